//! The content-addressed blob store under the gateway's state dir: `<dir>/<blake3-hex>`, each
//! blob written through a temporary file and renamed, so a blob is either whole or absent.
//!
//! Deliberately absent: metadata and retention (artifact rows in `skiff-store` decide what is
//! kept; a blob is removed only when no row names it).

use crate::{Error, Result, io_err};
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
pub struct Cas {
    dir: PathBuf,
}

fn check_hash(hash: &str) -> Result<()> {
    if hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(Error::Invalid {
            what: format!("blob name {hash:?}"),
            detail: "not a blake3 hash (64 lowercase hex digits)".into(),
        })
    }
}

impl Cas {
    /// Opens (creating, mode 0700) the store at `dir`.
    pub fn open(dir: &Path) -> Result<Cas> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir))?;
        Ok(Cas {
            dir: dir.to_path_buf(),
        })
    }

    pub fn path(&self, hash: &str) -> Result<PathBuf> {
        check_hash(hash)?;
        Ok(self.dir.join(hash))
    }

    pub fn contains(&self, hash: &str) -> bool {
        self.path(hash).is_ok_and(|p| p.is_file())
    }

    fn tmp(&self) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        self.dir
            .join(format!(".tmp-{}-{nanos}", std::process::id()))
    }

    fn commit(&self, tmp: &Path, hash: &str) -> Result<PathBuf> {
        let path = self.path(hash)?;
        if path.is_file() {
            let _ = std::fs::remove_file(tmp);
        } else {
            std::fs::rename(tmp, &path).map_err(io_err(&path))?;
        }
        Ok(path)
    }

    /// Stores `bytes`; returns their hash.
    pub fn put_bytes(&self, bytes: &[u8]) -> Result<String> {
        let hash = blake3::hash(bytes).to_hex().to_string();
        if self.contains(&hash) {
            return Ok(hash);
        }
        let tmp = self.tmp();
        let mut file = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(bytes).map_err(io_err(&tmp))?;
        file.sync_all().map_err(io_err(&tmp))?;
        self.commit(&tmp, &hash)?;
        Ok(hash)
    }

    /// Stores a copy of the file at `src`; returns its hash and size.
    pub fn put_file(&self, src: &Path) -> Result<(String, u64)> {
        let tmp = self.tmp();
        let copied = (|| -> std::io::Result<(String, u64)> {
            let mut input = std::fs::File::open(src)?;
            let mut out = std::fs::File::create(&tmp)?;
            let mut hasher = blake3::Hasher::new();
            let mut buf = vec![0u8; 256 * 1024];
            let mut size = 0u64;
            loop {
                let n = std::io::Read::read(&mut input, &mut buf)?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n])?;
                size += n as u64;
            }
            out.sync_all()?;
            Ok((hasher.finalize().to_hex().to_string(), size))
        })();
        let (hash, size) = match copied {
            Ok(v) => v,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(io_err(src)(e));
            }
        };
        self.commit(&tmp, &hash)?;
        Ok((hash, size))
    }

    pub fn get(&self, hash: &str) -> Result<Vec<u8>> {
        let path = self.path(hash)?;
        std::fs::read(&path).map_err(io_err(&path))
    }

    /// Removes a blob (absent is fine). Call it only when no artifact row names the hash.
    pub fn remove(&self, hash: &str) -> Result<()> {
        let path = self.path(hash)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&path)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_are_named_by_their_hash() {
        let dir = tempfile::tempdir().unwrap();
        let cas = Cas::open(&dir.path().join("artifacts")).unwrap();
        let h = cas.put_bytes(b"abc").unwrap();
        assert_eq!(h, blake3::hash(b"abc").to_hex().to_string());
        assert_eq!(cas.get(&h).unwrap(), b"abc");
        std::fs::write(dir.path().join("f"), b"abc").unwrap();
        assert_eq!(cas.put_file(&dir.path().join("f")).unwrap(), (h.clone(), 3));
        assert!(cas.get("../../etc/passwd").is_err());
        cas.remove(&h).unwrap();
        assert!(!cas.contains(&h));
    }
}
