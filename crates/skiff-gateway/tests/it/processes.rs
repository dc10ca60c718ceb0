//! Background processes of gateway-placed sessions: `keep` lives on between turns, the rest
//! ends with its turn.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::transcript::EntryBody;

const SCRIPT: &str = r#"
[[turns]]
text = "Starting a server I keep and a watcher I do not."
[[turns.tool_calls]]
name = "process"
arguments = { action = "start", command = "sleep 300", keep = true }
[[turns.tool_calls]]
name = "process"
arguments = { action = "start", command = "sleep 301" }

[[turns]]
text = "Both started."

[[turns]]
text = "What is still running?"
[[turns.tool_calls]]
name = "process"
arguments = { action = "status" }

[[turns]]
text = "Checked."
"#;

#[tokio::test]
async fn a_kept_process_of_a_gateway_session_outlives_its_turn_and_the_others_do_not() {
    let gw = TestGateway::start(SCRIPT).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "start them"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    let first = gw.client.follow_until_run_end(&id, 0).await;
    gw.client.send_message(&id, "check").await.unwrap();
    gw.client
        .follow_until_run_end(&id, first.last().unwrap().cursor)
        .await;

    let detail = gw.client.session(&id).await.unwrap();
    let status = detail
        .transcript
        .iter()
        .filter_map(|e| match &e.body {
            EntryBody::ToolResult { name, content, .. } if name == "process" => Some(content),
            _ => None,
        })
        .next_back()
        .unwrap();
    assert!(
        status.starts_with("process 1 running for ")
            && status.ends_with("(kept across turns): sleep 300"),
        "the kept server is not running in the next turn: {status}"
    );
    assert!(
        !status.contains("sleep 301"),
        "the watcher outlived its turn: {status}"
    );
    gw.shutdown().await;
}
