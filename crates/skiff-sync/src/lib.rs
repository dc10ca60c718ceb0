//! Workspace sync between the gateway's session workspace and a box: which files take part
//! ([`rules`], [`filelist`]), what they are ([`manifest`]), how bytes move over the pinned SSH
//! transfer connection ([`transfer`]), laying a workspace onto a box ([`outbound`]), filling a new managed worktree by copy
//! ([`fill`]), bringing
//! work back ([`inbound_git`], [`inbound_plain`]) under containment checks ([`contain`]), and
//! end-of-turn checkpoints ([`checkpoint`]) with their content-addressed blobs ([`cas`]), putting
//! a workspace back to one ([`rewind`]), and a
//! session's result coming home ([`results`]: its diff, applying or exporting it).
//!
//! The promise: nothing on either side is silently overwritten or lost. Every check (limits,
//! containment, drift, ancestry, bundle refs, transferred bytes against the manifest) runs
//! before the first byte is written; a refusal leaves both sides as they were and says why.
//!
//! Deliberately absent: SQL (artifact rows are `skiff-store`'s), HTTP, policy (when to sync or
//! checkpoint is the gateway's call), and credentials — the box never gets git or forge
//! credentials, and publishing is the gateway's own `git push`.

pub mod cas;
pub mod checkpoint;
pub mod contain;
pub mod filelist;
pub mod fill;
mod git;
pub mod inbound_git;
pub mod inbound_plain;
pub mod manifest;
pub mod outbound;
pub mod quarantine;
pub mod results;
pub mod rewind;
pub mod rules;
pub mod statcache;
pub mod transfer;

pub use filelist::{FileList, Limits, Mode};
pub use rules::Rules;
pub use skiff_protocol::sync::{Manifest, ManifestEntry};
pub use transfer::{Method, Remote};

use std::path::Path;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(".skiffignore line {line} ({pattern:?}) is not a valid pattern: {detail}")]
    Rule {
        line: usize,
        pattern: String,
        detail: String,
    },
    #[error(
        "workspace {root} is too large to sync: {detail}. Largest: {largest}. Exclude them in .skiffignore or raise the sync limit"
    )]
    TooLarge {
        root: String,
        detail: String,
        largest: String,
    },
    /// A file over the per-file limit (the largest, when several are; `remedy` names the rest).
    #[error(
        "{} is {}, over the per-file limit of {}; {}",
        .path,
        filelist::human(*.size),
        filelist::human(*.limit),
        .remedy
    )]
    FileTooLarge {
        path: String,
        size: u64,
        limit: u64,
        /// What to do, and anything else the refusal covers.
        remedy: String,
    },
    #[error(
        "cannot checkpoint {path} ({}): with it, the untracked files a checkpoint keeps outside git (in the gateway's artifact store) would pass the cap of {}; add it to .skiffignore or move it out of the workspace",
        filelist::human(*.size),
        filelist::human(*.cap)
    )]
    OverCheckpointCap { path: String, size: u64, cap: u64 },
    #[error(
        "{path} is private ({why}); a box runs as another user, so files other users cannot read are not sent to one. Exclude it in .skiffignore, or make it readable (chmod o+r) if it may leave this machine; nothing was sent"
    )]
    Private { path: String, why: String },
    #[error(
        "{path} is a {kind}; only regular files and symlinks are synced. Remove it or exclude it in .skiffignore"
    )]
    Special { path: String, kind: &'static str },
    #[error(
        "{path}: the file name is not valid UTF-8, and only UTF-8 names sync; rename it, or exclude its folder in .skiffignore. Nothing was synced"
    )]
    NotUtf8 { path: String },
    #[error("refusing {path}: {reason}; nothing was written")]
    Unsafe { path: String, reason: String },
    #[error(
        "the box's bundle carries {found}, but only refs/heads/skiff/{session} may come back; nothing was adopted"
    )]
    ForeignRef { session: String, found: String },
    #[error(
        "cannot adopt the box's work into {worktree}: {detail}. Both sides were left as they are; reconcile by hand (the box still has its branch)"
    )]
    Diverged { worktree: String, detail: String },
    #[error(
        "{target} changed since the box got its copy ({paths}); nothing was written. Keep exclusive ownership of a placed session's workspace, or discard the local edits"
    )]
    Drift { target: String, paths: String },
    #[error(
        "the bytes transferred for {path} do not match the box's manifest ({detail}); nothing was written"
    )]
    Mismatch { path: String, detail: String },
    #[error("the box directory {dir} already exists and is not empty; refusing to overwrite it")]
    RemoteNotEmpty { dir: String },
    /// `apply` found the target changed where the session changed it too.
    #[error(
        "{target} changed since the session started where the session changed it too: {}; nothing was written. Bring those paths back to what the session started from, apply to another directory (--to DIR), or export the whole result (skiff session export)",
        results::describe(.conflicts)
    )]
    ApplyConflict {
        target: String,
        conflicts: Vec<results::Conflict>,
    },
    /// `apply` failed after its first delete or rename (a directory swapped for a symlink
    /// meanwhile, a full disk): what it did stays, the rest was not done.
    #[error(
        "applying to {target} stopped part-way, after {deleted} deletes and {written} writes: {source}. Fix the cause and run apply again: paths already as the session has them are left alone"
    )]
    PartlyApplied {
        target: String,
        deleted: usize,
        written: usize,
        #[source]
        source: Box<Error>,
    },
    #[error(
        "{path} already exists and is not empty; an export writes only into a new or empty directory"
    )]
    TargetNotEmpty { path: String },
    #[error("{what} is not valid: {detail}")]
    Invalid { what: String, detail: String },
    #[error(transparent)]
    Process(#[from] skiff_process::Error),
    #[error(transparent)]
    Ssh(#[from] skiff_ssh::Error),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Joins a `/`-separated workspace path onto `root`.
pub(crate) fn join(root: &Path, rel: &str) -> std::path::PathBuf {
    let mut p = root.to_path_buf();
    for part in rel.split('/') {
        p.push(part);
    }
    p
}

/// A fresh private directory under `parent` (mode 0700), removed when dropped.
pub struct Scratch(std::path::PathBuf);

impl Scratch {
    pub fn new(parent: &Path, prefix: &str) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        for attempt in 0u32..100 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let dir = parent.join(format!(
                "{prefix}-{}-{nanos:08x}-{attempt}",
                std::process::id()
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(Self(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&dir)(e)),
            }
        }
        Err(Error::Invalid {
            what: parent.display().to_string(),
            detail: "cannot create a scratch directory in it".into(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
