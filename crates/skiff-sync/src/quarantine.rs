//! Nothing a box produced is silently dropped (DESIGN §7.8). Reconciliation screens the box's
//! manifest path by path: what passes every containment check is adopted, what does not is
//! refused by name — and before anything is adopted, the refused paths' bytes (and the box's
//! commits, as a bundle) are captured into the content-addressed store, so an operator can
//! inspect them and accept or discard them. Afterwards the box is put back in step with what
//! was adopted, so the same refusal does not come back every turn.
//!
//! Containment is exactly as strict for what is adopted as before; only *where* a refusal ends
//! (the whole turn, or one path) changed. Deliberately absent: the decision to accept (an
//! operator's, made through the gateway) and storage rows (`skiff-store`'s).

use crate::cas::Cas;
use crate::filelist::{Limits, human};
use crate::rules::Rules;
use crate::transfer::Remote;
use crate::{Error, Manifest, ManifestEntry, Result, Scratch, contain, join, manifest};
use skiff_protocol::sync::{QuarantinedPath, Refusal, RefusalKind};
use skiff_ssh::shell_quote;
use std::collections::BTreeMap;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// The box's manifest split into what may be adopted and what was refused.
#[derive(Clone, Debug)]
pub struct Screened {
    /// What the workspace holds after adoption: the box's entries that passed, and the base's
    /// entries where the box's were refused.
    pub manifest: Manifest,
    pub refused: Vec<Refusal>,
}

/// Why one changed entry of the box may not be adopted, if it may not.
fn problem(path: &str, entry: &ManifestEntry, limits: &Limits, rules: &Rules) -> Option<String> {
    let reason = |e: Error| match e {
        Error::Unsafe { reason, .. } => reason,
        other => other.to_string(),
    };
    if let Err(e) = contain::check_path(path) {
        return Some(reason(e));
    }
    if rules.excluded(path, false) {
        return Some("the gateway's sync rules exclude it, so the box may not write it".into());
    }
    match entry {
        ManifestEntry::File { size, blake3, .. } => {
            if *size > limits.max_file_bytes {
                return Some(format!(
                    "it is {}, over the per-file limit of {}",
                    human(*size),
                    human(limits.max_file_bytes)
                ));
            }
            if blake3.len() != 64 || !blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Some("the manifest's blake3 is not 64 hex digits".into());
            }
            None
        }
        ManifestEntry::Symlink { target } => contain::check_symlink(path, target).err().map(reason),
    }
}

/// Splits `theirs` (the box's manifest) against `base` (what the box was given). An entry
/// unchanged from the base is data and always passes. Limits on the whole (entry count, total
/// size) and the manifest's version are not per path: they still fail the whole adoption.
pub fn screen(
    theirs: &Manifest,
    base: &Manifest,
    limits: &Limits,
    rules: &Rules,
) -> Result<Screened> {
    let mut entries = BTreeMap::new();
    let mut refused = Vec::new();
    for (path, entry) in &theirs.entries {
        let unchanged = base.entries.get(path) == Some(entry);
        // What the base already has is kept whatever it is: only changes are judged.
        let problem = if unchanged {
            None
        } else {
            problem(path, entry, limits, rules)
        };
        match (unchanged, problem) {
            (false, Some(reason)) => {
                refused.push(Refusal {
                    path: path.clone(),
                    reason,
                    kind: RefusalKind::Path,
                });
                if let Some(kept) = base.entries.get(path) {
                    entries.insert(path.clone(), kept.clone());
                }
            }
            _ => {
                entries.insert(path.clone(), entry.clone());
            }
        }
    }
    // Nothing may sit below a file or symlink: the deeper path is the one refused (its write
    // would land somewhere else), and the base's version stays. One pass: removing a path
    // never puts another below a file.
    let below: Vec<(String, String)> = entries
        .keys()
        .filter_map(|path| {
            let mut prefix = path.as_str();
            while let Some((parent, _)) = prefix.rsplit_once('/') {
                if entries.contains_key(parent) {
                    return Some((path.clone(), parent.to_owned()));
                }
                prefix = parent;
            }
            None
        })
        .collect();
    for (path, parent) in below {
        entries.remove(&path);
        refused.push(Refusal {
            reason: format!("{parent} is a file or symlink, so nothing can sit below it"),
            path,
            kind: RefusalKind::Path,
        });
    }
    let screened = Manifest {
        version: theirs.version,
        base_commit: theirs.base_commit.clone(),
        entries,
    };
    contain::check_manifest(&screened, Some(base), limits)?;
    refused.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Screened {
        manifest: screened,
        refused,
    })
}

