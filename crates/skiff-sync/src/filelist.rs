//! Which files of a workspace sync, and whether they fit. Git mode lists what git would: the
//! tracked files that still exist plus untracked files that are not ignored (`git ls-files
//! --cached --others --exclude-standard`). Plain mode walks the directory, honouring `.ignore`
//! and `.gitignore` files. Both then apply [`Rules`]. Limits are checked here, before any byte
//! moves, and a refusal names the largest paths (a file over the per-file limit is named with
//! its size and the limit).
//!
//! Deliberately absent: hashing (that is [`crate::manifest`]) and submodules (a gitlink is
//! skipped: its contents belong to another repository).

use crate::git::{git, split_z};
use crate::rules::Rules;
use crate::{Error, Result, io_err, join};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// How a workspace is laid onto a box and brought back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A git repository: the box gets a real repository at the base commit.
    Git,
    /// A plain directory: a manifest-diffed mirror.
    Plain,
}

/// What sync accepts from one workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_files: usize,
    pub max_total_bytes: u64,
    pub max_file_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_files: 200_000,
            max_total_bytes: 2 << 30,
            max_file_bytes: 256 << 20,
        }
    }
}

/// A file or symlink that takes part in sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedFile {
    /// Relative, `/`-separated.
    pub path: String,
    pub size: u64,
    pub symlink: bool,
}

/// The files of a workspace that sync, sorted by path.
#[derive(Clone, Debug, Default)]
pub struct FileList {
    pub files: Vec<ListedFile>,
    pub total_bytes: u64,
    /// What the rules left out: nothing is excluded silently.
    pub left_out: LeftOut,
}

/// What a listing left out, by folder and the rule that matched, for people to read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeftOut {
    /// (folder or file, rule) → how many files (0: a whole folder the walk did not enter).
    pub by_rule: BTreeMap<(String, String), usize>,
    /// Submodules: their contents belong to another repository and never sync.
    pub submodules: Vec<String>,
}

impl LeftOut {
    fn add(&mut self, rules: &Rules, path: &str, is_dir: bool) {
        // Name the outermost folder the rule matched, not every file under it.
        let parts: Vec<&str> = path.split('/').collect();
        let mut at = (path.to_owned(), is_dir);
        for i in 1..parts.len() {
            let prefix = parts[..i].join("/");
            if rules.excluded(&prefix, true) {
                at = (prefix, true);
                break;
            }
        }
        let rule = rules
            .excluding_rule(&at.0, at.1)
            .unwrap_or_else(|| "a rule".into());
        let name = if at.1 { format!("{}/", at.0) } else { at.0 };
        let count = self.by_rule.entry((name, rule)).or_default();
        if !is_dir {
            *count += 1;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_rule.is_empty() && self.submodules.is_empty()
    }

    /// One line: the largest groups first, at most five, then how many more.
    pub fn summary(&self) -> Option<String> {
        if self.is_empty() {
            return None;
        }
        let mut groups: Vec<(&(String, String), &usize)> = self.by_rule.iter().collect();
        groups.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let mut parts: Vec<String> = groups
            .iter()
            .take(5)
            .map(|((what, rule), n)| match (what.ends_with('/'), n) {
                (true, 1) => format!("{what} (1 file) by {rule}"),
                (true, n) if **n > 1 => format!("{what} ({n} files) by {rule}"),
                _ => format!("{what} by {rule}"),
            })
            .collect();
        if groups.len() > 5 {
            parts.push(format!("and {} more", groups.len() - 5));
        }
        for sub in &self.submodules {
            parts.push(format!("submodule {sub} (another repository)"));
        }
        Some(format!("left out: {}", parts.join("; ")))
    }
}

impl FileList {
    pub fn paths(&self) -> Vec<String> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }
}

