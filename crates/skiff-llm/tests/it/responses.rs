//! `api = "openai-responses"` against the fake provider.

use crate::transport::Wire;
use crate::{collect, request, run, text, tool_calls};
use serde_json::{Value, json};
use skiff_llm::CacheKey;
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, Reasoning, ReasoningEffort, StopReason, Usage,
};
use skiff_test_support::openai_responses_sse::Response;
use skiff_test_support::{FakeProvider, FakeResponse};
use tokio_util::sync::CancellationToken;

const RESPONSES: Wire = Wire {
    provider: "openai",
    api: "openai-responses",
    model: "openai/gpt-5",
    hello,
    partial,
    error_body,
    key_header: "authorization",
    key_value: bearer,
};

fn hello() -> Vec<String> {
    Response::new()
        .message(&["Hello", " world"])
        .completed(10, 2, 0)
}

fn partial() -> Vec<String> {
    Response::new().message_unfinished(&["Hello"]).unfinished()
}

fn error_body(message: &str) -> String {
    json!({ "error": { "message": message, "type": "invalid_request_error", "param": null, "code": null } })
        .to_string()
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

crate::transport_tests!(RESPONSES);

/// Encrypted reasoning as the API returns it: base64 with `+`, `/` and `=`, which must come back
/// exactly as sent.
const ENCRYPTED: &str = "gAAAAABo9+Xk/enc+rypted//content==";

/// The provider with `gpt-5` set to reason hard, as skiff.toml would describe it.
const REASONING: &str = "[openai.models.\"gpt-5\"]\nreasoning = \"high\"";

async fn stream(events: Vec<String>) -> Vec<ModelEvent> {
    let fake = FakeProvider::start(vec![FakeResponse::sse(events)]).await;
    run(
        &RESPONSES.catalog(&fake.base_url(), ""),
        request(RESPONSES.model),
    )
    .await
}

fn sent_body(fake: &FakeProvider, n: usize) -> Value {
    serde_json::from_slice(&fake.requests()[n].body).unwrap()
}

#[tokio::test]
async fn text_usage_and_stop_reason() {
    let events = stream(hello()).await;
    assert_eq!(
        events,
        [
            ModelEvent::TextDelta {
                text: "Hello".into()
            },
            ModelEvent::TextDelta {
                text: " world".into()
            },
            ModelEvent::Usage {
                usage: Usage {
                    input_tokens: 10,
                    output_tokens: 2,
                    ..Usage::default()
                }
            },
            ModelEvent::Done {
                stop_reason: StopReason::EndTurn
            },
        ]
    );
}

#[tokio::test]
async fn request_goes_to_responses_with_a_stateless_streaming_body() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    let catalog = RESPONSES.catalog(&format!("{}/v1/", fake.base_url()), "");
    run(&catalog, request(RESPONSES.model)).await;
    assert_eq!(fake.requests()[0].path, "/v1/responses");
    let body = sent_body(&fake, 0);
    assert_eq!(body["model"], "gpt-5");
    assert_eq!(body["stream"], true);
    assert_eq!(body["store"], false);
    assert_eq!(body["max_output_tokens"], 4096);
    assert_eq!(body["instructions"], "You are a careful coding agent.");
    assert_eq!(
        body["input"],
        json!([{
            "type": "message",
            "role": "user",
            "content": [{ "type": "input_text", "text": "What is in this repository?" }],
        }])
    );
    assert_eq!(body["tools"][0]["type"], "function");
    assert_eq!(body["tools"][0]["name"], "read");
    assert_eq!(body["tools"][0]["strict"], false);
    // Reasoning is not asked of a model nobody said reasons, nor cache routing without a key.
    assert_eq!(body.get("reasoning"), None);
    assert_eq!(body.get("include"), None);
    assert_eq!(body.get("prompt_cache_key"), None);
}

#[tokio::test]
async fn the_gateways_cache_key_becomes_prompt_cache_key() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    let catalog = RESPONSES.catalog(&fake.base_url(), "");
    let key = CacheKey::for_conversation("ses_a");
    collect(catalog.stream(
        request(RESPONSES.model),
        Some(key.clone()),
        CancellationToken::new(),
    ))
    .await;
    assert_eq!(sent_body(&fake, 0)["prompt_cache_key"], key.as_str());
}

