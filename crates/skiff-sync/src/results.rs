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
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
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

/// The owner new entries of `dir` get: as root, the directory's owner (a root gateway writing
/// into a user's directory leaves that user's files); otherwise none (they are ours).
fn owner_for(dir: &Path) -> Option<(u32, u32)> {
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    std::fs::metadata(dir).ok().map(|m| (m.uid(), m.gid()))
}

fn chown(path: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(io_err(path))?;
    }
    Ok(())
}

/// Creates the directories above `rel` in `root` (never through a symlink), each owned like
/// its parent.
fn make_parents(root: &Path, rel: &str) -> Result<()> {
    let mut dir = PathBuf::from(root);
    let parts: Vec<&str> = rel.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        let parent = dir.clone();
        dir.push(part);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::Unsafe {
                    path: rel.to_owned(),
                    reason: format!("{} is not a real directory", dir.display()),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&dir).map_err(io_err(&dir))?;
                chown(&dir, owner_for(&parent))?;
            }
            Err(e) => return Err(io_err(&dir)(e)),
        }
    }
    Ok(())
}

/// Copies `src` to a new file `dst`, checking its bytes against `entry` on the way.
fn copy_checked(src: &Path, dst: &Path, path: &str, entry: &ManifestEntry) -> Result<()> {
    let ManifestEntry::File { blake3, size, mode } = entry else {
        return Ok(());
    };
    let mut input = std::fs::File::open(src).map_err(io_err(src))?;
    let mut output = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(io_err(dst))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut len = 0u64;
    loop {
        let n = input.read(&mut buf).map_err(io_err(src))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        output.write_all(&buf[..n]).map_err(io_err(dst))?;
        len += n as u64;
    }
    output.sync_all().map_err(io_err(dst))?;
    let got = hasher.finalize().to_hex().to_string();
    if len != *size || &got != blake3 {
        return Err(Error::Mismatch {
            path: path.to_owned(),
            detail: "it changed in the session's workspace while it was being copied; run the command again".into(),
        });
    }
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(mode & 0o777))
        .map_err(io_err(dst))?;
    Ok(())
}

/// Carries out a checked plan: every new file is staged inside `target` and checked against
/// the plan first (a failure there leaves `target` as it was), then deletes, then renames into
/// place, then directories the deletes emptied (those `workspace` no longer has) go.
pub fn apply(plan: &Plan, workspace: &Path, target: &Path) -> Result<Applied> {
    let staging = Scratch::new(target, ".skiff-apply")?;
    let mut staged: Vec<(&String, &ManifestEntry, PathBuf)> = Vec::new();
    for (i, (path, entry)) in plan.write.iter().enumerate() {
        let tmp = staging.path().join(i.to_string());
        match entry {
            ManifestEntry::File { .. } => copy_checked(&join(workspace, path), &tmp, path, entry)?,
            ManifestEntry::Symlink { target: link } => {
                std::os::unix::fs::symlink(link, &tmp).map_err(io_err(&tmp))?;
            }
        }
        staged.push((path, entry, tmp));
    }
    let mut applied = Applied::default();
    for path in &plan.delete {
        let full = join(target, path);
        match std::fs::symlink_metadata(&full) {
            Ok(m) if !m.is_dir() => {
                std::fs::remove_file(&full).map_err(io_err(&full))?;
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
            if std::fs::remove_dir(join(target, parent)).is_err() {
                break;
            }
            p = parent;
        }
    }
    for (path, _, tmp) in staged {
        make_parents(target, path)?;
        let full = join(target, path);
        let owner = match std::fs::symlink_metadata(&full) {
            Ok(m) if m.is_dir() => {
                // Emptied by the deletes above (the plan checked that it holds nothing else).
                remove_empty_tree(&full)?;
                owner_for(full.parent().unwrap_or(target))
            }
            Ok(m) if rustix::process::geteuid().is_root() => Some((m.uid(), m.gid())),
            Ok(_) => None,
            Err(_) => owner_for(full.parent().unwrap_or(target)),
        };
        std::fs::rename(&tmp, &full).map_err(io_err(&full))?;
        chown(&full, owner)?;
        applied.written.push(path.clone());
    }
    Ok(applied)
}

/// Removes a tree of empty directories (fails, changing nothing more, at anything else).
fn remove_empty_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        remove_empty_tree(&entry.path())?;
    }
    std::fs::remove_dir(dir).map_err(io_err(dir))
}

/// Copies every file and symlink of `root` that takes part in sync (`mode`'s listing, the
/// workspace's ignore rules; never `.git`) into `target`, which must not exist or be empty.
/// The copy is built beside `target` and renamed into place, so `target` is either whole or
/// as it was. Returns the number of entries and their bytes.
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
    let parent = target.parent().ok_or_else(|| Error::Invalid {
        what: target.display().to_string(),
        detail: "it has no parent directory to export beside".into(),
    })?;
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let rules = Rules::load(root)?;
    let list = filelist::list(root, mode, &rules, &unlimited(), cancel).await?;
    let staging = Scratch::new(parent, ".skiff-export")?;
    let owner = owner_for(parent);
    let mut bytes = 0u64;
    for file in &list.files {
        make_parents(staging.path(), &file.path)?;
        let from = join(root, &file.path);
        let to = join(staging.path(), &file.path);
        if file.symlink {
            let link = std::fs::read_link(&from).map_err(io_err(&from))?;
            std::os::unix::fs::symlink(link, &to).map_err(io_err(&to))?;
        } else {
            // `copy` keeps the permission bits.
            bytes += std::fs::copy(&from, &to).map_err(io_err(&from))?;
        }
        chown(&to, owner)?;
    }
    std::fs::set_permissions(staging.path(), std::fs::Permissions::from_mode(0o755))
        .map_err(io_err(staging.path()))?;
    chown(staging.path(), owner)?;
    // Over an empty directory or none: rename(2) replaces an empty directory.
    std::fs::rename(staging.path(), target).map_err(io_err(target))?;
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
}
