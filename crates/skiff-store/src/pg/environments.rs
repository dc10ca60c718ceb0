//! Environment rows on PostgreSQL. A transition reads the state under the row's lock
//! (`FOR UPDATE`) in the transaction that changes it, so two gateways moving one box are
//! ordered and each move is checked against the state the other left.

use super::{PgStore, bigint, count, id, optional_id};
use crate::aggregates::EnvironmentStore;
use crate::transition::environment_allowed;
use crate::{EnvironmentRow, Error, Result, Scope, Sight, now_ms};
use postgres::Row;
use skiff_protocol::environment::{EgressAccounting, EnvironmentState};
use skiff_protocol::{EnvironmentId, SnapshotId};

const COLUMNS: &str = "id, owner_id, tenant_id, profile, provider, state, op_id, lease_id, lease, \
    bundle_hash, error, created_at_ms, updated_at_ms, last_used_at_ms, expires_at_ms, \
    model_requests, input_tokens, output_tokens, bytes_in, bytes_out, gateway_tool_calls, \
    snapshot_id, prepared_key";

fn environment_from(row: &Row) -> Result<EnvironmentRow> {
    let state: &str = row.try_get(5)?;
    let counter = |i: usize| -> Result<u64> { count("environment accounting", row.try_get(i)?) };
    Ok(EnvironmentRow {
        id: id("environment", row.try_get(0)?, EnvironmentId::parse)?,
        scope: Scope::new(row.try_get::<_, String>(1)?, row.try_get::<_, String>(2)?),
        profile: row.try_get(3)?,
        provider: row.try_get(4)?,
        state: EnvironmentState::parse(state).ok_or_else(|| Error::Corrupt {
            what: "environment",
            detail: format!("unknown environment state {state:?}"),
        })?,
        op_id: row.try_get(6)?,
        lease_id: row.try_get(7)?,
        lease: row.try_get(8)?,
        bundle_hash: row.try_get(9)?,
        error: row.try_get(10)?,
        created_at_ms: row.try_get(11)?,
        updated_at_ms: row.try_get(12)?,
        last_used_at_ms: row.try_get(13)?,
        expires_at_ms: row.try_get(14)?,
        accounting: EgressAccounting {
            model_requests: counter(15)?,
            input_tokens: counter(16)?,
            output_tokens: counter(17)?,
            bytes_in: counter(18)?,
            bytes_out: counter(19)?,
            gateway_tool_calls: counter(20)?,
        },
        snapshot_id: optional_id("environment snapshot", row.try_get(21)?, SnapshotId::parse)?,
        prepared_key: row.try_get(22)?,
    })
}

fn not_found(id: &str) -> Error {
    Error::NotFound {
        what: "environment",
        id: id.to_string(),
    }
}

impl PgStore {
    /// One scoped `UPDATE environments SET {set} …` with `values` bound from `$1` and the
    /// id and scope after them. Like the SQLite store, a row outside the scope is left alone.
    fn update_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        set: &'static str,
        values: Values,
    ) -> Result<()> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| {
            let n = values.len();
            let sql = format!(
                "UPDATE environments SET {set} WHERE id = ${} AND owner_id = ${} AND tenant_id = ${}",
                n + 1,
                n + 2,
                n + 3
            );
            let mut params: Vec<&(dyn postgres::types::ToSql + Sync)> =
                values
                    .iter()
                    .map(|v| -> &(dyn postgres::types::ToSql + Sync) { v.as_ref() })
                    .collect();
            params.extend([
                &id as &(dyn postgres::types::ToSql + Sync),
                &scope.owner_id,
                &scope.tenant_id,
            ]);
            conn.client.execute(&sql, &params)?;
            Ok(())
        })
    }
}

/// Bound values that cross to the connection's thread.
type Values = Vec<Box<dyn postgres::types::ToSql + Send + Sync>>;

impl EnvironmentStore for PgStore {
    fn create_environment_from(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        profile: &str,
        provider: &str,
        op_id: &str,
        snapshot: Option<&SnapshotId>,
    ) -> Result<EnvironmentRow> {
        let args = (
            scope.clone(),
            id.to_string(),
            profile.to_string(),
            provider.to_string(),
            op_id.to_string(),
            snapshot.map(ToString::to_string),
        );
        let now = now_ms();
        self.conn.run(move |conn| {
            let (scope, id, profile, provider, op_id, snapshot) = args;
            let row = conn.client.query_one(
                &format!(
                    "INSERT INTO environments (id, owner_id, tenant_id, profile, provider, state, \
                     op_id, created_at_ms, updated_at_ms, last_used_at_ms, snapshot_id) \
                     VALUES ($1, $2, $3, $4, $5, 'requested', $6, $7, $7, $7, $8) \
                     RETURNING {COLUMNS}"
                ),
                &[
                    &id,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &profile,
                    &provider,
                    &op_id,
                    &now,
                    &snapshot,
                ],
            )?;
            environment_from(&row)
        })
    }

