//! The OpenAI Responses wire format (`api = "openai-responses"`): request body, headers and
//! stream decoding. It is the format OpenAI's reasoning models are made for: their reasoning
//! comes back as `reasoning` items (a readable summary and, when asked for, encrypted content)
//! that are sent back unchanged on the following requests of the turn.
//!
//! Requests are stateless (`store: false`): every request carries the whole conversation, so a
//! session's requests are the same bytes whichever process builds them, and nothing is kept at
//! the provider. The transport (sending, retries, timeouts, HTTP errors) is `http`'s, not this
//! module's; `previous_response_id`, built-in tools and background responses are not used.

use crate::drive::Failure;
use crate::http::{self, Adapter, malformed, tool_arguments};
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

/// The body of `POST {base_url}/responses` for `request`: compact JSON with sorted keys, so the
/// same request always gives the same bytes. `cache_key` becomes `prompt_cache_key`, which
/// routes a conversation's requests to the same prompt cache.
pub fn request_body(
    request: &ModelRequest,
    settings: &ModelSettings,
    cache_key: Option<&CacheKey>,
) -> Vec<u8> {
    let mut input = Vec::with_capacity(request.messages.len());
    for message in &request.messages {
        match message {
            Message::User { text } => input.push(json!({
                "type": "message",
                "role": "user",
                "content": [{ "type": "input_text", "text": text }],
            })),
            Message::Assistant {
                text,
                tool_calls,
                reasoning,
            } => {
                // The API wants a response's reasoning before the message and calls it led to.
                input.extend(reasoning.iter().filter_map(wire_reasoning));
                if !text.is_empty() {
                    input.push(json!({
                        "type": "message",
                        "role": "assistant",
                        "content": [{ "type": "output_text", "text": text }],
                    }));
                }
                input.extend(tool_calls.iter().map(wire_tool_call));
            }
            Message::ToolResult {
                call_id,
                content,
                images,
                ..
            } => input.push(json!({
                "type": "function_call_output",
                "call_id": call_id,
                "output": tool_output(request, settings, content, images),
            })),
        }
    }
    let mut body = json!({
        "model": request.model.model_id(),
        "input": input,
        "stream": true,
        "store": false,
        "max_output_tokens": request.max_output_tokens,
    });
    if !request.system.is_empty() {
        body["instructions"] = json!(request.system);
    }
    if let Some(key) = cache_key {
        body["prompt_cache_key"] = json!(key.as_str());
    }
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "type": "function",
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                    // Strict mode would demand every property be required and no others
                    // allowed, which the tools' schemas do not promise.
                    "strict": false,
                })
            })
            .collect();
    }
    let effort = match settings.reasoning {
        Some(ReasoningEffort::Low) => Some("low"),
        Some(ReasoningEffort::Medium) => Some("medium"),
        Some(ReasoningEffort::High) => Some("high"),
        Some(ReasoningEffort::Off) | None => None,
    };
    if let Some(effort) = effort {
        body["reasoning"] = json!({ "effort": effort, "summary": "auto" });
        // With `store: false` the reasoning exists nowhere but in this encrypted form; without
        // it the next request could not carry the model's reasoning forward.
        body["include"] = json!(["reasoning.encrypted_content"]);
    }
    body.to_string().into_bytes()
}

/// A reasoning item as the API returned it. Items of other providers (a conversation that
/// changed models) have no meaning here. An item without encrypted content is left out: with
/// `store: false` the API cannot look its id up and would reject the whole request.
fn wire_reasoning(reasoning: &Reasoning) -> Option<Value> {
    let Reasoning::OpenaiReasoning {
        id,
        summary,
        encrypted_content: Some(encrypted_content),
    } = reasoning
    else {
        return None;
    };
    let summary: Vec<Value> = summary
        .iter()
        .map(|text| json!({ "type": "summary_text", "text": text }))
        .collect();
    Some(json!({
        "type": "reasoning",
        "id": id,
        "summary": summary,
        "encrypted_content": encrypted_content,
    }))
}

fn wire_tool_call(call: &ToolCall) -> Value {
    // Arguments that were not valid JSON are carried as a string: send them back as written.
    let arguments = match &call.arguments {
        Value::String(raw) => raw.clone(),
        arguments => arguments.to_string(),
    };
    json!({
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
    })
}

