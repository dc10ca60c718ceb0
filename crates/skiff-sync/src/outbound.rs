//! Laying a session's workspace onto a box, and recording the immutable base manifest.
//!
//! Git mode: the box gets a real repository — a `git bundle` of the session branch (at the
//! base commit) goes through ssh's stdin, the box fetches it into a fresh repository and checks
//! the branch out, then the working tree (tracked files as they are now, untracked files that
//! are not ignored) is laid over it and tracked files the user deleted are deleted, so
//! `git status` on the box shows the user's uncommitted changes. Plain mode: the listed files
//! are copied into a fresh directory.
//!
//! Limits (and, for a plain copy, that no file is private to its owner) are checked before
//! anything is sent; a box directory that exists and is not empty
//! is refused, never overwritten. Deliberately absent: git credentials and remotes on the box
//! (the bundle is fetched by path and then deleted).

use crate::filelist::{self, Limits, Mode};
use crate::git::{git, split_z};
use crate::rules::Rules;
use crate::transfer::{Method, Remote};
use crate::{Manifest, Result, Scratch, contain, manifest};
use skiff_ssh::shell_quote;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// What to lay onto a box.
#[derive(Clone, Copy, Debug)]
pub struct Outbound<'a> {
    /// The session's own workspace on the gateway (managed worktree or plain copy).
    pub local: &'a Path,
    pub mode: Mode,
    /// Git mode: the session id; the branch is `skiff/<session>`.
    pub session: &'a str,
    pub rules: &'a Rules,
    pub limits: &'a Limits,
    /// A private directory of the gateway for temporary files (the bundle).
    pub scratch: &'a Path,
    /// Author identity for commits made on the box (`user.name`, `user.email` of the box's
    /// repository); projected from gateway config.
    pub identity: Option<(&'a str, &'a str)>,
}

/// What was laid onto the box.
#[derive(Clone, Debug)]
pub struct Dispatched {
    /// The base manifest: keep it (it is what inbound sync diffs against).
    pub manifest: Manifest,
    pub method: Method,
    pub files: usize,
    pub bytes: u64,
    /// What the rules left behind (said to the user, never silent).
    pub left_out: filelist::LeftOut,
}

/// Lays `out.local` onto `remote` and returns the base manifest.
pub async fn push(
    out: &Outbound<'_>,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Dispatched> {
    let list = filelist::list(out.local, out.mode, out.rules, out.limits, cancel).await?;
    if out.mode == Mode::Plain {
        filelist::check_shareable(out.local, &list)?;
    }
    let base_commit = match out.mode {
        Mode::Git => Some(session_head(out.local, out.session, cancel).await?),
        Mode::Plain => None,
    };
    let base = manifest::build(out.local, &list, base_commit.clone())?;

    let dir = remote.quoted_dir();
    let empty = remote
        .run(
            &format!("if [ ! -e {dir} ] || [ -z \"$(ls -A {dir})\" ]; then echo empty; fi"),
            Vec::new(),
            cancel,
        )
        .await?;
    if empty.trim() != "empty" {
        return Err(crate::Error::RemoteNotEmpty {
            dir: remote.dir().to_owned(),
        });
    }

    if let Some(commit) = &base_commit {
        seed_repository(out, remote, commit, cancel).await?;
    }
    let method = remote.push_files(out.local, &list.paths(), cancel).await?;
    if out.mode == Mode::Git {
        let deleted = git(out.local)
            .args(["ls-files", "-z", "--deleted"])
            .run_checked(cancel)
            .await?;
        let mut input = Vec::new();
        for path in split_z(&deleted) {
            contain::check_path(path)?;
            input.extend_from_slice(path.as_bytes());
            input.push(0);
        }
        if !input.is_empty() {
            remote
                .run(&format!("cd {dir} && xargs -0 rm -f --"), input, cancel)
                .await?;
        }
    }
    Ok(Dispatched {
        manifest: base,
        method,
        files: list.files.len(),
        bytes: list.total_bytes,
        left_out: list.left_out,
    })
}

/// The commit of `refs/heads/skiff/<session>`, which must be what the worktree has checked out.
pub(crate) async fn session_head(
    worktree: &Path,
    session: &str,
    cancel: &CancellationToken,
) -> Result<String> {
    let branch = format!("refs/heads/skiff/{session}");
    let head = git(worktree)
        .args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"])
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned();
    let tip = git(worktree)
        .args(["rev-parse", "--verify", "--quiet"])
        .arg(format!("{branch}^{{commit}}"))
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned();
    if head != tip {
        return Err(crate::Error::Invalid {
            what: format!("the managed worktree {}", worktree.display()),
            detail: format!("HEAD is {head}, not the session branch {branch} ({tip})"),
        });
    }
    Ok(head)
}

async fn seed_repository(
    out: &Outbound<'_>,
    remote: &Remote,
    commit: &str,
    cancel: &CancellationToken,
) -> Result<()> {
    let scratch = Scratch::new(out.scratch, "bundle")?;
    let bundle = scratch.path().join("base.bundle");
    let branch = format!("refs/heads/skiff/{}", out.session);
    git(out.local)
        .args(["bundle", "create", "--quiet"])
        .arg(&bundle)
        .arg(&branch)
        .run_checked(cancel)
        .await?;
    let remote_bundle = format!(".skiff/sync/{}.bundle", out.session);
    remote.send_file(&bundle, &remote_bundle, cancel).await?;
    let (b, q) = (shell_quote(&remote_bundle), shell_quote(&branch));
    let mut script = format!(
        "set -e; export GIT_TERMINAL_PROMPT=0; mkdir -p {dir}; cd {dir}; \
         git init -q; git -c core.hooksPath=/dev/null fetch -q --no-tags \"$HOME\"/{b} {q}:{q}; \
         git symbolic-ref HEAD {q}; git -c core.hooksPath=/dev/null reset -q --hard {c}; rm -f \"$HOME\"/{b}",
        dir = remote.quoted_dir(),
        c = shell_quote(commit),
    );
    if let Some((name, email)) = out.identity {
        script.push_str(&format!(
            "; git config user.name {}; git config user.email {}",
            shell_quote(name),
            shell_quote(email)
        ));
    }
    remote.run(&script, Vec::new(), cancel).await?;
    Ok(())
}
