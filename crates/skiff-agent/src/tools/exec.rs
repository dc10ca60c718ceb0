//! `exec`: a shell command in the workspace, through the shared process helper: a clean
//! environment, and containment — the command runs as the init of a PID namespace of its own
//! with a parent-death signal, so every process it starts, `setsid`'d or double-forked
//! included, is killed at its timeout, on cancel, when it ends and when this process dies
//! (`skiff_process::Cmd::contained`). With a [`Ledger`], each running command is recorded so
//! the next gateway kills whatever a crash left behind. With a [`Sandbox`] (a workspace on the
//! gateway's host), the command sees only the system's read-only paths and its workspace.

use super::{MAX_RESULT_BYTES, Workspace};
use serde::Deserialize;
use skiff_process::{Cmd, Error, Ledger, Sandbox};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long a command may run when the call does not say; a test suite or a build fits, a
/// command waiting for input that never comes does not hold the turn for long.
pub(super) const DEFAULT_TIMEOUT_S: u64 = 120;
/// The longest a call may ask for; longer work belongs in several calls or in the background.
pub(super) const MAX_TIMEOUT_S: u64 = 3600;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExecArgs {
    command: String,
    /// The directory to run in, relative to the workspace root (the root when absent).
    workdir: Option<String>,
    timeout_s: Option<u64>,
}

pub(super) async fn exec(
    ws: &Workspace,
    extra_env: &[(String, String)],
    ledger: Option<&Ledger>,
    sandbox: Option<&Sandbox>,
    args: ExecArgs,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let timeout_s = args.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
    if !(1..=MAX_TIMEOUT_S).contains(&timeout_s) {
        return Err(format!(
            "timeout_s is {timeout_s}; give 1 to {MAX_TIMEOUT_S} seconds (the default is \
             {DEFAULT_TIMEOUT_S})"
        ));
    }
    let cwd = match &args.workdir {
        Some(dir) => workdir(ws, dir)?,
        None => ws.root().to_path_buf(),
    };
    let cmd = shell(extra_env, ledger, sandbox, &args.command, &cwd)
        .timeout(Duration::from_secs(timeout_s))
        .output_cap(MAX_RESULT_BYTES);
    match cmd.run(cancel).await {
        Ok(done) => {
            let code = done.code();
            let output = done.stdout.into_string();
            let text = format!("exit code: {code}\n{output}");
            if code == 0 { Ok(text) } else { Err(text) }
        }
        Err(Error::TimedOut { .. }) => Err(format!(
            "timed out after {timeout_s} s; the command and everything it started were killed"
        )),
        Err(Error::Cancelled { .. }) => {
            Err("cancelled; the command and everything it started were killed".to_owned())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `bash -lc command` in `cwd`, contained (in `sandbox` when given), with a clean environment
/// plus `extra_env`, and recorded in `ledger` while it runs: how every command the agent starts
/// is run.
pub(super) fn shell(
    extra_env: &[(String, String)],
    ledger: Option<&Ledger>,
    sandbox: Option<&Sandbox>,
    command: &str,
    cwd: &Path,
) -> Cmd {
    let mut cmd = Cmd::new("bash")
        .args(["-lc", command])
        .cwd(cwd)
        .merge_stderr()
        .contained()
        .env("TERM", "dumb")
        .env("PAGER", "cat")
        .env("GIT_PAGER", "cat")
        .env("GIT_TERMINAL_PROMPT", "0");
    for (k, v) in extra_env {
        cmd = cmd.env(k.clone(), v.clone());
    }
    if let Some(ledger) = ledger {
        cmd = cmd.ledger(ledger.clone());
    }
    if let Some(sandbox) = sandbox {
        cmd = cmd.sandbox(sandbox.clone());
    }
    cmd
}

/// A workspace directory to run in, checked like any tool path.
pub(super) fn workdir(ws: &Workspace, dir: &str) -> Result<PathBuf, String> {
    let path = ws.resolve(dir)?;
    // stat, not open: it follows a symlink (`resolve` checked where it goes) and never blocks.
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => Ok(path),
        Ok(meta) => Err(format!(
            "workdir {dir} is {}, not a directory",
            super::fsio::kind(&meta)
        )),
        Err(e) => Err(format!("workdir {dir}: {e}")),
    }
}
