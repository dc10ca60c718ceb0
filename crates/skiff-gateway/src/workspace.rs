//! Each session owns its workspace. For a git repository: a managed worktree on branch
//! `skiff/<session-id>`, created from the repository's HEAD with the user's uncommitted and
//! untracked-but-not-ignored changes carried over. For a plain directory: a gateway-owned copy.
//!
//! A worktree is usable at once and filled in the background ([`prepare_deferred`], then
//! [`Fill::run`]): the session's rows exist while its files are still being written, and
//! everything that reads or writes the workspace waits for the fill first ([`Fills`]). A fill
//! is recorded in `<state>/filling/` before the session is returned, and removed once it is
//! complete, so a gateway killed mid-fill writes the recorded snapshot out again at its next
//! start: nobody ever sees a half-filled tree.
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
pub(crate) fn repo_lock(repo: &Path) -> std::sync::Arc<tokio::sync::Mutex<()>> {
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

/// Creates the session's own workspace from `source`, its files written before it returns.
pub async fn prepare(
    source: &Path,
    session: &SessionId,
    state: &StateDir,
) -> Result<WorkspaceView, WorkspaceError> {
    let (view, fill) = prepare_deferred(source, session, state).await?;
    if let Some(fill) = fill {
        fill.run().await?;
    }
    Ok(view)
}

/// The session's worktree with its branch, HEAD and the user's large untracked files in
/// place, and what is left to write: the snapshot of the user's working state.
async fn worktree_deferred(
    repo: &Path,
    session: &SessionId,
    state: &StateDir,
    cancel: &CancellationToken,
) -> Result<(WorkspaceView, Fill), WorkspaceError> {
    let failed = |source| WorkspaceError::Prepare {
        path: repo.display().to_string(),
        source,
    };
    let started = std::time::Instant::now();
    // What the user's files were before the snapshot looked at them is what a fill may copy.
    let since = std::time::SystemTime::now();
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
    // Nothing is checked out here: the fill writes the snapshot's files.
    let lock = repo_lock(repo);
    let added = {
        let _one_at_a_time = lock.lock().await;
        git(repo)
            .args(["worktree", "add", "--quiet", "--no-checkout", "-b", &branch])
            .arg(&path)
            .arg(&head)
            .run_checked(cancel)
            .await
    };
    added.map_err(failed)?;
    for rel in &large {
        copy_file(&repo.join(rel), &path.join(rel))?;
    }
    tracing::debug!(%session, ms = started.elapsed().as_millis() as u64, "worktree: added, to be filled");
    let view = WorkspaceView::Git {
        source: repo.display().to_string(),
        path: path.display().to_string(),
        branch,
        base_commit: head.clone(),
        remote: None,
    };
    let fill = Fill {
        session: session.to_string(),
        repo: repo.to_path_buf(),
        branch: format!("skiff/{session}"),
        path,
        base_commit: head,
        tree,
        copy_from: Some(CopySource {
            dir: repo.to_path_buf(),
            since_ms: since
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }),
    };
    Ok((view, fill))
}

/// What is left to write of a worktree [`prepare_deferred`] made: the snapshot `tree` of the
/// user's working state, laid over the session branch's commit (checked out by HEAD), so the
/// worktree shows exactly the user's uncommitted changes, as changes.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Fill {
    pub session: String,
    /// The user's repository, and the session branch in it.
    pub repo: PathBuf,
    pub branch: String,
    /// The worktree.
    pub path: PathBuf,
    pub base_commit: String,
    pub tree: String,
    /// The user's working tree the snapshot was taken of, when the fill may copy its files
    /// instead of checking them out (`None`: a remote repository's clone).
    #[serde(default)]
    pub copy_from: Option<CopySource>,
}

/// Where a fill may copy the snapshot's files from (see [`skiff_sync::fill`]).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CopySource {
    pub dir: PathBuf,
    /// When the snapshot began (ms since the epoch): files changed since are not copied.
    pub since_ms: u64,
}

/// A fill as recorded in `<state>/filling/`: with the session's scope, so a restart finds the
/// session again.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct FillRecord {
    pub owner_id: String,
    pub tenant_id: String,
    pub fill: Fill,
}

