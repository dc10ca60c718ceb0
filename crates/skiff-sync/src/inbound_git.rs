//! Adopting a box's git work into the managed worktree. Commits come back as a bundle of
//! `base..skiff/<session>`; uncommitted and untracked files come back through the box's
//! manifest and a checked transfer (see [`crate::inbound_plain`]).
//!
//! Before anything is written: the bundle verifies, carries exactly one ref — the session's
//! branch — and its tip descends from the recorded base and from where the managed branch is
//! now; the managed branch has not moved; the worktree still matches the base manifest; and
//! every pulled byte matches the box's manifest. Then the branch is fast-forwarded with a
//! compare-and-swap `update-ref`, the worktree is reset to the new tip and the box's
//! uncommitted state is laid over it, so `git status` here shows what it showed on the box.
//! Divergence stops with both sides intact (objects fetched from the bundle are inert).
//!
//! Git on box-produced data runs with prompts off, hooks off and no system config.

use crate::filelist::{Limits, Mode};
use crate::git::{git, split_z};
use crate::inbound_plain::{self, Applied};
use crate::rules::Rules;
use crate::transfer::Remote;
use crate::{Error, Manifest, ManifestEntry, Result, Scratch, contain, join, quarantine};
use skiff_protocol::sync::{Refusal, RefusalKind};
use skiff_ssh::shell_quote;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// What to adopt into.
#[derive(Clone, Copy, Debug)]
pub struct Adoption<'a> {
    /// The managed worktree (on branch `skiff/<session>`).
    pub worktree: &'a Path,
    pub session: &'a str,
    /// The base manifest recorded at dispatch (its `base_commit` is the recorded base).
    pub base: &'a Manifest,
    /// Where the managed branch must still be (normally the recorded base).
    pub expected_head: &'a str,
    pub rules: &'a Rules,
    pub limits: &'a Limits,
    /// A private directory of the gateway on the worktree's file system.
    pub scratch: &'a Path,
}

/// What adoption did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adopted {
    /// The managed branch's commit now.
    pub head: String,
    /// Whether the branch moved (the box made commits).
    pub fast_forwarded: bool,
    pub files: Applied,
    /// What was not adopted, by path (`(commits)` for the box's commits); empty when
    /// everything was.
    pub refused: Vec<Refusal>,
    /// The box's branch tip when its commits were refused (their files were adopted as
    /// uncommitted changes where they passed).
    pub commits_refused: Option<String>,
    /// What the worktree holds now, as a manifest: the next base.
    pub manifest: Manifest,
    /// When adoption wrote nothing here: the worktree as the drift check listed and hashed it,
    /// which a checkpoint can take instead of listing it again.
    pub unchanged: Option<crate::checkpoint::Known>,
}

/// A bundle fetched from the box, in a private directory removed on drop.
pub struct Bundle {
    _dir: Scratch,
    path: PathBuf,
}

