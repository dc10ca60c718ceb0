//! `api = "anthropic-messages"` against the fake provider.

use crate::transport::Wire;
use crate::{request, run, tool_calls};
use serde_json::{Value, json};
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, Reasoning, ReasoningEffort, StopReason, ToolCall, Usage,
};
use skiff_test_support::anthropic_sse::{
    error, message_delta, message_delta_cached, message_start, message_start_cached, message_stop,
    ping, redacted_thinking_block, text_block, thinking_block, tool_use_block,
};
use skiff_test_support::{FakeProvider, FakeResponse};

const ANTHROPIC: Wire = Wire {
    provider: "anthropic",
    api: "anthropic-messages",
    model: "anthropic/claude-sonnet-4-5",
    hello,
    partial,
    error_body,
    key_header: "x-api-key",
    key_value: str::to_owned,
};

fn hello() -> Vec<String> {
    [
        message_start(25),
        ping(),
        text_block(0, &["Hello", " world"]),
        message_delta("end_turn", 3),
        message_stop(),
    ]
    .concat()
}

fn partial() -> Vec<String> {
    [message_start(25), text_block(0, &["Hello"])].concat()
}

fn error_body(message: &str) -> String {
    json!({ "type": "error", "error": { "type": "invalid_request_error", "message": message } })
        .to_string()
}

crate::transport_tests!(ANTHROPIC);

async fn stream(events: Vec<Vec<String>>) -> Vec<ModelEvent> {
    let fake = FakeProvider::start(vec![FakeResponse::sse(events.concat())]).await;
    run(
        &ANTHROPIC.catalog(&fake.base_url(), ""),
        request(ANTHROPIC.model),
    )
    .await
}

#[tokio::test]
async fn text_usage_and_stop_reason() {
    let events = stream(vec![hello()]).await;
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
                    input_tokens: 25,
                    output_tokens: 3,
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
async fn request_goes_to_messages_with_version_header() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    run(
        &ANTHROPIC.catalog(&fake.base_url(), ""),
        request(ANTHROPIC.model),
    )
    .await;
    let sent = &fake.requests()[0];
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.header("anthropic-version"), Some("2023-06-01"));
    let body: Value = serde_json::from_slice(&sent.body).unwrap();
    assert_eq!(body["model"], "claude-sonnet-4-5");
    assert_eq!(body["max_tokens"], 4096);
    assert_eq!(body["stream"], true);
    assert_eq!(body["system"][0]["text"], "You are a careful coding agent.");
    assert_eq!(body["tools"][0]["input_schema"]["type"], "object");
}

#[tokio::test]
async fn tool_use_input_split_across_deltas_is_reassembled() {
    let events = stream(vec![
        message_start(40),
        text_block(0, &["Reading both."]),
        tool_use_block(1, "toolu_a", "read", r#"{"path":"README.md"}"#, 7),
        tool_use_block(2, "toolu_b", "read", r#"{"path":"src/lib.rs"}"#, 5),
        message_delta("tool_use", 30),
        message_stop(),
    ])
    .await;
    let calls = tool_calls(&events);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (calls[0].id.as_str(), calls[0].name.as_str()),
        ("toolu_a", "read")
    );
    assert_eq!(calls[0].arguments, json!({ "path": "README.md" }));
    assert_eq!(calls[1].arguments, json!({ "path": "src/lib.rs" }));
    assert_eq!(
        &events[events.len() - 2..],
        [
            ModelEvent::Usage {
                usage: Usage {
                    input_tokens: 40,
                    output_tokens: 30,
                    ..Usage::default()
                }
            },
            ModelEvent::Done {
                stop_reason: StopReason::ToolUse
            },
        ]
    );
}

#[tokio::test]
async fn tool_use_without_input_has_empty_arguments() {
    let events = stream(vec![
        message_start(1),
        tool_use_block(0, "toolu_a", "ls", "", 1),
        message_delta("tool_use", 1),
        message_stop(),
    ])
    .await;
    assert_eq!(tool_calls(&events)[0].arguments, json!({}));
}

#[tokio::test]
async fn invalid_tool_input_is_kept_as_text() {
    let events = stream(vec![
        message_start(1),
        tool_use_block(0, "toolu_a", "read", r#"{"path": "READ"#, 3),
        message_delta("tool_use", 1),
        message_stop(),
    ])
    .await;
    assert_eq!(
        tool_calls(&events)[0].arguments,
        Value::String(r#"{"path": "READ"#.into())
    );
    assert!(matches!(events.last(), Some(ModelEvent::Done { .. })));
}

#[tokio::test]
async fn max_tokens_stop_reason() {
    let events = stream(vec![
        message_start(1),
        text_block(0, &["Hel"]),
        message_delta("max_tokens", 1),
        message_stop(),
    ])
    .await;
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::MaxTokens
        })
    );
}

