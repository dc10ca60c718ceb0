//! The placement of a worker session, driven end to end: lease (or reuse) a box, lay the
//! workspace onto it, open the tunnel, start `skiff worker` with a fresh credential, wait for
//! its admission and the readiness canary, then hand it turns. After each turn the box's work
//! is reconciled into the session's workspace and checkpointed. A dropped connection is
//! repaired (tunnel first), a dead worker is replaced under a new owner epoch, and a dead box
//! reclaims the placement: the conversation stays, the next message starts a fresh box from
//! the last checkpoint.

use super::lock;
use crate::Core;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::ModelRef;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::{GatewayFrame, Method, Reply, TurnAssignment, TurnEnd};
use skiff_protocol::{EnvironmentId, RunId, SessionId};
use skiff_store::{PlacementChange, PlacementRow, RunRow, Scope, SessionRow};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::inbound_git::{self, Adoption};
use skiff_sync::inbound_plain::{self, Inbound};
use skiff_sync::outbound::{self, Outbound};
use skiff_sync::{Remote, Rules, manifest};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long a started worker has to connect and pass the canary.
const ADMISSION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a dropped worker has to come back before the gateway looks for evidence.
const RECONNECT_GRACE: Duration = Duration::from_secs(3);
/// How long the gateway keeps trying to reach a box it believes alive.
const RECOVERY_DEADLINE: Duration = Duration::from_secs(60);

/// The session's workspace on the box, relative to the box user's home.
pub(crate) fn box_workspace(session: &SessionId) -> String {
    format!("workspaces/{session}")
}

/// Author identity of commits made on boxes.
const BOX_AUTHOR: (&str, &str) = ("Skiff agent", "agent@skiff.invalid");

fn placement_error(e: impl std::fmt::Display) -> Error {
    Error::BadRequest(e.to_string())
}

impl Core {
    /// Moves the placement and tells the session's subscribers.
    fn place(
        &self,
        scope: &Scope,
        session: &SessionId,
        to: PlacementState,
        change: &PlacementChange<'_>,
        detail: &str,
    ) -> Result<PlacementRow> {
        let row = self
            .store
            .transition_placement(scope, session, to, change)?;
        let event = EventKind::Placement {
            state: to,
            environment_id: row.environment_id.clone(),
            detail: detail.to_owned(),
        };
        // Carried by the open run, so a client following that run sees its placement.
        let run = self
            .store
            .open_run(scope, session)
            .ok()
            .flatten()
            .map(|r| r.id);
        let _ = self.hub.publish(scope, session, run.as_ref(), event);
        tracing::info!(%session, placement = %to, detail, "placement");
        Ok(row)
    }

    /// Refuses a new worker when the gateway already runs as many as it may.
    pub(crate) fn check_worker_capacity(&self) -> Result<()> {
        let live = self.store.count_live_placements()?;
        if live >= self.workers.max_workers {
            return Err(Error::AtCapacity(format!(
                "the gateway is at capacity: {live} of {} workers are in use; try again when a worker session finishes, or raise [gateway] max_workers",
                self.workers.max_workers
            )));
        }
        Ok(())
    }

