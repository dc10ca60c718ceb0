//! The OpenAI chat-completions wire format (`api = "openai-completions"`), which most
//! OpenAI-compatible servers also speak: request body, headers and stream decoding.
//!
//! The transport (sending, retries, timeouts, HTTP errors) is `http`'s, not this module's.

use crate::drive::Failure;
use crate::http::{self, Adapter, images_not_shown, malformed, tool_arguments};
use crate::sse::SseEvent;
use crate::{CacheKey, ModelSettings};
use reqwest::header::HeaderName;
use serde::Deserialize;
use serde_json::{Value, json};
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, ModelRequest, StopReason, ToolCall, Usage,
};
use std::collections::BTreeMap;

/// The body of `POST {base_url}/chat/completions` for `request`: compact JSON with sorted keys,
/// so the same request always gives the same bytes. `cache_key` becomes `prompt_cache_key`,
/// which routes a conversation's requests to the same prompt cache.
pub fn request_body(
    request: &ModelRequest,
    settings: &ModelSettings,
    cache_key: Option<&CacheKey>,
) -> Vec<u8> {
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    if !request.system.is_empty() {
        messages.push(json!({ "role": "system", "content": request.system }));
    }
    // A tool message carries text only: the images of a run of tool results follow it in one
    // user message, before the next assistant message.
    let mut images: Vec<Value> = Vec::new();
    for message in &request.messages {
        let wire = match message {
            Message::User { text } => json!({ "role": "user", "content": text }),
            Message::Assistant {
                text, tool_calls, ..
            } => {
                // The API rejects an empty `tool_calls` array and wants `null` content beside
                // calls.
                let content = (!text.is_empty()).then_some(text);
                let mut wire = json!({ "role": "assistant", "content": content });
                if !tool_calls.is_empty() {
                    wire["tool_calls"] = tool_calls.iter().map(wire_tool_call).collect();
                }
                wire
            }
            Message::ToolResult {
                call_id,
                name,
                content,
                images: shown,
                ..
            } => {
                let content = if shown.is_empty() {
                    content.clone()
                } else if settings.images {
                    images.push(json!({
                        "type": "text",
                        "text": format!("The image{} {name} returned ({call_id}):", plural(shown.len())),
                    }));
                    images.extend(shown.iter().map(|image| {
                        json!({
                            "type": "image_url",
                            "image_url": {
                                "url": format!("data:{};base64,{}", image.media_type, image.data_base64),
                            },
                        })
                    }));
                    format!(
                        "{content}\n(the image{} follow{} in the next user message)",
                        plural(shown.len()),
                        if shown.len() == 1 { "s" } else { "" }
                    )
                } else {
                    format!(
                        "{content}\n{}",
                        images_not_shown(&request.model, shown.len())
                    )
                };
                messages
                    .push(json!({ "role": "tool", "tool_call_id": call_id, "content": content }));
                continue;
            }
        };
        push_images(&mut messages, &mut images);
        messages.push(wire);
    }
    push_images(&mut messages, &mut images);
    let mut body = json!({
        "model": request.model.model_id(),
        "messages": messages,
        "stream": true,
        "stream_options": { "include_usage": true },
        "max_completion_tokens": request.max_output_tokens,
    });
    if let Some(key) = cache_key {
        body["prompt_cache_key"] = json!(key.as_str());
    }
    // The API rejects an empty `tools` array.
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.parameters,
                    },
                })
            })
            .collect();
    }
    body.to_string().into_bytes()
}

fn push_images(messages: &mut Vec<Value>, images: &mut Vec<Value>) {
    if !images.is_empty() {
        messages.push(json!({ "role": "user", "content": std::mem::take(images) }));
    }
}

fn plural(count: usize) -> &'static str {
    if count == 1 { "" } else { "s" }
}

fn wire_tool_call(call: &ToolCall) -> Value {
    // Arguments that were not valid JSON are carried as a string: send them back as written.
    let arguments = match &call.arguments {
        Value::String(raw) => raw.clone(),
        arguments => arguments.to_string(),
    };
    json!({
        "id": call.id,
        "type": "function",
        "function": { "name": call.name, "arguments": arguments },
    })
}

