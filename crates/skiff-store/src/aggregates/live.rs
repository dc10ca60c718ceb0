//! The live-work aggregates: where a session's work runs (placements and the worker slots they
//! hold), the worker protocol's durable rows (cached operation replies, ACK cursors, admitted
//! credentials), the boxes (environments) and the snapshots boxes start from.
//!
//! Each method's contract is the SQLite method's of the same name. What must hold across
//! gateways holds in the database on both backends: a placement moves only from the state read
//! in the same transaction (under the session's row lock on PostgreSQL), worker-slot claims
//! are serialized so concurrent claims never exceed the cap, a credential is admitted once,
//! and a scoped read of another owner's or tenant's row is "not found".

use crate::{
    CachedOp, EnvironmentRow, IdlePlacement, NewSnapshot, PlacementChange, PlacementRow, Result,
    Scope, Sight, SnapshotRow, Store, WorkerSlots,
};
use skiff_protocol::environment::{EgressAccounting, EnvironmentState, PlacementState};
use skiff_protocol::worker::StreamKind;
use skiff_protocol::{EnvironmentId, RunId, SessionId, SnapshotId};
use std::collections::BTreeMap;

/// Placements of sessions on worker boxes and the worker slots they hold.
pub trait PlacementStore: Send + Sync {
    /// `local|reclaimed|failed|parked|failed_over → requested` on `profile`, claiming one of
    /// `max_live` worker slots (`WorkersAtCapacity` when none is free).
    fn request_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow>;
    /// `local → handing_off` for a live dispatch, holding a slot, while `run` is still open
    /// (`RunEnded` otherwise).
    fn claim_live_dispatch(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow>;
    fn placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>>;
    /// Placements that hold or are getting a box, across scopes.
    fn live_placements(&self) -> Result<Vec<PlacementRow>>;
    /// Sessions placed on `env` and not settled.
    fn sessions_on_environment(&self, env: &EnvironmentId) -> Result<Vec<SessionId>>;
    fn worker_slots(&self) -> Result<WorkerSlots>;
    /// Active sessions with no turn open and a box in step, the longest idle first.
    fn idle_placements(&self) -> Result<Vec<IdlePlacement>>;
    /// `active → parked` unless a turn is open or the box is ahead (`None` then).
    fn park_placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>>;
    /// `active → draining` when no turn is open (`SessionBusy` otherwise); the row as it was.
    fn claim_pull_back(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow>;
    /// `→ local`, advancing the owner epoch and forgetting the box; the row as it was.
    fn come_home(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow>;
    /// `reclaimed → failed_over`, forgetting the dead box and recording `why`.
    fn begin_failover(&self, scope: &Scope, session: &SessionId, why: &str)
    -> Result<PlacementRow>;
    /// Moves a placement to `to` if the state machine allows it from where it is.
    fn transition_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        to: PlacementState,
        change: &PlacementChange<'_>,
    ) -> Result<PlacementRow>;
    fn mark_box_ahead(&self, scope: &Scope, session: &SessionId) -> Result<()>;
    fn mark_box_in_step(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()>;
    fn set_placement_base_manifest(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()>;
}

/// The worker protocol's durable rows, keyed by session and owner epoch (unscoped: the
/// worker's connection has already proved whose session it serves).
pub trait WorkerOpStore: Send + Sync {
    fn worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<Option<CachedOp>>;
    /// Records a terminal reply; recording the same operation again keeps the first.
    fn record_worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
        op: &CachedOp,
    ) -> Result<()>;
    fn worker_cursors(&self, session: &SessionId, epoch: u64) -> Result<BTreeMap<StreamKind, u64>>;
    /// Moves a stream's ACK cursor forward, never back.
    fn advance_worker_cursor(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<()>;
    /// Admits a credential once: `false` for a replay, whichever gateway saw it first.
    fn use_worker_credential(
        &self,
        credential_id: &str,
        session: &SessionId,
        env: &EnvironmentId,
    ) -> Result<bool>;
}

/// Environments (leased boxes).
pub trait EnvironmentStore: Send + Sync {
    fn create_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        profile: &str,
        provider: &str,
        op_id: &str,
    ) -> Result<EnvironmentRow> {
        self.create_environment_from(scope, id, profile, provider, op_id, None)
    }
    fn create_environment_from(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        profile: &str,
        provider: &str,
        op_id: &str,
        snapshot: Option<&SnapshotId>,
    ) -> Result<EnvironmentRow>;
    fn environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<EnvironmentRow>;
    /// Newest first, destroyed ones included.
    fn environments(&self, sight: &Sight) -> Result<Vec<EnvironmentRow>>;
    fn environment_owner(&self, id: &EnvironmentId) -> Result<Option<Scope>>;
    /// Every environment not destroyed, across scopes, oldest first.
    fn live_environments(&self) -> Result<Vec<EnvironmentRow>>;
    fn transition_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        to: EnvironmentState,
        error: Option<&str>,
    ) -> Result<EnvironmentRow>;
    fn set_environment_lease(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        lease_id: &str,
        lease_json: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<()>;
    fn set_environment_prepared(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        key: Option<&str>,
    ) -> Result<()>;
    fn set_environment_bundle(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        bundle_hash: &str,
    ) -> Result<()>;
    fn set_environment_expiry(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        expires_at_ms: i64,
    ) -> Result<()>;
    fn touch_environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<()>;
    fn add_environment_egress(&self, env: &EnvironmentId, add: EgressAccounting) -> Result<()>;
}

/// Snapshots of prepared boxes.
pub trait SnapshotStore: Send + Sync {
    fn record_snapshot(&self, scope: &Scope, new: &NewSnapshot<'_>) -> Result<SnapshotRow>;
    fn snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow>;
    /// Most recently used first.
    fn snapshots(&self, sight: &Sight) -> Result<Vec<SnapshotRow>>;
    fn snapshot_captured(
        &self,
        scope: &Scope,
        id: &SnapshotId,
        size_bytes: u64,
    ) -> Result<SnapshotRow>;
    fn mark_snapshot_deleting(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow>;
    fn delete_snapshot_row(&self, scope: &Scope, id: &SnapshotId) -> Result<()>;
    /// The newest ready snapshot for `key`, marked used now.
    fn find_ready_snapshot(
        &self,
        scope: &Scope,
        profile: &str,
        key: &str,
    ) -> Result<Option<SnapshotRow>>;
    fn touch_snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow>;
    /// The ready snapshots of `profile` to delete so the rest fit `budget_bytes`.
    fn evict_plan(&self, profile: &str, budget_bytes: u64) -> Result<Vec<SnapshotRow>>;
    fn unsettled_snapshots(&self) -> Result<Vec<SnapshotRow>>;
    fn snapshot_known(&self, id: &SnapshotId) -> Result<bool>;
}

// The SQLite store implements each trait with its own methods (inherent methods win the name
// lookup, so each line below calls the SQLite code, not itself).

impl PlacementStore for Store {
    fn request_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow> {
        Store::request_placement(self, scope, session, profile, max_live)
    }
    fn claim_live_dispatch(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow> {
        Store::claim_live_dispatch(self, scope, session, run, profile, max_live)
    }
    fn placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>> {
        Store::placement(self, scope, session)
    }
    fn live_placements(&self) -> Result<Vec<PlacementRow>> {
        Store::live_placements(self)
    }
    fn sessions_on_environment(&self, env: &EnvironmentId) -> Result<Vec<SessionId>> {
        Store::sessions_on_environment(self, env)
    }
    fn worker_slots(&self) -> Result<WorkerSlots> {
        Store::worker_slots(self)
    }
    fn idle_placements(&self) -> Result<Vec<IdlePlacement>> {
        Store::idle_placements(self)
    }
    fn park_placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>> {
        Store::park_placement(self, scope, session)
    }
    fn claim_pull_back(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow> {
        Store::claim_pull_back(self, scope, session)
    }
    fn come_home(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow> {
        Store::come_home(self, scope, session)
    }
    fn begin_failover(
        &self,
        scope: &Scope,
        session: &SessionId,
        why: &str,
    ) -> Result<PlacementRow> {
        Store::begin_failover(self, scope, session, why)
    }
    fn transition_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        to: PlacementState,
        change: &PlacementChange<'_>,
    ) -> Result<PlacementRow> {
        Store::transition_placement(self, scope, session, to, change)
    }
    fn mark_box_ahead(&self, scope: &Scope, session: &SessionId) -> Result<()> {
        Store::mark_box_ahead(self, scope, session)
    }
    fn mark_box_in_step(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()> {
        Store::mark_box_in_step(self, scope, session, base_manifest)
    }
    fn set_placement_base_manifest(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()> {
        Store::set_placement_base_manifest(self, scope, session, base_manifest)
    }
}

impl WorkerOpStore for Store {
    fn worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<Option<CachedOp>> {
        Store::worker_op(self, session, epoch, stream, seq)
    }
    fn record_worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
        op: &CachedOp,
    ) -> Result<()> {
        Store::record_worker_op(self, session, epoch, stream, seq, op)
    }
    fn worker_cursors(&self, session: &SessionId, epoch: u64) -> Result<BTreeMap<StreamKind, u64>> {
        Store::worker_cursors(self, session, epoch)
    }
    fn advance_worker_cursor(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<()> {
        Store::advance_worker_cursor(self, session, epoch, stream, seq)
    }
    fn use_worker_credential(
        &self,
        credential_id: &str,
        session: &SessionId,
        env: &EnvironmentId,
    ) -> Result<bool> {
        Store::use_worker_credential(self, credential_id, session, env)
    }
}

impl EnvironmentStore for Store {
    fn create_environment_from(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        profile: &str,
        provider: &str,
        op_id: &str,
        snapshot: Option<&SnapshotId>,
    ) -> Result<EnvironmentRow> {
        Store::create_environment_from(self, scope, id, profile, provider, op_id, snapshot)
    }
    fn environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<EnvironmentRow> {
        Store::environment(self, scope, id)
    }
    fn environments(&self, sight: &Sight) -> Result<Vec<EnvironmentRow>> {
        Store::environments(self, sight)
    }
    fn environment_owner(&self, id: &EnvironmentId) -> Result<Option<Scope>> {
        Store::environment_owner(self, id)
    }
    fn live_environments(&self) -> Result<Vec<EnvironmentRow>> {
        Store::live_environments(self)
    }
    fn transition_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        to: EnvironmentState,
        error: Option<&str>,
    ) -> Result<EnvironmentRow> {
        Store::transition_environment(self, scope, id, to, error)
    }
    fn set_environment_lease(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        lease_id: &str,
        lease_json: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<()> {
        Store::set_environment_lease(self, scope, id, lease_id, lease_json, expires_at_ms)
    }
    fn set_environment_prepared(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        key: Option<&str>,
    ) -> Result<()> {
        Store::set_environment_prepared(self, scope, id, key)
    }
    fn set_environment_bundle(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        bundle_hash: &str,
    ) -> Result<()> {
        Store::set_environment_bundle(self, scope, id, bundle_hash)
    }
    fn set_environment_expiry(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        expires_at_ms: i64,
    ) -> Result<()> {
        Store::set_environment_expiry(self, scope, id, expires_at_ms)
    }
    fn touch_environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<()> {
        Store::touch_environment(self, scope, id)
    }
    fn add_environment_egress(&self, env: &EnvironmentId, add: EgressAccounting) -> Result<()> {
        Store::add_environment_egress(self, env, add)
    }
}

impl SnapshotStore for Store {
    fn record_snapshot(&self, scope: &Scope, new: &NewSnapshot<'_>) -> Result<SnapshotRow> {
        Store::record_snapshot(self, scope, new)
    }
    fn snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        Store::snapshot(self, scope, id)
    }
    fn snapshots(&self, sight: &Sight) -> Result<Vec<SnapshotRow>> {
        Store::snapshots(self, sight)
    }
    fn snapshot_captured(
        &self,
        scope: &Scope,
        id: &SnapshotId,
        size_bytes: u64,
    ) -> Result<SnapshotRow> {
        Store::snapshot_captured(self, scope, id, size_bytes)
    }
    fn mark_snapshot_deleting(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        Store::mark_snapshot_deleting(self, scope, id)
    }
    fn delete_snapshot_row(&self, scope: &Scope, id: &SnapshotId) -> Result<()> {
        Store::delete_snapshot_row(self, scope, id)
    }
    fn find_ready_snapshot(
        &self,
        scope: &Scope,
        profile: &str,
        key: &str,
    ) -> Result<Option<SnapshotRow>> {
        Store::find_ready_snapshot(self, scope, profile, key)
    }
    fn touch_snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        Store::touch_snapshot(self, scope, id)
    }
    fn evict_plan(&self, profile: &str, budget_bytes: u64) -> Result<Vec<SnapshotRow>> {
        Store::evict_plan(self, profile, budget_bytes)
    }
    fn unsettled_snapshots(&self) -> Result<Vec<SnapshotRow>> {
        Store::unsettled_snapshots(self)
    }
    fn snapshot_known(&self, id: &SnapshotId) -> Result<bool> {
        Store::snapshot_known(self, id)
    }
}
