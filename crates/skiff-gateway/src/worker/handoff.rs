//! Live handoff (`dispatch --live`, `pull-back --live`): a session moves while its turn runs,
//! in either direction, and the same run goes on at the new owner as a new attempt.
//!
//! The barrier drains the old owner at a model-step boundary: its current model call and the
//! tool calls of that step finish and are committed, and it is stopped before its next model
//! request. On the gateway the loop asks its backend before every request
//! ([`skiff_agent::SessionBackend::handing_off`]); on a box the inference proxy holds the
//! worker's next model call (every transcript commit is a call the worker waits on, so the
//! step before it is in the store). Then, each step a placement event:
//!
//! - home → box: `local → handing_off` (claimed with a worker slot), the gateway's loop stops,
//!   `→ requested` and the usual placement lays the workspace as it is now onto the box; the
//!   worker takes the run up from the transcript.
//! - box → home: `active → handing_off`; once drained, the worker is stopped on its box and
//!   fenced (`handing_off → handing_off`, a new owner epoch: whatever it still sends is
//!   refused), the box's work is brought back (`reconciling`), `→ local`, the box goes back to
//!   the idle pool, and the gateway's loop takes the run up.
//!
//! A turn that ends before its next model request still moves, at its boundary. A move home
//! that cannot finish leaves the session on its box, where a new worker takes the turn up; a
//! placement that fails brings the session home, where the turn goes on.
//!
//! Deliberately absent: moving a turn straight from one box to another (it comes home first).

use super::Live;
use super::pull_back::Moved;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_protocol::{RunId, SessionId};
use skiff_store::{PlacementChange, PlacementRow, RunRow, Scope, SessionRow};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Where a live move takes the running turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Handoff {
    /// Home to the gateway.
    Home,
    /// Onto a box of this worker profile.
    Profile(String),
}

/// Whether a turn of the session is attended by its run executor now, and the live move of
/// it asked for. One value behind one lock: a move is asked only of a turn still attended,
/// and an executor that stops attending takes whatever was asked, so no ask is ever lost.
#[derive(Clone, Debug, Default)]
pub(crate) struct HandoffState {
    attended: bool,
    asked: Option<Handoff>,
}

/// A step of a move's barrier at which [`BarrierFault`] strikes, in either direction, live
/// or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BarrierStep {
    /// The old owner is drained: home from a box, its next model call held (live) or
    /// admission stopped (at a boundary), the worker not yet stopped; to a box, the gateway's
    /// loop stopped (live) or the slot claimed (at a boundary), nothing placed yet.
    Drained,
    /// Home from a box: the worker is stopped and fenced by a new epoch. To a box: the new
    /// owner holds the session (its worker admitted under the new epoch, `active`) and may
    /// already have taken the turn up: starting a worker hands it the open run.
    Fenced,
    /// Home from a box: the box's work is back (or was already here); the session is not
    /// home yet. A move to a box reconciles nothing inbound and has no such step.
    Reconciled,
    /// Not a move's: a placement's lay-down running behind the worker's start, once the early
    /// word is out and before the workspace appears on the box. Only `hold` strikes here.
    Laying,
}

/// What [`BarrierFault`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultAction {
    /// Kills the worker's process on its box.
    KillWorker,
    /// Closes the SSH connections to the box, the reverse tunnel with them.
    CutTunnel,
    /// The gateway process dies at once (SIGKILL to itself: nothing is cleaned up).
    KillGateway,
    /// The box dies: its provider kills its processes and sshd, unknown to the gateway.
    KillBox,
    /// The lay-down waits there for ever (until the test kills the gateway): `laying` only.
    Hold,
}

/// `[gateway] barrier_fault`: a fault injected at one step of a move's barrier.
///
/// It exists for the fault-injection tests only: a fault that must land between two steps of
/// the barrier cannot be timed from outside the gateway (the steps follow each other within
/// milliseconds), so the gateway itself strikes at the named step. Production configs leave
/// it unset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BarrierFault {
    step: BarrierStep,
    action: FaultAction,
}