#[tokio::test]
async fn error_event_carries_the_providers_message() {
    let events = stream(vec![
        message_start(1),
        text_block(0, &["Hel"]),
        error("api_error", "Internal server error"),
    ])
    .await;
    let (kind, message) = crate::error(&events);
    assert_eq!(kind, ModelErrorKind::ProviderFailed);
    assert!(message.contains("Internal server error"), "{message}");
    assert!(message.contains("provider `anthropic`"), "{message}");
}

/// JSON pointers of every block in `body` that carries a `cache_control` breakpoint.
fn breakpoints(body: &Value) -> Vec<String> {
    let mut found = Vec::new();
    for (i, tool) in body["tools"].as_array().into_iter().flatten().enumerate() {
        if tool.get("cache_control").is_some() {
            found.push(format!("/tools/{i}"));
        }
    }
    for (i, block) in body["system"].as_array().into_iter().flatten().enumerate() {
        if block.get("cache_control").is_some() {
            found.push(format!("/system/{i}"));
        }
    }
    for (m, message) in body["messages"].as_array().unwrap().iter().enumerate() {
        for (b, block) in message["content"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            if let Some(control) = block.get("cache_control") {
                assert_eq!(control, &json!({ "type": "ephemeral" }));
                found.push(format!("/messages/{m}/content/{b}"));
            }
        }
    }
    found
}

#[tokio::test]
async fn cache_breakpoints_roll_with_a_tool_use_conversation() {
    let call = |id: &str, name: &str| ToolCall {
        id: id.into(),
        name: name.into(),
        arguments: json!({ "path": "src/lib.rs" }),
    };
    let result = |id: &str| Message::ToolResult {
        images: Vec::new(),
        call_id: id.into(),
        name: "read".into(),
        content: "fn main() {}".into(),
        is_error: false,
    };
    // The context of each step of a session: two parallel reads, an edit, the answer, and the
    // user's next turn.
    let steps: Vec<Vec<Message>> = vec![
        vec![Message::User {
            text: "Fix the bug".into(),
        }],
        vec![
            Message::Assistant {
                reasoning: Vec::new(),
                text: "Reading.".into(),
                tool_calls: vec![call("toolu_1", "read"), call("toolu_2", "read")],
            },
            result("toolu_1"),
            result("toolu_2"),
        ],
        vec![
            Message::Assistant {
                reasoning: Vec::new(),
                text: String::new(),
                tool_calls: vec![call("toolu_3", "edit")],
            },
            result("toolu_3"),
        ],
        vec![
            Message::Assistant {
                reasoning: Vec::new(),
                text: "Fixed.".into(),
                tool_calls: vec![],
            },
            Message::User {
                text: "Now add a test".into(),
            },
        ],
    ];
    let fake =
        FakeProvider::start(steps.iter().map(|_| FakeResponse::sse(hello())).collect()).await;
    let catalog = ANTHROPIC.catalog(&fake.base_url(), "");
    let mut context = request(ANTHROPIC.model);
    context.messages.clear();
    for step in steps {
        context.messages.extend(step);
        run(&catalog, context.clone()).await;
    }
    let bodies: Vec<Value> = fake
        .requests()
        .iter()
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    let marks: Vec<Vec<String>> = bodies.iter().map(breakpoints).collect();
    // Tools + system in every request; then the newest user-role message and the one before it,
    // which is where the previous request put its newest.
    assert_eq!(
        marks,
        [
            vec!["/system/0", "/messages/0/content/0"],
            vec![
                "/system/0",
                "/messages/0/content/0",
                "/messages/2/content/1"
            ],
            vec![
                "/system/0",
                "/messages/2/content/1",
                "/messages/4/content/0"
            ],
            vec![
                "/system/0",
                "/messages/4/content/0",
                "/messages/6/content/0"
            ],
        ]
    );
    assert!(marks.iter().all(|m| m.len() <= 4), "the API allows four");
    // The cached prefix up to the first breakpoint is the same bytes in every step.
    for body in &bodies[1..] {
        assert_eq!(body["tools"], bodies[0]["tools"]);
        assert_eq!(body["system"], bodies[0]["system"]);
    }
}

