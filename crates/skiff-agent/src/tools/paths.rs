//! Containment of tool paths to the workspace. A path is refused when it is absolute and
//! outside the root, when `..` climbs above the root, or when a symlink on the way resolves
//! outside the root.

use std::path::{Component, Path, PathBuf};

/// A workspace root, canonicalized once.
#[derive(Clone, Debug)]
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    pub fn new(root: PathBuf) -> std::io::Result<Self> {
        Ok(Self {
            root: root.canonicalize()?,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a path the model gave to a path inside the workspace.
    pub fn resolve(&self, user_path: &str) -> Result<PathBuf, String> {
        let given = Path::new(user_path);
        let relative = if given.is_absolute() {
            given
                .strip_prefix(&self.root)
                .map_err(|_| format!("{user_path} is outside the workspace; use a path relative to the workspace root"))?
        } else {
            given
        };
        let mut lexical = PathBuf::new();
        for component in relative.components() {
            match component {
                Component::Normal(part) => lexical.push(part),
                Component::CurDir => {}
                Component::ParentDir => {
                    if !lexical.pop() {
                        return Err(format!("{user_path} escapes the workspace through `..`"));
                    }
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(format!("{user_path} is not a workspace path"));
                }
            }
        }
        let full = self.root.join(&lexical);
        self.check_symlinks(&full, user_path)?;
        Ok(full)
    }

    /// `real` (a canonical path) when it is inside the workspace.
    pub(crate) fn contain(&self, real: &Path, user_path: &str) -> Result<PathBuf, String> {
        if real.starts_with(&self.root) {
            Ok(real.to_path_buf())
        } else {
            Err(format!(
                "{user_path} resolves through a symlink to {}, outside the workspace",
                real.display()
            ))
        }
    }

    /// Refuses a write to the workspace's `.git` (the file of a worktree, or anything in a
    /// git dir there): git reads from it which repository, config and filters apply, and the
    /// gateway's own git runs those outside any sandbox.
    pub(crate) fn check_writable(&self, path: &Path, user_path: &str) -> Result<(), String> {
        let first = path
            .strip_prefix(&self.root)
            .ok()
            .and_then(|rel| rel.components().next());
        if first == Some(Component::Normal(".git".as_ref())) {
            return Err(format!(
                "{user_path} is in the workspace's .git, which the file tools do not write; use git \
                 commands through exec"
            ));
        }
        Ok(())
    }

    /// The path relative to the root, for display.
    pub fn display(&self, path: &Path) -> String {
        let rel = path.strip_prefix(&self.root).unwrap_or(path);
        if rel.as_os_str().is_empty() {
            ".".to_owned()
        } else {
            rel.display().to_string()
        }
    }

    /// Canonicalizes the longest existing prefix: if any symlink on the way points outside the
    /// root, the resolved prefix is outside too. The missing tail cannot contain symlinks.
    fn check_symlinks(&self, full: &Path, user_path: &str) -> Result<(), String> {
        let mut existing = full;
        loop {
            if existing.symlink_metadata().is_ok() {
                break;
            }
            match existing.parent() {
                Some(parent) => existing = parent,
                None => return Ok(()),
            }
        }
        let resolved = existing
            .canonicalize()
            .map_err(|e| format!("{user_path}: {e}"))?;
        if resolved.starts_with(&self.root) {
            Ok(())
        } else {
            Err(format!(
                "{user_path} resolves through a symlink to {}, outside the workspace",
                resolved.display()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws() -> (tempfile::TempDir, Workspace) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("src")).unwrap();
        std::fs::write(dir.path().join("src/a.txt"), "a").unwrap();
        let ws = Workspace::new(dir.path().to_path_buf()).unwrap();
        (dir, ws)
    }

    #[test]
    fn relative_and_inner_dotdot_are_fine() {
        let (_d, ws) = ws();
        assert_eq!(
            ws.resolve("src/a.txt").unwrap(),
            ws.root().join("src/a.txt")
        );
        assert_eq!(
            ws.resolve("src/../src/a.txt").unwrap(),
            ws.root().join("src/a.txt")
        );
        assert_eq!(ws.resolve("new/file").unwrap(), ws.root().join("new/file"));
        let abs = ws.root().join("src/a.txt");
        assert_eq!(ws.resolve(abs.to_str().unwrap()).unwrap(), abs);
    }

    #[test]
    fn escapes_are_refused() {
        let (_d, ws) = ws();
        assert!(ws.resolve("../x").unwrap_err().contains("escapes"));
        assert!(ws.resolve("src/../../x").unwrap_err().contains("escapes"));
        assert!(
            ws.resolve("/etc/passwd")
                .unwrap_err()
                .contains("outside the workspace")
        );
    }

    #[test]
    fn the_git_link_is_not_writable() {
        let (_d, ws) = ws();
        let git = ws.resolve(".git").unwrap();
        assert!(
            ws.check_writable(&git, ".git")
                .unwrap_err()
                .contains(".git")
        );
        let inner = ws.resolve("./.git/config").unwrap();
        assert!(ws.check_writable(&inner, ".git/config").is_err());
        let ok = ws.resolve("src/.git").unwrap();
        assert!(ws.check_writable(&ok, "src/.git").is_ok());
        assert!(
            ws.check_writable(&ws.root().join(".gitignore"), ".gitignore")
                .is_ok()
        );
    }

    #[test]
    fn symlinks_out_are_refused() {
        let (_d, ws) = ws();
        std::os::unix::fs::symlink("/etc", ws.root().join("etc")).unwrap();
        std::os::unix::fs::symlink("src", ws.root().join("inner")).unwrap();
        assert!(ws.resolve("etc/passwd").unwrap_err().contains("symlink"));
        assert!(ws.resolve("etc/new-file").unwrap_err().contains("symlink"));
        assert!(ws.resolve("inner/a.txt").is_ok());
    }
}