impl BarrierFault {
    /// Whether it holds a lay-down behind the worker's start (`laying:hold`).
    pub(crate) fn holds_lay_down(self) -> bool {
        self.step == BarrierStep::Laying
    }

    /// Parses `STEP:ACTION`.
    pub(crate) fn parse(text: &str) -> std::result::Result<BarrierFault, String> {
        let (step, action) = text
            .split_once(':')
            .ok_or_else(|| format!("{text:?} is not STEP:ACTION (e.g. \"fenced:cut-tunnel\")"))?;
        let step = match step {
            "drained" => BarrierStep::Drained,
            "fenced" => BarrierStep::Fenced,
            "reconciled" => BarrierStep::Reconciled,
            "laying" => BarrierStep::Laying,
            other => {
                return Err(format!(
                    "no barrier step {other:?}; steps are drained, fenced, reconciled, laying"
                ));
            }
        };
        let action = match action {
            "kill-worker" => FaultAction::KillWorker,
            "cut-tunnel" => FaultAction::CutTunnel,
            "kill-gateway" => FaultAction::KillGateway,
            "kill-box" => FaultAction::KillBox,
            "hold" => FaultAction::Hold,
            other => {
                return Err(format!(
                    "no fault {other:?}; faults are kill-worker, cut-tunnel, kill-gateway, kill-box, hold"
                ));
            }
        };
        if (step == BarrierStep::Laying) != (action == FaultAction::Hold) {
            return Err(format!(
                "{text:?}: `hold` is the only fault at `laying`, and strikes nowhere else"
            ));
        }
        Ok(BarrierFault { step, action })
    }
}

impl Live {
    /// A run executor attends the session's turn from now on.
    pub(crate) fn attend(&self) {
        self.handoff.send_modify(|h| {
            h.attended = true;
            h.asked = None;
        });
        self.held_call.send_replace(false);
    }

    /// The executor stops attending; returns the move asked for and not made (the turn ended
    /// before its next step).
    pub(crate) fn leave(&self) -> Option<Handoff> {
        let mut asked = None;
        self.handoff.send_modify(|h| {
            h.attended = false;
            asked = h.asked.take();
        });
        self.held_call.send_replace(false);
        asked
    }

    /// Asks the attended turn to move; false when no turn is attended or a move is asked
    /// already.
    fn ask(&self, to: Handoff) -> bool {
        self.handoff.send_if_modified(|h| {
            if !h.attended || h.asked.is_some() {
                return false;
            }
            h.asked = Some(to);
            true
        })
    }

    /// The move asked for, if any.
    pub(crate) fn asked(&self) -> Option<Handoff> {
        self.handoff.borrow().asked.clone()
    }

    /// The move asked for is made: the turn runs at its new owner.
    fn moved(&self) {
        self.handoff.send_modify(|h| h.asked = None);
        self.held_call.send_replace(false);
    }

    /// The inference proxy's question for a worker's new model call: is it held for a move
    /// home? Holding it marks the worker drained.
    pub(super) fn hold_for_handoff(&self) -> bool {
        if self.handoff.borrow().asked != Some(Handoff::Home) {
            return false;
        }
        self.held_call.send_replace(true);
        true
    }

