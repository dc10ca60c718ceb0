//! The Anthropic Messages wire format (`api = "anthropic-messages"`): request body, headers
//! and stream decoding.
//!
//! The transport (sending, retries, timeouts, HTTP errors) is `http`'s, not this module's.

use crate::drive::Failure;
use crate::http::{Adapter, images_not_shown, malformed, tool_arguments};
use crate::sse::SseEvent;
use crate::{CacheKey, ModelSettings};
use reqwest::header::HeaderName;
use serde::Deserialize;
use serde_json::{Value, json};
use skiff_protocol::model::{
    Image, Message, ModelErrorKind, ModelEvent, ModelRequest, Reasoning, ReasoningEffort,
    StopReason, ToolCall, Usage,
};
use std::collections::BTreeMap;

const API_VERSION: &str = "2023-06-01";
// `from_static` is evaluated at compile time here, so a typo cannot become a runtime panic.
const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const ANTHROPIC_VERSION: HeaderName = HeaderName::from_static("anthropic-version");

/// The body of `POST {base_url}/v1/messages` for `request`: compact JSON with sorted keys, so
/// the same request always gives the same bytes.
///
/// It carries prompt-cache breakpoints (`cache_control`) at three stable positions, within the
/// API's limit of four: the end of tools + system (the same in every request of a session), and
/// the last block of each of the last two user-role messages. The newest one writes this
/// request's prefix to the cache; the one before is where the previous request of the session
/// wrote its own, so it is read back however many blocks were added since (the API looks only
/// 20 blocks back from a breakpoint for an earlier entry).
///
/// With reasoning on (`settings.reasoning`), it asks for extended thinking with a token budget
/// for the effort, and `max_tokens` grows by that budget (the API wants it above the budget,
/// and the answer keeps its own allowance). Every assistant message's thinking blocks go back
/// first in its content, exactly as they came: the API checks their signatures.
pub fn request_body(request: &ModelRequest, settings: &ModelSettings) -> Vec<u8> {
    let mut messages = Vec::with_capacity(request.messages.len());
    // Results of one assistant turn go together in the user message that follows it.
    let mut results = Vec::new();
    for message in &request.messages {
        let wire = match message {
            Message::ToolResult {
                call_id,
                content,
                is_error,
                images,
                ..
            } => {
                results.push(json!({
                    "type": "tool_result",
                    "tool_use_id": call_id,
                    "content": tool_result_content(request, settings, content, images),
                    "is_error": is_error,
                }));
                continue;
            }
            // Always in block form, so that a message reads the same whether or not it carries
            // a breakpoint.
            Message::User { text } => json!({
                "role": "user",
                "content": [{ "type": "text", "text": text }],
            }),
            Message::Assistant {
                text,
                tool_calls,
                reasoning,
            } => {
                let thinking = reasoning.iter().filter_map(thinking_block);
                // The API rejects empty text blocks.
                let text = (!text.is_empty()).then(|| json!({ "type": "text", "text": text }));
                let calls = tool_calls.iter().map(|call| {
                    json!({
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": tool_input(&call.arguments),
                    })
                });
                let content: Vec<Value> = thinking.chain(text).chain(calls).collect();
                json!({ "role": "assistant", "content": content })
            }
        };
        push_results(&mut messages, &mut results);
        messages.push(wire);
    }
    push_results(&mut messages, &mut results);
    let user_turns = messages.iter_mut().filter(|m| m["role"] == "user");
    for message in user_turns.rev().take(ROLLING_BREAKPOINTS) {
        if let Some(last) = message["content"].as_array_mut().and_then(|c| c.last_mut()) {
            last["cache_control"] = ephemeral();
        }
    }

    let mut body = json!({
        "model": request.model.model_id(),
        "max_tokens": request.max_output_tokens,
        "messages": messages,
        "stream": true,
    });
    if let Some(budget) = settings.reasoning.and_then(thinking_budget) {
        body["thinking"] = json!({ "type": "enabled", "budget_tokens": budget });
        body["max_tokens"] = json!(budget.saturating_add(request.max_output_tokens));
    }
    if !request.tools.is_empty() {
        let mut tools: Vec<Value> = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "input_schema": tool.parameters,
                })
            })
            .collect();
        // The prefix is tools, then system: without a system prompt the tools end it.
        if let (true, Some(last)) = (request.system.is_empty(), tools.last_mut()) {
            last["cache_control"] = ephemeral();
        }
        body["tools"] = Value::Array(tools);
    }
    if !request.system.is_empty() {
        body["system"] = json!([{
            "type": "text",
            "text": request.system,
            "cache_control": ephemeral(),
        }]);
    }
    body.to_string().into_bytes()
}

