//! The gateway's state directory: database, managed worktrees, workspace copies, and
//! `gateway.json` (how the local CLI finds the gateway). The directory is mode 0700 and the
//! file 0600: nothing of the gateway is readable by other users (later: by boxes).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("state dir {path}: {source}")]
pub struct StateDirError {
    path: String,
    #[source]
    source: std::io::Error,
}

fn err(path: &Path) -> impl FnOnce(std::io::Error) -> StateDirError + '_ {
    move |source| StateDirError {
        path: path.display().to_string(),
        source,
    }
}

#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// Creates the directory (and its subdirectories) if needed and makes it private.
    pub fn open(root: &Path) -> Result<Self, StateDirError> {
        fs::create_dir_all(root).map_err(err(root))?;
        fs::set_permissions(root, fs::Permissions::from_mode(0o700)).map_err(err(root))?;
        let root = root.canonicalize().map_err(err(root))?;
        for sub in ["worktrees", "workspaces", "tmp"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(err(&dir))?;
        }
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn database(&self) -> PathBuf {
        self.root.join("skiff.db")
    }

    pub fn worktree(&self, session: &str) -> PathBuf {
        self.root.join("worktrees").join(session)
    }

    pub fn workspace_copy(&self, session: &str) -> PathBuf {
        self.root.join("workspaces").join(session)
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
