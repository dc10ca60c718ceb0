//! Which gateway runs a session's live work (issue 17), on top of [`crate::cluster`]: a turn
//! owns its session's lease from admission to its end, the lease loop keeps what is held
//! alive and stops what was lost, and takes over the sessions of gateways that died — a
//! running turn goes on here as a new attempt of the same run.
//!
//! **Routing** (`forward.rs`). A turn for a session whose lease another live gateway holds
//! between turns is forwarded to that gateway with the caller's credentials, and its answer
//! relayed. A gateway holds a session's lease between turns while the session's worker is
//! attached there (its box's SSH masters and the worker's connection are there), and lets it
//! go once the worker is detached (pull-back, park, reclaim, session end). A turn for a
//! session another gateway is *running* a turn of is refused `409`, naming that gateway and
//! its address — what one gateway answers a second turn too (its events can be followed
//! through any gateway meanwhile). A session nobody holds is run by whichever gateway
//! receives it. A gateway that takes over a session on a box re-adopts the box
//! (`worker/adopt.rs`).
//!
//! **Hand-over** (`drain.rs`). A draining gateway releases its leases while their turns run;
//! the lease loop claims a released lease of a session with an unfinished run at its next
//! round (no expiry to wait out) and goes on with the run as a new attempt, as on a takeover.
//! A draining gateway takes nothing over.

use crate::telemetry::{LEASE_LOST, LEASE_RENEWALS, LEASE_TAKEOVERS};
use crate::{Core, Error, Result};
use serde_json::json;
use skiff_protocol::api::{AttemptStatus, RunStatus};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::{AttemptId, GatewayId, SessionId};
use skiff_store::{Lease, LeaseKey, RunRow, Scope};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The runtime node an attempt on the gateway's own loop records.
const RUNTIME_NODE: &str = "gateway";

impl Core {
    /// Makes `session`'s live work this gateway's for a turn. The token is cancelled if the
    /// lease is later lost to another gateway. A session another gateway is running is a
    /// conflict naming it.
    pub(crate) fn own_session(&self, session: &SessionId) -> Result<CancellationToken> {
        if self.cluster.is_draining() {
            return Err(Error::Unavailable(format!(
                "gateway {} is draining and starts no more turns: send the message to another \
                 gateway (none other is running, or it would have been forwarded there)",
                self.cluster.id()
            )));
        }
        match self.cluster.acquire(session)? {
            Ok(lost) => Ok(lost),
            Err(owner) => {
                let at = if owner.address.is_empty() {
                    String::new()
                } else {
                    format!(" at {}", owner.address)
                };
                Err(Error::Conflict(format!(
                    "session {session} is being run by gateway {}{at}: send the message there, or \
                     again once its turn has ended (its events can be followed through any gateway)",
                    owner.gateway
                )))
            }
        }
    }

    /// Lets `session`'s lease go after a refused admission, unless a turn of it runs here.
    pub(crate) fn disown_if_idle(&self, scope: &Scope, session: &SessionId) {
        let running_here = match self.store.open_run(scope, session) {
            Ok(Some(run)) => self.run_cancel_token(&run.id).is_some(),
            Ok(None) => false,
            // Unknown: keep it; the turn's end or the lease's expiry lets it go.
            Err(_) => true,
        };
        if !running_here {
            self.disown(session);
        }
    }

    /// Lets `session`'s lease go: its live work here ended — unless its worker is attached
    /// here, which keeps the session this gateway's between turns.
    pub(crate) fn disown(&self, session: &SessionId) {
        if !self.workers.attached_here(session) {
            self.cluster.release(session);
        }
    }

    /// Keeps the lease of every session whose worker is attached here (a dispatch without a
    /// message attaches one outside any turn), and lets go of held leases whose session has
    /// neither a worker here nor a turn (its worker was detached between turns).
    fn own_attached(&self) {
        for session in self.workers.connected_sessions() {
            if self.cluster.leases().fence(&session).is_some() {
                continue;
            }
            match self.cluster.acquire(&session) {
                Ok(Ok(_)) => {}
                Ok(Err(owner)) => {
                    tracing::warn!(%session, owner = %owner.gateway, "a worker is attached here to a session another gateway owns");
                }
                Err(e) => {
                    tracing::warn!(%session, error = %e, "could not take the lease of a session attached here")
                }
            }
        }
        for session in self.cluster.leases().sessions() {
            if self.workers.attached_here(&session) {
                continue;
            }
            // A turn being admitted holds this lock from its lease to its run.
            let admission = self.workers.live(&session).admission.clone();
            let Ok(_admitting) = admission.try_lock() else {
                continue;
            };
            if matches!(self.store.open_run_of(&session), Ok(None)) {
                self.cluster.release(&session);
            }
        }
    }

