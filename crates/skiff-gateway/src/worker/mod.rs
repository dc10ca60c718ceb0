//! Worker sessions: the gateway's side of the worker protocol (DESIGN §5, §6).
//!
//! - [`endpoint`]: one unix socket per attached environment under `<state>/workers/`, reached
//!   from the box only through the reverse forward of the environment's control SSH
//!   connection; admission (signed one-use credential, exact build hash, protocol version).
//! - [`ops`]: the closed RPC set with durable identity — scope and epoch checks, cached
//!   terminal replies for duplicates, ACK cursors.
//! - [`proxy`]: the inference proxy (the gateway's own catalog decides provider, endpoint and
//!   key), credit windows and terminal replay; the readiness canary.
//! - [`place`]: the placement state machine driven end to end — environment, outbound sync,
//!   tunnel, worker start, admission, canary — running turns remotely, reconciling the
//!   workspace after each, and recovering from tunnel blips, dead workers and dead boxes.
//! - [`park`]: a session idle on its box past its profile's `keep_attached`, or the one idle
//!   longest when a slot is needed, gives the box back to the idle pool (placement `parked`).
//! - [`pull_back`]: the migration barrier — a worker session brought home (placement
//!   `local`), and a session dispatched to a profile without a message.
//! - [`handoff`]: the same moves with the turn running (`--live`): the old owner's current
//!   step finishes and is committed, the old owner is stopped and fenced, the workspace
//!   reconciled, and the same run goes on at the new owner as a new attempt.
//! - [`adopt`]: a session taken over from a gateway that died gets its box back — the old
//!   worker fenced by a replacement under a higher epoch — or reclaimed when it cannot be
//!   reached; a box's SSH key sealed in the vault so every gateway can reach it.
//! - [`handles`]: what the worker side reaches of the rest of the gateway — runs,
//!   checkpoints, turn specs, gateway tools — through narrow traits the core lends it.
//!
//! Deliberately absent: any way for a worker to reach the HTTP API, to name another session,
//! to supply transcript ids, or to pick a model endpoint; and any reference to the gateway's
//! core from this module (it owns the worker side, never the other way round).

mod adopt;
pub(crate) mod credential;
mod egress_gate;
mod endpoint;
pub(crate) mod handles;
mod handoff;
mod ops;
mod park;
pub(crate) mod place;
pub(crate) mod probe;
mod proxy;
mod pull_back;
mod recover;
mod setup;
#[cfg(test)]
mod tests;
mod turn;

use skiff_protocol::worker::{GatewayFrame, TurnEnd};
use skiff_protocol::{EnvironmentId, RunId, SessionId};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

pub(crate) use credential::Signer;
pub(crate) use handoff::{BarrierFault, Handoff};
pub(crate) use place::box_workspace;
pub(crate) use pull_back::{Moved, moving_profiles};

/// The model reference of the readiness canary: answered by the proxy itself, never sent to a
/// provider.
pub(crate) const CANARY_MODEL: &str = "skiff/canary";

/// What the canary must come back with for `nonce`.
pub(crate) fn canary_answer(nonce: &str) -> String {
    format!(
        "canary-ok {}",
        &blake3::hash(nonce.as_bytes()).to_hex()[..16]
    )
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The connection a session's worker is on now.
struct Conn {
    id: u64,
    epoch: u64,
    out: mpsc::UnboundedSender<GatewayFrame>,
    closed: CancellationToken,
}

/// One worker session as the gateway sees it in memory. The durable part is the placement row.
#[derive(Default)]
pub(crate) struct Live {
    conn: Mutex<Option<Conn>>,
    /// Bumped on every connect and disconnect.
    changes: watch::Sender<u64>,
    canary: Mutex<Option<(String, oneshot::Sender<String>)>>,
    turns: Mutex<HashMap<RunId, oneshot::Sender<TurnEnd>>>,
    /// A recovery task is repairing this session's worker.
    recovering: Mutex<bool>,
    /// The run handed to the worker, while it is open (cleared when it ends).
    open_run: Mutex<Option<RunId>>,
    /// The last live event applied, per epoch (mirrors the persisted ACK cursor).
    applied_events: Mutex<Option<(u64, u64)>>,
    /// When the worker last showed progress: a frame of its turn (an event, a transcript
    /// write, a model call or acknowledgement; not a credential rotation) or model output the
    /// gateway passed on to it. The stall watchdog reads it.
    progress: Mutex<Option<std::time::Instant>>,
    /// Held while a turn is admitted (its run inserted and the placement it runs under read)
    /// and for the whole of a pull-back, so a message sent during a pull-back waits for it
    /// and then runs at home. Taken before `placing` when both are held.
    pub(crate) admission: Arc<tokio::sync::Mutex<()>>,
    /// Held by whoever drives the placement (a turn's `ensure_worker`, a dispatch without a
    /// message, a pull-back), so two of them never drive one placement at once.
    pub(crate) placing: Arc<tokio::sync::Mutex<()>>,
    /// Whether a turn is attended here, and the live move of it asked for (`--live`).
    handoff: watch::Sender<handoff::HandoffState>,
    /// The inference proxy held the worker's next model call for a live move home: the step
    /// before it is committed, and nothing after it will be.
    held_call: watch::Sender<bool>,
    /// The placement's workspace lay-down, when it runs behind the worker's start.
    lay_down: Mutex<LayDown>,
}

/// How the lay-down of the placement's workspace stands, as the worker's turns hear of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum LayDown {
    /// Done before the worker started (or no lay-down of this gateway's): nothing to wait for.
    #[default]
    Before,
    /// Running on the box while the worker starts and its turn's first model call is made.
    Running,
    /// Ended after the worker started: how.
    Ended(std::result::Result<(), String>),
}

