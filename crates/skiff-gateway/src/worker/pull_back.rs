//! Moving a session between the gateway and a worker on request: `pull-back` brings a worker
//! session home through the migration barrier (DESIGN §7), `dispatch` places a session on a
//! profile now, without a message.
//!
//! The barrier, each step a placement event and the whole audited: admission stopped (the
//! session's `admission` lock held, and `active → draining` claimed in the store only when
//! no turn is open); the worker told to go and its process killed on the box (its tools die
//! with it); the owner epoch advanced, so whatever the old worker still sends is refused;
//! the box's work brought back only when the box holds work the gateway lacks (the usual
//! reconciliation, from `skiff box scan`'s listing); `→ local`; the box cleared and given
//! back to the idle pool, as parking does. A message sent meanwhile waits for the barrier
//! and then runs at home.
//!
//! Both answer once the move is claimed and go on in the background: a client follows the
//! placement events until a settled state. A turn in flight is cancelled first, or the
//! pull-back refused, unless the move is live (`handoff`). Deliberately absent: moving a
//! session on a box straight to another profile (it comes home first).

use super::handoff::BarrierStep;
use super::park::stop_worker_script;
use crate::error::Result;
use futures_util::StreamExt;
use serde_json::json;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::{RunId, SessionId};
use skiff_store::{PlacementChange, PlacementRow, Scope};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;

/// How long a pull-back with `cancel` waits for the cancelled turn to end (a worker is given
/// 30 s to stop it, its work then comes back).
const CANCEL_WAIT: Duration = Duration::from_secs(180);

/// The session's locks a move holds until it is done.
struct Held {
    _admission: Option<OwnedMutexGuard<()>>,
    _placing: OwnedMutexGuard<()>,
}

impl super::WorkerSide {
    /// `POST /v1/sessions/{id}/pull-back`: brings a worker session home. A session with a
    /// turn open is refused unless `cancel`, which cancels the turn and waits for its end.
    pub(crate) async fn pull_back(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        cancel: bool,
        live_move: bool,
    ) -> Result<Moved> {
        if cancel && live_move {
            return Err(crate::Error::BadRequest(
                "cancel and live exclude each other: --cancel ends the running turn, --live moves it".into(),
            ));
        }
        self.store.session(scope, id)?;
        let live = self.live(id);
        let admission = live.admission.clone().lock_owned().await;
        if let Some(run) = self.store.open_run(scope, id)? {
            if live_move {
                let moved = self.claim_live_pull_back(scope, id, &run);
                drop(admission);
                return moved;
            }
            if !cancel {
                return Err(skiff_store::Error::SessionBusy {
                    session: id.to_string(),
                    run: run.id.to_string(),
                }
                .into());
            }
            // The barrier's step 3, before the cancel: what waits is told why.
            self.revoke_approvals(scope, id, "the session is pulled back to the gateway");
            self.cancel_and_wait(scope, id, &run.id).await?;
        }
        // Taken after the turn ended: a turn being placed holds it until it stops.
        let placing = live.placing.clone().lock_owned().await;
        let Some(p) = self.store.placement(scope, id)? else {
            return self.unmoved(
                scope,
                id,
                format!("session {id} already runs on the gateway"),
            );
        };
        match p.state {
            PlacementState::Local => self.unmoved(
                scope,
                id,
                format!("session {id} already runs on the gateway"),
            ),
            PlacementState::Parked
            | PlacementState::Reclaimed
            | PlacementState::FailedOver
            | PlacementState::Failed => {
                // No box holds anything of it: its last reconciled turn is here already.
                self.store.come_home(scope, id)?;
                let detail = format!(
                    "pulled back from {} (no box held it): the session runs on the gateway from now on",
                    p.state
                );
                let cursor = self.announce(scope, id, PlacementState::Local, None, &detail);
                self.audit_pull_back(scope, &p, "home", None);
                // From the announced step on.
                Self::moved(detail, cursor.saturating_sub(1))
            }
            PlacementState::Active => {
                let before = self.store.claim_pull_back(scope, id)?;
                let env = before.environment_id.clone();
                let detail = format!(
                    "pulling the session back to the gateway: no new turns; stopping the worker of epoch {} on {}",
                    before.owner_epoch,
                    env.as_ref().map_or("its box".into(), |e| e.to_string())
                );
                let cursor =
                    self.announce(scope, id, PlacementState::Draining, env.clone(), &detail);
                let held = Held {
                    _admission: Some(admission),
                    _placing: placing,
                };
                let workers = self.clone();
                let (scope2, id2) = (scope.clone(), id.clone());
                tokio::spawn(async move {
                    workers.barrier(&scope2, &id2, before).await;
                    drop(held);
                });
                // From the announced step on.
                Self::moved(detail, cursor.saturating_sub(1))
            }
            other => Err(crate::Error::Conflict(format!(
                "session {id} is {other} (its worker is being placed or repaired); pull it back once it is active"
            ))),
        }
    }