    /// Resolves once a move home is asked and the worker is drained: its next model call is
    /// held, or it is gone (killed, its tunnel cut) and did not come back within the reconnect
    /// grace — it commits nothing more, and the turn goes on from what it committed.
    pub(super) async fn drained(&self) {
        let mut asked = self.handoff.subscribe();
        loop {
            if asked.borrow_and_update().asked == Some(Handoff::Home) {
                break;
            }
            if asked.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
        let mut held = self.held_call.subscribe();
        loop {
            let mut changes = self.watch();
            if *held.borrow_and_update() {
                return;
            }
            if self.connected_epoch().is_none() {
                tokio::select! {
                    () = tokio::time::sleep(super::place::RECONNECT_GRACE) => {
                        if self.connected_epoch().is_none() && !*held.borrow() {
                            return;
                        }
                    }
                    _ = held.changed() => {}
                }
                continue;
            }
            tokio::select! {
                _ = held.changed() => {}
                _ = changes.changed() => {}
            }
        }
    }
}

/// The claims of a live move: they need only the worker side's own handles.
impl super::WorkerSide {
    /// `pull-back --live` of a session whose turn runs on its box (its caller holds the
    /// session's admission lock): `active → handing_off`, and the turn's executor is asked to
    /// bring it home after the current step.
    pub(super) fn claim_live_pull_back(
        &self,
        scope: &Scope,
        id: &SessionId,
        run: &RunRow,
    ) -> Result<Moved> {
        let p = self.store.placement(scope, id)?;
        let Some(p) = p.filter(|p| p.state == PlacementState::Active) else {
            return Err(Error::Conflict(format!(
                "session {id}'s turn is not running on a box now (it is being placed, reconciled or moved); try again in a moment, or pull back without --live"
            )));
        };
        let live = self.live(id);
        if live.asked().is_some() {
            return Err(Error::Conflict(format!(
                "session {id} is already being moved with its turn"
            )));
        }
        let cursor = self.store.last_event_cursor(scope, id)?;
        let env = p
            .environment_id
            .as_ref()
            .map_or("its box".to_owned(), |e| e.to_string());
        let detail = format!(
            "handing the running turn home: no new turns; its current model step and tool calls finish on {env}, then the worker of epoch {} stops before its next model call",
            p.owner_epoch
        );
        self.place(
            scope,
            id,
            PlacementState::HandingOff,
            &PlacementChange::default(),
            &detail,
        )?;
        if !live.ask(Handoff::Home) {
            // The turn ended between the check and the ask: nothing moves.
            self.place(
                scope,
                id,
                PlacementState::Active,
                &PlacementChange::default(),
                "the turn ended before it could be moved; the session stays on its box",
            )?;
            return Err(Error::Conflict(format!(
                "session {id}'s turn ended before it could be moved; pull it back without --live"
            )));
        }
        self.audit(
            scope,
            "placement.handoff",
            id.as_str(),
            "allowed",
            json!({ "to": "gateway", "run": run.id.as_str(), "epoch": p.owner_epoch }),
        );
        Ok(Moved {
            moved: true,
            message: detail,
            after_cursor: cursor,
        })
    }

    /// `dispatch --live` of a session whose turn runs on the gateway (its caller holds the
    /// session's admission lock): `local → handing_off` with a worker slot claimed, and the
    /// turn's loop is asked to stop before its next model request.
    pub(super) async fn claim_live_dispatch(
        &self,
        scope: &Scope,
        id: &SessionId,
        run: &RunRow,
        profile: &str,
    ) -> Result<Moved> {
        self.check_profile(profile)?;
        let live = self.live(id);
        if live.asked().is_some() {
            return Err(Error::Conflict(format!(
                "session {id} is already being moved with its turn"
            )));
        }
        let cursor = self.store.last_event_cursor(scope, id)?;
        self.claim_worker_slot(|max| {
            self.store
                .claim_live_dispatch(scope, id, &run.id, profile, max)
        })
        .await?;
        let detail = format!(
            "dispatching with the turn running: no new turns; the gateway's current model step and tool calls finish, then the same turn goes on on a box of profile {profile}"
        );
        self.publish_step(
            scope,
            id,
            Some(&run.id),
            PlacementState::HandingOff,
            &detail,
        );
        if !live.ask(Handoff::Profile(profile.to_owned())) {
            self.store.come_home(scope, id)?;
            self.publish_step(
                scope,
                id,
                Some(&run.id),
                PlacementState::Local,
                "the turn ended before it could be moved; the session stays on the gateway",
            );
            return Err(Error::Conflict(format!(
                "session {id}'s turn is not running now (it is starting or has ended); dispatch it without --live"
            )));
        }
        self.audit(
            scope,
            "session.dispatch",
            id.as_str(),
            "allowed",
            json!({ "profile": profile, "live": true, "run": run.id.as_str() }),
        );
        Ok(Moved {
            moved: true,
            message: detail,
            after_cursor: cursor,
        })
    }

