//! The placement of a worker session, driven as far as it needs to go: lease (or reuse) a box,
//! lay the workspace onto it, open the tunnel, start `skiff worker` with a fresh credential,
//! and wait for its admission and the readiness canary. Turns are in `turn.rs`, keeping the
//! worker alive in `recover.rs`.

use super::LayDown;
use crate::environments::SnapshotKey;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::ModelRef;
use skiff_protocol::worker::{GatewayFrame, Method};
use skiff_store::{PlacementChange, PlacementRow, Scope, SessionRow};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::outbound::{self, Outbound};
use skiff_sync::{Remote, Rules, manifest};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedMutexGuard, oneshot};
use tokio_util::sync::CancellationToken;

/// What a lay-down put (or is putting) on the box: the base manifest (JSON), the files and
/// bytes listed, and what the rules left out.
type Synced = (String, usize, u64, skiff_sync::filelist::LeftOut);

/// How long a started worker has to connect and pass the canary.
const ADMISSION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a dropped worker has to come back before the gateway looks for evidence.
pub(super) const RECONNECT_GRACE: Duration = Duration::from_secs(3);
/// How long the gateway keeps trying to reach a box it believes alive.
pub(super) const RECOVERY_DEADLINE: Duration = Duration::from_secs(60);

/// The session's workspace on the box, relative to the box user's home.
pub(crate) fn box_workspace(session: &SessionId) -> String {
    format!("workspaces/{session}")
}

/// Where a box whose home already holds a setup's result came from.
enum Prepared {
    /// The session's own previous box, which kept its workspace while it was parked (and,
    /// with a setup, holds that setup's result).
    Own,
    /// A warm box from the idle pool on which the same setup ran.
    Pool,
    /// A warm box from the idle pool whose home was restored from the setup's snapshot.
    Restored(skiff_protocol::SnapshotId),
    /// A new box made from the setup's snapshot.
    Snapshot(skiff_protocol::SnapshotId),
}

/// Author identity of commits made on boxes.
const BOX_AUTHOR: (&str, &str) = ("Skiff agent", "agent@skiff.invalid");

impl super::WorkerSide {
    /// Makes sure the session has an admitted, ready worker; drives the placement as far as
    /// needed. Waits for whoever drives it now (a dispatch without a message): a turn sent
    /// while its session is being placed runs on the worker that placement starts.
    pub(crate) async fn ensure_worker(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        cancel: &CancellationToken,
    ) -> Result<PlacementRow> {
        let placing = self.live(&session.id).placing.clone();
        let _placing = placing.lock_owned().await;
        self.drive_placement(scope, session, cancel, None).await
    }

    /// [`ensure_worker`](Self::ensure_worker) for a turn of `run_turn_on_worker`, which waits
    /// for the worker's end of the turn: a git-mode lay-down without setup may run behind the
    /// worker's start (see `drive_placement`).
    pub(crate) async fn ensure_worker_for_turn(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        cancel: &CancellationToken,
    ) -> Result<PlacementRow> {
        let placing = self.live(&session.id).placing.clone();
        let placing = placing.lock_owned().await;
        self.drive_placement(scope, session, cancel, Some(placing))
            .await
    }

    /// [`WorkerSide::ensure_worker`](super::WorkerSide::ensure_worker) for a caller that holds the session's `placing` lock.
    pub(super) async fn ensure_worker_locked(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        cancel: &CancellationToken,
    ) -> Result<PlacementRow> {
        self.drive_placement(scope, session, cancel, None).await
    }

