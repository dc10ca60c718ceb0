//! The store's seam: one trait per aggregate, each implemented by the SQLite [`Store`] and by
//! the PostgreSQL [`PgStore`](crate::PgStore), both held to one conformance suite
//! (`tests/it/conformance.rs`).
//!
//! The traits are synchronous and object safe, like the SQLite store's own methods, so the
//! gateway can hold either backend as `dyn Backend` and call it exactly as it calls `Store`
//! today. Each method's contract is the one the SQLite method it mirrors documents; the
//! invariants that matter across processes hold in the database itself on both backends:
//! event cursors are assigned by the database, the transcript leaf moves only by a
//! compare-and-swap, a session has at most one open run and a run at most one active attempt
//! (partial unique indexes), and a scoped read of another owner's or tenant's row is "not
//! found".
//!
//! The live-work aggregates (placements and worker slots, the worker protocol's rows,
//! environments, snapshots) are in `aggregates/live.rs`; the people and governance aggregates
//! (users and tokens, audit, approvals, grants, the vault, agent specs, usage) in [`people`],
//! artifact rows in [`artifacts`]; sessions made from or with others (placed at creation,
//! children, forks, fan-out groups) in [`lineage`]; turn admission, session choices, a
//! worker's acknowledged events and the restart's reconciliation in [`turns`]; the session
//! list page, `owner_of`, gauges, readiness and the audit listener in [`overview`]; the
//! gateway registry, leases, fenced writes and event wake-ups for several gateways on one
//! database in [`leases`]. The gateway holds every one of them as `dyn Backend`
//! ([`crate::open_backend`]).

mod artifacts;
pub(crate) mod leases;
mod lineage;
mod live;
mod overview;
mod people;
mod turns;
pub use artifacts::Artifacts;
pub use leases::{EventWakeups, Leases};
pub use lineage::Lineage;
pub use live::{EnvironmentStore, PlacementStore, SnapshotStore, WorkerOpStore};
pub use overview::Overview;
pub use people::{AgentSpecs, Approvals, AuditLog, Grants, People, UsageLedger, Vault};
pub use turns::Turns;

use crate::{AttemptRow, NewSession, Result, Resume, RunRow, Scope, SessionRow, Store};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{AttemptId, EntryId, RunId, SessionId};