/// A tool's output: its text, with its images as `input_image` parts when the model takes
/// images, else with a note saying they were left out and how to send them.
fn tool_output(
    request: &ModelRequest,
    settings: &ModelSettings,
    content: &str,
    images: &[Image],
) -> Value {
    if images.is_empty() {
        return json!(content);
    }
    if !settings.images {
        let model = &request.model;
        let note = format!(
            "(the image is not shown: model {model} takes no images; set images = true in [providers.{}.models.\"{}\"] if it does)",
            model.provider(),
            model.model_id(),
        );
        let text = if content.is_empty() {
            note
        } else {
            format!("{content}\n\n{note}")
        };
        return json!(text);
    }
    let text = (!content.is_empty()).then(|| json!({ "type": "input_text", "text": content }));
    let images = images.iter().map(|image| {
        json!({
            "type": "input_image",
            "image_url": format!("data:{};base64,{}", image.media_type, image.data_base64),
            "detail": "auto",
        })
    });
    Value::Array(text.into_iter().chain(images).collect())
}

/// Decoding state of one streamed response.
#[derive(Default)]
pub(crate) struct Decoder {
    /// Function calls being assembled, by their output item id.
    calls: BTreeMap<String, PartialCall>,
    /// Whether the response made a tool call: the API says `completed` either way.
    called: bool,
    /// The reasoning summary part last streamed, so that the next one starts a new paragraph.
    summary_part: Option<(String, u64)>,
}

#[derive(Default)]
struct PartialCall {
    call_id: String,
    name: String,
    arguments: String,
}

