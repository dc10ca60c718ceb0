//! A session's result, brought home: what changed against what the session started from (text
//! diffs in git's format, binary files named, never shown), written back onto a directory only
//! where that directory still matches the base, or exported whole into a new directory.
//!
//! Plain mode compares manifests whose bytes sit in a directory or in the content store
//! ([`Contents`]); git mode asks git, comparing a commit with another commit or with the
//! worktree's full state (commits, uncommitted and untracked-not-ignored files — untracked
//! files enter a private index as intent-to-add entries, so nothing is written to the
//! repository's object store).
//!
//! The promise of [`apply`]: every path it would touch is checked against the base first, and
//! a directory that changed where the session changed it too is left byte for byte as it was,
//! with the conflicting paths named. Deliberately absent: recording the base (the gateway does
//! that when it creates a session) and merging — a path changed on both sides is a conflict.

use crate::cas::Cas;
use crate::filelist::{self, Limits, Mode};
use crate::git::{git, split_z};
use crate::rules::Rules;
use crate::{Error, Manifest, ManifestEntry, Result, Scratch, contain, io_err, join, manifest};
use skiff_protocol::sync::{ChangeStatus, CommitView, FileChange};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// Bounds on the patches a diff carries (counts are always complete).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatchLimits {
    /// A side larger than this is not diffed as text.
    pub max_file_bytes: u64,
    /// One file's patch larger than this is left out.
    pub max_patch_bytes: usize,
    /// Past this many bytes of patches in all, the rest are left out.
    pub max_total_bytes: usize,
}

impl Default for PatchLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: 4 << 20,
            max_patch_bytes: 1 << 20,
            max_total_bytes: 16 << 20,
        }
    }
}

fn unlimited() -> Limits {
    Limits {
        max_files: usize::MAX,
        max_total_bytes: u64::MAX,
        max_file_bytes: u64::MAX,
    }
}

/// Lists and hashes `root` the way checkpoints see it (its own `.skiffignore` and ignore files,
/// no size limits: nothing leaves the machine).
pub async fn scan(root: &Path, mode: Mode, cancel: &CancellationToken) -> Result<Manifest> {
    let rules = Rules::load(root)?;
    manifest::scan(root, mode, &rules, &unlimited(), cancel).await
}

/// What turns `base` into `now`, the manifest of `workspace`. A path `now` lacks although
/// `workspace` still has a file or symlink there is not a deletion: the session's ignore rules
/// changed, and the file was left out of the scan, not removed.
pub fn result_diff(base: &Manifest, now: &Manifest, workspace: &Path) -> manifest::Diff {
    let mut d = manifest::diff(base, now);
    d.deleted.retain(|path| {
        !std::fs::symlink_metadata(join(workspace, path)).is_ok_and(|m| !m.is_dir())
    });
    d
}

/// Where the bytes of a manifest's files are.
#[derive(Clone, Copy, Debug)]
pub enum Contents<'a> {
    /// The manifest describes this directory.
    Dir(&'a Path),
    /// The files are blobs of the content store, by their blake3.
    Cas(&'a Cas),
}

impl Contents<'_> {
    fn read(&self, path: &str, entry: &ManifestEntry) -> Result<Vec<u8>> {
        match (entry, self) {
            (ManifestEntry::Symlink { target }, _) => Ok(target.as_bytes().to_vec()),
            (ManifestEntry::File { .. }, Contents::Dir(root)) => {
                let full = join(root, path);
                std::fs::read(&full).map_err(io_err(&full))
            }
            (ManifestEntry::File { blake3, .. }, Contents::Cas(cas)) => cas.get(blake3),
        }
    }
}

/// git's mode for an entry (`100644`, `100755`, `120000`; other permission bits as they are).
fn git_mode(entry: &ManifestEntry) -> String {
    match entry {
        ManifestEntry::Symlink { .. } => "120000".into(),
        ManifestEntry::File { mode, .. } => format!("100{:03o}", mode & 0o777),
    }
}

fn size_of(entry: &ManifestEntry) -> u64 {
    match entry {
        ManifestEntry::File { size, .. } => *size,
        ManifestEntry::Symlink { target } => target.len() as u64,
    }
}

/// Binary as git judges it (a NUL in the first 8000 bytes), or not UTF-8.
fn is_binary(bytes: &[u8]) -> bool {
    bytes.iter().take(8000).any(|b| *b == 0) || std::str::from_utf8(bytes).is_err()
}

/// One side of a changed path: its entry and, when it is text within the limits, its text.
struct Side {
    entry: ManifestEntry,
    text: Option<String>,
    binary: bool,
    too_large: bool,
}

fn side(
    contents: Contents<'_>,
    path: &str,
    entry: &ManifestEntry,
    limits: &PatchLimits,
) -> Result<Side> {
    if size_of(entry) > limits.max_file_bytes {
        return Ok(Side {
            entry: entry.clone(),
            text: None,
            binary: false,
            too_large: true,
        });
    }
    let bytes = contents.read(path, entry)?;
    let binary = is_binary(&bytes);
    Ok(Side {
        entry: entry.clone(),
        text: if binary {
            None
        } else {
            String::from_utf8(bytes).ok()
        },
        binary,
        too_large: false,
    })
}