/// The thinking budget for an effort, in tokens (the API's minimum is 1024).
fn thinking_budget(effort: ReasoningEffort) -> Option<u32> {
    match effort {
        ReasoningEffort::Off => None,
        ReasoningEffort::Low => Some(2048),
        ReasoningEffort::Medium => Some(8192),
        ReasoningEffort::High => Some(24_576),
    }
}

/// An Anthropic reasoning block as the API sent it. Another provider's reasoning (a session
/// that changed models) means nothing to this API and is left out.
fn thinking_block(reasoning: &Reasoning) -> Option<Value> {
    match reasoning {
        Reasoning::Thinking {
            thinking,
            signature,
        } => Some(json!({ "type": "thinking", "thinking": thinking, "signature": signature })),
        Reasoning::RedactedThinking { data } => {
            Some(json!({ "type": "redacted_thinking", "data": data }))
        }
        Reasoning::OpenaiReasoning { .. } => None,
    }
}

/// A tool result's `content`: its text alone (a string, as before images), or the text then its
/// images as blocks; for a model that takes no images, the text with a note saying so.
fn tool_result_content(
    request: &ModelRequest,
    settings: &ModelSettings,
    content: &str,
    images: &[Image],
) -> Value {
    if images.is_empty() {
        return json!(content);
    }
    if !settings.images {
        return json!(format!(
            "{content}\n{}",
            images_not_shown(&request.model, images.len())
        ));
    }
    let text = json!({ "type": "text", "text": content });
    let images = images.iter().map(|image| {
        json!({
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": image.media_type,
                "data": image.data_base64,
            },
        })
    });
    Value::Array(std::iter::once(text).chain(images).collect())
}

/// Breakpoints on user-role messages, newest first; with the one after tools + system, three of
/// the API's four.
const ROLLING_BREAKPOINTS: usize = 2;

fn ephemeral() -> Value {
    json!({ "type": "ephemeral" })
}

fn push_results(messages: &mut Vec<Value>, results: &mut Vec<Value>) {
    if !results.is_empty() {
        messages.push(json!({ "role": "user", "content": std::mem::take(results) }));
    }
}

/// The API requires `input` to be an object. Arguments that were not valid JSON are replayed as
/// none: the tool result that follows already tells the model what was wrong.
fn tool_input(arguments: &Value) -> Value {
    match arguments {
        Value::Object(_) => arguments.clone(),
        _ => json!({}),
    }
}

/// Decoding state of one streamed response.
#[derive(Default)]
pub(crate) struct Decoder {
    usage: WireUsage,
    stop: Option<StopReason>,
    /// Tool-use and thinking blocks being assembled, by content block index.
    blocks: BTreeMap<u64, Partial>,
}

enum Partial {
    Call(PartialCall),
    Thinking { thinking: String, signature: String },
    Redacted { data: String },
}

struct PartialCall {
    id: String,
    name: String,
    /// The block's initial `input`, used when no `input_json_delta` follows.
    input: Value,
    json: String,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: u64,
        content_block: Block,
    },
    ContentBlockDelta {
        index: u64,
        delta: Delta,
    },
    ContentBlockStop {
        index: u64,
    },
    MessageDelta {
        delta: MessageDelta,
        usage: Option<DeltaUsage>,
    },
    MessageStop,
    Error {
        error: ErrorBody,
    },
    /// `ping` and event types added after this was written, which the API says to ignore.
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct StartMessage {
    #[serde(default)]
    usage: WireUsage,
}

/// Usage as the API reports it: `input_tokens` is only the part of the prompt after the last
/// cache breakpoint, the cache counts are the rest. Defaults because compatible proxies do not
/// always report usage.
#[derive(Deserialize, Default, Clone, Copy)]
struct WireUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    cache_creation_input_tokens: u64,
    #[serde(default)]
    cache_read_input_tokens: u64,
}