    /// Drives the placement. With `placing` (the session's lock, held by
    /// `ensure_worker_for_turn`), a git-mode lay-down without setup runs behind the worker's start:
    /// the lock goes with it, so nothing else drives or moves the placement (a recovery, a
    /// pull-back) before the box holds the whole workspace.
    async fn drive_placement(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        cancel: &CancellationToken,
        mut placing: Option<OwnedMutexGuard<()>>,
    ) -> Result<PlacementRow> {
        let id = &session.id;
        let mut p = self
            .store
            .placement(scope, id)?
            .ok_or_else(|| Error::Conflict(format!("session {id} is not placed on a worker")))?;
        let live = self.live(id);
        if p.state == PlacementState::Active {
            if live.connected_epoch() == Some(p.owner_epoch) {
                return Ok(p);
            }
            // Probably a blip being repaired; give it a moment before replacing the worker.
            if wait_connected(&live, p.owner_epoch, RECONNECT_GRACE * 2).await {
                return Ok(p);
            }
            self.stop_before_fencing(scope, &p).await;
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
        if matches!(
            p.state,
            PlacementState::Parked
                | PlacementState::Reclaimed
                | PlacementState::FailedOver
                | PlacementState::Failed
        ) {
            // Usually claimed when the message was sent; here when a turn was admitted while
            // the session was being parked, for a retried turn, or for a failover's new
            // attempt. Followers see the claim like every other move.
            p = self.claim_again(scope, &p).await?;
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
        // What setup this placement runs decides which box it wants: one prepared by the same
        // setup (a snapshot) when there is one.
        let mut setup = None;
        let mut prepared = None;
        if matches!(
            p.state,
            PlacementState::Provisioning | PlacementState::Syncing
        ) {
            // The bundle is part of a prepared box's key.
            self.envs.warm_bundle().await;
            // The plan reads `.skiff/setup.sh` and the key files from the workspace: a worktree
            // still filling in the background would say there is none. Without any, the box is
            // leased while the worktree fills (the lay-down waits for the fill itself).
            if self.setup_reads_workspace(session, &p.profile).await
                && let Err(e) = self.workspace_ready(&session.id).await
            {
                let why = "the session's workspace could not be written";
                return Err(self.fail_placement(scope, &p, e, why).await);
            }
            setup = match self.setup_plan(session, &p.profile) {
                Ok(plan) => plan,
                Err(e) => {
                    let why = "the profile's setup cannot run";
                    return Err(self.fail_placement(scope, &p, e, why).await);
                }
            };
        }
        if p.state == PlacementState::Provisioning {
            let (env, from) = match self
                .acquire_for_setup(scope, id, &p.profile, setup.as_ref())
                .await
            {
                Ok(got) => got,
                Err(e) => return Err(self.fail_placement(scope, &p, e, "no box").await),
            };
            prepared = from;
            let from = match &prepared {
                Some(Prepared::Own) => {
                    " (its own previous box, which kept its workspace)".to_owned()
                }
                Some(Prepared::Pool) => " (a box this setup already prepared)".to_owned(),
                Some(Prepared::Restored(s)) => format!(" (a warm box, its home restored from {s})"),
                Some(Prepared::Snapshot(s)) => format!(" (a box prepared by setup, from {s})"),
                None => String::new(),
            };
            p = self.place(
                scope,
                id,
                PlacementState::Syncing,
                &PlacementChange {
                    environment_id: Some(&env),
                    ..Default::default()
                },
                &format!("laying the workspace onto {env}{from}"),
            )?;
        }
        if p.state == PlacementState::Syncing {
            // Nothing runs on the box before the worker (no setup) and a turn waits: the turn's
            // first model call need not wait for the box's checkout.
            let behind = if setup.is_none() && mode_of(&session.workspace) == Mode::Git {
                placing.take()
            } else {
                None
            };
            let synced = match behind {
                Some(guard) => self.sync_behind(scope, session, &p, cancel, guard).await,
                None => self
                    .sync_out(scope, session, &p, cancel, None)
                    .await
                    .map(|synced| (synced, false)),
            };
            match synced {
                Ok(((base, files, bytes, left_out), behind)) => {
                    let bundle = self.envs.bundle_hash_now();
                    // Nothing is left behind silently: the step says what the rules kept out.
                    let left_out = left_out
                        .summary()
                        .unwrap_or_else(|| "nothing left out".into());
                    // A prepared box runs `.skiff/maintain.sh` (if any) instead of setup. The
                    // session's own box counts as prepared only when that setup's result is
                    // in its home.
                    if matches!(prepared, Some(Prepared::Own)) {
                        let env = self.placement_env(scope, &p)?;
                        let key = setup.as_ref().map(|plan| plan.key.as_str());
                        if key.is_some() && env.prepared_key.as_deref() != key {
                            prepared = None;
                        }
                    }
                    let skipped = prepared.is_some() && setup.is_some();
                    let setup = match prepared {
                        Some(_) => setup.and_then(super::setup::SetupPlan::maintenance),
                        None => setup,
                    };
                    let size = skiff_sync::filelist::human(bytes);
                    let on_box = if behind {
                        format!(
                            "{files} files ({size}) going onto the box, {left_out}; the worker starts meanwhile and its tools wait for them"
                        )
                    } else {
                        format!("{files} files ({size}) on the box, {left_out}")
                    };
                    let (next, detail) = match &setup {
                        Some(plan) => (
                            PlacementState::Setup,
                            format!("{on_box}; running {}", plan.label),
                        ),
                        None if skipped => (
                            PlacementState::Starting,
                            format!(
                                "{on_box}; setup already done on this prepared box; starting the worker"
                            ),
                        ),
                        None => (
                            PlacementState::Starting,
                            format!("{on_box}; starting the worker"),
                        ),
                    };
                    p = self.place(
                        scope,
                        id,
                        next,
                        &PlacementChange {
                            advance_epoch: next == PlacementState::Starting,
                            base_manifest: Some(&base),
                            bundle_hash: bundle.as_deref(),
                            left_out: Some(&left_out),
                            // The box holds what the gateway just laid down.
                            box_in_step: Some(true),
                            ..Default::default()
                        },
                        &detail,
                    )?;
                    if let Some(plan) = setup {
                        p = self
                            .set_up(scope, &p, plan, prepared.is_none(), cancel)
                            .await?;
                    }
                }
                Err(e) => {
                    let why = "the workspace could not be laid onto the box";
                    return Err(self.fail_placement(scope, &p, e, why).await);
                }
            }
        }
        if p.state == PlacementState::Starting {
            match self.start_worker(scope, &p).await {
                Ok(row) => p = row,
                Err(e) => {
                    let why = "the worker did not become ready";
                    return Err(self.fail_placement(scope, &p, e, why).await);
                }
            }
        }
        if p.state != PlacementState::Active {
            return Err(Error::Conflict(format!(
                "session {id} is {}; it cannot run a turn now",
                p.state
            )));
        }
        Ok(p)
    }

    /// Runs the box's setup behind the egress proxy, closes the proxy's forward (proven from
    /// the box), and moves the placement on to `starting`; or fails it with the setup log's
    /// last lines.
    async fn set_up(
        &self,
        scope: &Scope,
        p: &PlacementRow,
        plan: super::setup::SetupPlan,
        keep_prepared: bool,
        cancel: &CancellationToken,
    ) -> Result<PlacementRow> {
        let env = self.placement_env(scope, p)?;
        let ran = async {
            let proxy = self
                .open_egress(&env, &p.profile, crate::egress::Phase::Setup, cancel)
                .await?
                .unwrap_or_default();
            let plan = plan.with_env(proxy);
            let outcome = self.run_setup(scope, p, &plan, cancel).await;
            // Closed whatever setup did, before anything else runs on the box.
            self.close_setup_egress(&env, cancel).await?;
            outcome.map(|o| (plan, o))
        };
        let (plan, outcome) = match ran.await {
            Ok(done) => done,
            Err(e) => {
                self.close_egress_gate(&env.id);
                let why = "the box's setup could not run";
                return Err(self.fail_placement(scope, p, e, why).await);
            }
        };
        if !outcome.succeeded() {
            let e = Error::BoxNotReady(outcome.failure(&plan, &p.session_id));
            return Err(self.fail_placement(scope, p, e, "setup failed").await);
        }
        // The box holds this setup's result now: a later session with the same setup that
        // finds it in the pool skips setup.
        self.store
            .set_environment_prepared(scope, &env.id, Some(&plan.key))?;
        // The prepared box is kept (its home, not the workspace) for the next session with
        // the same setup; a box that cannot be kept only costs the next one a setup.
        let mut kept = String::new();
        if keep_prepared && let Some(key) = SnapshotKey::parse(&plan.key) {
            match self.envs.snapshot_box(scope, &env.id, &key).await {
                Ok(Some(snapshot)) => kept = format!("; the prepared box is kept as {snapshot}"),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(env = %env.id, error = %e, "could not keep the prepared box");
                    kept = format!("; the prepared box could not be kept ({e})");
                }
            }
        }
        self.place(
            scope,
            &p.session_id,
            PlacementState::Starting,
            &PlacementChange {
                advance_epoch: true,
                ..Default::default()
            },
            &format!(
                "{} finished in {:.1} s{kept}; starting the worker",
                plan.label,
                outcome.duration.as_secs_f64()
            ),
        )
    }

    /// [`sync_out`](Self::sync_out) in a task of its own that holds `placing` until the box
    /// holds the whole workspace. Returns as soon as the base manifest is made and every check
    /// passed (`true`: the box is still laying the workspace down; the worker's turns hear how
    /// that ends, see [`LayDown`]), or when the lay-down ended without that early word (`false`:
    /// a kept workspace resumed, a top-level `AGENTS.md`, or a failure).
    async fn sync_behind(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        p: &PlacementRow,
        cancel: &CancellationToken,
        placing: OwnedMutexGuard<()>,
    ) -> Result<(Synced, bool)> {
        let (planned_tx, planned) = oneshot::channel();
        let this = self.clone();
        let (scope, session, p, cancel) =
            (scope.clone(), session.clone(), p.clone(), cancel.clone());
        let task = tokio::spawn(async move {
            let _placing = placing;
            let live = this.live(&session.id);
            let (early_tx, early) = oneshot::channel();
            // The lay-down counts as running before anyone hears it may be used, and is
            // recorded for a restart first (the placement may go `active` before it ends). One
            // that cannot be recorded is not used early: the placement waits for its end.
            let forward = async {
                match (early.await, p.environment_id.as_ref()) {
                    (Ok(early), Some(env)) => match this.record_lay_down(&session.id, env) {
                        Ok(()) => {
                            live.lay_down_running();
                            planned_tx.send(early).is_ok()
                        }
                        Err(e) => {
                            tracing::warn!(session = %session.id, error = %e, "the lay-down goes on before the worker starts");
                            false
                        }
                    },
                    _ => false,
                }
            };
            let (synced, behind) = tokio::join!(
                this.sync_out(&scope, &session, &p, &cancel, Some(early_tx)),
                forward
            );
            if synced.is_ok() {
                this.forget_lay_down(&session.id);
            }
            if behind {
                let outcome = synced.as_ref().map(|_| ()).map_err(|e| e.to_string());
                match &outcome {
                    Ok(()) => {
                        tracing::debug!(session = %session.id, "the workspace is laid onto the box behind the worker's start")
                    }
                    Err(e) => {
                        tracing::warn!(session = %session.id, error = %e, "the workspace could not be laid onto the box behind the worker's start")
                    }
                }
                live.set_lay_down(LayDown::Ended(outcome.clone()));
                live.send(GatewayFrame::WorkspaceLaid {
                    error: outcome.err(),
                });
            }
            synced
        });
        match planned.await {
            Ok(planned) => {
                let base = manifest::to_json(&planned.manifest)?;
                Ok(((base, planned.files, planned.bytes, planned.left_out), true))
            }
            Err(_) => match task.await {
                Ok(synced) => synced.map(|synced| (synced, false)),
                Err(e) => Err(Error::Internal(format!("the lay-down stopped: {e}"))),
            },
        }
    }

    async fn sync_out(
        &self,
        scope: &Scope,
        session: &SessionRow,
        p: &PlacementRow,
        cancel: &CancellationToken,
        early: Option<oneshot::Sender<outbound::Planned>>,
    ) -> Result<Synced> {
        let early = early.map(|to| outbound::Early {
            to,
            hold: self
                .barrier_fault
                .is_some_and(|f| f.holds_lay_down())
                .then(|| Box::pin(std::future::pending()) as _),
        });
        // A new lay-down: whatever the last one of this session said is over.
        self.live(&session.id).set_lay_down(LayDown::Before);
        let env = self.placement_env(scope, p)?;
        let ssh = self.envs.ssh(&env)?;
        let remote = Remote::new(ssh, &box_workspace(&session.id))?;
        let local = Path::new(session.workspace.path());
        // The placement may run while the worktree is still being filled (the lay-down waits
        // for the fill before it lists): a `.skiffignore` the fill writes is waited for.
        if self
            .fills
            .writes_root_entry(&session.id, local, skiff_sync::rules::FILE)
            .await
            == Some(true)
        {
            self.workspace_ready(&session.id).await?;
        }
        let rules = Rules::load(local)?;
        let scratch = self.tmp();
        let out = Outbound {
            local,
            mode: mode_of(&session.workspace),
            session: session.id.as_str(),
            rules: &rules,
            limits: &Limits::default(),
            scratch: &scratch,
            identity: Some(BOX_AUTHOR),
            history: match self.envs.history(&p.profile) {
                skiff_providers::History::Shallow => outbound::History::Shallow,
                skiff_providers::History::Full => outbound::History::Full,
            },
        };
        // The session's workspace kept on this box when it was parked serves when it can;
        // anything else the box keeps goes before another workspace is laid down.
        let kept = self.take_kept(&session.id).filter(|k| k.env == env.id);
        let mut resumed = None;
        if let Some(kept) = &kept {
            self.workspace_ready(&session.id).await?;
            let old = manifest::from_json(&kept.manifest)?;
            let dir = super::park::kept_dir(&session.id);
            let from = outbound::Kept {
                dir: &dir,
                manifest: &old,
            };
            resumed = outbound::resume(&out, &remote, &from, cancel).await?;
        }
        let (sent, how) = match resumed {
            Some(sent) => (sent, "resumed"),
            None => {
                // What the box keeps goes in the lay-down's own round trip. A new session's
                // worktree may still be filling: the box lays its base commit down meanwhile,
                // and the listing waits only for the files (its base is recorded meanwhile;
                // the turn is handed over once it is).
                let ready = self.fills.written(&session.id);
                let clear = super::park::clear_kept_script();
                let sent =
                    outbound::push_after(&out, &remote, &clear, ready, early, cancel).await?;
                (sent, "laid down")
            }
        };
        let base = manifest::to_json(&sent.manifest)?;
        self.audit(
            scope,
            "sync.outbound",
            session.id.as_str(),
            "applied",
            json!({ "env": env.id.as_str(), "files": sent.files, "bytes": sent.bytes, "workspace": how }),
        );
        Ok((base, sent.files, sent.bytes, sent.left_out))
    }

    /// Opens the tunnel, starts a worker for the placement's epoch, and waits until it is
    /// admitted and has passed the readiness canary.
    pub(super) async fn start_worker(
        self: &Arc<Self>,
        scope: &Scope,
        p: &PlacementRow,
    ) -> Result<PlacementRow> {
        let session = &p.session_id;
        let env = self.placement_env(scope, p)?;
        let epoch = p.owner_epoch;
        // The agent's `exec` reaches the network only if the profile says so (`egress.agent`).
        self.open_egress(
            &env,
            &p.profile,
            crate::egress::Phase::Agent,
            &CancellationToken::new(),
        )
        .await?;
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
        // The box is in use from now on (its idle time counts from here).
        self.store.touch_environment(scope, &env.id)?;
        // What the session starts from is recorded before its turn can change anything.
        self.workspace_ready(session).await?;
        // Only to a turn attended here: a run taken over from a gateway that died is handed
        // over by its new attempt, which must be waiting for its end first.
        if self.live(session).attending() {
            self.hand_over_turn(scope, session)?;
        }
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
            .ok_or_else(|| Error::Unavailable("the gateway's bundle is not known yet".into()))?;
        let host_key = self.envs.host_key(env).ok_or_else(|| {
            Error::Internal(format!("environment {} has no pinned host key", env.id))
        })?;
        let (credential, _) =
            self.mint_worker_credential(&env.id, &host_key, &bundle, session, epoch, methods)?;
        let live = self.live(session);
        live.close();
        let egress: String = self
            .agent_egress_env(&env.id)
            .iter()
            .map(|(k, v)| format!(" {k}={}", skiff_ssh::shell_quote(v)))
            .collect();
        let launch = format!(
            "set -e; umask 077; mkdir -p \"$HOME/.skiff\"; c=\"$HOME/.skiff/credential.$$\"; cat > \"$c\"; \
             nohup setsid env -i HOME=\"$HOME\" USER=\"$(id -un)\" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8{egress} \
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
            Error::BoxNotReady(format!(
                "starting the worker printed {:?}, not a pid",
                pid.trim()
            ))
        })?;
        started(pid)?;
        // A worker that exits before admission fails the start now, not after the timeout:
        // whoever started it decides at once whether to try again.
        let admitted = tokio::select! {
            admitted = wait_connected(&live, epoch, ADMISSION_TIMEOUT) => Ok(admitted),
            () = exited(&ssh, pid) => Err(()),
        };
        if admitted != Ok(true) {
            let log = ssh
                .run(
                    "tail -n 5 \"$HOME/.skiff/worker.log\" 2>/dev/null || true",
                    &cancel,
                )
                .await
                .unwrap_or_default();
            let what = match admitted {
                Err(()) => "exited before it was admitted".to_owned(),
                Ok(_) => format!("was not admitted within {} s", ADMISSION_TIMEOUT.as_secs()),
            };
            return Err(Error::BoxNotReady(format!(
                "the worker on {} {what}; its log ends: {}",
                env.id,
                log.trim()
            )));
        }
        // Readiness is a round trip through the inference proxy, not a process or a socket.
        let nonce = skiff_store::mint()?;
        let answer = live.expect_canary(&nonce);
        live.send(GatewayFrame::Canary {
            nonce: nonce.clone(),
            model: ModelRef::parse(super::CANARY_MODEL)
                .ok_or_else(|| Error::Internal("bad canary model".into()))?,
        });
        let text = tokio::time::timeout(ADMISSION_TIMEOUT, answer)
            .await
            .map_err(|_| {
                Error::BoxNotReady("the worker did not answer the readiness canary".into())
            })?
            .map_err(|_| {
                Error::BoxNotReady("the worker went away during the readiness canary".into())
            })?;
        if text != super::canary_answer(&nonce) {
            return Err(Error::BoxNotReady(
                "the readiness canary came back wrong".into(),
            ));
        }
        Ok(())
    }

