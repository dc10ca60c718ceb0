//! A per-workspace cache of manifest entries keyed by stat data, so a manifest re-hashes only
//! the files whose size, mtime, ctime, inode, device or mode changed since they were hashed.
//!
//! What makes a hit safe: the ctime (which no user call can set) and the inode change with
//! every write or replacement, down to the file system's timestamp tick. A file whose ctime or
//! mtime is within [`SETTLE`] of the scan's start (or in the future) is hashed but not kept: a
//! second write within the same tick would leave its stat data as it was (git's "racily
//! clean" problem, solved the same way). On a file system whose timestamps carry no
//! sub-second part, the window is [`SETTLE_COARSE`].
//!
//! A cache belongs to one workspace: it records the root's path and the root directory's
//! device and inode, and is dropped whole when either differs. The process keeps the caches of
//! its most recently used workspaces ([`shared`]); nothing is written to disk, so a new process
//! starts by hashing everything once.
//!
//! Deliberately absent: symlinks (read every time; a readlink is as cheap as a stat).

use crate::filelist::FileList;
use crate::{Error, ManifestEntry, Result, io_err, join};
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Files changed more recently than this before a scan are hashed but not cached.
pub const SETTLE: Duration = Duration::from_millis(200);
/// [`SETTLE`] on a file system with whole-second timestamps.
pub const SETTLE_COARSE: Duration = Duration::from_secs(3);
/// How many workspaces' caches [`shared`] keeps.
const KEPT: usize = 64;

/// The stat data a cached hash is valid for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    ino: u64,
    dev: u64,
    mode: u32,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
            ino: meta.ino(),
            dev: meta.dev(),
            mode: meta.mode(),
        }
    }

    /// Whether both times are at least the settle window before `start` (nanoseconds since
    /// the epoch).
    fn settled(&self, start: i128, settle: Duration) -> bool {
        let coarse = self.mtime.1 == 0 && self.ctime.1 == 0;
        let window = if coarse {
            settle.max(SETTLE_COARSE)
        } else {
            settle
        };
        let limit = start - window.as_nanos() as i128;
        let at = |(s, ns): (i64, i64)| i128::from(s) * 1_000_000_000 + i128::from(ns);
        at(self.mtime) < limit && at(self.ctime) < limit
    }
}

/// One workspace's cached entries.
#[derive(Debug)]
pub struct StatCache {
    root: PathBuf,
    /// The root directory's (device, inode) when the entries were made.
    root_id: Option<(u64, u64)>,
    settle: Duration,
    entries: HashMap<String, (Stamp, ManifestEntry)>,
    hashed: u64,
}

impl StatCache {
    pub fn new(root: &Path) -> StatCache {
        StatCache::with_settle(root, SETTLE)
    }

    /// A cache with another settle window (tests use a short one).
    pub fn with_settle(root: &Path, settle: Duration) -> StatCache {
        StatCache {
            root: root.to_path_buf(),
            root_id: None,
            settle,
            entries: HashMap::new(),
            hashed: 0,
        }
    }

    /// How many files this cache has hashed (rather than answered from its entries).
    pub fn hashed(&self) -> u64 {
        self.hashed
    }