impl Bundle {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn branch(session: &str) -> String {
    format!("refs/heads/skiff/{session}")
}

/// Asks the box for a bundle of `base..skiff/<session>`; `None` when the box made no commits.
/// A bundle over `limits.max_total_bytes` is refused.
pub async fn fetch_bundle(
    remote: &Remote,
    session: &str,
    base: &str,
    limits: &Limits,
    scratch: &Path,
    cancel: &CancellationToken,
) -> Result<Option<Bundle>> {
    let started = std::time::Instant::now();
    let dir = remote.quoted_dir();
    let b = shell_quote(&branch(session));
    let tip = remote
        .run(
            &format!("cd {dir} && git rev-parse --verify --quiet {b}^{{commit}}"),
            Vec::new(),
            cancel,
        )
        .await?;
    tracing::debug!(
        ms = started.elapsed().as_millis() as u64,
        "inbound: the box's branch tip read"
    );
    if tip.trim() == base {
        return Ok(None);
    }
    let scratch = Scratch::new(scratch, "bundle-in")?;
    let path = scratch.path().join("box.bundle");
    remote
        .fetch_output(
            &format!(
                "cd {dir} && git bundle create --quiet - {}..{b}",
                shell_quote(base)
            ),
            &path,
            limits.max_total_bytes,
            cancel,
        )
        .await?;
    Ok(Some(Bundle {
        _dir: scratch,
        path,
    }))
}

/// Checks a bundle from the box against the managed worktree's repository: it verifies, and
/// its only ref is the session's branch. Returns the tip it carries.
pub async fn verify_bundle(
    worktree: &Path,
    bundle: &Path,
    session: &str,
    cancel: &CancellationToken,
) -> Result<String> {
    git(worktree)
        .args(["bundle", "verify", "--quiet"])
        .arg(bundle)
        .run_checked(cancel)
        .await
        .map_err(|e| Error::Diverged {
            worktree: worktree.display().to_string(),
            detail: format!("the box's bundle does not verify: {e}"),
        })?;
    let heads = git(worktree)
        .args(["bundle", "list-heads"])
        .arg(bundle)
        .run_checked(cancel)
        .await?;
    let want = branch(session);
    let lines: Vec<&str> = heads.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut tip = None;
    for line in &lines {
        match line.split_once(' ') {
            Some((sha, name)) if name == want && tip.is_none() && is_sha(sha) => {
                tip = Some(sha.to_owned());
            }
            _ => {}
        }
    }
    match tip {
        Some(tip) if lines.len() == 1 => Ok(tip),
        _ => Err(Error::ForeignRef {
            session: session.to_owned(),
            found: if lines.is_empty() {
                "no refs".into()
            } else {
                lines
                    .iter()
                    .map(|l| l.split_once(' ').map_or(*l, |(_, n)| n))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        }),
    }
}

fn is_sha(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

async fn is_ancestor(
    worktree: &Path,
    older: &str,
    newer: &str,
    cancel: &CancellationToken,
) -> Result<bool> {
    let done = git(worktree)
        .args(["merge-base", "--is-ancestor", older, newer])
        .run(cancel)
        .await?;
    Ok(done.status.success())
}

/// The workspace side of adoption, checked: the managed branch is where it was left and
/// checked out, and the worktree still matches the base manifest. It needs nothing from the
/// box, so a caller can run it beside [`fetch_bundle`] and hand it to [`adopt_checked`].
#[derive(Debug)]
pub struct Here {
    head: String,
    ours: Manifest,
}

/// Checks where things stand here (see [`Here`]).
pub async fn check_here(a: &Adoption<'_>, cancel: &CancellationToken) -> Result<Here> {
    let diverged = |detail: String| Error::Diverged {
        worktree: a.worktree.display().to_string(),
        detail,
    };
    // Both in one git call: the branch, and what the worktree has checked out.
    let revs = git(a.worktree)
        .arg("rev-parse")
        // `refs/heads/…`: never taken for an option.
        .arg(format!("{}^{{commit}}", branch(a.session)))
        .arg("HEAD^{commit}")
        .run_checked(cancel)
        .await?;
    let mut revs = revs.lines().map(str::trim);
    let (head, checked_out) = match (revs.next(), revs.next()) {
        (Some(head), Some(checked_out)) if is_sha(head) && is_sha(checked_out) => {
            (head.to_owned(), checked_out.to_owned())
        }
        _ => {
            return Err(diverged(format!(
                "cannot read the managed branch skiff/{} and HEAD",
                a.session
            )));
        }
    };
    if head != a.expected_head {
        return Err(diverged(format!(
            "the managed branch skiff/{} moved to {head} (expected {})",
            a.session, a.expected_head
        )));
    }
    if checked_out != head {
        return Err(diverged(format!(
            "the worktree has {checked_out} checked out, not the session branch"
        )));
    }
    let ours = inbound_plain::check_drift(a.worktree, Mode::Git, a.base, a.rules, a.limits, cancel)
        .await?;
    Ok(Here { head, ours })
}

/// Adopts the box's work: the commits in `bundle` (if any) and the uncommitted state described
/// by `theirs` (the box's manifest, git-mode listing).
pub async fn adopt(
    a: &Adoption<'_>,
    bundle: Option<&Path>,
    theirs: &Manifest,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Adopted> {
    let here = check_here(a, cancel).await?;
    adopt_checked(a, here, bundle, theirs, remote, cancel).await
}

/// [`adopt`], with the workspace side already checked.
pub async fn adopt_checked(
    a: &Adoption<'_>,
    here: Here,
    bundle: Option<&Path>,
    theirs: &Manifest,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Adopted> {
    // Path by path: what fails containment is refused by name (and kept by the caller), the
    // rest goes on through every check below.
    let screened = quarantine::screen(theirs, a.base, a.limits, a.rules)?;
    adopt_screened(a, here, bundle, screened, remote, cancel).await
}

/// [`adopt_checked`] of a box's manifest the caller already screened against `a.base` with
/// `a.limits` and `a.rules` ([`quarantine::screen`]): a reconciliation screens once, to keep
/// what is refused before anything is adopted.
pub async fn adopt_screened(
    a: &Adoption<'_>,
    here: Here,
    bundle: Option<&Path>,
    screened: quarantine::Screened,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Adopted> {
    let diverged = |detail: String| Error::Diverged {
        worktree: a.worktree.display().to_string(),
        detail,
    };
    let base = a
        .base
        .base_commit
        .clone()
        .ok_or_else(|| diverged("the base manifest records no base commit".into()))?;
    let mut refused = screened.refused;
    let theirs = &screened.manifest;
    let Here { head, ours } = here;

    // The box's commits: verified, fetched (objects only, no ref), descending from both.
    let tip = match bundle {
        Some(bundle) => {
            let tip = verify_bundle(a.worktree, bundle, a.session, cancel).await?;
            git(a.worktree)
                .args(["fetch", "--quiet", "--no-tags", "--no-write-fetch-head"])
                .arg(bundle)
                .arg(branch(a.session))
                .run_checked(cancel)
                .await?;
            for (older, what) in [(&base, "the recorded base"), (&head, "the managed branch")] {
                if !is_ancestor(a.worktree, older, &tip, cancel).await? {
                    return Err(diverged(format!(
                        "the box's branch tip {tip} does not descend from {what} {older}"
                    )));
                }
            }
            tip
        }
        None => head.clone(),
    };
    // Commits cannot be taken in part: when one carries something containment refuses, none
    // is adopted (they stay in the caller's quarantine); their files come back through the
    // screened manifest like uncommitted work.
    let mut commits_refused = None;
    // No commits, nothing to check (two full tree listings saved on every quiet turn).
    let mut problems = if tip == head {
        Vec::new()
    } else {
        check_commit_tree(a.worktree, &head, &tip, cancel).await?
    };
    if tip != head && !refused.is_empty() {
        // A path refused in the files must not arrive through the commits either.
        let committed = git(a.worktree)
            .args(["diff", "--name-only", "--no-renames", "-z", &head, &tip])
            .run_checked(cancel)
            .await?;
        let committed: BTreeSet<&str> = split_z(&committed).collect();
        for r in refused
            .iter()
            .filter(|r| committed.contains(r.path.as_str()))
        {
            problems.push(format!("{}: {}", r.path, r.reason));
        }
    }
    let tip = if problems.is_empty() {
        tip
    } else {
        refused.push(Refusal {
            path: "(commits)".into(),
            reason: format!(
                "the box's commits up to {tip} were not adopted ({}); the files that passed are adopted as uncommitted changes",
                problems.join("; ")
            ),
            kind: RefusalKind::Commits,
        });
        commits_refused = Some(tip);
        head.clone()
    };

    // What to write: every entry of the box that differs from the base, that the commits
    // touched, or that is uncommitted here (the reset below returns those to the tip); what to
    // delete: known paths the box no longer has (never excluded ones).
    let mut touched = BTreeSet::new();
    if tip != head {
        let committed = git(a.worktree)
            .args(["diff", "--name-only", "--no-renames", "-z", &head, &tip])
            .run_checked(cancel)
            .await?;
        for path in split_z(&committed) {
            let here = std::fs::symlink_metadata(join(a.worktree, path)).is_ok();
            if here
                && !a.base.entries.contains_key(path)
                && !tracked_at(a.worktree, &head, path, cancel).await?
            {
                return Err(diverged(format!(
                    "the box's commits write {path}, which exists here but was never synced (an ignored or excluded file)"
                )));
            }
            touched.insert(path.to_owned());
        }
        let dirty = git(a.worktree)
            .args(["diff", "--name-only", "--no-renames", "-z", "HEAD"])
            .run_checked(cancel)
            .await?;
        for path in split_z(&dirty) {
            let here = std::fs::symlink_metadata(join(a.worktree, path)).is_ok();
            if here && !a.base.entries.contains_key(path) {
                return Err(diverged(format!(
                    "{path} has uncommitted changes here but is excluded from sync; adopting the box's commits would discard them"
                )));
            }
            touched.insert(path.to_owned());
        }
    }
    let changed: BTreeMap<String, ManifestEntry> = theirs
        .entries
        .iter()
        .filter(|(p, e)| a.base.entries.get(*p) != Some(*e) || touched.contains(*p))
        .map(|(p, e)| (p.clone(), e.clone()))
        .collect();
    // Paths of the tip's tree the base does not list are deleted too, when the box lost them.
    // Without new commits the tip is the branch the drift check just listed: such a path is
    // not here (or the drift check would have stopped), so there is nothing to list.
    let tree = if tip == head {
        String::new()
    } else {
        git(a.worktree)
            .args(["ls-tree", "-r", "-z", "--name-only", &tip])
            .run_checked(cancel)
            .await?
    };
    let deleted: BTreeSet<String> = a
        .base
        .entries
        .keys()
        .cloned()
        .chain(split_z(&tree).map(str::to_owned))
        .filter(|p| !theirs.entries.contains_key(p) && !a.rules.excluded(p, false))
        .filter(|p| !a.rules.may_be_left_out_elsewhere(p))
        .collect();
    inbound_plain::precheck_writes(a.worktree, &changed, &deleted)?;
    let staged = inbound_plain::stage(remote, &changed, a.scratch, cancel).await?;

    // Every check passed: write.
    if tip != head {
        git(a.worktree)
            .args(["update-ref", "-m", "skiff: adopt the box's commits"])
            .arg(branch(a.session))
            .args([&tip, &head])
            .run_checked(cancel)
            .await?;
        git(a.worktree)
            .args(["reset", "--quiet", "--hard", &tip])
            .run_checked(cancel)
            .await?;
    }
    let files = inbound_plain::apply(a.worktree, &staged, &changed, &deleted)?;
    let unchanged =
        (tip == head && files.written.is_empty() && files.deleted.is_empty()).then(|| {
            crate::checkpoint::Known {
                head: head.clone(),
                manifest: ours,
            }
        });
    let mut manifest = theirs.clone();
    manifest.base_commit = Some(tip.clone());
    Ok(Adopted {
        unchanged,
        head: tip.clone(),
        fast_forwarded: tip != head,
        files,
        refused,
        commits_refused,
        manifest,
    })
}

async fn tracked_at(
    worktree: &Path,
    commit: &str,
    path: &str,
    cancel: &CancellationToken,
) -> Result<bool> {
    let done = git(worktree)
        .args(["cat-file", "-e"])
        .arg(format!("{commit}:{path}"))
        .run(cancel)
        .await?;
    Ok(done.status.success())
}

/// The box's commits are contained like its files: `reset --hard` writes the tip's tree into
/// the worktree and `publish` would push it, so every path must be a plain workspace path,
/// every new or changed symlink must stay inside, and submodules are not adopted. A symlink
/// the managed branch (`ours`) already has, unchanged, is data: refusing it would strand every
/// turn of a repository that commits one (`licenses -> /usr/share/common-licenses`).
async fn check_commit_tree(
    worktree: &std::path::Path,
    ours: &str,
    tip: &str,
    cancel: &CancellationToken,
) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let mut problem = |e: Error| {
        problems.push(match e {
            Error::Unsafe { path, reason } => format!("{path}: {reason}"),
            other => other.to_string(),
        })
    };
    let tree = |commit: &str| {
        git(worktree)
            .args(["ls-tree", "-r", "-z", "--full-tree", commit])
            .run_checked(cancel)
    };
    let ours = tree(ours).await?;
    let known: BTreeSet<&str> = split_z(&ours)
        .filter(|e| e.starts_with("120000 "))
        .collect();
    let listing = tree(tip).await?;
    for entry in split_z(&listing) {
        let Some((meta, path)) = entry.split_once('\t') else {
            continue;
        };
        if let Err(e) = contain::check_path(path) {
            problem(e);
            continue;
        }
        let mut fields = meta.split_whitespace();
        let (mode, oid) = (fields.next().unwrap_or(""), fields.nth(1).unwrap_or(""));
        match mode {
            // Same mode, blob and path as on the managed branch: unchanged.
            "120000" if known.contains(entry) => {}
            "120000" => {
                let target = git(worktree)
                    .args(["cat-file", "blob", oid])
                    .run_checked(cancel)
                    .await?;
                if let Err(e) = contain::check_symlink(path, &target) {
                    problem(e);
                }
            }
            "160000" => problem(contain::refuse(
                path,
                "the box committed a submodule; submodules are not adopted",
            )),
            _ => {}
        }
    }
    Ok(problems)
}
