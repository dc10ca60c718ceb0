//! Each session owns its workspace. For a git repository: a managed worktree on branch
//! `skiff/<session-id>`, created from the repository's HEAD with the user's uncommitted and
//! untracked-but-not-ignored changes carried over. For a plain directory: a gateway-owned copy.
//!
//! The user's live checkout is never written: its working tree, index and HEAD stay as they
//! were. (The repository's object store and ref namespace do gain the session branch and the
//! worktree's metadata; that is what `git worktree add` is. Untracked files over
//! [`LARGE_UNTRACKED_BYTES`] are copied, never made objects of the user's repository.)

use crate::state_dir::StateDir;
use skiff_process::Cmd;
use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_sync::checkpoint::LARGE_UNTRACKED_BYTES;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("workspace {0} does not exist or is not a directory")]
    Missing(String),
    #[error(
        "workspace {path} contains the gateway's state dir {state}; choose a workspace outside it or move the state dir (--state-dir)"
    )]
    ContainsStateDir { path: String, state: String },
    #[error(
        "repository {0} has no commits yet; make a first commit, or use a directory that is not a git repository"
    )]
    NoCommits(String),
    #[error("preparing the session workspace from {path} failed: {source}")]
    Prepare {
        path: String,
        #[source]
        source: skiff_process::Error,
    },
    #[error("cannot create {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Git, as the gateway runs it on the user's repository: never prompting, never running the
/// repository's hooks.
fn git(dir: &Path) -> Cmd {
    Cmd::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "core.hooksPath=/dev/null"])
        .env("GIT_TERMINAL_PROMPT", "0")
        .timeout(Duration::from_secs(300))
}

/// The lock serializing `git worktree add` on one repository (per process).
fn repo_lock(repo: &Path) -> std::sync::Arc<tokio::sync::Mutex<()>> {
    static LOCKS: std::sync::OnceLock<
        std::sync::Mutex<
            std::collections::HashMap<PathBuf, std::sync::Arc<tokio::sync::Mutex<()>>>,
        >,
    > = std::sync::OnceLock::new();
    LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(repo.to_path_buf())
        .or_default()
        .clone()
}

/// A file under `<state>/tmp` that goes when it is dropped, on every path out (a failed
/// `git add` included). A killed gateway's are swept at the next start.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Creates the session's own workspace from `source`.
pub async fn prepare(
    source: &Path,
    session: &SessionId,
    state: &StateDir,
) -> Result<WorkspaceView, WorkspaceError> {
    let source = source
        .canonicalize()
        .ok()
        .filter(|p| p.is_dir())
        .ok_or_else(|| WorkspaceError::Missing(source.display().to_string()))?;
    if state.root().starts_with(&source) {
        return Err(WorkspaceError::ContainsStateDir {
            path: source.display().to_string(),
            state: state.root().display().to_string(),
        });
    }
    let cancel = CancellationToken::new();
    let toplevel = git(&source)
        .args(["rev-parse", "--show-toplevel"])
        .run(&cancel)
        .await
        .ok()
        .filter(|f| f.status.success())
        .map(|f| PathBuf::from(f.stdout.into_string().trim()));
    match toplevel {
        Some(repo) => worktree(&repo, session, state, &cancel).await,
        None => copy(&source, session, state, &cancel).await,
    }
}

