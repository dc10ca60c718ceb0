//! The scripted model: the built-in demo and user scripts.

use crate::{catalog, catalog_in, request, run, text, tool_calls};
use serde_json::json;
use skiff_llm::Catalog;
use skiff_protocol::model::{Message, ModelEvent, StopReason, ToolCall};
use tokio_util::sync::CancellationToken;

const SCRIPT: &str = r#"
[[turns]]
text = "I'll read the README first."
[[turns.tool_calls]]
name = "read"
arguments = { path = "README.md" }
[[turns.tool_calls]]
name = "ls"

[[turns]]
text = "Done reading."
"#;

fn script_catalog(script: &str) -> (tempfile::TempDir, Catalog) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fake.toml"), script).unwrap();
    // Relative: resolved against the configuration's directory.
    let catalog = catalog_in(
        "[fake]\napi = \"scripted\"\nscript = \"fake.toml\"\n",
        dir.path(),
    );
    (dir, catalog)
}

fn after_turns(turns: usize) -> skiff_protocol::model::ModelRequest {
    let mut request = request("fake/any");
    for _ in 0..turns {
        request.messages.push(Message::Assistant {
            reasoning: Vec::new(),
            text: "earlier".into(),
            tool_calls: vec![],
        });
        request.messages.push(Message::User {
            text: "go on".into(),
        });
    }
    request
}

#[tokio::test]
async fn first_turn_streams_words_then_tool_calls() {
    let (_dir, catalog) = script_catalog(SCRIPT);
    let events = run(&catalog, after_turns(0)).await;
    assert_eq!(text(&events), "I'll read the README first.");
    let deltas = events
        .iter()
        .filter(|e| matches!(e, ModelEvent::TextDelta { .. }))
        .count();
    assert_eq!(deltas, 5, "one chunk per word: {events:#?}");
    assert_eq!(
        tool_calls(&events),
        [
            ToolCall {
                id: "call_0_0".into(),
                name: "read".into(),
                arguments: json!({ "path": "README.md" }),
            },
            ToolCall {
                id: "call_0_1".into(),
                name: "ls".into(),
                arguments: json!({}),
            },
        ]
    );
    assert!(matches!(
        events[events.len() - 2],
        ModelEvent::Usage { usage } if usage.output_tokens > 0 && usage.input_tokens > 0
    ));
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::ToolUse
        })
    );
}

#[tokio::test]
async fn the_turn_is_the_number_of_assistant_messages() {
    let (_dir, catalog) = script_catalog(SCRIPT);
    let events = run(&catalog, after_turns(1)).await;
    assert_eq!(text(&events), "Done reading.");
    assert!(tool_calls(&events).is_empty());
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::EndTurn
        })
    );
    // Stateless: the same request replays the same turn.
    assert_eq!(run(&catalog, after_turns(1)).await, events);
}

#[tokio::test]
async fn an_exhausted_script_says_so() {
    let (_dir, catalog) = script_catalog(SCRIPT);
    let events = run(&catalog, after_turns(2)).await;
    assert_eq!(
        text(&events),
        "The scripted model has no more turns in its script."
    );
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::EndTurn
        })
    );
}

#[tokio::test]
async fn cancellation_is_honoured_between_chunks() {
    // Played to the end this turn takes 40 s, twice `collect`'s limit.
    let words = (0..40)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let (_dir, catalog) = script_catalog(&format!(
        "chunk_delay_ms = 1000\n[[turns]]\ntext = \"{words}\"\n"
    ));
    let cancel = CancellationToken::new();
    let stream = catalog.stream(after_turns(0), None, cancel.clone());
    let events = crate::collect_cancelling_after_first(stream, cancel).await;
    let text = text(&events);
    assert!(text.starts_with("w0") && !text.contains("w39"), "{text}");
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::Cancelled
        })
    );
}

#[tokio::test]
async fn built_in_demo_plays_without_configuration() {
    let catalog = catalog("");
    let model = catalog.resolve(None).unwrap();
    let mut request = request(model.as_str());
    request.model = model;
    let events = run(&catalog, request).await;
    assert!(!text(&events).is_empty());
    assert!(matches!(events.last(), Some(ModelEvent::Done { .. })));
}
