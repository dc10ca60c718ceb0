//! One-time invocation grants of governed actions: registered when the gateway mints one,
//! consumed exactly once by a conditional update (`consumed_at_ms IS NULL`), so two
//! redemptions racing each other have one winner. Rows hold metadata only.

use crate::{Result, Scope, Store, now_ms};
use rusqlite::{OptionalExtension, params};
use skiff_protocol::{GrantId, SessionId};

/// What the gateway registers when it mints a grant.
#[derive(Clone, Debug)]
pub struct NewGrant {
    pub id: GrantId,
    pub session_id: SessionId,
    pub capability: String,
    pub target: String,
    pub policy_revision: String,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
}

/// How a consumption went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consumed {
    /// This call consumed it.
    Now,
    /// It was consumed before (a replay).
    Already,
    /// No such grant in this scope for this session (foreign, or never registered).
    Unknown,
}

impl Store {
    pub fn register_grant(&self, scope: &Scope, grant: &NewGrant) -> Result<()> {
        self.conn().execute(
            "INSERT INTO grants (id, owner_id, tenant_id, session_id, capability, target, \
             policy_revision, issued_at_ms, expires_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                grant.id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                grant.session_id.as_str(),
                grant.capability,
                grant.target,
                grant.policy_revision,
                grant.issued_at_ms,
                grant.expires_at_ms,
            ],
        )?;
        Ok(())
    }

    /// Consumes grant `id` of `session` in `scope`, once.
    pub fn consume_grant(
        &self,
        scope: &Scope,
        session: &SessionId,
        id: &GrantId,
    ) -> Result<Consumed> {
        let conn = self.conn();
        let changed = conn.execute(
            "UPDATE grants SET consumed_at_ms = ?1 WHERE id = ?2 AND owner_id = ?3 \
             AND tenant_id = ?4 AND session_id = ?5 AND consumed_at_ms IS NULL",
            params![
                now_ms(),
                id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                session.as_str()
            ],
        )?;
        if changed == 1 {
            return Ok(Consumed::Now);
        }
        let seen: Option<i64> = conn
            .query_row(
                "SELECT 1 FROM grants WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3 \
                 AND session_id = ?4",
                params![
                    id.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                    session.as_str()
                ],
                |r| r.get(0),
            )
            .optional()?;
        Ok(if seen.is_some() {
            Consumed::Already
        } else {
            Consumed::Unknown
        })
    }
}