/// The changes from `old` (bytes in `old_bytes`) to `new` (bytes in `new_bytes`), sorted by
/// path, with git-format patches unless `stat`.
pub fn manifest_changes(
    old: &Manifest,
    old_bytes: Contents<'_>,
    new: &Manifest,
    new_bytes: Contents<'_>,
    diff: &manifest::Diff,
    stat: bool,
    limits: &PatchLimits,
) -> Result<Vec<FileChange>> {
    let mut paths: BTreeSet<&String> = diff.changed.keys().collect();
    paths.extend(diff.deleted.iter());
    let mut budget = limits.max_total_bytes;
    let mut out = Vec::new();
    for path in paths {
        let before = match old.entries.get(path) {
            Some(e) => Some(side(old_bytes, path, e, limits)?),
            None => None,
        };
        let after = match diff.changed.get(path).or_else(|| {
            (!diff.deleted.contains(path))
                .then(|| new.entries.get(path))
                .flatten()
        }) {
            Some(e) => Some(side(new_bytes, path, e, limits)?),
            None => None,
        };
        let status = match (&before, &after) {
            (None, _) => ChangeStatus::Added,
            (_, None) => ChangeStatus::Deleted,
            (Some(b), Some(a)) if kind_changed(&b.entry, &a.entry) => ChangeStatus::TypeChanged,
            _ => ChangeStatus::Modified,
        };
        let mut change = text_change(path, status, before.as_ref(), after.as_ref(), limits);
        if stat {
            change.patch = None;
        } else if let Some(patch) = &change.patch {
            if patch.len() > limits.max_patch_bytes {
                change.omitted = Some(format!(
                    "the diff of this file is {}, over the limit of {}",
                    filelist::human(patch.len() as u64),
                    filelist::human(limits.max_patch_bytes as u64)
                ));
                change.patch = None;
            } else if patch.len() > budget {
                change.omitted = Some(format!(
                    "the diff is over {} in all; export the session to see every file",
                    filelist::human(limits.max_total_bytes as u64)
                ));
                change.patch = None;
            } else {
                budget -= patch.len();
            }
        }
        out.push(change);
    }
    Ok(out)
}

fn kind_changed(a: &ManifestEntry, b: &ManifestEntry) -> bool {
    matches!(
        (a, b),
        (ManifestEntry::File { .. }, ManifestEntry::Symlink { .. })
            | (ManifestEntry::Symlink { .. }, ManifestEntry::File { .. })
    )
}

/// One path's change with its counts and patch (the patch is cut later).
fn text_change(
    path: &str,
    status: ChangeStatus,
    before: Option<&Side>,
    after: Option<&Side>,
    limits: &PatchLimits,
) -> FileChange {
    let mut change = FileChange {
        path: path.to_owned(),
        status,
        binary: before.is_some_and(|s| s.binary) || after.is_some_and(|s| s.binary),
        insertions: 0,
        deletions: 0,
        patch: None,
        omitted: None,
    };
    if before.is_some_and(|s| s.too_large) || after.is_some_and(|s| s.too_large) {
        change.omitted = Some(format!(
            "over {}, too large to diff as text",
            filelist::human(limits.max_file_bytes)
        ));
        return change;
    }
    let mut patch = String::new();
    if status == ChangeStatus::TypeChanged {
        // As git shows it: the old entry deleted, then the new one added.
        let a = one_sided(path, before, None, &mut change);
        let b = one_sided(path, None, after, &mut change);
        patch.push_str(&a);
        patch.push_str(&b);
    } else {
        patch = one_sided(path, before, after, &mut change);
    }
    change.patch = Some(patch);
    change
}

/// A git-format patch from `before` to `after` (at least one present, same kind), counting
/// lines into `change`.
fn one_sided(
    path: &str,
    before: Option<&Side>,
    after: Option<&Side>,
    change: &mut FileChange,
) -> String {
    let mut out = format!("diff --git a/{path} b/{path}\n");
    match (before, after) {
        (None, Some(a)) => {
            let _ = writeln!(out, "new file mode {}", git_mode(&a.entry));
        }
        (Some(b), None) => {
            let _ = writeln!(out, "deleted file mode {}", git_mode(&b.entry));
        }
        (Some(b), Some(a)) if git_mode(&b.entry) != git_mode(&a.entry) => {
            let _ = writeln!(out, "old mode {}", git_mode(&b.entry));
            let _ = writeln!(out, "new mode {}", git_mode(&a.entry));
        }
        _ => {}
    }
    let old_name = before.map_or("/dev/null".to_owned(), |_| format!("a/{path}"));
    let new_name = after.map_or("/dev/null".to_owned(), |_| format!("b/{path}"));
    if before.is_some_and(|s| s.binary) || after.is_some_and(|s| s.binary) {
        let _ = writeln!(out, "Binary files {old_name} and {new_name} differ");
        return out;
    }
    let old_text = before.and_then(|s| s.text.as_deref()).unwrap_or("");
    let new_text = after.and_then(|s| s.text.as_deref()).unwrap_or("");
    if old_text == new_text {
        // A mode change alone (or two empty files).
        return out;
    }
    let diff = similar::TextDiff::configure()
        .algorithm(similar::Algorithm::Myers)
        .timeout(std::time::Duration::from_secs(2))
        .diff_lines(old_text, new_text);
    for c in diff.iter_all_changes() {
        match c.tag() {
            similar::ChangeTag::Insert => change.insertions += 1,
            similar::ChangeTag::Delete => change.deletions += 1,
            similar::ChangeTag::Equal => {}
        }
    }
    let _ = writeln!(out, "--- {old_name}");
    let _ = writeln!(out, "+++ {new_name}");
    let mut unified = diff.unified_diff();
    unified.context_radius(3).missing_newline_hint(true);
    for hunk in unified.iter_hunks() {
        let _ = write!(out, "{hunk}");
    }
    out
}

/// What a git diff compares `from` with.
#[derive(Clone, Copy, Debug)]
pub enum GitTarget<'a> {
    /// Another commit.
    Commit(&'a str),
    /// The worktree's full state: its commits and its uncommitted and untracked, not ignored
    /// files (as checkpoints list them).
    Worktree,
}