    /// Starts the attempt of a run on the gateway's own loop: a new attempt after the one a
    /// dead gateway left when the run was taken over, else a fresh one. Fenced by the
    /// session's lease while this gateway holds it.
    pub(crate) fn start_gateway_attempt(&self, scope: &Scope, run: &RunRow) -> Result<AttemptId> {
        let after = self
            .resumes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&run.id);
        let resume = skiff_store::Resume {
            after: after.as_ref(),
            checkpoint_artifact_id: None,
        };
        Ok(match self.hub.fence(&run.session_id) {
            Some(fence) => {
                self.store
                    .resume_attempt_fenced(&fence, scope, run, RUNTIME_NODE, resume)?
            }
            None => self
                .store
                .resume_attempt(scope, run, RUNTIME_NODE, 1, resume)?,
        })
    }

    /// One round of the lease loop: the heartbeat, every held lease renewed (a lost one
    /// stops its session's work), then the sessions of dead gateways taken over.
    async fn lease_round(self: &Arc<Self>) {
        let core = self.clone();
        let renewed = tokio::task::spawn_blocking(move || {
            let beat = core.cluster.beat();
            (beat, core.cluster.renew_all())
        })
        .await;
        let (beat, round) = match renewed {
            Ok(answer) => answer,
            Err(e) => {
                tracing::warn!(error = %e, "the lease loop's round failed");
                return;
            }
        };
        if let Err(e) = &beat {
            tracing::warn!(error = %e, "the gateway's heartbeat failed");
        }
        self.telemetry
            .add(LEASE_RENEWALS, Vec::new(), round.renewed);
        self.telemetry
            .add(LEASE_LOST, Vec::new(), round.lost.len() as u64);
        for session in &round.lost {
            // Its turn was cancelled with the lease; its worker (if any) is the new owner's.
            self.workers.live(session).close();
        }
        let core = self.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || core.own_attached()).await {
            tracing::warn!(error = %e, "the lease loop's ownership of attached workers failed");
        }
        let took_over = self.take_over_round().await;
        if beat.is_ok() && round.complete && took_over {
            self.cluster.round_done();
        }
    }

    /// Takes over every session lease that expired (its holder died, or stopped renewing);
    /// whether every call was answered.
    async fn take_over_round(self: &Arc<Self>) -> bool {
        // A draining gateway is handing its sessions to the others, not taking theirs.
        if self.cluster.is_draining() {
            return true;
        }
        let core = self.clone();
        let listed = tokio::task::spawn_blocking(move || {
            Ok::<_, Error>((
                core.cluster.expired_sessions()?,
                core.store.released_open_sessions()?,
            ))
        })
        .await;
        let (expired, released) = match listed {
            Ok(Ok(listed)) => listed,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not list the session leases to take over");
                return false;
            }
            Err(_) => return false,
        };
        let mut complete = true;
        for session in released {
            if let Err(e) = self.take_over_handed(&session).await {
                tracing::warn!(%session, error = %e, "could not take a handed-over session over");
                complete = false;
            }
        }
        for lease in expired {
            if let Err(e) = self.take_over(&lease).await {
                tracing::warn!(lease = %lease.key, error = %e, "could not take a session over");
                complete = false;
            }
        }
        complete
    }

    /// Takes `expired` over and goes on with what its session was doing: a running turn on
    /// the gateway becomes a new attempt here; a session with nothing running is let go.
    async fn take_over(self: &Arc<Self>, expired: &Lease) -> Result<()> {
        let LeaseKey::Session(session) = expired.key.clone() else {
            return Ok(());
        };
        let Some(lost) = self.cluster.take_over(expired)? else {
            return Ok(());
        };
        self.telemetry.add(LEASE_TAKEOVERS, Vec::new(), 1);
        tracing::warn!(%session, from = %expired.holder, epoch = expired.epoch + 1,
            "took a session over from a gateway that stopped renewing its lease");
        match self.go_on_with(&session, Some(&expired.holder), &lost) {
            Ok(true) => Ok(()),
            Ok(false) if self.adopt_box(&session, &expired.holder)? => Ok(()),
            Ok(false) => {
                self.disown(&session);
                Ok(())
            }
            Err(e) => {
                self.disown(&session);
                Err(e)
            }
        }
    }

    /// Claims `session`, whose lease a draining gateway released during a turn, and goes on
    /// with its run as a new attempt (another gateway may claim it first: then nothing).
    async fn take_over_handed(self: &Arc<Self>, session: &SessionId) -> Result<()> {
        let Ok(lost) = self.cluster.acquire(session)? else {
            return Ok(());
        };
        self.telemetry.add(LEASE_TAKEOVERS, Vec::new(), 1);
        tracing::info!(%session, "took over a session a draining gateway handed over");
        match self.go_on_with(session, None, &lost) {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.disown(session);
                Ok(())
            }
            Err(e) => {
                self.disown(session);
                Err(e)
            }
        }
    }

    /// Goes on with `session`'s open run after taking it over from `from` (`None`: a
    /// draining gateway handed it over); whether a turn
    /// now runs here (which then lets the lease go when it ends).
    fn go_on_with(
        self: &Arc<Self>,
        session: &SessionId,
        from: Option<&GatewayId>,
        lost: &CancellationToken,
    ) -> Result<bool> {
        let Some((scope, run)) = self.store.open_run_of(session)? else {
            return Ok(false);
        };
        let fence = self
            .hub
            .fence(session)
            .ok_or_else(|| Error::Internal(format!("no fence on session {session} taken over")))?;
        let me = self.cluster.id();
        let (reason, notice) = match from {
            Some(from) => (
                format!(
                    "gateway {from} stopped while running this attempt; gateway {me} took the run over"
                ),
                format!("Gateway {from} stopped during this turn; gateway {me} goes on with it."),
            ),
            None => (
                format!(
                    "a draining gateway handed this attempt over; gateway {me} took the run over"
                ),
                format!("A draining gateway handed this turn over; gateway {me} goes on with it."),
            ),
        };
        // The old attempt ends; whatever its tool calls did is in the workspace, and a call
        // whose result was never recorded gets one saying so when the turn goes on.
        let mut after = None;
        for attempt in self.store.attempts(&scope, session)? {
            if attempt.run_id == run.id
                && matches!(
                    attempt.status,
                    AttemptStatus::Starting | AttemptStatus::Running
                )
            {
                self.store.finish_attempt_fenced(
                    &fence,
                    &scope,
                    &attempt.id,
                    AttemptStatus::Orphaned,
                    Some(&reason),
                )?;
                after = Some(attempt.id);
            }
        }
        let row = self.store.session(&scope, session)?;
        self.audit(
            &scope,
            "run.takeover",
            run.id.as_str(),
            "applied",
            json!({
                "session": session.as_str(),
                "from": from.map(GatewayId::as_str),
                "handed_over": from.is_none(),
                "placement": row.placement,
            }),
        );
        if run.status == RunStatus::Cancelling {
            let why = format!("{reason}; it was being cancelled");
            self.set_run_status(&scope, session, &run.id, RunStatus::Orphaned, Some(&why))?;
            return Ok(false);
        }
        let on_box = row.placement != PlacementState::Local.as_str();
        if let Some(after) = after {
            self.resumes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(run.id.clone(), after);
        }
        self.transcript()
            .notify(&scope, session, Some(&run.id), &notice);
        if !on_box || !self.workers.claim_adoption(session) {
            self.spawn_turn(&scope, row, run, lost);
            return Ok(true);
        }
        // The box first (re-adopted, or reclaimed so the turn fails over to a fresh one),
        // then the turn's new attempt on it.
        let from = from.map_or_else(|| "a draining gateway".to_owned(), ToString::to_string);
        let (core, session, lost) = (self.clone(), session.clone(), lost.clone());
        tokio::spawn(async move {
            core.workers.adopt(&scope, &session, &from).await;
            match core.store.session(&scope, &session) {
                Ok(row) => core.spawn_turn(&scope, row, run, &lost),
                Err(e) => {
                    let why =
                        format!("the run taken over from gateway {from} could not go on: {e}");
                    if let Err(e) = core.set_run_status(
                        &scope,
                        &session,
                        &run.id,
                        RunStatus::Failed,
                        Some(&why),
                    ) {
                        tracing::warn!(%session, error = %e, "could not end the taken-over run");
                    }
                    core.disown(&session);
                }
            }
        });
        Ok(true)
    }

    /// After taking over `session` with no turn running: re-adopts its box when it is on one
    /// (in the background, the lease kept meanwhile); whether it is.
    fn adopt_box(self: &Arc<Self>, session: &SessionId, from: &GatewayId) -> Result<bool> {
        // Placements holding or getting a box; a settled one (home, parked, reclaimed) has
        // nothing to adopt.
        let Some(scope) = self
            .store
            .live_placements()?
            .into_iter()
            .find(|p| &p.session_id == session)
            .map(|p| p.scope)
        else {
            return Ok(false);
        };
        if !self.workers.claim_adoption(session) {
            return Ok(false);
        }
        let (core, session, from) = (self.clone(), session.clone(), from.to_string());
        tokio::spawn(async move {
            core.workers.adopt(&scope, &session, &from).await;
            // Detached after all (reclaimed, or failed mid-placement): the lease goes.
            core.disown(&session);
        });
        Ok(true)
    }
}

/// Starts the lease loop: every [`crate::cluster::Cluster::beat_every`] while the gateway
/// lives — the heartbeat, renewals, take-overs.
pub(crate) fn spawn_lease_loop(core: &Arc<Core>) {
    // Weak: the loop keeps no gateway alive.
    let weak = Arc::downgrade(core);
    let every = core.cluster.beat_every();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(core) = weak.upgrade() else {
                return;
            };
            core.lease_round().await;
        }
    });
}
