//! Project instructions: the `AGENTS.md` files from the repository root down to the workspace
//! root, read at the start of every turn and given to the model after the system prompt, so a
//! project can say how it wants to be worked on (its checks, its conventions).
//!
//! In a Skiff session the workspace root *is* the repository root (the gateway makes a git
//! session's workspace a worktree of the repository's top level, as `git rev-parse
//! --show-toplevel` names it, even when a subfolder was given; a plain workspace is a copy that
//! belongs to no repository), so only the root's file counts, and nothing above the workspace is
//! ever read: a worker box does not have it, and a plain copy's parents are the gateway's. An
//! embedder whose workspace is a subfolder of a repository says where the repository root is
//! ([`Tools::with_repository_root`](crate::tools::Tools::with_repository_root)); the files from
//! there down are then given root first, each under its path relative to the repository root.
//! Nested `AGENTS.md` files below the workspace root are ordinary files the model may read.
//! Every file is opened without following a symlink and never blocking on a FIFO or device (the
//! workspace's own through the file tools' containment), and all of them together are bounded
//! to [`MAX_INSTRUCTIONS_BYTES`].

use crate::tools::Workspace;
use crate::tools::fsio;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The file, relative to each folder it is looked for in.
pub const INSTRUCTIONS_FILE: &str = "AGENTS.md";

/// The most of the files, all together, the model is given; the rest is cut with a line saying
/// so.
pub const MAX_INSTRUCTIONS_BYTES: usize = 32 * 1024;

/// What a turn found: one entry per folder holding an `AGENTS.md`, the repository root first.
#[derive(Debug, Default)]
pub(crate) struct Found {
    files: Vec<(String, One)>,
}

/// What one `AGENTS.md` gave.
#[derive(Debug)]
enum One {
    /// The text the model reads (already cut, with its marker), the file's size, and, when it
    /// was cut, how much of it was given (what was left of the bound).
    Read {
        text: String,
        size: u64,
        cut: Option<usize>,
    },
    /// There is something, but it cannot be used (a directory, a FIFO, a symlink out, binary).
    Unusable(String),
}

impl Found {
    /// The one line people see at turn start; `None` when there is nothing to say.
    pub(crate) fn notice(&self) -> Option<String> {
        if self.files.is_empty() {
            return None;
        }
        let parts: Vec<String> = self
            .files
            .iter()
            .map(|(rel, one)| match one {
                One::Read {
                    size,
                    cut: Some(limit),
                    ..
                } => format!(
                    "{rel} ({}, only the first {} given to the model)",
                    kib(*size),
                    whole_kib(*limit)
                ),
                One::Read { size, .. } => format!("{rel} ({})", kib(*size)),
                One::Unusable(why) => format!("{rel} not used: {why}"),
            })
            .collect();
        Some(format!("project instructions: {}", parts.join(", ")))
    }

    /// The system text for a request: the base prompt, then the instructions under a heading.
    // INVARIANT: built only from the files' bytes, their paths relative to the repository root
    // and constants — no absolute path, host or placement — so the request is the same on the
    // gateway and on a worker.
    pub(crate) fn system(&self, base: &str) -> String {
        let read: Vec<(&str, &str)> = self
            .files
            .iter()
            .filter_map(|(rel, one)| match one {
                One::Read { text, .. } => Some((rel.as_str(), text.as_str())),
                One::Unusable(_) => None,
            })
            .collect();
        match read.as_slice() {
            [] => base.to_owned(),
            // The workspace root's file alone: the text as it always was.
            [(rel, text)] if *rel == INSTRUCTIONS_FILE => format!(
                "{base}\n\n# Project instructions\n\nThe workspace's {INSTRUCTIONS_FILE} says \
                 the following; follow it unless the user asks otherwise.\n\n{text}"
            ),
            files => {
                let mut out = format!(
                    "{base}\n\n# Project instructions\n\nThese {INSTRUCTIONS_FILE} files say \
                     the following, the repository root's first; where they disagree, the one \
                     nearer the workspace wins. Follow them unless the user asks otherwise."
                );
                for (rel, text) in files {
                    out.push_str(&format!("\n\n## {rel}\n\n{text}"));
                }
                out
            }
        }
    }
}

/// Reads the instructions on the blocking pool (no open waits, see `fsio`). `repository` is a
/// folder above the workspace root the files are also looked for in, down from it.
pub(crate) async fn load(ws: &Workspace, repository: Option<&Path>) -> Found {
    let ws = ws.clone();
    let repository = repository.map(Path::to_path_buf);
    match tokio::task::spawn_blocking(move || read(&ws, repository.as_deref())).await {
        Ok(found) => found,
        Err(e) => Found {
            files: vec![(
                INSTRUCTIONS_FILE.to_owned(),
                One::Unusable(format!("reading it crashed: {e}")),
            )],
        },
    }
}