impl Fill {
    /// Writes the snapshot's files and leaves the index at HEAD. Safe to repeat over a fill
    /// that was cut short: every file of the snapshot is written again (whatever a killed
    /// fill left in its place is overwritten), and files the snapshot lacks are not touched.
    pub async fn run(&self) -> Result<(), WorkspaceError> {
        self.write(self.copy_from.as_ref()).await
    }

    async fn write(&self, copy_from: Option<&CopySource>) -> Result<(), WorkspaceError> {
        let cancel = CancellationToken::new();
        let started = std::time::Instant::now();
        if let Some(from) = copy_from {
            let copy = skiff_sync::fill::CopyFill {
                source: &from.dir,
                worktree: &self.path,
                tree: &self.tree,
                since: std::time::UNIX_EPOCH + Duration::from_millis(from.since_ms),
            };
            match skiff_sync::fill::fill_by_copy(&copy, &cancel).await {
                Ok(Some(filled)) => {
                    tracing::debug!(session = %self.session, copied = filled.copied, written = filled.written,
                        ms = started.elapsed().as_millis() as u64, "worktree: filled");
                    return Ok(());
                }
                Ok(None) => {}
                // The checkout below writes every file and the index again.
                Err(e) => {
                    tracing::warn!(session = %self.session, error = %e, "worktree: copying the user's files failed; checking the snapshot out instead")
                }
            }
        }
        let failed = |source| WorkspaceError::Prepare {
            path: self.path.display().to_string(),
            source,
        };
        // The checkout writes every file of the tree, and waits on the file system more than
        // on the CPU: more parallel workers than cores (8 writes 10,000 files in a quarter of
        // the time of one worker per core, on two cores). A worker placement's first model
        // request waits for it (the base manifest is made of its files), not for the box's
        // checkout of the base commit, which yields to it on a shared machine instead.
        git(&self.path)
            .args(["-c", "checkout.workers=8", "read-tree", "--reset", "-u"])
            .arg(&self.tree)
            .run_checked(&cancel)
            .await
            .map_err(failed)?;
        git(&self.path)
            .args(["reset", "--quiet"])
            .run_checked(&cancel)
            .await
            .map_err(failed)?;
        tracing::debug!(session = %self.session, ms = started.elapsed().as_millis() as u64, "worktree: filled");
        Ok(())
    }

    /// The workspace the fill writes.
    pub fn view(&self) -> WorkspaceView {
        WorkspaceView::Git {
            source: self.repo.display().to_string(),
            path: self.path.display().to_string(),
            branch: self.branch.clone(),
            base_commit: self.base_commit.clone(),
            remote: None,
        }
    }

    /// [`Fill::run`] after a gateway was killed in the middle of it: the git it ran was
    /// killed too, and may have left the worktree's index lock behind (nothing else works in
    /// a session's worktree while the gateway starts).
    pub async fn rerun(&self) -> Result<(), WorkspaceError> {
        // A killed gateway's git goes on without it (it is no contained command): whatever
        // still works in this worktree is stopped before the fill is written again.
        kill_working_in(&self.path);
        let cancel = CancellationToken::new();
        let dir = git(&self.path)
            .args(["rev-parse", "--absolute-git-dir"])
            .run_checked(&cancel)
            .await
            .map_err(|source| WorkspaceError::Prepare {
                path: self.path.display().to_string(),
                source,
            })?;
        let lock = Path::new(dir.trim()).join("index.lock");
        if let Err(source) = std::fs::remove_file(&lock)
            && source.kind() != std::io::ErrorKind::NotFound
        {
            return Err(WorkspaceError::Io {
                path: lock.display().to_string(),
                source,
            });
        }
        // Whatever the killed fill left is overwritten: a checkout, not a copy (which writes
        // only new files).
        self.write(None).await
    }

    fn record_path(state: &StateDir, session: &str) -> PathBuf {
        state.root().join("filling").join(format!("{session}.json"))
    }

