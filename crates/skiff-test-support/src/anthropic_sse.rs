//! Anthropic Messages streaming events as the API writes them
//! (`event: <type>\ndata: <json>\n\n`, `type` first in the JSON as in the API reference).
//!
//! Every builder returns whole events, one per element, so they concatenate into a response.

use crate::fragments;
use serde_json::Value;

fn event(name: &str, data: &str) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn quote(text: &str) -> String {
    Value::from(text).to_string()
}

/// `message_start` of a response that used no prompt cache.
pub fn message_start(input_tokens: u64) -> Vec<String> {
    message_start_cached(input_tokens, 0, 0)
}

/// `message_start` with the usage the API reports for a request with cache breakpoints:
/// `input_tokens` is only the part after the last breakpoint; `cache_write` tokens were
/// written to the cache and `cache_read` tokens read from it.
pub fn message_start_cached(input_tokens: u64, cache_write: u64, cache_read: u64) -> Vec<String> {
    vec![event(
        "message_start",
        &format!(
            r#"{{"type":"message_start","message":{{"id":"msg_fake","type":"message","role":"assistant","content":[],"model":"claude-fake","stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":{input_tokens},"cache_creation_input_tokens":{cache_write},"cache_read_input_tokens":{cache_read},"output_tokens":1,"service_tier":"standard"}}}}}}"#
        ),
    )]
}

fn block(index: u32, start: &str, deltas: impl IntoIterator<Item = String>) -> Vec<String> {
    let start = event(
        "content_block_start",
        &format!(r#"{{"type":"content_block_start","index":{index},"content_block":{start}}}"#),
    );
    let deltas = deltas.into_iter().map(|delta| {
        event(
            "content_block_delta",
            &format!(r#"{{"type":"content_block_delta","index":{index},"delta":{delta}}}"#),
        )
    });
    let stop = event(
        "content_block_stop",
        &format!(r#"{{"type":"content_block_stop","index":{index}}}"#),
    );
    std::iter::once(start).chain(deltas).chain([stop]).collect()
}

/// A text block: start, one `text_delta` per element, stop.
pub fn text_block(index: u32, texts: &[&str]) -> Vec<String> {
    let deltas = texts
        .iter()
        .map(|text| format!(r#"{{"type":"text_delta","text":{}}}"#, quote(text)));
    block(index, r#"{"type":"text","text":""}"#, deltas)
}

/// A tool-use block: start (with `"input":{}`), `args_json` over `n` `input_json_delta`s, stop.
pub fn tool_use_block(index: u32, id: &str, name: &str, args_json: &str, n: usize) -> Vec<String> {
    let start = format!(
        r#"{{"type":"tool_use","id":{},"name":{},"input":{{}}}}"#,
        quote(id),
        quote(name)
    );
    let deltas = fragments(args_json, n).into_iter().map(|fragment| {
        format!(
            r#"{{"type":"input_json_delta","partial_json":{}}}"#,
            quote(fragment)
        )
    });
    block(index, &start, deltas)
}

/// A thinking block as extended thinking streams it: start (empty `thinking` and
/// `signature`), one `thinking_delta` per element of `texts`, one `signature_delta`, stop.
pub fn thinking_block(index: u32, texts: &[&str], signature: &str) -> Vec<String> {
    let deltas = texts
        .iter()
        .map(|text| format!(r#"{{"type":"thinking_delta","thinking":{}}}"#, quote(text)))
        .chain([format!(
            r#"{{"type":"signature_delta","signature":{}}}"#,
            quote(signature)
        )]);
    block(
        index,
        r#"{"type":"thinking","thinking":"","signature":""}"#,
        deltas,
    )
}

/// A `redacted_thinking` block: its encrypted `data` whole in the start event, no deltas.
pub fn redacted_thinking_block(index: u32, data: &str) -> Vec<String> {
    let start = format!(r#"{{"type":"redacted_thinking","data":{}}}"#, quote(data));
    block(index, &start, [])
}

/// `stop_reason` is `end_turn`, `tool_use`, `max_tokens`, …
pub fn message_delta(stop_reason: &str, output_tokens: u64) -> Vec<String> {
    vec![event(
        "message_delta",
        &format!(
            r#"{{"type":"message_delta","delta":{{"stop_reason":{},"stop_sequence":null}},"usage":{{"output_tokens":{output_tokens}}}}}"#,
            quote(stop_reason)
        ),
    )]
}

/// `message_delta` as the API sends it today: the usage repeats the cumulative input and cache
/// counts beside the output count.
pub fn message_delta_cached(
    stop_reason: &str,
    input_tokens: u64,
    cache_write: u64,
    cache_read: u64,
    output_tokens: u64,
) -> Vec<String> {
    vec![event(
        "message_delta",
        &format!(
            r#"{{"type":"message_delta","delta":{{"stop_reason":{},"stop_sequence":null}},"usage":{{"input_tokens":{input_tokens},"cache_creation_input_tokens":{cache_write},"cache_read_input_tokens":{cache_read},"output_tokens":{output_tokens}}}}}"#,
            quote(stop_reason)
        ),
    )]
}

pub fn message_stop() -> Vec<String> {
    vec![event("message_stop", r#"{"type":"message_stop"}"#)]
}

pub fn ping() -> Vec<String> {
    vec![event("ping", r#"{"type": "ping"}"#)]
}

/// An error event mid-stream, for example `error("overloaded_error", "Overloaded")`.
pub fn error(error_type: &str, message: &str) -> Vec<String> {
    vec![event(
        "error",
        &format!(
            r#"{{"type":"error","error":{{"type":{},"message":{}}}}}"#,
            quote(error_type),
            quote(message)
        ),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_match_the_documented_format() {
        assert_eq!(
            text_block(0, &["Hi"])[1],
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n"
        );
        let events = [
            message_start(5),
            ping(),
            thinking_block(0, &["Let me", " think"], "EqQBCgIYAhIM"),
            redacted_thinking_block(1, "EmwKAhgBEgy3va3pzix"),
            tool_use_block(1, "toolu_1", "read", r#"{"path":"a\"b"}"#, 4),
            message_delta("tool_use", 9),
            message_start_cached(5, 100, 2000),
            message_delta_cached("end_turn", 5, 100, 2000, 9),
            message_stop(),
            error("overloaded_error", "Overloaded"),
        ]
        .concat();
        for event in &events {
            let (_, data) = event.split_once("\ndata: ").unwrap();
            serde_json::from_str::<Value>(data.trim_end()).unwrap();
        }
    }
}