/// Lists the files of `root` that sync, and checks them against `limits`.
pub async fn list(
    root: &Path,
    mode: Mode,
    rules: &Rules,
    limits: &Limits,
    cancel: &CancellationToken,
) -> Result<FileList> {
    let mut left_out = LeftOut::default();
    let candidates = match mode {
        Mode::Git => git_candidates(root, cancel).await?,
        Mode::Plain => plain_candidates(root, rules, &mut left_out)?,
    };
    let mut files = BTreeMap::new();
    let mut matcher = rules.matcher();
    for path in candidates {
        if matcher.excluded(&path, false) {
            left_out.add(rules, &path, false);
            continue;
        }
        let full = join(root, &path);
        let meta = match std::fs::symlink_metadata(&full) {
            Ok(meta) => meta,
            // git printed a name that is not UTF-8 (it reached us with replacement characters,
            // so no such path exists): refused by name, before anything moves.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && path.contains('\u{FFFD}') => {
                return Err(Error::NotUtf8 {
                    path: full.display().to_string(),
                });
            }
            // Deleted but still tracked: the deletion is the change.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&full)(e)),
        };
        let ft = meta.file_type();
        let symlink = ft.is_symlink();
        if ft.is_dir() {
            // A tracked directory is a gitlink: a submodule.
            if mode == Mode::Git {
                left_out.submodules.push(path);
            }
            continue;
        }
        if !ft.is_file() && !symlink {
            return Err(Error::Special {
                path: full.display().to_string(),
                kind: special_kind(&ft),
            });
        }
        files.insert(
            path.clone(),
            ListedFile {
                path,
                size: if symlink { 0 } else { meta.len() },
                symlink,
            },
        );
    }
    let files: Vec<ListedFile> = files.into_values().collect();
    let total_bytes = files.iter().map(|f| f.size).sum();
    let list = FileList {
        files,
        total_bytes,
        left_out,
    };
    check_limits(root, &list, limits)?;
    Ok(list)
}

/// Refuses, by name, a plain workspace's file that other users cannot read: a box runs as
/// another user (or on another machine), and sending the file there would make it readable by
/// that user. A file is private when it lacks `o+r`, or sits in a directory below `root` that
/// others cannot enter (`o+x`; `root` itself is the session's directory, the gateway's own).
///
/// Files of the gateway's own user are refused too, not excluded. For a root gateway they are
/// the system's secrets: a copy of `/etc` keeps `/etc/shadow` root-owned (`cp -a`). For any
/// gateway the mode is the only statement of the owner's intent that survives the copy, and a
/// box is always someone else. Excluding instead would leave a file the box's manifest never
/// lists: every reconciliation would see it as drift, or a box could write over it unseen.
/// A refusal is loud, names the file, leaves both sides as they were, and is undone with one
/// `chmod o+r` or one `.skiffignore` line.
///
/// Plain mode only: a managed worktree's files are written by the gateway's own git with the
/// gateway's umask, so their modes say nothing about the user's intent. Outbound only: a
/// checkpoint or a drift scan keeps files on the gateway, and a box-made `0600` file that came
/// back must not stop the next reconciliation (a later re-sync to a fresh box refuses it here).
pub fn check_shareable(root: &Path, list: &FileList) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    // Directories of the workspace already seen to be open to others.
    let mut open_dirs: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    let me = rustix::process::geteuid().as_raw();
    let owner = |uid: u32| {
        if uid == me {
            format!("uid {uid}, the gateway's own user")
        } else {
            format!("uid {uid}")
        }
    };
    for file in list.files.iter().filter(|f| !f.symlink) {
        let full = join(root, &file.path);
        let dirs = file.path.rsplit_once('/').map_or("", |(dirs, _)| dirs);
        let mut parent = String::new();
        for part in dirs.split('/').filter(|p| !p.is_empty()) {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(part);
            if open_dirs.contains(&parent) {
                continue;
            }
            let dir = join(root, &parent);
            let meta = std::fs::metadata(&dir).map_err(io_err(&dir))?;
            if meta.mode() & 0o001 == 0 {
                return Err(Error::Private {
                    path: full.display().to_string(),
                    why: format!(
                        "it is inside {}, mode {:04o}, owned by {}, which other users cannot enter",
                        dir.display(),
                        meta.mode() & 0o7777,
                        owner(meta.uid())
                    ),
                });
            }
            open_dirs.insert(parent.clone());
        }
        let meta = std::fs::symlink_metadata(&full).map_err(io_err(&full))?;
        if meta.mode() & 0o004 == 0 {
            return Err(Error::Private {
                path: full.display().to_string(),
                why: format!(
                    "mode {:04o}, owned by {}: other users cannot read it",
                    meta.mode() & 0o7777,
                    owner(meta.uid())
                ),
            });
        }
    }
    Ok(())
}

pub(crate) fn special_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "device file"
    } else {
        "special file"
    }
}

async fn git_candidates(root: &Path, cancel: &CancellationToken) -> Result<Vec<String>> {
    let out = git(root)
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .run_checked(cancel)
        .await?;
    Ok(split_z(&out).map(str::to_owned).collect())
}