/// The changes from commit `from` to `to` in the repository or worktree `repo`, sorted by
/// path, with patches unless `stat`. `scratch` is a private directory for the private index.
pub async fn git_changes(
    repo: &Path,
    from: &str,
    to: GitTarget<'_>,
    stat: bool,
    limits: &PatchLimits,
    scratch: &Path,
    cancel: &CancellationToken,
) -> Result<Vec<FileChange>> {
    let dir = Scratch::new(scratch, "diff")?;
    let index = dir.path().join("index");
    let with_index = |cmd: skiff_process::Cmd| {
        cmd.env("GIT_INDEX_FILE", index.as_os_str())
            .env("GIT_LITERAL_PATHSPECS", "1")
    };
    if let GitTarget::Worktree = to {
        let rules = Rules::load(repo)?;
        let list = filelist::list(repo, Mode::Git, &rules, &unlimited(), cancel).await?;
        with_index(git(repo).args(["read-tree", "HEAD"]))
            .run_checked(cancel)
            .await?;
        if !list.files.is_empty() {
            let mut paths = Vec::new();
            for f in &list.files {
                paths.extend_from_slice(f.path.as_bytes());
                paths.push(0);
            }
            // Intent-to-add: the worktree's untracked files take part in the diff as new files,
            // and none of their bytes becomes an object (tracked paths are left as they are).
            with_index(git(repo).args([
                "add",
                "-N",
                "--pathspec-from-file=-",
                "--pathspec-file-nul",
            ]))
            .stdin(paths)
            .run_checked(cancel)
            .await?;
        }
    }
    let diff = |extra: &[&str]| {
        let mut cmd = with_index(git(repo))
            .args([
                "-c",
                "diff.noprefix=false",
                "-c",
                "diff.mnemonicPrefix=false",
                "diff",
                "-O/dev/null",
                "--no-renames",
                "--no-color",
                "--no-ext-diff",
                "--no-textconv",
                "--no-relative",
                "--src-prefix=a/",
                "--dst-prefix=b/",
            ])
            .args(extra)
            .arg(from);
        if let GitTarget::Commit(to) = to {
            cmd = cmd.arg(to);
        }
        cmd.arg("--")
    };
    let raw = diff(&["--raw", "-z", "--abbrev=40"])
        .run_checked(cancel)
        .await?;
    let numstat = diff(&["--numstat", "-z"]).run_checked(cancel).await?;
    let mut counts: BTreeMap<&str, (Option<u64>, Option<u64>)> = BTreeMap::new();
    for record in split_z(&numstat) {
        let mut parts = record.splitn(3, '\t');
        if let (Some(a), Some(d), Some(path)) = (parts.next(), parts.next(), parts.next()) {
            counts.insert(path, (a.parse().ok(), d.parse().ok()));
        }
    }
    // `:old_mode new_mode old_sha new_sha status`, then the path.
    let mut entries: Vec<(String, char)> = Vec::new();
    let mut tokens = split_z(&raw);
    while let Some(meta) = tokens.next() {
        let Some(path) = tokens.next() else { break };
        let status = meta
            .split(' ')
            .nth(4)
            .and_then(|s| s.chars().next())
            .unwrap_or('M');
        entries.push((path.to_owned(), status));
    }
    let mut changes: Vec<FileChange> = entries
        .iter()
        .map(|(path, status)| {
            let (ins, del) = counts
                .get(path.as_str())
                .copied()
                .unwrap_or((Some(0), Some(0)));
            FileChange {
                path: path.clone(),
                status: match status {
                    'A' => ChangeStatus::Added,
                    'D' => ChangeStatus::Deleted,
                    'T' => ChangeStatus::TypeChanged,
                    _ => ChangeStatus::Modified,
                },
                binary: ins.is_none() || del.is_none(),
                insertions: ins.unwrap_or(0),
                deletions: del.unwrap_or(0),
                patch: None,
                omitted: None,
            }
        })
        .collect();
    if !stat && !changes.is_empty() {
        let finished = diff(&["-p"])
            .output_cap(limits.max_total_bytes * 2)
            .run(cancel)
            .await?;
        if !finished.status.success() {
            return Err(Error::Process(skiff_process::Error::Failed {
                command: format!("git diff {from}"),
                status: finished.status.to_string(),
                stderr: finished.stderr.into_string().trim().to_owned(),
            }));
        }
        let cut = finished.stdout.truncated_bytes() > 0;
        let text = finished.stdout.into_string();
        attach_patches(&mut changes, &text, cut, limits);
    }
    changes.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(changes)
}

/// Splits git's patch output at its `diff --git` headers and gives each change its part, in
/// git's order (a type change is two parts: the deletion and the addition).
fn attach_patches(changes: &mut [FileChange], text: &str, cut: bool, limits: &PatchLimits) {
    let mut chunks: Vec<String> = Vec::new();
    for line in text.split_inclusive('\n') {
        if line.starts_with("diff --git ") || line.starts_with("diff --cc ") || chunks.is_empty() {
            chunks.push(String::new());
        }
        if let Some(last) = chunks.last_mut() {
            last.push_str(line);
        }
    }
    let wanted: usize = changes
        .iter()
        .map(|c| {
            if c.status == ChangeStatus::TypeChanged {
                2
            } else {
                1
            }
        })
        .sum();
    if cut || chunks.len() != wanted {
        let why = if cut {
            format!(
                "the diff is over {} in all; export the session to see every file",
                filelist::human(limits.max_total_bytes as u64)
            )
        } else {
            "git's diff could not be split by file".to_owned()
        };
        for c in changes.iter_mut() {
            c.omitted = Some(why.clone());
        }
        return;
    }
    let mut chunks = chunks.into_iter();
    let mut budget = limits.max_total_bytes;
    for c in changes.iter_mut() {
        let mut patch = chunks.next().unwrap_or_default();
        if c.status == ChangeStatus::TypeChanged {
            patch.push_str(&chunks.next().unwrap_or_default());
        }
        if patch.len() > limits.max_patch_bytes {
            c.omitted = Some(format!(
                "the diff of this file is {}, over the limit of {}",
                filelist::human(patch.len() as u64),
                filelist::human(limits.max_patch_bytes as u64)
            ));
        } else if patch.len() > budget {
            c.omitted = Some(format!(
                "the diff is over {} in all; export the session to see every file",
                filelist::human(limits.max_total_bytes as u64)
            ));
        } else {
            budget -= patch.len();
            c.patch = Some(patch);
        }
    }
}