    fn environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<EnvironmentRow> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| {
            let row = conn
                .client
                .query_opt(
                    &format!(
                        "SELECT {COLUMNS} FROM environments \
                         WHERE id = $1 AND owner_id = $2 AND tenant_id = $3"
                    ),
                    &[&id, &scope.owner_id, &scope.tenant_id],
                )?
                .ok_or_else(|| not_found(&id))?;
            environment_from(&row)
        })
    }

    fn environments(&self, sight: &Sight) -> Result<Vec<EnvironmentRow>> {
        let (scope, wide) = (sight.scope.clone(), sight.tenant_wide());
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM environments \
                         WHERE tenant_id = $2 AND (owner_id = $1 OR $3) \
                         ORDER BY created_at_ms DESC, id COLLATE \"C\""
                    ),
                    &[&scope.owner_id, &scope.tenant_id, &wide],
                )?
                .iter()
                .map(environment_from)
                .collect()
        })
    }

    fn environment_owner(&self, id: &EnvironmentId) -> Result<Option<Scope>> {
        let id = id.to_string();
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    "SELECT owner_id, tenant_id FROM environments WHERE id = $1",
                    &[&id],
                )?
                .map(|row| {
                    Ok(Scope::new(
                        row.try_get::<_, String>(0)?,
                        row.try_get::<_, String>(1)?,
                    ))
                })
                .transpose()
        })
    }

    fn live_environments(&self) -> Result<Vec<EnvironmentRow>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM environments WHERE state <> 'destroyed' \
                         ORDER BY created_at_ms, id COLLATE \"C\""
                    ),
                    &[],
                )?
                .iter()
                .map(environment_from)
                .collect()
        })
    }

    fn transition_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        to: EnvironmentState,
        error: Option<&str>,
    ) -> Result<EnvironmentRow> {
        let (scope, id, error) = (scope.clone(), id.to_string(), error.map(str::to_string));
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let from = tx
                .query_opt(
                    "SELECT state FROM environments \
                     WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 FOR UPDATE",
                    &[&id, &scope.owner_id, &scope.tenant_id],
                )?
                .map(|row| row.try_get::<_, String>(0))
                .transpose()?;
            let from = from
                .as_deref()
                .and_then(EnvironmentState::parse)
                .ok_or_else(|| not_found(&id))?;
            if !environment_allowed(from, to) {
                return Err(Error::IllegalEnvironmentTransition { env: id, from, to });
            }
            let row = tx.query_one(
                &format!(
                    "UPDATE environments SET state = $1, error = $2, updated_at_ms = $3 \
                     WHERE id = $4 RETURNING {COLUMNS}"
                ),
                &[&to.as_str(), &error, &now_ms(), &id],
            )?;
            let after = environment_from(&row)?;
            tx.commit()?;
            Ok(after)
        })
    }

    fn set_environment_lease(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        lease_id: &str,
        lease_json: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<()> {
        self.update_environment(
            scope,
            id,
            "lease_id = $1, lease = $2, expires_at_ms = $3, updated_at_ms = $4",
            vec![
                Box::new(lease_id.to_string()),
                Box::new(lease_json.to_string()),
                Box::new(expires_at_ms),
                Box::new(now_ms()),
            ],
        )
    }

    fn set_environment_prepared(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        key: Option<&str>,
    ) -> Result<()> {
        self.update_environment(
            scope,
            id,
            "prepared_key = $1, updated_at_ms = $2",
            vec![Box::new(key.map(str::to_string)), Box::new(now_ms())],
        )
    }

    fn set_environment_bundle(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        bundle_hash: &str,
    ) -> Result<()> {
        self.update_environment(
            scope,
            id,
            "bundle_hash = $1, updated_at_ms = $2",
            vec![Box::new(bundle_hash.to_string()), Box::new(now_ms())],
        )
    }

    fn set_environment_expiry(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        expires_at_ms: i64,
    ) -> Result<()> {
        self.update_environment(
            scope,
            id,
            "expires_at_ms = $1, updated_at_ms = $2",
            vec![Box::new(expires_at_ms), Box::new(now_ms())],
        )
    }

    fn touch_environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<()> {
        self.update_environment(scope, id, "last_used_at_ms = $1", vec![Box::new(now_ms())])
    }

    fn add_environment_egress(&self, env: &EnvironmentId, add: EgressAccounting) -> Result<()> {
        let env = env.to_string();
        self.conn.run(move |conn| {
            conn.client.execute(
                "UPDATE environments SET model_requests = model_requests + $1, \
                 input_tokens = input_tokens + $2, output_tokens = output_tokens + $3, \
                 bytes_in = bytes_in + $4, bytes_out = bytes_out + $5, \
                 gateway_tool_calls = gateway_tool_calls + $6 WHERE id = $7",
                &[
                    &bigint(add.model_requests),
                    &bigint(add.input_tokens),
                    &bigint(add.output_tokens),
                    &bigint(add.bytes_in),
                    &bigint(add.bytes_out),
                    &bigint(add.gateway_tool_calls),
                    &env,
                ],
            )?;
            Ok(())
        })
    }
}