fn plain_candidates(root: &Path, rules: &Rules, left_out: &mut LeftOut) -> Result<Vec<String>> {
    let base = root.to_path_buf();
    let filter_rules = rules.clone();
    // Folders the walk does not enter, for the report (the filter runs on the walk's thread).
    let pruned = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let pruned_in = pruned.clone();
    let walker = ignore::WalkBuilder::new(root)
        .hidden(false)
        .parents(false)
        .ignore(true)
        .git_ignore(true)
        .git_global(false)
        .git_exclude(false)
        .require_git(false)
        .follow_links(false)
        .filter_entry(move |entry| {
            let Some(rel) = relative(&base, entry.path()) else {
                return true;
            };
            if rel.is_empty() || !entry.file_type().is_some_and(|t| t.is_dir()) {
                return true;
            }
            let enter =
                !filter_rules.excluded(&rel, true) || filter_rules.may_reinclude_below(&rel);
            if !enter && let Ok(mut p) = pruned_in.lock() {
                p.push(rel);
            }
            enter
        })
        .build();
    let mut out = Vec::new();
    for entry in walker {
        let entry = entry.map_err(|e| Error::Io {
            path: root.display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
        if entry.file_type().is_some_and(|t| t.is_dir()) {
            continue;
        }
        match relative(root, entry.path()) {
            Some(rel) if !rel.is_empty() => out.push(rel),
            Some(_) => {}
            None => {
                return Err(Error::NotUtf8 {
                    path: entry.path().display().to_string(),
                });
            }
        }
    }
    let pruned = pruned.lock().map(|p| p.clone()).unwrap_or_default();
    for dir in pruned {
        left_out.add(rules, &dir, true);
    }
    Ok(out)
}

fn relative(root: &Path, path: &Path) -> Option<String> {
    let rel = path.strip_prefix(root).ok()?;
    let parts: Option<Vec<&str>> = rel.iter().map(|p| p.to_str()).collect();
    Some(parts?.join("/"))
}

/// Refuses a list over the limits, naming the largest paths (or the fullest directories, when
/// the count is what is over).
pub fn check_limits(root: &Path, list: &FileList, limits: &Limits) -> Result<()> {
    let too_large = |detail: String, largest: String| Error::TooLarge {
        root: root.display().to_string(),
        detail,
        largest,
    };
    let largest = |n: usize| {
        let mut by_size: Vec<&ListedFile> = list.files.iter().collect();
        by_size.sort_by(|a, b| b.size.cmp(&a.size).then(a.path.cmp(&b.path)));
        by_size
            .iter()
            .take(n)
            .map(|f| format!("{} ({})", f.path, human(f.size)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut oversized: Vec<&ListedFile> = list
        .files
        .iter()
        .filter(|f| f.size > limits.max_file_bytes)
        .collect();
    oversized.sort_by(|a, b| b.size.cmp(&a.size).then(a.path.cmp(&b.path)));
    if let Some(first) = oversized.first() {
        let others = oversized[1..]
            .iter()
            .take(4)
            .map(|f| format!("{} ({})", f.path, human(f.size)))
            .collect::<Vec<_>>();
        let also = if others.is_empty() {
            String::new()
        } else {
            format!(" (also over the limit: {})", others.join(", "))
        };
        return Err(Error::FileTooLarge {
            path: join(root, &first.path).display().to_string(),
            size: first.size,
            limit: limits.max_file_bytes,
            remedy: format!(
                "add `/{}` to the workspace's .skiffignore to leave it behind, or make it smaller; nothing was synced{also}",
                first.path
            ),
        });
    }
    if list.total_bytes > limits.max_total_bytes {
        return Err(too_large(
            format!(
                "{} in all, over the limit of {}",
                human(list.total_bytes),
                human(limits.max_total_bytes)
            ),
            largest(5),
        ));
    }
    if list.files.len() > limits.max_files {
        let mut dirs: BTreeMap<&str, usize> = BTreeMap::new();
        for f in &list.files {
            let top = f.path.split('/').next().unwrap_or("");
            *dirs.entry(top).or_default() += 1;
        }
        let mut dirs: Vec<(&str, usize)> = dirs.into_iter().collect();
        dirs.sort_by_key(|d| std::cmp::Reverse(d.1));
        let fullest = dirs
            .iter()
            .take(5)
            .map(|(d, n)| format!("{d} ({n} files)"))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(too_large(
            format!(
                "{} files, over the limit of {}",
                list.files.len(),
                limits.max_files
            ),
            fullest,
        ));
    }
    Ok(())
}

/// `1.5 MiB`-style sizes for messages.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The absolute path of a listed file.
pub fn full_path(root: &Path, rel: &str) -> PathBuf {
    join(root, rel)
}