/// Sessions and their transcript tree.
pub trait SessionStore: Send + Sync {
    fn create_session(&self, scope: &Scope, new: &NewSession) -> Result<SessionRow>;
    /// The session, or "not found" outside `scope`.
    fn session(&self, scope: &Scope, id: &SessionId) -> Result<SessionRow>;
    /// Sessions of the scope, newest activity first.
    fn sessions(&self, scope: &Scope) -> Result<Vec<SessionRow>>;
    /// Appends `bodies` as a chain under the leaf if the leaf is still `base_leaf`
    /// (`LeafConflict` otherwise); the store assigns ids and parent ids.
    fn append_entries(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>>;
    /// The session's current leaf entry, if the transcript is not empty.
    fn leaf(&self, scope: &Scope, session: &SessionId) -> Result<Option<EntryId>>;
    /// The transcript from the root to the leaf.
    fn transcript(&self, scope: &Scope, session: &SessionId) -> Result<Vec<TranscriptEntry>>;
}

/// The per-session event log.
pub trait EventLog: Send + Sync {
    /// Appends an event; the database assigns its cursor (the session's next, from 1).
    fn append_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent>;
    /// The cursor of the session's newest event (0 when it has none).
    fn last_event_cursor(&self, scope: &Scope, session: &SessionId) -> Result<u64>;
    /// Up to `limit` events after `cursor`, oldest first.
    fn events_after(
        &self,
        scope: &Scope,
        session: &SessionId,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<SessionEvent>>;
}

/// Runs (turns) and their attempts.
pub trait RunStore: Send + Sync {
    /// Admits a turn: a queued run, unless the session has an unfinished one (`SessionBusy`).
    fn create_run(&self, scope: &Scope, session: &SessionId, model_ref: &str) -> Result<RunRow>;
    fn run(&self, scope: &Scope, id: &RunId) -> Result<RunRow>;
    /// Runs of a session, oldest first.
    fn runs(&self, scope: &Scope, session: &SessionId) -> Result<Vec<RunRow>>;
    /// The session's unfinished run, if any.
    fn open_run(&self, scope: &Scope, session: &SessionId) -> Result<Option<RunRow>>;
    /// Moves a run to `to` if the state machine allows it from where it is.
    fn transition_run(
        &self,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow>;
    /// Starts an attempt, taking the run over from an earlier one when `resume` says so;
    /// refused (`AttemptActive`) while another attempt of the run is active.
    fn resume_attempt(
        &self,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
        resume: Resume<'_>,
    ) -> Result<AttemptId>;
    /// Starts a fresh attempt of `run`.
    fn start_attempt(
        &self,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
    ) -> Result<AttemptId> {
        self.resume_attempt(scope, run, runtime_node, owner_epoch, Resume::default())
    }
    /// Ends an active attempt (an attempt already ended is left as it is).
    fn finish_attempt(
        &self,
        scope: &Scope,
        id: &AttemptId,
        status: crate::AttemptStatus,
        error: Option<&str>,
    ) -> Result<()>;
    /// Every attempt of the session's runs, oldest first.
    fn attempts(&self, scope: &Scope, session: &SessionId) -> Result<Vec<AttemptRow>>;
}

/// Every aggregate that both backends implement.
pub trait Backend:
    SessionStore
    + EventLog
    + RunStore
    + PlacementStore
    + WorkerOpStore
    + EnvironmentStore
    + SnapshotStore
    + People
    + AuditLog
    + Approvals
    + Grants
    + Vault
    + AgentSpecs
    + UsageLedger
    + Artifacts
    + Lineage
    + Turns
    + Overview
    + Leases
    + EventWakeups
{
}

impl<T> Backend for T where
    T: SessionStore
        + EventLog
        + RunStore
        + PlacementStore
        + WorkerOpStore
        + EnvironmentStore
        + SnapshotStore
        + People
        + AuditLog
        + Approvals
        + Grants
        + Vault
        + AgentSpecs
        + UsageLedger
        + Artifacts
        + Lineage
        + Turns
        + Overview
        + Leases
        + EventWakeups
{
}

// The SQLite store implements each trait with its own methods (inherent methods win the
// name lookup, so each line below calls the SQLite code, not itself).

impl SessionStore for Store {
    fn create_session(&self, scope: &Scope, new: &NewSession) -> Result<SessionRow> {
        Store::create_session(self, scope, new)
    }
    fn session(&self, scope: &Scope, id: &SessionId) -> Result<SessionRow> {
        Store::session(self, scope, id)
    }
    fn sessions(&self, scope: &Scope) -> Result<Vec<SessionRow>> {
        Store::sessions(self, scope)
    }
    fn append_entries(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>> {
        Store::append_entries(self, scope, session, base_leaf, run, bodies)
    }
    fn leaf(&self, scope: &Scope, session: &SessionId) -> Result<Option<EntryId>> {
        Store::leaf(self, scope, session)
    }
    fn transcript(&self, scope: &Scope, session: &SessionId) -> Result<Vec<TranscriptEntry>> {
        Store::transcript(self, scope, session)
    }
}

impl EventLog for Store {
    fn append_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent> {
        Store::append_event(self, scope, session, run, kind)
    }
    fn last_event_cursor(&self, scope: &Scope, session: &SessionId) -> Result<u64> {
        Store::last_event_cursor(self, scope, session)
    }
    fn events_after(
        &self,
        scope: &Scope,
        session: &SessionId,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<SessionEvent>> {
        Store::events_after(self, scope, session, cursor, limit)
    }
}

impl RunStore for Store {
    fn create_run(&self, scope: &Scope, session: &SessionId, model_ref: &str) -> Result<RunRow> {
        Store::create_run(self, scope, session, model_ref)
    }
    fn run(&self, scope: &Scope, id: &RunId) -> Result<RunRow> {
        Store::run(self, scope, id)
    }
    fn runs(&self, scope: &Scope, session: &SessionId) -> Result<Vec<RunRow>> {
        Store::runs(self, scope, session)
    }
    fn open_run(&self, scope: &Scope, session: &SessionId) -> Result<Option<RunRow>> {
        Store::open_run(self, scope, session)
    }
    fn transition_run(
        &self,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        Store::transition_run(self, scope, id, to, error)
    }
    fn resume_attempt(
        &self,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
        resume: Resume<'_>,
    ) -> Result<AttemptId> {
        Store::resume_attempt(self, scope, run, runtime_node, owner_epoch, resume)
    }
    fn finish_attempt(
        &self,
        scope: &Scope,
        id: &AttemptId,
        status: crate::AttemptStatus,
        error: Option<&str>,
    ) -> Result<()> {
        Store::finish_attempt(self, scope, id, status, error)
    }
    fn attempts(&self, scope: &Scope, session: &SessionId) -> Result<Vec<AttemptRow>> {
        Store::attempts(self, scope, session)
    }
}

impl EventWakeups for Store {
    fn subscribe_events(&self, session: Option<&SessionId>) -> Result<crate::EventHints> {
        Ok(self.wakeups.subscribe(session))
    }
}
