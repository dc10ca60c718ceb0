//! `find` (glob over paths) and `grep` (regex over contents). Both walk the workspace with the
//! `ignore` crate, so `.gitignore` and friends are respected and `.git` is skipped.
//!
//! Only regular files are searched: the walk lists no FIFO, socket or device, every file is
//! opened through [`fsio`] (non-blocking, type checked on the open file), and at most
//! [`MAX_GREP_FILE_BYTES`] of a file is read. The walker itself opens ignore files with a
//! blocking open, so a directory whose ignore file is a FIFO, socket or device is not entered
//! (and said so); a path given to search that is one of those is refused by name.

use super::fsio::{self, Lines};
use super::{Workspace, cap};
use serde::Deserialize;
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

const MAX_FIND_RESULTS: usize = 1000;
const MAX_GREP_MATCHES: usize = 500;
/// How much of one file `grep` reads; the rest of a larger file is not searched (and the
/// result says so).
pub(crate) const MAX_GREP_FILE_BYTES: u64 = 16 << 20;
/// How much of one line `grep` matches against.
const MAX_GREP_LINE_BYTES: usize = 64 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FindArgs {
    pattern: String,
    path: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GrepArgs {
    pattern: String,
    path: Option<String>,
    glob: Option<String>,
    ignore_case: Option<bool>,
}

/// Directories left out of a walk, with why.
type Skipped = Arc<Mutex<Vec<String>>>;

/// The regular files under `root`. Refuses to start when an ignore file the walker would read
/// first (in `root` or above it) is a FIFO, socket or device; skips directories below that
/// have one, recording them in `skipped`.
fn walk(
    ws: &Workspace,
    root: &Path,
    tool: &str,
    skipped: &Skipped,
) -> Result<impl Iterator<Item = ignore::DirEntry> + use<>, String> {
    for dir in root.ancestors() {
        if let Some((file, kind)) = fsio::special_ignore_file(dir) {
            return Err(format!(
                "{} is {kind}, not a regular file; {tool} reads ignore files and would block \
                 on it. Remove it (rm) and search again",
                ws.display(&file)
            ));
        }
    }
    let ws_for_filter = ws.clone();
    let skipped = skipped.clone();
    Ok(ignore::WalkBuilder::new(root)
        .hidden(false)
        .require_git(false)
        .filter_entry(move |e| {
            if e.file_name() == ".git" {
                return false;
            }
            if e.file_type().is_some_and(|t| t.is_dir())
                && let Some((file, kind)) = fsio::special_ignore_file(e.path())
            {
                if let Ok(mut skipped) = skipped.lock() {
                    skipped.push(format!(
                        "{}/ (its {} is {kind})",
                        ws_for_filter.display(e.path()),
                        file.file_name()
                            .map(|n| n.to_string_lossy())
                            .unwrap_or_default()
                    ));
                }
                return false;
            }
            true
        })
        .sort_by_file_path(Ord::cmp)
        .build()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_some_and(|t| t.is_file())))
}

fn glob(pattern: &str) -> Result<globset::GlobMatcher, String> {
    globset::GlobBuilder::new(pattern)
        .literal_separator(false)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| format!("invalid glob {pattern:?}: {e}"))
}

/// What a search path is: a directory to walk or one regular file. Anything else is refused.
enum Base {
    Dir(PathBuf),
    File(PathBuf),
}

fn base(ws: &Workspace, user_path: Option<&str>, tool: &str) -> Result<Base, String> {
    let user_path = user_path.unwrap_or("");
    let cannot = |e: std::io::Error| format!("cannot search {user_path}: {e}");
    let path = ws.resolve(user_path)?;
    let path = if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
        // Search what the link names (`resolve` checked that it stays inside).
        ws.contain(&path.canonicalize().map_err(cannot)?, user_path)?
    } else {
        path
    };
    // stat, not open: never blocks, whatever the path is.
    let meta = std::fs::metadata(&path).map_err(cannot)?;
    if meta.is_dir() {
        Ok(Base::Dir(path))
    } else if meta.is_file() {
        Ok(Base::File(path))
    } else {
        Err(fsio::not_regular(user_path, &meta, tool))
    }
}

fn note_skipped(out: &mut String, skipped: &Skipped) {
    let skipped = skipped.lock().map(|s| s.clone()).unwrap_or_default();
    if !skipped.is_empty() {
        let _ = write!(
            out,
            "\n[not searched, because an ignore file there is not a regular file: {}]",
            skipped.join(", ")
        );
    }
}