    /// Records the fill (durably) before anyone can see its session.
    pub fn record(
        &self,
        state: &StateDir,
        owner_id: &str,
        tenant_id: &str,
    ) -> Result<(), WorkspaceError> {
        let path = Fill::record_path(state, &self.session);
        let io = |source| WorkspaceError::Io {
            path: path.display().to_string(),
            source,
        };
        let record = FillRecord {
            owner_id: owner_id.to_owned(),
            tenant_id: tenant_id.to_owned(),
            fill: self.clone(),
        };
        let json = serde_json::to_vec(&record).map_err(|e| io(std::io::Error::other(e)))?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let part = path.with_extension("json.part");
        {
            use std::io::Write;
            let mut file = std::fs::File::create(&part).map_err(io)?;
            file.write_all(&json).map_err(io)?;
            file.sync_all().map_err(io)?;
        }
        std::fs::rename(&part, &path).map_err(io)?;
        Ok(())
    }

    /// The fill of `session` is complete (or its session is gone): forget the record.
    pub fn forget(state: &StateDir, session: &str) {
        let path = Fill::record_path(state, session);
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a fill record");
        }
    }

    /// The fills a previous gateway recorded and did not complete.
    pub fn unfinished(state: &StateDir) -> Vec<FillRecord> {
        let Ok(dir) = std::fs::read_dir(state.root().join("filling")) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                // A record cut short before its rename: its session was never returned.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            match std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<FillRecord>(&b).ok())
            {
                Some(record) => out.push(record),
                None => {
                    tracing::warn!(path = %path.display(), "an unreadable fill record is left alone")
                }
            }
        }
        out
    }
}

/// Kills the processes whose working directory is `dir` (a killed gateway's git, and its
/// checkout workers, in a worktree under the private state dir).
fn kill_working_in(dir: &Path) {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw)
        else {
            continue;
        };
        if std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd == dir) {
            tracing::warn!(pid = pid.as_raw_nonzero().get(), dir = %dir.display(), "stopping a process a killed gateway left in a worktree");
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// The sessions whose worktree is being filled, and how each fill ended (a fill that failed
/// stays here with its error, so everything that waits for it is told).
#[derive(Default)]
pub struct Fills {
    pending: std::sync::Mutex<std::collections::HashMap<SessionId, Pending>>,
}

/// A fill under way (or failed): how it ended, whether its files are all written (what
/// follows them is the session's base being recorded), and the tree it writes.
struct Pending {
    done: FillDone,
    written: tokio::sync::watch::Sender<bool>,
    tree: String,
}

/// How a fill ended (`None` while it runs).
pub type FillDone = tokio::sync::watch::Receiver<Option<Result<(), String>>>;

impl Fills {
    /// Registers `session`'s fill, which writes `tree`, as under way; the returned sender
    /// says how it ended.
    pub fn begin(
        &self,
        session: &SessionId,
        tree: &str,
    ) -> tokio::sync::watch::Sender<Option<Result<(), String>>> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                session.clone(),
                Pending {
                    done: rx,
                    written: tokio::sync::watch::Sender::new(false),
                    tree: tree.to_owned(),
                },
            );
        tx
    }

    /// Whether the fill under way of `session`'s worktree `path` writes an entry `name` at
    /// its root (`None`: no fill is under way, the files are there to look at). Answered
    /// from the tree the fill writes, without waiting for it; a tree that cannot be read
    /// counts as writing it.
    pub async fn writes_root_entry(
        &self,
        session: &SessionId,
        path: &Path,
        name: &str,
    ) -> Option<bool> {
        let tree = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(session)
            .map(|p| p.tree.clone())?;
        let listed = git(path)
            .args(["ls-tree", "-z", "--name-only", &tree, "--"])
            .arg(name)
            .run_checked(&CancellationToken::new())
            .await;
        Some(match listed {
            Ok(out) => !out.trim().is_empty(),
            Err(_) => true,
        })
    }

    /// Every file of `session`'s fill is written: what only reads the worktree may go on
    /// ([`Fills::written`]) while the session's base is recorded.
    pub fn files_written(&self, session: &SessionId) {
        if let Some(p) = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(session)
        {
            p.written.send_replace(true);
        }
    }

    /// Waits until `session`'s worktree holds all its files, which may be before its fill
    /// is complete ([`Fills::ready`]): for what only reads them, never for what writes.
    pub async fn written(&self, session: &SessionId) -> Result<(), String> {
        let watched = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(session)
            .map(|p| (p.done.clone(), p.written.subscribe()));
        let Some((mut done, mut written)) = watched else {
            return Ok(());
        };
        tokio::select! {
            // Marked written, or the fill succeeded and was forgotten (the sender went).
            _ = written.wait_for(|w| *w) => Ok(()),
            ended = done.wait_for(Option::is_some) => match ended {
                Ok(done) => done.clone().unwrap_or(Ok(())),
                Err(_) => Err("the fill stopped before it finished".into()),
            },
        }
    }

    /// `session`'s fill succeeded: nothing waits for it from now on.
    pub fn finished(&self, session: &SessionId) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session);
    }

    /// Waits until `session`'s worktree is filled; at once when no fill is under way. The
    /// error is the failed fill's.
    pub async fn ready(&self, session: &SessionId) -> Result<(), String> {
        let rx = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(session)
            .map(|p| p.done.clone());
        let Some(mut rx) = rx else {
            return Ok(());
        };
        match rx.wait_for(Option::is_some).await {
            Ok(done) => done.clone().unwrap_or(Ok(())),
            Err(_) => Err("the fill stopped before it finished".into()),
        }
    }
}

