//! The PostgreSQL implementation of the aggregates in [`crate::aggregates`] (sessions and
//! transcript, runs and attempts, the event log; placements and worker slots, the worker
//! protocol's rows, environments, snapshots; users and tokens, audit, approvals, grants, the
//! vault, agent specs, usage; artifact rows; sessions made from or with others, turn
//! admission and choices, the session list page, gauges) — every aggregate the gateway uses,
//! so `[store] url = "postgres://…"` runs a gateway on it.
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
mod lineage;
mod listen;
mod migrations;
mod overview;
mod people;
mod placements;
mod runs;
mod sessions;
mod snapshots;
mod specs;
mod turns;
mod usage;
mod vault;

use crate::wakeups::Hub;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// The PostgreSQL store: a small pool of connections, each on its own thread, that reconnect
/// after a restart (see `conn`). Cheap to share behind an `Arc`.
pub struct PgStore {
    conn: conn::Connection,
    /// Told the id of each audit row this process writes (`on_audit`).
    audit_listener: std::sync::OnceLock<Box<dyn Fn(i64) + Send + Sync>>,
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
        Self::connect_with(url, None)
    }

    /// [`PgStore::connect`] with the password given apart from `url` (from wherever the
    /// operator keeps it), which it then overrides.
    pub fn connect_with(url: &str, password: Option<&str>) -> Result<Self> {
        let url = match password {
            Some(password) => with_password(url, password),
            None => url.to_owned(),
        };
        let config = url.parse().map_err(Error::PgUrl)?;
        let conn = conn::Connection::open(&url)?;
        conn.run(migrations::migrate)?;
        Ok(Self {
            conn,
            audit_listener: std::sync::OnceLock::new(),
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

/// `url` with `password` added: a `postgres://` url's `password` parameter (percent-encoded),
/// or a `key=value` string's `password` key (quoted); the last one given wins in either.
/// `url` with `password` added (percent-encoded), for a password kept out of the url.
pub fn with_password(url: &str, password: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let mut encoded = String::with_capacity(password.len() * 3);
        for byte in password.bytes() {
            if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
                encoded.push(char::from(byte));
            } else {
                encoded.push_str(&format!("%{byte:02X}"));
            }
        }
        let joint = if url.contains('?') { '&' } else { '?' };
        format!("{url}{joint}password={encoded}")
    } else {
        let quoted = password.replace('\\', "\\\\").replace('\'', "\\'");
        format!("{url} password='{quoted}'")
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

#[cfg(test)]
mod tests {
    use super::with_password;

    #[test]
    fn a_password_given_apart_reads_back_from_either_form_of_url() {
        let tricky = "p@ss w:rd/'\\%?&=";
        for url in [
            "postgres://skiff@db.example/app",
            "postgresql://skiff@db.example/app?sslmode=disable",
            "host=/run/pg user=skiff dbname=app",
        ] {
            let config: postgres::Config = with_password(url, tricky).parse().unwrap();
            assert_eq!(config.get_password(), Some(tricky.as_bytes()), "{url}");
            assert_eq!(config.get_user(), Some("skiff"), "{url}");
            assert_eq!(config.get_dbname(), Some("app"), "{url}");
        }
    }
}
