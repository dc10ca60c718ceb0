//! `api = "openai-completions"` against the fake provider.

use crate::transport::Wire;
use crate::{collect, request, run, tool_calls};
use serde_json::{Value, json};
use skiff_llm::CacheKey;
use skiff_protocol::model::{ModelErrorKind, ModelEvent, StopReason, Usage};
use skiff_test_support::openai_sse::{done, finish, text_chunks, tool_call, usage, usage_cached};
use skiff_test_support::{FakeProvider, FakeResponse};
use tokio_util::sync::CancellationToken;

const OPENAI: Wire = Wire {
    provider: "openai",
    api: "openai-completions",
    model: "openai/gpt-4o-mini",
    hello,
    partial,
    error_body,
    key_header: "authorization",
    key_value: bearer,
};

fn hello() -> Vec<String> {
    [
        text_chunks(&["Hello", " world"]),
        finish("stop"),
        usage(10, 2),
        done(),
    ]
    .concat()
}

fn partial() -> Vec<String> {
    text_chunks(&["Hello"])
}

fn error_body(message: &str) -> String {
    json!({ "error": { "message": message, "type": "invalid_request_error", "param": null, "code": null } })
        .to_string()
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

crate::transport_tests!(OPENAI);

async fn stream(events: Vec<Vec<String>>) -> (FakeProvider, Vec<ModelEvent>) {
    let fake = FakeProvider::start(vec![FakeResponse::sse(events.concat())]).await;
    let events = run(&OPENAI.catalog(&fake.base_url(), ""), request(OPENAI.model)).await;
    (fake, events)
}

#[tokio::test]
async fn text_usage_and_stop_reason() {
    let (_, events) = stream(vec![hello()]).await;
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
async fn request_goes_to_chat_completions_with_a_streaming_body() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    let catalog = OPENAI.catalog(&format!("{}/v1/", fake.base_url()), "");
    run(&catalog, request(OPENAI.model)).await;
    let sent = &fake.requests()[0];
    assert_eq!(sent.path, "/v1/chat/completions");
    let body: Value = serde_json::from_slice(&sent.body).unwrap();
    assert_eq!(body["model"], "gpt-4o-mini");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({ "include_usage": true }));
    assert_eq!(body["max_completion_tokens"], 4096);
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["messages"][1]["role"], "user");
    assert_eq!(body["tools"][0]["function"]["name"], "read");
    // Without a key from the gateway, no cache routing is asked for.
    assert_eq!(body.get("prompt_cache_key"), None);
}

#[tokio::test]
async fn the_gateways_cache_key_routes_a_conversation_to_one_prompt_cache() {
    let hellos = (0..3).map(|_| FakeResponse::sse(hello())).collect();
    let fake = FakeProvider::start(hellos).await;
    let catalog = OPENAI.catalog(&fake.base_url(), "");
    let ask = |conversation: &str| {
        let key = CacheKey::for_conversation(conversation);
        collect(catalog.stream(request(OPENAI.model), Some(key), CancellationToken::new()))
    };
    ask("ses_a").await;
    ask("ses_a").await;
    ask("ses_b").await;
    let keys: Vec<Value> = fake
        .requests()
        .iter()
        .map(|r| serde_json::from_slice::<Value>(&r.body).unwrap()["prompt_cache_key"].clone())
        .collect();
    let expected = CacheKey::for_conversation("ses_a");
    assert_eq!(keys[0], expected.as_str());
    assert_eq!(keys[0], keys[1]);
    assert_ne!(keys[0], keys[2]);
    assert!(keys[2].is_string());
}

#[tokio::test]
async fn tool_call_arguments_split_across_deltas_are_reassembled() {
    let (_, events) = stream(vec![
        text_chunks(&["Reading both."]),
        tool_call(0, "call_a", "read", r#"{"path":"README.md"}"#, 7),
        tool_call(1, "call_b", "read", r#"{"path":"src/lib.rs"}"#, 5),
        finish("tool_calls"),
        usage(20, 9),
        done(),
    ])
    .await;
    let calls = tool_calls(&events);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (calls[0].id.as_str(), calls[0].name.as_str()),
        ("call_a", "read")
    );
    assert_eq!(calls[0].arguments, json!({ "path": "README.md" }));
    assert_eq!(calls[1].id, "call_b");
    assert_eq!(calls[1].arguments, json!({ "path": "src/lib.rs" }));
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::ToolUse
        })
    );
}

