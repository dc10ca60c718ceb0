//! End-of-turn checkpoints of a session's workspace, taken without disturbing it.
//!
//! Git mode: a commit of the worktree's full state — tracked changes, deletions and untracked
//! files that sync (the same listing and rules) — built through a private index with
//! `update-index`, `write-tree` and `commit-tree`, and stored under
//! `refs/skiff/checkpoints/<session>/<n>`. The worktree's own index, HEAD and files are never
//! touched. Plain mode: every file's bytes go into the content-addressed store, and a manifest
//! naming them is stored there too; [`restore_plain`] rebuilds a directory from it.
//!
//! Deliberately absent: cadence and retention (the gateway checkpoints at the end of every
//! turn; artifact rows decide what is kept).

use crate::cas::Cas;
use crate::filelist::{self, Limits, Mode};
use crate::git::{git, split_z};
use crate::rules::Rules;
use crate::{Error, Manifest, ManifestEntry, Result, Scratch, contain, io_err, join, manifest};
use skiff_protocol::sync::MANIFEST_VERSION;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// A git checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GitCheckpoint {
    pub git_ref: String,
    pub commit: String,
    pub tree: String,
    pub files: u64,
    pub bytes: u64,
}

/// A plain checkpoint: the manifest's blake3 in the content store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlainCheckpoint {
    pub manifest: String,
    pub files: u64,
    pub bytes: u64,
}

/// The ref a git checkpoint is stored under.
pub fn git_ref(session: &str, seq: u64) -> String {
    format!("refs/skiff/checkpoints/{session}/{seq}")
}

/// Commits the full state of `worktree` as checkpoint `seq` of `session`.
pub async fn git_checkpoint(
    worktree: &Path,
    session: &str,
    seq: u64,
    rules: &Rules,
    limits: &Limits,
    scratch: &Path,
    cancel: &CancellationToken,
) -> Result<GitCheckpoint> {
    let list = filelist::list(worktree, Mode::Git, rules, limits, cancel).await?;
    let deleted = git(worktree)
        .args(["ls-files", "-z", "--deleted"])
        .run_checked(cancel)
        .await?;
    let mut paths = Vec::new();
    for path in list
        .paths()
        .iter()
        .map(String::as_str)
        .chain(split_z(&deleted))
    {
        paths.extend_from_slice(path.as_bytes());
        paths.push(0);
    }
    let dir = Scratch::new(scratch, "checkpoint")?;
    let index = dir.path().join("index");
    let private = |cmd: skiff_process::Cmd| cmd.env("GIT_INDEX_FILE", index.as_os_str());
    private(git(worktree).args(["read-tree", "HEAD"]))
        .run_checked(cancel)
        .await?;
    private(git(worktree).args(["update-index", "--add", "--remove", "-z", "--stdin"]))
        .stdin(paths)
        .run_checked(cancel)
        .await?;
    let tree = private(git(worktree).arg("write-tree"))
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned();
    let commit = git(worktree)
        .args(["commit-tree", &tree, "-p", "HEAD", "-m"])
        .arg(format!("skiff checkpoint {seq} of {session}"))
        .env("GIT_AUTHOR_NAME", "Skiff")
        .env("GIT_AUTHOR_EMAIL", "skiff@localhost")
        .env("GIT_COMMITTER_NAME", "Skiff")
        .env("GIT_COMMITTER_EMAIL", "skiff@localhost")
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned();
    let name = git_ref(session, seq);
    git(worktree)
        .args(["update-ref", &name, &commit])
        .run_checked(cancel)
        .await?;
    Ok(GitCheckpoint {
        git_ref: name,
        commit,
        tree,
        files: list.files.len() as u64,
        bytes: list.total_bytes,
    })
}

/// Stores the full state of the plain directory `root` in `cas`.
pub async fn plain_checkpoint(
    root: &Path,
    rules: &Rules,
    limits: &Limits,
    cas: &Cas,
    cancel: &CancellationToken,
) -> Result<PlainCheckpoint> {
    let list = filelist::list(root, Mode::Plain, rules, limits, cancel).await?;
    let mut entries = BTreeMap::new();
    for file in &list.files {
        let entry = match manifest::entry_of(root, &file.path)? {
            ManifestEntry::File { mode, .. } => {
                let (blake3, size) = cas.put_file(&join(root, &file.path))?;
                ManifestEntry::File { blake3, size, mode }
            }
            link => link,
        };
        entries.insert(file.path.clone(), entry);
    }
    let m = Manifest {
        version: MANIFEST_VERSION,
        base_commit: None,
        entries,
    };
    let hash = cas.put_bytes(manifest::to_json(&m)?.as_bytes())?;
    Ok(PlainCheckpoint {
        manifest: hash,
        files: list.files.len() as u64,
        bytes: list.total_bytes,
    })
}

/// Rebuilds a plain checkpoint into `target`, which must not exist or be empty.
pub fn restore_plain(cas: &Cas, manifest_hash: &str, target: &Path) -> Result<Manifest> {
    let text = cas.get(manifest_hash)?;
    let m = manifest::from_json(&String::from_utf8_lossy(&text))?;
    let limits = Limits {
        max_files: usize::MAX,
        max_total_bytes: u64::MAX,
        max_file_bytes: u64::MAX,
    };
    contain::check_manifest(&m, None, &limits)?;
    std::fs::create_dir_all(target).map_err(io_err(target))?;
    if std::fs::read_dir(target)
        .map_err(io_err(target))?
        .next()
        .is_some()
    {
        return Err(Error::Unsafe {
            path: target.display().to_string(),
            reason: "a checkpoint restores only into an empty directory".into(),
        });
    }
    for (path, entry) in &m.entries {
        contain::create_parents(target, path)?;
        let full = join(target, path);
        match entry {
            ManifestEntry::File { blake3, mode, .. } => {
                let src = cas.path(blake3)?;
                std::fs::copy(&src, &full).map_err(io_err(&full))?;
                std::fs::set_permissions(&full, std::fs::Permissions::from_mode(mode & 0o777))
                    .map_err(io_err(&full))?;
            }
            ManifestEntry::Symlink { target: link } => {
                std::os::unix::fs::symlink(link, &full).map_err(io_err(&full))?;
            }
        }
    }
    Ok(m)
}
