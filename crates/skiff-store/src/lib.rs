//! Persistence for the gateway, on SQLite (embedded, the default) or PostgreSQL: sessions, the
//! transcript tree, runs and their state machine, attempts, the per-session event log,
//! environments, snapshots, tokens and audit rows, and the vault's sealed secrets.
//!
//! This is the only crate that speaks SQL. Every table but the worker protocol's own
//! (`worker_ops`, `worker_cursors`, `worker_credentials`) and the gateway-wide vault
//! (`secrets`, admin only) carries `owner_id` and `tenant_id`,
//! and every query a client's request reaches filters by the caller's [`Scope`], or for the
//! lists by their [`Sight`] (their own rows, or their tenant's): a caller asking for a row they
//! cannot see gets "not found". The unscoped queries are the gateway's own
//! work across scopes (token verification, restart reconciliation, worker slots, snapshot
//! eviction, blob references, the worker protocol's rows). State changes go through checked
//! transitions ([`transition`]) inside a transaction; an illegal move is an error, never a
//! panic.
//!
//! The connection is synchronous (rusqlite, WAL). Calls are short and serialized by one mutex;
//! callers in async code call them directly.
//!
//! The store is a set of per-aggregate traits ([`aggregates`], all in [`Backend`]) with two
//! implementations: this SQLite [`Store`] and [`PgStore`] on PostgreSQL (`pg`), held to one
//! conformance suite. The gateway holds whichever [`open_backend`] opened as `dyn Backend`.

mod agents;
pub mod aggregates;
mod approvals;
mod artifacts;
mod audit;
pub mod copy;
mod environments;
mod error;
mod events;
mod fork;
mod grants;
mod groups;
mod ids;
mod leases;
mod listing;
mod metrics;
mod migrations;
mod people;
mod pg;
mod placements;
mod runs;
mod secrets;
mod sessions;
mod sight;
mod snapshots;
mod tokens;
mod transcript;
pub mod transition;
mod usage;
mod wakeups;

pub use agents::AgentSpecRow;
pub use aggregates::leases::{Claim, Fence, GatewayRow, Lease, LeaseKey};
pub use aggregates::{
    AgentSpecs, Approvals, Artifacts, AuditLog, Backend, EnvironmentStore, EventLog, EventWakeups,
    Grants, Leases, Lineage, Overview, People, PlacementStore, RunStore, SessionStore,
    SnapshotStore, Turns, UsageLedger, Vault, WorkerOpStore,
};
pub use approvals::NewApproval;
pub use artifacts::{ArtifactRole, ArtifactRow, NewArtifact, Retention};
pub use audit::DAY_MS;
pub use environments::EnvironmentRow;
pub use error::{Error, Result};
pub use grants::{Consumed, NewGrant};
pub use groups::GroupRow;
pub use ids::mint;
pub use listing::SessionListRow;
pub use metrics::{EgressTotals, Gauges};
pub use people::{DEFAULT_TENANT, FIRST_ADMIN, TokenRow, UserRow};
pub use pg::{PgStore, with_password as pg_url_with_password};
pub use placements::{CachedOp, IdlePlacement, PlacementChange, PlacementRow, WorkerSlots};
pub use runs::{Admission, AttemptRow, AttemptStatus, Resume, RunRow};
pub use secrets::{Resealed, SecretRow};
pub use sessions::{NewSession, SessionChoices, SessionRow};
pub use sight::{Owned, Reach, Sight};
pub use snapshots::{NewSnapshot, SnapshotRow};
pub use tokens::AuditRow;
pub use usage::{Used, UsedBy};
pub use wakeups::{EventHints, Follower, Hint};

use rusqlite::Connection;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

/// Who is asking. Every row is scoped by both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub owner_id: String,
    pub tenant_id: String,
}

impl Scope {
    pub fn new(owner_id: impl Into<String>, tenant_id: impl Into<String>) -> Self {
        Self {
            owner_id: owner_id.into(),
            tenant_id: tenant_id.into(),
        }
    }
}

