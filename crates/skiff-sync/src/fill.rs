//! Filling a new managed worktree by copying the user's working tree instead of checking the
//! snapshot out of the object store: a copy moves bytes the kernel already has, where a
//! checkout inflates every blob (several times slower on a big repository).
//!
//! Only files the snapshot and the base commit agree on are copied, and only when the user's
//! file provably did not change since before the snapshot was taken: its ctime and mtime lie
//! a settle window before the snapshot began (as in [`crate::statcache`]), and its stat data
//! is the same after the copy as before. The user's tree is read without following a symlink
//! below its root (as git reads it): a directory swapped for a symlink after the snapshot
//! never makes the gateway read where it points. The worktree's index is written here for the base
//! commit, with the copies' own stat data (so git hashes nothing to trust them); the
//! user's changes are then written by git itself (`read-tree -m -u HEAD <snapshot>`), and any
//! file that could not be copied by `checkout-index` from the snapshot. The result is what a
//! checkout of the snapshot followed by `git reset` leaves.
//!
//! Not used (the caller checks the snapshot out instead) when a checkout could write other
//! bytes than the user's files hold (attributes, line-ending, filter or symlink settings), for
//! submodules, sparse checkouts, repositories not on SHA-1, and names git prints lossily.

use crate::git::{git, split_z};
use crate::{Error, Result};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};
use sha1::Digest as _;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// What to fill.
#[derive(Clone, Copy, Debug)]
pub struct CopyFill<'a> {
    /// The user's working tree the snapshot was taken of.
    pub source: &'a Path,
    /// The new worktree: nothing checked out, HEAD at the base commit.
    pub worktree: &'a Path,
    /// The snapshot's tree.
    pub tree: &'a str,
    /// When the snapshot began.
    pub since: SystemTime,
}

/// How a copy fill went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filled {
    /// Files copied from the user's working tree.
    pub copied: usize,
    /// Files git wrote (the user's changes, and what could not be copied).
    pub written: usize,
}

/// Files changed within this window before the snapshot began are not copied.
const SETTLE: Duration = Duration::from_secs(1);
/// [`SETTLE`] on a file system with whole-second timestamps.
const SETTLE_COARSE: Duration = Duration::from_secs(3);
/// Threads copying files: the writes wait on the file system more than on the CPU.
const COPIERS: usize = 4;

/// One entry of a tree listing.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TreeEntry {
    mode: u32,
    oid: [u8; 20],
}

/// Fills `f.worktree` with the snapshot; `None` (nothing written) when a copy cannot be
/// exact here, and the caller checks the snapshot out instead. An error may leave files
/// behind: the caller's checkout overwrites them.
pub async fn fill_by_copy(f: &CopyFill<'_>, cancel: &CancellationToken) -> Result<Option<Filled>> {
    let format = git(f.worktree)
        .args(["rev-parse", "--show-object-format"])
        .run(cancel)
        .await?;
    if !format.status.success() || format.stdout.into_string().trim() != "sha1" {
        return Ok(None);
    }
    if may_convert(f.worktree, cancel).await? {
        return Ok(None);
    }
    let (Some(head), Some(snapshot)) = (
        tree_listing(f.worktree, "HEAD", cancel).await?,
        tree_listing(f.worktree, f.tree, cancel).await?,
    ) else {
        return Ok(None);
    };
    let attributes = |p: &String| p == ".gitattributes" || p.ends_with("/.gitattributes");
    if head.keys().chain(snapshot.keys()).any(attributes) {
        return Ok(None);
    }
    // What the base commit and the snapshot agree on is copied; the rest is git's to write.
    let same: Vec<(String, u32)> = snapshot
        .iter()
        .filter(|(path, entry)| head.get(*path) == Some(entry))
        .map(|(path, entry)| (path.clone(), entry.mode))
        .collect();
    let (source, worktree, since) = (f.source.to_path_buf(), f.worktree.to_path_buf(), f.since);
    let copies = tokio::task::spawn_blocking(move || copy_all(&source, &worktree, &same, since))
        .await
        .map_err(|e| Error::Invalid {
            what: "copying the workspace".into(),
            detail: e.to_string(),
        })?;
    let index = git(f.worktree)
        .args(["rev-parse", "--git-path", "index"])
        .run_checked(cancel)
        .await?;
    // Relative to the worktree unless absolute.
    let index = f.worktree.join(index.trim());
    write_index(&index, &head, &copies.stats)?;
    git(f.worktree)
        .args([
            "-c",
            "checkout.workers=8",
            "read-tree",
            "-m",
            "-u",
            "HEAD",
            f.tree,
        ])
        .run_checked(cancel)
        .await?;
    if !copies.missed.is_empty() {
        let mut paths = Vec::new();
        for path in &copies.missed {
            paths.extend_from_slice(path.as_bytes());
            paths.push(0);
        }
        git(f.worktree)
            .args(["checkout-index", "-f", "-z", "--stdin"])
            .stdin(paths)
            .run_checked(cancel)
            .await?;
    }
    git(f.worktree)
        .args(["reset", "--quiet"])
        .run_checked(cancel)
        .await?;
    let copied = copies.stats.len();
    Ok(Some(Filled {
        copied,
        written: snapshot.len() - copied,
    }))
}

