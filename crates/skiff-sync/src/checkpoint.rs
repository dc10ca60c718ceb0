//! End-of-turn checkpoints of a session's workspace, taken without disturbing it.
//!
//! Git mode: a commit of the worktree's full state — tracked changes, deletions and untracked
//! files that sync (the same listing and rules) — built through a private index with
//! `update-index`, `write-tree` and `commit-tree`, and stored under
//! `refs/skiff/checkpoints/<session>/<n>`. The worktree's own index, HEAD and files are never
//! touched. Untracked files over [`LargeFiles::threshold`] never become objects of the user's
//! repository (a worktree shares its object store): they go into the content-addressed store,
//! under a cap per checkpoint, and a manifest of them is referenced from the checkpoint
//! ([`GitCheckpoint::outside_git`]); [`restore_git`] puts both back together. Plain mode: every
//! file's bytes go into the content-addressed store, and a manifest naming them is stored there
//! too; [`restore_plain`] rebuilds a directory from it.
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
    /// The content-store manifest of the large untracked files kept outside git, if any.
    pub outside_git: Option<String>,
    pub files: u64,
    pub bytes: u64,
    /// What the checkpoint holds, as one digest (HEAD and every synced file's entry): equal
    /// digests mean equal checkpoints, so the next one can reuse this one's tree.
    pub state: String,
    /// Whether the tree of the previous checkpoint was reused (nothing had changed).
    pub reused: bool,
}

/// The previous checkpoint, as far as the next one needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Previous {
    pub state: String,
    pub commit: String,
    pub tree: String,
    pub outside_git: Option<String>,
}

/// What the caller already knows a worktree holds: HEAD, and the manifest of its synced files
/// (listed and hashed as a checkpoint would, with nothing written since).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Known {
    pub head: String,
    pub manifest: Manifest,
}

/// The digest of a checkpoint's content: HEAD and every synced file's entry.
fn state_of(head: &str, entries: &BTreeMap<String, ManifestEntry>) -> Result<String> {
    let m = Manifest {
        version: MANIFEST_VERSION,
        base_commit: Some(head.to_owned()),
        entries: entries.clone(),
    };
    Ok(blake3::hash(manifest::to_json(&m)?.as_bytes())
        .to_hex()
        .to_string())
}

/// Untracked files above this size are never written into the user's repository as objects:
/// a session's snapshot copies them, a checkpoint keeps them in the content store.
pub const LARGE_UNTRACKED_BYTES: u64 = 8 << 20;

/// Which untracked files a git checkpoint keeps outside git, and how much of them it may keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LargeFiles {
    /// Untracked files larger than this go to the content store.
    pub threshold: u64,
    /// The most bytes of such files one checkpoint keeps; past it the checkpoint is refused,
    /// naming the file.
    pub cap: u64,
}

impl Default for LargeFiles {
    fn default() -> Self {
        Self {
            threshold: LARGE_UNTRACKED_BYTES,
            cap: 1 << 30,
        }
    }
}

/// Where a git checkpoint's parts go besides the repository.
#[derive(Clone, Copy, Debug)]
pub struct GitStores<'a> {
    /// A private directory of the gateway for the private index.
    pub scratch: &'a Path,
    pub cas: &'a Cas,
    pub large: LargeFiles,
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
    stores: &GitStores<'_>,
    cancel: &CancellationToken,
) -> Result<GitCheckpoint> {
    git_checkpoint_after(
        worktree, session, seq, rules, limits, stores, None, None, cancel,
    )
    .await
}

