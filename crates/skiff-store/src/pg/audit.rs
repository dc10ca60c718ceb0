//! The audit trail on PostgreSQL. Ids come from the `audit_next` counter row (see the
//! schema): gapless, and visible in the order they were given.

use super::{PgStore, json};
use crate::aggregates::AuditLog;
use crate::{AuditRow, DAY_MS, Result, Scope, now_ms};
use postgres::Row;
use skiff_protocol::audit::AuditRecord;

/// One statement: the counter's increment gives the id, held locked until the row commits.
const APPEND: &str = "WITH next AS (
        UPDATE audit_next SET last = last + 1 RETURNING last
    )
    INSERT INTO audit (id, at_ms, owner_id, tenant_id, actor, action, target, decision, detail)
    SELECT last, $1, $2, $3, $4, $5, $6, $7, $8 FROM next
    RETURNING id";

const COLUMNS: &str = "id, at_ms, owner_id, tenant_id, actor, action, target, decision, detail";

fn record(row: &Row) -> Result<AuditRecord> {
    Ok(AuditRecord {
        id: row.try_get(0)?,
        at_ms: row.try_get(1)?,
        owner_id: row.try_get(2)?,
        tenant_id: row.try_get(3)?,
        actor: row.try_get(4)?,
        action: row.try_get(5)?,
        target: row.try_get(6)?,
        decision: row.try_get(7)?,
        detail: json("audit detail", row.try_get(8)?)?,
    })
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The parts of a row the caller gives.
struct Written {
    at_ms: i64,
    scope: Scope,
    actor: String,
    action: String,
    target: String,
    decision: String,
    detail: String,
}

impl PgStore {
    fn append_audit(&self, row: Written) -> Result<()> {
        let id: i64 = self.conn.run(move |conn| {
            let append = conn.statement(APPEND)?;
            Ok(conn
                .client
                .query_one(
                    &append,
                    &[
                        &row.at_ms,
                        &row.scope.owner_id,
                        &row.scope.tenant_id,
                        &row.actor,
                        &row.action,
                        &row.target,
                        &row.decision,
                        &row.detail,
                    ],
                )?
                .try_get(0)?)
        })?;
        if let Some(listener) = self.audit_listener.get() {
            listener(id);
        }
        Ok(())
    }

    /// Audit rows by `sql`, whose parameters are the integers `args`, in order.
    fn audit_query(&self, sql: String, args: Vec<i64>) -> Result<Vec<AuditRecord>> {
        self.conn.run(move |conn| {
            let params: Vec<&(dyn postgres::types::ToSql + Sync)> = args
                .iter()
                .map(|a| a as &(dyn postgres::types::ToSql + Sync))
                .collect();
            conn.client
                .query(sql.as_str(), &params)?
                .iter()
                .map(record)
                .collect()
        })
    }
}

impl AuditLog for PgStore {
    fn audit(
        &self,
        scope: &Scope,
        actor: &str,
        action: &str,
        target: &str,
        decision: &str,
        detail: &serde_json::Value,
    ) -> Result<()> {
        self.append_audit(Written {
            at_ms: now_ms(),
            scope: scope.clone(),
            actor: actor.to_owned(),
            action: action.to_owned(),
            target: target.to_owned(),
            decision: decision.to_owned(),
            detail: detail.to_string(),
        })
    }

    fn audit_at(&self, at_ms: i64, scope: &Scope, action: &str, target: &str) -> Result<()> {
        self.append_audit(Written {
            at_ms,
            scope: scope.clone(),
            actor: "test".into(),
            action: action.to_owned(),
            target: target.to_owned(),
            decision: "applied".into(),
            detail: "{}".into(),
        })
    }

    fn audit_rows(&self) -> Result<Vec<AuditRow>> {
        Ok(self
            .audit_query(format!("SELECT {COLUMNS} FROM audit ORDER BY id"), vec![])?
            .into_iter()
            .map(|r| AuditRow {
                at_ms: r.at_ms,
                owner_id: r.owner_id,
                tenant_id: r.tenant_id,
                actor: r.actor,
                action: r.action,
                target: r.target,
                decision: r.decision,
                detail: r.detail,
            })
            .collect())
    }

    fn audit_last(&self, n: usize) -> Result<Vec<AuditRecord>> {
        self.audit_query(
            format!(
                "SELECT {COLUMNS} FROM \
                 (SELECT * FROM audit ORDER BY id DESC LIMIT $1) AS newest ORDER BY id"
            ),
            vec![limit(n)],
        )
    }

    fn audit_range(
        &self,
        since_ms: i64,
        until_ms: i64,
        after: i64,
        n: usize,
    ) -> Result<Vec<AuditRecord>> {
        self.audit_query(
            format!(
                "SELECT {COLUMNS} FROM audit WHERE at_ms >= $1 AND at_ms < $2 AND id > $3 \
                 ORDER BY id LIMIT $4"
            ),
            vec![since_ms, until_ms, after, limit(n)],
        )
    }

    fn audit_days_before(&self, before_ms: i64) -> Result<Vec<i64>> {
        self.conn.run(move |conn| {
            // Integer division truncates toward zero in both databases.
            conn.client
                .query(
                    "SELECT DISTINCT at_ms / $1 FROM audit WHERE at_ms < $2 ORDER BY 1",
                    &[&DAY_MS, &before_ms],
                )?
                .iter()
                .map(|row| Ok(row.try_get(0)?))
                .collect()
        })
    }

    fn delete_audit_day(&self, day: i64, before_ms: i64) -> Result<usize> {
        self.conn.run(move |conn| {
            let gone = conn.client.execute(
                "DELETE FROM audit WHERE at_ms >= $1 AND at_ms < $2 AND at_ms < $3",
                &[&(day * DAY_MS), &((day + 1) * DAY_MS), &before_ms],
            )?;
            Ok(usize::try_from(gone).unwrap_or(usize::MAX))
        })
    }
}
