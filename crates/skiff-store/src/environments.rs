//! Environment rows: the durable side of the environment state machine. The intent row and
//! its operation id are written before any provider is called.

use crate::transition::environment_allowed;
use crate::{Error, Result, Scope, Store, id_col, now_ms};
use rusqlite::{OptionalExtension, Row, TransactionBehavior, params};
use skiff_protocol::environment::{EgressAccounting, EnvironmentState};
use skiff_protocol::{EnvironmentId, SnapshotId};

#[derive(Clone, Debug, PartialEq)]
pub struct EnvironmentRow {
    pub id: EnvironmentId,
    pub scope: Scope,
    pub profile: String,
    pub provider: String,
    pub state: EnvironmentState,
    pub op_id: String,
    pub lease_id: Option<String>,
    /// The provider's lease, as JSON (the gateway owns its shape).
    pub lease: Option<String>,
    pub bundle_hash: Option<String>,
    pub error: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub last_used_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub accounting: EgressAccounting,
    /// The snapshot the box's home starts from (provisioning asks the provider for that).
    pub snapshot_id: Option<SnapshotId>,
    /// The key of the setup whose result the box's home holds (a setup ran on it, or it came
    /// from that setup's snapshot): a session with the same setup skips it here.
    pub prepared_key: Option<String>,
}

const COLUMNS: &str = "id, owner_id, tenant_id, profile, provider, state, op_id, lease_id, lease, \
    bundle_hash, error, created_at_ms, updated_at_ms, last_used_at_ms, expires_at_ms, \
    model_requests, input_tokens, output_tokens, bytes_in, bytes_out, gateway_tool_calls, \
    snapshot_id, prepared_key";

fn from_row(row: &Row<'_>) -> rusqlite::Result<EnvironmentRow> {
    let state: String = row.get(5)?;
    Ok(EnvironmentRow {
        id: id_col(row, 0, EnvironmentId::parse)?,
        scope: Scope::new(row.get::<_, String>(1)?, row.get::<_, String>(2)?),
        profile: row.get(3)?,
        provider: row.get(4)?,
        state: EnvironmentState::parse(&state).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                5,
                rusqlite::types::Type::Text,
                format!("unknown environment state {state:?}").into(),
            )
        })?,
        op_id: row.get(6)?,
        lease_id: row.get(7)?,
        lease: row.get(8)?,
        bundle_hash: row.get(9)?,
        error: row.get(10)?,
        created_at_ms: row.get(11)?,
        updated_at_ms: row.get(12)?,
        last_used_at_ms: row.get(13)?,
        expires_at_ms: row.get(14)?,
        accounting: EgressAccounting {
            model_requests: row.get(15)?,
            input_tokens: row.get(16)?,
            output_tokens: row.get(17)?,
            bytes_in: row.get(18)?,
            bytes_out: row.get(19)?,
            gateway_tool_calls: row.get(20)?,
        },
        snapshot_id: match row.get::<_, Option<String>>(21)? {
            None => None,
            Some(_) => Some(id_col(row, 21, SnapshotId::parse)?),
        },
        prepared_key: row.get(22)?,
    })
}