    /// Moves the placement and tells the session's subscribers.
    pub(super) fn place(
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
        if to != PlacementState::Local {
            self.end_session_processes(session);
        }
        if change.advance_epoch {
            // INVARIANT: no connection of an older epoch outlives the advance (the event hot
            // path checks epochs per connection).
            self.live(session).close();
        }
        self.publish_move(scope, session, &row, detail);
        Ok(row)
    }

    /// Claims a worker slot again for a session whose placement `p` holds no box (parked,
    /// reclaimed, failed over, failed): `→ requested`, parking a session idle on its box if
    /// that is what it takes, and published like every move.
    pub(crate) async fn claim_again(
        &self,
        scope: &Scope,
        p: &PlacementRow,
    ) -> Result<PlacementRow> {
        let (id, from, profile) = (&p.session_id, p.state, &p.profile);
        let row = self
            .claim_worker_slot(|max| self.store.request_placement(scope, id, profile, max))
            .await?;
        self.publish_move(
            scope,
            id,
            &row,
            &format!("claimed a worker slot on profile {profile} (the placement was {from})"),
        );
        Ok(row)
    }

    /// Tells the session's subscribers of a worker slot claimed with other rows (a new
    /// session's, a child's, an admitted turn's run): the placement as it is now.
    pub(crate) fn publish_claim(&self, scope: &Scope, session: &SessionId, detail: &str) {
        match self.store.placement(scope, session) {
            Ok(Some(row)) => self.publish_move(scope, session, &row, detail),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(%session, error = %e, "could not read the placement a claim made")
            }
        }
    }

    /// Tells the session's subscribers the placement is now `row`'s state.
    pub(crate) fn publish_move(
        &self,
        scope: &Scope,
        session: &SessionId,
        row: &PlacementRow,
        detail: &str,
    ) {
        let event = EventKind::Placement {
            state: row.state,
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
        if let Err(e) = self.hub.publish(scope, session, run.as_ref(), event) {
            tracing::warn!(%session, error = %e, "could not publish a placement move");
        }
        tracing::info!(%session, placement = %row.state, detail, "placement");
    }

    /// The placement failed: record why, and give up the box it had (its state is unknown,
    /// and an attached box nobody uses would be paid for until its TTL). Returns `e`.
    pub(super) async fn fail_placement(
        &self,
        scope: &Scope,
        p: &PlacementRow,
        e: Error,
        detail: &str,
    ) -> Error {
        let why = e.to_string();
        let change = PlacementChange {
            error: Some(&why),
            ..Default::default()
        };
        if let Err(e) = self.place(
            scope,
            &p.session_id,
            PlacementState::Failed,
            &change,
            detail,
        ) {
            tracing::warn!(session = %p.session_id, error = %e, "could not record a failed placement");
        }
        let env = self
            .store
            .placement(scope, &p.session_id)
            .ok()
            .flatten()
            .and_then(|p| p.environment_id);
        if let Some(env) = env {
            self.close_worker_endpoint(&env);
            self.envs
                .abandon(scope, &env, &format!("placing a session failed: {why}"))
                .await;
        }
        e
    }

    /// Makes sure the control connection is up and forwards the box's worker socket to this
    /// gateway's endpoint for the environment. Returns the socket path on the box.
    pub(super) async fn open_tunnel(
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
        let local = self.socket_path(&env.id);
        if let Err(e) = ssh.forward_socket(&remote_socket, &local, cancel).await {
            // An existing forward of the same socket is what we want.
            tracing::debug!(env = %env.id, error = %e, "forward request");
        }
        // A restarted control master lost the agent's egress forward too.
        self.reforward_egress(env, ssh, cancel).await;
        Ok(remote_socket)
    }

    /// A box for a session with `setup`, the cheapest first: a warm one that setup already
    /// prepared, else a warm one with that setup's snapshot restored onto it, else a new one
    /// made from the snapshot, else any box (warm or cold) on which setup will run.
    /// A parked session's own previous box comes first, when it is idle (it kept the
    /// session's workspace).
    async fn acquire_for_setup(
        &self,
        scope: &Scope,
        session: &SessionId,
        profile: &str,
        setup: Option<&super::setup::SetupPlan>,
    ) -> Result<(skiff_protocol::EnvironmentId, Option<Prepared>)> {
        if let Some(own) = self.kept_box(session).await
            && let Some(row) = self.envs.acquire_this(scope, profile, &own).await?
        {
            return Ok((row.id, Some(Prepared::Own)));
        }
        if let Some(plan) = setup {
            if let Some(env) = self
                .envs
                .acquire_prepared(scope, profile, &plan.key)
                .await?
            {
                return Ok((env, Some(Prepared::Pool)));
            }
            if let Some(key) = SnapshotKey::parse(&plan.key) {
                if let Some((env, snapshot)) =
                    self.envs.acquire_restored(scope, profile, &key).await?
                {
                    return Ok((env, Some(Prepared::Restored(snapshot))));
                }
                if let Some((env, snapshot)) = self
                    .envs
                    .acquire_from_snapshot(scope, profile, &key)
                    .await?
                {
                    self.store
                        .set_environment_prepared(scope, &env, Some(&plan.key))?;
                    return Ok((env, Some(Prepared::Snapshot(snapshot))));
                }
            }
        }
        Ok((self.envs.acquire(scope, profile).await?, None))
    }
}

