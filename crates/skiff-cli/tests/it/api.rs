use crate::harness::{Gateway, sandbox_shares, stderr};
use skiff_test_support::TempGitRepo;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;

const TWO_STEPS: &str = r#"
[[turns]]
text = "Listing."
[[turns.tool_calls]]
name = "ls"
arguments = {}

[[turns]]
text = "Done listing."
"#;

/// Reads SSE events (their JSON data) until the run ends.
fn read_sse_until_run_end(resp: reqwest::blocking::Response) -> Vec<serde_json::Value> {
    let mut events = Vec::new();
    for line in BufReader::new(resp).lines() {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            let event: serde_json::Value = serde_json::from_str(data).unwrap();
            let end = event["type"] == "run_status" && event["status"] == "succeeded";
            events.push(event);
            if end {
                break;
            }
        }
    }
    events
}

fn cursors(events: &[serde_json::Value]) -> Vec<u64> {
    events
        .iter()
        .map(|e| e["cursor"].as_u64().unwrap())
        .collect()
}

#[test]
fn the_event_stream_resumes_from_a_cursor_with_nothing_missing_or_doubled() {
    let gw = Gateway::start(TWO_STEPS);
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let id = gw.new_session(repo.path(), "fake/x", "list");
    let client = reqwest::blocking::Client::new();
    let url = format!("{}/v1/sessions/{id}/events", gw.url);

    let all = read_sse_until_run_end(
        client
            .get(format!("{url}?after=0"))
            .bearer_auth(&gw.token)
            .send()
            .unwrap(),
    );
    let expected: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(cursors(&all), expected, "cursors are dense and ordered");
    let kinds: Vec<&str> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
    for kind in [
        "run_status",
        "model_request",
        "text_delta",
        "tool_started",
        "tool_finished",
        "entry",
    ] {
        assert!(kinds.contains(&kind), "no {kind} event in {kinds:?}");
    }

    let resumed = read_sse_until_run_end(
        client
            .get(format!("{url}?after=5"))
            .bearer_auth(&gw.token)
            .send()
            .unwrap(),
    );
    assert_eq!(resumed, all[5..]);
    let by_header = read_sse_until_run_end(
        client
            .get(&url)
            .bearer_auth(&gw.token)
            .header("last-event-id", "5")
            .send()
            .unwrap(),
    );
    assert_eq!(by_header, all[5..]);

    // The WebSocket carries the same events.
    let ws_url = format!(
        "{}/v1/sessions/{id}/events/ws?after=5",
        gw.url.replace("http://", "ws://")
    );
    let mut request = tungstenite::client::IntoClientRequest::into_client_request(ws_url).unwrap();
    request.headers_mut().insert(
        "authorization",
        format!("Bearer {}", gw.token).parse().unwrap(),
    );
    let (mut socket, _) = tungstenite::connect(request).unwrap();
    let mut over_ws = Vec::new();
    while over_ws.len() < all.len() - 5 {
        let text = socket.read().unwrap().into_text().unwrap();
        over_ws.push(serde_json::from_str::<serde_json::Value>(&text).unwrap());
    }
    assert_eq!(over_ws, all[5..]);
}

#[test]
fn the_gateway_keeps_its_secrets_private_and_out_of_the_audit_log() {
    let gw = Gateway::start(TWO_STEPS);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&gw.state_dir), 0o700);
    assert_eq!(mode(&gw.state_dir.join("gateway.json")), 0o600);

    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let prompt = "a-very-distinctive-prompt-text";
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        prompt,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = reqwest::blocking::Client::new()
        .get(format!("{}/v1/sessions", gw.url))
        .bearer_auth("skf_bogus")
        .send()
        .unwrap();

    let store = gw.store();
    let rows = store.audit_rows().unwrap();
    let actions: Vec<&str> = rows.iter().map(|r| r.action.as_str()).collect();
    for action in ["token.mint", "session.create", "run.start", "auth"] {
        assert!(
            actions.contains(&action),
            "no {action} audit row in {actions:?}"
        );
    }
    let denied = rows.iter().find(|r| r.action == "auth").unwrap();
    assert_eq!(denied.decision, "denied");
    let dump = format!("{rows:?}");
    assert!(!dump.contains(prompt), "the audit log holds a prompt");
    assert!(
        !dump.contains(&gw.token) && !dump.contains("skf_bogus"),
        "the audit log holds a token"
    );

    // The database holds only the token's hash (SQLite's file and WAL, or PostgreSQL's rows).
    let bytes = gw.database_bytes();
    assert!(
        bytes
            .windows(b"token.mint".len())
            .any(|w| w == b"token.mint"),
        "the database's bytes were read"
    );
    assert!(
        !bytes
            .windows(gw.token.len())
            .any(|w| w == gw.token.as_bytes()),
        "the token is stored in plaintext"
    );
}

#[test]
fn a_run_active_when_the_gateway_dies_is_orphaned_on_restart() {
    let fifo_dir = tempfile::tempdir().unwrap();
    let fifo = fifo_dir.path().join("started");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let script = format!(
        "[[turns]]\ntext = \"Waiting.\"\n[[turns.tool_calls]]\nname = \"exec\"\narguments = {{ command = \"echo started > {}; sleep 300\" }}\n\n[[turns]]\ntext = \"Back.\"\n",
        fifo.display()
    );
    let mut gw = Gateway::start_with(&script, &sandbox_shares(fifo_dir.path()));
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let started = gw.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "wait",
    ]);
    let id = started["session"]["id"].as_str().unwrap().to_owned();
    // The command runs once it says so.
    let mut started = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut started)
        .unwrap();

    gw.crash_and_restart();

    let detail = gw.json(&["session", "show", &id, "--json"]);
    assert_eq!(detail["runs"][0]["status"], "orphaned");
    assert!(
        detail["runs"][0]["error"]
            .as_str()
            .unwrap()
            .contains("gateway stopped")
    );
    // The conversation survived, and the session takes the next turn.
    assert_eq!(detail["transcript"][0]["body"]["text"], "wait");
    let out = gw.run(&["session", "send", &id, "again"]);
    assert!(out.status.success(), "{}", stderr(&out));
}