impl Live {
    pub(crate) fn lay_down(&self) -> LayDown {
        lock(&self.lay_down).clone()
    }

    pub(crate) fn set_lay_down(&self, to: LayDown) {
        *lock(&self.lay_down) = to;
    }

    /// `Before` → `Running`; a lay-down that ended already stays ended.
    pub(crate) fn lay_down_running(&self) {
        let mut now = lock(&self.lay_down);
        if *now == LayDown::Before {
            *now = LayDown::Running;
        }
    }

    fn bump(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// Makes `out` the session's connection, closing the one it replaces.
    fn connect(
        &self,
        id: u64,
        epoch: u64,
        out: mpsc::UnboundedSender<GatewayFrame>,
    ) -> CancellationToken {
        let closed = CancellationToken::new();
        let old = lock(&self.conn).replace(Conn {
            id,
            epoch,
            out,
            closed: closed.clone(),
        });
        if let Some(old) = old {
            old.closed.cancel();
        }
        self.bump();
        closed
    }

    fn disconnect(&self, id: u64) {
        let mut conn = lock(&self.conn);
        if conn.as_ref().is_some_and(|c| c.id == id) {
            *conn = None;
            drop(conn);
            self.bump();
        }
    }

    /// Closes connection `id` if it is still the session's; its worker reconnects and sends
    /// again what was not acknowledged.
    fn drop_conn(&self, id: u64) {
        let conn = lock(&self.conn);
        if let Some(c) = conn.as_ref().filter(|c| c.id == id) {
            c.closed.cancel();
        }
    }

    /// Closes the connection (a new owner takes over, or the session is done with its worker).
    pub(crate) fn close(&self) {
        if let Some(conn) = lock(&self.conn).take() {
            conn.closed.cancel();
        }
        self.bump();
    }

    /// Tells the worker of `epoch` to go and closes its connection (queued frames still go
    /// out); a newer epoch's worker, already placed again, is left alone.
    fn stop_epoch(&self, epoch: u64, reason: &str) {
        let mut conn = lock(&self.conn);
        if conn.as_ref().is_some_and(|c| c.epoch == epoch)
            && let Some(old) = conn.take()
        {
            drop(conn);
            // A worker that can no longer hear it is killed by whoever stops it.
            let _ = old.out.send(GatewayFrame::Shutdown {
                reason: reason.to_owned(),
            });
            old.closed.cancel();
            self.bump();
        }
    }

    pub(crate) fn open_run(&self) -> Option<RunId> {
        lock(&self.open_run).clone()
    }

    pub(crate) fn set_open_run(&self, run: Option<RunId>) {
        *lock(&self.open_run) = run;
    }

    /// The last live event applied at `epoch`; `load` reads the persisted cursor once.
    /// The last live event applied in `epoch`; `load` reads it from the store the first time.
    /// A failed read is not remembered: taking it for 0 would apply events a second time.
    fn applied_events<E>(
        &self,
        epoch: u64,
        load: impl FnOnce() -> Result<u64, E>,
    ) -> Result<u64, E> {
        let mut applied = lock(&self.applied_events);
        match *applied {
            Some((e, seq)) if e == epoch => Ok(seq),
            _ => {
                let seq = load()?;
                *applied = Some((epoch, seq));
                Ok(seq)
            }
        }
    }

    fn set_applied_events(&self, epoch: u64, seq: u64) {
        *lock(&self.applied_events) = Some((epoch, seq));
    }

    pub(crate) fn connected_epoch(&self) -> Option<u64> {
        lock(&self.conn).as_ref().map(|c| c.epoch)
    }

    /// Sends a frame to the worker; false when it is not connected.
    pub(crate) fn send(&self, frame: GatewayFrame) -> bool {
        lock(&self.conn)
            .as_ref()
            .is_some_and(|c| c.out.send(frame).is_ok())
    }

    fn send_on(&self, conn_id: u64, frame: GatewayFrame) -> bool {
        if matches!(frame, GatewayFrame::Model { .. }) {
            // The provider is producing: the worker is waiting on it, not stalled.
            self.touch();
        }
        lock(&self.conn)
            .as_ref()
            .is_some_and(|c| c.id == conn_id && c.out.send(frame).is_ok())
    }

    /// Records progress of the session's worker now.
    pub(crate) fn touch(&self) {
        *lock(&self.progress) = Some(std::time::Instant::now());
    }

    /// How long ago the worker last showed progress (since `since` when it never did).
    pub(crate) fn idle_for(&self, since: std::time::Instant) -> std::time::Duration {
        lock(&self.progress)
            .filter(|at| *at > since)
            .unwrap_or(since)
            .elapsed()
    }

    pub(crate) fn watch(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub(crate) fn expect_turn(&self, run: &RunId) -> oneshot::Receiver<TurnEnd> {
        let (tx, rx) = oneshot::channel();
        lock(&self.turns).insert(run.clone(), tx);
        rx
    }

    /// Whether a turn here waits for its end from the worker.
    pub(crate) fn attending(&self) -> bool {
        !lock(&self.turns).is_empty()
    }

    pub(crate) fn end_turn(&self, run: &RunId, end: TurnEnd) -> bool {
        match lock(&self.turns).remove(run) {
            Some(tx) => tx.send(end).is_ok(),
            None => false,
        }
    }

    /// Ends every turn waiting on this worker (its box is gone).
    pub(crate) fn end_all_turns(&self, error: &str) {
        for (_, tx) in lock(&self.turns).drain() {
            let _ = tx.send(TurnEnd::Failed {
                error: error.to_owned(),
            });
        }
    }

    pub(crate) fn expect_canary(&self, nonce: &str) -> oneshot::Receiver<String> {
        let (tx, rx) = oneshot::channel();
        *lock(&self.canary) = Some((nonce.to_owned(), tx));
        rx
    }

    fn canary_pending(&self) -> bool {
        lock(&self.canary).is_some()
    }

    fn answer_canary(&self, nonce: &str, text: String) {
        let mut canary = lock(&self.canary);
        if canary.as_ref().is_some_and(|(n, _)| n == nonce)
            && let Some((_, tx)) = canary.take()
        {
            let _ = tx.send(text);
        }
    }
}

/// What the worker side is given when the gateway opens: the only parts of the gateway it
/// reaches (never the HTTP API, never the gateway's core itself).
pub(crate) struct Handles {
    pub(crate) store: Arc<dyn skiff_store::Backend>,
    pub(crate) hub: Arc<crate::Hub>,
    pub(crate) envs: Arc<crate::environments::Environments>,
    pub(crate) egress_dir: PathBuf,
    /// `<state>/tmp` (scratch space of syncs and setup logs) and `<state>/artifacts`.
    pub(crate) tmp_dir: PathBuf,
    pub(crate) artifacts_dir: PathBuf,
    /// The background processes of gateway-placed sessions, shared with the core: a session
    /// leaving home stops them.
    pub(crate) session_processes: SessionProcesses,
    /// Sessions whose worktree is still being filled, shared with the core: a placement
    /// waits for the fill.
    pub(crate) fills: Arc<crate::workspace::Fills>,
    /// Sealed secrets, for a profile's setup.
    pub(crate) vault: Arc<crate::vault::Vault>,
    /// `[gateway] barrier_fault`: a fault the tests inject at one barrier step.
    pub(crate) barrier_fault: Option<BarrierFault>,
    /// Revokes a session's pending approvals when it moves or fails over.
    pub(crate) approvals: crate::approvals::Revoker,
    /// Runs, checkpoints, turn specs and gateway tools, lent by the core.
    pub(crate) lent: handles::Lent,
    /// The state dir's lock, shared with the core: it is let go once neither is held.
    pub(crate) hold: Arc<crate::Hold>,
}

/// Gateway-placed sessions' background processes, one registry per session.
pub(crate) type SessionProcesses = Arc<Mutex<HashMap<SessionId, skiff_agent::tools::Processes>>>;

/// The worker side of placement: every worker session of this gateway, one [`Live`] per live
/// session, and the handles it works through. It drives placement end to end — dispatch,
/// turns on workers, pull-back, live handoff, recovery and failover — and reaches the rest of
/// the gateway only through these handles (see [`handles`]).
pub(crate) struct WorkerSide {
    store: Arc<dyn skiff_store::Backend>,
    hub: Arc<crate::Hub>,
    envs: Arc<crate::environments::Environments>,
    /// Where the per-environment egress proxy sockets live (inside the 0700 state dir).
    egress_dir: PathBuf,
    session_processes: SessionProcesses,
    tmp_dir: PathBuf,
    artifacts_dir: PathBuf,
    fills: Arc<crate::workspace::Fills>,
    vault: Arc<crate::vault::Vault>,
    barrier_fault: Option<BarrierFault>,
    approvals: crate::approvals::Revoker,
    lent: handles::Lent,
    _hold: Arc<crate::Hold>,
    pub(crate) signer: Signer,
    live: Mutex<HashMap<SessionId, Arc<Live>>>,
    listeners: Mutex<HashMap<EnvironmentId, CancellationToken>>,
    models: Mutex<HashMap<(SessionId, u64, u64), Arc<proxy::ModelCall>>>,
    /// Where the per-environment endpoint sockets live (inside the 0700 state dir).
    pub(crate) socket_dir: PathBuf,
    pub(crate) max_workers: u64,
    pub(crate) web_fetch_allow: Vec<String>,
    /// How long a minted credential lives.
    pub(crate) credential_ttl_ms: i64,
    next_conn: AtomicU64,
    /// Egress proxies of environments in a phase that may reach the network.
    egress: egress_gate::Gates,
    /// Parked sessions whose workspace their box keeps (see `park.rs`). In memory only: after
    /// a restart the next taker of such a box clears what it keeps.
    kept: Mutex<HashMap<SessionId, park::KeptWorkspace>>,
    /// Cancelled when the gateway stops: worker endpoints stop accepting and connections end
    /// without recovery (the workers reconnect to the next gateway).
    stopping: CancellationToken,
}

impl WorkerSide {
    pub(crate) fn new(
        handles: Handles,
        signer: Signer,
        socket_dir: PathBuf,
        max_workers: u64,
        web_fetch_allow: Vec<String>,
        credential_ttl: std::time::Duration,
    ) -> WorkerSide {
        WorkerSide {
            store: handles.store,
            hub: handles.hub,
            envs: handles.envs,
            egress_dir: handles.egress_dir,
            session_processes: handles.session_processes,
            tmp_dir: handles.tmp_dir,
            artifacts_dir: handles.artifacts_dir,
            fills: handles.fills,
            vault: handles.vault,
            barrier_fault: handles.barrier_fault,
            approvals: handles.approvals,
            lent: handles.lent,
            _hold: handles.hold,
            signer,
            live: Mutex::new(HashMap::new()),
            listeners: Mutex::new(HashMap::new()),
            models: Mutex::new(HashMap::new()),
            socket_dir,
            max_workers,
            web_fetch_allow,
            credential_ttl_ms: i64::try_from(credential_ttl.as_millis()).unwrap_or(i64::MAX),
            next_conn: AtomicU64::new(1),
            egress: egress_gate::Gates::default(),
            kept: Mutex::new(HashMap::new()),
            stopping: CancellationToken::new(),
        }
    }

    /// The gateway is stopping: no worker connection is accepted or kept, and a lost one is
    /// not recovered, so nothing of the worker side outlives the gateway's shutdown.
    pub(crate) fn stop(&self) {
        self.stopping.cancel();
        for (_, stop) in lock(&self.listeners).drain() {
            stop.cancel();
        }
    }

    /// How many sessions' workers are connected now.
    pub(crate) fn connected(&self) -> u64 {
        let live: Vec<Arc<Live>> = lock(&self.live).values().cloned().collect();
        live.iter()
            .filter(|l| l.connected_epoch().is_some())
            .count() as u64
    }

    pub(crate) fn live(&self, session: &SessionId) -> Arc<Live> {
        lock(&self.live).entry(session.clone()).or_default().clone()
    }

    /// A run ended: late events naming it are fenced from now on.
    pub(crate) fn run_ended(&self, session: &SessionId, run: &RunId) {
        if let Some(live) = lock(&self.live).get(session) {
            let mut open = lock(&live.open_run);
            if open.as_ref() == Some(run) {
                *open = None;
            }
        }
    }

    /// Drops what is kept in memory for a session's worker.
    pub(crate) fn forget(&self, session: &SessionId) {
        lock(&self.live).remove(session);
    }

    pub(crate) fn socket_path(&self, env: &EnvironmentId) -> PathBuf {
        self.socket_dir.join(format!("{env}.sock"))
    }

    /// Whether the session's worker is connected now (for listings).
    pub(crate) fn tunnel_up(&self, session: &SessionId) -> bool {
        lock(&self.live)
            .get(session)
            .is_some_and(|l| l.connected_epoch().is_some())
    }

    fn recovering(&self, session: &SessionId) -> bool {
        lock(&self.live)
            .get(session)
            .is_some_and(|l| *lock(&l.recovering))
    }

    /// An environment as listings show it: the sessions placed on it and their tunnel.
    pub(crate) fn with_worker(
        &self,
        mut view: skiff_protocol::environment::EnvironmentView,
    ) -> skiff_protocol::environment::EnvironmentView {
        let sessions = self
            .store
            .sessions_on_environment(&view.id)
            .unwrap_or_default();
        view.tunnel = match sessions.first() {
            None => "none".into(),
            Some(s) if self.tunnel_up(s) => "up".into(),
            Some(s) if self.recovering(s) => "reconnecting".into(),
            Some(_) => "down".into(),
        };
        view.attached_sessions = sessions;
        view.egress_hosts = self
            .egress_counters(&view.id)
            .into_iter()
            .map(|c| skiff_protocol::environment::EgressHost {
                phase: match c.phase {
                    crate::egress::Phase::Setup => "setup".into(),
                    crate::egress::Phase::Agent => "agent".into(),
                },
                host: c.host,
                connections: c.connections,
                bytes_out: c.bytes_out,
                bytes_in: c.bytes_in,
                refused: c.refused,
            })
            .collect();
        view
    }

    pub(crate) fn placement_env(
        &self,
        scope: &skiff_store::Scope,
        p: &skiff_store::PlacementRow,
    ) -> crate::Result<skiff_store::EnvironmentRow> {
        let env = p.environment_id.as_ref().ok_or_else(|| {
            crate::Error::Conflict(format!("session {} has no environment", p.session_id))
        })?;
        Ok(self.store.environment(scope, env)?)
    }

    /// Publishes a move's step and returns its cursor (0 when it could not be published: the
    /// follower then reads from the start).
    fn announce(
        &self,
        scope: &skiff_store::Scope,
        id: &SessionId,
        state: skiff_protocol::environment::PlacementState,
        environment_id: Option<EnvironmentId>,
        detail: &str,
    ) -> u64 {
        tracing::info!(session = %id, placement = %state, detail, "placement");
        let event = skiff_protocol::event::EventKind::Placement {
            state,
            environment_id,
            detail: detail.to_owned(),
        };
        match self.hub.publish(scope, id, None, event) {
            Ok(e) => e.cursor,
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "could not publish a placement step");
                0
            }
        }
    }

