//! A session's result coming home. Where it lives: git mode, the branch `skiff/<session>` in
//! the user's repository (plus the worktree's uncommitted files); plain mode, the gateway's
//! copy of the directory. This module shows it (`diff`, against what the session started from,
//! and a turn's changes, its checkpoint against the one before) and brings a plain session's
//! result home (`apply`, onto its directory where that still matches the base; `export`,
//! whole, into a new directory).
//!
//! What a session started from is recorded when it is created, before its first turn
//! (`record_base`): a `manifest` artifact whose metadata says `purpose: base` — plain mode, a
//! manifest of the copy with every file's bytes in the content store; git mode, checkpoint 0
//! (the base commit plus the user's carried-over uncommitted work), so the first turn's changes
//! are the agent's alone. Deliberately absent: applying a git session's result (that is a
//! merge of its branch, or `publish`).

use crate::Core;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::sync::{ApplyResult, ChangeStatus, ExportResult, FileChange, SessionDiff};
use skiff_protocol::{RunId, SessionId};
use skiff_store::{ArtifactRole, ArtifactRow, NewArtifact, Retention, Scope};
use skiff_sync::cas::Cas;
use skiff_sync::results::{self, Contents, GitTarget, PatchLimits};
use skiff_sync::{Limits, Manifest, Mode, Rules, checkpoint, manifest};
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// A recorded state of a session's workspace: its base, or a checkpoint.
enum Snapshot {
    Git {
        commit: String,
        /// The large untracked files kept outside git.
        outside: Option<String>,
        /// Whether `commit` is a checkpoint commit (its parent is the branch head then) rather
        /// than a branch commit.
        checkpoint: bool,
    },
    Plain {
        manifest: String,
    },
}

impl Snapshot {
    fn of(row: &ArtifactRow) -> Result<Snapshot> {
        let text = |key: &str| row.meta[key].as_str().map(str::to_owned);
        match row.meta["mode"].as_str() {
            Some("git") => Ok(Snapshot::Git {
                commit: text("commit").ok_or_else(|| corrupt(row, "no commit"))?,
                outside: text("manifest"),
                checkpoint: true,
            }),
            Some("plain") => Ok(Snapshot::Plain {
                manifest: text("manifest").ok_or_else(|| corrupt(row, "no manifest"))?,
            }),
            _ => Err(corrupt(row, "no mode")),
        }
    }
}

fn corrupt(row: &ArtifactRow, detail: &str) -> Error {
    Error::Store(skiff_store::Error::Corrupt {
        what: "workspace snapshot",
        detail: format!("{}: {detail}", row.id),
    })
}

fn mode_name(view: &WorkspaceView) -> &'static str {
    match view {
        WorkspaceView::Git { .. } => "git",
        WorkspaceView::Plain { .. } => "plain",
    }
}

fn load_manifest(cas: &Cas, hash: &str) -> Result<Manifest> {
    Ok(manifest::from_json(&String::from_utf8_lossy(
        &cas.get(hash)?,
    ))?)
}

fn totals(session_id: &SessionId, mode: &str, base: String, files: Vec<FileChange>) -> SessionDiff {
    SessionDiff {
        session_id: session_id.clone(),
        run_id: None,
        mode: mode.to_owned(),
        base,
        commits: Vec::new(),
        insertions: files.iter().map(|f| f.insertions).sum(),
        deletions: files.iter().map(|f| f.deletions).sum(),
        files,
    }
}

/// Runs blocking file work (hashing, diffing, copying) off the async runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("a file task of the gateway died: {e}")))?
}

