//! Git as sync runs it: on the gateway's own managed worktrees, and on data a box produced
//! (bundles). Never prompting, never running hooks, never reading the system config.

use skiff_process::Cmd;
use std::path::Path;
use std::time::Duration;

/// `git -C dir` with the hardening every sync step uses.
pub(crate) fn git(dir: &Path) -> Cmd {
    Cmd::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "core.fsmonitor=false",
            "-c",
            "core.quotePath=false",
        ])
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .timeout(Duration::from_secs(600))
        .output_cap(64 << 20)
}

/// Splits `-z` output into paths.
pub(crate) fn split_z(out: &str) -> impl Iterator<Item = &str> {
    out.split('\0').filter(|s| !s.is_empty())
}