/// Lay-downs running behind their worker's start, one file per session in `<state>/laying/`
/// naming the box, written (as a fill's record is) before the placement can go `active` and
/// removed once the box holds the whole workspace. A gateway killed in between finds the record at its next start
/// (see `reconcile_placements_on_start`): that placement's box lacks its workspace.
impl super::WorkerSide {
    fn lay_downs_dir(&self) -> std::path::PathBuf {
        // A sibling of `<state>/tmp`, which every start sweeps.
        self.tmp_dir.with_file_name("laying")
    }

    fn record_lay_down(
        &self,
        session: &SessionId,
        env: &skiff_protocol::EnvironmentId,
    ) -> Result<()> {
        let dir = self.lay_downs_dir();
        let path = dir.join(session.as_str());
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            std::fs::create_dir_all(&dir)?;
            let part = path.with_extension("part");
            let mut file = std::fs::File::create(&part)?;
            file.write_all(env.as_str().as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&part, &path)
        };
        write().map_err(|e| {
            Error::Internal(format!(
                "cannot record the lay-down in {}: {e}",
                path.display()
            ))
        })
    }

    fn forget_lay_down(&self, session: &SessionId) {
        let path = self.lay_downs_dir().join(session.as_str());
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a lay-down record");
        }
    }

    /// The lay-downs a previous gateway on this state dir did not see finish (session → box).
    pub(super) fn unfinished_lay_downs(
        &self,
    ) -> std::collections::HashMap<SessionId, skiff_protocol::EnvironmentId> {
        let mut out = std::collections::HashMap::new();
        let Ok(dir) = std::fs::read_dir(self.lay_downs_dir()) else {
            return out;
        };
        for entry in dir.flatten() {
            let path = entry.path();
            let session = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(SessionId::parse);
            let env = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| skiff_protocol::EnvironmentId::parse(t.trim()));
            if let (Some(session), Some(env)) = (session, env) {
                out.insert(session, env);
            }
        }
        out
    }

    /// Forgets every lay-down record, once a start settled the placements they were about.
    pub(super) fn forget_lay_downs(&self) {
        if let Ok(dir) = std::fs::read_dir(self.lay_downs_dir()) {
            for entry in dir.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

fn mode_of(workspace: &WorkspaceView) -> Mode {
    match workspace {
        WorkspaceView::Git { .. } => Mode::Git,
        WorkspaceView::Plain { .. } => Mode::Plain,
    }
}

/// Returns once the box says process `pid` is gone (checked twice a second over the control
/// connection; a check that cannot be made counts as "still there").
async fn exited(ssh: &skiff_ssh::Ssh, pid: i64) {
    let probe = format!("kill -0 {pid} 2>/dev/null && echo alive || echo gone");
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(out) = ssh.run(&probe, &CancellationToken::new()).await
            && out.trim() == "gone"
        {
            return;
        }
    }
}

/// Waits until the session's worker of `epoch` is connected, at most `timeout`.
pub(super) async fn wait_connected(live: &super::Live, epoch: u64, timeout: Duration) -> bool {
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