impl Core {
    /// Records what a new session starts from (see the module docs). Never fails the session:
    /// a failure is logged and audited, and `diff`/`apply` then say there is no base.
    pub(crate) async fn record_base(&self, scope: &Scope, id: &SessionId, view: &WorkspaceView) {
        match self.take_base(scope, id, view).await {
            Ok(row) => self.audit(
                scope,
                "session.base",
                id.as_str(),
                "applied",
                json!({ "artifact": row.id.as_str(), "files": row.meta["files"] }),
            ),
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "could not record what the session starts from");
                self.audit(scope, "session.base", id.as_str(), "failed", json!({}));
            }
        }
    }

    async fn take_base(
        &self,
        scope: &Scope,
        id: &SessionId,
        view: &WorkspaceView,
    ) -> Result<ArtifactRow> {
        let cancel = CancellationToken::new();
        let cas = Cas::open(&self.artifacts_dir())?;
        let path = Path::new(view.path());
        let rules = Rules::load(path)?;
        let limits = Limits::default();
        let (meta, hash, size) = match view {
            WorkspaceView::Git { .. } => {
                let scratch = self.state.tmp();
                let stores = checkpoint::GitStores {
                    scratch: &scratch,
                    cas: &cas,
                    large: checkpoint::LargeFiles::default(),
                };
                let cp = checkpoint::git_checkpoint(
                    path,
                    id.as_str(),
                    0,
                    &rules,
                    &limits,
                    &stores,
                    &cancel,
                )
                .await?;
                let meta = json!({
                    "purpose": "base", "mode": "git", "git_ref": cp.git_ref, "commit": cp.commit,
                    "manifest": cp.outside_git, "files": cp.files, "bytes": cp.bytes,
                });
                let descriptor = meta.to_string();
                let hash = cas.put_bytes(descriptor.as_bytes())?;
                (meta, hash, descriptor.len() as u64)
            }
            WorkspaceView::Plain { .. } => {
                let cp = checkpoint::plain_checkpoint(path, &rules, &limits, &cas, &cancel).await?;
                let size = cas.get(&cp.manifest)?.len() as u64;
                let meta = json!({
                    "purpose": "base", "mode": "plain", "manifest": cp.manifest,
                    "files": cp.files, "bytes": cp.bytes,
                });
                (meta, cp.manifest, size)
            }
        };
        Ok(self.store.create_artifact(
            scope,
            &NewArtifact {
                session_id: Some(id.clone()),
                run_id: None,
                role: ArtifactRole::Manifest,
                retention: Retention::Session,
                hash,
                size,
                meta,
                expires_at_ms: None,
            },
        )?)
    }

    pub(crate) fn base_row(&self, scope: &Scope, id: &SessionId) -> Result<Option<ArtifactRow>> {
        Ok(self
            .store
            .artifacts(scope, id, ArtifactRole::Manifest)?
            .into_iter()
            .find(|r| r.meta["purpose"] == "base"))
    }

    /// The plain base manifest's hash, or why there is none.
    fn plain_base(&self, scope: &Scope, id: &SessionId) -> Result<String> {
        match self
            .base_row(scope, id)?
            .map(|r| Snapshot::of(&r))
            .transpose()?
        {
            Some(Snapshot::Plain { manifest }) => Ok(manifest),
            _ => Err(Error::Conflict(format!(
                "session {id} has no record of what its directory held when it started (it was created by an older gateway, or recording it failed: see the gateway's log); `skiff session export {id} --to DIR` still writes its whole result"
            ))),
        }
    }

    /// The session's changes against what it started from.
    pub(crate) async fn session_diff(
        &self,
        scope: &Scope,
        id: &SessionId,
        stat: bool,
    ) -> Result<SessionDiff> {
        let session = self.store.session(scope, id)?;
        self.workspace_ready(id).await?;
        let cancel = CancellationToken::new();
        let limits = PatchLimits::default();
        match &session.workspace {
            WorkspaceView::Git {
                path, base_commit, ..
            } => {
                let worktree = Path::new(path);
                let files = results::git_changes(
                    worktree,
                    base_commit,
                    GitTarget::Worktree,
                    stat,
                    &limits,
                    &self.state.tmp(),
                    &cancel,
                )
                .await?;
                let mut diff = totals(id, "git", base_commit.clone(), files);
                diff.commits = results::commits(worktree, base_commit, "HEAD", &cancel).await?;
                Ok(diff)
            }
            WorkspaceView::Plain { path, .. } => {
                let base_hash = self.plain_base(scope, id)?;
                let cas = Cas::open(&self.artifacts_dir())?;
                let base = load_manifest(&cas, &base_hash)?;
                let workspace = PathBuf::from(path);
                let now = results::scan(&workspace, Mode::Plain, &cancel).await?;
                let files = blocking(move || {
                    let d = results::result_diff(&base, &now, &workspace);
                    Ok(results::manifest_changes(
                        &base,
                        Contents::Cas(&cas),
                        &now,
                        Contents::Dir(&workspace),
                        &d,
                        stat,
                        &limits,
                    )?)
                })
                .await?;
                Ok(totals(id, "plain", base_hash, files))
            }
        }
    }

    /// One turn's changes: its checkpoint against the previous one (the session's base for
    /// the first).
    pub(crate) async fn turn_changes(
        &self,
        scope: &Scope,
        id: &SessionId,
        run: &RunId,
        stat: bool,
    ) -> Result<SessionDiff> {
        let session = self.store.session(scope, id)?;
        self.workspace_ready(id).await?;
        let run_row = self.store.run(scope, run)?;
        if run_row.session_id != *id {
            return Err(skiff_store::Error::NotFound {
                what: "run",
                id: run.to_string(),
            }
            .into());
        }
        let checkpoints = self.store.artifacts(scope, id, ArtifactRole::Checkpoint)?;
        let Some(pos) = checkpoints
            .iter()
            .rposition(|r| r.run_id.as_ref() == Some(run))
        else {
            return Err(if run_row.status.is_terminal() {
                Error::Conflict(format!(
                    "turn {run} left no checkpoint (taking it failed: see the gateway's log), so its changes are not known; `skiff session diff {id}` shows the session's"
                ))
            } else {
                Error::Conflict(format!(
                    "turn {run} is still running; its changes are known when it ends"
                ))
            });
        };
        let current = Snapshot::of(&checkpoints[pos])?;
        let previous = match pos.checked_sub(1) {
            Some(p) => Some(Snapshot::of(&checkpoints[p])?),
            None => self
                .base_row(scope, id)?
                .map(|r| Snapshot::of(&r))
                .transpose()?,
        };
        let cancel = CancellationToken::new();
        let limits = PatchLimits::default();
        let cas = Cas::open(&self.artifacts_dir())?;
        let mut diff = match (&session.workspace, current) {
            (
                WorkspaceView::Git {
                    source,
                    base_commit,
                    ..
                },
                Snapshot::Git {
                    commit, outside, ..
                },
            ) => {
                let (from, from_outside, from_checkpoint) = match previous {
                    Some(Snapshot::Git {
                        commit,
                        outside,
                        checkpoint,
                    }) => (commit, outside, checkpoint),
                    _ => (base_commit.clone(), None, false),
                };
                let repo = Path::new(source);
                let mut files = results::git_changes(
                    repo,
                    &from,
                    GitTarget::Commit(&commit),
                    stat,
                    &limits,
                    &self.state.tmp(),
                    &cancel,
                )
                .await?;
                files.extend(outside_changes(&cas, from_outside, outside, &files)?);
                files.sort_by(|a, b| a.path.cmp(&b.path));
                // A checkpoint commit's parent is the branch head when it was taken.
                let head_then = |c: &str, checkpoint: bool| {
                    if checkpoint {
                        format!("{c}^")
                    } else {
                        c.to_owned()
                    }
                };
                let mut diff = totals(id, "git", from.clone(), files);
                diff.commits = results::commits(
                    repo,
                    &head_then(&from, from_checkpoint),
                    &head_then(&commit, true),
                    &cancel,
                )
                .await?;
                diff
            }
            (WorkspaceView::Plain { .. }, Snapshot::Plain { manifest }) => {
                let from = match previous {
                    Some(Snapshot::Plain { manifest }) => manifest,
                    _ => self.plain_base(scope, id)?,
                };
                let old = load_manifest(&cas, &from)?;
                let new = load_manifest(&cas, &manifest)?;
                let files = blocking(move || {
                    let d = manifest::diff(&old, &new);
                    Ok(results::manifest_changes(
                        &old,
                        Contents::Cas(&cas),
                        &new,
                        Contents::Cas(&cas),
                        &d,
                        stat,
                        &limits,
                    )?)
                })
                .await?;
                totals(id, "plain", from, files)
            }
            _ => {
                return Err(corrupt(
                    &checkpoints[pos],
                    "its mode is not the session's workspace mode",
                ));
            }
        };
        diff.run_id = Some(run.clone());
        Ok(diff)
    }

    /// Writes a plain session's changes back onto its directory (or `to`), where that still
    /// matches what the session started from; otherwise names the conflicts and writes
    /// nothing.
    pub(crate) async fn apply_result(
        &self,
        scope: &Scope,
        id: &SessionId,
        to: Option<String>,
    ) -> Result<ApplyResult> {
        let session = self.store.session(scope, id)?;
        self.workspace_ready(id).await?;
        let (source, path) = match &session.workspace {
            WorkspaceView::Git { source, branch, .. } => {
                return Err(Error::Conflict(format!(
                    "session {id} works on the git repository {source}: its result is the branch {branch} there. Merge it (git -C {source} merge {branch}), or push it with `skiff session publish {id}`"
                )));
            }
            WorkspaceView::Plain { source, path } => (source.clone(), PathBuf::from(path)),
        };
        if let Some(run) = self.store.open_run(scope, id)? {
            return Err(skiff_store::Error::SessionBusy {
                session: id.to_string(),
                run: run.id.to_string(),
            }
            .into());
        }
        let target = self.outside_state(to.as_deref().unwrap_or(&source))?;
        if !target.is_dir() {
            return Err(Error::BadRequest(format!(
                "{} is not a directory; apply writes into an existing directory (for a new one, use `skiff session export {id} --to DIR`)",
                target.display()
            )));
        }
        let base_hash = self.plain_base(scope, id)?;
        let cas = Cas::open(&self.artifacts_dir())?;
        let base = load_manifest(&cas, &base_hash)?;
        let now = results::scan(&path, Mode::Plain, &CancellationToken::new()).await?;
        let dir = target.clone();
        let done = blocking(move || {
            let d = results::result_diff(&base, &now, &path);
            let plan = results::plan_apply(&base, &d, &dir)?;
            let applied = results::apply(&plan, &path, &dir)?;
            Ok((plan, applied))
        })
        .await;
        let to = target.display().to_string();
        match &done {
            Ok((plan, applied)) => self.audit(
                scope,
                "session.apply",
                id.as_str(),
                "applied",
                json!({ "to": to, "written": applied.written.len(), "deleted": applied.deleted.len(), "unchanged": plan.unchanged.len() }),
            ),
            Err(Error::Sync(skiff_sync::Error::ApplyConflict { conflicts, .. })) => self.audit(
                scope,
                "session.apply",
                id.as_str(),
                "refused",
                json!({ "to": to, "conflicts": conflicts.len() }),
            ),
            Err(_) => self.audit(
                scope,
                "session.apply",
                id.as_str(),
                "failed",
                json!({ "to": to }),
            ),
        }
        let (plan, applied) = done?;
        Ok(ApplyResult {
            session_id: id.clone(),
            to,
            written: applied.written,
            deleted: applied.deleted,
            unchanged: plan.unchanged,
        })
    }

    /// Writes the session's whole result (its workspace's files that sync, never `.git`) into
    /// a new or empty directory.
    pub(crate) async fn export_result(
        &self,
        scope: &Scope,
        id: &SessionId,
        to: &str,
    ) -> Result<ExportResult> {
        let session = self.store.session(scope, id)?;
        self.workspace_ready(id).await?;
        let target = self.outside_state(to)?;
        let mode = match session.workspace {
            WorkspaceView::Git { .. } => Mode::Git,
            WorkspaceView::Plain { .. } => Mode::Plain,
        };
        let root = PathBuf::from(session.workspace.path());
        let done = results::export(&root, mode, &target, &CancellationToken::new()).await;
        let to = target.display().to_string();
        let (decision, detail) = match &done {
            Ok((files, bytes)) => (
                "applied",
                json!({ "to": to, "mode": mode_name(&session.workspace), "files": files, "bytes": bytes }),
            ),
            Err(_) => ("failed", json!({ "to": to })),
        };
        self.audit(scope, "session.export", id.as_str(), decision, detail);
        let (files, bytes) = done?;
        Ok(ExportResult {
            session_id: id.clone(),
            to,
            files,
            bytes,
        })
    }

    /// An absolute directory outside the gateway's state dir (which holds every session's
    /// workspace and is private).
    fn outside_state(&self, dir: &str) -> Result<PathBuf> {
        let path = Path::new(dir);
        if !path.is_absolute() {
            return Err(Error::BadRequest(format!(
                "{dir} must be an absolute path on the gateway host"
            )));
        }
        let normalized: PathBuf = path.components().collect();
        if normalized
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(Error::BadRequest(format!(
                "{dir} has a `..` segment; name the directory plainly"
            )));
        }
        // The nearest existing ancestor, resolved: a symlink must not lead into the state dir.
        let mut existing = normalized.as_path();
        while !existing.exists() {
            match existing.parent() {
                Some(p) => existing = p,
                None => break,
            }
        }
        let resolved = existing
            .canonicalize()
            .unwrap_or_else(|_| existing.to_path_buf());
        // Both roots the gateway owns: the state dir and `[store] workspaces` (the same
        // directory unless configured apart). Writing a result into either would overwrite
        // sessions' worktrees, clones or the database.
        for (what, root) in [
            ("state dir", self.state.root()),
            (
                "workspaces directory ([store] workspaces)",
                self.state.workspaces_root(),
            ),
        ] {
            let root = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
            if resolved.starts_with(&root) || root.starts_with(&normalized) {
                return Err(Error::BadRequest(format!(
                    "{dir} is inside (or holds) the gateway's {what} {}; choose a directory outside it",
                    root.display()
                )));
            }
        }
        Ok(normalized)
    }
}

