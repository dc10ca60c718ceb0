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
mod leases;
mod listen;
mod migrations;
mod people;
mod placements;
mod runs;
mod sessions;
mod snapshots;
mod specs;
mod usage;
mod vault;

use crate::wakeups::Hub;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// The PostgreSQL store: one connection on its own thread (see `conn`). Cheap to share
/// behind an `Arc`; calls are serialized on the connection like the SQLite store's.
pub struct PgStore {
    conn: conn::Connection,
    /// Where the listener connects (the store's own connection settings).
    config: postgres::Config,
    /// Followers in this process, hinted by this store's appends and by the listener.
    wakeups: Arc<Hub>,
    /// The `LISTEN` connection, started by the first subscription.
    listener: Mutex<Option<listen::Listener>>,
}

impl PgStore {
    /// Connects to `url` (`postgres://user@host/db`, or `host=/run/pg dbname=…`) and brings
    /// the schema up to date. Errors name the host and database, never the password.
    pub fn connect(url: &str) -> Result<Self> {
        let config = url.parse().map_err(Error::PgUrl)?;
        let conn = conn::Connection::open(url)?;
        conn.run(migrations::migrate)?;
        Ok(Self {
            conn,
            config,
            wakeups: Arc::new(Hub::default()),
            listener: Mutex::new(None),
        })
    }

    /// Starts the listener unless it runs already.
    fn listen(&self) -> Result<()> {
        // Starting it cannot leave the slot half-set; a poisoned lock is safe to keep using.
        let mut listener = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        if listener.is_none() {
            *listener = Some(listen::Listener::start(
                self.config.clone(),
                Arc::clone(&self.wakeups),
            )?);
        }
        Ok(())
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
