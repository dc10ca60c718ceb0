//! Turns on a worker: the run handed over (again after a reconnect, with the transcript), its
//! end awaited, and at `turn.finish` the box's work reconciled into the session's workspace
//! (git: verified bundle + fast-forward; plain: checked mirror) and checkpointed.

use super::place::{box_workspace, placement_error};
use crate::Core;
use crate::error::Result;
use serde_json::json;
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::ModelRef;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::{GatewayFrame, Reply, TurnAssignment, TurnEnd};
use skiff_protocol::{RunId, SessionId};
use skiff_store::{PlacementChange, PlacementRow, RunRow, Scope, SessionRow};
use skiff_sync::filelist::Limits;
use skiff_sync::inbound_git::{self, Adoption};
use skiff_sync::inbound_plain::{self, Inbound};
use skiff_sync::{Remote, Rules, manifest};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl Core {
    /// Sends the session's open run to its worker (again: the worker starts a run once).
    pub(crate) fn hand_over_turn(&self, scope: &Scope, session: &SessionId) {
        let Ok(Some(run)) = self.store.open_run(scope, session) else {
            return;
        };
        if run.status != RunStatus::Running {
            return;
        }
        let Ok(model) = ModelRef::parse(&run.model_ref).ok_or(()) else {
            return;
        };
        let Ok(transcript) = self.store.transcript(scope, session) else {
            return;
        };
        let turn = TurnAssignment {
            run_id: run.id.clone(),
            model_label: self.catalog.describe(&model).label,
            model,
            max_steps: crate::sessions::MAX_STEPS,
            max_output_tokens: crate::sessions::MAX_OUTPUT_TOKENS,
            transcript,
        };
        let live = self.workers.live(session);
        live.set_open_run(Some(run.id.clone()));
        live.send(GatewayFrame::Turn { turn });
    }

    /// Runs the admitted run on the session's worker and waits for its end.
    pub(crate) async fn run_turn_on_worker(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        cancel: &CancellationToken,
    ) -> Result<skiff_agent::TurnOutcome> {
        let p = self.ensure_worker(scope, session, cancel).await?;
        self.store
            .transition_run(scope, &run.id, RunStatus::Running, None)?;
        self.hub.publish(
            scope,
            &session.id,
            Some(&run.id),
            EventKind::RunStatus {
                status: RunStatus::Running,
                error: None,
            },
        )?;
        let env = p
            .environment_id
            .clone()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let attempt = self.store.start_attempt(
            scope,
            run,
            &env,
            i64::try_from(p.owner_epoch).unwrap_or(0),
        )?;
        let live = self.workers.live(&session.id);
        let done = live.expect_turn(&run.id);
        self.hand_over_turn(scope, &session.id);
        tokio::pin!(done);
        let end = tokio::select! {
            end = &mut done => end.ok(),
            _ = cancel.cancelled() => {
                live.send(GatewayFrame::CancelTurn { run_id: run.id.clone() });
                self.cancel_model_calls(&session.id);
                tokio::time::timeout(Duration::from_secs(30), &mut done).await.ok().and_then(|r| r.ok())
            }
        };
        let end = end.unwrap_or(TurnEnd::Failed {
            error: "the worker did not finish the turn".into(),
        });
        let (status, outcome) = match end {
            TurnEnd::Completed => (
                skiff_store::AttemptStatus::Succeeded,
                skiff_agent::TurnOutcome::Completed,
            ),
            TurnEnd::Cancelled => (
                skiff_store::AttemptStatus::Cancelled,
                skiff_agent::TurnOutcome::Cancelled,
            ),
            TurnEnd::Failed { error } => (
                skiff_store::AttemptStatus::Failed,
                skiff_agent::TurnOutcome::Failed(error),
            ),
        };
        if let Err(e) = self.store.finish_attempt(scope, &attempt, status) {
            tracing::warn!(run = %run.id, error = %e, "could not finish the attempt");
        }
        Ok(outcome)
    }

    /// `turn.finish`: reconcile the box's work into the session's workspace, checkpoint it,
    /// and end the turn the run executor is waiting for.
    pub(super) async fn worker_turn_finished(
        self: &Arc<Self>,
        scope: &Scope,
        claims: &skiff_protocol::worker::CredentialClaims,
        op: &skiff_protocol::worker::OpId,
        end: TurnEnd,
        theirs: std::result::Result<skiff_protocol::sync::Manifest, String>,
    ) -> Reply {
        let Some(run) = op.run_id.clone() else {
            return Reply::Finished;
        };
        let session = &claims.session_id;
        let open = self.store.open_run(scope, session).ok().flatten();
        if open.as_ref().map(|r| &r.id) != Some(&run) {
            // A fenced turn (its run already ended): nothing of it is adopted here; the next
            // turn's reconciliation carries whatever it left in the workspace.
            return Reply::Finished;
        }
        let end = match self.reconcile(scope, session, theirs, &run).await {
            Ok(()) => end,
            Err(e) => {
                let text = format!(
                    "The box's work could not be brought back: {e}. Nothing was overwritten; the box keeps its copy."
                );
                let leaf = self.store.leaf(scope, session).ok().flatten();
                if let Ok(entries) = self.store.append_entries(
                    scope,
                    session,
                    leaf.as_ref(),
                    Some(&run),
                    &[EntryBody::Notice { text: text.clone() }],
                ) {
                    for entry in entries {
                        let _ = self.hub.publish(
                            scope,
                            session,
                            Some(&run),
                            EventKind::Entry { entry },
                        );
                    }
                }
                TurnEnd::Failed { error: text }
            }
        };
        self.workers.live(session).end_turn(&run, end);
        Reply::Finished
    }

    async fn reconcile(
        &self,
        scope: &Scope,
        session_id: &SessionId,
        theirs: std::result::Result<skiff_protocol::sync::Manifest, String>,
        run: &RunId,
    ) -> Result<()> {
        let p = self.place(
            scope,
            session_id,
            PlacementState::Reconciling,
            &PlacementChange::default(),
            "bringing the box's work back",
        )?;
        let result = self.reconcile_inner(scope, session_id, &p, theirs).await;
        let base = result.as_ref().ok().cloned();
        let detail = match &result {
            Ok(_) => "the box's work is in the session's workspace".to_owned(),
            Err(e) => format!("reconciliation stopped: {e}"),
        };
        self.place(
            scope,
            session_id,
            PlacementState::Active,
            &PlacementChange {
                base_manifest: base.as_deref(),
                ..Default::default()
            },
            &detail,
        )?;
        if result.is_ok() {
            let session = self.store.session(scope, session_id)?;
            self.checkpoint_turn(scope, &session, run).await;
        }
        result.map(|_| ())
    }

    async fn reconcile_inner(
        &self,
        scope: &Scope,
        session_id: &SessionId,
        p: &PlacementRow,
        theirs: std::result::Result<skiff_protocol::sync::Manifest, String>,
    ) -> Result<String> {
        let mut theirs = theirs.map_err(|why| {
            // The box's words: bounded, and said to be the worker's.
            let why: String = why.chars().take(2000).collect();
            placement_error(format!("the worker could not list its workspace: {why}"))
        })?;
        let session = self.store.session(scope, session_id)?;
        let base = manifest::from_json(p.base_manifest.as_deref().unwrap_or(""))?;
        let env = self.placement_env(scope, p)?;
        let remote = Remote::new(self.envs.ssh(&env)?, &box_workspace(session_id))?;
        let local = Path::new(session.workspace.path());
        let rules = Rules::load(local)?;
        let limits = Limits::default();
        let scratch = self.state.tmp();
        let cancel = CancellationToken::new();
        match &session.workspace {
            WorkspaceView::Git { .. } => {
                let commit = base
                    .base_commit
                    .clone()
                    .ok_or_else(|| placement_error("the base manifest has no base commit"))?;
                let bundle = inbound_git::fetch_bundle(
                    &remote,
                    session_id.as_str(),
                    &commit,
                    &limits,
                    &scratch,
                    &cancel,
                )
                .await?;
                let a = Adoption {
                    worktree: local,
                    session: session_id.as_str(),
                    base: &base,
                    expected_head: &commit,
                    rules: &rules,
                    limits: &limits,
                    scratch: &scratch,
                };
                let adopted = inbound_git::adopt(
                    &a,
                    bundle.as_ref().map(|b| b.path()),
                    &theirs,
                    &remote,
                    &cancel,
                )
                .await?;
                self.audit(scope, "sync.inbound", session_id.as_str(), "applied", json!({
                    "env": env.id.as_str(), "mode": "git", "head": adopted.head, "fast_forwarded": adopted.fast_forwarded,
                    "written": adopted.files.written.len(), "deleted": adopted.files.deleted.len(),
                }));
                theirs.base_commit = Some(adopted.head);
            }
            WorkspaceView::Plain { .. } => {
                let inb = Inbound {
                    target: local,
                    base: &base,
                    rules: &rules,
                    limits: &limits,
                    scratch: &scratch,
                };
                let applied = inbound_plain::mirror(&inb, &theirs, &remote, &cancel).await?;
                self.audit(scope, "sync.inbound", session_id.as_str(), "applied", json!({
                    "env": env.id.as_str(), "mode": "plain", "written": applied.written.len(), "deleted": applied.deleted.len(),
                }));
            }
        }
        Ok(manifest::to_json(&theirs)?)
    }
}
