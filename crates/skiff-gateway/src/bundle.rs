//! The worker bundle: the running `skiff` executable, identified by its content hash, plus a
//! small manifest. Installing it on a box is idempotent: a box that already has this hash is
//! left alone.

use std::path::{Path, PathBuf};

/// The build hash of an executable: blake3 of its bytes. `skiff --build-hash` prints it for
/// its own executable, which is how the gateway verifies an installed bundle over SSH.
pub fn build_hash(exe: &Path) -> std::io::Result<String> {
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(std::fs::File::open(exe)?)?;
    Ok(hasher.finalize().to_hex().to_string())
}

#[derive(Clone, Debug)]
pub struct Bundle {
    pub exe: PathBuf,
    pub hash: String,
}

impl Bundle {
    pub fn of_current_exe() -> std::io::Result<Self> {
        let exe = std::env::current_exe()?;
        let hash = build_hash(&exe)?;
        Ok(Self { exe, hash })
    }

    /// Where the bundle lives on a box, relative to the box user's home.
    pub fn remote_dir(&self) -> String {
        format!(".skiff/bundles/{}", self.hash)
    }

    pub fn manifest(&self) -> String {
        serde_json::json!({
            "hash": self.hash,
            "version": env!("CARGO_PKG_VERSION"),
            "entry": "skiff",
        })
        .to_string()
    }
}