    /// The gateway's loop stopped for a live dispatch: place the session on `profile` and
    /// hand the run to its worker. On failure the session comes home (the error says why)
    /// and the turn goes on here.
    pub(crate) async fn hand_off_to_box(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunId,
        profile: &str,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let live = self.live(&session.id);
        self.strike_now(scope, &session.id, BarrierStep::Drained)
            .await;
        let placed = async {
            self.place(
                scope,
                &session.id,
                PlacementState::Requested,
                &PlacementChange::default(),
                &format!(
                    "the gateway's loop stopped before its next model call, its step committed; placing the session on profile {profile}"
                ),
            )?;
            let p = self.ensure_worker(scope, session, cancel).await?;
            self.strike(scope, &p, BarrierStep::Fenced).await;
            Ok(p)
        }
        .await;
        live.moved();
        match placed {
            Ok(_) => Ok(()),
            Err(e) => {
                // `failed` (the placement said why) or still `handing_off`: home either way.
                if let Err(home) = self.store.come_home(scope, &session.id) {
                    tracing::warn!(session = %session.id, error = %home, "could not bring a failed live dispatch home");
                }
                self.publish_step(
                    scope,
                    &session.id,
                    Some(run),
                    PlacementState::Local,
                    &format!("the live dispatch failed ({e}); the turn goes on on the gateway"),
                );
                Err(e)
            }
        }
    }

    /// A live move asked for as the turn ended, before its next step: made at the boundary.
    pub(crate) async fn move_at_boundary(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        to: Handoff,
    ) {
        let id = &session.id;
        let state = match self.store.placement(scope, id) {
            Ok(p) => p.map(|p| p.state),
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "cannot read the placement of a move at the boundary");
                return;
            }
        };
        match (to, state) {
            (Handoff::Home, Some(PlacementState::Active | PlacementState::HandingOff)) => {
                if let Err(e) = self.hand_off_home(scope, id, None).await {
                    tracing::warn!(session = %id, error = %e, "the pull-back at the turn's end stopped");
                }
            }
            (Handoff::Profile(profile), Some(PlacementState::HandingOff)) => {
                // The run ends now; the placement goes on in the background, as a dispatch
                // without a message does (a message sent meanwhile waits for its worker).
                let workers = self.clone();
                let (scope, session) = (scope.clone(), session.clone());
                tokio::spawn(async move {
                    let placed = workers.place(
                        &scope,
                        &session.id,
                        PlacementState::Requested,
                        &PlacementChange::default(),
                        &format!(
                            "the turn ended on the gateway before its next model call; placing the session on profile {profile}"
                        ),
                    );
                    let placed = match placed {
                        Ok(_) => workers
                            .ensure_worker(&scope, &session, &CancellationToken::new())
                            .await
                            .map(|_| ()),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = placed {
                        tracing::warn!(session = %session.id, error = %e, "the dispatch at the turn's end failed");
                    }
                });
            }
            (to, state) => {
                tracing::debug!(session = %id, ?to, ?state, "nothing to move at the turn's end");
            }
        }
    }

