//! Anthropic prompt caching as the API accounts it, for fakes: a request's prompt is its
//! tools, then its system blocks, then its messages' content blocks, in that order; a
//! `cache_control` breakpoint makes the prefix up to and including its block cacheable.
//!
//! On each request the longest prefix seen before (at a breakpoint, or at most
//! [`LOOKBACK_BLOCKS`] blocks before one, as the API looks back) is read from the cache; the
//! prefixes at this request's breakpoints beyond it are written; what follows the last
//! breakpoint is plain input. A prefix shorter than [`MIN_CACHEABLE_TOKENS`] is not cached,
//! as with the API's Sonnet models. Tokens are estimated at four bytes each; entries never
//! expire (a benchmark runs well within the five-minute lifetime).

use serde_json::Value;
use std::collections::HashSet;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

/// How far before a breakpoint the API looks for an earlier cache entry.
pub const LOOKBACK_BLOCKS: usize = 20;
/// The shortest prefix the API caches for Claude Sonnet models.
pub const MIN_CACHEABLE_TOKENS: u64 = 1024;

/// One request's prompt, as the API bills it (the fields of its `usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// After the last breakpoint (the API's `input_tokens`).
    pub input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    pub cache_read_input_tokens: u64,
}

impl CacheUsage {
    pub fn total(&self) -> u64 {
        self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens
    }
}

/// The cache of one organisation: the prefixes written so far.
#[derive(Default)]
pub struct PromptCache {
    entries: HashSet<u64>,
}

struct Block {
    /// Of the prefix ending with this block.
    prefix_hash: u64,
    /// Of the prefix ending with this block.
    prefix_tokens: u64,
    breakpoint: bool,
}

impl PromptCache {
    /// Accounts one `POST /v1/messages` body and remembers what it wrote.
    pub fn account(&mut self, body: &[u8]) -> CacheUsage {
        let Ok(body) = serde_json::from_slice::<Value>(body) else {
            return CacheUsage::default();
        };
        let blocks = blocks(&body);
        let total = blocks.last().map_or(0, |b| b.prefix_tokens);
        let breakpoints: Vec<usize> = (0..blocks.len())
            .filter(|&i| blocks[i].breakpoint)
            .collect();
        let read = breakpoints
            .iter()
            .flat_map(|&b| (b.saturating_sub(LOOKBACK_BLOCKS)..=b).rev())
            .filter(|&i| self.entries.contains(&blocks[i].prefix_hash))
            .max();
        let read_tokens = read.map_or(0, |i| blocks[i].prefix_tokens);
        let mut written_to = read_tokens;
        for &b in &breakpoints {
            let block = &blocks[b];
            if block.prefix_tokens > read_tokens && block.prefix_tokens >= MIN_CACHEABLE_TOKENS {
                self.entries.insert(block.prefix_hash);
                written_to = block.prefix_tokens;
            }
        }
        CacheUsage {
            input_tokens: total - written_to,
            cache_creation_input_tokens: written_to - read_tokens,
            cache_read_input_tokens: read_tokens,
        }
    }
}

/// The prompt's blocks in cache order; a message's string content is one text block, and a
/// block's role is part of it. `cache_control` marks a breakpoint and is not prompt content.
fn blocks(body: &Value) -> Vec<Block> {
    let mut content: Vec<(String, bool)> = Vec::new();
    let mut push = |role: &str, block: &Value| {
        let mut block = block.clone();
        let breakpoint = block
            .as_object_mut()
            .and_then(|b| b.remove("cache_control"))
            .is_some();
        content.push((format!("{role}:{block}"), breakpoint));
    };
    for tool in body["tools"].as_array().into_iter().flatten() {
        push("tool", tool);
    }
    match &body["system"] {
        Value::String(text) => push(
            "system",
            &serde_json::json!({ "type": "text", "text": text }),
        ),
        Value::Array(system) => system.iter().for_each(|b| push("system", b)),
        _ => {}
    }
    for message in body["messages"].as_array().into_iter().flatten() {
        let role = message["role"].as_str().unwrap_or("");
        match &message["content"] {
            Value::String(text) => push(role, &serde_json::json!({ "type": "text", "text": text })),
            Value::Array(blocks) => blocks.iter().for_each(|b| push(role, b)),
            _ => {}
        }
    }
    let mut hasher = DefaultHasher::new();
    let mut tokens = 0;
    content
        .into_iter()
        .map(|(text, breakpoint)| {
            text.hash(&mut hasher);
            tokens += (text.len() as u64).div_ceil(4);
            Block {
                prefix_hash: hasher.finish(),
                prefix_tokens: tokens,
                breakpoint,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(messages: Value) -> Vec<u8> {
        let system = "s".repeat(8000);
        json!({
            "system": [{ "type": "text", "text": system, "cache_control": { "type": "ephemeral" } }],
            "messages": messages,
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_prefix_seen_before_at_a_breakpoint_is_read_and_the_rest_written() {
        let mut cache = PromptCache::default();
        let ephemeral = json!({ "type": "ephemeral" });
        let first = body(json!([
            { "role": "user", "content": [{ "type": "text", "text": "hi", "cache_control": ephemeral }] }
        ]));
        let cold = cache.account(&first);
        assert_eq!(cold.cache_read_input_tokens, 0);
        assert!(cold.cache_creation_input_tokens > MIN_CACHEABLE_TOKENS);
        assert_eq!(cold.input_tokens, 0);
        // The same prefix again, moved breakpoint and more after it: the old prefix is read.
        let second = body(json!([
            { "role": "user", "content": [{ "type": "text", "text": "hi" }] },
            { "role": "assistant", "content": [{ "type": "text", "text": "hello" }] },
            { "role": "user", "content": [{ "type": "text", "text": "more", "cache_control": ephemeral }] }
        ]));
        let warm = cache.account(&second);
        assert_eq!(warm.cache_read_input_tokens, cold.total());
        assert!(warm.cache_creation_input_tokens > 0);
        // Without breakpoints nothing is read or written.
        let plain = json!({ "system": "s".repeat(8000), "messages": [] }).to_string();
        let usage = cache.account(plain.as_bytes());
        assert_eq!(usage.input_tokens, usage.total());
    }
}
