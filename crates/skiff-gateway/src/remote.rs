//! Sessions from a remote repository (`POST /v1/sessions` with `repo`, `skiff session new
//! --repo URL [--ref REF]`): one bare clone per URL under `[store] workspaces` (`mirrors/`),
//! fetched again each time a session is made from it, and each session's worktree made from it
//! on branch `skiff/<id>` (see `workspace::remote_worktree_deferred`). `session publish` pushes
//! back to the clone's `origin`, the URL itself.
//!
//! Git talks to the remote with the gateway's own credentials (`[git.credentials."PREFIX"]`,
//! a `vault:NAME` or `env:VAR` token), handed to git through a credential helper that reads
//! them from git's own environment: never in a URL, an argument, the clone's configuration, a
//! log or an error, and never on a box (a box gets no remote at all).

use crate::config::{ConfigError, GitConfig};
use crate::state_dir::StateDir;
use skiff_process::Cmd;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The credential helper git runs for `get`: the user name and token from its environment.
/// Only variable names are in it, never a value.
const HELPER: &str = "credential.helper=!f() { test \"$1\" = get || return 0; \
    echo \"username=$SKIFF_GIT_USERNAME\"; echo \"password=$SKIFF_GIT_PASSWORD\"; }; f";

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error(
        "{url:?} is not a repository URL ({why}); give an https://, http://, ssh://, git:// or file:// URL, or a directory on the gateway host as the workspace instead"
    )]
    BadUrl { url: String, why: String },
    #[error("{git_ref:?} is not a ref name; give a branch, tag or commit of {url}")]
    BadRef { url: String, git_ref: String },
    #[error(
        "cannot reach the repository {url}: {detail}; check the URL and that the gateway's host can reach it"
    )]
    Unreachable { url: String, detail: String },
    #[error("the repository {url} refused the gateway's credentials ({detail}); {hint}")]
    AuthFailed {
        url: String,
        detail: String,
        hint: String,
    },
    #[error("the repository {url} has no ref {git_ref:?}; {known}")]
    UnknownRef {
        url: String,
        git_ref: String,
        known: String,
    },
    #[error(
        "the repository {url} has no commits yet (no default branch); push a first commit, or name a ref with --ref"
    )]
    Empty { url: String },
    #[error("cannot read the git credentials for {url} from `{key}`: {reason}")]
    Credential {
        url: String,
        key: String,
        reason: String,
    },
    #[error("git failed on the clone of {url}: {detail}")]
    Git { url: String, detail: String },
    #[error("cannot write the clone of {url} at {path}: {source}")]
    Io {
        url: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where a credential's token comes from.
#[derive(Clone, Debug)]
enum TokenSource {
    Env(String),
    Vault(String),
}

#[derive(Clone, Debug)]
struct Credential {
    prefix: String,
    username: String,
    token: TokenSource,
}

/// `[git.credentials]`, checked: longest prefix first.
#[derive(Clone, Debug, Default)]
pub(crate) struct Credentials {
    entries: Vec<Credential>,
}

/// A user name and token, resolved for one git command.
pub(crate) struct Resolved {
    username: String,
    token: String,
}

impl Credentials {
    pub(crate) fn from_config(config_path: &Path, git: &GitConfig) -> Result<Self, ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: config_path.display().to_string(),
            message: format!("at `git.credentials.\"{key}\"`: {message}"),
        };
        let mut entries = Vec::new();
        for (prefix, c) in &git.credentials {
            if check_url(prefix).is_err() && !prefix.contains("://") {
                return Err(invalid(
                    prefix,
                    "the key must be a URL prefix like \"https://git.example.com/\"".into(),
                ));
            }
            let token = match c.token.split_once(':') {
                Some(("vault", name)) if !name.is_empty() => TokenSource::Vault(name.to_owned()),
                Some(("env", var)) if !var.is_empty() => TokenSource::Env(var.to_owned()),
                _ => {
                    return Err(invalid(
                        prefix,
                        "`token` must be \"vault:NAME\" (a secret stored with `skiff secret set NAME`) or \"env:VAR\", never the token itself".into(),
                    ));
                }
            };
            let username = c
                .username
                .clone()
                .unwrap_or_else(|| "x-access-token".to_owned());
            if username.chars().any(char::is_control) {
                return Err(invalid(prefix, "`username` has a control character".into()));
            }
            entries.push(Credential {
                prefix: prefix.clone(),
                username,
                token,
            });
        }
        entries.sort_by_key(|e| std::cmp::Reverse(e.prefix.len()));
        Ok(Credentials { entries })
    }

    /// The credential configured for `url`, its token read now; `None` when none is.
    pub(crate) fn resolve(
        &self,
        url: &str,
        vault: &crate::vault::Vault,
    ) -> Result<Option<Resolved>, RemoteError> {
        let Some(entry) = self.entries.iter().find(|e| url.starts_with(&e.prefix)) else {
            return Ok(None);
        };
        let key = format!("git.credentials.\"{}\".token", entry.prefix);
        let failed = |reason: String| RemoteError::Credential {
            url: url.to_owned(),
            key: key.clone(),
            reason,
        };
        let token = match &entry.token {
            TokenSource::Env(var) => std::env::var(var).map_err(|_| {
                failed(format!(
                    "the gateway's environment variable {var} is not set"
                ))
            })?,
            TokenSource::Vault(name) => vault.open(name).map_err(|e| failed(e.to_string()))?,
        };
        Ok(Some(Resolved {
            username: entry.username.clone(),
            token,
        }))
    }

    /// What to tell a user whose credentials the remote refused.
    fn hint(&self, url: &str) -> String {
        match self.entries.iter().find(|e| url.starts_with(&e.prefix)) {
            Some(e) => format!(
                "check the token `git.credentials.\"{}\".token` names in skiff.toml (`skiff secret set NAME` replaces a vault secret)",
                e.prefix
            ),
            None => "give the gateway credentials for it: a `[git.credentials.\"PREFIX\"]` table with `token = \"vault:NAME\"` in skiff.toml".to_owned(),
        }
    }
}