    /// The barrier of a move home, its worker drained (or its turn over): the worker stopped
    /// and fenced, the box's work brought back, home, the box given back. A barrier that
    /// cannot finish leaves the session on its box (`active`, its worker stopped) and says
    /// why. `run` is the run that goes on at home, if any.
    pub(crate) async fn hand_off_home(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        run: Option<&RunId>,
    ) -> Result<()> {
        let started = std::time::Instant::now();
        let live = self.live(id);
        let result = self.barrier_home(scope, id, run, started).await;
        live.moved();
        if let Err(e) = &result {
            let why = e.to_string();
            let detail = format!(
                "the live pull-back stopped: {why}. The session stays on its box, where a new worker takes the turn up"
            );
            if let Err(e) = self.place(
                scope,
                id,
                PlacementState::Active,
                &PlacementChange {
                    error: Some(&why),
                    ..Default::default()
                },
                &detail,
            ) {
                tracing::warn!(session = %id, error = %e, "could not record a stopped live pull-back");
            }
        }
        result
    }

    async fn barrier_home(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        run: Option<&RunId>,
        started: std::time::Instant,
    ) -> Result<()> {
        let live = self.live(id);
        let mut p = self
            .store
            .placement(scope, id)?
            .ok_or_else(|| Error::Conflict(format!("session {id} has no placement")))?;
        if p.state == PlacementState::Active {
            // The turn ended on the box first; its reconciliation took the placement back.
            p = self.place(
                scope,
                id,
                PlacementState::HandingOff,
                &PlacementChange::default(),
                "the turn ended on the box before its next model call; bringing the session home at the boundary",
            )?;
        }
        let epoch = p.owner_epoch;
        self.strike(scope, &p, BarrierStep::Drained).await;
        live.stop_epoch(epoch, "the session is handed off to the gateway");
        self.cancel_model_calls(id);
        let env = self.placement_env(scope, &p)?;
        let how = match self.stop_worker_on_box(&env, p.worker_pid).await {
            Ok(()) => "stopped, with the commands its tools started".to_owned(),
            Err(e) => format!("could not be confirmed stopped ({e})"),
        };
        p = self.place(
            scope,
            id,
            PlacementState::HandingOff,
            &PlacementChange {
                advance_epoch: true,
                ..Default::default()
            },
            &format!(
                "drained: the worker of epoch {epoch} {how}; epoch {} fences it: whatever it still sends is refused",
                epoch + 1
            ),
        )?;
        self.strike(scope, &p, BarrierStep::Fenced).await;
        let reconciled = !p.box_in_step;
        if reconciled {
            self.place(
                scope,
                id,
                PlacementState::Reconciling,
                &PlacementChange::default(),
                "the box holds work of this turn the gateway does not have yet; bringing it back",
            )?;
            self.capture_box_work(scope, id).await.map_err(|e| {
                Error::BoxFailed(format!("the box's work could not be brought back: {e}"))
            })?;
        }
        self.strike(scope, &p, BarrierStep::Reconciled).await;
        let was = self.store.come_home(scope, id)?;
        let (pooled, the_box, work) = self.box_home(scope, id, &was, reconciled).await;
        let goes_on = if run.is_some() {
            "the turn goes on on the gateway"
        } else {
            "the session runs on the gateway from now on"
        };
        let detail = format!(
            "home in {:.1} s: {goes_on}; {work}; {the_box}",
            started.elapsed().as_secs_f64()
        );
        self.publish_step(scope, id, run, PlacementState::Local, &detail);
        self.audit(
            scope,
            "placement.handoff",
            id.as_str(),
            "applied",
            json!({
                "to": "gateway",
                "env": was.environment_id.as_ref().map(|e| e.as_str()),
                "epoch": epoch,
                "run": run.map(RunId::as_str),
                "box": pooled.map(|pooled| if pooled { "idle" } else { "destroyed" }),
            }),
        );
        Ok(())
    }

