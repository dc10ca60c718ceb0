//! `apply_patch`: a multi-file patch ([`patch`]) applied all or nothing.
//!
//! Every section is checked and every update computed in memory first — paths through
//! [`Workspace::resolve`], files opened through `fsio`, each hunk matched — and only if all of
//! that succeeds is anything written. Writing is per file atomic (a temporary file and a
//! rename); deleted files are first renamed aside, so that if a write fails half-way (a full
//! disk) what was already done is undone and the workspace is as it was.

use super::fsio;
use super::patch::{self, FileOp};
use super::{Workspace, files};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ApplyPatchArgs {
    patch: String,
}

/// A file to write, and what to put back if the patch has to be undone.
struct Write {
    path: PathBuf,
    text: String,
    /// Its text before the patch; `None` when it did not exist.
    before: Option<String>,
    /// Whose permissions the file gets (itself, or the file it was moved from).
    mode_of: PathBuf,
}

/// What a checked patch will do: files to write, files to delete, and one line per file.
struct Plan {
    writes: Vec<Write>,
    removals: Vec<PathBuf>,
    summary: Vec<String>,
}

enum Undo {
    Remove(PathBuf),
    Restore(PathBuf, String),
    Unstash { stashed: PathBuf, path: PathBuf },
}

pub(super) fn apply_patch(
    ws: &Workspace,
    args: ApplyPatchArgs,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let not_applied = |e: String| format!("patch not applied, nothing was changed: {e}");
    let ops = patch::parse(&args.patch).map_err(not_applied)?;
    let Plan {
        writes,
        removals,
        summary,
    } = plan(ws, &ops).map_err(not_applied)?;
    if cancel.is_cancelled() {
        return Err("apply_patch was cancelled before it wrote anything".to_owned());
    }
    commit(ws, writes, removals)?;
    Ok(format!("applied the patch:\n{}", summary.join("\n")))
}

/// Everything the patch will do, checked and computed, nothing written.
fn plan(ws: &Workspace, ops: &[FileOp]) -> Result<Plan, String> {
    let mut claimed = HashSet::new();
    let mut claim = |path: &Path, user_path: &str| {
        ws.check_writable(path, user_path)?;
        if claimed.insert(path.to_path_buf()) {
            Ok(())
        } else {
            Err(format!(
                "{user_path} appears twice in the patch; give each file one section"
            ))
        }
    };
    let mut writes = Vec::new();
    let mut removals = Vec::new();
    let mut summary = Vec::new();
    for op in ops {
        match op {
            FileOp::Add { path, text } => {
                let target = ws.resolve(path)?;
                claim(&target, path)?;
                refuse_existing(&target, path, "add")?;
                summary.push(format!("A {}", ws.display(&target)));
                writes.push(Write {
                    path: target.clone(),
                    text: text.clone(),
                    before: None,
                    mode_of: target,
                });
            }
            FileOp::Delete { path } => {
                let target = ws.resolve(path)?;
                claim(&target, path)?;
                let meta = std::fs::symlink_metadata(&target)
                    .map_err(|e| format!("cannot delete {path}: {e}"))?;
                if !(meta.is_file() || meta.file_type().is_symlink()) {
                    return Err(format!(
                        "cannot delete {path}: it is {}; apply_patch deletes files",
                        fsio::kind(&meta)
                    ));
                }
                summary.push(format!("D {}", ws.display(&target)));
                removals.push(target);
            }
            FileOp::Update {
                path,
                move_to,
                hunks,
            } => {
                let opened = fsio::open_regular(ws, path, "update")?;
                let (real, text) = files::read_text(ws, opened, path, "update")?;
                claim(&real, path)?;
                let new = patch::apply_hunks(&text, hunks).map_err(|e| {
                    format!(
                        "{path}: hunk {} of {} did not match: {}",
                        e.hunk,
                        hunks.len(),
                        e.message
                    )
                })?;
                let Some(to) = move_to else {
                    summary.push(format!("M {}", ws.display(&real)));
                    writes.push(Write {
                        path: real.clone(),
                        text: new,
                        before: Some(text),
                        mode_of: real,
                    });
                    continue;
                };
                let lexical = ws.resolve(path)?;
                if lexical != real {
                    return Err(format!(
                        "{path} is a symbolic link; move the link or its target with exec"
                    ));
                }
                let dest = ws.resolve(to)?;
                claim(&dest, to)?;
                refuse_existing(&dest, to, "move a file to")?;
                summary.push(format!("R {} -> {}", ws.display(&real), ws.display(&dest)));
                writes.push(Write {
                    path: dest,
                    text: new,
                    before: None,
                    mode_of: real.clone(),
                });
                removals.push(real);
            }
        }
    }
    Ok(Plan {
        writes,
        removals,
        summary,
    })
}