#[tokio::test]
async fn a_tool_turn_sends_the_models_reasoning_back_unchanged() {
    let first = Response::new()
        .reasoning(
            "rs_1",
            &["**Planning**", "Read the README first."],
            Some(ENCRYPTED),
        )
        .function_call("call_1", "read", r#"{"path":"README.md"}"#, 4)
        .completed(120, 40, 0);
    let second = Response::new()
        .message(&["It is a Rust workspace."])
        .completed(180, 9, 0);
    let fake = FakeProvider::start(vec![FakeResponse::sse(first), FakeResponse::sse(second)]).await;
    let catalog = RESPONSES.catalog(&fake.base_url(), REASONING);

    let events = run(&catalog, request(RESPONSES.model)).await;
    let summary: String = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ReasoningDelta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(summary, "**Planning**\n\nRead the README first.");
    let reasoning: Vec<Reasoning> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::Reasoning { reasoning } => Some(reasoning.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        reasoning,
        [Reasoning::OpenaiReasoning {
            id: "rs_1".into(),
            summary: vec!["**Planning**".into(), "Read the README first.".into()],
            encrypted_content: Some(ENCRYPTED.into()),
        }]
    );
    let calls = tool_calls(&events);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].id, "call_1");
    assert_eq!(calls[0].arguments, json!({ "path": "README.md" }));
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::ToolUse
        })
    );

    let mut next = request(RESPONSES.model);
    next.messages.push(Message::Assistant {
        text: String::new(),
        tool_calls: calls,
        reasoning,
    });
    next.messages.push(Message::ToolResult {
        call_id: "call_1".into(),
        name: "read".into(),
        content: "# skiff".into(),
        is_error: false,
        images: Vec::new(),
    });
    let events = run(&catalog, next).await;
    assert_eq!(text(&events), "It is a Rust workspace.");

    let asked = sent_body(&fake, 0);
    assert_eq!(
        asked["reasoning"],
        json!({ "effort": "high", "summary": "auto" })
    );
    assert_eq!(asked["include"], json!(["reasoning.encrypted_content"]));
    let body = sent_body(&fake, 1);
    assert_eq!(
        body["input"],
        json!([
            {
                "type": "message",
                "role": "user",
                "content": [{ "type": "input_text", "text": "What is in this repository?" }],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [
                    { "type": "summary_text", "text": "**Planning**" },
                    { "type": "summary_text", "text": "Read the README first." },
                ],
                "encrypted_content": ENCRYPTED,
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "read",
                "arguments": r#"{"path":"README.md"}"#,
            },
            { "type": "function_call_output", "call_id": "call_1", "output": "# skiff" },
        ])
    );
    // Byte for byte, not merely equal once decoded.
    let raw = String::from_utf8(fake.requests()[1].body.clone()).unwrap();
    assert!(
        raw.contains(&format!("\"encrypted_content\":\"{ENCRYPTED}\"")),
        "{raw}"
    );
}

#[tokio::test]
async fn reasoning_off_for_the_session_overrides_the_model() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    let catalog = RESPONSES.catalog(&fake.base_url(), REASONING);
    let mut request = request(RESPONSES.model);
    request.reasoning = Some(ReasoningEffort::Off);
    run(&catalog, request).await;
    let body = sent_body(&fake, 0);
    assert_eq!(body.get("reasoning"), None);
    assert_eq!(body.get("include"), None);
}

#[tokio::test]
async fn cached_input_tokens_are_read_from_the_completed_response() {
    let events = stream(Response::new().message(&["Hi"]).completed(3000, 12, 2816)).await;
    assert_eq!(
        events[events.len() - 2],
        ModelEvent::Usage {
            usage: Usage {
                input_tokens: 3000,
                output_tokens: 12,
                cache_read_tokens: 2816,
                cache_write_tokens: 0,
            }
        }
    );
}

#[tokio::test]
async fn hitting_max_output_tokens_stops_with_max_tokens() {
    let events = stream(
        Response::new()
            .message(&["Hel"])
            .incomplete("max_output_tokens", 10, 3),
    )
    .await;
    assert_eq!(text(&events), "Hel");
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::MaxTokens
        })
    );
}

#[tokio::test]
async fn a_failed_response_is_an_error_with_the_providers_message() {
    let events = stream(
        Response::new()
            .message_unfinished(&["Hel"])
            .failed("server_error", "The model had a problem"),
    )
    .await;
    let (kind, message) = crate::error(&events);
    assert_eq!(kind, ModelErrorKind::ProviderFailed);
    assert!(
        message.starts_with("provider `openai` failed mid-response: The model had a problem"),
        "{message}"
    );

    let events = stream(Response::new().failed("rate_limit_exceeded", "Rate limit reached")).await;
    let (kind, message) = crate::error(&events);
    assert_eq!(kind, ModelErrorKind::RateLimited);
    assert!(message.contains("Rate limit reached"), "{message}");
}

#[tokio::test]
async fn an_error_event_is_reported_as_rejected() {
    let events = stream(Response::new().error(
        "context_length_exceeded",
        "Your input exceeds the context window of this model.",
    ))
    .await;
    let (kind, message) = crate::error(&events);
    assert_eq!(kind, ModelErrorKind::Rejected);
    assert_eq!(
        message,
        "provider `openai` rejected the request mid-response: Your input exceeds the context window of this model. (context_length_exceeded)"
    );
}

#[tokio::test]
async fn the_api_key_never_appears_in_a_stream_failure() {
    let key = crate::transport::env_key();
    let fake = FakeProvider::start(vec![FakeResponse::sse(
        Response::new().failed("invalid_request_error", &format!("bad key {key}")),
    )])
    .await;
    let catalog = RESPONSES.catalog(&fake.base_url(), "api_key_env = \"PATH\"");
    let events = run(&catalog, request(RESPONSES.model)).await;
    let (_, message) = crate::error(&events);
    assert!(!message.contains(&key), "{message}");
    assert!(message.contains("bad key [redacted]"), "{message}");
}