#[tokio::test]
async fn without_a_system_prompt_the_tools_end_the_cached_prefix() {
    let fake = FakeProvider::start(vec![FakeResponse::sse(hello())]).await;
    let mut context = request(ANTHROPIC.model);
    context.system.clear();
    run(&ANTHROPIC.catalog(&fake.base_url(), ""), context).await;
    let body: Value = serde_json::from_slice(&fake.requests()[0].body).unwrap();
    assert_eq!(body.get("system"), None);
    assert_eq!(breakpoints(&body), ["/tools/0", "/messages/0/content/0"]);
}

#[tokio::test]
async fn cache_reads_and_writes_are_part_of_the_input() {
    // As the API reports a request whose prefix was partly cached: 2000 tokens read, 300
    // written, 40 after the last breakpoint; message_delta repeats the cumulative counts.
    let events = stream(vec![
        message_start_cached(40, 300, 2000),
        text_block(0, &["Hi"]),
        message_delta_cached("end_turn", 40, 300, 2000, 7),
        message_stop(),
    ])
    .await;
    let usage = events.iter().find_map(|e| match e {
        ModelEvent::Usage { usage } => Some(*usage),
        _ => None,
    });
    assert_eq!(
        usage,
        Some(Usage {
            input_tokens: 2340,
            output_tokens: 7,
            cache_read_tokens: 2000,
            cache_write_tokens: 300,
        })
    );
}

#[tokio::test]
async fn cache_counts_only_in_message_start_still_count() {
    let events = stream(vec![
        message_start_cached(10, 0, 500),
        message_delta("end_turn", 3),
        message_stop(),
    ])
    .await;
    assert_eq!(
        events[0],
        ModelEvent::Usage {
            usage: Usage {
                input_tokens: 510,
                output_tokens: 3,
                cache_read_tokens: 500,
                cache_write_tokens: 0,
            }
        }
    );
}

// Thinking text with what JSON escapes (quotes, backslashes, newlines) and what it does not
// (non-ASCII), and a signature with base64's `+`, `/` and `=`: none of it may change on the way
// back.
const THOUGHT: [&str; 3] = [
    "The user wants the \"README\".\n",
    "Paths look like C:\\x or é/ü — ",
    "read it first.",
];
const SIGNATURE: &str = "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+GgxBdjrkzLoky3dl1pk/iMOYds=";
const REDACTED: &str = "EmwKAhgBEgy3va3pzix/LafPsn4aHhhOa+5Y==";

/// A response that thinks, has a thought redacted, and calls a tool, as the API streams it.
fn thinking_then_tool_use() -> Vec<String> {
    [
        message_start(50),
        thinking_block(0, &THOUGHT, SIGNATURE),
        redacted_thinking_block(1, REDACTED),
        tool_use_block(2, "toolu_t", "read", r#"{"path":"README.md"}"#, 3),
        message_delta("tool_use", 120),
        message_stop(),
    ]
    .concat()
}

#[tokio::test]
async fn thinking_streams_for_display_and_arrives_whole_with_its_signature() {
    let events = stream(vec![thinking_then_tool_use()]).await;
    let deltas: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ReasoningDelta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(deltas, THOUGHT);
    let blocks: Vec<&Reasoning> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::Reasoning { reasoning } => Some(reasoning),
            _ => None,
        })
        .collect();
    assert_eq!(
        blocks,
        [
            &Reasoning::Thinking {
                thinking: THOUGHT.concat(),
                signature: SIGNATURE.into(),
            },
            &Reasoning::RedactedThinking {
                data: REDACTED.into()
            },
        ]
    );
    // The blocks come before the call, in the order the model produced them.
    let position = |f: &dyn Fn(&ModelEvent) -> bool| events.iter().position(f).unwrap();
    assert!(
        position(&|e| matches!(e, ModelEvent::Reasoning { .. }))
            < position(&|e| matches!(e, ModelEvent::ToolCall { .. }))
    );
    assert_eq!(
        tool_calls(&events)[0].arguments,
        json!({ "path": "README.md" })
    );
}

