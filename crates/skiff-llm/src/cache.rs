//! Prompt-cache metadata the gateway adds to provider requests.
//!
//! It owns what the provider is told about a request's place in a conversation (the OpenAI
//! `prompt_cache_key`); where Anthropic's `cache_control` breakpoints go is the Anthropic
//! adapter's, as a pure function of the request. Deliberately not part of
//! [`ModelRequest`](skiff_protocol::model::ModelRequest): a worker sends the context, and the
//! gateway alone decides cache metadata, so a session's provider requests are the same bytes
//! wherever its loop runs.

/// A stable, opaque key for one conversation's prompt cache, derived from the conversation's
/// id. Providers route requests with the same key to the same cache; the key reveals nothing
/// of the id it came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey(String);

/// Bumped if the derivation ever changes (which would cost every live conversation its cache).
const DOMAIN: &str = "skiff prompt-cache key v1";
/// Hex digits kept: 128 bits is collision-free at any scale and well within providers' limits.
const KEY_HEX_LEN: usize = 32;

impl CacheKey {
    /// The key of the conversation `id` (a session id): the same id always gives the same key.
    pub fn for_conversation(id: &str) -> CacheKey {
        let mut hasher = blake3::Hasher::new_derive_key(DOMAIN);
        hasher.update(id.as_bytes());
        let hex = hasher.finalize().to_hex();
        CacheKey(hex[..KEY_HEX_LEN].to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_distinct_and_opaque() {
        let a = CacheKey::for_conversation("ses_0123456789abcdef");
        assert_eq!(a, CacheKey::for_conversation("ses_0123456789abcdef"));
        assert_ne!(a, CacheKey::for_conversation("ses_0123456789abcdee"));
        assert_eq!(a.as_str().len(), KEY_HEX_LEN);
        assert!(!a.as_str().contains("ses_"));
    }
}
