//! Containment: what a box may hand back. Paths are relative, `/`-separated, free of `.`,
//! `..`, empty segments and `.git`; symlinks must resolve inside the workspace; nothing sits
//! below a file or symlink; sizes stay within the limits. Writes into the gateway's copy never
//! pass through a symlink.
//!
//! Deliberately absent: any decision about *whether* to sync; these are pure checks.

use crate::filelist::Limits;
use crate::{Error, Manifest, ManifestEntry, Result, io_err};
use std::path::{Path, PathBuf};

pub(crate) fn refuse(path: &str, reason: impl Into<String>) -> Error {
    Error::Unsafe {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Checks a workspace-relative path from a box.
pub fn check_path(path: &str) -> Result<()> {
    if path.is_empty() {
        return Err(refuse("(empty path)", "an empty path names nothing"));
    }
    if path.len() > 4096 {
        return Err(refuse(path, "the path is longer than 4096 bytes"));
    }
    if path.starts_with('/') {
        return Err(refuse(path, "absolute paths are outside the workspace"));
    }
    if path.contains('\0') {
        return Err(refuse(path, "the path contains a NUL byte"));
    }
    for part in path.split('/') {
        match part {
            "" => return Err(refuse(path, "the path has an empty segment")),
            "." | ".." => {
                return Err(refuse(
                    path,
                    "`.` and `..` segments may escape the workspace",
                ));
            }
            ".git" => return Err(refuse(path, "git internals are never synced")),
            _ => {}
        }
    }
    Ok(())
}

/// Checks that the symlink at `path` pointing at `target` resolves inside the workspace.
pub fn check_symlink(path: &str, target: &str) -> Result<()> {
    if target.is_empty() || target.contains('\0') {
        return Err(refuse(path, "the symlink has an empty or malformed target"));
    }
    if target.starts_with('/') {
        return Err(refuse(
            path,
            format!("the symlink points at the absolute path {target}, outside the workspace"),
        ));
    }
    let mut stack: Vec<&str> = path.split('/').collect();
    stack.pop();
    // `..` may only lead the target. After a name it would be resolved by the kernel through
    // that name, which may itself be a symlink of the same manifest (`a/link -> ..`, then
    // `e -> a/link/../../x`): a textual walk cannot see that chain, so it is refused outright.
    let mut seen_name = false;
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." if seen_name => {
                return Err(refuse(
                    path,
                    format!(
                        "the symlink target {target} climbs with `..` after a name; only leading `..` is allowed"
                    ),
                ));
            }
            ".." => {
                if stack.pop().is_none() {
                    return Err(refuse(
                        path,
                        format!("the symlink target {target} resolves outside the workspace"),
                    ));
                }
            }
            ".git" => return Err(refuse(path, "the symlink points into git internals")),
            other => {
                seen_name = true;
                stack.push(other);
            }
        }
    }
    Ok(())
}

/// Checks every entry of a manifest from a box: paths, symlinks, sizes, limits, and that no
/// entry lies below another (a write below a file or symlink would go somewhere else).
///
/// A symlink exactly as `base` has it (the manifest the box was given) is data, not a
/// request: it is never refused, wherever it points — it came from this side, and being
/// unchanged it is never written back. Only a new or changed symlink must stay inside.
pub fn check_manifest(manifest: &Manifest, base: Option<&Manifest>, limits: &Limits) -> Result<()> {
    if manifest.version != skiff_protocol::sync::MANIFEST_VERSION {
        return Err(Error::Invalid {
            what: "the box's manifest".into(),
            detail: format!(
                "version {} (this gateway reads {})",
                manifest.version,
                skiff_protocol::sync::MANIFEST_VERSION
            ),
        });
    }
    let mut total: u64 = 0;
    for (path, entry) in &manifest.entries {
        check_path(path)?;
        match entry {
            ManifestEntry::File { size, blake3, .. } => {
                if *size > limits.max_file_bytes {
                    return Err(Error::FileTooLarge {
                        path: format!("the box's {path}"),
                        size: *size,
                        limit: limits.max_file_bytes,
                        remedy: format!(
                            "delete it on the box, or add `/{path}` to the workspace's .skiffignore so it stays there; nothing was written"
                        ),
                    });
                }
                if blake3.len() != 64 || !blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(refuse(path, "the manifest's blake3 is not 64 hex digits"));
                }
                total = total.saturating_add(*size);
            }
            ManifestEntry::Symlink { target } => {
                let unchanged = base.is_some_and(|b| b.entries.get(path) == Some(entry));
                if !unchanged {
                    check_symlink(path, target)?;
                }
            }
        }
        let mut prefix = path.as_str();
        while let Some((parent, _)) = prefix.rsplit_once('/') {
            if manifest.entries.contains_key(parent) {
                return Err(refuse(
                    path,
                    format!("{parent} is a file or symlink, so nothing can sit below it"),
                ));
            }
            prefix = parent;
        }
    }
    if manifest.entries.len() > limits.max_files {
        return Err(refuse(
            "(manifest)",
            format!(
                "{} entries is over the limit of {}",
                manifest.entries.len(),
                limits.max_files
            ),
        ));
    }
    if total > limits.max_total_bytes {
        return Err(refuse(
            "(manifest)",
            format!(
                "{total} bytes in all is over the limit of {} bytes",
                limits.max_total_bytes
            ),
        ));
    }
    Ok(())
}

/// Whether some directory between `root` and `rel` (exclusive) is a symlink or not a
/// directory. Writing `rel` must never pass through a symlink.
pub fn parent_chain_problem(root: &Path, rel: &str) -> Option<String> {
    let mut dir = PathBuf::from(root);
    let parts: Vec<&str> = rel.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        dir.push(part);
        match std::fs::symlink_metadata(&dir) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Some(format!("{} is a symlink", dir.display()));
            }
            Ok(meta) if !meta.is_dir() => {
                return Some(format!("{} is not a directory", dir.display()));
            }
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

/// Creates the directories above `rel` one by one, refusing to pass through a symlink.
pub fn create_parents(root: &Path, rel: &str) -> Result<()> {
    let mut dir = PathBuf::from(root);
    let parts: Vec<&str> = rel.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        dir.push(part);
        match std::fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() && !meta.file_type().is_symlink() => {}
            Ok(_) => {
                return Err(refuse(
                    rel,
                    format!("{} is not a real directory", dir.display()),
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&dir).map_err(io_err(&dir))?;
            }
            Err(e) => return Err(io_err(&dir)(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        check_path("a/b.txt").unwrap();
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "../x",
            "./a",
            "a//b",
            ".git/config",
            "a/.git",
        ] {
            assert!(check_path(bad).is_err(), "{bad:?} passed");
        }
    }

    #[test]
    fn symlinks() {
        check_symlink("a/link", "../b").unwrap();
        check_symlink("a/b/link", "../../c/d").unwrap();
        // A chain through another link of the manifest cannot be seen textually: refused.
        assert!(check_symlink("e", "a/link/../../etc").is_err());
        check_symlink("link", "x/./y").unwrap();
        for (p, t) in [
            ("link", "../x"),
            ("a/link", "../../x"),
            ("l", "/etc"),
            ("l", "a/../../x"),
            ("l", ".git/hooks"),
        ] {
            assert!(check_symlink(p, t).is_err(), "{p} -> {t} passed");
        }
    }
}