/// Decoding state of one streamed response.
#[derive(Default)]
pub(crate) struct Decoder {
    /// Tool calls being assembled, by their `index` in the response.
    calls: BTreeMap<u64, PartialCall>,
    stop: Option<StopReason>,
    usage: Option<Usage>,
}

#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

// Compatible servers send `null` where OpenAI omits a field, hence `Option` throughout.
#[derive(Deserialize)]
struct Chunk {
    choices: Option<Vec<Choice>>,
    usage: Option<WireUsage>,
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    delta: Option<Delta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: u64,
    id: Option<String>,
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    name: Option<String>,
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
}

/// `cached_tokens` are part of `prompt_tokens`; OpenAI does not report cache writes.
#[derive(Deserialize)]
struct PromptDetails {
    cached_tokens: Option<u64>,
}

impl PartialCall {
    /// OpenAI sends the id and name once and the arguments in pieces; some compatible servers
    /// repeat the id and name in every piece, so only the first of each counts.
    fn merge(&mut self, fragment: ToolCallDelta) {
        if self.id.is_empty() {
            self.id = fragment.id.unwrap_or_default();
        }
        if let Some(function) = fragment.function {
            if self.name.is_empty() {
                self.name = function.name.unwrap_or_default();
            }
            self.arguments.extend(function.arguments);
        }
    }
}

impl Decoder {
    /// Tool calls are complete when the choice finishes; emitted in index order. True if
    /// there were any.
    fn finish_calls(&mut self, out: &mut Vec<ModelEvent>) -> bool {
        let calls = std::mem::take(&mut self.calls);
        let any = !calls.is_empty();
        for (index, call) in calls {
            let id = if call.id.is_empty() {
                format!("call_{index}")
            } else {
                call.id
            };
            let call = ToolCall {
                id,
                name: call.name,
                arguments: tool_arguments(call.arguments),
            };
            out.push(ModelEvent::ToolCall { call });
        }
        any
    }
}

impl Adapter for Decoder {
    const PATH: &'static str = "/chat/completions";

    fn request_body(
        request: &ModelRequest,
        settings: &ModelSettings,
        cache_key: Option<&CacheKey>,
    ) -> Vec<u8> {
        request_body(request, settings, cache_key)
    }

    fn headers(api_key: Option<&str>) -> Vec<(HeaderName, String)> {
        http::bearer(api_key)
    }

