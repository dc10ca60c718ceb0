//! End-of-turn checkpoints: after every turn (a worker's once its work is reconciled), the
//! session's workspace is
//! checkpointed (git mode: a commit under `refs/skiff/checkpoints/<session>/<n>`, taken
//! through a private index, with large untracked files kept in `<state>/artifacts/` instead of
//! the user's object store; plain mode: a manifest of content-addressed blobs under
//! `<state>/artifacts/`) and recorded as a `checkpoint` artifact row.
//!
//! A checkpoint that fails is logged and audited, never a failed turn. Restoring one, or
//! forking a session at one, is `restore.rs`'s. Deliberately absent: cadence policy (every
//! turn), and deleting checkpoints (a restore keeps the later ones, and a fork's first N rows
//! name the original's commits and blobs).

use crate::Core;
use crate::error::Result;
use serde_json::json;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::sync::{CheckpointList, CheckpointView};
use skiff_protocol::{RunId, SessionId};
use skiff_store::{ArtifactRole, ArtifactRow, NewArtifact, Retention, Scope, SessionRow};
use skiff_sync::cas::Cas;
use skiff_sync::{Limits, Rules, checkpoint};
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

impl Core {
    pub(crate) fn artifacts_dir(&self) -> PathBuf {
        self.state.artifacts()
    }

    /// Checkpoints the session's workspace at the end of a turn. Never fails the turn.
    /// `known`: what a reconciliation just found the worktree to hold, with nothing written
    /// since (it spares the checkpoint a listing when nothing changed).
    pub(crate) async fn checkpoint_turn(
        &self,
        scope: &Scope,
        session: &SessionRow,
        run: &RunId,
        known: Option<&checkpoint::Known>,
    ) {
        let started = std::time::Instant::now();
        match self.take_checkpoint(scope, session, run, known).await {
            Ok(row) => {
                tracing::debug!(session = %session.id, checkpoint = %row.id, seq = ?row.seq, ms = started.elapsed().as_millis() as u64, "checkpoint taken");
                self.audit(
                    scope,
                    "checkpoint.create",
                    row.id.as_str(),
                    "applied",
                    json!({ "session": session.id.as_str(), "run": run.as_str(), "seq": row.seq, "bytes": row.meta["bytes"] }),
                );
            }
            Err(e) => {
                tracing::warn!(session = %session.id, error = %e, "could not checkpoint the session's workspace");
                self.audit(
                    scope,
                    "checkpoint.create",
                    session.id.as_str(),
                    "failed",
                    json!({ "run": run.as_str() }),
                );
            }
        }
    }

    async fn take_checkpoint(
        &self,
        scope: &Scope,
        session: &SessionRow,
        run: &RunId,
        known: Option<&checkpoint::Known>,
    ) -> Result<ArtifactRow> {
        self.workspace_ready(&session.id).await?;
        let cancel = CancellationToken::new();
        let cas = Cas::open(&self.artifacts_dir())?;
        let last = self
            .store
            .artifacts(scope, &session.id, ArtifactRole::Checkpoint)?
            .pop();
        let seq = last.as_ref().and_then(|r| r.seq).unwrap_or(0) + 1;
        // What the next checkpoint may reuse when nothing changed since this one.
        let previous = last.and_then(|r| {
            Some(checkpoint::Previous {
                state: r.meta["state"].as_str()?.to_owned(),
                commit: r.meta["commit"].as_str()?.to_owned(),
                tree: r.meta["tree"].as_str()?.to_owned(),
                outside_git: r.meta["manifest"].as_str().map(str::to_owned),
            })
        });
        let path = Path::new(session.workspace.path());
        let rules = Rules::load(path)?;
        let limits = Limits::default();
        let (meta, hash, size) = match &session.workspace {
            WorkspaceView::Git { .. } => {
                let scratch = self.state.tmp();
                let stores = checkpoint::GitStores {
                    scratch: &scratch,
                    cas: &cas,
                    large: checkpoint::LargeFiles::default(),
                };
                let cp = checkpoint::git_checkpoint_after(
                    path,
                    session.id.as_str(),
                    seq,
                    &rules,
                    &limits,
                    &stores,
                    previous.as_ref(),
                    known,
                    &cancel,
                )
                .await?;
                // `manifest`: the large untracked files kept in the artifact store, not the repo.
                // `state`: the digest the next checkpoint compares to reuse this tree.
                let meta = json!({
                    "mode": "git", "git_ref": cp.git_ref, "commit": cp.commit, "tree": cp.tree,
                    "manifest": cp.outside_git, "files": cp.files, "bytes": cp.bytes,
                    "state": cp.state,
                });
                // The blob of a git checkpoint is its descriptor; the content is in the repo.
                let descriptor = meta.to_string();
                let hash = cas.put_bytes(descriptor.as_bytes())?;
                (meta, hash, descriptor.len() as u64)
            }
            WorkspaceView::Plain { .. } => {
                let cp = checkpoint::plain_checkpoint(path, &rules, &limits, &cas, &cancel).await?;
                let size = cas.get(&cp.manifest)?.len() as u64;
                let meta = json!({
                    "mode": "plain", "manifest": cp.manifest, "files": cp.files, "bytes": cp.bytes,
                });
                (meta, cp.manifest, size)
            }
        };
        let row = self.store.create_artifact(
            scope,
            &NewArtifact {
                session_id: Some(session.id.clone()),
                run_id: Some(run.clone()),
                role: ArtifactRole::Checkpoint,
                retention: Retention::WhileRetryable,
                hash,
                size,
                meta,
                expires_at_ms: None,
            },
        )?;
        if row.seq != Some(seq) {
            tracing::warn!(session = %session.id, expected = seq, got = ?row.seq, "checkpoint numbers raced");
        }
        Ok(row)
    }

    /// The session's checkpoints, oldest first.
    pub(crate) fn checkpoints(&self, scope: &Scope, id: &SessionId) -> Result<CheckpointList> {
        self.store.session(scope, id)?;
        let rows = self.store.artifacts(scope, id, ArtifactRole::Checkpoint)?;
        Ok(CheckpointList {
            checkpoints: rows.into_iter().map(view).collect(),
        })
    }
}

fn view(row: ArtifactRow) -> CheckpointView {
    let text = |key: &str| row.meta[key].as_str().map(str::to_owned);
    CheckpointView {
        id: row.id.clone(),
        session_id: row
            .session_id
            .clone()
            .unwrap_or_else(|| SessionId::from_suffix("unknown")),
        run_id: row.run_id.clone(),
        seq: row.seq.unwrap_or(0),
        mode: text("mode").unwrap_or_default(),
        git_ref: text("git_ref"),
        commit: text("commit"),
        manifest: text("manifest"),
        files: row.meta["files"].as_u64().unwrap_or(0),
        bytes: row.meta["bytes"].as_u64().unwrap_or(0),
        created_at_ms: row.created_at_ms,
    }
}