fn refuse_existing(path: &Path, user_path: &str, what: &str) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => Err(format!(
            "cannot {what} {user_path}: it already exists ({}); update or delete it in its own \
             section instead",
            fsio::kind(&meta)
        )),
        Err(_) => Ok(()),
    }
}

/// Writes, then deletes; on the first failure undoes what was done, newest first.
fn commit(ws: &Workspace, writes: Vec<Write>, removals: Vec<PathBuf>) -> Result<(), String> {
    let mut done = Vec::new();
    let mut failure = None;
    for write in writes {
        match fsio::write_atomic_like(&write.path, write.text.as_bytes(), &write.mode_of) {
            Ok(()) => done.push(match write.before {
                Some(before) => Undo::Restore(write.path, before),
                None => Undo::Remove(write.path),
            }),
            Err(e) => {
                failure = Some(format!("cannot write {}: {e}", ws.display(&write.path)));
                break;
            }
        }
    }
    if failure.is_none() {
        for path in removals {
            match stash(&path) {
                Ok(stashed) => done.push(Undo::Unstash { stashed, path }),
                Err(e) => {
                    failure = Some(format!("cannot delete {}: {e}", ws.display(&path)));
                    break;
                }
            }
        }
    }
    let Some(failure) = failure else {
        let mut left = Vec::new();
        for undo in done {
            if let Undo::Unstash { stashed, .. } = undo
                && let Err(e) = std::fs::remove_file(&stashed)
            {
                left.push(format!("{} ({e})", ws.display(&stashed)));
            }
        }
        if left.is_empty() {
            return Ok(());
        }
        return Err(format!(
            "the patch was applied, but these copies of deleted files could not be removed: {}",
            left.join(", ")
        ));
    };
    let mut unrestored = Vec::new();
    for undo in done.into_iter().rev() {
        let (path, result) = match undo {
            Undo::Remove(path) => {
                let r = std::fs::remove_file(&path);
                (path, r)
            }
            Undo::Restore(path, before) => {
                let r = fsio::write_atomic(&path, before.as_bytes());
                (path, r)
            }
            Undo::Unstash { stashed, path } => {
                let r = std::fs::rename(&stashed, &path);
                (path, r)
            }
        };
        if let Err(e) = result {
            unrestored.push(format!("{} ({e})", ws.display(&path)));
        }
    }
    if unrestored.is_empty() {
        Err(format!(
            "patch not applied: {failure}; what it had already changed was undone, so nothing \
             was changed"
        ))
    } else {
        Err(format!(
            "patch only partly applied: {failure}; undoing it failed for {} — check these files",
            unrestored.join(", ")
        ))
    }
}

/// Renames a file to be deleted aside, next to it, to a name nothing else uses.
fn stash(path: &Path) -> std::io::Result<PathBuf> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for n in 0u32..1000 {
        let stashed = parent.join(format!(".{name}.{}-{n}.skiff-deleted", std::process::id()));
        if std::fs::symlink_metadata(&stashed).is_err() {
            std::fs::rename(path, &stashed)?;
            return Ok(stashed);
        }
    }
    Err(std::io::Error::other("no free name to move it aside"))
}