#[tokio::test]
async fn invalid_tool_arguments_are_kept_as_text() {
    let (_, events) = stream(vec![
        tool_call(0, "call_a", "read", r#"{"path": "READ"#, 3),
        finish("tool_calls"),
        done(),
    ])
    .await;
    let calls = tool_calls(&events);
    assert_eq!(
        calls[0].arguments,
        Value::String(r#"{"path": "READ"#.into())
    );
    assert!(matches!(events.last(), Some(ModelEvent::Done { .. })));
}

#[tokio::test]
async fn length_stops_with_max_tokens() {
    let (_, events) = stream(vec![text_chunks(&["Hel"]), finish("length"), done()]).await;
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::MaxTokens
        })
    );
}

#[tokio::test]
async fn an_error_chunk_mid_stream_is_reported() {
    let (_, events) = stream(vec![
        text_chunks(&["Hel"]),
        vec!["data: {\"error\":{\"message\":\"The server is overloaded\"}}\n\n".into()],
    ])
    .await;
    let (kind, message) = crate::error(&events);
    assert_eq!(kind, ModelErrorKind::ProviderFailed);
    assert!(message.contains("The server is overloaded"), "{message}");
}

#[tokio::test]
async fn cached_prompt_tokens_are_read_from_the_usage_chunk() {
    let (_, events) = stream(vec![
        text_chunks(&["Hi"]),
        finish("stop"),
        usage_cached(3000, 12, 2816),
        done(),
    ])
    .await;
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

#[test]
fn an_image_tool_result_is_followed_by_a_user_message_with_the_image() {
    let mut request = crate::image_request(OPENAI.model);
    request
        .messages
        .push(skiff_protocol::model::Message::Assistant {
            reasoning: Vec::new(),
            text: "A gradient.".into(),
            tool_calls: Vec::new(),
        });
    let settings = skiff_llm::ModelSettings::defaults_for("gpt-4o-mini");
    assert!(settings.images);
    let body = skiff_llm::openai::request_body(&request, &settings, None);
    insta::assert_snapshot!(crate::pretty(&body), @r#"
        {
          "max_completion_tokens": 4096,
          "messages": [
            {
              "content": "What is in this repository?",
              "role": "user"
            },
            {
              "content": null,
              "role": "assistant",
              "tool_calls": [
                {
                  "function": {
                    "arguments": "{\"path\":\"shot.png\"}",
                    "name": "read"
                  },
                  "id": "call_1",
                  "type": "function"
                }
              ]
            },
            {
              "content": "image: shot.png, 64×48 PNG, 6 KiB\n(the image follows in the next user message)",
              "role": "tool",
              "tool_call_id": "call_1"
            },
            {
              "content": [
                {
                  "text": "The image read returned (call_1):",
                  "type": "text"
                },
                {
                  "image_url": {
                    "url": "data:image/png;base64,iVBORw0KGgo="
                  },
                  "type": "image_url"
                }
              ],
              "role": "user"
            },
            {
              "content": "A gradient.",
              "role": "assistant"
            }
          ],
          "model": "gpt-4o-mini",
          "stream": true,
          "stream_options": {
            "include_usage": true
          }
        }
        "#);
}

/// `images = false` in the model's table reaches the request the provider gets.
#[tokio::test]
async fn a_model_configured_without_images_reads_why_in_the_tool_message() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    let catalog = OPENAI.catalog(
        &fake.base_url(),
        "[openai.models.\"gpt-4o-mini\"]\nimages = false",
    );
    run(&catalog, crate::image_request(OPENAI.model)).await;
    let body = &fake.requests()[0].body;
    insta::assert_snapshot!(crate::pretty(body), @r#"
        {
          "max_completion_tokens": 4096,
          "messages": [
            {
              "content": "What is in this repository?",
              "role": "user"
            },
            {
              "content": null,
              "role": "assistant",
              "tool_calls": [
                {
                  "function": {
                    "arguments": "{\"path\":\"shot.png\"}",
                    "name": "read"
                  },
                  "id": "call_1",
                  "type": "function"
                }
              ]
            },
            {
              "content": "image: shot.png, 64×48 PNG, 6 KiB\n(the image is not shown: model openai/gpt-4o-mini takes no images; set images = true in [providers.openai.models.\"gpt-4o-mini\"] if it does)",
              "role": "tool",
              "tool_call_id": "call_1"
            }
          ],
          "model": "gpt-4o-mini",
          "stream": true,
          "stream_options": {
            "include_usage": true
          }
        }
        "#);
}