/// Whether a checkout in `worktree` could write other bytes than a working tree holds, or
/// leave files out: attributes anywhere git reads them, `core.autocrlf`/`eol`/`symlinks`,
/// filters, or a sparse checkout. Every configuration scope counts, the system's included.
async fn may_convert(worktree: &Path, cancel: &CancellationToken) -> Result<bool> {
    let info = git(worktree)
        .args(["rev-parse", "--git-path", "info/attributes"])
        .run_checked(cancel)
        .await?;
    if crate::outbound::converts_at(&worktree.join(info.trim())) {
        return Ok(true);
    }
    if let Some(home) = std::env::var_os("HOME")
        && crate::outbound::converts_at(&Path::new(&home).join(".config/git/attributes"))
    {
        return Ok(true);
    }
    let settings = git(worktree)
        .env("GIT_CONFIG_NOSYSTEM", "0")
        .args([
            "config",
            "--get-regexp",
            r"^core\.(autocrlf|eol|attributesfile|symlinks|sparsecheckout)$|^filter\.",
        ])
        .run(cancel)
        .await?;
    Ok(settings
        .stdout
        .into_string()
        .lines()
        .any(|line| !matches!(line.trim(), "core.autocrlf false" | "core.symlinks true")))
}

/// Path → entry of every blob of `tree`; `None` when it has a submodule or a name git could
/// not print exactly.
async fn tree_listing(
    worktree: &Path,
    tree: &str,
    cancel: &CancellationToken,
) -> Result<Option<BTreeMap<String, TreeEntry>>> {
    let out = git(worktree)
        .args(["ls-tree", "-r", "-z", "--full-tree", tree])
        .run_checked(cancel)
        .await?;
    let mut entries = BTreeMap::new();
    for line in split_z(&out) {
        let Some((meta, path)) = line.split_once('\t') else {
            return Ok(None);
        };
        let mut fields = meta.split(' ');
        let (mode, kind, oid) = (fields.next(), fields.next(), fields.next());
        let mode = mode.and_then(|m| u32::from_str_radix(m, 8).ok());
        let oid = oid.and_then(parse_oid);
        match (mode, kind, oid) {
            (Some(mode @ (0o100644 | 0o100755 | 0o120000)), Some("blob"), Some(oid))
                if !path.contains('\u{FFFD}') =>
            {
                entries.insert(path.to_owned(), TreeEntry { mode, oid });
            }
            _ => return Ok(None),
        }
    }
    Ok(Some(entries))
}

fn parse_oid(hex: &str) -> Option<[u8; 20]> {
    if hex.len() != 40 {
        return None;
    }
    let mut oid = [0u8; 20];
    for (i, byte) in oid.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(oid)
}

/// What the copy threads did.
#[derive(Default)]
struct Copies {
    /// The copies' stat data, by path.
    stats: BTreeMap<String, std::fs::Metadata>,
    /// Paths that could not be copied exactly (git writes them).
    missed: Vec<String>,
}