/// [`git_checkpoint`], reusing `previous` (its commit, tree and files kept outside git) when
/// nothing changed since it was taken: same HEAD, same synced files (by the stat-cached
/// manifest, or by `known` when the caller has just listed and hashed the worktree).
#[allow(clippy::too_many_arguments)]
pub async fn git_checkpoint_after(
    worktree: &Path,
    session: &str,
    seq: u64,
    rules: &Rules,
    limits: &Limits,
    stores: &GitStores<'_>,
    previous: Option<&Previous>,
    known: Option<&Known>,
    cancel: &CancellationToken,
) -> Result<GitCheckpoint> {
    if let (Some(previous), Some(known)) = (previous, known)
        && state_of(&known.head, &known.manifest.entries)? == previous.state
    {
        let (files, bytes) =
            known
                .manifest
                .entries
                .values()
                .fold((0u64, 0u64), |(n, b), e| match e {
                    ManifestEntry::File { size, .. } => (n + 1, b + size),
                    ManifestEntry::Symlink { .. } => (n + 1, b),
                });
        if let Some(cp) = reuse(worktree, session, seq, previous, files, bytes, cancel).await {
            return Ok(cp);
        }
    }
    let list = filelist::list(worktree, Mode::Git, rules, limits, cancel).await?;
    let head = git(worktree)
        .args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"])
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned();
    let state = {
        let now = manifest::build(worktree, &list, None)?;
        state_of(&head, &now.entries)?
    };
    if let Some(previous) = previous.filter(|p| p.state == state) {
        let (files, bytes) = (list.files.len() as u64, list.total_bytes);
        if let Some(cp) = reuse(worktree, session, seq, previous, files, bytes, cancel).await {
            return Ok(cp);
        }
    }
    let large = large_untracked(worktree, &list, stores.large.threshold, cancel).await?;
    check_cap(worktree, &large, &stores.large)?;
    let deleted = git(worktree)
        .args(["ls-files", "-z", "--deleted"])
        .run_checked(cancel)
        .await?;
    let mut paths = Vec::new();
    for path in list
        .paths()
        .iter()
        .filter(|p| !large.contains_key(p.as_str()))
        .map(String::as_str)
        .chain(split_z(&deleted))
    {
        paths.extend_from_slice(path.as_bytes());
        paths.push(0);
    }
    // The large files' bytes first: nothing of the checkpoint is referenced before they are
    // whole in the content store.
    let outside_git = keep_outside_git(worktree, &large, stores.cas)?;
    let dir = Scratch::new(stores.scratch, "checkpoint")?;
    let index = dir.path().join("index");
    // No split index: its shared part would be written into the repository.
    let private = |cmd: skiff_process::Cmd| {
        cmd.env("GIT_INDEX_FILE", index.as_os_str())
            .args(["-c", "core.splitIndex=false"])
    };
    // HEAD's tree, with the stat data of the worktree's own index where its entries are
    // HEAD's (a one-tree `read-tree -m`): `update-index` then re-hashes only the files that
    // changed, not every file. The worktree's index is only copied, never written.
    let seeded = copy_index(worktree, &index, cancel).await?;
    let read = if seeded {
        vec!["read-tree", "-m", head.as_str()]
    } else {
        vec!["read-tree", head.as_str()]
    };
    private(git(worktree))
        .args(read)
        .run_checked(cancel)
        .await?;
    private(git(worktree))
        .args(["update-index", "--add", "--remove", "-z", "--stdin"])
        .stdin(paths)
        .run_checked(cancel)
        .await?;
    if !large.is_empty() {
        // An untracked path may still be in HEAD (`git rm --cached`): its old blob must not
        // stand in for the file kept outside git.
        let mut gone = Vec::new();
        for path in large.keys() {
            gone.extend_from_slice(path.as_bytes());
            gone.push(0);
        }
        private(git(worktree))
            .args(["update-index", "--force-remove", "-z", "--stdin"])
            .stdin(gone)
            .run_checked(cancel)
            .await?;
    }
    let tree = private(git(worktree))
        .arg("write-tree")
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned();
    let commit = commit_tree(worktree, &tree, &head, session, seq, cancel).await?;
    let name = git_ref(session, seq);
    git(worktree)
        .args(["update-ref", &name, &commit])
        .run_checked(cancel)
        .await?;
    Ok(GitCheckpoint {
        git_ref: name,
        commit,
        tree,
        outside_git,
        files: list.files.len() as u64,
        bytes: list.total_bytes,
        state,
        reused: false,
    })
}

