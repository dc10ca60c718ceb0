//! What the sandbox of gateway-placed sessions costs an `exec` call (printed, never asserted):
//! the median of 20 calls of `exec {command: "true"}` through the agent's tools, contained as
//! before (a PID namespace of its own, `unshare`) and sandboxed (`bwrap`, the workspace's
//! sandbox as the gateway builds it), interleaved so the machine's noise falls on both alike,
//! both with an empty `$HOME` (a login profile would otherwise dominate the unsandboxed figure).
//!
//! `cargo bench -p skiff-agent --bench exec` (`SKIFF_BENCH_ROUNDS` overrides the 20 calls).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use skiff_agent::tools::{Tools, sandbox};
use skiff_protocol::model::ToolCall;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn main() {
    let rounds: usize = std::env::var("SKIFF_BENCH_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // An empty home for both, so a login profile's cost (the sandbox hides the real home) is
    // not counted as the sandbox's.
    let home = tempfile::tempdir().unwrap();
    let env = vec![("HOME".to_owned(), home.path().display().to_string())];
    let plain = Tools::new(dir.path().to_path_buf(), env).unwrap();
    let sandboxed = plain
        .clone()
        .with_sandbox(sandbox::for_workspace(plain.workspace().root()));
    let call = ToolCall {
        id: "call_0".into(),
        name: "exec".into(),
        arguments: json!({"command": "true"}),
    };
    let cancel = CancellationToken::new();
    let time = |tools: &Tools| {
        runtime.block_on(async {
            let start = Instant::now();
            let out = tools.call(&call, &cancel).await;
            assert!(!out.is_error, "exec true failed: {}", out.content);
            start.elapsed()
        })
    };
    // One of each first: the ways of containing are probed once per process.
    time(&plain);
    time(&sandboxed);
    let (mut before, mut after) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        before.push(time(&plain));
        after.push(time(&sandboxed));
    }
    let (before, after) = (median(before), median(after));
    println!("exec `true`, median of {rounds} calls");
    println!("  contained (before): {:>8.2} ms", ms(before));
    println!("  sandboxed (after):  {:>8.2} ms", ms(after));
    println!(
        "  ratio after/before: {:>8.2}",
        after.as_secs_f64() / before.as_secs_f64()
    );
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
