//! `--reasoning` and a model's thinking as a person sees them, and as the provider gets them
//! back from either placement, with a fake Anthropic server.

use crate::harness::{Gateway, SKIFF, stderr, stdout};
use crate::worker::Rig;
use serde_json::Value;
use skiff_test_support::anthropic_sse::{
    message_delta, message_start, message_stop, redacted_thinking_block, text_block,
    thinking_block, tool_use_block,
};
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo};
use std::process::Command;

const THOUGHT: [&str; 3] = [
    "The user wants \"README.md\" — ",
    "é, \\ and ",
    "a newline\n",
];
const SIGNATURE: &str = "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+Ggx/Bdjrk=";
const REDACTED: &str = "EmwKAhgBEgy3va3pzix/LafPsn4a==";
const CLAUDE: &str =
    "[providers.claude]\napi = \"anthropic-messages\"\nbase_url = \"{fake_url}\"\n";

fn thinks_then_reads() -> FakeResponse {
    FakeResponse::sse(
        [
            message_start(30),
            thinking_block(0, &THOUGHT, SIGNATURE),
            redacted_thinking_block(1, REDACTED),
            tool_use_block(2, "toolu_1", "read", r#"{"path":"README.md"}"#, 2),
            message_delta("tool_use", 40),
            message_stop(),
        ]
        .concat(),
    )
}

fn answers(text: &str) -> FakeResponse {
    FakeResponse::sse(
        [
            message_start(30),
            text_block(0, &[text]),
            message_delta("end_turn", 5),
            message_stop(),
        ]
        .concat(),
    )
}

#[test]
fn an_unknown_reasoning_effort_is_a_usage_error_naming_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    for command in [
        &["session", "new", "--reasoning", "extreme", "hi"][..],
        &["session", "send", "--reasoning", "max", "ses_x", "hi"][..],
    ] {
        let out = Command::new(SKIFF)
            .arg("--state-dir")
            .arg(dir.path())
            .args(command)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("is not a reasoning effort; use off, low, medium or high"),
            "{err}"
        );
    }
}

#[test]
fn thinking_shows_as_one_line_with_its_duration_and_a_marker_in_show() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let fake = rt.block_on(FakeProvider::start(vec![
        thinks_then_reads(),
        answers("It is a repo."),
    ]));
    let config = CLAUDE.replace("{fake_url}", &fake.base_url());
    let gw = Gateway::start_full("", &config, &[]);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let out = gw.run(&[
        "session",
        "new",
        "--reasoning",
        "high",
        "--model",
        "claude/claude-sonnet-4-5",
        "--workspace",
        repo.path().to_str().unwrap(),
        "What is this?",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // One line on stderr for the thinking, with how long; the thinking itself is not printed.
    let err = stderr(&out);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("thinking… "))
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].ends_with(" ms") || lines[0].ends_with(" s"),
        "{err}"
    );
    assert!(!err.contains("The user wants"), "{err}");
    assert!(!stdout(&out).contains("The user wants"), "{}", stdout(&out));
    assert!(stdout(&out).contains("It is a repo."), "{}", stdout(&out));

    let body: Value = serde_json::from_slice(&fake.requests()[0].body).unwrap();
    assert_eq!(body["thinking"]["budget_tokens"], 24_576);

    let list = gw.json(&["session", "list", "--json"]);
    let id = list["sessions"][0]["id"].as_str().unwrap().to_owned();
    let show = stdout(&gw.run(&["session", "show", &id]));
    assert!(show.contains("\nreasoning  high\n"), "{show}");
    let chars = THOUGHT.concat().chars().count();
    assert!(
        show.contains(&format!("  · thinking ({chars} chars, 1 redacted)\n")),
        "{show}"
    );
    let detail = gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["session"]["reasoning"], "high");
}

/// The request bodies' `messages` and `thinking`, which both placements must send alike (the
/// tool lists differ: only a gateway session may dispatch).
fn conversation(body: &[u8]) -> (Value, Value, Value) {
    let body: Value = serde_json::from_slice(body).unwrap();
    (
        body["messages"].clone(),
        body["thinking"].clone(),
        body["max_tokens"].clone(),
    )
}

#[test]
fn a_worker_session_sends_thinking_back_exactly_as_a_local_one_does() {
    let rig = Rig::start(
        vec![
            thinks_then_reads(),
            answers("Done."),
            thinks_then_reads(),
            answers("Done."),
        ],
        CLAUDE,
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let args = |profile: Option<&'static str>| {
        let mut args = vec![
            "new",
            "--json",
            "--reasoning",
            "medium",
            "--model",
            "claude/claude-sonnet-4-5",
            "--workspace",
            repo.path().to_str().unwrap(),
        ];
        if let Some(profile) = profile {
            args.extend(["--profile", profile]);
        }
        args.push("Read the README");
        args
    };
    let local = rig.session(&args(None));
    assert!(local.status.success(), "{}", stderr(&local));
    let worker = rig.session(&args(Some("local")));
    assert!(worker.status.success(), "{}", stderr(&worker));

    // The worker session's thinking streamed to its follower too.
    let deltas: Vec<String> = stdout(&worker)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["type"] == "reasoning_delta")
        .map(|e| e["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(deltas, THOUGHT);

    let requests = rig.fake.requests();
    assert_eq!(requests.len(), 4);
    assert_eq!(
        conversation(&requests[1].body),
        conversation(&requests[3].body),
        "the thinking went back differently from the worker"
    );
    let quoted = |s: &str| Value::from(s).to_string();
    let replayed = format!(
        r#"{{"content":[{{"signature":{},"thinking":{},"type":"thinking"}},{{"data":{},"type":"redacted_thinking"}},{{"id":"toolu_1""#,
        quoted(SIGNATURE),
        quoted(&THOUGHT.concat()),
        quoted(REDACTED)
    );
    let worker_body = String::from_utf8_lossy(&requests[3].body);
    assert!(worker_body.contains(&replayed), "{worker_body}");
    assert_eq!(conversation(&requests[3].body).1["budget_tokens"], 8192);
}
