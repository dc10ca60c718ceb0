//! Approval rows: a tool call that waits for a person. A row is written `pending` before the
//! call waits and leaves `pending` exactly once (approved, denied, expired or revoked), by a
//! compare-and-swap on the state, so a decision racing a timeout or a revocation has one
//! winner and both sides read it.

use crate::{Error, Result, Scope, Store, id_col, now_ms};
use rusqlite::{OptionalExtension, Row, params};
use skiff_protocol::approval::{ApprovalKind, ApprovalState, ApprovalView};
use skiff_protocol::{ApprovalId, RunId, SessionId};

/// What the gateway records when a call starts waiting.
#[derive(Clone, Debug)]
pub struct NewApproval {
    pub id: ApprovalId,
    pub session_id: SessionId,
    pub run_id: RunId,
    pub tool: String,
    pub kind: ApprovalKind,
    pub subject: String,
    pub requested_by: String,
    pub request_reason: Option<String>,
    pub expires_at_ms: i64,
}

const COLUMNS: &str = "id, session_id, run_id, tool, kind, subject, requested_by, request_reason, \
                       created_at_ms, expires_at_ms, state, decided_by, decided_at_ms, reason";

fn from_row(row: &Row<'_>) -> rusqlite::Result<ApprovalView> {
    let text = |i: usize| -> rusqlite::Result<String> { row.get(i) };
    let bad = |i: usize, what: String| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, what.into())
    };
    let kind = match text(4)?.as_str() {
        "exec" => ApprovalKind::Exec,
        "write" => ApprovalKind::Write,
        "call" => ApprovalKind::Call,
        "request" => ApprovalKind::Request,
        other => return Err(bad(4, format!("unknown approval kind {other:?}"))),
    };
    let state = text(10)?;
    Ok(ApprovalView {
        id: id_col(row, 0, ApprovalId::parse)?,
        session_id: id_col(row, 1, SessionId::parse)?,
        run_id: id_col(row, 2, RunId::parse)?,
        tool: text(3)?,
        kind,
        subject: text(5)?,
        requested_by: text(6)?,
        request_reason: row.get(7)?,
        created_at_ms: row.get(8)?,
        expires_at_ms: row.get(9)?,
        state: ApprovalState::parse(&state)
            .ok_or_else(|| bad(10, format!("unknown approval state {state:?}")))?,
        decided_by: row.get(11)?,
        decided_at_ms: row.get(12)?,
        reason: row.get(13)?,
    })
}

impl Store {
    /// Records a pending approval.
    pub fn create_approval(&self, scope: &Scope, new: &NewApproval) -> Result<ApprovalView> {
        self.conn().execute(
            "INSERT INTO approvals (id, owner_id, tenant_id, session_id, run_id, tool, kind, \
             subject, requested_by, request_reason, created_at_ms, expires_at_ms, state) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 'pending')",
            params![
                new.id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                new.session_id.as_str(),
                new.run_id.as_str(),
                new.tool,
                new.kind.as_str(),
                new.subject,
                new.requested_by,
                new.request_reason,
                now_ms(),
                new.expires_at_ms,
            ],
        )?;
        self.approval(scope, &new.id)
    }

    pub fn approval(&self, scope: &Scope, id: &ApprovalId) -> Result<ApprovalView> {
        self.conn()
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM approvals WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
            ))?
            .query_row(
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "approval",
                id: id.to_string(),
            })
    }

    /// The approvals the sight sees, newest first: one session's, or every session's; only pending
    /// ones with `pending_only`.
    pub fn approvals(
        &self,
        sight: &crate::Sight,
        session: Option<&SessionId>,
        pending_only: bool,
    ) -> Result<Vec<ApprovalView>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM approvals WHERE {seen} \
             AND (?4 IS NULL OR session_id = ?4) AND (?5 = 0 OR state = 'pending') \
             ORDER BY created_at_ms DESC, rowid DESC LIMIT 500",
            seen = crate::sight::seen("", 1)
        ))?;
        let rows = stmt
            .query_map(
                params![
                    sight.scope.owner_id,
                    sight.scope.tenant_id,
                    sight.tenant_wide(),
                    session.map(SessionId::as_str),
                    pending_only
                ],
                from_row,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Moves a pending approval to `to` (never `pending`). `Ok(None)` when it had already
    /// left `pending` (someone else won); the row as it is now is then [`Store::approval`].
    pub fn settle_approval(
        &self,
        scope: &Scope,
        id: &ApprovalId,
        to: ApprovalState,
        decided_by: &str,
        reason: Option<&str>,
    ) -> Result<Option<ApprovalView>> {
        if to == ApprovalState::Pending {
            return Err(Error::Corrupt {
                what: "approval decision",
                detail: format!("approval {id} cannot be moved back to pending"),
            });
        }
        let changed = self.conn().execute(
            "UPDATE approvals SET state = ?1, decided_by = ?2, decided_at_ms = ?3, reason = ?4 \
             WHERE id = ?5 AND owner_id = ?6 AND tenant_id = ?7 AND state = 'pending'",
            params![
                to.as_str(),
                decided_by,
                now_ms(),
                reason,
                id.as_str(),
                scope.owner_id,
                scope.tenant_id
            ],
        )?;
        if changed == 0 {
            // Not found is said as such; a row already settled is `None`.
            self.approval(scope, id)?;
            return Ok(None);
        }
        self.approval(scope, id).map(Some)
    }

    /// Expires the approvals still pending that nothing waits for any more, across scopes:
    /// at a gateway's start, those of sessions no other gateway (than `gateway`) holds the
    /// lease of unexpired — never a live gateway's turn waiting for a person. `None`: all.
    /// Returns how many.
    pub fn expire_orphaned_approvals(
        &self,
        gateway: Option<&skiff_protocol::GatewayId>,
        reason: &str,
    ) -> Result<usize> {
        Ok(self.conn().execute(
            &format!(
                "UPDATE approvals SET state = 'revoked', decided_by = 'gateway', decided_at_ms = ?1, \
                 reason = ?2 WHERE state = 'pending' AND {}",
                crate::runs::unleased("approvals", 3)
            ),
            params![now_ms(), reason, gateway.map(skiff_protocol::GatewayId::as_str)],
        )?)
    }
}