async fn worktree(
    repo: &Path,
    session: &SessionId,
    state: &StateDir,
    cancel: &CancellationToken,
) -> Result<WorkspaceView, WorkspaceError> {
    let failed = |source| WorkspaceError::Prepare {
        path: repo.display().to_string(),
        source,
    };
    let started = std::time::Instant::now();
    let head = git(repo)
        .args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"])
        .run_checked(cancel)
        .await
        .map_err(|_| WorkspaceError::NoCommits(repo.display().to_string()))?
        .trim()
        .to_owned();

    // Snapshot the user's working state as a tree through a private index, so the user's own
    // index is not touched. `add -A` takes tracked changes, deletions and untracked files that
    // are not ignored — except large untracked files: `add` would write each into the user's
    // object store (again for every session), so they are copied into the worktree instead.
    let large = large_untracked(repo, cancel).await?;
    let index = TempFile(state.tmp().join(format!("{session}.index")));
    let with_index = |cmd: Cmd| cmd.env("GIT_INDEX_FILE", index.0.as_os_str());
    // Seeded from a copy of the user's index, `add -A` re-hashes only the files whose stat
    // data changed since git last looked at them, not the whole tree. The copy is only read
    // from the user's side (git replaces its index by rename, so a copy is never torn).
    if !seed_index(repo, &index.0, cancel).await? {
        with_index(git(repo).args(["read-tree", &head]))
            .run_checked(cancel)
            .await
            .map_err(failed)?;
    }
    let mut pathspecs = b".\0".to_vec();
    for path in &large {
        pathspecs.extend_from_slice(b":(exclude,literal)");
        pathspecs.extend_from_slice(path.as_bytes());
        pathspecs.push(0);
    }
    // A split index would write its shared part into the user's repository, and the user's
    // file-system monitor answers for the user's index: neither here.
    with_index(git(repo).args([
        "-c",
        "core.splitIndex=false",
        "-c",
        "core.fsmonitor=false",
        "add",
        "-A",
        "--pathspec-from-file=-",
        "--pathspec-file-nul",
    ]))
    .stdin(pathspecs)
    .run_checked(cancel)
    .await
    .map_err(failed)?;
    let tree = with_index(git(repo).arg("write-tree"))
        .run_checked(cancel)
        .await
        .map_err(failed)?
        .trim()
        .to_owned();
    drop(index);
    tracing::debug!(%session, ms = started.elapsed().as_millis() as u64, "worktree: snapshot taken");

    let path = state.worktree(session.as_str());
    let branch = format!("skiff/{session}");
    // git's own worktree bookkeeping is not safe against itself: concurrent `worktree add`
    // on one repository can fail ("failed to read …/commondir"). One at a time per repository.
    let lock = repo_lock(repo);
    let added = {
        let _one_at_a_time = lock.lock().await;
        // The checkout writes every file of the tree, and waits on the file system more than
        // on the CPU: more parallel workers than cores (8 writes 10,000 files in a quarter of
        // the time of one worker per core, on two cores).
        git(repo)
            .args(["-c", "checkout.workers=8"])
            .args(["worktree", "add", "--quiet", "-b", &branch])
            .arg(&path)
            .arg(&head)
            .run_checked(cancel)
            .await
    };
    added.map_err(failed)?;
    // Lay the snapshot over the fresh checkout, then unstage: the worktree shows exactly the
    // user's uncommitted changes, as changes.
    git(&path)
        .args(["read-tree", "-m", "-u", &head, &tree])
        .run_checked(cancel)
        .await
        .map_err(failed)?;
    git(&path)
        .args(["reset", "--quiet"])
        .run_checked(cancel)
        .await
        .map_err(failed)?;
    for rel in &large {
        copy_file(&repo.join(rel), &path.join(rel))?;
    }
    tracing::debug!(%session, ms = started.elapsed().as_millis() as u64, "worktree: checked out");
    Ok(WorkspaceView::Git {
        source: repo.display().to_string(),
        path: path.display().to_string(),
        branch,
        base_commit: head,
    })
}

/// A fork's worktree: a new branch `skiff/<session>` of `repo` at `start` (the commit a
/// checkpoint was taken on), checked out under the state dir. The caller lays the
/// checkpoint's files over it. `base_commit` is the original session's: a fork's result is
/// measured against what the original started from.
pub async fn fork_worktree(
    repo: &Path,
    session: &SessionId,
    state: &StateDir,
    start: &str,
    base_commit: &str,
) -> Result<WorkspaceView, WorkspaceError> {
    let cancel = CancellationToken::new();
    let path = state.worktree(session.as_str());
    let branch = format!("skiff/{session}");
    let lock = repo_lock(repo);
    let added = {
        let _one_at_a_time = lock.lock().await;
        git(repo)
            .args(["-c", "checkout.workers=8"])
            .args(["worktree", "add", "--quiet", "-b", &branch])
            .arg(&path)
            .arg(start)
            .run_checked(&cancel)
            .await
    };
    added.map_err(|source| WorkspaceError::Prepare {
        path: repo.display().to_string(),
        source,
    })?;
    Ok(WorkspaceView::Git {
        source: repo.display().to_string(),
        path: path.display().to_string(),
        branch,
        base_commit: base_commit.to_owned(),
    })
}

/// Copies the user's index to `to`; `false` when there is none to copy (a repository whose
/// index was never written, or one git cannot name).
async fn seed_index(
    repo: &Path,
    to: &Path,
    cancel: &CancellationToken,
) -> Result<bool, WorkspaceError> {
    let named = git(repo)
        .args(["rev-parse", "--git-path", "index"])
        .run_checked(cancel)
        .await
        .map_err(|source| WorkspaceError::Prepare {
            path: repo.display().to_string(),
            source,
        })?;
    // Relative to `repo` unless absolute (`--path-format` is younger than the git we support).
    let from = repo.join(named.trim());
    skiff_sync::checkpoint::copy_index_file(&from, to).map_err(|source| WorkspaceError::Io {
        path: from.display().to_string(),
        source,
    })
}

