//! Manifests: what a workspace holds, path by path (blake3, size, mode, symlink target), plus
//! the base commit in git mode. A base manifest is recorded when a workspace is laid onto a box
//! and never changes; inbound sync diffs the box's manifest against it and checks that the
//! gateway's copy still matches it. Stored as JSON.
//!
//! Deliberately absent: deciding what is listed ([`crate::filelist`]) and any I/O beyond
//! reading the files being hashed.

use crate::filelist::{FileList, Limits, Mode};
use crate::rules::Rules;
use crate::{Error, Manifest, ManifestEntry, Result, io_err, join};
use skiff_protocol::sync::MANIFEST_VERSION;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// What changed from one manifest to another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Added or changed paths, with their new entries.
    pub changed: BTreeMap<String, ManifestEntry>,
    pub deleted: BTreeSet<String>,
}

impl Diff {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.deleted.is_empty()
    }
}

/// Hashes one file (or reads one symlink) of `root`.
pub fn entry_of(root: &Path, rel: &str) -> Result<ManifestEntry> {
    let full = join(root, rel);
    let meta = std::fs::symlink_metadata(&full).map_err(io_err(&full))?;
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target = std::fs::read_link(&full).map_err(io_err(&full))?;
        let target = target.to_str().ok_or_else(|| Error::Invalid {
            what: full.display().to_string(),
            detail: "the symlink target is not UTF-8".into(),
        })?;
        return Ok(ManifestEntry::Symlink {
            target: target.to_owned(),
        });
    }
    if !ft.is_file() {
        return Err(Error::Special {
            path: full.display().to_string(),
            kind: crate::filelist::special_kind(&ft),
        });
    }
    let (blake3, size) = hash_file(&full)?;
    Ok(ManifestEntry::File {
        blake3,
        size,
        mode: meta.permissions().mode() & 0o777,
    })
}

/// blake3 (hex) and length of a file's bytes.
pub fn hash_file(path: &Path) -> Result<(String, u64)> {
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = blake3::Hasher::new();
    let size = std::io::copy(&mut file, &mut hasher).map_err(io_err(path))?;
    Ok((hasher.finalize().to_hex().to_string(), size))
}

/// The manifest of the listed files of `root`. Files whose stat data has not changed since
/// this process last hashed them in the same workspace are not read again
/// ([`crate::statcache`]).
pub fn build(root: &Path, list: &FileList, base_commit: Option<String>) -> Result<Manifest> {
    let cache = crate::statcache::shared(root);
    let entries = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entries(root, list)?;
    Ok(Manifest {
        version: MANIFEST_VERSION,
        base_commit,
        entries,
    })
}

/// Lists and hashes `root` in one go: what a box's worker reports, and what drift checks
/// compare against the base.
pub async fn scan(
    root: &Path,
    mode: Mode,
    rules: &Rules,
    limits: &Limits,
    cancel: &CancellationToken,
) -> Result<Manifest> {
    let started = std::time::Instant::now();
    let list = crate::filelist::list(root, mode, rules, limits, cancel).await?;
    let listed = started.elapsed().as_millis() as u64;
    let manifest = build(root, &list, None);
    tracing::debug!(
        root = %root.display(),
        files = list.files.len(),
        listed_ms = listed,
        ms = started.elapsed().as_millis() as u64,
        "manifest: scanned"
    );
    manifest
}

/// What turns `old` into `new`.
pub fn diff(old: &Manifest, new: &Manifest) -> Diff {
    let mut d = Diff::default();
    for (path, entry) in &new.entries {
        if old.entries.get(path) != Some(entry) {
            d.changed.insert(path.clone(), entry.clone());
        }
    }
    for path in old.entries.keys() {
        if !new.entries.contains_key(path) {
            d.deleted.insert(path.clone());
        }
    }
    d
}

/// `old` with `diff` applied (the base commit is `new_base`).
pub fn apply(old: &Manifest, diff: &Diff, new_base: Option<String>) -> Manifest {
    let mut entries = old.entries.clone();
    for path in &diff.deleted {
        entries.remove(path);
    }
    for (path, entry) in &diff.changed {
        entries.insert(path.clone(), entry.clone());
    }
    Manifest {
        version: MANIFEST_VERSION,
        base_commit: new_base,
        entries,
    }
}

/// Paths where `actual` differs from `expected` (either side), sorted.
pub fn differences(expected: &Manifest, actual: &Manifest) -> Vec<String> {
    let d = diff(expected, actual);
    let mut paths: Vec<String> = d.changed.into_keys().chain(d.deleted).collect();
    paths.sort();
    paths
}

pub fn to_json(manifest: &Manifest) -> Result<String> {
    serde_json::to_string(manifest).map_err(|e| Error::Invalid {
        what: "a manifest".into(),
        detail: e.to_string(),
    })
}

pub fn from_json(text: &str) -> Result<Manifest> {
    let m: Manifest = serde_json::from_str(text).map_err(|e| Error::Invalid {
        what: "a manifest".into(),
        detail: e.to_string(),
    })?;
    if m.version != MANIFEST_VERSION {
        return Err(Error::Invalid {
            what: "a manifest".into(),
            detail: format!(
                "version {} (this build reads {MANIFEST_VERSION})",
                m.version
            ),
        });
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry() -> impl Strategy<Value = ManifestEntry> {
        prop_oneof![
            (
                "[0-9a-f]{64}",
                0u64..1000,
                prop_oneof![Just(0o644u32), Just(0o755)]
            )
                .prop_map(|(blake3, size, mode)| ManifestEntry::File {
                    blake3,
                    size,
                    mode
                }),
            "[a-z]{1,3}".prop_map(|target| ManifestEntry::Symlink { target }),
        ]
    }

    fn manifest() -> impl Strategy<Value = Manifest> {
        (
            prop::collection::btree_map("[a-c]{1,2}(/[a-c]{1,2})?", entry(), 0..12),
            prop::option::of("[0-9a-f]{40}"),
        )
            .prop_map(|(entries, base_commit)| Manifest {
                version: MANIFEST_VERSION,
                base_commit,
                entries,
            })
    }

    proptest! {
        /// Applying the diff from `a` to `b` onto `a` gives `b`, and the diff of a manifest
        /// with itself is empty.
        #[test]
        fn diff_then_apply_round_trips(a in manifest(), b in manifest()) {
            let d = diff(&a, &b);
            prop_assert_eq!(apply(&a, &d, b.base_commit.clone()), b.clone());
            prop_assert!(diff(&b, &b).is_empty());
            prop_assert_eq!(from_json(&to_json(&b).unwrap()).unwrap(), b);
        }
    }

    #[test]
    fn entries_hash_bytes_and_keep_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "hello").unwrap();
        std::os::unix::fs::symlink("a.txt", dir.path().join("l")).unwrap();
        let ManifestEntry::File { blake3, size, .. } = entry_of(dir.path(), "a.txt").unwrap()
        else {
            panic!("not a file");
        };
        assert_eq!(blake3, blake3::hash(b"hello").to_hex().to_string());
        assert_eq!(size, 5);
        assert_eq!(
            entry_of(dir.path(), "l").unwrap(),
            ManifestEntry::Symlink {
                target: "a.txt".into()
            }
        );
    }
}
