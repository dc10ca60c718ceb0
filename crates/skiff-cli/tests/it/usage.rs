//! Token usage and cost as a user reads them: a real gateway with priced models behind a fake
//! OpenAI-compatible provider that reports prompt-cache hits the way OpenAI does.

use crate::harness::{Gateway, stderr, stdout};
use serde_json::Value;
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};

/// A final reply whose usage chunk says `cached` of `prompt` tokens came from the cache.
fn reply(text: &str, prompt: u64, completion: u64, cached: u64) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&[text]);
    events.extend(openai_sse::finish("stop"));
    events.extend(openai_sse::usage_cached(prompt, completion, cached));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

#[test]
fn session_show_prints_cached_tokens_and_cost_per_turn_and_in_total() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let fake = rt.block_on(FakeProvider::start(vec![
        reply("First.", 3000, 100, 0),
        reply("Second.", 4000, 50, 2816),
    ]));
    // No cache_write price: OpenAI bills none, and a left-out price is the input price.
    let config = format!(
        "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\n\
         [providers.openai.prices.\"gpt-fake\"]\ninput = 2.5\noutput = 10.0\ncache_read = 1.25\n",
        fake.base_url()
    );
    let gw = Gateway::start_full("", &config, &[]);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = gw.new_session(repo.path(), "openai/gpt-fake", "first");
    let out = gw.run(&["session", "send", &id, "second"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // 3000 × 2.5 + 100 × 10 = $0.0085; (4000 − 2816) × 2.5 + 2816 × 1.25 + 50 × 10 = $0.00698.
    let shown = stdout(&gw.run(&["session", "show", &id]));
    // The two run lines and the total, from their token counts on.
    let runs: Vec<&str> = shown
        .lines()
        .filter(|l| l.contains(" tokens"))
        .map(|l| &l[l.find(" in ").unwrap() + 1..])
        .collect();
    assert_eq!(
        runs,
        [
            "in 3000 / out 100 tokens · $0.0085",
            "in 4000 (2816 read from cache) / out 50 tokens · $0.0070",
            "in 7000 (2816 read from cache) / out 150 tokens · $0.0155",
        ],
        "{shown}"
    );
    assert!(shown.contains("\ntotal      in 7000"), "{shown}");

    let detail = gw.json(&["session", "show", "--json", &id]);
    let second = &detail["runs"][1];
    assert_eq!(second["cache_read_tokens"], 2816);
    assert!((second["cost_usd"].as_f64().unwrap() - 0.00698).abs() < 1e-9);
    assert_eq!(detail["totals"]["input_tokens"], 7000);
    assert!((detail["totals"]["cost_usd"].as_f64().unwrap() - 0.01548).abs() < 1e-9);
    // The UI reckons costs from the session's model prices, cache prices filled in.
    assert_eq!(
        detail["session"]["model"]["prices"],
        serde_json::json!({ "input": 2.5, "output": 10.0, "cache_read": 1.25, "cache_write": 2.5 })
    );
    // Each model response keeps its own usage in the transcript.
    let usages: Vec<Value> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "assistant_message")
        .map(|e| e["body"]["usage"].clone())
        .collect();
    assert_eq!(usages[1]["cache_read_tokens"], 2816);
    assert_eq!(usages[0].get("cache_read_tokens"), None);
}

#[test]
fn a_model_without_prices_shows_tokens_and_no_cost() {
    let gw = Gateway::start("[[turns]]\ntext = \"Done.\"\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = gw.new_session(repo.path(), "fake/e2e", "go");
    let detail = gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["runs"][0].get("cost_usd"), None);
    assert_eq!(detail["totals"].get("cost_usd"), None);
    let shown = stdout(&gw.run(&["session", "show", &id]));
    assert!(!shown.contains('$'), "{shown}");
}