#[tokio::test]
async fn thinking_goes_back_byte_for_byte_with_the_budget() {
    let fake = FakeProvider::start(vec![
        FakeResponse::sse(thinking_then_tool_use()),
        FakeResponse::sse(hello()),
    ])
    .await;
    let catalog = ANTHROPIC.catalog(&fake.base_url(), "");
    let mut context = request(ANTHROPIC.model);
    context.reasoning = Some(ReasoningEffort::Medium);
    let first = run(&catalog, context.clone()).await;

    // What the agent loop keeps of the reply, then the tool's result.
    let reasoning = first
        .iter()
        .filter_map(|e| match e {
            ModelEvent::Reasoning { reasoning } => Some(reasoning.clone()),
            _ => None,
        })
        .collect();
    context.messages.push(Message::Assistant {
        text: String::new(),
        tool_calls: tool_calls(&first),
        reasoning,
    });
    context.messages.push(Message::ToolResult {
        images: Vec::new(),
        call_id: "toolu_t".into(),
        name: "read".into(),
        content: "# Skiff".into(),
        is_error: false,
    });
    run(&catalog, context).await;

    let requests = fake.requests();
    let first_body: Value = serde_json::from_slice(&requests[0].body).unwrap();
    assert_eq!(
        first_body["thinking"],
        json!({ "type": "enabled", "budget_tokens": 8192 })
    );
    assert_eq!(first_body["max_tokens"], 8192 + 4096);

    // The raw JSON of the thinking block as the API streamed its pieces, and of the redacted
    // block as it came in content_block_start, appear verbatim in the second request.
    let second = String::from_utf8(requests[1].body.clone()).unwrap();
    let quoted = |s: &str| Value::from(s).to_string();
    let thinking = format!(
        r#"{{"signature":{},"thinking":{},"type":"thinking"}}"#,
        quoted(SIGNATURE),
        quoted(&THOUGHT.concat())
    );
    let redacted = format!(
        r#"{{"data":{},"type":"redacted_thinking"}}"#,
        quoted(REDACTED)
    );
    let signature_as_streamed = format!(r#""signature":{}"#, quoted(SIGNATURE));
    assert!(
        thinking_then_tool_use()
            .concat()
            .contains(&signature_as_streamed)
    );
    let assistant = format!(r#"{{"content":[{thinking},{redacted},{{"id":"toolu_t""#);
    assert!(
        second.contains(&assistant),
        "the assistant message must start with the thinking blocks as received:\n{second}"
    );
    let body: Value = serde_json::from_str(&second).unwrap();
    assert_eq!(
        body["messages"][1]["content"][0]["thinking"],
        THOUGHT.concat()
    );
    assert_eq!(body["thinking"]["budget_tokens"], 8192);
}

#[test]
fn an_image_tool_result_carries_the_image_as_a_block_after_its_text() {
    let request = crate::image_request(ANTHROPIC.model);
    let settings = skiff_llm::ModelSettings::defaults_for("claude-sonnet-4-5");
    assert!(settings.images);
    let body = skiff_llm::anthropic::request_body(&request, &settings);
    insta::assert_snapshot!(crate::pretty(&body), @r#"
        {
          "max_tokens": 4096,
          "messages": [
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "text": "What is in this repository?",
                  "type": "text"
                }
              ],
              "role": "user"
            },
            {
              "content": [
                {
                  "id": "call_1",
                  "input": {
                    "path": "shot.png"
                  },
                  "name": "read",
                  "type": "tool_use"
                }
              ],
              "role": "assistant"
            },
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "content": [
                    {
                      "text": "image: shot.png, 64×48 PNG, 6 KiB",
                      "type": "text"
                    },
                    {
                      "source": {
                        "data": "iVBORw0KGgo=",
                        "media_type": "image/png",
                        "type": "base64"
                      },
                      "type": "image"
                    }
                  ],
                  "is_error": false,
                  "tool_use_id": "call_1",
                  "type": "tool_result"
                }
              ],
              "role": "user"
            }
          ],
          "model": "claude-sonnet-4-5",
          "stream": true
        }
        "#);
}

#[test]
fn a_model_that_takes_no_images_reads_why_in_the_tool_result() {
    let request = crate::image_request(ANTHROPIC.model);
    let settings = skiff_llm::ModelSettings {
        images: false,
        ..skiff_llm::ModelSettings::defaults_for("claude-sonnet-4-5")
    };
    let body = skiff_llm::anthropic::request_body(&request, &settings);
    insta::assert_snapshot!(crate::pretty(&body), @r#"
        {
          "max_tokens": 4096,
          "messages": [
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "text": "What is in this repository?",
                  "type": "text"
                }
              ],
              "role": "user"
            },
            {
              "content": [
                {
                  "id": "call_1",
                  "input": {
                    "path": "shot.png"
                  },
                  "name": "read",
                  "type": "tool_use"
                }
              ],
              "role": "assistant"
            },
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "content": "image: shot.png, 64×48 PNG, 6 KiB\n(the image is not shown: model anthropic/claude-sonnet-4-5 takes no images; set images = true in [providers.anthropic.models.\"claude-sonnet-4-5\"] if it does)",
                  "is_error": false,
                  "tool_use_id": "call_1",
                  "type": "tool_result"
                }
              ],
              "role": "user"
            }
          ],
          "model": "claude-sonnet-4-5",
          "stream": true
        }
        "#);
}