    /// The barrier after the claim: stop and fence the worker, bring back what only the box
    /// has, come home, give the box back. A box whose work cannot come back keeps the
    /// session (`active`, its worker stopped; the next message starts a new one there).
    async fn barrier(self: &Arc<Self>, scope: &Scope, id: &SessionId, before: PlacementRow) {
        let started = std::time::Instant::now();
        let epoch = before.owner_epoch;
        let live = self.live(id);
        self.strike_now(scope, id, BarrierStep::Drained).await;
        live.stop_epoch(epoch, "the session is pulled back to the gateway");
        self.cancel_model_calls(id);
        self.revoke_approvals(scope, id, "the session is pulled back to the gateway");
        let env_row = self.placement_env(scope, &before).ok();
        let stopped = match &env_row {
            Some(env) => self.stop_worker_on_box(env, before.worker_pid).await,
            None => Err("the session names no box".to_owned()),
        };
        let how = match &stopped {
            Ok(()) => "stopped, with the commands its tools started".to_owned(),
            Err(e) => format!("could not be confirmed stopped ({e})"),
        };
        let fenced = self.place(
            scope,
            id,
            PlacementState::Draining,
            &PlacementChange {
                advance_epoch: true,
                ..Default::default()
            },
            &format!(
                "the worker of epoch {epoch} {how}; epoch {} fences it: whatever it still sends is refused",
                epoch + 1
            ),
        );
        if let Err(e) = fenced {
            self.pull_back_stopped(
                scope,
                id,
                &before,
                &format!("the worker could not be fenced: {e}"),
            );
            return;
        }
        self.strike_now(scope, id, BarrierStep::Fenced).await;
        let mut reconciled = false;
        if !before.box_in_step {
            let step = self.place(
                scope,
                id,
                PlacementState::Reconciling,
                &PlacementChange::default(),
                "the box holds work the gateway does not have yet; bringing it back",
            );
            if let Err(e) = step {
                self.pull_back_stopped(scope, id, &before, &e.to_string());
                return;
            }
            if let Err(e) = self.capture_box_work(scope, id).await {
                let why = format!("the box's work could not be brought back: {e}");
                self.pull_back_stopped(scope, id, &before, &why);
                return;
            }
            reconciled = true;
        }
        self.strike_now(scope, id, BarrierStep::Reconciled).await;
        let was = match self.store.come_home(scope, id) {
            Ok(was) => was,
            Err(e) => {
                self.pull_back_stopped(scope, id, &before, &e.to_string());
                return;
            }
        };
        let (pooled, the_box, work) = self.box_home(scope, id, &was, reconciled).await;
        let detail = format!(
            "home in {:.1} s: the session runs on the gateway from now on; {work}; {the_box}",
            started.elapsed().as_secs_f64()
        );
        self.announce(scope, id, PlacementState::Local, None, &detail);
        let box_state = pooled.map(|pooled| if pooled { "idle" } else { "destroyed" });
        self.audit_pull_back(scope, &before, "home", box_state);
    }

    /// Cancels the session's open run (the usual cancel) and waits until it has ended.
    async fn cancel_and_wait(&self, scope: &Scope, id: &SessionId, run: &RunId) -> Result<()> {
        let after = self.store.last_event_cursor(scope, id)?;
        let events = self.hub.subscribe(scope.clone(), id.clone(), after)?;
        self.cancel(scope, id)?;
        let ended = async {
            let mut events = std::pin::pin!(events);
            // The run may have ended before the subscription: the store says so first.
            if self.store.run(scope, run)?.status.is_terminal() {
                return Ok(());
            }
            while let Some(event) = events.next().await {
                let event = event?;
                if event.run_id.as_ref() == Some(run) && event.kind.is_run_end() {
                    return Ok(());
                }
            }
            Err(crate::Error::Unavailable(
                "the gateway is shutting down".into(),
            ))
        };
        tokio::time::timeout(CANCEL_WAIT, ended)
            .await
            .map_err(|_| {
                crate::Error::Conflict(format!(
                    "run {run} did not stop within {} s of its cancel; try the pull-back again when it has",
                    CANCEL_WAIT.as_secs()
                ))
            })?
    }

