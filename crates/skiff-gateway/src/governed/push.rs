//! `git_push`'s execution: the session branch, and only it, pushed from the session's
//! repository to the configured remote as the same branch (never forced). For an `https`
//! remote the credential goes to git from this one process's environment (never its command
//! line, never a file, never a box): the `[git.credentials]` entry for the remote's URL through
//! the gateway's credential helper, else the forge token as an HTTP header.

use crate::remote::Resolved;
use crate::sync_api::git;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use skiff_protocol::GrantId;
use skiff_protocol::grant::GitPushResult;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// Fails unless `dir` has a remote named `remote`.
pub(super) async fn check_remote(
    dir: &str,
    remote: &str,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let remotes = git(dir)
        .arg("remote")
        .run_checked(cancel)
        .await
        .map_err(|e| e.to_string())?;
    if remotes.lines().any(|r| r.trim() == remote) {
        Ok(())
    } else {
        Err(format!(
            "{dir} has no remote named {remote} ([forge] remote); add one with `git remote add {remote} URL`"
        ))
    }
}

/// The URL of `remote` in `dir`.
pub(super) async fn remote_url(
    dir: &str,
    remote: &str,
    cancel: &CancellationToken,
) -> Result<String, String> {
    check_remote(dir, remote, cancel).await?;
    git(dir)
        .args(["remote", "get-url", remote])
        .run_checked(cancel)
        .await
        .map(|s| s.trim().to_owned())
        .map_err(|e| e.to_string())
}

/// What a push authenticates with.
pub(super) enum Credential<'a> {
    /// The `[git.credentials]` entry whose prefix matches the remote's URL.
    Configured(&'a Resolved),
    /// The `[forge]` token, sent only to an `https` remote; empty when none is configured.
    Forge(&'a str),
}

impl<'a> Credential<'a> {
    pub(super) fn pick(configured: Option<&'a Resolved>, forge_token: &'a str) -> Self {
        match configured {
            Some(c) => Credential::Configured(c),
            None => Credential::Forge(forge_token),
        }
    }
}

pub(super) async fn push(
    dir: &str,
    remote: &str,
    branch: &str,
    credential: Credential<'_>,
    grant: &GrantId,
    cancel: &CancellationToken,
) -> Result<GitPushResult, String> {
    let commit = git(dir)
        .args(["rev-parse", "--verify", "--quiet"])
        .arg(format!("refs/heads/{branch}^{{commit}}"))
        .run_checked(cancel)
        .await
        .map_err(|_| format!("the session branch {branch} is gone from {dir}"))?
        .trim()
        .to_owned();
    let url = remote_url(dir, remote, cancel).await?;
    let mut cmd = match credential {
        Credential::Configured(c) => crate::remote::git(Path::new(dir), Some(c)),
        Credential::Forge(_) => git(dir),
    };
    if let Credential::Forge(token) = credential
        && url.starts_with("https://")
        && !token.is_empty()
    {
        let basic = BASE64.encode(format!("x-access-token:{token}"));
        cmd = cmd
            .env("GIT_CONFIG_COUNT", "1")
            .env("GIT_CONFIG_KEY_0", "http.extraHeader")
            .env(
                "GIT_CONFIG_VALUE_0",
                format!("Authorization: Basic {basic}"),
            );
    }
    cmd.args(["push", "--quiet", "--no-verify", remote])
        .arg(format!("refs/heads/{branch}:refs/heads/{branch}"))
        .run_checked(cancel)
        .await
        .map_err(|e| format!("pushing {branch} to {remote} failed: {e}"))?;
    Ok(GitPushResult {
        remote: remote.to_owned(),
        branch: branch.to_owned(),
        commit,
        grant: grant.clone(),
    })
}
