//! Bringing a box's work back into a plain (non-git) workspace: a manifest-diffed mirror with
//! delete propagation. The order is the safety: check the box's manifest (containment, limits),
//! check that the gateway's copy still matches the base manifest (drift stops everything), pull
//! the changed files into a private staging directory, check every staged byte against the
//! box's manifest, and only then write and delete.
//!
//! The staging and apply steps are shared with [`crate::inbound_git`], which mirrors the box's
//! uncommitted files the same way. Deliberately absent: merging — exclusive ownership of the
//! workspace makes conflicts impossible, and drift is refused rather than merged.

use crate::filelist::{Limits, Mode};
use crate::rules::Rules;
use crate::transfer::{Method, Remote};
use crate::{Error, Manifest, ManifestEntry, Result, Scratch, contain, io_err, join, manifest};
use skiff_protocol::sync::Refusal;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// Where the box's work comes back to.
#[derive(Clone, Copy, Debug)]
pub struct Inbound<'a> {
    /// The gateway-owned target directory.
    pub target: &'a Path,
    /// The base manifest recorded when the workspace was laid onto the box.
    pub base: &'a Manifest,
    pub rules: &'a Rules,
    pub limits: &'a Limits,
    /// A private directory of the gateway on the same file system as `target`.
    pub scratch: &'a Path,
}

/// What an inbound sync changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub written: Vec<String>,
    pub deleted: Vec<String>,
    /// How the bytes came (none when nothing had to be pulled).
    pub method: Option<Method>,
}

/// What a mirror did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mirrored {
    pub files: Applied,
    /// Paths of the box's that were not adopted, and why (the base's version stays).
    pub refused: Vec<Refusal>,
    /// What the target holds now, as a manifest: the next base.
    pub manifest: Manifest,
}

