//! The gateway's state directory: database, managed worktrees, workspace copies, and
//! `gateway.json` (how the local CLI finds the gateway). The directory is mode 0700 and the
//! file 0600: nothing of the gateway is readable by other users, a root gateway's box users
//! included.
//!
//! An existing directory is used only when it is already ours alone: one that another user
//! owns or may write (a shared `/tmp`, mode 1777) is refused rather than chmod'ed, because
//! whoever could write there may already have planted a `skiff.toml`, a database or a symlink.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    #[error("state dir {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "refusing the state dir {path}: {why}. It holds the database, the admin token and keys, so it must be private to this user; choose another directory with --state-dir (one that does not exist yet is created with mode 0700)"
    )]
    NotPrivate { path: String, why: String },
    #[error(
        "[store] workspaces = \"{path}\": {why}; give a directory the gateway's user can create or write (one that does not exist yet is created with mode 0700), or remove the key to keep workspaces in the state dir"
    )]
    Workspaces { path: String, why: String },
}

/// The host's paths the sandbox of gateway-placed sessions shows every command (read-only):
/// workspaces there would be readable by every session.
const SANDBOX_VISIBLE: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc",
    "/dev", "/sys",
];

fn err(path: &Path) -> impl FnOnce(std::io::Error) -> StateDirError + '_ {
    move |source| StateDirError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Why the state dir could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another gateway (pid {pid}) is using the state dir {dir}; stop it first, or start this one with another --state-dir"
    )]
    InUse { dir: String, pid: String },
    #[error("cannot lock the state dir ({path}): {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Holds the state dir for one gateway process; dropping it releases the lock.
#[derive(Debug)]
pub struct StateDirLock {
    _file: fs::File,
}

/// Refuses an existing directory that is not this user's alone.
fn check_private(root: &Path) -> Result<(), StateDirError> {
    let meta = fs::metadata(root).map_err(err(root))?;
    let refuse = |why: String| StateDirError::NotPrivate {
        path: root.display().to_string(),
        why,
    };
    if !meta.is_dir() {
        return Err(refuse("it is not a directory".into()));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refuse(format!(
            "it is owned by uid {}, not by this user (uid {me})",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        let who = if mode & 0o002 != 0 {
            "every user"
        } else {
            "its group"
        };
        return Err(refuse(format!(
            "its mode {mode:04o} lets {who} write in it"
        )));
    }
    Ok(())
}

#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
    /// `[store] workspaces`: worktrees, workspace copies, clones and checkpoint blobs (the
    /// state dir itself unless configured).
    workspaces: PathBuf,
}

/// Checks `[store] workspaces` and makes its subdirectories: an absolute path outside the
/// system paths a sandbox shows, created (0700) when missing, a directory, not writable by
/// every user, and writable by this one (a file is made and removed to prove it).
fn open_workspaces(path: &Path) -> Result<PathBuf, StateDirError> {
    let refuse = |why: String| StateDirError::Workspaces {
        path: path.display().to_string(),
        why,
    };
    if !path.is_absolute() {
        return Err(refuse("it is not an absolute path".into()));
    }
    if path
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(refuse("it has a `..` segment".into()));
    }
    if let Some(sys) = SANDBOX_VISIBLE.iter().find(|s| path.starts_with(s)) {
        return Err(refuse(format!(
            "it lies under {sys}, which every sandboxed session command can read"
        )));
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|e| refuse(format!("cannot create it ({e})")))?;
    let real = path
        .canonicalize()
        .map_err(|e| refuse(format!("cannot resolve it ({e})")))?;
    let meta = fs::metadata(&real).map_err(|e| refuse(format!("cannot read it ({e})")))?;
    if !meta.is_dir() {
        return Err(refuse("it is not a directory".into()));
    }
    if meta.mode() & 0o002 != 0 {
        return Err(refuse(format!(
            "its mode {:04o} lets every user write in it",
            meta.mode() & 0o7777
        )));
    }
    let probe = real.join(format!(".skiff-write-probe-{}", std::process::id()));
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&probe)
        .map_err(|e| refuse(format!("this user cannot write in it ({e})")))?;
    let _ = fs::remove_file(&probe);
    for sub in ["worktrees", "workspaces", "mirrors"] {
        let dir = real.join(sub);
        fs::create_dir_all(&dir)
            .map_err(|e| refuse(format!("cannot create {sub}/ in it ({e})")))?;
    }
    Ok(real)
}

