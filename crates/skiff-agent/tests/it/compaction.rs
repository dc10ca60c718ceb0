//! The loop compacts when a step's results push the context past its share of the window,
//! goes on from the summary, and fails the turn cleanly when the compaction call fails.

use crate::turn::{Memory, backend_with_prompt, config, final_turn, kinds, tool_turn};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::json;
use skiff_agent::tools::Tools;
use skiff_agent::{AgentConfig, ModelClient, TurnOutcome, run_turn};
use skiff_protocol::model::{Message, ModelErrorKind, ModelEvent, ModelRequest};
use skiff_protocol::transcript::EntryBody;
use std::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// Answers a request without tools (a compaction) with `summary`, or an error when it is
/// `None`; other requests get the next of `steps`. Every request is kept.
struct Recording {
    steps: Mutex<Vec<Vec<ModelEvent>>>,
    summary: Option<&'static str>,
    requests: Mutex<Vec<ModelRequest>>,
}

impl ModelClient for Recording {
    fn stream(
        &self,
        request: ModelRequest,
        _cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        let compaction = request.tools.is_empty();
        self.requests.lock().unwrap().push(request);
        let events = match (compaction, self.summary) {
            (true, Some(summary)) => final_turn(summary),
            (true, None) => vec![ModelEvent::Error {
                kind: ModelErrorKind::ProviderFailed,
                message: "provider said 529 overloaded".into(),
            }],
            (false, _) => self.steps.lock().unwrap().remove(0),
        };
        stream::iter(events).boxed()
    }
}

/// A window the tool specs and system prompt fit in (≈2k tokens), but not with an 8 KB file.
fn small_window() -> AgentConfig {
    AgentConfig {
        context_window: 4_000,
        ..config()
    }
}

fn workspace_with_big_file() -> (tempfile::TempDir, Tools) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("big.txt"), "BIG-LINE\n".repeat(1_000)).unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    (dir, tools)
}

#[tokio::test]
async fn a_step_that_crosses_the_window_is_followed_by_one_compaction_and_the_turn_finishes() {
    let (_dir, tools) = workspace_with_big_file();
    let model = Recording {
        steps: Mutex::new(vec![
            tool_turn(&[("read", json!({"path": "big.txt"}))]),
            final_turn("done"),
        ]),
        summary: Some("SUMMARY: read big.txt"),
        requests: Mutex::default(),
    };
    let memory: Memory = backend_with_prompt();
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &small_window(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, TurnOutcome::Completed);
    assert_eq!(
        kinds(&memory),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "compaction",
            "assistant_message"
        ]
    );
    let entries = memory.entries.lock().unwrap();
    let EntryBody::Compaction {
        files,
        request,
        entries: replaced,
        ..
    } = &entries[3].body
    else {
        unreachable!()
    };
    assert_eq!(files, &["big.txt"]);
    assert_eq!(request.as_deref(), Some("go"));
    assert_eq!(*replaced, 3);

    let requests = model.requests.lock().unwrap();
    assert_eq!(requests.len(), 3, "step, compaction, step");
    let Message::User { text } = &requests[1].messages[0] else {
        panic!("the compaction call asks in one user message")
    };
    assert!(
        text.contains("BIG-LINE") && text.contains("## User\ngo"),
        "{text}"
    );
    let after = &requests[2].messages;
    assert_eq!(after.len(), 1, "{after:?}");
    let Message::User { text } = &after[0] else {
        panic!("{after:?}")
    };
    assert!(
        text.contains("SUMMARY: read big.txt")
            && text.contains("- big.txt")
            && text.ends_with("go"),
        "{text}"
    );
}

#[tokio::test]
async fn a_failed_compaction_fails_the_turn_with_a_notice_and_writes_no_summary() {
    let (_dir, tools) = workspace_with_big_file();
    let model = Recording {
        steps: Mutex::new(vec![tool_turn(&[("read", json!({"path": "big.txt"}))])]),
        summary: None,
        requests: Mutex::default(),
    };
    let memory = backend_with_prompt();
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &small_window(),
        &CancellationToken::new(),
    )
    .await;
    let TurnOutcome::Failed(why) = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        why.contains("could not be compacted") && why.contains("529 overloaded"),
        "{why}"
    );
    assert_eq!(
        kinds(&memory),
        ["user_message", "assistant_message", "tool_result", "notice"]
    );
}