impl WireUsage {
    /// Skiff's `input_tokens` is the whole prompt; the cache counts are parts of it.
    fn normalized(self) -> Usage {
        Usage {
            input_tokens: self.input_tokens
                + self.cache_creation_input_tokens
                + self.cache_read_input_tokens,
            output_tokens: self.output_tokens,
            cache_read_tokens: self.cache_read_input_tokens,
            cache_write_tokens: self.cache_creation_input_tokens,
        }
    }
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Option<Value>,
    },
    /// Usually empty here; the text and signature follow as deltas.
    Thinking {
        #[serde(default)]
        thinking: String,
        #[serde(default)]
        signature: String,
    },
    RedactedThinking {
        data: String,
    },
    /// Block types added after this was written, which carry nothing the agent uses.
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
#[serde(tag = "type")]
enum Delta {
    #[serde(rename = "text_delta")]
    Text { text: String },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: String },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: String },
    #[serde(rename = "signature_delta")]
    Signature { signature: String },
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct MessageDelta {
    stop_reason: Option<String>,
}

/// Only what changed since `message_start`; every count present is cumulative.
#[derive(Deserialize)]
struct DeltaUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(rename = "type")]
    kind: String,
    message: String,
}

impl Adapter for Decoder {
    const PATH: &'static str = "/v1/messages";

    /// Anthropic's cache is keyed by the prompt itself; the breakpoints say where.
    fn request_body(
        request: &ModelRequest,
        settings: &ModelSettings,
        _cache_key: Option<&CacheKey>,
    ) -> Vec<u8> {
        request_body(request, settings)
    }

    fn headers(api_key: Option<&str>) -> Vec<(HeaderName, String)> {
        let key = api_key.map(|key| (X_API_KEY, key.to_owned()));
        key.into_iter()
            .chain([(ANTHROPIC_VERSION, API_VERSION.to_owned())])
            .collect()
    }