    /// `POST /v1/sessions/{id}/dispatch`: places a session on `profile` now, without a turn;
    /// the next message runs there. A message sent meanwhile waits for the worker.
    pub(crate) async fn dispatch(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        profile: &str,
        live_move: bool,
    ) -> Result<Moved> {
        let session = self.store.session(scope, id)?;
        let live = self.live(id);
        let admission = live.admission.clone().lock_owned().await;
        let placement = self.store.placement(scope, id)?;
        if live_move
            && placement
                .as_ref()
                .is_none_or(|p| p.state == PlacementState::Local)
            && let Some(run) = self.store.open_run(scope, id)?
        {
            let moved = self.claim_live_dispatch(scope, id, &run, profile).await;
            drop(admission);
            return moved;
        }
        if let Some(p) = self.store.placement(scope, id)?
            && !matches!(
                p.state,
                PlacementState::Local
                    | PlacementState::Parked
                    | PlacementState::Reclaimed
                    | PlacementState::FailedOver
                    | PlacementState::Failed
            )
        {
            if p.profile == profile {
                return self.unmoved(
                    scope,
                    id,
                    format!("session {id} is already on profile {profile} ({})", p.state),
                );
            }
            return Err(moving_profiles(id, &p.profile, profile));
        }
        self.claim_dispatch(scope, id, profile).await?;
        let detail =
            format!("dispatching to profile {profile}: placing the session now, without a turn");
        let cursor = self.announce(scope, id, PlacementState::Requested, None, &detail);
        // No turn drives this placement: the dispatch does, holding `placing` so a turn sent
        // meanwhile waits for the worker it starts. Admission is free again once it is held.
        let held = Held {
            _admission: None,
            _placing: live.placing.clone().lock_owned().await,
        };
        drop(admission);
        let workers = self.clone();
        let scope2 = scope.clone();
        tokio::spawn(async move {
            let cancel = CancellationToken::new();
            workers
                .strike_now(&scope2, &session.id, BarrierStep::Drained)
                .await;
            let placed = workers
                .ensure_worker_locked(&scope2, &session, &cancel)
                .await;
            if placed.is_ok() {
                workers
                    .strike_now(&scope2, &session.id, BarrierStep::Fenced)
                    .await;
            }
            if let Err(e) = placed {
                // Most failures recorded the placement `failed` already; one before the first
                // step did not, and a follower waits for a settled state.
                match workers.store.placement(&scope2, &session.id) {
                    Ok(Some(p))
                        if !matches!(
                            p.state,
                            PlacementState::Failed | PlacementState::Reclaimed
                        ) =>
                    {
                        workers
                            .fail_placement(&scope2, &p, e, "the dispatch failed")
                            .await;
                    }
                    Ok(_) => {}
                    Err(read) => {
                        tracing::warn!(session = %session.id, error = %read, "cannot read a failed dispatch's placement");
                    }
                }
            }
            drop(held);
        });
        Self::moved(
            format!("placing session {id} on profile {profile}"),
            cursor.saturating_sub(1),
        )
    }

    /// The answer to a move that started: what it does, and the cursor after which the
    /// client follows the move's placement events.
    fn moved(message: String, after_cursor: u64) -> Result<Moved> {
        Ok(Moved {
            moved: true,
            message,
            after_cursor,
        })
    }

    /// The answer to a move that was not needed: why, and the session's cursor now.
    fn unmoved(&self, scope: &Scope, id: &SessionId, message: String) -> Result<Moved> {
        Ok(Moved {
            moved: false,
            message,
            after_cursor: self.store.last_event_cursor(scope, id)?,
        })
    }

    /// Places a session on `profile` at a turn boundary (its caller holds `admission`): no
    /// turn may be open, and a worker slot is claimed (parking a session idle on its box if
    /// that is what it takes). Answers the placement, `requested`; the caller says why to
    /// the session's followers.
    pub(crate) async fn claim_dispatch(
        &self,
        scope: &Scope,
        id: &SessionId,
        profile: &str,
    ) -> Result<PlacementRow> {
        self.check_profile(profile)?;
        if let Some(run) = self.store.open_run(scope, id)? {
            return Err(skiff_store::Error::SessionBusy {
                session: id.to_string(),
                run: run.id.to_string(),
            }
            .into());
        }
        let row = self
            .claim_worker_slot(|max| self.store.request_placement(scope, id, profile, max))
            .await?;
        self.dispatched(scope, id, profile);
        Ok(row)
    }