/// Checkpoint `seq` is `previous` again: the same content on the same HEAD makes the same
/// commit (one `update-ref`, nothing else). `None` when that commit cannot be named any more
/// (its ref deleted and the object gone): then the caller makes the checkpoint afresh.
async fn reuse(
    worktree: &Path,
    session: &str,
    seq: u64,
    previous: &Previous,
    files: u64,
    bytes: u64,
    cancel: &CancellationToken,
) -> Option<GitCheckpoint> {
    let name = git_ref(session, seq);
    let pointed = git(worktree)
        .args(["update-ref", &name])
        .arg(format!("{}^{{commit}}", previous.commit))
        .run_checked(cancel)
        .await;
    if let Err(e) = pointed {
        tracing::debug!(commit = %previous.commit, error = %e, "the previous checkpoint cannot be reused");
        return None;
    }
    Some(GitCheckpoint {
        git_ref: name,
        commit: previous.commit.clone(),
        tree: previous.tree.clone(),
        outside_git: previous.outside_git.clone(),
        files,
        bytes,
        state: previous.state.clone(),
        reused: true,
    })
}

async fn commit_tree(
    worktree: &Path,
    tree: &str,
    parent: &str,
    session: &str,
    seq: u64,
    cancel: &CancellationToken,
) -> Result<String> {
    Ok(git(worktree)
        .args(["commit-tree", tree, "-p", parent, "-m"])
        .arg(format!("skiff checkpoint {seq} of {session}"))
        .env("GIT_AUTHOR_NAME", "Skiff")
        .env("GIT_AUTHOR_EMAIL", "skiff@localhost")
        .env("GIT_COMMITTER_NAME", "Skiff")
        .env("GIT_COMMITTER_EMAIL", "skiff@localhost")
        .run_checked(cancel)
        .await?
        .trim()
        .to_owned())
}

/// Copies the worktree's own index to `to`; `false` when it has none.
async fn copy_index(worktree: &Path, to: &Path, cancel: &CancellationToken) -> Result<bool> {
    let named = git(worktree)
        .args(["rev-parse", "--git-path", "index"])
        .run_checked(cancel)
        .await?;
    // Relative to the worktree unless absolute.
    let from = worktree.join(named.trim());
    copy_index_file(&from, to).map_err(io_err(&from))
}

