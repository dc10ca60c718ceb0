//! Test-only helpers: a fake model provider that speaks real HTTP and server-sent events (and
//! can misbehave on purpose), builders for the OpenAI (Chat Completions and Responses) and
//! Anthropic stream formats, temporary git repositories, and throwaway PostgreSQL clusters.
//!
//! Nothing here is linked into a shipped binary. It deliberately does not mock Skiff's own
//! types: fakes sit on the far side of a real wire format so the code under test runs unchanged.

// A helper that cannot do its job should fail the test on the spot, with the reason.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test support: failing loudly is the point"
)]

pub mod anthropic_cache;
pub mod anthropic_sse;
mod fake_forge;
mod fake_provider;
pub mod fake_slack;
mod git;
pub mod git_http;
pub mod oidc_provider;
pub mod openai_responses_sse;
pub mod openai_sse;
pub mod postgres;

pub use fake_forge::FakeForge;
pub use fake_provider::{FakeProvider, FakeResponse, RecordedRequest};
pub use git::TempGitRepo;

/// The `fake-mcp-server` binary of this crate (a stdio MCP server, see its source), built
/// first when missing: a test of another crate cannot depend on a binary, and a workspace
/// build (`scripts/test`) has built it already.
pub fn fake_mcp_server() -> std::path::PathBuf {
    static BUILT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test binary> → target/<profile>/fake-mcp-server
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("fake-mcp-server");
    let _one = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args([
                "build",
                "-p",
                "skiff-test-support",
                "--bin",
                "fake-mcp-server",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(status.success(), "could not build fake-mcp-server");
    }
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// Splits `text` into `n` pieces of roughly equal length (fewer when it is shorter), never
/// inside a UTF-8 character, as a provider splits streamed JSON.
fn fragments(text: &str, n: usize) -> Vec<&str> {
    let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    let n = n.clamp(1, chars.len().max(1));
    let mut pieces = Vec::with_capacity(n);
    let mut start = 0;
    for k in 1..=n {
        let end = if k == n {
            text.len()
        } else {
            chars[k * chars.len() / n]
        };
        pieces.push(&text[start..end]);
        start = end;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::fragments;

    #[test]
    fn fragments_rejoin_to_the_text() {
        for (text, n) in [("{\"a\":1}", 3), ("é€😀", 2), ("ab", 5), ("", 3)] {
            let pieces = fragments(text, n);
            assert_eq!(pieces.concat(), text);
            assert!(pieces.len() <= n.max(1));
        }
        assert_eq!(fragments("abcdef", 3), ["ab", "cd", "ef"]);
    }
}