/// What was captured of a box's refused work.
#[derive(Clone, Debug, Default)]
pub struct Captured {
    pub paths: Vec<QuarantinedPath>,
    /// blake3 of every blob the capture stored (file bytes, the bundle).
    pub blobs: Vec<String>,
    /// blake3 of the box's bundle, when it had commits.
    pub bundle: Option<String>,
}

/// Captures the refused paths of `theirs` (their bytes, for files a transfer can carry and
/// the limits allow) and the box's bundle into `cas`. Each pulled file is checked against the
/// box's manifest like any inbound byte.
#[allow(clippy::too_many_arguments)]
pub async fn capture(
    remote: &Remote,
    refused: &[Refusal],
    theirs: &Manifest,
    bundle: Option<&Path>,
    cas: &Cas,
    scratch: &Path,
    limits: &Limits,
    cancel: &CancellationToken,
) -> Result<Captured> {
    let mut captured = Captured::default();
    let pullable = |path: &str, entry: &ManifestEntry| {
        matches!(entry, ManifestEntry::File { size, .. } if *size <= limits.max_file_bytes)
            && contain::check_path(path).is_ok()
    };
    let files: Vec<String> = refused
        .iter()
        .filter(|r| r.kind == RefusalKind::Path)
        .filter_map(|r| {
            let entry = theirs.entries.get(&r.path)?;
            pullable(&r.path, entry).then(|| r.path.clone())
        })
        .collect();
    let staging = Scratch::new(scratch, "quarantine")?;
    if !files.is_empty() {
        remote.pull_files(&files, staging.path(), cancel).await?;
    }
    for r in refused {
        let entry = match r.kind {
            RefusalKind::Path => theirs.entries.get(&r.path).cloned(),
            RefusalKind::Commits | RefusalKind::Everything => None,
        };
        let kept = match &entry {
            Some(ManifestEntry::Symlink { .. }) => true,
            Some(ManifestEntry::File { blake3, size, .. }) if files.contains(&r.path) => {
                let full = join(staging.path(), &r.path);
                // Only what arrived as a regular file of the promised size is read: a box
                // could have turned the path into a symlink to a device or a FIFO by now.
                let regular = std::fs::symlink_metadata(&full)
                    .is_ok_and(|m| m.file_type().is_file() && m.len() == *size);
                match regular.then(|| manifest::hash_file(&full)) {
                    Some(Ok((got, _))) if &got == blake3 => {
                        let (hash, _) = cas.put_file(&full)?;
                        captured.blobs.push(hash);
                        true
                    }
                    _ => false,
                }
            }
            _ => false,
        };
        captured.paths.push(QuarantinedPath {
            path: r.path.clone(),
            reason: r.reason.clone(),
            kind: r.kind,
            entry,
            kept,
        });
    }
    if let Some(bundle) = bundle {
        let (hash, _) = cas.put_file(bundle)?;
        captured.blobs.push(hash.clone());
        captured.bundle = Some(hash);
    }
    Ok(captured)
}