fn read(ws: &Workspace, repository: Option<&Path>) -> Found {
    // The folders from the repository root down to the workspace root, with their paths
    // relative to the repository root.
    let mut folders: Vec<(PathBuf, String)> = Vec::new();
    if let Some(below) = repository.and_then(|repo| ws.root().strip_prefix(repo).ok()) {
        let mut dir = ws.root().to_path_buf();
        let mut rel = below.to_path_buf();
        for _ in below.components() {
            dir.pop();
            rel.pop();
            folders.push((dir.clone(), relative(&rel)));
        }
        folders.reverse();
    }
    let mut budget = MAX_INSTRUCTIONS_BYTES;
    let mut files = Vec::new();
    for (dir, rel) in folders {
        if let Some(one) = read_parent(&dir.join(INSTRUCTIONS_FILE), &mut budget) {
            files.push((rel, one));
        }
    }
    let root_rel = repository
        .and_then(|repo| ws.root().strip_prefix(repo).ok())
        .map_or_else(|| INSTRUCTIONS_FILE.to_owned(), relative);
    if let Some(one) = read_root(ws, &mut budget) {
        files.push((root_rel, one));
    }
    Found { files }
}

/// `dir/AGENTS.md` as a path relative to the repository root ("AGENTS.md", "app/AGENTS.md").
fn relative(dir: &Path) -> String {
    dir.join(INSTRUCTIONS_FILE).to_string_lossy().into_owned()
}

/// The workspace root's file, contained like any file a tool opens.
fn read_root(ws: &Workspace, budget: &mut usize) -> Option<One> {
    match std::fs::symlink_metadata(ws.root().join(INSTRUCTIONS_FILE)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(One::Unusable(e.to_string())),
        Ok(_) => {}
    }
    Some(match fsio::open_regular(ws, INSTRUCTIONS_FILE, "read") {
        Ok(opened) => take(opened.file, opened.meta.len(), budget),
        Err(why) => One::Unusable(why),
    })
}

/// A file in a folder above the workspace: opened without following a symlink or blocking, and
/// used only when it is a regular file.
fn read_parent(path: &Path, budget: &mut usize) -> Option<One> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(One::Unusable(e.to_string())),
        Ok(meta) => meta,
    };
    if !meta.is_file() {
        return Some(One::Unusable(format!(
            "it is {}, not a regular file",
            fsio::kind(&meta)
        )));
    }
    let file = match fsio::open_nonblocking(path) {
        Ok(file) => file,
        Err(e) => return Some(One::Unusable(format!("cannot open it: {e}"))),
    };
    Some(match file.metadata() {
        Ok(meta) if meta.is_file() => take(file, meta.len(), budget),
        Ok(meta) => One::Unusable(format!("it is {}, not a regular file", fsio::kind(&meta))),
        Err(e) => One::Unusable(format!("cannot read it: {e}")),
    })
}

/// Up to `budget` bytes of an opened file, cut on a character boundary with a line saying so;
/// the budget shrinks by what was taken.
fn take(file: std::fs::File, size: u64, budget: &mut usize) -> One {
    let limit = *budget;
    let mut bytes = Vec::new();
    if let Err(e) = file.take(*budget as u64 + 1).read_to_end(&mut bytes) {
        return One::Unusable(format!("cannot read it: {e}"));
    }
    if bytes.contains(&0) {
        return One::Unusable("it is a binary file".to_owned());
    }
    let cut = bytes.len() > *budget;
    bytes.truncate(*budget);
    // A cut through a character drops that character rather than showing a replacement.
    if let Err(e) = std::str::from_utf8(&bytes)
        && e.error_len().is_none()
    {
        bytes.truncate(e.valid_up_to());
    }
    *budget -= bytes.len();
    let mut text = String::from_utf8_lossy(&bytes).into_owned();
    // The size it had when opened, which is what the notice says too.
    let size = if cut {
        size.max(bytes.len() as u64 + 1)
    } else {
        size
    };
    if cut {
        text.push_str(&format!(
            "\n\n[{INSTRUCTIONS_FILE} is {}; only its first {} are shown here. Read the \
             file for the rest.]",
            kib(size),
            whole_kib(limit)
        ));
    }
    One::Read {
        text,
        size,
        cut: cut.then_some(limit),
    }
}

/// A bound: "32 KiB", "700 bytes".
fn whole_kib(bytes: usize) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{} KiB", bytes / 1024)
    }
}