/// The database. Cheap to share behind an `Arc`.
pub struct Store {
    conn: Mutex<Connection>,
    /// Dropping it stops the background checkpointer.
    _checkpointer: Option<std::sync::mpsc::Sender<()>>,
    /// Told the id of each audit row written (`on_audit`).
    audit_listener: std::sync::OnceLock<Box<dyn Fn(i64) + Send + Sync>>,
    /// This process's followers, hinted after each event append.
    wakeups: wakeups::Hub,
}

impl Store {
    /// Opens (creating if needed) the database at `path`, in WAL mode, and migrates it.
    pub fn open(path: &Path) -> Result<Self> {
        let conn = Connection::open(path).map_err(|source| Error::Open {
            path: path.display().to_string(),
            source,
        })?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        let mut store = Self::init(conn)?;
        // Checkpoints copy the WAL back into the database and fsync; done inline they stall
        // whichever commit triggers them for tens of milliseconds (visible as event-delivery
        // tail latency). A background connection checkpoints instead, without blocking writers.
        start_checkpointer(path, &mut store)?;
        Ok(store)
    }

    /// A private in-memory database, for tests and benchmarks.
    pub fn open_in_memory() -> Result<Self> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(mut conn: Connection) -> Result<Self> {
        // NORMAL is durable across application crashes in WAL mode; only an OS crash can lose
        // the last transactions, and never corrupts the file.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        // See `start_checkpointer`: file databases checkpoint in the background.
        conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        migrations::migrate(&mut conn)?;
        Ok(Self {
            conn: Mutex::new(conn),
            _checkpointer: None,
            audit_listener: std::sync::OnceLock::new(),
            wakeups: wakeups::Hub::default(),
        })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite half-written (transactions roll
        // back on drop), so a poisoned lock is safe to keep using.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

fn start_checkpointer(path: &Path, store: &mut Store) -> Result<()> {
    let conn = Connection::open(path).map_err(|source| Error::Open {
        path: path.display().to_string(),
        source,
    })?;
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("skiff-store-checkpoint".into())
        .spawn(move || {
            // Runs until the store is dropped (the sender goes away).
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(CHECKPOINT_EVERY)
            {
                // PASSIVE never blocks writers; a busy database just waits for the next tick.
                let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
            }
            let _ = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
        })
        .map_err(Error::Checkpointer)?;
    store._checkpointer = Some(stop);
    Ok(())
}

/// Where a gateway's store lives.
#[derive(Clone, Copy)]
pub enum Location<'a> {
    /// The embedded SQLite database file (the default).
    Sqlite(&'a Path),
    /// A PostgreSQL database: a `postgres://` url or a `key=value` connection string, and the
    /// password when it is kept out of the url.
    Postgres {
        url: &'a str,
        password: Option<&'a str>,
    },
}

/// Opens the store at `at` — creating and migrating SQLite's file, or connecting to
/// PostgreSQL and bringing its schema up to date — as the backend the gateway holds.
/// Errors name where the database is, never its password.
pub fn open_backend(at: Location<'_>) -> Result<std::sync::Arc<dyn Backend>> {
    Ok(match at {
        Location::Sqlite(path) => std::sync::Arc::new(Store::open(path)?),
        Location::Postgres { url, password } => {
            std::sync::Arc::new(PgStore::connect_with(url, password)?)
        }
    })
}

/// Now, as the `*_at_ms` columns store it: Unix milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Reads a JSON column; a decoding failure surfaces as a conversion error naming the column.
pub(crate) fn json_col<T: serde::de::DeserializeOwned>(
    row: &rusqlite::Row<'_>,
    idx: usize,
) -> rusqlite::Result<T> {
    let text: String = row.get(idx)?;
    serde_json::from_str(&text).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(idx, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// Reads an id column into its typed wrapper.
pub(crate) fn id_col<T>(
    row: &rusqlite::Row<'_>,
    idx: usize,
    parse: fn(&str) -> Option<T>,
) -> rusqlite::Result<T> {
    let text: String = row.get(idx)?;
    parse(&text).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            idx,
            rusqlite::types::Type::Text,
            format!("malformed id {text:?}").into(),
        )
    })
}

pub(crate) fn to_json<T: serde::Serialize>(what: &'static str, value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Corrupt {
        what,
        detail: e.to_string(),
    })
}