pub(super) fn find(
    ws: &Workspace,
    args: FindArgs,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let matcher = glob(&args.pattern)?;
    let skipped = Skipped::default();
    let (base, files): (PathBuf, Box<dyn Iterator<Item = PathBuf>>) =
        match base(ws, args.path.as_deref(), "find")? {
            Base::File(path) => (path.clone(), Box::new(std::iter::once(path))),
            Base::Dir(dir) => {
                let files = walk(ws, &dir, "find", &skipped)?.map(ignore::DirEntry::into_path);
                (dir, Box::new(files))
            }
        };
    let mut hits = Vec::new();
    let mut more = 0usize;
    for path in files {
        if cancel.is_cancelled() {
            return Err("cancelled".to_owned());
        }
        let rel = path.strip_prefix(&base).unwrap_or(&path);
        if matcher.is_match(rel) || rel.file_name().is_some_and(|n| matcher.is_match(n)) {
            if hits.len() < MAX_FIND_RESULTS {
                hits.push(ws.display(&path));
            } else {
                more += 1;
            }
        }
    }
    let mut out = if hits.is_empty() {
        format!("no files match {}", args.pattern)
    } else {
        hits.join("\n")
    };
    if more > 0 {
        let _ = write!(out, "\n[… {more} more files; narrow the pattern]");
    }
    note_skipped(&mut out, &skipped);
    Ok(out)
}

pub(super) fn grep(
    ws: &Workspace,
    args: GrepArgs,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let regex = regex::bytes::RegexBuilder::new(&args.pattern)
        .case_insensitive(args.ignore_case.unwrap_or(false))
        .build()
        .map_err(|e| format!("invalid regex: {e}"))?;
    let filter = args.glob.as_deref().map(glob).transpose()?;
    let skipped = Skipped::default();
    let (base, files): (PathBuf, Box<dyn Iterator<Item = PathBuf>>) =
        match base(ws, args.path.as_deref(), "grep")? {
            Base::File(path) => (path.clone(), Box::new(std::iter::once(path))),
            Base::Dir(dir) => {
                let files = walk(ws, &dir, "grep", &skipped)?.map(ignore::DirEntry::into_path);
                (dir, Box::new(files))
            }
        };
    let mut out = String::new();
    let mut matches = 0usize;
    let mut cut = Vec::new();
    let mut buf = Vec::new();
    for path in files {
        if cancel.is_cancelled() {
            return Err("cancelled".to_owned());
        }
        if let Some(f) = &filter {
            let rel = path.strip_prefix(&base).unwrap_or(&path);
            if !f.is_match(rel) && !path.file_name().is_some_and(|n| f.is_match(n)) {
                continue;
            }
        }
        // Whatever the walk saw, only a file that is regular once opened is read.
        let Ok(file) = fsio::open_nonblocking(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        if meta.len() > MAX_GREP_FILE_BYTES {
            cut.push(ws.display(&path));
        }
        let mut lines = Lines::new(file.take(MAX_GREP_FILE_BYTES), cancel.clone());
        if lines.looks_binary().unwrap_or(true) {
            continue;
        }
        let mut number = 0usize;
        while let Ok(Some(_)) = lines.next_line(&mut buf, MAX_GREP_LINE_BYTES) {
            number += 1;
            if regex.is_match(&buf) {
                matches += 1;
                if matches <= MAX_GREP_MATCHES {
                    let text = String::from_utf8_lossy(&buf);
                    let shown: String = text.chars().take(300).collect();
                    let _ = writeln!(out, "{}:{number}: {shown}", ws.display(&path));
                }
            }
        }
    }
    if cancel.is_cancelled() {
        return Err("cancelled".to_owned());
    }
    if matches == 0 {
        out = format!("no matches for {}", args.pattern);
    }
    if matches > MAX_GREP_MATCHES {
        let _ = write!(
            out,
            "[… {} more matches; narrow the search]",
            matches - MAX_GREP_MATCHES
        );
    }
    if !cut.is_empty() {
        let _ = write!(
            out,
            "\n[only the first {} MiB of these larger files were searched: {}]",
            MAX_GREP_FILE_BYTES >> 20,
            cut.join(", ")
        );
    }
    note_skipped(&mut out, &skipped);
    Ok(cap(out, "narrow the search"))
}
