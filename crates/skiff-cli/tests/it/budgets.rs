//! Token and cost budgets as an operator meets them: a real gateway with `[budgets]`, a fake
//! OpenAI-compatible provider that reports usage, and the CLI. An exhausted budget refuses the
//! next model call before the provider is asked, and says which budget, how much and how to
//! raise it; `session show` and `admin usage` show usage against each budget.

use crate::harness::{Gateway, stderr, stdout};
use serde_json::Value;
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// A final reply that reports `prompt` + `completion` tokens.
fn reply(text: &str, prompt: u64, completion: u64) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&[text]);
    events.extend(openai_sse::finish("stop"));
    events.extend(openai_sse::usage(prompt, completion));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

/// A reply that calls `ls` and reports `prompt` + `completion` tokens.
fn ls_call(prompt: u64, completion: u64) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&["Looking."]);
    events.extend(openai_sse::tool_call(0, "call_1", "ls", "{}", 1));
    events.extend(openai_sse::finish("tool_calls"));
    events.extend(openai_sse::usage(prompt, completion));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

fn provider(fake: &FakeProvider) -> String {
    format!(
        "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\n\
         [providers.openai.prices.\"gpt-fake\"]\ninput = 2.5\noutput = 10.0\n",
        fake.base_url()
    )
}

/// `session new` to the end of its first turn, whatever its outcome; the session id.
fn start_session(gw: &Gateway, repo: &TempGitRepo, prompt: &str) -> (String, std::process::Output) {
    let out = gw.run(&[
        "session",
        "new",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "openai/gpt-fake",
        prompt,
    ]);
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    (first["session_id"].as_str().unwrap().to_owned(), out)
}

#[test]
fn a_session_budget_exhausted_mid_turn_refuses_the_next_model_call_and_says_how_to_raise_it() {
    let rt = runtime();
    // The first call uses 3100 tokens of 3000 and asks for a tool; the call after the tool's
    // result is refused. The second response is never served.
    let fake = rt.block_on(FakeProvider::start(vec![
        ls_call(3000, 100),
        reply("Never sent.", 10, 10),
    ]));
    let config = format!("{}[budgets]\nsession_tokens = 3000\n", provider(&fake));
    let gw = Gateway::start_full("", &config, &[]);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (id, out) = start_session(&gw, &repo, "look around");
    assert!(
        !out.status.success(),
        "the turn should fail: {}",
        stdout(&out)
    );
    assert_eq!(
        fake.requests().len(),
        1,
        "the provider was asked after the budget ran out"
    );

    let detail = gw.json(&["session", "show", "--json", &id]);
    let run = &detail["runs"][0];
    assert_eq!(run["status"], "failed");
    let error = run["error"].as_str().unwrap();
    assert!(
        error.contains("budget exhausted")
            && error.contains("`budgets.session_tokens`")
            && error.contains("used 3100 tokens")
            && error.contains("the limit is 3000 tokens")
            && error.contains("skiff.toml"),
        "{error}"
    );
    // Nothing lost: the call, its result, then the notice.
    let kinds: Vec<&str> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["body"]["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["user_message", "assistant_message", "tool_result", "notice"],
        "{detail}"
    );
    let notice = detail["transcript"][3]["body"]["text"].as_str().unwrap();
    assert!(notice.contains("`budgets.session_tokens`"), "{notice}");
    let session_line = &detail["usage"][0];
    assert_eq!(session_line["subject"], "session");
    assert_eq!(session_line["tokens"], 3100);
    assert_eq!(session_line["tokens_limit"], 3000);
    assert_eq!(session_line["exhausted"], true);

    let shown = stdout(&gw.run(&["session", "show", &id]));
    let line = shown
        .lines()
        .find(|l| l.starts_with("budgets "))
        .unwrap_or_else(|| panic!("no budgets line: {shown}"));
    assert!(
        line.contains(&format!("session {id}: 3100 of 3000 tokens"))
            && line.contains("(exhausted)"),
        "{line}"
    );

    // A message sent now is refused the same way, still without asking the provider.
    let out = gw.run(&["session", "send", &id, "go on"]);
    assert!(!out.status.success());
    assert_eq!(fake.requests().len(), 1);
}

