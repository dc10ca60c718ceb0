//! Approvals and one-time grants on PostgreSQL. Both leave their open state once, by a
//! conditional update: under READ COMMITTED a second writer waits for the first's row lock,
//! re-reads the row and finds the condition false, so racing gateways get one winner.

use super::conn::PgConn;
use super::{PgStore, id};
use crate::aggregates::{Approvals, Grants};
use crate::{Consumed, Error, NewApproval, NewGrant, Result, Scope, Sight, now_ms};
use postgres::Row;
use skiff_protocol::approval::{ApprovalKind, ApprovalState, ApprovalView};
use skiff_protocol::{ApprovalId, GrantId, RunId, SessionId};

const COLUMNS: &str = "id, session_id, run_id, tool, kind, subject, requested_by, \
     request_reason, created_at_ms, expires_at_ms, state, decided_by, decided_at_ms, reason";

fn kind(text: &str) -> Result<ApprovalKind> {
    Ok(match text {
        "exec" => ApprovalKind::Exec,
        "write" => ApprovalKind::Write,
        "call" => ApprovalKind::Call,
        "request" => ApprovalKind::Request,
        other => {
            return Err(Error::Corrupt {
                what: "approval",
                detail: format!("unknown approval kind {other:?}"),
            });
        }
    })
}

fn approval_from(row: &Row) -> Result<ApprovalView> {
    let state: &str = row.try_get(10)?;
    Ok(ApprovalView {
        id: id("approval", row.try_get(0)?, ApprovalId::parse)?,
        session_id: id("approval", row.try_get(1)?, SessionId::parse)?,
        run_id: id("approval", row.try_get(2)?, RunId::parse)?,
        tool: row.try_get(3)?,
        kind: kind(row.try_get(4)?)?,
        subject: row.try_get(5)?,
        requested_by: row.try_get(6)?,
        request_reason: row.try_get(7)?,
        created_at_ms: row.try_get(8)?,
        expires_at_ms: row.try_get(9)?,
        state: ApprovalState::parse(state).ok_or_else(|| Error::Corrupt {
            what: "approval",
            detail: format!("unknown approval state {state:?}"),
        })?,
        decided_by: row.try_get(11)?,
        decided_at_ms: row.try_get(12)?,
        reason: row.try_get(13)?,
    })
}

fn approval_in(conn: &mut PgConn, scope: &Scope, approval: &str) -> Result<ApprovalView> {
    let by_id = conn.statement(
        "SELECT id, session_id, run_id, tool, kind, subject, requested_by, request_reason, \
         created_at_ms, expires_at_ms, state, decided_by, decided_at_ms, reason \
         FROM approvals WHERE id = $1 AND owner_id = $2 AND tenant_id = $3",
    )?;
    let row = conn
        .client
        .query_opt(&by_id, &[&approval, &scope.owner_id, &scope.tenant_id])?
        .ok_or_else(|| Error::NotFound {
            what: "approval",
            id: approval.to_owned(),
        })?;
    approval_from(&row)
}

impl Approvals for PgStore {
    fn create_approval(&self, scope: &Scope, new: &NewApproval) -> Result<ApprovalView> {
        let (scope, new) = (scope.clone(), new.clone());
        let now = now_ms();
        self.conn.run(move |conn| {
            let row = conn.client.query_one(
                &format!(
                    "INSERT INTO approvals (id, owner_id, tenant_id, session_id, run_id, tool, \
                     kind, subject, requested_by, request_reason, created_at_ms, expires_at_ms, \
                     state) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'pending') \
                     RETURNING {COLUMNS}"
                ),
                &[
                    &new.id.as_str(),
                    &scope.owner_id,
                    &scope.tenant_id,
                    &new.session_id.as_str(),
                    &new.run_id.as_str(),
                    &new.tool,
                    &new.kind.as_str(),
                    &new.subject,
                    &new.requested_by,
                    &new.request_reason,
                    &now,
                    &new.expires_at_ms,
                ],
            )?;
            approval_from(&row)
        })
    }