impl StateDir {
    /// Creates the directory (and its subdirectories) if needed and makes it private. An
    /// existing directory must already be this user's and writable by no one else.
    pub fn open(root: &Path) -> Result<Self, StateDirError> {
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(err(parent))?;
        }
        match fs::DirBuilder::new().mode(0o700).create(root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => check_private(root)?,
            Err(e) => return Err(err(root)(e)),
        }
        // A private directory that others may read or enter (0755) is tightened, as before.
        fs::set_permissions(root, fs::Permissions::from_mode(0o700)).map_err(err(root))?;
        let root = root.canonicalize().map_err(err(root))?;
        for sub in ["worktrees", "workspaces", "mirrors", "tmp"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(err(&dir))?;
        }
        Ok(Self {
            workspaces: root.clone(),
            root,
        })
    }

    /// Keeps sessions' workspaces, clones and checkpoint blobs in `path` (`[store]
    /// workspaces`) instead of the state dir, once it is checked.
    pub fn set_workspaces(&mut self, path: &Path) -> Result<(), StateDirError> {
        self.workspaces = open_workspaces(path)?;
        Ok(())
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where sessions' workspaces live: `[store] workspaces`, else the state dir.
    pub fn workspaces_root(&self) -> &Path {
        &self.workspaces
    }

    /// One bare clone per remote repository URL, shared by the sessions made from it.
    pub fn mirror(&self, key: &str) -> PathBuf {
        self.workspaces.join("mirrors").join(key)
    }

    /// The content-addressed store of checkpoints, manifests and logs.
    pub fn artifacts(&self) -> PathBuf {
        self.workspaces.join("artifacts")
    }

    /// Takes the state dir for this process: an exclusive lock on `gateway.lock`, held until
    /// the returned guard is dropped (or the process dies — the kernel releases it, so a
    /// crashed gateway never blocks the next one). It must be taken before anything in the
    /// directory is read or repaired: restart reconciliation on a live gateway's state would
    /// orphan its running turns.
    pub fn lock(&self) -> Result<StateDirLock, LockError> {
        let path = self.root.join("gateway.lock");
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|source| LockError::Io {
                path: path.display().to_string(),
                source,
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = std::io::Read::read_to_string(&mut file, &mut holder);
                return Err(LockError::InUse {
                    dir: self.root.display().to_string(),
                    pid: holder.trim().to_owned(),
                });
            }
            Err(fs::TryLockError::Error(source)) => {
                return Err(LockError::Io {
                    path: path.display().to_string(),
                    source,
                });
            }
        }
        // The holder's pid, for the message a second gateway prints.
        let write_pid = |file: &mut fs::File| -> std::io::Result<()> {
            file.set_len(0)?;
            std::io::Seek::seek(file, std::io::SeekFrom::Start(0))?;
            file.write_all(std::process::id().to_string().as_bytes())?;
            file.sync_all()
        };
        write_pid(&mut file).map_err(|source| LockError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(StateDirLock { _file: file })
    }

    pub fn database(&self) -> PathBuf {
        self.root.join("skiff.db")
    }

    pub fn worktree(&self, session: &str) -> PathBuf {
        self.workspaces.join("worktrees").join(session)
    }

    pub fn workspace_copy(&self, session: &str) -> PathBuf {
        self.workspaces.join("workspaces").join(session)
    }

    pub fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }

    pub fn gateway_file(&self) -> PathBuf {
        self.root.join("gateway.json")
    }

    /// Writes `gateway.json` with mode 0600 through a temporary file, so a reader never sees
    /// half of it and the token is never world-readable, not even for a moment.
    pub fn write_gateway_file(&self, json: &str) -> Result<(), StateDirError> {
        let target = self.gateway_file();
        let tmp = self.root.join(".gateway.json.tmp");
        let _ = fs::remove_file(&tmp);
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(err(&tmp))?;
        file.write_all(json.as_bytes()).map_err(err(&tmp))?;
        file.sync_all().map_err(err(&tmp))?;
        fs::rename(&tmp, &target).map_err(err(&target))
    }
}