/// Untracked, not ignored regular files of `repo` over [`LARGE_UNTRACKED_BYTES`], as paths
/// relative to it.
async fn large_untracked(
    repo: &Path,
    cancel: &CancellationToken,
) -> Result<Vec<String>, WorkspaceError> {
    let listed = git(repo)
        .args(["ls-files", "-z", "--others", "--exclude-standard"])
        .run_checked(cancel)
        .await
        .map_err(|source| WorkspaceError::Prepare {
            path: repo.display().to_string(),
            source,
        })?;
    Ok(listed
        .split('\0')
        .filter(|p| !p.is_empty())
        .filter(|p| {
            std::fs::symlink_metadata(repo.join(p))
                .is_ok_and(|m| m.is_file() && m.len() > LARGE_UNTRACKED_BYTES)
        })
        .map(str::to_owned)
        .collect())
}

/// Copies one file (bytes and permissions), making its directory.
fn copy_file(from: &Path, to: &Path) -> Result<(), WorkspaceError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| WorkspaceError::Io { path, source }
    };
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::copy(from, to).map_err(io(to))?;
    Ok(())
}

async fn copy(
    source: &Path,
    session: &SessionId,
    state: &StateDir,
    cancel: &CancellationToken,
) -> Result<WorkspaceView, WorkspaceError> {
    let path = state.workspace_copy(session.as_str());
    let failed = |e| WorkspaceError::Prepare {
        path: source.display().to_string(),
        source: e,
    };
    std::fs::create_dir_all(&path).map_err(|source| WorkspaceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Cmd::new("cp")
        .arg("-a")
        .arg(source.join("."))
        .arg(&path)
        .timeout(Duration::from_secs(600))
        .run_checked(cancel)
        .await
        .map_err(failed)?;
    Ok(WorkspaceView::Plain {
        source: source.display().to_string(),
        path: path.display().to_string(),
    })
}

/// Removes a workspace `prepare` made for a session that was then refused (nothing of it is
/// kept: the worktree, its branch, or the plain copy). Best effort, logged: the session never
/// existed for anyone.
pub async fn discard(view: &WorkspaceView) {
    let cancel = CancellationToken::new();
    let result = match view {
        WorkspaceView::Git {
            source,
            path,
            branch,
            ..
        } => {
            let repo = Path::new(source);
            let lock = repo_lock(repo);
            let _one_at_a_time = lock.lock().await;
            let removed = git(repo)
                .args(["worktree", "remove", "--force"])
                .arg(path)
                .run_checked(&cancel)
                .await;
            match removed {
                Ok(_) => git(repo)
                    .args(["branch", "-D", branch])
                    .run_checked(&cancel)
                    .await
                    .map(drop),
                Err(e) => Err(e),
            }
        }
        WorkspaceView::Plain { path, .. } => {
            std::fs::remove_dir_all(path).map_err(|source| skiff_process::Error::Io {
                command: format!("rm -r {path}"),
                source,
            })
        }
    };
    if let Err(e) = result {
        tracing::warn!(workspace = view.path(), error = %e, "could not remove a refused session's workspace");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::process::Command;

    fn git_in(dir: &Path, args: &[&str]) -> String {
        let out = Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// The snapshot starts from a copy of the user's index, so it must still see an edit the
    /// index's stat data cannot tell apart (same size, mtime put back, made right after the
    /// index was written), and the user's index stays as it was.
    #[tokio::test]
    async fn the_snapshot_sees_edits_the_users_index_cannot_tell_apart() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        std::fs::create_dir(&repo).unwrap();
        git_in(&repo, &["init", "-q", "-b", "main"]);
        git_in(&repo, &["config", "user.name", "T"]);
        git_in(&repo, &["config", "user.email", "t@skiff.invalid"]);
        std::fs::write(repo.join("a.txt"), "one\n").unwrap();
        std::fs::write(repo.join("b.txt"), "kept\n").unwrap();
        git_in(&repo, &["add", "-A"]);
        git_in(&repo, &["commit", "-q", "-m", "first"]);
        let mtime = std::fs::metadata(repo.join("a.txt"))
            .unwrap()
            .modified()
            .unwrap();
        std::fs::write(repo.join("a.txt"), "two\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(repo.join("a.txt"))
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(mtime))
            .unwrap();
        std::fs::write(repo.join("new.txt"), "untracked\n").unwrap();
        let index = std::fs::read(repo.join(".git/index")).unwrap();
        // Past the second the index was written in: only its kept mtime makes git re-check.
        std::thread::sleep(Duration::from_millis(1100));

        let state = StateDir::open(&dir.path().join("state")).unwrap();
        let session = SessionId::from_suffix("snapshot0test");
        let view = prepare(&repo, &session, &state).await.unwrap();
        let path = PathBuf::from(view.path());
        assert_eq!(
            std::fs::read_to_string(path.join("a.txt")).unwrap(),
            "two\n"
        );
        assert_eq!(
            std::fs::read_to_string(path.join("new.txt")).unwrap(),
            "untracked\n"
        );
        assert_eq!(
            git_in(&path, &["status", "--porcelain"]),
            " M a.txt\n?? new.txt\n"
        );
        assert_eq!(std::fs::read(repo.join(".git/index")).unwrap(), index);
    }
}