    fn decode(
        &mut self,
        event: SseEvent,
        out: &mut Vec<ModelEvent>,
    ) -> Result<Option<StopReason>, Failure> {
        // The `type` inside the data repeats the `event:` field; decoding the data alone keeps
        // one source of truth.
        let decoded: Event =
            serde_json::from_str(&event.data).map_err(|e| malformed(&event, &e))?;
        match decoded {
            // The output count here is a placeholder; message_delta has the real one.
            Event::MessageStart { message } => {
                self.usage = WireUsage {
                    output_tokens: 0,
                    ..message.usage
                }
            }
            Event::ContentBlockStart {
                index,
                content_block,
            } => match content_block {
                Block::Text { text } if !text.is_empty() => {
                    out.push(ModelEvent::TextDelta { text })
                }
                Block::ToolUse { id, name, input } => {
                    let input = input.unwrap_or(Value::Null);
                    let json = String::new();
                    let call = PartialCall {
                        id,
                        name,
                        input,
                        json,
                    };
                    self.blocks.insert(index, Partial::Call(call));
                }
                Block::Thinking {
                    thinking,
                    signature,
                } => {
                    if !thinking.is_empty() {
                        let text = thinking.clone();
                        out.push(ModelEvent::ReasoningDelta { text });
                    }
                    let block = Partial::Thinking {
                        thinking,
                        signature,
                    };
                    self.blocks.insert(index, block);
                }
                Block::RedactedThinking { data } => {
                    self.blocks.insert(index, Partial::Redacted { data });
                }
                Block::Text { .. } | Block::Other => {}
            },
            Event::ContentBlockDelta { index, delta } => {
                match (delta, self.blocks.get_mut(&index)) {
                    (Delta::Text { text }, _) => out.push(ModelEvent::TextDelta { text }),
                    (Delta::InputJson { partial_json }, Some(Partial::Call(call))) => {
                        call.json.push_str(&partial_json);
                    }
                    (Delta::Thinking { thinking }, Some(Partial::Thinking { thinking: t, .. })) => {
                        t.push_str(&thinking);
                        out.push(ModelEvent::ReasoningDelta { text: thinking });
                    }
                    (
                        Delta::Signature { signature },
                        Some(Partial::Thinking { signature: s, .. }),
                    ) => s.push_str(&signature),
                    // A delta for a block that was never started, or of another kind.
                    _ => {}
                }
            }
            Event::ContentBlockStop { index } => match self.blocks.remove(&index) {
                Some(Partial::Call(call)) => {
                    let arguments = match call.input {
                        Value::Object(input) if call.json.is_empty() => Value::Object(input),
                        _ => tool_arguments(call.json),
                    };
                    let call = ToolCall {
                        id: call.id,
                        name: call.name,
                        arguments,
                    };
                    out.push(ModelEvent::ToolCall { call });
                }
                Some(Partial::Thinking {
                    thinking,
                    signature,
                }) => {
                    let reasoning = Reasoning::Thinking {
                        thinking,
                        signature,
                    };
                    out.push(ModelEvent::Reasoning { reasoning });
                }
                Some(Partial::Redacted { data }) => {
                    let reasoning = Reasoning::RedactedThinking { data };
                    out.push(ModelEvent::Reasoning { reasoning });
                }
                None => {}
            },
            Event::MessageDelta { delta, usage } => {
                if let Some(reason) = delta.stop_reason {
                    self.stop = Some(match reason.as_str() {
                        "end_turn" | "stop_sequence" => StopReason::EndTurn,
                        "tool_use" => StopReason::ToolUse,
                        "max_tokens" => StopReason::MaxTokens,
                        _ => StopReason::Other,
                    });
                }
                // Counts in message_delta are cumulative, so they replace earlier ones.
                if let Some(delta) = usage {
                    let u = &mut self.usage;
                    u.input_tokens = delta.input_tokens.unwrap_or(u.input_tokens);
                    u.output_tokens = delta.output_tokens.unwrap_or(u.output_tokens);
                    u.cache_creation_input_tokens = delta
                        .cache_creation_input_tokens
                        .unwrap_or(u.cache_creation_input_tokens);
                    u.cache_read_input_tokens = delta
                        .cache_read_input_tokens
                        .unwrap_or(u.cache_read_input_tokens);
                }
            }
            Event::MessageStop => {
                let usage = self.usage.normalized();
                out.push(ModelEvent::Usage { usage });
                return Ok(Some(self.stop.unwrap_or(StopReason::Other)));
            }
            Event::Error { error } => {
                // Overload is the same condition as an HTTP 529 before streaming started.
                let kind = match error.kind.as_str() {
                    "rate_limit_error" | "overloaded_error" => ModelErrorKind::RateLimited,
                    _ => ModelErrorKind::ProviderFailed,
                };
                return Err(Failure::new(
                    kind,
                    format!(
                        "reported an error mid-response: {} ({})",
                        error.message, error.kind
                    ),
                ));
            }
            Event::Other => {}
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::model::{ModelRef, ToolSpec};

    fn settings() -> ModelSettings {
        ModelSettings::defaults_for("claude-test")
    }

    fn request() -> ModelRequest {
        let call = |id: &str| ToolCall {
            id: id.into(),
            name: "read".into(),
            arguments: json!({ "path": "README.md" }),
        };
        let result = |id: &str, is_error| Message::ToolResult {
            images: Vec::new(),
            call_id: id.into(),
            name: "read".into(),
            content: "# Skiff".into(),
            is_error,
        };
        ModelRequest {
            reasoning: None,
            model: ModelRef::parse("anthropic/claude-sonnet-4-5").unwrap(),
            system: "You are terse.".into(),
            messages: vec![
                Message::User {
                    text: "Read the README twice".into(),
                },
                Message::Assistant {
                    reasoning: Vec::new(),
                    text: "Reading.".into(),
                    tool_calls: vec![call("toolu_1"), call("toolu_2")],
                },
                result("toolu_1", false),
                result("toolu_2", true),
            ],
            tools: vec![ToolSpec {
                name: "read".into(),
                description: "Read a file".into(),
                parameters: json!({ "type": "object", "properties": { "path": { "type": "string" } } }),
            }],
            max_output_tokens: 2048,
        }
    }

    #[test]
    fn request_body_is_a_pure_function_of_the_request() {
        assert_eq!(
            request_body(&request(), &settings()),
            request_body(&request().clone(), &settings())
        );
    }

    #[test]
    fn request_body_snapshot() {
        let body: Value = serde_json::from_slice(&request_body(&request(), &settings())).unwrap();
        insta::assert_snapshot!(serde_json::to_string_pretty(&body).unwrap(), @r##"
        {
          "max_tokens": 2048,
          "messages": [
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "text": "Read the README twice",
                  "type": "text"
                }
              ],
              "role": "user"
            },
            {
              "content": [
                {
                  "text": "Reading.",
                  "type": "text"
                },
                {
                  "id": "toolu_1",
                  "input": {
                    "path": "README.md"
                  },
                  "name": "read",
                  "type": "tool_use"
                },
                {
                  "id": "toolu_2",
                  "input": {
                    "path": "README.md"
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
                  "content": "# Skiff",
                  "is_error": false,
                  "tool_use_id": "toolu_1",
                  "type": "tool_result"
                },
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "content": "# Skiff",
                  "is_error": true,
                  "tool_use_id": "toolu_2",
                  "type": "tool_result"
                }
              ],
              "role": "user"
            }
          ],
          "model": "claude-sonnet-4-5",
          "stream": true,
          "system": [
            {
              "cache_control": {
                "type": "ephemeral"
              },
              "text": "You are terse.",
              "type": "text"
            }
          ],
          "tools": [
            {
              "description": "Read a file",
              "input_schema": {
                "properties": {
                  "path": {
                    "type": "string"
                  }
                },
                "type": "object"
              },
              "name": "read"
            }
          ]
        }
        "##);
    }

