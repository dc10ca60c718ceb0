//! Several gateways on one database (issue 17): the gateway registry, the leases by which
//! exactly one gateway at a time owns a session's live work or a gateway-wide chore, the
//! fence that makes a run's writes conditional on the lease, and wake-ups for events another
//! process appended.
//!
//! **Time is the database's.** Every expiry is computed and compared by the database's clock
//! (PostgreSQL `clock_timestamp()`, SQLite `unixepoch('subsec')`), never the caller's: callers
//! pass durations only, so two gateways whose clocks disagree still agree on who holds what.
//!
//! **Expiry decides who may take over; the epoch decides who may write.** A lease's epoch
//! grows by one every time its holder changes (a take-over, or a claim after a release).
//! Fenced writes check holder and epoch — not expiry — under the lease row's lock in their
//! own transaction, and a take-over bumps the epoch under the same lock, so a write and a
//! take-over are ordered: there is no moment at which two gateways may both write. A holder
//! whose lease merely expired, with nobody taking it over, may renew it and go on.

use crate::{Error, Result, Scope};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{AttemptId, EntryId, GatewayId, RunId, SessionId};
use std::fmt;
use std::time::Duration;

/// What a lease is on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LeaseKey {
    /// A session's live work: its runs, its worker connection, its box's SSH masters.
    Session(SessionId),
    /// A gateway-wide chore that one gateway at a time does (`"sweeper"`, `"lifetime-tick"`).
    Singleton(String),
}

impl LeaseKey {
    pub fn singleton(name: impl Into<String>) -> Self {
        LeaseKey::Singleton(name.into())
    }

    /// The `kind` column.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            LeaseKey::Session(_) => "session",
            LeaseKey::Singleton(_) => "singleton",
        }
    }

    /// The `name` column.
    pub(crate) fn name(&self) -> &str {
        match self {
            LeaseKey::Session(id) => id.as_str(),
            LeaseKey::Singleton(name) => name,
        }
    }

    pub(crate) fn from_columns(kind: &str, name: &str) -> Result<Self> {
        match kind {
            "session" => SessionId::parse(name)
                .map(LeaseKey::Session)
                .ok_or_else(|| corrupt(format!("malformed session id {name:?}"))),
            "singleton" => Ok(LeaseKey::Singleton(name.to_string())),
            other => Err(corrupt(format!("unknown lease kind {other:?}"))),
        }
    }
}

impl fmt::Display for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseKey::Session(id) => write!(f, "session {id}"),
            LeaseKey::Singleton(name) => write!(f, "the {name:?} lease"),
        }
    }
}

fn corrupt(detail: String) -> Error {
    Error::Corrupt {
        what: "lease",
        detail,
    }
}

/// A gateway as the registry knows it. Times are the database's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayRow {
    pub id: GatewayId,
    /// Where other gateways reach it (`host:port`), for routing a client to a session's owner.
    pub address: String,
    pub started_at_ms: i64,
    pub heartbeat_at_ms: i64,
    /// Whether it beat within the `alive_within` the list was asked with.
    pub alive: bool,
}

/// A held lease, as the database saw it when it answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub key: LeaseKey,
    pub holder: GatewayId,
    /// One more every time the holder changes.
    pub epoch: i64,
    pub expires_at_ms: i64,
    /// Whether it had expired by the database's clock when read.
    pub expired: bool,
}

impl Lease {
    /// The fence a session lease's holder puts on the session's writes; `None` for a
    /// singleton lease (nothing is written under one).
    pub fn fence(&self) -> Option<Fence> {
        match &self.key {
            LeaseKey::Session(session) => Some(Fence {
                session: session.clone(),
                gateway: self.holder.clone(),
                epoch: self.epoch,
            }),
            LeaseKey::Singleton(_) => None,
        }
    }
}

/// What a claim got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The lease is the caller's now.
    Won(Lease),
    /// Another gateway holds it (live, or it moved on since the caller read it).
    Held(Lease),
}

impl Claim {
    pub fn won(self) -> Option<Lease> {
        match self {
            Claim::Won(lease) => Some(lease),
            Claim::Held(_) => None,
        }
    }
}

/// "This write belongs to `session`'s run, owned by `gateway` at `epoch`": checked, under the
/// lease row's lock, in the write's own transaction. A mismatch is [`Error::LeaseLost`] and
/// nothing is written.
///
/// Any write can be fenced: single-statement writes on PostgreSQL run inside
/// `Connection::run_fenced`; writes with a transaction of their own call `fence::check_pg`
/// (PostgreSQL) or `leases::check_fence` (SQLite) first thing in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    pub session: SessionId,
    pub gateway: GatewayId,
    pub epoch: i64,
}

impl Fence {
    /// Judges the lease row read under its lock (`(holder, epoch)`, `None`: no row): `Ok`
    /// only when this fence's gateway holds it at this fence's epoch.
    pub(crate) fn check(&self, row: Option<(Option<String>, i64)>) -> Result<()> {
        match row {
            Some((Some(holder), epoch))
                if holder == self.gateway.as_str() && epoch == self.epoch =>
            {
                Ok(())
            }
            row => Err(lease_lost(
                &LeaseKey::Session(self.session.clone()),
                &self.gateway,
                self.epoch,
                row.and_then(|(holder, epoch)| holder.map(|h| (h, epoch))),
            )),
        }
    }
}

/// The refusal of a write, renewal or release by `gateway` at `epoch` when the lease is now
/// `current` (`(holder, epoch)`, `None`: nobody holds it).
pub(crate) fn lease_lost(
    key: &LeaseKey,
    gateway: &GatewayId,
    epoch: i64,
    current: Option<(String, i64)>,
) -> Error {
    Error::LeaseLost {
        lease: key.to_string(),
        gateway: gateway.to_string(),
        epoch,
        now: match current {
            Some((holder, epoch)) => format!("held by {holder} at epoch {epoch}"),
            None => "held by nobody".to_string(),
        },
    }
}

