//! The gateway's views across sessions — the session list a page at a time, whose row an id
//! names, the operator's gauges, readiness — and the audit listener, on both backends: the
//! SQLite [`Store`] delegates to its own methods, [`PgStore`](crate::PgStore) is
//! `pg/overview.rs`.

use crate::{Gauges, Owned, Result, Scope, SessionListRow, Sight, Store};
use skiff_protocol::SessionId;

pub trait Overview: Send + Sync {
    /// At most `limit` sessions the sight sees, each with its placement and newest run, most
    /// recently active first (ties by id), after session `after` (the last of the previous
    /// page; "not found" when the sight does not see it) — one query, however many sessions.
    fn session_page(
        &self,
        sight: &Sight,
        limit: usize,
        after: Option<&SessionId>,
    ) -> Result<Vec<SessionListRow>>;
    /// The owner's scope of the `kind` row `id` when the sight sees it.
    fn owner_of(&self, sight: &Sight, kind: Owned, id: &str) -> Result<Option<Scope>>;
    /// What `/metrics` reports of the database, across every scope, read at one moment.
    fn gauges(&self) -> Result<Gauges>;
    /// Whether the database answers a read of the tables every request needs.
    fn ready(&self) -> Result<()>;
    /// Calls `listener` with the id of every audit row this process writes from now on (set
    /// once; a second call is ignored and returns false). In-process only: rows another
    /// gateway writes are not told.
    fn on_audit(&self, listener: Box<dyn Fn(i64) + Send + Sync>) -> bool;
}

impl Overview for Store {
    fn session_page(
        &self,
        sight: &Sight,
        limit: usize,
        after: Option<&SessionId>,
    ) -> Result<Vec<SessionListRow>> {
        Store::session_page(self, sight, limit, after)
    }
    fn owner_of(&self, sight: &Sight, kind: Owned, id: &str) -> Result<Option<Scope>> {
        Store::owner_of(self, sight, kind, id)
    }
    fn gauges(&self) -> Result<Gauges> {
        Store::gauges(self)
    }
    fn ready(&self) -> Result<()> {
        Store::ready(self)
    }
    fn on_audit(&self, listener: Box<dyn Fn(i64) + Send + Sync>) -> bool {
        Store::on_audit(self, listener)
    }
}