/// Git as the gateway runs it on a clone: no prompts, no hooks, no command that repository
/// configuration names, and with `credential` (when given) as the only credential helper.
pub(crate) fn git(dir: &Path, credential: Option<&Resolved>) -> Cmd {
    let mut cmd = Cmd::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "core.hooksPath=/dev/null"])
        .args([
            "-c",
            "core.sshCommand=ssh",
            "-c",
            "protocol.ext.allow=never",
        ])
        .args([
            "-c",
            "core.fsmonitor=false",
            "-c",
            "uploadpack.packObjectsHook=",
        ])
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_ASKPASS", "/bin/false")
        .env("SSH_ASKPASS", "/bin/false")
        .timeout(Duration::from_secs(600));
    if let Some(c) = credential {
        cmd = cmd
            .args(["-c", "credential.helper=", "-c", HELPER])
            .env("SKIFF_GIT_USERNAME", &c.username)
            .env("SKIFF_GIT_PASSWORD", &c.token);
    } else if let Some(sock) = std::env::var_os("SSH_AUTH_SOCK") {
        cmd = cmd.env("SSH_AUTH_SOCK", sock);
    }
    cmd
}

/// Checks a repository URL: a known transport, no password, nothing git could take for an
/// option or a second line.
pub(crate) fn check_url(url: &str) -> Result<(), RemoteError> {
    let bad = |why: &str| RemoteError::BadUrl {
        url: redact_password(url),
        why: why.to_owned(),
    };
    if url.is_empty() || url.starts_with('-') {
        return Err(bad("it is empty or starts with '-'"));
    }
    if url.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(bad("it has a space or control character"));
    }
    match url.split_once("://") {
        Some((scheme, rest)) => {
            if !matches!(scheme, "https" | "http" | "ssh" | "git" | "file") {
                return Err(bad(&format!("the transport {scheme}:// is not supported")));
            }
            let authority = rest.split('/').next().unwrap_or_default();
            if let Some((userinfo, _)) = authority.rsplit_once('@')
                && userinfo.contains(':')
            {
                return Err(bad(
                    "it carries a password; put the gateway's credentials in `[git.credentials]` instead",
                ));
            }
            Ok(())
        }
        // scp-like `[user@]host:path`.
        None => match url.split_once(':') {
            Some((host, path)) if !host.is_empty() && !host.contains('/') && !path.is_empty() => {
                Ok(())
            }
            _ => Err(bad("it names no transport")),
        },
    }
}

/// `url` with the password of its user info (if any) replaced, fit for an error.
fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{host}{path}")
        }
        _ => url.to_owned(),
    }
}

/// The clone's directory name for a URL in a tenant (a trailing `/` does not make another
/// clone). Tenants never share a clone: a gateway-placed session can write its repository's
/// refs and objects, and another tenant's session branches are none of its business.
fn mirror_key(tenant: &str, url: &str) -> String {
    let normal = url.trim_end_matches('/');
    let hash = blake3::hash(format!("{tenant}\0{normal}").as_bytes()).to_hex();
    format!("{}.git", &hash[..16])
}

