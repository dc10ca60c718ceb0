//! OpenAI Responses API streaming events as the API writes them
//! (`event: <type>\ndata: <json>\n\n`, `type` first in the JSON, every event numbered by
//! `sequence_number`), for a response built item by item:
//!
//! ```ignore
//! let events = Response::new().reasoning("rs_1", &["Plan"], Some("gAAA…")).message(&["Hi"]).completed(10, 2, 0);
//! ```
//!
//! Each element of the result is one whole event, so a response can be cut short anywhere.

use crate::fragments;
use serde_json::{Value, json};

const RESPONSE_ID: &str = "resp_fake";

/// One streamed response being built: its events so far, the output items finished so far
/// (the terminal event repeats them, as the API does), and the next sequence number.
pub struct Response {
    events: Vec<String>,
    output: Vec<Value>,
    sequence: u64,
}

impl Default for Response {
    fn default() -> Self {
        Self::new()
    }
}

impl Response {
    /// `response.created` and `response.in_progress`.
    pub fn new() -> Response {
        let mut response = Response {
            events: Vec::new(),
            output: Vec::new(),
            sequence: 0,
        };
        let created = response.snapshot("in_progress", Value::Null, Value::Null, Value::Null);
        response.push("response.created", json!({ "response": created }));
        let created = response.snapshot("in_progress", Value::Null, Value::Null, Value::Null);
        response.push("response.in_progress", json!({ "response": created }));
        response
    }

    /// A reasoning item with one summary part per element of `summary` (each streamed in two
    /// deltas) and, when given, its encrypted content.
    pub fn reasoning(mut self, id: &str, summary: &[&str], encrypted: Option<&str>) -> Response {
        let index = self.output.len();
        let mut item = json!({ "id": id, "type": "reasoning", "summary": [] });
        if encrypted.is_some() {
            // The API sends the encrypted content on the finished item only.
            item["encrypted_content"] = Value::Null;
        }
        self.push(
            "response.output_item.added",
            json!({ "output_index": index, "item": item }),
        );
        for (summary_index, text) in summary.iter().enumerate() {
            let at =
                json!({ "item_id": id, "output_index": index, "summary_index": summary_index });
            let part = |text: &str| json!({ "type": "summary_text", "text": text });
            self.push(
                "response.reasoning_summary_part.added",
                merged(&at, json!({ "part": part("") })),
            );
            for delta in fragments(text, 2) {
                self.push(
                    "response.reasoning_summary_text.delta",
                    merged(&at, json!({ "delta": delta })),
                );
            }
            self.push(
                "response.reasoning_summary_text.done",
                merged(&at, json!({ "text": text })),
            );
            self.push(
                "response.reasoning_summary_part.done",
                merged(&at, json!({ "part": part(text) })),
            );
        }
        let summary: Vec<Value> = summary
            .iter()
            .map(|text| json!({ "type": "summary_text", "text": text }))
            .collect();
        let mut done = json!({ "id": id, "type": "reasoning", "summary": summary });
        if let Some(encrypted) = encrypted {
            done["encrypted_content"] = json!(encrypted);
        }
        self.finish_item(index, done)
    }

    /// An assistant message streaming one `output_text.delta` per element of `texts`.
    pub fn message(self, texts: &[&str]) -> Response {
        self.message_items(texts, true)
    }

    /// The start of an assistant message, its text streamed and nothing after it: a response
    /// cut short.
    pub fn message_unfinished(self, texts: &[&str]) -> Response {
        self.message_items(texts, false)
    }

    fn message_items(mut self, texts: &[&str], finish: bool) -> Response {
        let index = self.output.len();
        let id = format!("msg_fake_{index}");
        let message = |status: &str, content: Value| json!({ "id": id, "type": "message", "status": status, "role": "assistant", "content": content });
        let part = |text: &str| json!({ "type": "output_text", "annotations": [], "text": text });
        self.push(
            "response.output_item.added",
            json!({ "output_index": index, "item": message("in_progress", json!([])) }),
        );
        let at = json!({ "item_id": id, "output_index": index, "content_index": 0 });
        self.push(
            "response.content_part.added",
            merged(&at, json!({ "part": part("") })),
        );
        for text in texts {
            self.push(
                "response.output_text.delta",
                merged(&at, json!({ "delta": text, "logprobs": [] })),
            );
        }
        if !finish {
            return self;
        }
        let text = texts.concat();
        self.push(
            "response.output_text.done",
            merged(&at, json!({ "text": text, "logprobs": [] })),
        );
        self.push(
            "response.content_part.done",
            merged(&at, json!({ "part": part(&text) })),
        );
        let done = message("completed", json!([part(&text)]));
        self.finish_item(index, done)
    }

    /// A function call whose `args_json` streams over `n` `function_call_arguments.delta`s.
    pub fn function_call(
        mut self,
        call_id: &str,
        name: &str,
        args_json: &str,
        n: usize,
    ) -> Response {
        let index = self.output.len();
        let id = format!("fc_fake_{index}");
        let call = |status: &str, arguments: &str| json!({ "id": id, "type": "function_call", "status": status, "arguments": arguments, "call_id": call_id, "name": name });
        self.push(
            "response.output_item.added",
            json!({ "output_index": index, "item": call("in_progress", "") }),
        );
        let at = json!({ "item_id": id, "output_index": index });
        for delta in fragments(args_json, n) {
            self.push(
                "response.function_call_arguments.delta",
                merged(&at, json!({ "delta": delta })),
            );
        }
        self.push(
            "response.function_call_arguments.done",
            merged(&at, json!({ "arguments": args_json })),
        );
        let done = call("completed", args_json);
        self.finish_item(index, done)
    }