impl Store {
    /// Records the intent to lease a box: state `requested`, with its operation id.
    pub fn create_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        profile: &str,
        provider: &str,
        op_id: &str,
    ) -> Result<EnvironmentRow> {
        self.create_environment_from(scope, id, profile, provider, op_id, None)
    }

    /// [`Store::create_environment`], for a box whose home starts from `snapshot` (recorded
    /// in the same row, so a restarted gateway provisions the same kind of box).
    pub fn create_environment_from(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        profile: &str,
        provider: &str,
        op_id: &str,
        snapshot: Option<&SnapshotId>,
    ) -> Result<EnvironmentRow> {
        let now = now_ms();
        self.conn().execute(
            "INSERT INTO environments (id, owner_id, tenant_id, profile, provider, state, op_id, \
             created_at_ms, updated_at_ms, last_used_at_ms, snapshot_id) \
             VALUES (?1, ?2, ?3, ?4, ?5, 'requested', ?6, ?7, ?7, ?7, ?8)",
            params![
                id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                profile,
                provider,
                op_id,
                now,
                snapshot.map(SnapshotId::as_str)
            ],
        )?;
        self.environment(scope, id)
    }

    pub fn environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<EnvironmentRow> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM environments WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3"),
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "environment",
                id: id.to_string(),
            })
    }

    /// Environments the sight sees, newest first (destroyed ones included: they are history).
    pub fn environments(&self, sight: &crate::Sight) -> Result<Vec<EnvironmentRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM environments WHERE {seen} ORDER BY created_at_ms DESC, id",
            seen = crate::sight::seen("", 1)
        ))?;
        let rows = stmt
            .query_map(
                params![
                    sight.scope.owner_id,
                    sight.scope.tenant_id,
                    sight.tenant_wide()
                ],
                from_row,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Who owns an environment, in any state, across scopes: whose an event about a worker
    /// endpoint is when the connection on it proves nothing yet. `None`: no such environment.
    pub fn environment_owner(&self, id: &EnvironmentId) -> Result<Option<Scope>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT owner_id, tenant_id FROM environments WHERE id = ?1",
                params![id.as_str()],
                |r| Ok(Scope::new(r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
            )
            .optional()?)
    }

    /// Every environment that is not destroyed, across scopes: what restart reconciliation and
    /// the orphan sweep look at.
    pub fn live_environments(&self) -> Result<Vec<EnvironmentRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM environments WHERE state != 'destroyed' ORDER BY created_at_ms"
        ))?;
        let rows = stmt
            .query_map([], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Moves an environment to `to` if the state machine allows it; `error` replaces the
    /// recorded error (None clears it).
    pub fn transition_environment(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        to: EnvironmentState,
        error: Option<&str>,
    ) -> Result<EnvironmentRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let from: Option<String> = tx
                .query_row(
                    "SELECT state FROM environments WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                    params![id.as_str(), scope.owner_id, scope.tenant_id],
                    |r| r.get(0),
                )
                .optional()?;
            let from = from
                .as_deref()
                .and_then(EnvironmentState::parse)
                .ok_or_else(|| Error::NotFound {
                    what: "environment",
                    id: id.to_string(),
                })?;
            if !environment_allowed(from, to) {
                return Err(Error::IllegalEnvironmentTransition {
                    env: id.to_string(),
                    from,
                    to,
                });
            }
            tx.execute(
                "UPDATE environments SET state = ?1, error = ?2, updated_at_ms = ?3 WHERE id = ?4",
                params![to.as_str(), error, now_ms(), id.as_str()],
            )?;
            tx.commit()?;
        }
        self.environment(scope, id)
    }

    /// Records the lease the provider returned.
    pub fn set_environment_lease(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        lease_id: &str,
        lease_json: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<()> {
        self.conn().execute(
            "UPDATE environments SET lease_id = ?1, lease = ?2, expires_at_ms = ?3, updated_at_ms = ?4 \
             WHERE id = ?5 AND owner_id = ?6 AND tenant_id = ?7",
            params![lease_id, lease_json, expires_at_ms, now_ms(), id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }

    /// Records which setup the box's home holds the result of (`None`: unknown).
    pub fn set_environment_prepared(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        key: Option<&str>,
    ) -> Result<()> {
        self.conn().execute(
            "UPDATE environments SET prepared_key = ?1, updated_at_ms = ?2 WHERE id = ?3 AND owner_id = ?4 AND tenant_id = ?5",
            params![key, now_ms(), id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }

    pub fn set_environment_bundle(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        bundle_hash: &str,
    ) -> Result<()> {
        self.conn().execute(
            "UPDATE environments SET bundle_hash = ?1, updated_at_ms = ?2 WHERE id = ?3 AND owner_id = ?4 AND tenant_id = ?5",
            params![bundle_hash, now_ms(), id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }

    /// Records a renewed lease's new expiry.
    pub fn set_environment_expiry(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        expires_at_ms: i64,
    ) -> Result<()> {
        self.conn().execute(
            "UPDATE environments SET expires_at_ms = ?1, updated_at_ms = ?2 WHERE id = ?3 AND owner_id = ?4 AND tenant_id = ?5",
            params![expires_at_ms, now_ms(), id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }

    /// Marks the environment used now (the idle timeout counts from here).
    pub fn touch_environment(&self, scope: &Scope, id: &EnvironmentId) -> Result<()> {
        self.conn().execute(
            "UPDATE environments SET last_used_at_ms = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![now_ms(), id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }
}