/// Sorts a failed git command's text into unreachable, refused credentials, or else.
fn classify(url: &str, credentials: &Credentials, e: skiff_process::Error) -> RemoteError {
    let detail = match &e {
        skiff_process::Error::Failed { stderr, .. } => stderr
            .lines()
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or_default()
            .trim()
            .to_owned(),
        other => other.to_string(),
    };
    let text = match &e {
        skiff_process::Error::Failed { stderr, .. } => stderr.to_ascii_lowercase(),
        _ => String::new(),
    };
    let auth = [
        "authentication failed",
        "could not read username",
        "could not read password",
        "terminal prompts disabled",
        "permission denied (publickey",
        "http 401",
        "http 403",
        "the requested url returned error: 401",
        "the requested url returned error: 403",
        "invalid username or password",
    ];
    if auth.iter().any(|a| text.contains(a)) {
        return RemoteError::AuthFailed {
            url: url.to_owned(),
            detail,
            hint: credentials.hint(url),
        };
    }
    let unreachable = [
        "could not resolve host",
        "connection refused",
        "failed to connect",
        "couldn't connect",
        "does not appear to be a git repository",
        "not found",
        "no such file or directory",
        "unable to access",
        "could not read from remote repository",
        "connection timed out",
        "unable to connect",
        "network is unreachable",
    ];
    if unreachable.iter().any(|a| text.contains(a))
        || matches!(e, skiff_process::Error::TimedOut { .. })
    {
        return RemoteError::Unreachable {
            url: url.to_owned(),
            detail,
        };
    }
    RemoteError::Git {
        url: url.to_owned(),
        detail,
    }
}

/// How a clone is brought up to date: every branch as `refs/remotes/origin/*` and every tag,
/// forced, so a ref a session wrote into the clone never survives a fetch (the session
/// branches, `refs/heads/skiff/*`, are not touched).
const FETCH: [&str; 7] = [
    "fetch",
    "--quiet",
    "--prune",
    "--prune-tags",
    "--force",
    "--tags",
    "origin",
];

/// A remote's commit, fetched into its clone.
pub(crate) struct Fetched {
    /// The bare clone.
    pub mirror: PathBuf,
    /// The commit the session starts from.
    pub commit: String,
}