/// Mirrors the box's workspace (described by `theirs`, the box's manifest) into `inb.target`.
/// Paths containment refuses are left as the base has them and named in the result.
pub async fn mirror(
    inb: &Inbound<'_>,
    theirs: &Manifest,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Mirrored> {
    let screened = crate::quarantine::screen(theirs, inb.base, inb.limits, inb.rules)?;
    mirror_screened(inb, screened, remote, cancel).await
}

/// [`mirror`] of a box's manifest the caller already screened against `inb.base` with
/// `inb.limits` and `inb.rules` ([`crate::quarantine::screen`]).
pub async fn mirror_screened(
    inb: &Inbound<'_>,
    screened: crate::quarantine::Screened,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Mirrored> {
    let theirs = &screened.manifest;
    check_drift(
        inb.target,
        Mode::Plain,
        inb.base,
        inb.rules,
        inb.limits,
        cancel,
    )
    .await?;
    let diff = manifest::diff(inb.base, theirs);
    // A path the box no longer lists is deleted here — unless a build-output rule may have
    // left it out there (a marker file the box made beside it), which is not a deletion.
    let deleted: BTreeSet<String> = diff
        .deleted
        .into_iter()
        .filter(|p| !inb.rules.may_be_left_out_elsewhere(p))
        .collect();
    precheck_writes(inb.target, &diff.changed, &deleted)?;
    let staged = stage(remote, &diff.changed, inb.scratch, cancel).await?;
    let files = apply(inb.target, &staged, &diff.changed, &deleted)?;
    Ok(Mirrored {
        files,
        refused: screened.refused,
        manifest: screened.manifest,
    })
}

/// Refuses when `target` no longer matches `base` (paths filtered by the same rules); returns
/// what it found there (base commit unset).
pub async fn check_drift(
    target: &Path,
    mode: Mode,
    base: &Manifest,
    rules: &Rules,
    limits: &Limits,
    cancel: &CancellationToken,
) -> Result<Manifest> {
    let unlimited = Limits {
        max_files: usize::MAX,
        max_total_bytes: u64::MAX,
        max_file_bytes: u64::MAX,
    };
    let _ = limits;
    let ours = manifest::scan(target, mode, rules, &unlimited, cancel).await?;
    let drifted = manifest::differences(base, &ours);
    if drifted.is_empty() {
        return Ok(ours);
    }
    let mut paths: Vec<String> = drifted.iter().take(10).cloned().collect();
    if drifted.len() > 10 {
        paths.push(format!("and {} more", drifted.len() - 10));
    }
    Err(Error::Drift {
        target: target.display().to_string(),
        paths: paths.join(", "),
    })
}

/// Refuses, before anything is written, a write that would pass through a symlink or replace
/// a directory or file that is not itself being replaced or deleted.
pub(crate) fn precheck_writes(
    target: &Path,
    changed: &BTreeMap<String, ManifestEntry>,
    deleted: &BTreeSet<String>,
) -> Result<()> {
    for path in changed.keys() {
        if let Some(problem) = contain::parent_chain_problem(target, path) {
            let parent_deleted = deleted.iter().any(|d| path.starts_with(&format!("{d}/")));
            if !parent_deleted {
                return Err(Error::Unsafe {
                    path: path.clone(),
                    reason: format!("writing it would pass through {problem}"),
                });
            }
        }
        let full = join(target, path);
        if let Ok(meta) = std::fs::symlink_metadata(&full)
            && meta.is_dir()
        {
            let emptied = std::fs::read_dir(&full)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false)
                || deleted.iter().any(|d| d.starts_with(&format!("{path}/")));
            if !emptied {
                return Err(Error::Unsafe {
                    path: path.clone(),
                    reason: format!("{} is a directory on the gateway", full.display()),
                });
            }
        }
    }
    Ok(())
}

/// Pulls the changed regular files into a fresh staging directory and checks them.
pub(crate) async fn stage(
    remote: &Remote,
    changed: &BTreeMap<String, ManifestEntry>,
    scratch: &Path,
    cancel: &CancellationToken,
) -> Result<Staged> {
    let dir = Scratch::new(scratch, "inbound")?;
    let files: Vec<String> = changed
        .iter()
        .filter(|(_, e)| matches!(e, ManifestEntry::File { .. }))
        .map(|(p, _)| p.clone())
        .collect();
    let method = if files.is_empty() {
        None
    } else {
        Some(remote.pull_files(&files, dir.path(), cancel).await?)
    };
    verify_staged(dir.path(), changed)?;
    Ok(Staged { dir, method })
}

pub(crate) struct Staged {
    dir: Scratch,
    method: Option<Method>,
}

impl Staged {
    /// Files the gateway staged itself (a checkpoint rebuilt for a restore): nothing moved
    /// over the network.
    pub(crate) fn local(dir: Scratch) -> Staged {
        Staged { dir, method: None }
    }
}

/// Every staged entry must be an expected regular file (or a directory above one) whose size
/// and blake3 match the manifest; every expected file must be there. (Mode bits are set from
/// the manifest when applying.)
fn verify_staged(staging: &Path, changed: &BTreeMap<String, ManifestEntry>) -> Result<()> {
    let mut expected_dirs = BTreeSet::new();
    for path in changed.keys() {
        let mut p = path.as_str();
        while let Some((parent, _)) = p.rsplit_once('/') {
            expected_dirs.insert(parent.to_owned());
            p = parent;
        }
    }
    let mut stack = vec![(staging.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            let name = entry.file_name();
            let name = name.to_str().ok_or_else(|| Error::Mismatch {
                path: entry.path().display().to_string(),
                detail: "the name is not UTF-8".into(),
            })?;
            let path = if rel.is_empty() {
                name.to_owned()
            } else {
                format!("{rel}/{name}")
            };
            let ft = entry.file_type().map_err(io_err(&entry.path()))?;
            if ft.is_dir() && expected_dirs.contains(&path) {
                stack.push((entry.path(), path));
                continue;
            }
            match changed.get(&path) {
                Some(ManifestEntry::File { .. }) if ft.is_file() => {}
                Some(ManifestEntry::File { .. }) => {
                    return Err(Error::Mismatch {
                        path,
                        detail: "a regular file was promised, something else arrived".into(),
                    });
                }
                _ => {
                    return Err(Error::Mismatch {
                        path,
                        detail: "it arrived but is not in the manifest as a file".into(),
                    });
                }
            }
        }
    }
    for (path, entry) in changed {
        let ManifestEntry::File { blake3, size, .. } = entry else {
            continue;
        };
        let full = join(staging, path);
        let meta = std::fs::symlink_metadata(&full).map_err(|_| Error::Mismatch {
            path: path.clone(),
            detail: "it did not arrive (a device, FIFO or socket on the box does not transfer)"
                .into(),
        })?;
        if !meta.is_file() {
            return Err(Error::Mismatch {
                path: path.clone(),
                detail: format!(
                    "a {} arrived",
                    crate::filelist::special_kind(&meta.file_type())
                ),
            });
        }
        let (got, len) = manifest::hash_file(&full)?;
        if len != *size || &got != blake3 {
            return Err(Error::Mismatch {
                path: path.clone(),
                detail: format!(
                    "{len} bytes with blake3 {got}, the manifest says {size} bytes with blake3 {blake3}"
                ),
            });
        }
    }
    Ok(())
}

/// Deletes, then writes (staged files renamed into place, symlinks created from the manifest),
/// then removes directories the deletes emptied.
pub(crate) fn apply(
    target: &Path,
    staged: &Staged,
    changed: &BTreeMap<String, ManifestEntry>,
    deleted: &BTreeSet<String>,
) -> Result<Applied> {
    let mut applied = Applied {
        method: staged.method,
        ..Applied::default()
    };
    for path in deleted {
        let full = join(target, path);
        match std::fs::symlink_metadata(&full) {
            Ok(meta) if !meta.is_dir() => {
                std::fs::remove_file(&full).map_err(io_err(&full))?;
                applied.deleted.push(path.clone());
            }
            _ => {}
        }
    }
    for path in deleted {
        let mut p = path.as_str();
        while let Some((parent, _)) = p.rsplit_once('/') {
            let dir = join(target, parent);
            if std::fs::remove_dir(&dir).is_err() {
                break;
            }
            p = parent;
        }
    }
    for (path, entry) in changed {
        contain::create_parents(target, path)?;
        let full = join(target, path);
        if let Ok(meta) = std::fs::symlink_metadata(&full) {
            if meta.is_dir() {
                std::fs::remove_dir(&full).map_err(io_err(&full))?;
            } else {
                std::fs::remove_file(&full).map_err(io_err(&full))?;
            }
        }
        match entry {
            ManifestEntry::File { mode, .. } => {
                let src = join(staged.dir.path(), path);
                if std::fs::rename(&src, &full).is_err() {
                    std::fs::copy(&src, &full).map_err(io_err(&full))?;
                }
                std::fs::set_permissions(&full, std::fs::Permissions::from_mode(mode & 0o777))
                    .map_err(io_err(&full))?;
            }
            ManifestEntry::Symlink { target: link } => {
                std::os::unix::fs::symlink(link, &full).map_err(io_err(&full))?;
            }
        }
        applied.written.push(path.clone());
    }
    Ok(applied)
}