    fn decode(
        &mut self,
        event: SseEvent,
        out: &mut Vec<ModelEvent>,
    ) -> Result<Option<StopReason>, Failure> {
        let data = event.data.trim();
        if data.is_empty() {
            return Ok(None);
        }
        if data == "[DONE]" {
            // Calls still open here came without a finish_reason; they are complete all the same.
            let called = self.finish_calls(out);
            out.extend(self.usage.map(|usage| ModelEvent::Usage { usage }));
            let unsaid = if called {
                StopReason::ToolUse
            } else {
                StopReason::Other
            };
            return Ok(Some(self.stop.unwrap_or(unsaid)));
        }
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| malformed(&event, &e))?;
        if let Some(error) = chunk.error {
            let message = error
                .pointer("/message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            return Err(Failure::new(
                ModelErrorKind::ProviderFailed,
                format!("reported an error mid-response: {message}"),
            ));
        }
        if let Some(usage) = chunk.usage {
            let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
            self.usage = Some(Usage {
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
                // Never more than the prompt, whatever a compatible server says.
                cache_read_tokens: cached.unwrap_or(0).min(usage.prompt_tokens),
                cache_write_tokens: 0,
            });
        }
        for choice in chunk.choices.into_iter().flatten() {
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                    out.push(ModelEvent::TextDelta { text });
                }
                for fragment in delta.tool_calls.into_iter().flatten() {
                    self.calls
                        .entry(fragment.index)
                        .or_default()
                        .merge(fragment);
                }
            }
            if let Some(reason) = choice.finish_reason {
                let called = self.finish_calls(out);
                self.stop = Some(match reason.as_str() {
                    // Some compatible servers (Ollama among them) say `stop` after tool calls.
                    "stop" if called => StopReason::ToolUse,
                    "stop" => StopReason::EndTurn,
                    "tool_calls" | "function_call" => StopReason::ToolUse,
                    "length" => StopReason::MaxTokens,
                    _ => StopReason::Other,
                });
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::model::{ModelRef, ToolSpec};

    fn settings() -> ModelSettings {
        ModelSettings::defaults_for("gpt-test")
    }

    fn request() -> ModelRequest {
        ModelRequest {
            reasoning: None,
            model: ModelRef::parse("openai/gpt-4o-mini").unwrap(),
            system: "You are terse.".into(),
            messages: vec![
                Message::User {
                    text: "List files".into(),
                },
                Message::Assistant {
                    reasoning: Vec::new(),
                    text: String::new(),
                    tool_calls: vec![ToolCall {
                        id: "call_1".into(),
                        name: "ls".into(),
                        arguments: json!({ "path": "." }),
                    }],
                },
                Message::ToolResult {
                    images: Vec::new(),
                    call_id: "call_1".into(),
                    name: "ls".into(),
                    content: "README.md".into(),
                    is_error: false,
                },
            ],
            tools: vec![ToolSpec {
                name: "ls".into(),
                description: "List a directory".into(),
                parameters: json!({ "type": "object", "properties": { "path": { "type": "string" } } }),
            }],
            max_output_tokens: 1024,
        }
    }

    #[test]
    fn request_body_is_a_pure_function_of_the_request() {
        let key = CacheKey::for_conversation("ses_1");
        assert_eq!(
            request_body(&request(), &settings(), Some(&key)),
            request_body(&request().clone(), &settings(), Some(&key))
        );
    }

    #[test]
    fn request_body_snapshot() {
        let key = CacheKey::for_conversation("ses_1");
        let body: Value =
            serde_json::from_slice(&request_body(&request(), &settings(), Some(&key))).unwrap();
        insta::assert_snapshot!(serde_json::to_string_pretty(&body).unwrap(), @r#"
        {
          "max_completion_tokens": 1024,
          "messages": [
            {
              "content": "You are terse.",
              "role": "system"
            },
            {
              "content": "List files",
              "role": "user"
            },
            {
              "content": null,
              "role": "assistant",
              "tool_calls": [
                {
                  "function": {
                    "arguments": "{\"path\":\".\"}",
                    "name": "ls"
                  },
                  "id": "call_1",
                  "type": "function"
                }
              ]
            },
            {
              "content": "README.md",
              "role": "tool",
              "tool_call_id": "call_1"
            }
          ],
          "model": "gpt-4o-mini",
          "prompt_cache_key": "6841447f7cc3c2cba0a143e5711fd611",
          "stream": true,
          "stream_options": {
            "include_usage": true
          },
          "tools": [
            {
              "function": {
                "description": "List a directory",
                "name": "ls",
                "parameters": {
                  "properties": {
                    "path": {
                      "type": "string"
                    }
                  },
                  "type": "object"
                }
              },
              "type": "function"
            }
          ]
        }
        "#);
    }

    #[test]
    fn unparsable_arguments_go_back_as_written() {
        let call = ToolCall {
            id: "c".into(),
            name: "read".into(),
            arguments: Value::String("{\"path\": ".into()),
        };
        assert_eq!(
            wire_tool_call(&call)["function"]["arguments"],
            "{\"path\": "
        );
    }

    fn sse(data: &str) -> SseEvent {
        SseEvent {
            event: None,
            data: data.to_owned(),
        }
    }

    #[test]
    fn null_fields_of_compatible_servers_are_accepted() {
        let mut decoder = Decoder::default();
        let mut out = Vec::new();
        let chunk = r#"{"choices":[{"index":0,"delta":{"content":"Hi","tool_calls":null},"finish_reason":null}],"usage":null}"#;
        assert_eq!(decoder.decode(sse(chunk), &mut out).unwrap(), None);
        assert_eq!(
            decoder.decode(sse("[DONE]"), &mut out).unwrap(),
            Some(StopReason::Other)
        );
        assert_eq!(out, vec![ModelEvent::TextDelta { text: "Hi".into() }]);
    }
}
