//! The PostgreSQL implementation of the aggregates in [`crate::aggregates`] (sessions and
//! transcript, runs and attempts, the event log; placements and worker slots, the worker
//! protocol's rows, environments, snapshots; users and tokens, audit, approvals, grants, the
//! vault, agent specs, usage; artifact rows) — what several gateways sharing one database will
//! stand on. The rest of the store is SQLite-only so far, so this backend is not offered to
//! users yet.
//!
//! The invariants hold in the database, not in this process: the event cursor comes from a
//! per-session counter row, the transcript leaf moves by a conditional update, and one open
//! run per session and one active attempt per run are partial unique indexes (inserts use
//! `ON CONFLICT … DO NOTHING` on them), so two connections — or two gateways — racing get one
//! winner and a clear refusal. A placement moves under its session's row lock, checked against
//! the state read under it; worker-slot claims count under a gateway-wide advisory lock.

mod approvals;
mod artifacts;
mod audit;
mod conn;
mod environments;
mod events;
mod migrations;
mod people;
mod placements;
mod runs;
mod sessions;
mod snapshots;
mod specs;
mod usage;
mod vault;

use crate::{Error, Result};

/// The PostgreSQL store: a small pool of connections, each on its own thread, that reconnect
/// after a restart (see `conn`). Cheap to share behind an `Arc`.
pub struct PgStore {
    conn: conn::Connection,
}

impl PgStore {
    /// Connects to `url` (`postgres://user@host/db`, or `host=/run/pg dbname=…`) and brings
    /// the schema up to date. Errors name the host and database, never the password.
    pub fn connect(url: &str) -> Result<Self> {
        let conn = conn::Connection::open(url)?;
        conn.run(migrations::migrate)?;
        Ok(Self { conn })
    }

    /// Whether the database answers a read of the tables every request needs (for
    /// `/readyz`): an error — at once, not after a wait — while the server is down.
    pub fn ready(&self) -> Result<()> {
        self.conn.retry(|conn| {
            let probe = conn.statement(
                "SELECT (SELECT COUNT(*) FROM sessions WHERE false) \
                      + (SELECT COUNT(*) FROM runs WHERE false)",
            )?;
            conn.client.query_one(&probe, &[])?;
            Ok(())
        })
    }
}

/// An id column's text as its typed id.
fn id<T>(what: &'static str, text: &str, parse: fn(&str) -> Option<T>) -> Result<T> {
    parse(text).ok_or_else(|| Error::Corrupt {
        what,
        detail: format!("malformed id {text:?}"),
    })
}

fn optional_id<T>(
    what: &'static str,
    text: Option<String>,
    parse: fn(&str) -> Option<T>,
) -> Result<Option<T>> {
    text.map(|text| id(what, &text, parse)).transpose()
}

/// A JSON column's text decoded.
fn json<T: serde::de::DeserializeOwned>(what: &'static str, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| Error::Corrupt {
        what,
        detail: e.to_string(),
    })
}

/// A counter column (never negative when written by Skiff).
fn count(what: &'static str, value: i64) -> Result<u64> {
    u64::try_from(value).map_err(|e| Error::Corrupt {
        what,
        detail: e.to_string(),
    })
}

/// A count as the BIGINT it is stored as.
fn bigint(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