    /// A turn that thought before its call, with the thinking sent back and a high budget.
    fn thinking_request() -> (ModelRequest, ModelSettings) {
        let mut request = request();
        request.messages.truncate(3);
        request.system.clear();
        request.tools.clear();
        if let Message::Assistant {
            reasoning,
            tool_calls,
            ..
        } = &mut request.messages[1]
        {
            tool_calls.truncate(1);
            *reasoning = vec![
                Reasoning::Thinking {
                    thinking: "The README is short; \"read\" it.\n".into(),
                    signature: "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+/=".into(),
                },
                Reasoning::RedactedThinking {
                    data: "EmwKAhgBEgy3va3pzix/LafPsn4a".into(),
                },
                Reasoning::OpenaiReasoning {
                    id: "rs_1".into(),
                    summary: vec!["not for this API".into()],
                    encrypted_content: None,
                },
            ];
        }
        let settings = ModelSettings {
            reasoning: Some(ReasoningEffort::High),
            ..settings()
        };
        (request, settings)
    }

    #[test]
    fn request_body_with_thinking_snapshot() {
        let (request, settings) = thinking_request();
        let body: Value = serde_json::from_slice(&request_body(&request, &settings)).unwrap();
        insta::assert_snapshot!(serde_json::to_string_pretty(&body).unwrap(), @r##"
        {
          "max_tokens": 26624,
          "messages": [
            {
              "content": [
                {
                  "cache_control": {
                    "type": "ephemeral"
                  },
                  "text": "Read the README twice",
                  "type": "text"
                }
              ],
              "role": "user"
            },
            {
              "content": [
                {
                  "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+/=",
                  "thinking": "The README is short; \"read\" it.\n",
                  "type": "thinking"
                },
                {
                  "data": "EmwKAhgBEgy3va3pzix/LafPsn4a",
                  "type": "redacted_thinking"
                },
                {
                  "text": "Reading.",
                  "type": "text"
                },
                {
                  "id": "toolu_1",
                  "input": {
                    "path": "README.md"
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
                  "content": "# Skiff",
                  "is_error": false,
                  "tool_use_id": "toolu_1",
                  "type": "tool_result"
                }
              ],
              "role": "user"
            }
          ],
          "model": "claude-sonnet-4-5",
          "stream": true,
          "thinking": {
            "budget_tokens": 24576,
            "type": "enabled"
          }
        }
        "##);
    }

    #[test]
    fn each_effort_has_a_budget_below_max_tokens() {
        let (mut request, mut settings) = thinking_request();
        request.max_output_tokens = 1000;
        for (effort, budget) in [
            (ReasoningEffort::Low, 2048),
            (ReasoningEffort::Medium, 8192),
            (ReasoningEffort::High, 24_576),
        ] {
            settings.reasoning = Some(effort);
            let body: Value = serde_json::from_slice(&request_body(&request, &settings)).unwrap();
            assert_eq!(body["thinking"]["budget_tokens"], budget);
            assert_eq!(body["max_tokens"], budget + 1000);
        }
        settings.reasoning = None;
        let body: Value = serde_json::from_slice(&request_body(&request, &settings)).unwrap();
        assert_eq!(body.get("thinking"), None);
        assert_eq!(body["max_tokens"], 1000);
    }

    #[test]
    fn non_object_arguments_are_replayed_as_empty_input() {
        assert_eq!(tool_input(&Value::String("{oops".into())), json!({}));
    }
}