/// The commits of `repo` reachable from `to` but not from `from`, oldest first.
pub async fn commits(
    repo: &Path,
    from: &str,
    to: &str,
    cancel: &CancellationToken,
) -> Result<Vec<CommitView>> {
    let out = git(repo)
        .args([
            "log",
            "--no-color",
            "--reverse",
            "--format=%H%x1f%an%x1f%at%x1f%s%x1e",
        ])
        .arg(format!("{from}..{to}"))
        .arg("--")
        .run_checked(cancel)
        .await?;
    Ok(out
        .split('\u{1e}')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .filter_map(|record| {
            let mut f = record.split('\u{1f}');
            Some(CommitView {
                commit: f.next()?.to_owned(),
                author: f.next()?.to_owned(),
                authored_at_ms: f.next()?.parse::<i64>().ok()?.saturating_mul(1000),
                summary: f.next().unwrap_or("").to_owned(),
            })
        })
        .collect())
}

/// A path `apply` would not write, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub path: String,
    pub reason: String,
}

/// `a.txt (changed in the target since the session started), …`: at most 20, then a count.
pub fn describe(conflicts: &[Conflict]) -> String {
    let mut parts: Vec<String> = conflicts
        .iter()
        .take(20)
        .map(|c| format!("{} ({})", c.path, c.reason))
        .collect();
    if conflicts.len() > 20 {
        parts.push(format!("and {} more", conflicts.len() - 20));
    }
    parts.join(", ")
}

/// What an apply will do, every path checked against the target.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub write: BTreeMap<String, ManifestEntry>,
    pub delete: BTreeSet<String>,
    /// Changed paths the target already has as the result has them.
    pub unchanged: Vec<String>,
}

/// What a path of the target holds.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    Absent,
    Entry(ManifestEntry),
    Dir,
    Special(&'static str),
}

fn found_at(target: &Path, path: &str) -> Result<Found> {
    let full = join(target, path);
    match std::fs::symlink_metadata(&full) {
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.kind() == std::io::ErrorKind::NotADirectory =>
        {
            Ok(Found::Absent)
        }
        Err(e) => Err(io_err(&full)(e)),
        Ok(m) if m.is_dir() => Ok(Found::Dir),
        Ok(m) if m.is_file() || m.file_type().is_symlink() => {
            Ok(Found::Entry(manifest::entry_of(target, path)?))
        }
        Ok(m) => Ok(Found::Special(filelist::special_kind(&m.file_type()))),
    }
}

/// Whether `a` and `b` are the same file or symlink (bytes, and for files permission bits).
fn same(a: &ManifestEntry, b: &ManifestEntry) -> bool {
    a == b
}

/// Checks every path `diff` touches in `target` against `base`: a path is written or deleted
/// only where `target` still holds what the session started from (or already holds the
/// result). Any other path is a conflict ([`Error::ApplyConflict`], naming each), and then
/// nothing is planned.
pub fn plan_apply(base: &Manifest, diff: &manifest::Diff, target: &Path) -> Result<Plan> {
    let mut plan = Plan::default();
    let mut conflicts = Vec::new();
    let touched: BTreeSet<&String> = diff.changed.keys().chain(diff.deleted.iter()).collect();
    let deleted_above = |path: &str| {
        let mut p = path;
        while let Some((parent, _)) = p.rsplit_once('/') {
            if diff.deleted.contains(parent) {
                return true;
            }
            p = parent;
        }
        false
    };
    for path in touched {
        contain::check_path(path)?;
        let desired = diff.changed.get(path);
        let expected = base.entries.get(path);
        let mut conflict = |reason: String| {
            conflicts.push(Conflict {
                path: path.clone(),
                reason,
            })
        };
        let found = match contain::parent_chain_problem(target, path) {
            // Below a file or symlink the session deletes: nothing is there once it is gone.
            Some(_) if desired.is_some() && deleted_above(path) => Found::Absent,
            Some(problem) => {
                conflict(format!("{problem} in the target"));
                continue;
            }
            None => found_at(target, path)?,
        };
        match (&found, desired) {
            (Found::Entry(have), Some(want)) if same(have, want) => {
                plan.unchanged.push(path.clone());
                continue;
            }
            (Found::Absent, None) => {
                plan.unchanged.push(path.clone());
                continue;
            }
            _ => {}
        }
        let matches_base = match (&found, expected) {
            (Found::Absent, None) => true,
            (Found::Entry(have), Some(base)) => same(have, base),
            // A directory where the session puts a file: fine when all it holds is what the
            // session deletes.
            (Found::Dir, None) if desired.is_some() => {
                only_deleted_below(target, path, &diff.deleted)?
            }
            _ => false,
        };
        if !matches_base {
            let reason = match (&found, expected) {
                (Found::Absent, Some(_)) => "deleted in the target since the session started",
                (Found::Entry(_), Some(_)) => "changed in the target since the session started",
                (Found::Entry(_), None) => "created in the target since the session started",
                (Found::Dir, _) => "a directory in the target",
                (Found::Special(kind), _) => {
                    conflict(format!("a {kind} in the target"));
                    continue;
                }
                (Found::Absent, None) => "changed in the target since the session started",
            };
            conflict(reason.to_owned());
            continue;
        }
        match desired {
            Some(entry) => {
                plan.write.insert(path.clone(), entry.clone());
            }
            None => {
                plan.delete.insert(path.clone());
            }
        }
    }
    if conflicts.is_empty() {
        Ok(plan)
    } else {
        Err(Error::ApplyConflict {
            target: target.display().to_string(),
            conflicts,
        })
    }
}