    fn audit_worker(
        &self,
        scope: &skiff_store::Scope,
        action: &str,
        target: &str,
        decision: &str,
        detail: serde_json::Value,
    ) {
        if let Err(e) = self
            .store
            .audit(scope, "worker", action, target, decision, &detail)
        {
            tracing::warn!(action, error = %e, "could not write an audit row");
        }
    }

    /// Stops every background process of a session that leaves the gateway (kept ones too):
    /// its workspace is about to be somewhere else.
    fn end_session_processes(&self, session: &SessionId) {
        let gone = lock(&self.session_processes).remove(session);
        // Dropping the last handle stops the processes (a turn in flight holds none: a
        // session only moves at a turn boundary or after its turn was cancelled).
        drop(gone);
    }

    fn audit(
        &self,
        scope: &skiff_store::Scope,
        action: &str,
        target: &str,
        decision: &str,
        detail: serde_json::Value,
    ) {
        crate::sessions::audit_row(&*self.store, scope, action, target, decision, detail);
    }

    /// Revokes every pending approval of a session that moves or fails over: each waiting
    /// call gets an error saying `why`.
    pub(crate) fn revoke_approvals(&self, scope: &skiff_store::Scope, id: &SessionId, why: &str) {
        self.approvals.revoke(scope, id, why);
    }

    /// A profile a session may be placed on, or an error naming the configured ones.
    pub(crate) fn check_profile(&self, profile: &str) -> crate::Result<()> {
        crate::sessions::check_profile(&self.envs, profile)
    }

    /// The transcript and run-status writes, on the worker side's store and hub.
    pub(crate) fn transcript(&self) -> crate::transcript::Transcript<'_> {
        crate::transcript::Transcript {
            store: &*self.store,
            hub: &self.hub,
        }
    }

    fn conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}