    /// Makes sure the session has an admitted, ready worker; drives the placement as far as
    /// needed.
    pub(crate) async fn ensure_worker(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        cancel: &CancellationToken,
    ) -> Result<PlacementRow> {
        let id = &session.id;
        let mut p = self
            .store
            .placement(scope, id)?
            .ok_or_else(|| placement_error(format!("session {id} is not placed on a worker")))?;
        let live = self.workers.live(id);
        if p.state == PlacementState::Active {
            if live.connected_epoch() == Some(p.owner_epoch) {
                return Ok(p);
            }
            // Probably a blip being repaired; give it a moment before replacing the worker.
            if wait_connected(&live, p.owner_epoch, RECONNECT_GRACE * 2).await {
                return Ok(p);
            }
            p = self.place(
                scope,
                id,
                PlacementState::Starting,
                &PlacementChange {
                    advance_epoch: true,
                    ..Default::default()
                },
                "the worker is gone; starting a new one",
            )?;
        }
        if matches!(p.state, PlacementState::Reclaimed | PlacementState::Failed) {
            self.check_worker_capacity()?;
            p = self.store.request_placement(scope, id, &p.profile)?;
        }
        if p.state == PlacementState::Requested {
            p = self.place(
                scope,
                id,
                PlacementState::Provisioning,
                &PlacementChange::default(),
                &format!("leasing a box from profile {}", p.profile),
            )?;
        }
        if p.state == PlacementState::Provisioning {
            let env = match self.envs.acquire(scope, &p.profile).await {
                Ok(env) => env,
                Err(e) => {
                    self.place(
                        scope,
                        id,
                        PlacementState::Failed,
                        &PlacementChange {
                            error: Some(&e.to_string()),
                            ..Default::default()
                        },
                        "no box",
                    )?;
                    return Err(e);
                }
            };
            p = self.place(
                scope,
                id,
                PlacementState::Syncing,
                &PlacementChange {
                    environment_id: Some(&env),
                    ..Default::default()
                },
                &format!("laying the workspace onto {env}"),
            )?;
        }
        if p.state == PlacementState::Syncing {
            match self.sync_out(scope, session, &p, cancel).await {
                Ok((base, files, bytes)) => {
                    let bundle = self.envs.bundle_hash_now();
                    p = self.place(
                        scope,
                        id,
                        PlacementState::Starting,
                        &PlacementChange {
                            advance_epoch: true,
                            base_manifest: Some(&base),
                            bundle_hash: bundle.as_deref(),
                            ..Default::default()
                        },
                        &format!(
                            "{files} files ({}) on the box; starting the worker",
                            skiff_sync::filelist::human(bytes)
                        ),
                    )?;
                }
                Err(e) => {
                    self.place(
                        scope,
                        id,
                        PlacementState::Failed,
                        &PlacementChange {
                            error: Some(&e.to_string()),
                            ..Default::default()
                        },
                        "the workspace could not be laid onto the box",
                    )?;
                    return Err(e);
                }
            }
        }
        if p.state == PlacementState::Starting {
            match self.start_worker(scope, &p).await {
                Ok(row) => p = row,
                Err(e) => {
                    let why = e.to_string();
                    self.place(
                        scope,
                        id,
                        PlacementState::Failed,
                        &PlacementChange {
                            error: Some(&why),
                            ..Default::default()
                        },
                        "the worker did not become ready",
                    )?;
                    return Err(e);
                }
            }
        }
        if p.state != PlacementState::Active {
            return Err(placement_error(format!(
                "session {id} is {}; it cannot run a turn now",
                p.state
            )));
        }
        Ok(p)
    }

    async fn sync_out(
        &self,
        scope: &Scope,
        session: &SessionRow,
        p: &PlacementRow,
        cancel: &CancellationToken,
    ) -> Result<(String, usize, u64)> {
        let env = self.placement_env(scope, p)?;
        let ssh = self.envs.ssh(&env)?;
        let remote = Remote::new(ssh, &box_workspace(&session.id))?;
        let local = Path::new(session.workspace.path());
        let rules = Rules::load(local)?;
        let scratch = self.state.tmp();
        let out = Outbound {
            local,
            mode: mode_of(&session.workspace),
            session: session.id.as_str(),
            rules: &rules,
            limits: &Limits::default(),
            scratch: &scratch,
            identity: Some(BOX_AUTHOR),
        };
        let sent = outbound::push(&out, &remote, cancel).await?;
        let base = manifest::to_json(&sent.manifest)?;
        self.audit(
            scope,
            "sync.outbound",
            session.id.as_str(),
            "applied",
            json!({ "env": env.id.as_str(), "files": sent.files, "bytes": sent.bytes }),
        );
        Ok((base, sent.files, sent.bytes))
    }

    fn placement_env(
        &self,
        scope: &Scope,
        p: &PlacementRow,
    ) -> Result<skiff_store::EnvironmentRow> {
        let env = p.environment_id.as_ref().ok_or_else(|| {
            placement_error(format!("session {} has no environment", p.session_id))
        })?;
        Ok(self.store.environment(scope, env)?)
    }

