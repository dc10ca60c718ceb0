//! Prompt caching on a long session (printed, never asserted): a scripted 30-turn coding
//! session (each turn: read a file, edit it, answer) against a fake Anthropic server that
//! honours `cache_control` the way the API does (`skiff_test_support::anthropic_cache`: a
//! prefix up to a breakpoint seen before is a cache read). Prints the input tokens billed
//! without caching (every prompt token at the input price) and with it (cache writes at 1.25×
//! and reads at 0.1× the input price, Anthropic's five-minute cache), the share of input read
//! from the cache after turn 2 (goal >= 70 %), and the median round trip of a model call.
//!
//! `cargo bench -p skiff-llm --bench prompt_cache`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use serde_json::{Value, json};
use skiff_llm::{Catalog, ProviderConfig};
use skiff_protocol::model::{Message, ModelEvent, ModelRef, ModelRequest, ToolCall, ToolSpec};
use skiff_test_support::anthropic_cache::PromptCache;
use skiff_test_support::anthropic_sse::{
    message_delta_cached, message_start_cached, message_stop, text_block, tool_use_block,
};
use skiff_test_support::{FakeProvider, FakeResponse, RecordedRequest};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

const TURNS: usize = 30;
const WARM_AFTER_TURN: usize = 2;
/// Anthropic's prices relative to plain input, for the five-minute cache.
const WRITE_FACTOR: f64 = 1.25;
const READ_FACTOR: f64 = 0.1;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A coding agent's context: a system prompt and tools about the size of Skiff's own.
fn context() -> ModelRequest {
    let rule = "Read before you edit; keep changes small; run the tests after each change and \
                report what you ran and what it printed. ";
    let tool = |name: &str| ToolSpec {
        name: name.into(),
        description: format!("{name}: {}", "Operates on the workspace. ".repeat(12)),
        parameters: json!({
            "type": "object",
            "properties": {
                "path": { "type": "string", "description": "Relative to the workspace root." },
                "content": { "type": "string", "description": "Text to write or insert." },
                "old": { "type": "string", "description": "Exact text to replace." },
            },
            "required": ["path"],
        }),
    };
    ModelRequest {
        reasoning: None,
        model: ModelRef::parse("anthropic/claude-sonnet-4-5").unwrap(),
        system: rule.repeat(60),
        messages: Vec::new(),
        tools: [
            "read",
            "write",
            "edit",
            "exec",
            "grep",
            "ls",
            "web_fetch",
            "web_search",
        ]
        .map(tool)
        .to_vec(),
        max_output_tokens: 4096,
    }
}

/// Answers as a model would in this session: read, then edit, then a final answer; usage as
/// the API accounts the prompt against its cache.
fn responder(cache: Arc<Mutex<PromptCache>>) -> impl FnMut(&[RecordedRequest]) -> FakeResponse {
    move |requests| {
        let body = &requests.last().unwrap().body;
        let usage = cache.lock().unwrap().account(body);
        let body: Value = serde_json::from_slice(body).unwrap();
        let messages = body["messages"].as_array().unwrap();
        let last_prompt = messages
            .iter()
            .rposition(|m| m["content"][0]["type"] == "text" && m["role"] == "user")
            .unwrap();
        let step = messages[last_prompt..]
            .iter()
            .filter(|m| m["role"] == "assistant")
            .count();
        let n = requests.len();
        let (content, stop) = match step {
            0 => (
                tool_use_block(
                    0,
                    &format!("toolu_{n}"),
                    "read",
                    r#"{"path":"src/parser.rs"}"#,
                    3,
                ),
                "tool_use",
            ),
            1 => (
                tool_use_block(
                    0,
                    &format!("toolu_{n}"),
                    "edit",
                    r#"{"path":"src/parser.rs","old":"a","content":"b"}"#,
                    3,
                ),
                "tool_use",
            ),
            _ => (text_block(0, &["Fixed it; the tests pass."]), "end_turn"),
        };
        let (input, write, read) = (
            usage.input_tokens,
            usage.cache_creation_input_tokens,
            usage.cache_read_input_tokens,
        );
        FakeResponse::sse(
            [
                message_start_cached(input, write, read),
                content,
                message_delta_cached(stop, input, write, read, 40),
                message_stop(),
            ]
            .concat(),
        )
    }
}

