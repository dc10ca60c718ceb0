//! Temporary git repositories with one commit, made with the system `git`.

use std::path::Path;
use std::process::Command;
use tempfile::TempDir;

/// A repository in a temporary directory, removed on drop.
pub struct TempGitRepo {
    dir: TempDir,
}

impl TempGitRepo {
    /// `git init -b main`, a local identity, `files` as (relative path, contents), one commit.
    pub fn new(files: &[(&str, &str)]) -> TempGitRepo {
        let repo = TempGitRepo {
            dir: tempfile::tempdir().unwrap(),
        };
        repo.git(&["init", "-q", "-b", "main"]);
        repo.git(&["config", "user.name", "Skiff Test"]);
        repo.git(&["config", "user.email", "test@skiff.invalid"]);
        repo.git(&["config", "commit.gpgsign", "false"]);
        for (path, contents) in files {
            let path = repo.path().join(path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            std::fs::write(&path, contents)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        }
        repo.git(&["add", "-A"]);
        repo.git(&["commit", "-q", "--allow-empty", "-m", "initial commit"]);
        repo
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Runs `git <args>` in the repository and returns its stdout; panics with stderr on failure.
    pub fn git(&self, args: &[&str]) -> String {
        let output = Command::new("git")
            .args(args)
            .current_dir(self.path())
            // The developer's own git configuration must not change what tests see.
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .output()
            .unwrap_or_else(|e| panic!("running git {args:?}: {e}"));
        assert!(
            output.status.success(),
            "git {args:?} in {} failed: {}",
            self.path().display(),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makes_a_repository_with_one_commit() {
        let repo = TempGitRepo::new(&[("README.md", "# hi\n"), ("src/lib.rs", "")]);
        assert_eq!(repo.git(&["rev-list", "--count", "HEAD"]).trim(), "1");
        assert_eq!(repo.git(&["branch", "--show-current"]).trim(), "main");
        assert_eq!(
            repo.git(&["ls-files"]).lines().collect::<Vec<_>>(),
            ["README.md", "src/lib.rs"]
        );
    }
}