fn copy_all(source: &Path, worktree: &Path, files: &[(String, u32)], since: SystemTime) -> Copies {
    let since = since
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0);
    // Every directory first (one thread), so the copy threads never race to make one.
    let mut dirs = HashSet::new();
    let mut unmade = HashSet::new();
    for (path, _) in files {
        if let Some((dir, _)) = path.rsplit_once('/')
            && dirs.insert(dir)
            && std::fs::create_dir_all(worktree.join(dir)).is_err()
        {
            unmade.insert(dir);
        }
    }
    let chunk = files.len().div_ceil(COPIERS).max(1);
    let parts: Vec<Copies> = std::thread::scope(|scope| {
        let handles: Vec<_> = files
            .chunks(chunk)
            .map(|part| {
                let unmade = &unmade;
                scope.spawn(move || {
                    let mut out = Copies::default();
                    let mut from = Source::open(source);
                    for (path, mode) in part {
                        let dir_made = path
                            .rsplit_once('/')
                            .is_none_or(|(dir, _)| !unmade.contains(dir));
                        let copied = match from.as_mut() {
                            Some(from) if dir_made => copy_one(from, worktree, path, *mode, since),
                            _ => None,
                        };
                        match copied {
                            Some(meta) => {
                                out.stats.insert(path.clone(), meta);
                            }
                            None => out.missed.push(path.clone()),
                        }
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut all = Copies::default();
    for part in parts {
        all.stats.extend(part.stats);
        all.missed.extend(part.missed);
    }
    all
}

/// The user's working tree, read without following a symlink anywhere below its root: a
/// directory swapped for a symlink since the snapshot makes its files not copied (git writes
/// them), never read from wherever it points.
struct Source {
    root: OwnedFd,
    dirs: HashMap<String, OwnedFd>,
}

impl Source {
    fn open(root: &Path) -> Option<Source> {
        let root = rustix::fs::open(
            root,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()?;
        Some(Source {
            root,
            dirs: HashMap::new(),
        })
    }

    /// The directory `dir` (relative, `/`-separated; empty: the root), each component opened
    /// as a real directory.
    fn dir(&mut self, dir: &str) -> Option<BorrowedFd<'_>> {
        if dir.is_empty() {
            return Some(self.root.as_fd());
        }
        if !self.dirs.contains_key(dir) {
            let (parent, name) = dir.rsplit_once('/').unwrap_or(("", dir));
            let fd = rustix::fs::openat(
                self.dir(parent)?,
                name,
                OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .ok()?;
            self.dirs.insert(dir.to_owned(), fd);
        }
        self.dirs.get(dir).map(AsFd::as_fd)
    }
}

/// Copies one file (or symlink) of mode `mode` when the user's copy is provably the one the
/// snapshot holds; returns the copy's stat data. `None`: nothing usable was left behind.
fn copy_one(
    from: &mut Source,
    worktree: &Path,
    path: &str,
    mode: u32,
    since: i128,
) -> Option<std::fs::Metadata> {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    let dir = from.dir(dir)?;
    let to = worktree.join(path);
    let before = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).ok()?;
    let kind = FileType::from_raw_mode(before.st_mode);
    let symlink = mode == 0o120000;
    let expected = if symlink {
        FileType::Symlink
    } else {
        FileType::RegularFile
    };
    if kind != expected || !settled(&before, since) {
        return None;
    }
    let copied = if symlink {
        rustix::fs::readlinkat(dir, name, Vec::new())
            .ok()
            .and_then(|target| {
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(target.as_bytes()), &to).ok()
            })
            .and_then(|()| rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).ok())
    } else {
        rustix::fs::openat(
            dir,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()
        .and_then(|fd| {
            let mut input = std::fs::File::from(fd);
            copy_bytes(&mut input, &to, mode).ok()?;
            // The file read is the one looked at before, unchanged.
            rustix::fs::fstat(&input).ok()
        })
    };
    let unchanged = copied.is_some_and(|after| same_stat(&before, &after));
    let made = std::fs::symlink_metadata(&to).ok();
    match (unchanged, made) {
        (true, Some(made)) => Some(made),
        (_, made) => {
            if made.is_some() {
                let _ = std::fs::remove_file(&to);
            }
            None
        }
    }
}

/// Copies a file's bytes into a new file with the permissions a checkout gives `mode`.
fn copy_bytes(input: &mut std::fs::File, to: &Path, mode: u32) -> std::io::Result<()> {
    let perm = if mode == 0o100755 { 0o777 } else { 0o666 };
    let mut output = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(perm)
        .open(to)?;
    std::io::copy(input, &mut output)?;
    Ok(())
}

/// Whether `st`'s ctime and mtime lie the settle window before `since` (nanoseconds).
fn settled(st: &Stat, since: i128) -> bool {
    let coarse = st.st_mtime_nsec == 0 && st.st_ctime_nsec == 0;
    let window = if coarse { SETTLE_COARSE } else { SETTLE };
    let limit = since - window.as_nanos() as i128;
    let at = |s: i128, ns: i128| s * 1_000_000_000 + ns;
    at(i128::from(st.st_mtime), i128::from(st.st_mtime_nsec)) < limit
        && at(i128::from(st.st_ctime), i128::from(st.st_ctime_nsec)) < limit
}

fn same_stat(a: &Stat, b: &Stat) -> bool {
    let key = |s: &Stat| {
        (
            s.st_dev,
            s.st_ino,
            s.st_size,
            s.st_mode,
            s.st_mtime,
            s.st_mtime_nsec,
            s.st_ctime,
            s.st_ctime_nsec,
        )
    };
    key(a) == key(b)
}

/// Writes a version 2 index of `entries` at `path` (through `index.lock`, as git does), with
/// the stat data in `stats` where there is some: a path without any counts as changed, and git
/// hashes its file when it looks.
fn write_index(
    path: &Path,
    entries: &BTreeMap<String, TreeEntry>,
    stats: &BTreeMap<String, std::fs::Metadata>,
) -> Result<()> {
    // Git's order: the paths' bytes, a shorter prefix first (a BTreeMap of `String` is that).
    let mut out = Vec::with_capacity(entries.len() * 96);
    out.extend_from_slice(b"DIRC");
    out.extend_from_slice(&2u32.to_be_bytes());
    let count = u32::try_from(entries.len()).map_err(|_| Error::Invalid {
        what: "the worktree's index".into(),
        detail: "too many entries".into(),
    })?;
    out.extend_from_slice(&count.to_be_bytes());
    for (name, entry) in entries {
        let start = out.len();
        let stat = stats.get(name);
        // Git keeps the low 32 bits of each field.
        let field = |v: i64| (v as u64 as u32).to_be_bytes();
        let fields: [i64; 10] = match stat {
            Some(m) => [
                m.ctime(),
                m.ctime_nsec(),
                m.mtime(),
                m.mtime_nsec(),
                m.dev() as i64,
                m.ino() as i64,
                i64::from(entry.mode),
                i64::from(m.uid()),
                i64::from(m.gid()),
                m.size() as i64,
            ],
            None => [0, 0, 0, 0, 0, 0, i64::from(entry.mode), 0, 0, 0],
        };
        for v in fields {
            out.extend_from_slice(&field(v));
        }
        out.extend_from_slice(&entry.oid);
        let flags = name.len().min(0xFFF) as u16;
        out.extend_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        // NUL-padded to a multiple of eight, at least one NUL.
        let len = out.len() - start;
        let pad = 8 - len % 8;
        out.extend(std::iter::repeat_n(0u8, pad));
    }
    let digest = sha1::Sha1::digest(&out);
    out.extend_from_slice(&digest);
    let lock = PathBuf::from(format!("{}.lock", path.display()));
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |source| Error::Io { path: p, source }
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&lock)
        .map_err(io(&lock))?;
    // Not synced, as git's own index writes are not (`core.fsync`'s default).
    let written = file.write_all(&out);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&lock);
        return Err(io(&lock)(e));
    }
    std::fs::rename(&lock, path).map_err(io(path))
}