    /// `response.completed` with the usage of a request whose first `cached` input tokens
    /// (part of `input`) came from the prompt cache.
    pub fn completed(mut self, input: u64, output: u64, cached: u64) -> Vec<String> {
        let usage = usage(input, output, cached);
        let response = self.snapshot("completed", Value::Null, Value::Null, usage);
        self.push("response.completed", json!({ "response": response }));
        self.events
    }

    /// `response.incomplete` for `reason` (`max_output_tokens`, `content_filter`).
    pub fn incomplete(mut self, reason: &str, input: u64, output: u64) -> Vec<String> {
        let details = json!({ "reason": reason });
        let usage = usage(input, output, 0);
        let response = self.snapshot("incomplete", Value::Null, details, usage);
        self.push("response.incomplete", json!({ "response": response }));
        self.events
    }

    /// `response.failed` with the error `code` (`server_error`, `rate_limit_exceeded`, …).
    pub fn failed(mut self, code: &str, message: &str) -> Vec<String> {
        let error = json!({ "code": code, "message": message });
        let response = self.snapshot("failed", error, Value::Null, Value::Null);
        self.push("response.failed", json!({ "response": response }));
        self.events
    }

    /// An `error` event: the API's report of a failure outside a response's own status.
    pub fn error(mut self, code: &str, message: &str) -> Vec<String> {
        self.push(
            "error",
            json!({ "code": code, "message": message, "param": null }),
        );
        self.events
    }

    /// The events so far, with no terminal event.
    pub fn unfinished(self) -> Vec<String> {
        self.events
    }

    fn finish_item(mut self, index: usize, item: Value) -> Response {
        self.push(
            "response.output_item.done",
            json!({ "output_index": index, "item": item }),
        );
        self.output.push(item);
        self
    }

    /// The response object as the lifecycle events carry it.
    fn snapshot(&self, status: &str, error: Value, incomplete: Value, usage: Value) -> Value {
        json!({
            "id": RESPONSE_ID,
            "object": "response",
            "created_at": 1_700_000_000,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": null,
            "model": "gpt-fake",
            "output": self.output,
            "parallel_tool_calls": true,
            "store": false,
            "usage": usage,
        })
    }

    fn push(&mut self, kind: &str, fields: Value) {
        let fields = merged(&fields, json!({ "sequence_number": self.sequence }));
        self.sequence += 1;
        // `type` first, as the API writes it; serde_json would sort it among the others.
        let rest = fields.to_string();
        let rest = rest.strip_prefix('{').unwrap_or(&rest);
        let data = format!(
            "{{\"type\":{}{}{rest}",
            Value::from(kind),
            if rest == "}" { "" } else { "," }
        );
        self.events.push(format!("event: {kind}\ndata: {data}\n\n"));
    }
}

fn usage(input: u64, output: u64, cached: u64) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": { "cached_tokens": cached },
        "output_tokens": output,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": input + output,
    })
}

/// `a`'s fields and `b`'s, `b` winning.
fn merged(a: &Value, b: Value) -> Value {
    let mut merged = a.clone();
    if let (Some(into), Value::Object(from)) = (merged.as_object_mut(), b) {
        into.extend(from);
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(event: &str) -> Value {
        let (head, data) = event.split_once("\ndata: ").unwrap();
        let value: Value = serde_json::from_str(data.strip_suffix("\n\n").unwrap()).unwrap();
        assert_eq!(
            Some(head),
            value["type"]
                .as_str()
                .map(|t| format!("event: {t}"))
                .as_deref()
        );
        value
    }

    #[test]
    fn events_are_numbered_sse_with_type_first() {
        let events = Response::new()
            .reasoning("rs_1", &["Plan"], Some("enc"))
            .message(&["Hi"])
            .function_call("call_1", "read", r#"{"path":"a"}"#, 3)
            .completed(10, 2, 4);
        for (n, event) in events.iter().enumerate() {
            assert!(event.contains("\ndata: {\"type\":"), "{event}");
            assert_eq!(data(event)["sequence_number"], n as u64);
        }
        let last = data(events.last().unwrap());
        assert_eq!(last["response"]["output"].as_array().unwrap().len(), 3);
        assert_eq!(last["response"]["output"][0]["encrypted_content"], "enc");
        assert_eq!(
            last["response"]["usage"]["input_tokens_details"]["cached_tokens"],
            4
        );
        assert_eq!(
            events[events.len() - 2],
            "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"item\":{\"arguments\":\"{\\\"path\\\":\\\"a\\\"}\",\"call_id\":\"call_1\",\"id\":\"fc_fake_2\",\"name\":\"read\",\"status\":\"completed\",\"type\":\"function_call\"},\"output_index\":2,\"sequence_number\":20}\n\n"
        );
    }
}