    /// The manifest entries of the listed files of `root`, hashing only what changed. Every
    /// entry not listed is forgotten. A `root` other than the cache's own, or a root
    /// directory that is not the one the entries were made in, empties the cache first.
    pub fn entries(
        &mut self,
        root: &Path,
        list: &FileList,
    ) -> Result<std::collections::BTreeMap<String, ManifestEntry>> {
        let meta = std::fs::metadata(root).map_err(io_err(root))?;
        let id = Some((meta.dev(), meta.ino()));
        if root != self.root || id != self.root_id {
            self.entries.clear();
            self.root = root.to_path_buf();
            self.root_id = id;
        }
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as i128)
            .unwrap_or(0);
        let mut out = std::collections::BTreeMap::new();
        let mut kept = HashMap::with_capacity(list.files.len());
        for file in &list.files {
            let full = join(root, &file.path);
            let meta = std::fs::symlink_metadata(&full).map_err(io_err(&full))?;
            if meta.file_type().is_symlink() {
                out.insert(
                    file.path.clone(),
                    crate::manifest::entry_of(root, &file.path)?,
                );
                continue;
            }
            let stamp = Stamp::of(&meta);
            let entry = match self.entries.remove(&file.path) {
                Some((cached, entry)) if cached == stamp => entry,
                _ => {
                    self.hashed += 1;
                    self.hash(&full, &meta)?
                }
            };
            if stamp.settled(start, self.settle) {
                kept.insert(file.path.clone(), (stamp, entry.clone()));
            }
            out.insert(file.path.clone(), entry);
        }
        self.entries = kept;
        Ok(out)
    }

    fn hash(&self, full: &Path, meta: &std::fs::Metadata) -> Result<ManifestEntry> {
        use std::os::unix::fs::PermissionsExt;
        if !meta.file_type().is_file() {
            return Err(Error::Special {
                path: full.display().to_string(),
                kind: crate::filelist::special_kind(&meta.file_type()),
            });
        }
        let (blake3, size) = crate::manifest::hash_file(full)?;
        Ok(ManifestEntry::File {
            blake3,
            size,
            mode: meta.permissions().mode() & 0o777,
        })
    }
}

struct Kept {
    cache: Arc<Mutex<StatCache>>,
    used: u64,
}

