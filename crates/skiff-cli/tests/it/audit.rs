//! The audit trail as an operator takes it away: `skiff audit export` as JSON lines over a time
//! range, `skiff audit tail --follow` seeing a row as it is written, and every exported row of
//! a session that used a vault secret, a prompt and tool output holding none of them.

use crate::harness::{Gateway, stderr, stdout};
use skiff_protocol::audit::AuditRecord;
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

const SECRET: &str = "sk-audit-secret-4b1d9e07c3a2";
const PROMPT: &str = "PROMPT-MARK-zebra-crossing";
const TOOL_OUTPUT: &str = "TOOLOUT-42";
const COMPLETION: &str = "COMPLETION-MARK-all-done";

fn export(gw: &Gateway, args: &[&str]) -> Vec<AuditRecord> {
    let mut all = vec!["audit", "export"];
    all.extend_from_slice(args);
    let out = gw.run(&all);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn export_round_trips_the_rows_of_a_time_range_as_json_lines() {
    let gw = Gateway::start("[[turns]]\ntext = \"Hello.\"\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = gw.new_session(repo.path(), "fake/model", "hi");

    let today = export(&gw, &["--since", "1d", "--format", "jsonl"]);
    assert!(
        today
            .iter()
            .any(|r| r.action == "run.start" && r.detail["session"] == id.as_str()),
        "{today:?}"
    );
    // The same rows as `tail --json` shows, field for field (ids increasing).
    let tail_out = gw.run(&["audit", "tail", "--json", "-n", "1000"]);
    let tailed: Vec<AuditRecord> = stdout(&tail_out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(today, tailed);
    assert!(today.windows(2).all(|w| w[0].id < w[1].id));

    // --since after the last row: nothing; --until before the first: nothing; a date range
    // around today: everything.
    let last = today.last().unwrap().at_ms;
    let after_last = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(last as u64 + 1),
    )
    .to_string();
    assert!(export(&gw, &["--since", &after_last]).is_empty());
    assert!(export(&gw, &["--since", "1970-01-01", "--until", "1970-01-02"]).is_empty());
    let day = &after_last[..10];
    assert_eq!(export(&gw, &["--since", day]).len(), today.len());

    let bad = gw.run(&["audit", "export", "--since", "last tuesday"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        stderr(&bad).contains("\"last tuesday\" is not a date"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn tail_follow_prints_a_row_written_after_it_started() {
    let gw = Gateway::start("");
    let mut follow = gw
        .cli()
        .args(["audit", "tail", "--follow", "--json", "-n", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
    // The newest row before it (the admin token's minting, or a gateway-wide chore this
    // gateway took on as it started): it has read the trail.
    let first: AuditRecord =
        serde_json::from_str(&lines.next().expect("tail printed nothing").unwrap()).unwrap();
    assert!(
        matches!(first.action.as_str(), "token.mint" | "chore.take"),
        "{}",
        first.action
    );
    // A refused request is audited (`auth`, denied) with its route as the target.
    let refused = reqwest::blocking::Client::new()
        .get(format!("{}/v1/sessions/follow-me", gw.url))
        .bearer_auth("not-a-token")
        .send()
        .unwrap();
    assert_eq!(refused.status(), 401);
    let seen = loop {
        let line = lines.next().expect("tail --follow ended").unwrap();
        let row: AuditRecord = serde_json::from_str(&line).unwrap();
        if row.target == "/v1/sessions/follow-me" {
            break row;
        }
    };
    follow.kill().unwrap();
    follow.wait().unwrap();
    assert_eq!(
        (seen.action.as_str(), seen.decision.as_str()),
        ("auth", "denied")
    );
}

#[test]
fn no_exported_row_holds_a_secret_a_prompt_tool_output_or_a_completion() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut call = openai_sse::text_chunks(&["Running it."]);
    call.extend(openai_sse::tool_call(
        0,
        "call_1",
        "exec",
        r#"{"command":"echo TOOLOUT-$((6*7))"}"#,
        2,
    ));
    call.extend(openai_sse::finish("tool_calls"));
    call.extend(openai_sse::usage(100, 10));
    call.extend(openai_sse::done());
    let mut last = openai_sse::text_chunks(&[COMPLETION]);
    last.extend(openai_sse::finish("stop"));
    last.extend(openai_sse::usage(120, 10));
    last.extend(openai_sse::done());
    let fake = rt.block_on(FakeProvider::start(vec![
        FakeResponse::sse(call),
        FakeResponse::sse(last),
    ]));
    let config = format!(
        "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\napi_key = \"vault:openai\"\n",
        fake.base_url()
    );
    let gw = Gateway::start_full("", &config, &[]);
    let mut set = gw
        .cli()
        .args(["secret", "set", "openai"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    set.stdin
        .take()
        .unwrap()
        .write_all(SECRET.as_bytes())
        .unwrap();
    assert!(set.wait().unwrap().success());

    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = gw.new_session(repo.path(), "openai/gpt-fake", PROMPT);
    // The secret, the prompt and the tool's output were really used.
    let requests = fake.requests();
    assert_eq!(
        requests[0].header("authorization"),
        Some(format!("Bearer {SECRET}").as_str())
    );
    let second = String::from_utf8_lossy(&requests[1].body).into_owned();
    assert!(
        second.contains(PROMPT) && second.contains(TOOL_OUTPUT),
        "{second}"
    );
    let shown = stdout(&gw.run(&["session", "show", &id]));
    assert!(shown.contains(COMPLETION), "{shown}");

    let rows = export(&gw, &["--since", "1d"]);
    assert!(
        rows.iter().any(|r| r.action == "secret.set")
            && rows.iter().any(|r| r.detail["session"] == id.as_str()),
        "{rows:?}"
    );
    for row in &rows {
        let text = serde_json::to_string(row).unwrap();
        for needle in [SECRET, PROMPT, TOOL_OUTPUT, COMPLETION] {
            assert!(!text.contains(needle), "{needle} in an audit row: {text}");
        }
    }
}