/// "812 bytes", "1.2 KiB".
fn kib(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(content: Option<&[u8]>) -> (tempfile::TempDir, Workspace) {
        let dir = tempfile::tempdir().unwrap();
        if let Some(content) = content {
            std::fs::write(dir.path().join(INSTRUCTIONS_FILE), content).unwrap();
        }
        let ws = Workspace::new(dir.path().to_path_buf()).unwrap();
        (dir, ws)
    }

    #[test]
    fn no_file_changes_nothing_and_says_nothing() {
        let (_d, ws) = ws(None);
        let found = read(&ws, None);
        assert!(found.notice().is_none());
        assert_eq!(found.system("base"), "base");
    }

    #[test]
    fn a_small_file_is_given_whole_and_named_with_its_size() {
        let (_d, ws) = ws(Some("Run `make check`.\n".repeat(100).as_bytes()));
        let found = read(&ws, None);
        assert_eq!(
            found.notice().unwrap(),
            "project instructions: AGENTS.md (1.8 KiB)"
        );
        let system = found.system("base");
        assert!(system.starts_with("base\n\n# Project instructions\n"));
        assert!(system.ends_with("Run `make check`.\n"));
    }

    #[test]
    fn a_large_file_is_cut_on_a_character_boundary_with_a_line_saying_so() {
        // 'é' is two bytes; at an odd offset the cut falls inside one.
        let content = format!("x{}", "é".repeat(MAX_INSTRUCTIONS_BYTES));
        let (_d, ws) = ws(Some(content.as_bytes()));
        let found = read(&ws, None);
        let [(_, One::Read { text, size, .. })] = found.files.as_slice() else {
            panic!("{found:?}")
        };
        assert_eq!(*size, content.len() as u64);
        let (shown, marker) = text.split_once("\n\n[").unwrap();
        assert_eq!(shown.len(), MAX_INSTRUCTIONS_BYTES - 1);
        assert!(content.starts_with(shown));
        assert!(marker.contains("only its first 32 KiB"), "{marker}");
        assert!(
            found.notice().unwrap().contains("only the first 32 KiB"),
            "{:?}",
            found.notice()
        );
    }

    #[test]
    fn a_directory_or_fifo_is_named_and_not_used() {
        let (dir, ws) = ws(None);
        std::fs::create_dir(dir.path().join(INSTRUCTIONS_FILE)).unwrap();
        let found = read(&ws, None);
        assert_eq!(found.system("base"), "base");
        assert!(
            found
                .notice()
                .unwrap()
                .contains("not used: AGENTS.md is a directory"),
            "{:?}",
            found.notice()
        );
        std::fs::remove_dir(dir.path().join(INSTRUCTIONS_FILE)).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(dir.path().join(INSTRUCTIONS_FILE))
            .status()
            .unwrap();
        assert!(made.success());
        let found = read(&ws, None);
        assert!(
            found.notice().unwrap().contains("a FIFO"),
            "{:?}",
            found.notice()
        );
    }

    #[test]
    fn a_symlink_out_of_the_workspace_is_not_followed() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "secret").unwrap();
        let (dir, ws) = ws(None);
        std::os::unix::fs::symlink(
            outside.path().join("secret"),
            dir.path().join(INSTRUCTIONS_FILE),
        )
        .unwrap();
        let found = read(&ws, None);
        assert_eq!(found.system("base"), "base");
        assert!(
            found.notice().unwrap().contains("outside the workspace"),
            "{:?}",
            found.notice()
        );
    }

    #[test]
    fn parent_folders_share_the_bound_root_first_and_each_is_named() {
        let repo = tempfile::tempdir().unwrap();
        let sub = repo.path().join("a/b");
        std::fs::create_dir_all(&sub).unwrap();
        // The root's file takes all but 100 bytes of the bound; `a/` has none; a directory
        // named AGENTS.md in between would be named, not read.
        let root_text = "r".repeat(MAX_INSTRUCTIONS_BYTES - 100);
        std::fs::write(repo.path().join(INSTRUCTIONS_FILE), &root_text).unwrap();
        std::fs::write(sub.join(INSTRUCTIONS_FILE), "s".repeat(300)).unwrap();
        let ws = Workspace::new(sub).unwrap();
        let repo_root = repo.path().canonicalize().unwrap();
        let found = read(&ws, Some(&repo_root));
        assert_eq!(
            found.notice().unwrap(),
            "project instructions: AGENTS.md (31.9 KiB), a/b/AGENTS.md (300 bytes, only the \
             first 100 bytes given to the model)"
        );
        let system = found.system("base");
        assert!(system.contains(&format!("## AGENTS.md\n\n{root_text}\n\n## a/b/AGENTS.md\n\n{}\n\n[AGENTS.md is 300 bytes; only its first 100 bytes are shown here.", "s".repeat(100))), "{system}");

        std::fs::create_dir(repo.path().join("a").join(INSTRUCTIONS_FILE)).unwrap();
        let found = read(&ws, Some(&repo_root));
        assert!(
            found
                .notice()
                .unwrap()
                .contains("a/AGENTS.md not used: it is a directory, not a regular file"),
            "{:?}",
            found.notice()
        );
    }
}
