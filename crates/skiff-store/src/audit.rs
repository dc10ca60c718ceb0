//! Reading the audit trail across scopes (the admin's tail and export, the gateway's daily
//! archive) and removing rows past retention. Rows are written by `Store::audit`
//! (`tokens.rs`); a listener set once is told each new row's id, so a follower waits on an
//! event rather than polling.

use crate::{Result, Store};
use rusqlite::params;
use skiff_protocol::audit::AuditRecord;

const COLUMNS: &str = "id, at_ms, owner_id, tenant_id, actor, action, target, decision, detail";

fn record(r: &rusqlite::Row<'_>) -> rusqlite::Result<AuditRecord> {
    Ok(AuditRecord {
        id: r.get(0)?,
        at_ms: r.get(1)?,
        owner_id: r.get(2)?,
        tenant_id: r.get(3)?,
        actor: r.get(4)?,
        action: r.get(5)?,
        target: r.get(6)?,
        decision: r.get(7)?,
        detail: crate::json_col(r, 8)?,
    })
}

/// Milliseconds in a UTC day.
pub const DAY_MS: i64 = 86_400_000;

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Store {
    /// Calls `listener` with the id of every audit row written from now on (set once; a second
    /// call is ignored and returns false).
    pub fn on_audit(&self, listener: Box<dyn Fn(i64) + Send + Sync>) -> bool {
        self.audit_listener.set(listener).is_ok()
    }

    pub(crate) fn audit_written(&self, id: i64) {
        if let Some(listener) = self.audit_listener.get() {
            listener(id);
        }
    }

    /// The newest `n` rows, oldest first.
    pub fn audit_last(&self, n: usize) -> Result<Vec<AuditRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM (SELECT * FROM audit ORDER BY id DESC LIMIT ?1) ORDER BY id"
        ))?;
        let rows = stmt
            .query_map(params![limit(n)], record)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Up to `n` rows with `since_ms <= at_ms < until_ms` and an id above `after`, oldest
    /// first.
    pub fn audit_range(
        &self,
        since_ms: i64,
        until_ms: i64,
        after: i64,
        n: usize,
    ) -> Result<Vec<AuditRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM audit WHERE at_ms >= ?1 AND at_ms < ?2 AND id > ?3 \
             ORDER BY id LIMIT ?4"
        ))?;
        let rows = stmt
            .query_map(params![since_ms, until_ms, after, limit(n)], record)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// The UTC days (as day numbers since the epoch) before `before_ms` that have rows.
    pub fn audit_days_before(&self, before_ms: i64) -> Result<Vec<i64>> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare("SELECT DISTINCT at_ms / ?1 FROM audit WHERE at_ms < ?2 ORDER BY 1")?;
        let days = stmt
            .query_map(params![DAY_MS, before_ms], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<i64>>>()?;
        Ok(days)
    }

    /// Removes every row of a UTC day (by day number) older than `before_ms`; returns how
    /// many went.
    pub fn delete_audit_day(&self, day: i64, before_ms: i64) -> Result<usize> {
        Ok(self.conn().execute(
            "DELETE FROM audit WHERE at_ms >= ?1 AND at_ms < ?2 AND at_ms < ?3",
            params![day * DAY_MS, (day + 1) * DAY_MS, before_ms],
        )?)
    }

    /// Writes an audit row at a given time (tests of archiving and retention).
    pub fn audit_at(
        &self,
        at_ms: i64,
        scope: &crate::Scope,
        action: &str,
        target: &str,
    ) -> Result<()> {
        self.conn().execute(
            "INSERT INTO audit (at_ms, owner_id, tenant_id, actor, action, target, decision, detail)
             VALUES (?1, ?2, ?3, 'test', ?4, ?5, 'applied', '{}')",
            params![at_ms, scope.owner_id, scope.tenant_id, action, target],
        )?;
        Ok(())
    }
}