#[test]
fn a_users_daily_budget_spans_sessions_and_admin_usage_reports_it() {
    let rt = runtime();
    let fake = rt.block_on(FakeProvider::start(vec![
        reply("Done.", 900, 200),
        reply("Never sent.", 10, 10),
    ]));
    let config = format!(
        "{}[budgets]\nuser_tokens_per_day = 1000\nsession_cost_usd = 5.0\n",
        provider(&fake)
    );
    let gw = Gateway::start_full("", &config, &[]);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (first, out) = start_session(&gw, &repo, "one");
    assert!(out.status.success(), "{}", stderr(&out));

    // Another session of the same user, the same day: its first call is refused.
    let (second, out) = start_session(&gw, &repo, "two");
    assert!(!out.status.success());
    assert_eq!(fake.requests().len(), 1);
    let detail = gw.json(&["session", "show", "--json", &second]);
    let error = detail["runs"][0]["error"].as_str().unwrap();
    assert!(
        error.contains("`budgets.user_tokens_per_day`")
            && error.contains("user usr_admin used 1100 tokens on ")
            && error.contains("wait for the next UTC day"),
        "{error}"
    );

    let report = gw.json(&["admin", "usage", "--json"]);
    let day = report["day"].as_str().unwrap().to_owned();
    let lines = report["lines"].as_array().unwrap();
    let find = |subject: &str| {
        lines
            .iter()
            .find(|l| l["subject"] == subject)
            .unwrap_or_else(|| panic!("no {subject} line: {report}"))
    };
    let user = find("user");
    assert_eq!(
        (
            &user["id"],
            &user["window"],
            &user["tokens"],
            &user["tokens_limit"],
            &user["exhausted"]
        ),
        (
            &Value::from("usr_admin"),
            &Value::from(day.clone()),
            &Value::from(1100),
            &Value::from(1000),
            &Value::from(true)
        ),
        "{report}"
    );
    // 900 × 2.5 + 200 × 10 per million = $0.00425.
    assert!(
        (user["cost_usd"].as_f64().unwrap() - 0.00425).abs() < 1e-9,
        "{report}"
    );
    let tenant = find("tenant");
    assert_eq!(
        (&tenant["id"], &tenant["tokens"]),
        (&Value::from("ten_default"), &Value::from(1100))
    );
    assert_eq!(
        tenant.get("tokens_limit"),
        None,
        "no tenant budget is configured"
    );
    let session = find("session");
    assert_eq!(
        (
            &session["id"],
            &session["window"],
            &session["cost_usd_limit"],
            &session["exhausted"]
        ),
        (
            &Value::from(first.clone()),
            &Value::from("session"),
            &Value::from(5.0),
            &Value::from(false)
        ),
        "{report}"
    );
    // The refused session used nothing and has no line.
    assert!(
        !lines.iter().any(|l| l["id"] == second.as_str()),
        "{report}"
    );

    let text = stdout(&gw.run(&["admin", "usage"]));
    let user_line = text
        .lines()
        .find(|l| l.starts_with("user "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        user_line.starts_with(&format!(
            "user usr_admin on {day}: 1100 of 1000 tokens · $0.004"
        )) && user_line.ends_with("(exhausted)"),
        "{text}"
    );
}

#[test]
fn a_bad_budget_fails_the_gateway_start_naming_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(&config, "[budgets]\ntenant_cost_usd_per_day = -3.0\n").unwrap();
    let out = std::process::Command::new(crate::harness::SKIFF)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("`budgets.tenant_cost_usd_per_day`"), "{err}");
}