/// Creates the session's own workspace from `source`; for a git repository, the files are
/// left to the returned [`Fill`] (the caller records it, runs it, and makes everything that
/// touches the workspace wait for it). A plain copy is made before it returns.
pub async fn prepare_deferred(
    source: &Path,
    session: &SessionId,
    state: &StateDir,
) -> Result<(WorkspaceView, Option<Fill>), WorkspaceError> {
    let source = source
        .canonicalize()
        .ok()
        .filter(|p| p.is_dir())
        .ok_or_else(|| WorkspaceError::Missing(source.display().to_string()))?;
    for held in [state.root(), state.workspaces_root()] {
        if held.starts_with(&source) {
            return Err(WorkspaceError::ContainsStateDir {
                path: source.display().to_string(),
                state: held.display().to_string(),
            });
        }
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
        Some(repo) => {
            let (view, fill) = worktree_deferred(&repo, session, state, &cancel).await?;
            Ok((view, Some(fill)))
        }
        None => Ok((copy(&source, session, state, &cancel).await?, None)),
    }
}

/// A session's worktree of a remote repository's clone (`remote.rs`): a new branch
/// `skiff/<session>` at `commit`, its files left to the returned [`Fill`] as for a local
/// repository. The view's `source` is the clone, whose `origin` is the remote.
pub async fn remote_worktree_deferred(
    mirror: &Path,
    commit: &str,
    session: &SessionId,
    state: &StateDir,
) -> Result<(WorkspaceView, Fill), WorkspaceError> {
    let cancel = CancellationToken::new();
    let failed = |source| WorkspaceError::Prepare {
        path: mirror.display().to_string(),
        source,
    };
    let tree = git(mirror)
        .args(["rev-parse", "--verify", "--quiet"])
        .arg(format!("{commit}^{{tree}}"))
        .run_checked(&cancel)
        .await
        .map_err(failed)?
        .trim()
        .to_owned();
    let path = state.worktree(session.as_str());
    let branch = format!("skiff/{session}");
    let lock = repo_lock(mirror);
    let added = {
        let _one_at_a_time = lock.lock().await;
        git(mirror)
            .args(["worktree", "add", "--quiet", "--no-checkout", "-b", &branch])
            .arg(&path)
            .arg(commit)
            .run_checked(&cancel)
            .await
    };
    added.map_err(failed)?;
    let fill = Fill {
        session: session.to_string(),
        repo: mirror.to_path_buf(),
        branch: branch.clone(),
        path: path.clone(),
        base_commit: commit.to_owned(),
        tree,
        copy_from: None,
    };
    Ok((fill.view(), fill))
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
        remote: None,
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