    /// Opens the tunnel, starts a worker for the placement's epoch, and waits until it is
    /// admitted and has passed the readiness canary.
    async fn start_worker(
        self: &Arc<Self>,
        scope: &Scope,
        p: &PlacementRow,
    ) -> Result<PlacementRow> {
        let session = &p.session_id;
        let env = self.placement_env(scope, p)?;
        let epoch = p.owner_epoch;
        self.launch_verified(&env, session, epoch, Method::ALL.to_vec(), |pid| {
            self.store.transition_placement(
                scope,
                session,
                PlacementState::Starting,
                &PlacementChange {
                    worker_pid: Some(pid),
                    ..Default::default()
                },
            )?;
            self.audit(
                scope,
                "worker.start",
                session.as_str(),
                "applied",
                json!({ "env": env.id.as_str(), "epoch": epoch, "pid": pid }),
            );
            Ok(())
        })
        .await?;
        let p = self.place(
            scope,
            session,
            PlacementState::Active,
            &PlacementChange::default(),
            &format!("worker ready on {} (epoch {epoch})", env.id),
        )?;
        self.envs.mark_attached_ready(scope, &env.id).await?;
        self.hand_over_turn(scope, session);
        Ok(p)
    }

    /// Starts `skiff worker` on `env` for `session` at `epoch`, allowed `methods`, and waits
    /// until it is admitted and has streamed the canary's expected answer through the
    /// inference proxy. `started` records the worker's pid.
    pub(super) async fn launch_verified(
        self: &Arc<Self>,
        env: &skiff_store::EnvironmentRow,
        session: &SessionId,
        epoch: u64,
        methods: Vec<Method>,
        started: impl FnOnce(i64) -> Result<()>,
    ) -> Result<()> {
        let ssh = self.envs.ssh(env)?;
        let cancel = CancellationToken::new();
        self.open_worker_endpoint(&env.id)?;
        let remote_socket = self.open_tunnel(env, &ssh, &cancel).await?;
        let bundle = self
            .envs
            .bundle_hash_now()
            .ok_or_else(|| placement_error("the gateway's bundle is not known yet"))?;
        let host_key = self.envs.host_key(env).ok_or_else(|| {
            placement_error(format!("environment {} has no pinned host key", env.id))
        })?;
        let (credential, _) =
            self.mint_worker_credential(&env.id, &host_key, &bundle, session, epoch, methods)?;
        let live = self.workers.live(session);
        live.close();
        let launch = format!(
            "set -e; umask 077; mkdir -p \"$HOME/.skiff\"; c=\"$HOME/.skiff/credential.$$\"; cat > \"$c\"; \
             nohup setsid env -i HOME=\"$HOME\" USER=\"$(id -un)\" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
             \"$HOME/.skiff/bundles/{bundle}/skiff\" worker --socket {socket} --credential-file \"$c\" \
             </dev/null >>\"$HOME/.skiff/worker.log\" 2>&1 & echo $!",
            socket = skiff_ssh::shell_quote(&remote_socket),
        );
        let pid = ssh
            .run_with_input(
                &launch,
                credential.into_bytes(),
                Duration::from_secs(30),
                &cancel,
            )
            .await?;
        let pid: i64 = pid.trim().parse().map_err(|_| {
            placement_error(format!(
                "starting the worker printed {:?}, not a pid",
                pid.trim()
            ))
        })?;
        started(pid)?;
        if !wait_connected(&live, epoch, ADMISSION_TIMEOUT).await {
            let log = ssh
                .run(
                    "tail -n 5 \"$HOME/.skiff/worker.log\" 2>/dev/null || true",
                    &cancel,
                )
                .await
                .unwrap_or_default();
            return Err(placement_error(format!(
                "the worker on {} was not admitted within {} s; its log ends: {}",
                env.id,
                ADMISSION_TIMEOUT.as_secs(),
                log.trim()
            )));
        }
        // Readiness is a round trip through the inference proxy, not a process or a socket.
        let nonce = skiff_store::mint()?;
        let answer = live.expect_canary(&nonce);
        live.send(GatewayFrame::Canary {
            nonce: nonce.clone(),
            model: ModelRef::parse(super::CANARY_MODEL)
                .ok_or_else(|| placement_error("bad canary model"))?,
        });
        let text = tokio::time::timeout(ADMISSION_TIMEOUT, answer)
            .await
            .map_err(|_| placement_error("the worker did not answer the readiness canary"))?
            .map_err(|_| placement_error("the worker went away during the readiness canary"))?;
        if text != super::canary_answer(&nonce) {
            return Err(placement_error("the readiness canary came back wrong"));
        }
        Ok(())
    }

