//! `exec`: a shell command in the workspace, through the shared process helper (clean
//! environment, own process group, timeout, cancellation kill the whole group).

use super::{MAX_RESULT_BYTES, Workspace};
use serde::Deserialize;
use skiff_process::{Cmd, Error};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const DEFAULT_TIMEOUT_S: u64 = 120;
const MAX_TIMEOUT_S: u64 = 3600;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExecArgs {
    command: String,
    timeout_s: Option<u64>,
}

pub(super) async fn exec(
    ws: &Workspace,
    extra_env: &[(String, String)],
    args: ExecArgs,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let timeout_s = args
        .timeout_s
        .unwrap_or(DEFAULT_TIMEOUT_S)
        .clamp(1, MAX_TIMEOUT_S);
    let mut cmd = Cmd::new("bash")
        .args(["-lc", &args.command])
        .cwd(ws.root())
        .timeout(Duration::from_secs(timeout_s))
        .output_cap(MAX_RESULT_BYTES)
        .merge_stderr()
        .env("TERM", "dumb")
        .env("PAGER", "cat")
        .env("GIT_PAGER", "cat")
        .env("GIT_TERMINAL_PROMPT", "0");
    for (k, v) in extra_env {
        cmd = cmd.env(k.clone(), v.clone());
    }
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