/// Puts the box back in step with what was adopted: each refused path whose bytes the
/// quarantine kept gets the base's version (a symlink recreated, a file pushed from `local`, a
/// path the base did not have removed), and with `reset_to` the box's branch goes back to that
/// commit with its files left as they are (its commits were refused; they are in the
/// quarantine's bundle). A path whose bytes were not kept (over the size limit) stays on the
/// box — its only copy — and so do paths that are not plain workspace paths.
pub async fn revert_on_box(
    remote: &Remote,
    local: &Path,
    base: &Manifest,
    kept: &[QuarantinedPath],
    reset_to: Option<&str>,
    cancel: &CancellationToken,
) -> Result<()> {
    let mut script = format!("set -e; cd {}", remote.quoted_dir());
    let mut push = Vec::new();
    for r in kept {
        // Only a path whose bytes are safe in the quarantine: anything else stays on the box,
        // its only copy.
        if r.kind != RefusalKind::Path || !r.kept || contain::check_path(&r.path).is_err() {
            continue;
        }
        let path = shell_quote(&r.path);
        match base.entries.get(&r.path) {
            Some(ManifestEntry::Symlink { target }) => {
                script.push_str(&format!(
                    "; rm -rf -- {path}; ln -s -- {} {path}",
                    shell_quote(target)
                ));
            }
            Some(ManifestEntry::File { .. }) => {
                script.push_str(&format!("; rm -rf -- {path}"));
                push.push(r.path.clone());
            }
            None => script.push_str(&format!("; rm -rf -- {path}")),
        }
    }
    if let Some(commit) = reset_to {
        if !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::Invalid {
                what: format!("commit {commit:?}"),
                detail: "not a commit id".into(),
            });
        }
        script.push_str(&format!("; git reset -q --soft {commit}"));
    }
    remote.run(&script, Vec::new(), cancel).await?;
    if !push.is_empty() {
        remote.push_files(local, &push, cancel).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(hash: char, size: u64) -> ManifestEntry {
        ManifestEntry::File {
            size,
            mode: 0o644,
            blake3: hash.to_string().repeat(64),
        }
    }

    fn link(target: &str) -> ManifestEntry {
        ManifestEntry::Symlink {
            target: target.into(),
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
    fn refused_paths_keep_the_base_and_the_rest_passes() {
        let base = manifest(&[
            ("a.txt", file('a', 1)),
            ("licenses", link("/usr/share/common-licenses")),
            ("link", link("a.txt")),
        ]);
        let theirs = manifest(&[
            ("a.txt", file('b', 2)),
            ("licenses", link("/usr/share/common-licenses")),
            ("link", link("/etc")),
            ("new-leak", link("../../outside")),
            ("big.bin", file('c', 10 << 30)),
            ("ok.txt", file('d', 3)),
        ]);
        let s = screen(&theirs, &base, &Limits::default(), &Rules::builtin()).unwrap();
        let refused: Vec<&str> = s.refused.iter().map(|r| r.path.as_str()).collect();
        assert_eq!(refused, ["big.bin", "link", "new-leak"]);
        assert!(
            s.refused[0].reason.contains("per-file limit"),
            "{:?}",
            s.refused[0]
        );
        assert_eq!(s.manifest.entries["a.txt"], file('b', 2));
        assert_eq!(s.manifest.entries["ok.txt"], file('d', 3));
        assert_eq!(
            s.manifest.entries["link"],
            link("a.txt"),
            "the base's version stays"
        );
        assert_eq!(
            s.manifest.entries["licenses"],
            link("/usr/share/common-licenses"),
            "an unchanged escaping symlink is data"
        );
        assert!(!s.manifest.entries.contains_key("new-leak"));
        assert!(!s.manifest.entries.contains_key("big.bin"));
    }

    #[test]
    fn nothing_below_a_file() {
        let base = manifest(&[]);
        let theirs = manifest(&[("a", file('a', 1)), ("a/b", file('b', 1))]);
        let s = screen(&theirs, &base, &Limits::default(), &Rules::builtin()).unwrap();
        assert_eq!(s.refused.len(), 1);
        assert_eq!(s.refused[0].path, "a/b");
    }
}
