//! The usage ledger: one row per recorded model response (written with the run's totals by
//! `add_run_usage`), summed per session, per user and per tenant for budgets. A user is the
//! owner of a scope within its tenant.

use crate::{Result, Scope, Store};
use rusqlite::params;
use skiff_protocol::SessionId;

/// Tokens and dollars used.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Used {
    pub tokens: u64,
    pub cost_usd: f64,
}

/// One subject's usage since a moment, from `usage_since`.
#[derive(Clone, Debug, PartialEq)]
pub struct UsedBy {
    pub owner_id: String,
    pub tenant_id: String,
    /// Set for a session's row, absent for a user's or tenant's.
    pub session_id: Option<String>,
    pub used: Used,
}

fn used(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<Used> {
    let tokens: i64 = r.get(at)?;
    Ok(Used {
        tokens: u64::try_from(tokens).unwrap_or(0),
        cost_usd: r.get(at + 1)?,
    })
}

impl Store {
    /// What `session` used over its whole life.
    pub fn session_usage(&self, scope: &Scope, session: &SessionId) -> Result<Used> {
        Ok(self.conn().query_row(
            "SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(cost_usd), 0.0) FROM usage \
             WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
            params![session.as_str(), scope.owner_id, scope.tenant_id],
            |r| used(r, 0),
        )?)
    }

    /// What the scope's owner (within its tenant) used from `since_ms` on.
    pub fn user_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used> {
        Ok(self.conn().query_row(
            "SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(cost_usd), 0.0) FROM usage \
             WHERE tenant_id = ?1 AND owner_id = ?2 AND at_ms >= ?3",
            params![scope.tenant_id, scope.owner_id, since_ms],
            |r| used(r, 0),
        )?)
    }

    /// What the scope's whole tenant used from `since_ms` on.
    pub fn tenant_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used> {
        Ok(self.conn().query_row(
            "SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(cost_usd), 0.0) FROM usage \
             WHERE tenant_id = ?1 AND at_ms >= ?2",
            params![scope.tenant_id, since_ms],
            |r| used(r, 0),
        )?)
    }

    /// Across scopes (the admin's usage report): per user and per session, everything used
    /// from `since_ms` on, users first, each group ordered by tenant and owner.
    pub fn usage_since(&self, since_ms: i64) -> Result<Vec<UsedBy>> {
        let conn = self.conn();
        let mut rows = Vec::new();
        let mut stmt = conn.prepare(
            "SELECT owner_id, tenant_id, COALESCE(SUM(tokens), 0), COALESCE(SUM(cost_usd), 0.0) \
             FROM usage WHERE at_ms >= ?1 GROUP BY tenant_id, owner_id ORDER BY tenant_id, owner_id",
        )?;
        for row in stmt.query_map(params![since_ms], |r| {
            Ok(UsedBy {
                owner_id: r.get(0)?,
                tenant_id: r.get(1)?,
                session_id: None,
                used: used(r, 2)?,
            })
        })? {
            rows.push(row?);
        }
        // A session's line is its whole life, for every session that used a model since.
        let mut stmt = conn.prepare(
            "SELECT u.owner_id, u.tenant_id, u.session_id, COALESCE(SUM(u.tokens), 0), \
             COALESCE(SUM(u.cost_usd), 0.0) FROM usage u \
             WHERE u.session_id IN (SELECT session_id FROM usage WHERE at_ms >= ?1) \
             GROUP BY u.tenant_id, u.owner_id, u.session_id \
             ORDER BY u.tenant_id, u.owner_id, u.session_id",
        )?;
        for row in stmt.query_map(params![since_ms], |r| {
            Ok(UsedBy {
                owner_id: r.get(0)?,
                tenant_id: r.get(1)?,
                session_id: Some(r.get(2)?),
                used: used(r, 3)?,
            })
        })? {
            rows.push(row?);
        }
        Ok(rows)
    }
}