    /// What follows a dispatch's claim of a worker slot (here, or with the run of the turn
    /// that dispatches): approvals still pending are revoked, and the dispatch is audited.
    pub(crate) fn dispatched(&self, scope: &Scope, id: &SessionId, profile: &str) {
        self.revoke_approvals(
            scope,
            id,
            &format!("the session is dispatched to profile {profile}"),
        );
        self.audit(
            scope,
            "session.dispatch",
            id.as_str(),
            "allowed",
            json!({ "profile": profile }),
        );
    }

    /// Gives back the box a session came home from (`was`, as `come_home` left it), and says
    /// for people where the box went and where the box's work is. `None`: it held no box;
    /// `Some(false)`: the box could not be cleared and was destroyed.
    pub(super) async fn box_home(
        &self,
        scope: &Scope,
        id: &SessionId,
        was: &PlacementRow,
        reconciled: bool,
    ) -> (Option<bool>, String, &'static str) {
        let pooled = match &was.environment_id {
            Some(env) => Some(
                self.give_box_back(scope, id, env, was.worker_pid, false)
                    .await,
            ),
            None => None,
        };
        let the_box = match (&was.environment_id, pooled) {
            (Some(env), Some(true)) => format!("its box {env} is back in the idle pool"),
            (Some(env), _) => format!("its box {env} could not be cleared and was destroyed"),
            (None, _) => "it held no box".to_owned(),
        };
        let work = if reconciled {
            "the box's work is in the session's workspace"
        } else {
            "its workspace here already had the box's work"
        };
        (pooled, the_box, work)
    }

    /// Stops the worker's process on its box (the endpoint already told it to go).
    pub(super) async fn stop_worker_on_box(
        &self,
        env: &skiff_store::EnvironmentRow,
        worker_pid: Option<i64>,
    ) -> std::result::Result<(), String> {
        let ssh = self.envs.ssh(env).map_err(|e| e.to_string())?;
        ssh.run(&stop_worker_script(worker_pid), &CancellationToken::new())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Before a new epoch fences a worker that is merely out of reach, that worker is
    /// stopped on its box with the commands its tools started: a tool the gateway admitted
    /// under the old epoch ends before the fence, never after it. A box that cannot be
    /// reached runs nothing that could come home; that is logged, and the fence goes on.
    pub(super) async fn stop_before_fencing(&self, scope: &Scope, p: &PlacementRow) {
        if p.worker_pid.is_none_or(|pid| pid <= 0) {
            return;
        }
        let stopped = match self.placement_env(scope, p) {
            Ok(env) => self.stop_worker_on_box(&env, p.worker_pid).await,
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = stopped {
            tracing::warn!(session = %p.session_id, epoch = p.owner_epoch, error = %e, "the worker being fenced could not be confirmed stopped");
        }
    }

    fn audit_pull_back(
        &self,
        scope: &Scope,
        before: &PlacementRow,
        outcome: &str,
        box_state: Option<&str>,
    ) {
        self.audit(
            scope,
            "placement.pull_back",
            before.session_id.as_str(),
            "applied",
            json!({
                "from": before.state.as_str(),
                "env": before.environment_id.as_ref().map(|e| e.as_str()),
                "epoch": before.owner_epoch,
                "outcome": outcome,
                "box": box_state,
            }),
        );
    }

    /// A pull-back that cannot finish leaves the session on its box, worker stopped.
    fn pull_back_stopped(&self, scope: &Scope, id: &SessionId, before: &PlacementRow, why: &str) {
        let detail = format!(
            "the pull-back stopped: {why}. The session stays on its box; its next message starts a new worker there"
        );
        if let Err(e) = self.place(
            scope,
            id,
            PlacementState::Active,
            &PlacementChange {
                error: Some(why),
                ..Default::default()
            },
            &detail,
        ) {
            tracing::warn!(session = %id, error = %e, "could not record a stopped pull-back");
        }
        self.audit_pull_back(scope, before, "stopped", None);
        tracing::warn!(session = %id, why, "pull-back stopped");
    }
}

/// A move as the worker side answers it: whether it started, what it does, and the cursor
/// after which its placement events follow. The API adds the session's view.
pub(crate) struct Moved {
    pub(crate) moved: bool,
    pub(crate) message: String,
    pub(crate) after_cursor: u64,
}

/// A session on a box moves to another profile by coming home first.
pub(crate) fn moving_profiles(id: &SessionId, from: &str, to: &str) -> crate::error::Error {
    crate::Error::Conflict(format!(
        "session {id} runs on profile `{from}`; bring it home first (`skiff session pull-back {id}`), then dispatch it to `{to}`"
    ))
}