    /// Makes sure the control connection is up and forwards the box's worker socket to this
    /// gateway's endpoint for the environment. Returns the socket path on the box.
    async fn open_tunnel(
        &self,
        env: &skiff_store::EnvironmentRow,
        ssh: &skiff_ssh::Ssh,
        cancel: &CancellationToken,
    ) -> Result<String> {
        ssh.ensure_master(skiff_ssh::Channel::Control, cancel)
            .await?;
        let home = ssh
            .run("mkdir -p \"$HOME/.skiff\" && printf %s \"$HOME\"", cancel)
            .await?;
        let remote_socket = format!("{}/.skiff/worker.sock", home.trim());
        let local = self.workers.socket_path(&env.id);
        if let Err(e) = ssh.forward_socket(&remote_socket, &local, cancel).await {
            // An existing forward of the same socket is what we want.
            tracing::debug!(env = %env.id, error = %e, "forward request");
        }
        Ok(remote_socket)
    }

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
        self.workers.live(session).send(GatewayFrame::Turn { turn });
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
        theirs: Option<skiff_protocol::sync::Manifest>,
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
        theirs: Option<skiff_protocol::sync::Manifest>,
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
        theirs: Option<skiff_protocol::sync::Manifest>,
    ) -> Result<String> {
        let mut theirs =
            theirs.ok_or_else(|| placement_error("the worker could not list its workspace"))?;
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

    /// After a worker is admitted: a reconnecting worker gets its turn again; a session whose
    /// turn was orphaned by a gateway restart gets it retried as a new turn.
    pub(super) async fn after_admission(self: &Arc<Self>, a: &super::endpoint::Admitted) {
        let session = &a.claims.session_id;
        let Ok(Some(p)) = self.store.placement(&a.scope, session) else {
            return;
        };
        if p.state != PlacementState::Active {
            return;
        }
        let runs = self.store.runs(&a.scope, session).unwrap_or_default();
        if let Some(last) = runs.last()
            && last.status == RunStatus::Orphaned
        {
            // Stop whatever the worker still does for it; its writes are fenced anyway.
            a.live.send(GatewayFrame::CancelTurn {
                run_id: last.id.clone(),
            });
            if let Err(e) = self
                .start_run_with(
                    &a.scope,
                    session,
                    EntryBody::Notice {
                        text: "The gateway restarted during the previous turn; that turn stopped and is retried as a new turn.".into(),
                    },
                )
                .await
            {
                tracing::warn!(%session, error = %e, "could not retry the orphaned turn");
            }
            return;
        }
        self.hand_over_turn(&a.scope, session);
    }

    /// A worker's connection closed: repair the tunnel, then replace a dead worker or reclaim
    /// a dead box.
    pub(super) fn on_worker_disconnect(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        epoch: u64,
    ) {
        let live = self.workers.live(session);
        if !live.begin_recovery() {
            return;
        }
        let core = self.clone();
        let (scope, session) = (scope.clone(), session.clone());
        tokio::spawn(async move {
            core.recover(&scope, &session, epoch).await;
            core.workers.live(&session).end_recovery();
        });
    }

    async fn recover(self: &Arc<Self>, scope: &Scope, session: &SessionId, epoch: u64) {
        let live = self.workers.live(session);
        let started = std::time::Instant::now();
        let cancel = CancellationToken::new();
        loop {
            if live.connected_epoch() == Some(epoch) {
                return;
            }
            let Ok(Some(p)) = self.store.placement(scope, session) else {
                return;
            };
            if p.owner_epoch != epoch
                || !matches!(
                    p.state,
                    PlacementState::Active | PlacementState::Reconciling
                )
            {
                return;
            }
            let Ok(env) = self.placement_env(scope, &p) else {
                return;
            };
            let Ok(ssh) = self.envs.ssh(&env) else {
                return;
            };
            let _ = self.open_worker_endpoint(&env.id);
            match self.open_tunnel(&env, &ssh, &cancel).await {
                Ok(_) => {}
                Err(e) => {
                    if !self.envs.box_alive(&env).await || started.elapsed() > RECOVERY_DEADLINE {
                        self.reclaim(scope, session, &format!("its box cannot be reached: {e}"))
                            .await;
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            }
            if wait_connected(&live, epoch, RECONNECT_GRACE).await {
                self.audit(
                    scope,
                    "worker.reconnect",
                    session.as_str(),
                    "applied",
                    json!({ "env": env.id.as_str(), "epoch": epoch }),
                );
                return;
            }
            let pid = p.worker_pid.unwrap_or(0);
            match ssh
                .run(
                    &format!("kill -0 {pid} 2>/dev/null && echo alive || echo dead"),
                    &cancel,
                )
                .await
            {
                Ok(out) if out.trim() == "dead" => {
                    if let Err(e) = self.replace_worker(scope, session).await {
                        tracing::warn!(%session, error = %e, "could not replace the worker");
                        self.reclaim(
                            scope,
                            session,
                            &format!("a new worker could not start: {e}"),
                        )
                        .await;
                    }
                    return;
                }
                Ok(_) if started.elapsed() < RECOVERY_DEADLINE => continue,
                Ok(_) => {
                    let _ = self.replace_worker(scope, session).await;
                    return;
                }
                Err(e) => {
                    if !self.envs.box_alive(&env).await {
                        self.reclaim(scope, session, &format!("its box stopped: {e}"))
                            .await;
                        return;
                    }
                }
            }
        }
    }

    /// A new worker on the same box under a new owner epoch; the old one is fenced.
    async fn replace_worker(self: &Arc<Self>, scope: &Scope, session: &SessionId) -> Result<()> {
        let p = self.place(
            scope,
            session,
            PlacementState::Starting,
            &PlacementChange {
                advance_epoch: true,
                ..Default::default()
            },
            "the worker stopped; starting a new one (the old one is fenced)",
        )?;
        self.cancel_model_calls(session);
        self.audit(
            scope,
            "worker.replace",
            session.as_str(),
            "applied",
            json!({ "epoch": p.owner_epoch }),
        );
        self.start_worker(scope, &p).await.map(|_| ())
    }

    /// The session's box is gone: keep the conversation, mark the placement reclaimed, tell
    /// the user what was lost, and end the turn that was running there.
    pub(crate) async fn reclaim(&self, scope: &Scope, session: &SessionId, reason: &str) {
        let live = self.workers.live(session);
        // A worker that can still hear it is told to go (explicit close).
        live.send(GatewayFrame::Shutdown {
            reason: reason.to_owned(),
        });
        live.close();
        self.cancel_model_calls(session);
        let p = self.store.placement(scope, session).ok().flatten();
        let env = p.as_ref().and_then(|p| p.environment_id.clone());
        if let Some(env) = &env {
            self.close_worker_endpoint(env);
        }
        if let Err(e) = self.place(
            scope,
            session,
            PlacementState::Reclaimed,
            &PlacementChange {
                error: Some(reason),
                ..Default::default()
            },
            reason,
        ) {
            tracing::warn!(%session, error = %e, "could not reclaim the placement");
        }
        self.audit(
            scope,
            "placement.reclaim",
            session.as_str(),
            "applied",
            json!({ "env": env.as_ref().map(|e| e.as_str()), "reason": reason }),
        );
        let open = self.store.open_run(scope, session).ok().flatten();
        let notice = self.lost_work_notice(
            scope,
            session,
            env.as_ref(),
            open.as_ref().map(|r| &r.id),
            reason,
        );
        let leaf = self.store.leaf(scope, session).ok().flatten();
        if let Ok(entries) = self.store.append_entries(
            scope,
            session,
            leaf.as_ref(),
            open.as_ref().map(|r| &r.id),
            &[EntryBody::Notice {
                text: notice.clone(),
            }],
        ) {
            for entry in entries {
                let _ = self.hub.publish(
                    scope,
                    session,
                    open.as_ref().map(|r| &r.id),
                    EventKind::Entry { entry },
                );
            }
        }
        live.end_all_turns(&format!("the session's box stopped ({reason})"));
        if let Some(env) = env {
            self.envs.abandon(scope, &env, reason).await;
        }
    }

    /// What the user lost with a dead box: the changes the running turn made since the last
    /// checkpoint (every finished turn was reconciled and checkpointed).
    fn lost_work_notice(
        &self,
        scope: &Scope,
        session: &SessionId,
        env: Option<&EnvironmentId>,
        run: Option<&RunId>,
        reason: &str,
    ) -> String {
        let checkpoint = self
            .store
            .artifacts(scope, session, skiff_store::ArtifactRole::Checkpoint)
            .ok()
            .and_then(|a| a.last().and_then(|r| r.seq));
        let mut changes = Vec::new();
        if let (Some(run), Ok(entries)) = (run, self.store.transcript(scope, session)) {
            for entry in entries.iter().filter(|e| e.run_id.as_ref() == Some(run)) {
                if let EntryBody::AssistantMessage { tool_calls, .. } = &entry.body {
                    for call in tool_calls
                        .iter()
                        .filter(|c| matches!(c.name.as_str(), "write" | "edit" | "exec"))
                    {
                        changes.push(format!(
                            "{} {}",
                            call.name,
                            skiff_agent::tools::summary(call)
                        ));
                    }
                }
            }
        }
        let env = env
            .map(|e| e.to_string())
            .unwrap_or_else(|| "its box".into());
        let since = match checkpoint {
            Some(n) => format!("checkpoint {n}"),
            None => "the start of the session".into(),
        };
        let lost = if changes.is_empty() {
            format!("Workspace changes made there since {since} were lost (none were recorded).")
        } else {
            format!(
                "Workspace changes made there since {since} were lost: {}.",
                changes.join("; ")
            )
        };
        format!(
            "The worker box {env} stopped ({reason}). The conversation is intact. {lost} Your next message starts a fresh box from {since}."
        )
    }

    /// At gateway start: placements caught mid-placement failed; active ones get their
    /// endpoint back and wait for their worker to re-attach (repairing the tunnel if needed).
    pub(crate) fn reconcile_placements_on_start(self: &Arc<Self>) -> Result<()> {
        for p in self.store.live_placements()? {
            match p.state {
                PlacementState::Active | PlacementState::Reconciling => {
                    if p.state == PlacementState::Reconciling {
                        self.place(
                            &p.scope,
                            &p.session_id,
                            PlacementState::Active,
                            &PlacementChange::default(),
                            "the gateway restarted during reconciliation",
                        )?;
                    }
                    if let Some(env) = &p.environment_id {
                        self.open_worker_endpoint(env)?;
                    }
                    self.on_worker_disconnect(&p.scope, &p.session_id, p.owner_epoch);
                }
                _ => {
                    let why = "the gateway restarted while placing this session; send a message to try again";
                    self.place(
                        &p.scope,
                        &p.session_id,
                        PlacementState::Failed,
                        &PlacementChange {
                            error: Some(why),
                            ..Default::default()
                        },
                        why,
                    )?;
                }
            }
        }
        Ok(())
    }
}

fn mode_of(workspace: &WorkspaceView) -> Mode {
    match workspace {
        WorkspaceView::Git { .. } => Mode::Git,
        WorkspaceView::Plain { .. } => Mode::Plain,
    }
}

/// Waits until the session's worker of `epoch` is connected, at most `timeout`.
async fn wait_connected(live: &super::Live, epoch: u64, timeout: Duration) -> bool {
    let mut changes = live.watch();
    let wait = async {
        loop {
            if live.connected_epoch() == Some(epoch) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    };
    tokio::time::timeout(timeout, wait).await.is_ok() && live.connected_epoch() == Some(epoch)
}

impl super::Live {
    fn begin_recovery(&self) -> bool {
        let mut r = lock(&self.recovering);
        if *r {
            return false;
        }
        *r = true;
        true
    }

    fn end_recovery(&self) {
        *lock(&self.recovering) = false;
    }
}