    /// Publishes a step of a move, carried by `run` so a client following the run sees it.
    fn publish_step(
        &self,
        scope: &Scope,
        id: &SessionId,
        run: Option<&RunId>,
        state: PlacementState,
        detail: &str,
    ) {
        tracing::info!(session = %id, placement = %state, detail, "placement");
        let environment_id = self
            .store
            .placement(scope, id)
            .ok()
            .flatten()
            .and_then(|p| p.environment_id);
        let event = EventKind::Placement {
            state,
            environment_id,
            detail: detail.to_owned(),
        };
        if let Err(e) = self.hub.publish(scope, id, run, event) {
            tracing::warn!(session = %id, error = %e, "could not publish a handoff step");
        }
    }

    /// Every injected fault is audited before it strikes (the row outlives a killed gateway).
    fn audit_fault(&self, scope: &Scope, id: &SessionId, fault: BarrierFault) {
        self.audit(
            scope,
            "barrier.fault",
            id.as_str(),
            "applied",
            json!({
                "step": format!("{:?}", fault.step).to_lowercase(),
                "action": format!("{:?}", fault.action),
            }),
        );
    }

    /// `[gateway] barrier_fault`: strikes when the barrier reaches its step (tests only).
    async fn strike(&self, scope: &Scope, p: &PlacementRow, step: BarrierStep) {
        let Some(fault) = self.barrier_fault.filter(|f| f.step == step) else {
            return;
        };
        tracing::warn!(session = %p.session_id, ?step, action = ?fault.action, "barrier_fault strikes");
        self.audit_fault(scope, &p.session_id, fault);
        if fault.action == FaultAction::KillGateway {
            kill_this_gateway();
        }
        let Ok(env) = self.placement_env(scope, p) else {
            return;
        };
        if fault.action == FaultAction::KillBox {
            if let Err(e) = self.envs.kill_box_for_fault(&env).await {
                tracing::warn!(session = %p.session_id, error = %e, "barrier_fault could not kill the box");
            }
            return;
        }
        let Ok(ssh) = self.envs.ssh(&env) else {
            return;
        };
        match fault.action {
            FaultAction::KillWorker => {
                let Some(pid) = p.worker_pid.filter(|pid| *pid > 0) else {
                    return;
                };
                if let Err(e) = ssh
                    .run(
                        &format!("kill -KILL {pid} 2>/dev/null; true"),
                        &CancellationToken::new(),
                    )
                    .await
                {
                    tracing::warn!(session = %p.session_id, error = %e, "barrier_fault could not kill the worker");
                }
            }
            FaultAction::CutTunnel => ssh.close().await,
            FaultAction::KillGateway | FaultAction::KillBox | FaultAction::Hold => {}
        }
    }

    /// `[gateway] barrier_fault`: strikes when the barrier reaches its step (tests only).
    /// Reads the placement as it is now (the box, the worker).
    pub(super) async fn strike_now(&self, scope: &Scope, id: &SessionId, step: BarrierStep) {
        if self.barrier_fault.is_none_or(|f| f.step != step) {
            return;
        }
        match self.store.placement(scope, id) {
            Ok(Some(p)) => self.strike(scope, &p, step).await,
            Ok(None) => self.strike_without_box(scope, id, step),
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "barrier_fault cannot read the placement")
            }
        }
    }

    /// A fault at a step where the session holds no box: only the gateway can die there.
    fn strike_without_box(&self, scope: &Scope, id: &SessionId, step: BarrierStep) {
        if let Some(fault) = self.barrier_fault.filter(|f| f.step == step)
            && fault.action == FaultAction::KillGateway
        {
            tracing::warn!(session = %id, ?step, "barrier_fault kills the gateway");
            self.audit_fault(scope, id, fault);
            kill_this_gateway();
        }
    }
}

/// The gateway dies where it stands, as a crash or `kill -9` would end it: no shutdown path,
/// no destructor, nothing flushed but what is already in the store.
fn kill_this_gateway() {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    // SIGKILL is not delivered synchronously everywhere; nothing after this point may run.
    std::process::abort();
}