/// A tool's output: the file read is the bulk of a step's new context.
fn tool_output(call: &ToolCall, turn: usize) -> String {
    match call.name.as_str() {
        "read" => format!(
            "// turn {turn}\n{}",
            "fn parse(input: &str) -> Ast { todo!() }\n".repeat(40)
        ),
        _ => "edited src/parser.rs (1 replacement)".to_owned(),
    }
}

#[derive(Default)]
struct Totals {
    input: u64,
    read: u64,
    write: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cache = Arc::new(Mutex::new(PromptCache::default()));
    let fake = FakeProvider::start_with(responder(cache)).await;
    let providers: BTreeMap<String, ProviderConfig> = toml::from_str(&format!(
        "[anthropic]\napi = \"anthropic-messages\"\nbase_url = \"{}\"\n",
        fake.base_url()
    ))
    .unwrap();
    let catalog = Catalog::new(providers, None, std::path::Path::new("/"), None).unwrap();

    let mut request = context();
    let (mut all, mut warm) = (Totals::default(), Totals::default());
    let mut calls = 0;
    let mut round_trips = Vec::new();
    for turn in 1..=TURNS {
        request.messages.push(Message::User {
            text: format!("Turn {turn}: the parser test fails on input {turn}; fix it."),
        });
        loop {
            let started = Instant::now();
            let events: Vec<ModelEvent> = catalog
                .stream(request.clone(), None, CancellationToken::new())
                .collect()
                .await;
            round_trips.push(started.elapsed().as_secs_f64() * 1000.0);
            calls += 1;
            let (mut text, mut tool_calls) = (String::new(), Vec::new());
            for event in events {
                match event {
                    ModelEvent::TextDelta { text: t } => text.push_str(&t),
                    ModelEvent::ToolCall { call } => tool_calls.push(call),
                    ModelEvent::Usage { usage } => {
                        for t in [&mut all, &mut warm]
                            .into_iter()
                            .take(1 + usize::from(turn > WARM_AFTER_TURN))
                        {
                            t.input += usage.input_tokens;
                            t.read += usage.cache_read_tokens;
                            t.write += usage.cache_write_tokens;
                        }
                    }
                    ModelEvent::Error { message, .. } => panic!("{message}"),
                    ModelEvent::Done { .. }
                    | ModelEvent::ReasoningDelta { .. }
                    | ModelEvent::Reasoning { .. } => {}
                }
            }
            let results: Vec<Message> = tool_calls
                .iter()
                .map(|call| Message::ToolResult {
                    images: Vec::new(),
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    content: tool_output(call, turn),
                    is_error: false,
                })
                .collect();
            let done = tool_calls.is_empty();
            request.messages.push(Message::Assistant {
                reasoning: Vec::new(),
                text,
                tool_calls,
            });
            request.messages.extend(results);
            if done {
                break;
            }
        }
    }

    let uncached = all.input - all.read - all.write;
    let billed = uncached as f64 + all.write as f64 * WRITE_FACTOR + all.read as f64 * READ_FACTOR;
    println!("prompt caching, {TURNS} turns, {calls} model calls (fake Anthropic, ~4 bytes/token)");
    println!("  input tokens without caching   {:>9}", all.input);
    println!(
        "  with caching: {uncached} uncached + {} written + {} read = {:.0} input-token equivalents ({:.1} % of without)",
        all.write,
        all.read,
        billed,
        100.0 * billed / all.input as f64
    );
    println!(
        "  read from cache after turn {WARM_AFTER_TURN}: {:.1} % of input (goal >= 70 %)",
        100.0 * warm.read as f64 / warm.input as f64
    );
    println!(
        "  median model call round trip {:.2} ms",
        median(round_trips)
    );
}
