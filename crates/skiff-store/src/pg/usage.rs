//! The usage ledger on PostgreSQL. `SUM` of a BIGINT is NUMERIC there, so sums are cast back.

use super::{PgStore, bigint, count};
use crate::aggregates::UsageLedger;
use crate::{Result, Scope, Used, UsedBy, now_ms};
use postgres::Row;
use skiff_protocol::model::Usage;
use skiff_protocol::{RunId, SessionId};

/// The sums' columns, from the ledger rows a query selects.
const SUMS: &str =
    "COALESCE(SUM(tokens), 0)::BIGINT, COALESCE(SUM(cost_usd), 0.0)::DOUBLE PRECISION";

fn used(row: &Row, at: usize) -> Result<Used> {
    Ok(Used {
        tokens: count("usage", row.try_get(at)?)?,
        cost_usd: row.try_get(at + 1)?,
    })
}

/// One statement for every budget's sum: the tenant's rows, narrowed to an owner and a
/// session when they are given, from a moment on.
const SUM: &str = "SELECT COALESCE(SUM(tokens), 0)::BIGINT, \
     COALESCE(SUM(cost_usd), 0.0)::DOUBLE PRECISION FROM usage \
     WHERE tenant_id = $1 AND ($2::text IS NULL OR owner_id = $2) \
     AND ($3::text IS NULL OR session_id = $3) AND at_ms >= $4";

impl PgStore {
    fn sum_usage(
        &self,
        tenant: &str,
        owner: Option<&str>,
        session: Option<&SessionId>,
        since_ms: i64,
    ) -> Result<Used> {
        let args = (
            tenant.to_owned(),
            owner.map(str::to_owned),
            session.map(ToString::to_string),
        );
        self.conn.run(move |conn| {
            let (tenant, owner, session) = args;
            let sum = conn.statement(SUM)?;
            let row = conn
                .client
                .query_one(&sum, &[&tenant, &owner, &session, &since_ms])?;
            used(&row, 0)
        })
    }
}

impl UsageLedger for PgStore {
    fn add_run_usage(&self, scope: &Scope, id: &RunId, usage: Usage, cost_usd: f64) -> Result<()> {
        let (scope, id) = (scope.clone(), id.to_string());
        let now = now_ms();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            tx.execute(
                "UPDATE runs SET input_tokens = input_tokens + $1, \
                 output_tokens = output_tokens + $2, \
                 cache_read_tokens = cache_read_tokens + $6, \
                 cache_write_tokens = cache_write_tokens + $7 \
                 WHERE id = $3 AND owner_id = $4 AND tenant_id = $5",
                &[
                    &bigint(usage.input_tokens),
                    &bigint(usage.output_tokens),
                    &id,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &bigint(usage.cache_read_tokens),
                    &bigint(usage.cache_write_tokens),
                ],
            )?;
            let tokens = usage.input_tokens.saturating_add(usage.output_tokens);
            if tokens > 0 || cost_usd > 0.0 {
                tx.execute(
                    "INSERT INTO usage (at_ms, owner_id, tenant_id, session_id, run_id, tokens, \
                     cost_usd) SELECT $1, owner_id, tenant_id, session_id, id, $2, $3 FROM runs \
                     WHERE id = $4 AND owner_id = $5 AND tenant_id = $6",
                    &[
                        &now,
                        &bigint(tokens),
                        &cost_usd,
                        &id,
                        &scope.owner_id,
                        &scope.tenant_id,
                    ],
                )?;
            }
            tx.commit()?;
            Ok(())
        })
    }

    fn session_usage(&self, scope: &Scope, session: &SessionId) -> Result<Used> {
        self.sum_usage(
            &scope.tenant_id,
            Some(&scope.owner_id),
            Some(session),
            i64::MIN,
        )
    }

    fn user_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used> {
        self.sum_usage(&scope.tenant_id, Some(&scope.owner_id), None, since_ms)
    }

    fn tenant_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used> {
        self.sum_usage(&scope.tenant_id, None, None, since_ms)
    }

    fn usage_since(&self, since_ms: i64) -> Result<Vec<UsedBy>> {
        self.conn.run(move |conn| {
            let mut rows = Vec::new();
            for row in conn.client.query(
                &format!(
                    "SELECT owner_id, tenant_id, {SUMS} FROM usage WHERE at_ms >= $1 \
                     GROUP BY tenant_id, owner_id \
                     ORDER BY tenant_id COLLATE \"C\", owner_id COLLATE \"C\""
                ),
                &[&since_ms],
            )? {
                rows.push(UsedBy {
                    owner_id: row.try_get(0)?,
                    tenant_id: row.try_get(1)?,
                    session_id: None,
                    used: used(&row, 2)?,
                });
            }
            // A session's line is its whole life, for every session that used a model since.
            for row in conn.client.query(
                &format!(
                    "SELECT owner_id, tenant_id, session_id, {SUMS} FROM usage \
                     WHERE session_id IN (SELECT session_id FROM usage WHERE at_ms >= $1) \
                     GROUP BY tenant_id, owner_id, session_id \
                     ORDER BY tenant_id COLLATE \"C\", owner_id COLLATE \"C\", \
                     session_id COLLATE \"C\""
                ),
                &[&since_ms],
            )? {
                rows.push(UsedBy {
                    owner_id: row.try_get(0)?,
                    tenant_id: row.try_get(1)?,
                    session_id: Some(row.try_get(2)?),
                    used: used(&row, 3)?,
                });
            }
            Ok(rows)
        })
    }
}