/// Whether everything below the directory `target/dir` is a file or symlink in `deleted`.
fn only_deleted_below(target: &Path, dir: &str, deleted: &BTreeSet<String>) -> Result<bool> {
    let mut stack = vec![dir.to_owned()];
    while let Some(rel) = stack.pop() {
        let full = join(target, &rel);
        for entry in std::fs::read_dir(&full).map_err(io_err(&full))? {
            let entry = entry.map_err(io_err(&full))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                return Ok(false);
            };
            let path = format!("{rel}/{name}");
            if entry.file_type().map_err(io_err(&entry.path()))?.is_dir() {
                stack.push(path);
            } else if !deleted.contains(&path) {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// What an apply wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub written: Vec<String>,
    pub deleted: Vec<String>,
}

/// Writes into a directory the gateway does not own (a user's, possibly writable by others
/// while the gateway runs as root) go through directory descriptors: every directory below the
/// root is opened without following a symlink, new entries are made in a private staging
/// directory (mode 0700) and get their owner and mode there, and only then are renamed into
/// place. A directory swapped for a symlink between the checks and the writes stops the write
/// instead of redirecting it.
mod at {
    use crate::{Error, Result};
    use rustix::fs::{AtFlags, Mode, OFlags};
    use std::os::fd::{AsFd, OwnedFd};
    use std::path::Path;

    pub(super) fn err(what: String) -> impl FnOnce(rustix::io::Errno) -> Error {
        move |e| Error::Io {
            path: what,
            source: e.into(),
        }
    }

    /// Opens the directory `path` (the root: symlinks in the path the user named are theirs).
    pub(super) fn open_root(path: &Path) -> Result<OwnedFd> {
        rustix::fs::open(
            path,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(err(path.display().to_string()))
    }

    /// Opens `name` in `dir` as a directory, refusing a symlink. `None` when it is absent.
    pub(super) fn open_dir(dir: impl AsFd, name: &str, shown: &str) -> Result<Option<OwnedFd>> {
        match rustix::fs::openat(
            dir,
            name,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => Err(Error::Unsafe {
                path: shown.to_owned(),
                reason: "it is not a real directory (a symlink or a file took its place)".into(),
            }),
            Err(e) => Err(err(shown.to_owned())(e)),
        }
    }

    /// The owner new entries of `dir` get: as root, the directory's own (a root gateway
    /// writing into a user's directory leaves that user's files); otherwise none.
    pub(super) fn owner(dir: impl AsFd) -> Option<(u32, u32)> {
        if !rustix::process::geteuid().is_root() {
            return None;
        }
        rustix::fs::fstat(dir).ok().map(|st| (st.st_uid, st.st_gid))
    }

    pub(super) fn chown(
        dir: impl AsFd,
        name: &str,
        owner: Option<(u32, u32)>,
        shown: &str,
    ) -> Result<()> {
        if let Some((uid, gid)) = owner {
            rustix::fs::chownat(
                dir,
                name,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(err(shown.to_owned()))?;
        }
        Ok(())
    }

    /// Opens the directory holding `rel` below `root`, never through a symlink, creating
    /// missing directories (owned like their parent) when `create`. `None` when a directory
    /// is missing and `create` is false.
    pub(super) fn parent_of(
        root: &OwnedFd,
        rel: &str,
        create: bool,
        shown: &Path,
    ) -> Result<Option<OwnedFd>> {
        let parts: Vec<&str> = rel.split('/').collect();
        let mut dir = root.try_clone().map_err(|e| Error::Io {
            path: shown.display().to_string(),
            source: e,
        })?;
        let mut sofar = shown.to_path_buf();
        for part in &parts[..parts.len().saturating_sub(1)] {
            sofar.push(part);
            let name = sofar.display().to_string();
            dir = match open_dir(&dir, part, &name)? {
                Some(next) => next,
                None if create => {
                    rustix::fs::mkdirat(&dir, *part, Mode::from_raw_mode(0o755))
                        .map_err(err(name.clone()))?;
                    chown(&dir, part, owner(&dir), &name)?;
                    open_dir(&dir, part, &name)?.ok_or_else(|| Error::Unsafe {
                        path: name.clone(),
                        reason: "it vanished as it was created".into(),
                    })?
                }
                None => return Ok(None),
            };
        }
        Ok(Some(dir))
    }

    /// A private directory (0700) made inside `parent`, removed with what it still holds when
    /// dropped.
    pub(super) struct Staging {
        parent: OwnedFd,
        pub(super) name: String,
        pub(super) fd: OwnedFd,
        shown: String,
    }

    impl Staging {
        pub(super) fn new(parent: &OwnedFd, shown: &Path, prefix: &str) -> Result<Staging> {
            let parent = parent.try_clone().map_err(|e| Error::Io {
                path: shown.display().to_string(),
                source: e,
            })?;
            for attempt in 0u32..100 {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0);
                let name = format!("{prefix}-{}-{nanos:08x}-{attempt}", std::process::id());
                let path = shown.join(&name).display().to_string();
                match rustix::fs::mkdirat(&parent, name.as_str(), Mode::from_raw_mode(0o700)) {
                    Ok(()) => {}
                    Err(rustix::io::Errno::EXIST) => continue,
                    Err(e) => return Err(err(path)(e)),
                }
                let fd = open_dir(&parent, &name, &path)?.ok_or_else(|| Error::Unsafe {
                    path: path.clone(),
                    reason: "the staging directory vanished as it was created".into(),
                })?;
                return Ok(Staging {
                    parent,
                    name,
                    fd,
                    shown: path,
                });
            }
            Err(Error::Invalid {
                what: shown.display().to_string(),
                detail: "cannot create a staging directory in it".into(),
            })
        }

        pub(super) fn shown(&self) -> &str {
            &self.shown
        }

        /// Forgets the directory (it was renamed into place).
        pub(super) fn keep(mut self) {
            self.name.clear();
        }
    }

    impl Drop for Staging {
        fn drop(&mut self) {
            if self.name.is_empty() {
                return;
            }
            remove_tree(&self.fd);
            let _ = rustix::fs::unlinkat(&self.parent, self.name.as_str(), AtFlags::REMOVEDIR);
        }
    }

    /// Best effort: empties a directory the gateway made (its own staging).
    fn remove_tree(dir: &OwnedFd) {
        let Ok(dup) = dir.try_clone() else { return };
        let Ok(entries) = rustix::fs::Dir::read_from(dup) else {
            return;
        };
        let names: Vec<(std::ffi::CString, bool)> = entries
            .filter_map(|e| e.ok())
            .filter(|e| !matches!(e.file_name().to_bytes(), b"." | b".."))
            .map(|e| {
                (
                    e.file_name().to_owned(),
                    e.file_type() == rustix::fs::FileType::Directory,
                )
            })
            .collect();
        for (name, is_dir) in names {
            if is_dir
                && let Ok(sub) = rustix::fs::openat(
                    dir,
                    name.as_c_str(),
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
            {
                remove_tree(&sub);
                let _ = rustix::fs::unlinkat(dir, name.as_c_str(), AtFlags::REMOVEDIR);
            } else {
                let _ = rustix::fs::unlinkat(dir, name.as_c_str(), AtFlags::empty());
            }
        }
    }
}

/// Copies `src` into a new file `name` of the directory `dir`, checking its bytes against
/// `entry` when given, and setting `mode`.
fn copy_into(
    src: &Path,
    dir: &std::os::fd::OwnedFd,
    name: &str,
    shown: &str,
    mode: u32,
    check: Option<(&str, &str, u64)>,
) -> Result<u64> {
    use rustix::fs::{Mode as FsMode, OFlags};
    let mut input = std::fs::File::open(src).map_err(io_err(src))?;
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        FsMode::from_raw_mode(0o600),
    )
    .map_err(at::err(shown.to_owned()))?;
    let mut output = std::fs::File::from(fd);
    let shown_path = Path::new(shown);
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut len = 0u64;
    loop {
        let n = input.read(&mut buf).map_err(io_err(src))?;
        if n == 0 {
            break;
        }
        if check.is_some() {
            hasher.update(&buf[..n]);
        }
        output.write_all(&buf[..n]).map_err(io_err(shown_path))?;
        len += n as u64;
    }
    output.sync_all().map_err(io_err(shown_path))?;
    if let Some((path, blake3, size)) = check {
        let got = hasher.finalize().to_hex().to_string();
        if len != size || got != blake3 {
            return Err(Error::Mismatch {
                path: path.to_owned(),
                detail: "it changed in the session's workspace while it was being copied; run the command again".into(),
            });
        }
    }
    output
        .set_permissions(std::fs::Permissions::from_mode(mode & 0o777))
        .map_err(io_err(shown_path))?;
    Ok(len)
}

/// The last segment of a workspace path.
fn leaf(rel: &str) -> &str {
    rel.rsplit_once('/').map_or(rel, |(_, name)| name)
}

/// Carries out a checked plan: every new file is staged inside `target` and checked against
/// the plan first (a failure there leaves `target` as it was), then deletes, then directories
/// the deletes emptied (those `workspace` no longer has) go, then the staged entries are
/// renamed into place. Nothing is written through a symlink (see [`at`]). A failure after the
/// first delete or rename is [`Error::PartlyApplied`], saying how far it got.
pub fn apply(plan: &Plan, workspace: &Path, target: &Path) -> Result<Applied> {
    let root = at::open_root(target)?;
    let staging = at::Staging::new(&root, target, ".skiff-apply")?;
    for (i, (path, entry)) in plan.write.iter().enumerate() {
        let name = i.to_string();
        let shown = format!("{}/{name}", staging.shown());
        match entry {
            ManifestEntry::File { blake3, size, mode } => {
                copy_into(
                    &join(workspace, path),
                    &staging.fd,
                    &name,
                    &shown,
                    *mode,
                    Some((path, blake3, *size)),
                )?;
            }
            ManifestEntry::Symlink { target: link } => {
                rustix::fs::symlinkat(link.as_str(), &staging.fd, name.as_str())
                    .map_err(at::err(shown))?;
            }
        }
    }
    let mut applied = Applied::default();
    match finish(plan, workspace, target, &root, &staging, &mut applied) {
        Ok(()) => Ok(applied),
        Err(e) if applied.deleted.is_empty() && applied.written.is_empty() => Err(e),
        Err(e) => Err(Error::PartlyApplied {
            target: target.display().to_string(),
            deleted: applied.deleted.len(),
            written: applied.written.len(),
            source: Box::new(e),
        }),
    }
}

/// The deletes and renames of [`apply`], recording each in `applied` as it is done.
fn finish(
    plan: &Plan,
    workspace: &Path,
    target: &Path,
    root: &std::os::fd::OwnedFd,
    staging: &at::Staging,
    applied: &mut Applied,
) -> Result<()> {
    use rustix::fs::AtFlags;
    for path in &plan.delete {
        let Some(dir) = at::parent_of(root, path, false, target)? else {
            continue;
        };
        let shown = join(target, path).display().to_string();
        match rustix::fs::statat(&dir, leaf(path), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st)
                if rustix::fs::FileType::from_raw_mode(st.st_mode)
                    != rustix::fs::FileType::Directory =>
            {
                rustix::fs::unlinkat(&dir, leaf(path), AtFlags::empty()).map_err(at::err(shown))?;
                applied.deleted.push(path.clone());
            }
            _ => {}
        }
    }
    for path in &plan.delete {
        let mut p = path.as_str();
        while let Some((parent, _)) = p.rsplit_once('/') {
            if std::fs::symlink_metadata(join(workspace, parent)).is_ok_and(|m| m.is_dir()) {
                break;
            }
            let Some(dir) = at::parent_of(root, parent, false, target)? else {
                break;
            };
            if rustix::fs::unlinkat(&dir, leaf(parent), AtFlags::REMOVEDIR).is_err() {
                break;
            }
            p = parent;
        }
    }
    for (i, path) in plan.write.keys().enumerate() {
        let shown = join(target, path).display().to_string();
        let dir = at::parent_of(root, path, true, target)?.ok_or_else(|| Error::Unsafe {
            path: shown.clone(),
            reason: "its directory could not be made".into(),
        })?;
        // A replaced entry keeps its owner; a new one gets its directory's.
        let owner = match rustix::fs::statat(&dir, leaf(path), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st)
                if rustix::fs::FileType::from_raw_mode(st.st_mode)
                    == rustix::fs::FileType::Directory =>
            {
                return Err(Error::Unsafe {
                    path: shown,
                    reason: "a directory is in the way".into(),
                });
            }
            Ok(st) if rustix::process::geteuid().is_root() => Some((st.st_uid, st.st_gid)),
            Ok(_) => None,
            Err(_) => at::owner(&dir),
        };
        let name = i.to_string();
        at::chown(&staging.fd, &name, owner, &shown)?;
        rustix::fs::renameat(&staging.fd, name.as_str(), &dir, leaf(path))
            .map_err(at::err(shown))?;
        applied.written.push(path.clone());
    }
    Ok(())
}

/// Copies every file and symlink of `root` that takes part in sync (`mode`'s listing, the
/// workspace's ignore rules; never `.git`) into `target`, which must not exist or be empty.
/// The copy is built in a private directory beside `target` and renamed into place, so
/// `target` is either whole or as it was. Returns the number of entries and their bytes.
pub async fn export(
    root: &Path,
    mode: Mode,
    target: &Path,
    cancel: &CancellationToken,
) -> Result<(u64, u64)> {
    let refuse = || Error::TargetNotEmpty {
        path: target.display().to_string(),
    };
    match std::fs::symlink_metadata(target) {
        Ok(m) if !m.is_dir() => return Err(refuse()),
        Ok(_) => {
            if std::fs::read_dir(target)
                .map_err(io_err(target))?
                .next()
                .is_some()
            {
                return Err(refuse());
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(target)(e)),
    }
    let (Some(parent), Some(name)) = (target.parent(), target.file_name().and_then(|n| n.to_str()))
    else {
        return Err(Error::Invalid {
            what: target.display().to_string(),
            detail: "it has no parent directory and UTF-8 name to export beside".into(),
        });
    };
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let rules = Rules::load(root)?;
    let list = filelist::list(root, mode, &rules, &unlimited(), cancel).await?;
    let parent_fd = at::open_root(parent)?;
    let owner = at::owner(&parent_fd);
    let staging = at::Staging::new(&parent_fd, parent, ".skiff-export")?;
    let staged = Path::new(staging.shown()).to_path_buf();
    let mut bytes = 0u64;
    for file in &list.files {
        let from = join(root, &file.path);
        let shown = join(&staged, &file.path).display().to_string();
        let dir = at::parent_of(&staging.fd, &file.path, true, &staged)?.ok_or_else(|| {
            Error::Unsafe {
                path: shown.clone(),
                reason: "its directory could not be made".into(),
            }
        })?;
        let leaf = leaf(&file.path);
        let meta = std::fs::symlink_metadata(&from).map_err(io_err(&from))?;
        if meta.file_type().is_symlink() {
            let link = std::fs::read_link(&from).map_err(io_err(&from))?;
            rustix::fs::symlinkat(link.as_path(), &dir, leaf).map_err(at::err(shown.clone()))?;
        } else {
            bytes += copy_into(&from, &dir, leaf, &shown, meta.permissions().mode(), None)?;
        }
        at::chown(&dir, leaf, owner, &shown)?;
    }
    rustix::fs::fchmod(&staging.fd, rustix::fs::Mode::from_raw_mode(0o755))
        .map_err(at::err(staging.shown().to_owned()))?;
    at::chown(&parent_fd, &staging.name, owner, staging.shown())?;
    // Over an empty directory or none: rename(2) replaces an empty directory.
    rustix::fs::renameat(&parent_fd, staging.name.as_str(), &parent_fd, name)
        .map_err(at::err(target.display().to_string()))?;
    staging.keep();
    Ok((list.files.len() as u64, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(bytes: &[u8], mode: u32) -> ManifestEntry {
        ManifestEntry::File {
            blake3: blake3::hash(bytes).to_hex().to_string(),
            size: bytes.len() as u64,
            mode,
        }
    }

    fn manifest(entries: &[(&str, ManifestEntry)]) -> Manifest {
        Manifest {
            version: skiff_protocol::sync::MANIFEST_VERSION,
            base_commit: None,
            entries: entries
                .iter()
                .map(|(p, e)| ((*p).to_owned(), e.clone()))
                .collect(),
        }
    }

    #[test]
    fn plain_patches_read_like_gits() {
        let dir = tempfile::tempdir().unwrap();
        let cas = Cas::open(&dir.path().join("cas")).unwrap();
        let old_text = b"one\ntwo\nthree\n";
        cas.put_bytes(old_text).unwrap();
        cas.put_bytes(b"bin\0ary").unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        std::fs::write(ws.join("a.txt"), "one\n2\nthree\nfour").unwrap();
        std::fs::write(ws.join("new.txt"), "fresh\n").unwrap();
        let old = manifest(&[
            ("a.txt", file(old_text, 0o644)),
            ("gone.bin", file(b"bin\0ary", 0o644)),
        ]);
        let new = manifest(&[
            ("a.txt", manifest::entry_of(&ws, "a.txt").unwrap()),
            ("new.txt", manifest::entry_of(&ws, "new.txt").unwrap()),
            (
                "link",
                ManifestEntry::Symlink {
                    target: "a.txt".into(),
                },
            ),
        ]);
        let d = manifest::diff(&old, &new);
        let changes = manifest_changes(
            &old,
            Contents::Cas(&cas),
            &new,
            Contents::Dir(&ws),
            &d,
            false,
            &PatchLimits::default(),
        )
        .unwrap();
        let shown: Vec<(&str, ChangeStatus, bool, u64, u64)> = changes
            .iter()
            .map(|c| {
                (
                    c.path.as_str(),
                    c.status,
                    c.binary,
                    c.insertions,
                    c.deletions,
                )
            })
            .collect();
        assert_eq!(
            shown,
            [
                ("a.txt", ChangeStatus::Modified, false, 2, 1),
                ("gone.bin", ChangeStatus::Deleted, true, 0, 0),
                ("link", ChangeStatus::Added, false, 1, 0),
                ("new.txt", ChangeStatus::Added, false, 1, 0),
            ]
        );
        assert_eq!(
            changes[0].patch.as_deref().unwrap(),
            "diff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,4 @@\n one\n-two\n+2\n three\n+four\n\\ No newline at end of file\n"
        );
        assert_eq!(
            changes[1].patch.as_deref().unwrap(),
            "diff --git a/gone.bin b/gone.bin\ndeleted file mode 100644\nBinary files a/gone.bin and /dev/null differ\n"
        );
        assert_eq!(
            changes[2].patch.as_deref().unwrap(),
            "diff --git a/link b/link\nnew file mode 120000\n--- /dev/null\n+++ b/link\n@@ -0,0 +1 @@\n+a.txt\n\\ No newline at end of file\n"
        );
    }

    #[test]
    fn a_target_that_moved_where_the_session_changed_is_a_conflict() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path();
        std::fs::write(target.join("same.txt"), "base\n").unwrap();
        std::fs::write(target.join("edited.txt"), "edited by the user\n").unwrap();
        std::fs::write(target.join("done.txt"), "result\n").unwrap();
        let base = manifest(&[
            ("same.txt", file(b"base\n", 0o644)),
            ("edited.txt", file(b"base\n", 0o644)),
            ("done.txt", file(b"base\n", 0o644)),
            ("vanished.txt", file(b"base\n", 0o644)),
        ]);
        let mut d = manifest::Diff::default();
        for p in ["same.txt", "edited.txt", "done.txt", "vanished.txt"] {
            d.changed.insert(p.into(), file(b"result\n", 0o644));
        }
        let Err(Error::ApplyConflict { conflicts, .. }) = plan_apply(&base, &d, target) else {
            panic!("no conflict");
        };
        let named: Vec<&str> = conflicts.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(named, ["edited.txt", "vanished.txt"]);
        d.changed.remove("edited.txt");
        d.changed.remove("vanished.txt");
        let plan = plan_apply(&base, &d, target).unwrap();
        assert_eq!(plan.unchanged, ["done.txt"]);
        assert_eq!(plan.write.keys().collect::<Vec<_>>(), ["same.txt"]);
    }

    #[test]
    fn a_directory_swapped_for_a_symlink_after_the_checks_stops_the_write() {
        let dir = tempfile::tempdir().unwrap();
        let (ws, target, elsewhere) = (
            dir.path().join("ws"),
            dir.path().join("target"),
            dir.path().join("elsewhere"),
        );
        for d in [&ws, &target, &elsewhere] {
            std::fs::create_dir_all(d.join("docs")).unwrap();
        }
        std::fs::write(ws.join("docs/new.txt"), "new\n").unwrap();
        let mut d = manifest::Diff::default();
        d.changed.insert(
            "docs/new.txt".into(),
            manifest::entry_of(&ws, "docs/new.txt").unwrap(),
        );
        let base = manifest(&[]);
        let plan = plan_apply(&base, &d, &target).unwrap();
        // Between the checks and the writes, `docs` becomes a symlink to somewhere else.
        std::fs::remove_dir(target.join("docs")).unwrap();
        std::os::unix::fs::symlink(elsewhere.join("docs"), target.join("docs")).unwrap();
        let err = apply(&plan, &ws, &target).unwrap_err();
        assert!(matches!(err, Error::Unsafe { .. }), "{err}");
        assert!(err.to_string().contains("not a real directory"), "{err}");
        assert!(
            !elsewhere.join("docs/new.txt").exists(),
            "written through the symlink"
        );
        // The staging directory went too.
        let left: Vec<_> = std::fs::read_dir(&target)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from("docs")]);
        // The checks alone refuse it as well.
        let Err(Error::ApplyConflict { conflicts, .. }) = plan_apply(&base, &d, &target) else {
            panic!("no conflict");
        };
        assert_eq!(conflicts[0].path, "docs/new.txt");
    }
}