/// Changes to the large untracked files a git checkpoint keeps outside git (not in its tree),
/// named as changes whose content is not diffed.
fn outside_changes(
    cas: &Cas,
    from: Option<String>,
    to: Option<String>,
    seen: &[FileChange],
) -> Result<Vec<FileChange>> {
    if from.is_none() && to.is_none() {
        return Ok(Vec::new());
    }
    let empty = Manifest {
        version: skiff_protocol::sync::MANIFEST_VERSION,
        base_commit: None,
        entries: Default::default(),
    };
    let old = from
        .map(|h| load_manifest(cas, &h))
        .transpose()?
        .unwrap_or_else(|| empty.clone());
    let new = to
        .map(|h| load_manifest(cas, &h))
        .transpose()?
        .unwrap_or(empty);
    let d = manifest::diff(&old, &new);
    let mut out = Vec::new();
    for path in d.changed.keys().chain(d.deleted.iter()) {
        if seen.iter().any(|c| &c.path == path) {
            continue;
        }
        out.push(FileChange {
            path: path.clone(),
            status: if d.deleted.contains(path) {
                ChangeStatus::Deleted
            } else if old.entries.contains_key(path) {
                ChangeStatus::Modified
            } else {
                ChangeStatus::Added
            },
            binary: false,
            insertions: 0,
            deletions: 0,
            patch: None,
            omitted: Some(
                "a large untracked file, kept outside git by the checkpoint; not diffed".into(),
            ),
        });
    }
    Ok(out)
}