/// The stream events this adapter reads; every other type is ignored, as the API reference
/// asks of clients.
#[derive(Deserialize)]
#[serde(tag = "type")]
enum Event {
    /// A refusal reads as the answer: without it the person would see nothing at all.
    #[serde(
        rename = "response.output_text.delta",
        alias = "response.refusal.delta"
    )]
    OutputTextDelta { delta: String },
    #[serde(rename = "response.reasoning_summary_text.delta")]
    ReasoningSummaryDelta {
        item_id: String,
        #[serde(default)]
        summary_index: u64,
        delta: String,
    },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded { item: Item },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta { item_id: String, delta: String },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone { item_id: String, arguments: String },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone { item: Item },
    #[serde(rename = "response.completed")]
    Completed { response: WireResponse },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: WireResponse },
    #[serde(rename = "response.failed")]
    Failed { response: WireResponse },
    #[serde(rename = "error")]
    Error {
        code: Option<String>,
        message: Option<String>,
        /// Some deployments nest the details the way an HTTP error body does.
        error: Option<WireError>,
    },
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Item {
    Reasoning {
        id: String,
        #[serde(default)]
        summary: Vec<SummaryPart>,
        encrypted_content: Option<String>,
    },
    FunctionCall {
        id: Option<String>,
        call_id: String,
        name: String,
        #[serde(default)]
        arguments: String,
    },
    /// Messages (their text has streamed already) and item types this adapter does not use.
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct SummaryPart {
    text: String,
}

#[derive(Deserialize)]
struct WireResponse {
    usage: Option<WireUsage>,
    incomplete_details: Option<IncompleteDetails>,
    error: Option<WireError>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    input_tokens_details: Option<InputDetails>,
}

/// `cached_tokens` are part of `input_tokens`; OpenAI does not report cache writes.
#[derive(Deserialize)]
struct InputDetails {
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct IncompleteDetails {
    reason: Option<String>,
}

#[derive(Deserialize)]
struct WireError {
    code: Option<String>,
    message: Option<String>,
}

impl WireUsage {
    fn normalized(self) -> Usage {
        let cached = self.input_tokens_details.and_then(|d| d.cached_tokens);
        Usage {
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            // Never more than the prompt, whatever a compatible server says.
            cache_read_tokens: cached.unwrap_or(0).min(self.input_tokens),
            cache_write_tokens: 0,
        }
    }
}

/// A failure the provider reported inside the stream, its kind chosen by its code.
fn reported(code: Option<String>, message: Option<String>) -> Failure {
    let message = message.filter(|m| !m.trim().is_empty());
    let message = message.unwrap_or_else(|| "no message given".to_owned());
    let code_note = code
        .as_deref()
        .map_or_else(String::new, |code| format!(" ({code})"));
    match code.as_deref() {
        Some("rate_limit_exceeded") => Failure::new(
            ModelErrorKind::RateLimited,
            format!("is rate limiting: {message}{code_note}; try again in a minute"),
        ),
        Some("server_error") => Failure::new(
            ModelErrorKind::ProviderFailed,
            format!("failed mid-response: {message}{code_note}; try again later"),
        ),
        _ => Failure::new(
            ModelErrorKind::Rejected,
            format!("rejected the request mid-response: {message}{code_note}"),
        ),
    }
}

impl Decoder {
    /// Calls whose `output_item.done` never came are complete once the response is.
    fn finish_calls(&mut self, out: &mut Vec<ModelEvent>) {
        for (item_id, call) in std::mem::take(&mut self.calls) {
            let id = if call.call_id.is_empty() {
                item_id
            } else {
                call.call_id
            };
            self.called = true;
            out.push(ModelEvent::ToolCall {
                call: ToolCall {
                    id,
                    name: call.name,
                    arguments: tool_arguments(call.arguments),
                },
            });
        }
    }

    fn item_done(&mut self, item: Item, out: &mut Vec<ModelEvent>) {
        match item {
            Item::Reasoning {
                id,
                summary,
                encrypted_content,
            } => out.push(ModelEvent::Reasoning {
                reasoning: Reasoning::OpenaiReasoning {
                    id,
                    summary: summary.into_iter().map(|part| part.text).collect(),
                    encrypted_content,
                },
            }),
            Item::FunctionCall {
                id,
                call_id,
                name,
                arguments,
            } => {
                // Found by item id, or by call id from a server that leaves the item id out.
                let key = id.filter(|id| self.calls.contains_key(id)).or_else(|| {
                    self.calls
                        .iter()
                        .find(|(_, call)| call.call_id == call_id)
                        .map(|(key, _)| key.clone())
                });
                let streamed = key.and_then(|key| self.calls.remove(&key));
                // The item carries the whole arguments; the streamed ones stand in for a
                // compatible server that leaves them out here.
                let arguments = match streamed {
                    Some(call) if arguments.is_empty() => call.arguments,
                    _ => arguments,
                };
                self.called = true;
                out.push(ModelEvent::ToolCall {
                    call: ToolCall {
                        id: call_id,
                        name,
                        arguments: tool_arguments(arguments),
                    },
                });
            }
            Item::Other => {}
        }
    }
}

impl Adapter for Decoder {
    const PATH: &'static str = "/responses";

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
        // The `type` inside the data repeats the `event:` field; decoding the data alone keeps
        // one source of truth.
        let decoded: Event =
            serde_json::from_str(&event.data).map_err(|e| malformed(&event, &e))?;
        match decoded {
            Event::OutputTextDelta { delta } => {
                if !delta.is_empty() {
                    out.push(ModelEvent::TextDelta { text: delta });
                }
            }
            Event::ReasoningSummaryDelta {
                item_id,
                summary_index,
                delta,
            } => {
                let part = Some((item_id, summary_index));
                // Summary parts read as paragraphs, the way `Reasoning::readable_text` joins them.
                if self.summary_part.is_some() && self.summary_part != part {
                    out.push(ModelEvent::ReasoningDelta {
                        text: "\n\n".to_owned(),
                    });
                }
                self.summary_part = part;
                if !delta.is_empty() {
                    out.push(ModelEvent::ReasoningDelta { text: delta });
                }
            }
            Event::OutputItemAdded { item } => {
                if let Item::FunctionCall {
                    id: Some(id),
                    call_id,
                    name,
                    arguments,
                } = item
                {
                    let call = PartialCall {
                        call_id,
                        name,
                        arguments,
                    };
                    self.calls.insert(id, call);
                }
            }
            Event::FunctionCallArgumentsDelta { item_id, delta } => {
                if let Some(call) = self.calls.get_mut(&item_id) {
                    call.arguments.push_str(&delta);
                }
            }
            Event::FunctionCallArgumentsDone { item_id, arguments } => {
                if let Some(call) = self.calls.get_mut(&item_id) {
                    call.arguments = arguments;
                }
            }
            Event::OutputItemDone { item } => self.item_done(item, out),
            Event::Completed { response } => {
                self.finish_calls(out);
                out.extend(response.usage.map(|usage| ModelEvent::Usage {
                    usage: usage.normalized(),
                }));
                let stop = if self.called {
                    StopReason::ToolUse
                } else {
                    StopReason::EndTurn
                };
                return Ok(Some(stop));
            }
            Event::Incomplete { response } => {
                // A call cut off by the limit is not a call the agent could run.
                self.calls.clear();
                out.extend(response.usage.map(|usage| ModelEvent::Usage {
                    usage: usage.normalized(),
                }));
                let reason = response.incomplete_details.and_then(|d| d.reason);
                let stop = match reason.as_deref() {
                    Some("max_output_tokens") => StopReason::MaxTokens,
                    _ => StopReason::Other,
                };
                return Ok(Some(stop));
            }
            Event::Failed { response } => {
                let (code, message) = response
                    .error
                    .map_or((None, None), |error| (error.code, error.message));
                return Err(reported(code, message));
            }
            Event::Error {
                code,
                message,
                error,
            } => {
                let (nested_code, nested_message) =
                    error.map_or((None, None), |error| (error.code, error.message));
                return Err(reported(code.or(nested_code), message.or(nested_message)));
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
        ModelSettings {
            reasoning: Some(ReasoningEffort::High),
            ..ModelSettings::defaults_for("gpt-5")
        }
    }

    fn request() -> ModelRequest {
        ModelRequest {
            reasoning: None,
            model: ModelRef::parse("openai/gpt-5").unwrap(),
            system: "You are terse.".into(),
            messages: vec![
                Message::User {
                    text: "What is in the screenshot?".into(),
                },
                Message::Assistant {
                    reasoning: vec![
                        Reasoning::OpenaiReasoning {
                            id: "rs_1".into(),
                            summary: vec!["**Looking**".into(), "Read it first.".into()],
                            encrypted_content: Some("gAAAAB+enc/1==".into()),
                        },
                        Reasoning::Thinking {
                            thinking: "another provider's".into(),
                            signature: "sig".into(),
                        },
                    ],
                    text: "Reading it.".into(),
                    tool_calls: vec![ToolCall {
                        id: "call_1".into(),
                        name: "read".into(),
                        arguments: json!({ "path": "shot.png" }),
                    }],
                },
                Message::ToolResult {
                    images: vec![Image {
                        media_type: "image/png".into(),
                        data_base64: "iVBORw0K".into(),
                    }],
                    call_id: "call_1".into(),
                    name: "read".into(),
                    content: "shot.png: 640x480 PNG".into(),
                    is_error: false,
                },
            ],
            tools: vec![ToolSpec {
                name: "read".into(),
                description: "Read a file".into(),
                parameters: json!({ "type": "object", "properties": { "path": { "type": "string" } } }),
            }],
            max_output_tokens: 1024,
        }
    }

    fn body(request: &ModelRequest, settings: &ModelSettings) -> Value {
        let key = CacheKey::for_conversation("ses_1");
        serde_json::from_slice(&request_body(request, settings, Some(&key))).unwrap()
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
        let body = body(&request(), &settings());
        insta::assert_snapshot!(serde_json::to_string_pretty(&body).unwrap(), @r#"
        {
          "include": [
            "reasoning.encrypted_content"
          ],
          "input": [
            {
              "content": [
                {
                  "text": "What is in the screenshot?",
                  "type": "input_text"
                }
              ],
              "role": "user",
              "type": "message"
            },
            {
              "encrypted_content": "gAAAAB+enc/1==",
              "id": "rs_1",
              "summary": [
                {
                  "text": "**Looking**",
                  "type": "summary_text"
                },
                {
                  "text": "Read it first.",
                  "type": "summary_text"
                }
              ],
              "type": "reasoning"
            },
            {
              "content": [
                {
                  "text": "Reading it.",
                  "type": "output_text"
                }
              ],
              "role": "assistant",
              "type": "message"
            },
            {
              "arguments": "{\"path\":\"shot.png\"}",
              "call_id": "call_1",
              "name": "read",
              "type": "function_call"
            },
            {
              "call_id": "call_1",
              "output": [
                {
                  "text": "shot.png: 640x480 PNG",
                  "type": "input_text"
                },
                {
                  "detail": "auto",
                  "image_url": "data:image/png;base64,iVBORw0K",
                  "type": "input_image"
                }
              ],
              "type": "function_call_output"
            }
          ],
          "instructions": "You are terse.",
          "max_output_tokens": 1024,
          "model": "gpt-5",
          "prompt_cache_key": "6841447f7cc3c2cba0a143e5711fd611",
          "reasoning": {
            "effort": "high",
            "summary": "auto"
          },
          "store": false,
          "stream": true,
          "tools": [
            {
              "description": "Read a file",
              "name": "read",
              "parameters": {
                "properties": {
                  "path": {
                    "type": "string"
                  }
                },
                "type": "object"
              },
              "strict": false,
              "type": "function"
            }
          ]
        }
        "#);
    }

    #[test]
    fn without_reasoning_nothing_about_it_is_asked() {
        let settings = ModelSettings {
            reasoning: None,
            ..settings()
        };
        let body = body(&request(), &settings);
        assert_eq!(body.get("reasoning"), None);
        assert_eq!(body.get("include"), None);
    }

    #[test]
    fn a_model_without_images_gets_the_text_and_a_note() {
        let settings = ModelSettings {
            images: false,
            ..settings()
        };
        let body = body(&request(), &settings);
        assert_eq!(
            body["input"][4]["output"],
            "shot.png: 640x480 PNG\n\n(the image is not shown: model openai/gpt-5 takes no images; set images = true in [providers.openai.models.\"gpt-5\"] if it does)"
        );
    }

    #[test]
    fn reasoning_without_encrypted_content_is_not_sent_back() {
        let mut request = request();
        if let Message::Assistant { reasoning, .. } = &mut request.messages[1] {
            *reasoning = vec![Reasoning::OpenaiReasoning {
                id: "rs_2".into(),
                summary: Vec::new(),
                encrypted_content: None,
            }];
        }
        let body = body(&request, &settings());
        let types: Vec<&str> = body["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            types,
            [
                "message",
                "message",
                "function_call",
                "function_call_output"
            ]
        );
    }

    fn sse(data: &str) -> SseEvent {
        SseEvent {
            event: None,
            data: data.to_owned(),
        }
    }

    #[test]
    fn summary_parts_stream_as_paragraphs_and_unknown_events_are_ignored() {
        let mut decoder = Decoder::default();
        let mut out = Vec::new();
        for data in [
            r#"{"type":"response.reasoning_summary_text.delta","item_id":"rs_1","output_index":0,"summary_index":0,"delta":"One","sequence_number":3}"#,
            r#"{"type":"response.something_new","sequence_number":4}"#,
            r#"{"type":"response.reasoning_summary_text.delta","item_id":"rs_1","output_index":0,"summary_index":1,"delta":"Two","sequence_number":5}"#,
        ] {
            assert_eq!(decoder.decode(sse(data), &mut out).unwrap(), None);
        }
        let text: String = out
            .iter()
            .map(|event| match event {
                ModelEvent::ReasoningDelta { text } => text.as_str(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(text, "One\n\nTwo");
    }

    #[test]
    fn a_call_is_emitted_once_even_when_its_done_item_has_no_id() {
        let mut decoder = Decoder::default();
        let mut out = Vec::new();
        for data in [
            r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"fc_1","type":"function_call","status":"in_progress","arguments":"","call_id":"call_1","name":"read"}}"#,
            r#"{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":0,"delta":"{\"path\":\"a\"}"}"#,
            r#"{"type":"response.output_item.done","output_index":0,"item":{"type":"function_call","arguments":"","call_id":"call_1","name":"read"}}"#,
        ] {
            assert_eq!(decoder.decode(sse(data), &mut out).unwrap(), None);
        }
        let completed =
            r#"{"type":"response.completed","response":{"status":"completed","usage":null}}"#;
        assert_eq!(
            decoder.decode(sse(completed), &mut out).unwrap(),
            Some(StopReason::ToolUse)
        );
        assert_eq!(
            out,
            [ModelEvent::ToolCall {
                call: ToolCall {
                    id: "call_1".into(),
                    name: "read".into(),
                    arguments: json!({ "path": "a" }),
                }
            }]
        );
    }

    #[test]
    fn a_refusal_reads_as_the_answer() {
        let mut decoder = Decoder::default();
        let mut out = Vec::new();
        let refusal = r#"{"type":"response.refusal.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"I can't help with that.","sequence_number":4}"#;
        decoder.decode(sse(refusal), &mut out).unwrap();
        assert_eq!(
            out,
            [ModelEvent::TextDelta {
                text: "I can't help with that.".into()
            }]
        );
    }

    #[test]
    fn failure_codes_choose_the_kind() {
        let kind = |code: Option<&str>| reported(code.map(str::to_owned), None).kind;
        assert_eq!(
            kind(Some("rate_limit_exceeded")),
            ModelErrorKind::RateLimited
        );
        assert_eq!(kind(Some("server_error")), ModelErrorKind::ProviderFailed);
        assert_eq!(
            kind(Some("context_length_exceeded")),
            ModelErrorKind::Rejected
        );
        assert_eq!(kind(None), ModelErrorKind::Rejected);
    }
}