/// Copies a git index file, keeping its mtime: git's racy-entry check compares the entries'
/// mtimes with the index file's own, and a copy that looked newer would make files changed
/// in the same second as the original index was written look clean. `false` when `from` does
/// not exist.
pub fn copy_index_file(from: &Path, to: &Path) -> std::io::Result<bool> {
    let mtime = match std::fs::metadata(from) {
        Ok(meta) => meta.modified()?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    std::fs::copy(from, to)?;
    std::fs::File::options()
        .write(true)
        .open(to)?
        .set_times(std::fs::FileTimes::new().set_modified(mtime))?;
    // The index may have been replaced between the two reads: then the copy is of the new
    // one, which is at least as new as the mtime kept. Only older-looking is safe.
    Ok(true)
}

/// The listed regular files of `worktree` that git does not track and that are larger than
/// `threshold`, with their sizes.
async fn large_untracked(
    worktree: &Path,
    list: &filelist::FileList,
    threshold: u64,
    cancel: &CancellationToken,
) -> Result<BTreeMap<String, u64>> {
    if !list.files.iter().any(|f| !f.symlink && f.size > threshold) {
        return Ok(BTreeMap::new());
    }
    let out = git(worktree)
        .args(["ls-files", "-z", "--others", "--exclude-standard"])
        .run_checked(cancel)
        .await?;
    let untracked: std::collections::BTreeSet<&str> = split_z(&out).collect();
    Ok(list
        .files
        .iter()
        .filter(|f| !f.symlink && f.size > threshold && untracked.contains(f.path.as_str()))
        .map(|f| (f.path.clone(), f.size))
        .collect())
}

/// Refuses a checkpoint whose large untracked files would pass the cap, naming the file that
/// passes it (in path order).
fn check_cap(worktree: &Path, large: &BTreeMap<String, u64>, limits: &LargeFiles) -> Result<()> {
    let mut total: u64 = 0;
    for (path, size) in large {
        total = total.saturating_add(*size);
        if total > limits.cap {
            return Err(Error::OverCheckpointCap {
                path: join(worktree, path).display().to_string(),
                size: *size,
                cap: limits.cap,
            });
        }
    }
    Ok(())
}

/// Copies the large files into `cas` and stores a manifest of them; its hash.
fn keep_outside_git(
    worktree: &Path,
    large: &BTreeMap<String, u64>,
    cas: &Cas,
) -> Result<Option<String>> {
    if large.is_empty() {
        return Ok(None);
    }
    let mut entries = BTreeMap::new();
    for path in large.keys() {
        let full = join(worktree, path);
        let mode = std::fs::symlink_metadata(&full)
            .map_err(io_err(&full))?
            .permissions()
            .mode()
            & 0o777;
        let (blake3, size) = cas.put_file(&full)?;
        entries.insert(path.clone(), ManifestEntry::File { blake3, size, mode });
    }
    let m = Manifest {
        version: MANIFEST_VERSION,
        base_commit: None,
        entries,
    };
    Ok(Some(cas.put_bytes(manifest::to_json(&m)?.as_bytes())?))
}

/// Rebuilds git checkpoint `commit` of `repo` (the session's worktree or its repository) into
/// `target`, which must not exist or be empty: the committed tree, then the files kept
/// outside git (`outside_git`, from [`GitCheckpoint::outside_git`]).
pub async fn restore_git(
    repo: &Path,
    commit: &str,
    outside_git: Option<&str>,
    stores: &GitStores<'_>,
    target: &Path,
    cancel: &CancellationToken,
) -> Result<()> {
    let outside = match outside_git {
        Some(hash) => {
            let text = stores.cas.get(hash)?;
            let m = manifest::from_json(&String::from_utf8_lossy(&text))?;
            contain::check_manifest(&m, None, &unlimited())?;
            Some(m)
        }
        None => None,
    };
    empty_target(target)?;
    let dir = Scratch::new(stores.scratch, "restore")?;
    let index = dir.path().join("index");
    let private = |cmd: skiff_process::Cmd| cmd.env("GIT_INDEX_FILE", index.as_os_str());
    private(git(repo).args(["read-tree", commit]))
        .run_checked(cancel)
        .await?;
    private(
        git(repo)
            .arg("--work-tree")
            .arg(target)
            .args(["checkout-index", "-a"]),
    )
    .run_checked(cancel)
    .await?;
    if let Some(m) = outside {
        restore_files(stores.cas, &m, target)?;
    }
    Ok(())
}

pub(crate) fn unlimited() -> Limits {
    Limits {
        max_files: usize::MAX,
        max_total_bytes: u64::MAX,
        max_file_bytes: u64::MAX,
    }
}

/// Creates `target` if needed; refuses one that holds anything.
fn empty_target(target: &Path) -> Result<()> {
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
    Ok(())
}

/// Writes a (checked) manifest's files from `cas` under `target`.
fn restore_files(cas: &Cas, m: &Manifest, target: &Path) -> Result<()> {
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
    Ok(())
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
    contain::check_manifest(&m, None, &unlimited())?;
    empty_target(target)?;
    restore_files(cas, &m, target)?;
    Ok(m)
}