    fn approval(&self, scope: &Scope, id: &ApprovalId) -> Result<ApprovalView> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| approval_in(conn, &scope, &id))
    }

    fn approvals(
        &self,
        sight: &Sight,
        session: Option<&SessionId>,
        pending_only: bool,
    ) -> Result<Vec<ApprovalView>> {
        let sight = sight.clone();
        let session = session.map(ToString::to_string);
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM approvals \
                         WHERE tenant_id = $2 AND (owner_id = $1 OR $3) \
                         AND ($4::text IS NULL OR session_id = $4) \
                         AND (NOT $5 OR state = 'pending') \
                         ORDER BY created_at_ms DESC, ord DESC LIMIT 500"
                    ),
                    &[
                        &sight.scope.owner_id,
                        &sight.scope.tenant_id,
                        &sight.tenant_wide(),
                        &session,
                        &pending_only,
                    ],
                )?
                .iter()
                .map(approval_from)
                .collect()
        })
    }

    fn settle_approval(
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
        let args = (
            scope.clone(),
            id.to_string(),
            decided_by.to_owned(),
            reason.map(str::to_owned),
        );
        let now = now_ms();
        self.conn.run(move |conn| {
            let (scope, id, decided_by, reason) = args;
            let settled = conn.client.query_opt(
                &format!(
                    "UPDATE approvals SET state = $1, decided_by = $2, decided_at_ms = $3, \
                     reason = $4 WHERE id = $5 AND owner_id = $6 AND tenant_id = $7 \
                     AND state = 'pending' RETURNING {COLUMNS}"
                ),
                &[
                    &to.as_str(),
                    &decided_by,
                    &now,
                    &reason,
                    &id,
                    &scope.owner_id,
                    &scope.tenant_id,
                ],
            )?;
            match settled {
                Some(row) => approval_from(&row).map(Some),
                // Not found is said as such; a row already settled is `None`.
                None => approval_in(conn, &scope, &id).map(|_| None),
            }
        })
    }

    fn expire_orphaned_approvals(
        &self,
        gateway: Option<&skiff_protocol::GatewayId>,
        reason: &str,
    ) -> Result<usize> {
        let reason = reason.to_owned();
        let gateway = gateway.map(|g| g.as_str().to_owned());
        let now = now_ms();
        self.conn.run(move |conn| {
            let n = conn.client.execute(
                &format!(
                    "UPDATE approvals SET state = 'revoked', decided_by = 'gateway', \
                     decided_at_ms = $1, reason = $2 WHERE state = 'pending' AND {}",
                    super::turns::unleased("approvals", 3)
                ),
                &[&now, &reason, &gateway],
            )?;
            Ok(usize::try_from(n).unwrap_or(usize::MAX))
        })
    }
}

impl Grants for PgStore {
    fn register_grant(&self, scope: &Scope, grant: &NewGrant) -> Result<()> {
        let (scope, grant) = (scope.clone(), grant.clone());
        self.conn.run(move |conn| {
            conn.client.execute(
                "INSERT INTO grants (id, owner_id, tenant_id, session_id, capability, target, \
                 policy_revision, issued_at_ms, expires_at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                &[
                    &grant.id.as_str(),
                    &scope.owner_id,
                    &scope.tenant_id,
                    &grant.session_id.as_str(),
                    &grant.capability,
                    &grant.target,
                    &grant.policy_revision,
                    &grant.issued_at_ms,
                    &grant.expires_at_ms,
                ],
            )?;
            Ok(())
        })
    }

    fn consume_grant(&self, scope: &Scope, session: &SessionId, id: &GrantId) -> Result<Consumed> {
        let args = (scope.clone(), session.to_string(), id.to_string());
        let now = now_ms();
        self.conn.run(move |conn| {
            let (scope, session, id) = args;
            let consume = conn.statement(
                "UPDATE grants SET consumed_at_ms = $1 WHERE id = $2 AND owner_id = $3 \
                 AND tenant_id = $4 AND session_id = $5 AND consumed_at_ms IS NULL",
            )?;
            let changed = conn.client.execute(
                &consume,
                &[&now, &id, &scope.owner_id, &scope.tenant_id, &session],
            )?;
            if changed == 1 {
                return Ok(Consumed::Now);
            }
            let seen = conn.client.query_opt(
                "SELECT 1 FROM grants WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 \
                 AND session_id = $4",
                &[&id, &scope.owner_id, &scope.tenant_id, &session],
            )?;
            Ok(if seen.is_some() {
                Consumed::Already
            } else {
                Consumed::Unknown
            })
        })
    }
}