/// A holder column's text as its gateway id.
pub(crate) fn gateway_id(text: &str) -> Result<GatewayId> {
    GatewayId::parse(text).ok_or_else(|| Error::Corrupt {
        what: "gateway id",
        detail: format!("malformed id {text:?}"),
    })
}

/// A TTL as the milliseconds added to the database's now.
pub(crate) fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2)
}

/// The gateway registry and leases. Unscoped: this is the gateways' own work across owners
/// and tenants, like worker slots.
pub trait Leases: Send + Sync {
    /// Records a gateway (again, after a restart: its start time and address are replaced).
    fn register_gateway(&self, id: &GatewayId, address: &str) -> Result<GatewayRow>;
    /// The gateway is alive now (database time); "not found" if it never registered.
    fn heartbeat(&self, id: &GatewayId) -> Result<GatewayRow>;
    /// Every registered gateway, `alive` when it beat within `alive_within`; oldest first.
    fn gateways(&self, alive_within: Duration) -> Result<Vec<GatewayRow>>;
    /// The database's clock, in Unix milliseconds.
    fn database_now_ms(&self) -> Result<i64>;
    /// Forgets a gateway that is leaving for good (`skiff gateway drain`): it is no longer
    /// listed, and no request is routed to it. Its leases are not touched.
    fn deregister_gateway(&self, id: &GatewayId) -> Result<()>;

    /// Claims `key` for `gateway` until `ttl` from now if it is free, expired, or already
    /// the caller's (then only extended, same epoch). A change of holder adds one to the
    /// epoch. Two gateways racing get one `Won`.
    fn acquire_lease(&self, key: &LeaseKey, gateway: &GatewayId, ttl: Duration) -> Result<Claim>;
    /// Extends a lease the caller holds at `lease.epoch` to `ttl` from now — also after it
    /// expired, as long as nobody took it over. Otherwise [`Error::LeaseLost`].
    fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Lease>;
    /// Gives a lease up (drain, a session gone home); [`Error::LeaseLost`] if it is no longer
    /// the caller's at that epoch. The epoch stays: the next holder gets one more.
    fn release_lease(&self, lease: &Lease) -> Result<()>;
    /// The lease on `key`, if anyone holds it.
    fn lease(&self, key: &LeaseKey) -> Result<Option<Lease>>;
    /// Held leases past their expiry, oldest expiry first: what another gateway takes over.
    fn expired_leases(&self) -> Result<Vec<Lease>>;
    /// Sessions with an unfinished run whose lease nobody holds: a draining gateway released
    /// it while the turn ran (a turn's own end releases the lease only after its run ended),
    /// so another gateway claims it at once and goes on with the run.
    fn released_open_sessions(&self) -> Result<Vec<SessionId>>;
    /// Held leases whose holder did not beat within `alive_within` (or never registered).
    fn leases_of_dead_gateways(&self, alive_within: Duration) -> Result<Vec<Lease>>;
    /// Takes over `expired` (as listed) for `gateway`, epoch + 1, if it is still that lease
    /// and still expired — or has been released since. `Held` when it moved on (renewed,
    /// or taken over by another gateway first).
    fn take_over_lease(&self, expired: &Lease, gateway: &GatewayId, ttl: Duration)
    -> Result<Claim>;

    /// [`SessionStore::append_entries`](crate::SessionStore::append_entries), if `fence`
    /// still holds the session's lease; [`Error::LeaseLost`] and nothing written otherwise.
    fn append_entries_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>>;
    /// [`EventLog::append_event`](crate::EventLog::append_event), fenced the same way.
    fn append_event_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent>;
    /// [`RunStore::transition_run`](crate::RunStore::transition_run), fenced the same way.
    fn transition_run_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<crate::RunRow>;
    /// [`RunStore::resume_attempt`](crate::RunStore::resume_attempt) (a fresh attempt with
    /// the default `resume`), fenced the same way.
    fn resume_attempt_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        run: &crate::RunRow,
        runtime_node: &str,
        resume: crate::Resume<'_>,
    ) -> Result<AttemptId>;
    /// [`RunStore::finish_attempt`](crate::RunStore::finish_attempt), fenced the same way.
    fn finish_attempt_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        id: &AttemptId,
        status: crate::AttemptStatus,
        error: Option<&str>,
    ) -> Result<()>;
    /// The session's unfinished run with its scope, whoever owns it: what a gateway that
    /// took the session's lease over goes on with.
    fn open_run_of(&self, session: &SessionId) -> Result<Option<(Scope, crate::RunRow)>>;
    /// At a gateway's start: [`Turns::orphan_active_on_start`](crate::Turns::orphan_active_on_start)
    /// for the runs of sessions whose lease is free, expired or `gateway`'s own — never the
    /// runs of a session another gateway holds unexpired (it is running them).
    fn orphan_unleased_on_start(
        &self,
        gateway: &GatewayId,
        reason: &str,
    ) -> Result<Vec<(Scope, crate::RunRow)>>;
}

/// Hints that events were appended, possibly by another process. See [`crate::Follower`]:
/// a hint is never the event, only a reason to read by cursor.
pub trait EventWakeups: Send + Sync {
    /// Hints for `session`'s appends (every session's with `None`), from this process and —
    /// on PostgreSQL — from every other process on the database.
    fn subscribe_events(&self, session: Option<&SessionId>) -> Result<crate::EventHints>;
}
