//! Integration tests of skiff-llm: the HTTP adapters against the fake provider, the scripted
//! model, and the catalog. Every stream is checked to end with exactly one terminal event.

// clippy.toml allows these in `#[test]` functions only; the helpers here are test code too.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test on the spot"
)]

mod anthropic;
mod catalog;
mod openai;
mod responses;
mod scripted;
mod transport;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde_json::json;
use skiff_llm::{Catalog, ProviderConfig};
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, ModelRef, ModelRequest, ToolCall, ToolSpec,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A catalog from the body of a skiff.toml `[providers]` section, as the gateway builds it.
pub fn catalog_in(providers_toml: &str, config_dir: &Path) -> Catalog {
    let providers: BTreeMap<String, ProviderConfig> = toml::from_str(providers_toml).unwrap();
    Catalog::new(providers, None, config_dir, None).unwrap()
}

pub fn catalog(providers_toml: &str) -> Catalog {
    catalog_in(providers_toml, Path::new("/nonexistent"))
}

pub fn request(model: &str) -> ModelRequest {
    ModelRequest {
        reasoning: None,
        model: ModelRef::parse(model).unwrap(),
        system: "You are a careful coding agent.".into(),
        messages: vec![Message::User {
            text: "What is in this repository?".into(),
        }],
        tools: vec![ToolSpec {
            name: "read".into(),
            description: "Read a file".into(),
            parameters: json!({ "type": "object", "properties": { "path": { "type": "string" } } }),
        }],
        max_output_tokens: 4096,
    }
}

/// Runs `request` to the end of its stream (failing after 20 s rather than hanging).
pub async fn run(catalog: &Catalog, request: ModelRequest) -> Vec<ModelEvent> {
    collect(catalog.stream(request, None, CancellationToken::new())).await
}

pub async fn collect(stream: BoxStream<'static, ModelEvent>) -> Vec<ModelEvent> {
    let events = tokio::time::timeout(Duration::from_secs(20), stream.collect::<Vec<_>>())
        .await
        .expect("the stream did not end within 20s");
    assert_ends_once(&events);
    events
}

/// Reads the first event, cancels, and collects the rest: a stream that ignored the cancel would
/// play on past `collect`'s limit.
pub async fn collect_cancelling_after_first(
    mut stream: BoxStream<'static, ModelEvent>,
    cancel: tokio_util::sync::CancellationToken,
) -> Vec<ModelEvent> {
    let first = stream
        .next()
        .await
        .expect("the stream ended before its first event");
    cancel.cancel();
    let mut events = vec![first];
    events.extend(collect(stream).await);
    assert_ends_once(&events);
    events
}

pub fn assert_ends_once(events: &[ModelEvent]) {
    let terminal = |e: &ModelEvent| matches!(e, ModelEvent::Done { .. } | ModelEvent::Error { .. });
    assert_eq!(
        events.iter().filter(|e| terminal(e)).count(),
        1,
        "expected exactly one Done or Error: {events:#?}"
    );
    assert!(
        events.last().is_some_and(terminal),
        "the terminal event must come last: {events:#?}"
    );
}

pub fn text(events: &[ModelEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::TextDelta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

pub fn tool_calls(events: &[ModelEvent]) -> Vec<ToolCall> {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ToolCall { call } => Some(call.clone()),
            _ => None,
        })
        .collect()
}

/// The stream's error; panics if it ended otherwise.
pub fn error(events: &[ModelEvent]) -> (ModelErrorKind, String) {
    match events.last() {
        Some(ModelEvent::Error { kind, message }) => (*kind, message.clone()),
        other => panic!("expected an error, got {other:?} in {events:#?}"),
    }
}

/// `request(model)` after the model read an image: its call, then the result with the image.
pub fn image_request(model: &str) -> ModelRequest {
    let mut request = request(model);
    request.system.clear();
    request.tools.clear();
    request.messages.extend([
        Message::Assistant {
            reasoning: Vec::new(),
            text: String::new(),
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "read".into(),
                arguments: json!({ "path": "shot.png" }),
            }],
        },
        Message::ToolResult {
            call_id: "call_1".into(),
            name: "read".into(),
            content: "image: shot.png, 64×48 PNG, 6 KiB".into(),
            is_error: false,
            images: vec![skiff_protocol::model::Image {
                media_type: "image/png".into(),
                data_base64: "iVBORw0KGgo=".into(),
            }],
        },
    ]);
    request
}

/// A request body as a person reads it (pretty JSON), for snapshots.
pub fn pretty(body: &[u8]) -> String {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    serde_json::to_string_pretty(&value).unwrap()
}
