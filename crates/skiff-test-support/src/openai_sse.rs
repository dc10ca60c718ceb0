//! OpenAI chat-completions streaming events as the API writes them (`data: <chunk>\n\n`, with
//! `"usage": null` on every chunk but the last, as `stream_options.include_usage` makes it).
//!
//! Every builder returns whole events, one per element, so they concatenate into a response.

use crate::fragments;
use serde_json::Value;

fn chunk(choices: &str, usage: &str) -> String {
    format!(
        r#"data: {{"id":"chatcmpl-fake","object":"chat.completion.chunk","created":1700000000,"model":"gpt-fake","system_fingerprint":"fp_fake","choices":{choices},"usage":{usage}}}"#
    ) + "\n\n"
}

fn choice(delta: &str, finish_reason: &str) -> String {
    format!(r#"[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish_reason}}}]"#)
}

fn quote(text: &str) -> String {
    Value::from(text).to_string()
}

/// The opening role chunk, then one content chunk per element.
pub fn text_chunks(texts: &[&str]) -> Vec<String> {
    let role = chunk(
        &choice(r#"{"role":"assistant","content":""}"#, "null"),
        "null",
    );
    let deltas = texts.iter().map(|text| {
        let delta = format!(r#"{{"content":{}}}"#, quote(text));
        chunk(&choice(&delta, "null"), "null")
    });
    std::iter::once(role).chain(deltas).collect()
}

/// Tool call number `index` of the response: a chunk with its id and name, then `args_json`
/// spread over `n` argument deltas.
pub fn tool_call(index: u32, id: &str, name: &str, args_json: &str, n: usize) -> Vec<String> {
    let head = format!(
        r#"{{"tool_calls":[{{"index":{index},"id":{},"type":"function","function":{{"name":{},"arguments":""}}}}]}}"#,
        quote(id),
        quote(name)
    );
    let fragments = fragments(args_json, n).into_iter().map(|fragment| {
        format!(
            r#"{{"tool_calls":[{{"index":{index},"function":{{"arguments":{}}}}}]}}"#,
            quote(fragment)
        )
    });
    std::iter::once(head)
        .chain(fragments)
        .map(|delta| chunk(&choice(&delta, "null"), "null"))
        .collect()
}

/// The chunk carrying `finish_reason` (`stop`, `tool_calls`, `length`, …) and an empty delta.
pub fn finish(reason: &str) -> Vec<String> {
    vec![chunk(&choice("{}", &quote(reason)), "null")]
}

/// The final usage chunk, whose `choices` is empty.
pub fn usage(prompt: u64, completion: u64) -> Vec<String> {
    usage_cached(prompt, completion, 0)
}

/// The final usage chunk of a request whose first `cached` prompt tokens (part of `prompt`)
/// came from the prompt cache, with the details objects OpenAI sends.
pub fn usage_cached(prompt: u64, completion: u64, cached: u64) -> Vec<String> {
    let usage = format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":{completion},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{cached},"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}"#,
        prompt + completion
    );
    vec![chunk("[]", &usage)]
}

pub fn done() -> Vec<String> {
    vec!["data: [DONE]\n\n".to_owned()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_valid_sse_and_json() {
        let events = [
            text_chunks(&["Hi \"you\""]),
            tool_call(0, "call_1", "ls", r#"{"path":"."}"#, 3),
            finish("tool_calls"),
            usage(3, 4),
        ]
        .concat();
        for event in &events {
            let data = event
                .strip_prefix("data: ")
                .unwrap()
                .strip_suffix("\n\n")
                .unwrap();
            serde_json::from_str::<Value>(data).unwrap();
        }
        assert_eq!(events.len(), 2 + 4 + 2);
        assert_eq!(
            tool_call(1, "c", "ls", "{}", 1)[1],
            "data: {\"id\":\"chatcmpl-fake\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-fake\",\"system_fingerprint\":\"fp_fake\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"arguments\":\"{}\"}}]},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
        );
    }
}
