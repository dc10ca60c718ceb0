//! The sandbox the commands of `exec` and `process` run in when the workspace is on the
//! gateway's own host ([`super::Tools::with_sandbox`]): the workspace read-write, and for a git
//! worktree what git needs of its repository — and no way to change what the gateway's own git
//! (or the user's, in their checkout) will read as configuration or run as a hook.
//!
//! A managed worktree's `.git` is a file naming its git dir, `<common>/worktrees/<name>`,
//! whose `commondir` names the repository's git dir. Commits need the git dir and the common
//! objects and refs writable. Read-only: the `.git` file, the git dir's `commondir` and
//! `gitdir` (rewritten, they would point git at a config the agent wrote, whose filters and
//! fsmonitor the gateway's git would run outside the sandbox), and the repository's `config`,
//! `hooks`, `info` and `modules` (a hook or submodule the user's own git would run). Other
//! worktrees' git dirs are hidden.

use skiff_process::Sandbox;
use std::path::{Path, PathBuf};

/// The sandbox for commands working in the workspace `root` (canonical).
pub fn for_workspace(root: &Path) -> Sandbox {
    with_workspace(Sandbox::new(), root)
}

/// `sandbox` (what it shows already: directories the operator shares) with the workspace
/// `root` on top, so nothing shared can uncover what the workspace's mounts make read-only.
pub fn with_workspace(sandbox: Sandbox, root: &Path) -> Sandbox {
    let mut sandbox = sandbox.writable(root);
    let Some(git_dir) = worktree_git_dir(root) else {
        return sandbox;
    };
    let Some(common) = common_dir(&git_dir) else {
        // A git dir of its own: only it and the workspace.
        return sandbox
            .read_only(root.join(".git"))
            .writable(&git_dir)
            .read_only(git_dir.join("config"))
            .hidden(git_dir.join("hooks"));
    };
    sandbox = sandbox
        .read_only(root.join(".git"))
        .writable(&common)
        .read_only(common.join("config"))
        .read_only(common.join("config.worktree"))
        .hidden(common.join("hooks"))
        .read_only(common.join("info"))
        .hidden(common.join("modules"));
    if git_dir.starts_with(common.join("worktrees")) {
        sandbox = sandbox.hidden(common.join("worktrees"));
    }
    sandbox
        .writable(&git_dir)
        .read_only(git_dir.join("commondir"))
        .read_only(git_dir.join("gitdir"))
}

/// The git dir a `.git` file at the workspace root names (`gitdir: …`), canonical.
fn worktree_git_dir(root: &Path) -> Option<PathBuf> {
    let dot_git = root.join(".git");
    let meta = dot_git.symlink_metadata().ok()?;
    if !meta.is_file() || meta.len() > 4096 {
        return None;
    }
    let text = std::fs::read_to_string(&dot_git).ok()?;
    let named = text.lines().next()?.strip_prefix("gitdir: ")?.trim();
    root.join(named).canonicalize().ok()
}

/// The repository's git dir a worktree's git dir names in `commondir`, canonical.
fn common_dir(git_dir: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(git_dir.join("commondir")).ok()?;
    git_dir
        .join(text.lines().next()?.trim())
        .canonicalize()
        .ok()
}