/// Fetches `url` into `tenant`'s clone of it (made, fully, the first time: a clone that fails is removed)
/// and resolves `git_ref` (the remote's default branch when `None`) to a commit in it. Holds
/// the clone's lock; the caller makes the worktree under it (`lock` of the returned mirror).
pub(crate) async fn fetch(
    url: &str,
    git_ref: Option<&str>,
    credentials: &Credentials,
    vault: &crate::vault::Vault,
    state: &StateDir,
    tenant: &str,
    scratch_name: &str,
) -> Result<Fetched, RemoteError> {
    check_url(url)?;
    if let Some(r) = git_ref
        && (r.is_empty()
            || r.starts_with('-')
            || r.contains("..")
            || r.chars()
                .any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\".contains(c)))
    {
        return Err(RemoteError::BadRef {
            url: url.to_owned(),
            git_ref: r.to_owned(),
        });
    }
    let credential = credentials.resolve(url, vault)?;
    let cancel = CancellationToken::new();
    let mirror = state.mirror(&mirror_key(tenant, url));
    let io = |path: &Path| {
        let (url, path) = (url.to_owned(), path.display().to_string());
        move |source| RemoteError::Io { url, path, source }
    };
    let failed = |e| classify(url, credentials, e);
    let lock = crate::workspace::repo_lock(&mirror);
    let _one_at_a_time = lock.lock().await;
    if !mirror.join("HEAD").exists() {
        // Made aside and renamed into place whole: a clone that fails leaves nothing.
        let aside = mirror.with_extension(format!("new-{scratch_name}"));
        let _ = std::fs::remove_dir_all(&aside);
        std::fs::create_dir_all(&aside).map_err(io(&aside))?;
        let made = async {
            git(&aside, None)
                .args(["init", "--quiet", "--bare"])
                .run_checked(&cancel)
                .await
                .map_err(|e| RemoteError::Git {
                    url: url.to_owned(),
                    detail: e.to_string(),
                })?;
            git(&aside, None)
                .args(["remote", "add", "origin", "--"])
                .arg(url)
                .run_checked(&cancel)
                .await
                .map_err(|e| RemoteError::Git {
                    url: url.to_owned(),
                    detail: e.to_string(),
                })?;
            git(&aside, credential.as_ref())
                .args(FETCH)
                .run_checked(&cancel)
                .await
                .map_err(failed)?;
            Ok::<_, RemoteError>(())
        }
        .await;
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&aside);
            return Err(e);
        }
        std::fs::rename(&aside, &mirror).map_err(io(&mirror))?;
    } else {
        git(&mirror, credential.as_ref())
            .args(FETCH)
            .run_checked(&cancel)
            .await
            .map_err(failed)?;
    }
    let rev = |spec: String| {
        let mirror = mirror.clone();
        let cancel = cancel.clone();
        async move {
            git(&mirror, None)
                .args(["rev-parse", "--verify", "--quiet", "--end-of-options"])
                .arg(format!("{spec}^{{commit}}"))
                .run_checked(&cancel)
                .await
                .ok()
                .map(|s| s.trim().to_owned())
        }
    };
    let commit = match git_ref {
        None => {
            let listed = git(&mirror, credential.as_ref())
                .args(["ls-remote", "--symref", "origin", "HEAD"])
                .run_checked(&cancel)
                .await
                .map_err(failed)?;
            let branch = listed
                .lines()
                .find_map(|l| l.strip_prefix("ref: refs/heads/"))
                .and_then(|l| l.split('\t').next())
                .map(str::to_owned)
                .ok_or_else(|| RemoteError::Empty {
                    url: url.to_owned(),
                })?;
            rev(format!("refs/remotes/origin/{branch}"))
                .await
                .ok_or_else(|| RemoteError::Empty {
                    url: url.to_owned(),
                })?
        }
        Some(r) => {
            let mut found = None;
            for spec in [format!("refs/remotes/origin/{r}"), format!("refs/tags/{r}")] {
                if let Some(c) = rev(spec).await {
                    found = Some(c);
                    break;
                }
            }
            if found.is_none() && r.len() >= 7 && r.chars().all(|c| c.is_ascii_hexdigit()) {
                found = rev(r.to_owned()).await;
            }
            match found {
                Some(c) => c,
                None => {
                    let branches = git(&mirror, None)
                        .args([
                            "for-each-ref",
                            "--count=8",
                            "--format=%(refname:lstrip=3)",
                            "refs/remotes/origin/",
                        ])
                        .run_checked(&cancel)
                        .await
                        .unwrap_or_default();
                    let branches: Vec<&str> = branches
                        .lines()
                        .map(str::trim)
                        .filter(|b| !b.is_empty() && *b != "HEAD")
                        .collect();
                    let known = if branches.is_empty() {
                        "it has no branches".to_owned()
                    } else {
                        format!(
                            "name a branch, tag or commit of it (branches: {})",
                            branches.join(", ")
                        )
                    };
                    return Err(RemoteError::UnknownRef {
                        url: url.to_owned(),
                        git_ref: r.to_owned(),
                        known,
                    });
                }
            }
        }
    };
    Ok(Fetched { mirror, commit })
}

/// The URL of `remote` in a session's repository, when it has one.
pub(crate) async fn remote_url(repo: &str, remote: &str) -> Option<String> {
    git(Path::new(repo), None)
        .args(["remote", "get-url", "--"])
        .arg(remote)
        .run_checked(&CancellationToken::new())
        .await
        .ok()
        .map(|s| s.trim().to_owned())
}

/// A push's failure, sorted like a fetch's.
pub(crate) fn push_error(
    url: &str,
    credentials: &Credentials,
    e: skiff_process::Error,
) -> RemoteError {
    classify(url, credentials, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_with_a_password_or_an_unknown_transport_are_refused() {
        assert!(check_url("https://git.example.com/a/b.git").is_ok());
        assert!(check_url("git@github.com:a/b.git").is_ok());
        assert!(check_url("file:///srv/repo.git").is_ok());
        let err = check_url("https://me:hunter2@git.example.com/a.git").unwrap_err();
        assert!(err.to_string().contains("[git.credentials]"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(check_url("ext::sh -c evil").is_err());
        assert!(check_url("-uhttps://x").is_err());
        assert!(check_url("/srv/repo").is_err());
        assert!(check_url("gopher://x/y").is_err());
    }

    #[test]
    fn a_token_must_be_a_reference() {
        let git = GitConfig {
            credentials: [(
                "https://git.example.com/".to_owned(),
                crate::config::GitCredentialConfig {
                    username: None,
                    token: "ghp_literal".into(),
                },
            )]
            .into(),
        };
        let err = Credentials::from_config(Path::new("skiff.toml"), &git).unwrap_err();
        assert!(err.to_string().contains("vault:NAME"), "{err}");
        assert!(!err.to_string().contains("ghp_literal"), "{err}");
    }
}