/// The process's cache for the workspace at `root` (made on first use). The least recently
/// used caches go when more than a few dozen workspaces have one.
pub fn shared(root: &Path) -> Arc<Mutex<StatCache>> {
    static CACHES: OnceLock<Mutex<(u64, HashMap<PathBuf, Kept>)>> = OnceLock::new();
    let mut all = CACHES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    all.0 += 1;
    let now = all.0;
    let caches = &mut all.1;
    if !caches.contains_key(root) && caches.len() >= KEPT {
        let oldest = caches
            .iter()
            .min_by_key(|(_, k)| k.used)
            .map(|(p, _)| p.clone());
        if let Some(oldest) = oldest {
            caches.remove(&oldest);
        }
    }
    let kept = caches.entry(root.to_path_buf()).or_insert_with(|| Kept {
        cache: Arc::new(Mutex::new(StatCache::new(root))),
        used: now,
    });
    kept.used = now;
    kept.cache.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filelist::ListedFile;
    use std::fs::FileTimes;

    fn list(paths: &[&str]) -> FileList {
        FileList {
            files: paths
                .iter()
                .map(|p| ListedFile {
                    path: (*p).to_owned(),
                    size: 0,
                    symlink: false,
                })
                .collect(),
            total_bytes: 0,
            left_out: Default::default(),
        }
    }

    fn blake3_of(entries: &std::collections::BTreeMap<String, ManifestEntry>, p: &str) -> String {
        match &entries[p] {
            ManifestEntry::File { blake3, .. } => blake3.clone(),
            other => panic!("{other:?}"),
        }
    }

    /// Lets the file system's clock pass at least one timestamp tick.
    fn tick() {
        std::thread::sleep(Duration::from_millis(30));
    }

    #[test]
    fn unchanged_files_are_not_hashed_again() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), "alpha").unwrap();
        std::fs::write(dir.path().join("b"), "beta").unwrap();
        let mut cache = StatCache::with_settle(dir.path(), Duration::ZERO);
        tick();
        let first = cache.entries(dir.path(), &list(&["a", "b"])).unwrap();
        assert_eq!(cache.hashed(), 2);
        let again = cache.entries(dir.path(), &list(&["a", "b"])).unwrap();
        assert_eq!(cache.hashed(), 2, "nothing changed, nothing hashed");
        assert_eq!(first, again);
    }

    /// Same size, and the mtime put back to exactly what it was: the ctime still tells.
    #[test]
    fn a_rewrite_with_the_same_size_and_mtime_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a");
        std::fs::write(&path, "alpha").unwrap();
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let mut cache = StatCache::with_settle(dir.path(), Duration::ZERO);
        tick();
        let before = cache.entries(dir.path(), &list(&["a"])).unwrap();
        tick();
        std::fs::write(&path, "omega").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_times(FileTimes::new().set_modified(mtime))
            .unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
        let after = cache.entries(dir.path(), &list(&["a"])).unwrap();
        assert_ne!(blake3_of(&before, "a"), blake3_of(&after, "a"));
        assert_eq!(
            blake3_of(&after, "a"),
            blake3::hash(b"omega").to_hex().to_string()
        );
    }

    /// A file replaced by another (rename over it) with the same size and mtime: the inode
    /// tells.
    #[test]
    fn a_replaced_file_with_the_same_stat_times_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a");
        std::fs::write(&path, "alpha").unwrap();
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let mut cache = StatCache::with_settle(dir.path(), Duration::ZERO);
        tick();
        cache.entries(dir.path(), &list(&["a"])).unwrap();
        let other = dir.path().join("a.new");
        std::fs::write(&other, "omega").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&other)
            .unwrap()
            .set_times(FileTimes::new().set_modified(mtime))
            .unwrap();
        std::fs::rename(&other, &path).unwrap();
        let after = cache.entries(dir.path(), &list(&["a"])).unwrap();
        assert_eq!(
            blake3_of(&after, "a"),
            blake3::hash(b"omega").to_hex().to_string()
        );
    }

    /// A file changed just now is not cached: a second write within the same timestamp tick
    /// could leave its stat data as it is.
    #[test]
    fn files_changed_within_the_settle_window_are_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), "alpha").unwrap();
        let mut cache = StatCache::with_settle(dir.path(), Duration::from_secs(3600));
        cache.entries(dir.path(), &list(&["a"])).unwrap();
        cache.entries(dir.path(), &list(&["a"])).unwrap();
        assert_eq!(cache.hashed(), 2);
    }

    /// A cache made for one workspace answers nothing for another: not for another root, and
    /// not for a new directory at the same path whose files have the same names, sizes and
    /// mtimes.
    #[test]
    fn a_cache_from_another_workspace_is_never_used() {
        let parent = tempfile::tempdir().unwrap();
        let root = parent.path().join("ws");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("a"), "alpha").unwrap();
        let mtime = std::fs::metadata(root.join("a"))
            .unwrap()
            .modified()
            .unwrap();
        let mut cache = StatCache::with_settle(&root, Duration::ZERO);
        tick();
        cache.entries(&root, &list(&["a"])).unwrap();
        assert_eq!(cache.hashed(), 1);

        // Another root with the same relative paths.
        let other = parent.path().join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("a"), "omega").unwrap();
        let got = cache.entries(&other, &list(&["a"])).unwrap();
        assert_eq!(
            blake3_of(&got, "a"),
            blake3::hash(b"omega").to_hex().to_string()
        );

        // The same path, made anew.
        cache.entries(&root, &list(&["a"])).unwrap();
        let hashed = cache.hashed();
        std::fs::remove_dir_all(&root).unwrap();
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("a"), "gamma").unwrap();
        std::fs::File::options()
            .write(true)
            .open(root.join("a"))
            .unwrap()
            .set_times(FileTimes::new().set_modified(mtime))
            .unwrap();
        let got = cache.entries(&root, &list(&["a"])).unwrap();
        assert_eq!(cache.hashed(), hashed + 1);
        assert_eq!(
            blake3_of(&got, "a"),
            blake3::hash(b"gamma").to_hex().to_string()
        );
    }

    #[test]
    fn shared_caches_are_per_root() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        assert!(Arc::ptr_eq(&shared(a.path()), &shared(a.path())));
        assert!(!Arc::ptr_eq(&shared(a.path()), &shared(b.path())));
    }
}
