//! Snapshot rows on PostgreSQL. A transition reads the state under the row's lock in the
//! transaction that changes it; every recorded use takes an advisory lock first, so uses get
//! strictly increasing times across gateways (eviction is least recently used first, and two
//! uses in one millisecond are still two).

use super::{PgStore, bigint, count, id};
use crate::aggregates::SnapshotStore;
use crate::snapshots::{COLUMNS, eviction, not_found};
use crate::transition::snapshot_allowed;
use crate::{Error, NewSnapshot, Result, Scope, Sight, SnapshotRow, now_ms};
use postgres::{Row, Transaction};
use skiff_protocol::environment::SnapshotState;
use skiff_protocol::{EnvironmentId, SnapshotId};

/// An arbitrary constant: the advisory lock a use of any snapshot takes.
const SNAPSHOT_USE_LOCK: i64 = 0x736b_6966_665f_736e;

fn snapshot_from(row: &Row) -> Result<SnapshotRow> {
    let state: &str = row.try_get(8)?;
    Ok(SnapshotRow {
        id: id("snapshot", row.try_get(0)?, SnapshotId::parse)?,
        scope: Scope::new(row.try_get::<_, String>(1)?, row.try_get::<_, String>(2)?),
        profile: row.try_get(3)?,
        key: row.try_get(4)?,
        environment_id: id("snapshot", row.try_get(5)?, EnvironmentId::parse)?,
        lease_id: row.try_get(6)?,
        size_bytes: count("snapshot size", row.try_get(7)?)?,
        state: SnapshotState::parse(state).ok_or_else(|| Error::Corrupt {
            what: "snapshot",
            detail: format!("unknown snapshot state {state:?}"),
        })?,
        created_at_ms: row.try_get(9)?,
        last_used_at_ms: row.try_get(10)?,
    })
}

/// The time of a use: now, or just after the latest recorded use when the clock has not moved
/// past it. Holds the use lock until the caller's transaction ends.
fn next_use_ms(tx: &mut Transaction<'_>) -> Result<i64> {
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SNAPSHOT_USE_LOCK])?;
    let latest: Option<i64> = tx
        .query_one("SELECT MAX(last_used_at_ms) FROM snapshots", &[])?
        .try_get(0)?;
    Ok(latest.map_or(now_ms(), |l| now_ms().max(l.saturating_add(1))))
}

fn snapshot_in(
    client: &mut impl postgres::GenericClient,
    scope: &Scope,
    id: &SnapshotId,
) -> Result<SnapshotRow> {
    let row = client
        .query_opt(
            &format!(
                "SELECT {COLUMNS} FROM snapshots WHERE id = $1 AND owner_id = $2 AND tenant_id = $3"
            ),
            &[&id.as_str(), &scope.owner_id, &scope.tenant_id],
        )?
        .ok_or_else(|| not_found(id))?;
    snapshot_from(&row)
}

impl PgStore {
    /// Moves a snapshot to `to` if allowed; `size_bytes` replaces the recorded size when given.
    fn transition_snapshot(
        &self,
        scope: &Scope,
        id: &SnapshotId,
        to: SnapshotState,
        size_bytes: Option<u64>,
    ) -> Result<SnapshotRow> {
        let (scope, id) = (scope.clone(), id.clone());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let from = tx
                .query_opt(
                    "SELECT state FROM snapshots \
                     WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 FOR UPDATE",
                    &[&id.as_str(), &scope.owner_id, &scope.tenant_id],
                )?
                .map(|row| row.try_get::<_, String>(0))
                .transpose()?;
            let from = from
                .as_deref()
                .and_then(SnapshotState::parse)
                .ok_or_else(|| not_found(&id))?;
            if !snapshot_allowed(from, to) {
                return Err(Error::IllegalSnapshotTransition {
                    snapshot: id.to_string(),
                    from,
                    to,
                });
            }
            tx.execute(
                "UPDATE snapshots SET state = $1, size_bytes = COALESCE($2, size_bytes) \
                 WHERE id = $3",
                &[&to.as_str(), &size_bytes.map(bigint), &id.as_str()],
            )?;
            if to == SnapshotState::Ready {
                // Its capture counts as a use: a new snapshot is not the first to be evicted.
                let used = next_use_ms(&mut tx)?;
                tx.execute(
                    "UPDATE snapshots SET last_used_at_ms = $1 WHERE id = $2",
                    &[&used, &id.as_str()],
                )?;
            }
            let after = snapshot_in(&mut tx, &scope, &id)?;
            tx.commit()?;
            Ok(after)
        })
    }
}

impl SnapshotStore for PgStore {
    fn record_snapshot(&self, scope: &Scope, new: &NewSnapshot<'_>) -> Result<SnapshotRow> {
        let args = (
            scope.clone(),
            new.id.to_string(),
            new.profile.to_string(),
            new.key.to_string(),
            new.environment_id.to_string(),
            new.lease_id.to_string(),
        );
        self.conn.run(move |conn| {
            let (scope, id, profile, key, env, lease) = args;
            let mut tx = conn.client.transaction()?;
            let now = next_use_ms(&mut tx)?;
            let row = tx.query_one(
                &format!(
                    "INSERT INTO snapshots (id, owner_id, tenant_id, profile, key, \
                     environment_id, lease_id, state, created_at_ms, last_used_at_ms) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, 'capturing', $8, $8) RETURNING {COLUMNS}"
                ),
                &[
                    &id,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &profile,
                    &key,
                    &env,
                    &lease,
                    &now,
                ],
            )?;
            let recorded = snapshot_from(&row)?;
            tx.commit()?;
            Ok(recorded)
        })
    }

    fn snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        let (scope, id) = (scope.clone(), id.clone());
        self.conn
            .run(move |conn| snapshot_in(&mut conn.client, &scope, &id))
    }

    fn snapshots(&self, sight: &Sight) -> Result<Vec<SnapshotRow>> {
        let (scope, wide) = (sight.scope.clone(), sight.tenant_wide());
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM snapshots \
                         WHERE tenant_id = $2 AND (owner_id = $1 OR $3) \
                         ORDER BY last_used_at_ms DESC, created_at_ms DESC, id COLLATE \"C\""
                    ),
                    &[&scope.owner_id, &scope.tenant_id, &wide],
                )?
                .iter()
                .map(snapshot_from)
                .collect()
        })
    }

    fn snapshot_captured(
        &self,
        scope: &Scope,
        id: &SnapshotId,
        size_bytes: u64,
    ) -> Result<SnapshotRow> {
        self.transition_snapshot(scope, id, SnapshotState::Ready, Some(size_bytes))
    }

    fn mark_snapshot_deleting(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        self.transition_snapshot(scope, id, SnapshotState::Deleting, None)
    }

    fn delete_snapshot_row(&self, scope: &Scope, id: &SnapshotId) -> Result<()> {
        let (scope, id) = (scope.clone(), id.clone());
        self.conn.run(move |conn| {
            let deleted = conn.client.execute(
                "DELETE FROM snapshots WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 \
                 AND state = 'deleting'",
                &[&id.as_str(), &scope.owner_id, &scope.tenant_id],
            )?;
            if deleted == 0 {
                // Not in the scope (not found), or not on its way out.
                let row = snapshot_in(&mut conn.client, &scope, &id)?;
                return Err(Error::IllegalSnapshotTransition {
                    snapshot: id.to_string(),
                    from: row.state,
                    to: SnapshotState::Deleting,
                });
            }
            Ok(())
        })
    }

    fn find_ready_snapshot(
        &self,
        scope: &Scope,
        profile: &str,
        key: &str,
    ) -> Result<Option<SnapshotRow>> {
        let (scope, profile, key) = (scope.clone(), profile.to_string(), key.to_string());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let used = next_use_ms(&mut tx)?;
            let found = tx.query_opt(
                &format!(
                    "UPDATE snapshots SET last_used_at_ms = $5 WHERE id = (SELECT id FROM snapshots \
                     WHERE owner_id = $1 AND tenant_id = $2 AND profile = $3 AND key = $4 \
                     AND state = 'ready' ORDER BY created_at_ms DESC, id COLLATE \"C\" DESC \
                     LIMIT 1 FOR UPDATE) RETURNING {COLUMNS}"
                ),
                &[&scope.owner_id, &scope.tenant_id, &profile, &key, &used],
            )?;
            let found = found.as_ref().map(snapshot_from).transpose()?;
            tx.commit()?;
            Ok(found)
        })
    }

    fn touch_snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        let (scope, id) = (scope.clone(), id.clone());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let used = next_use_ms(&mut tx)?;
            let touched = tx.query_opt(
                &format!(
                    "UPDATE snapshots SET last_used_at_ms = $1 WHERE id = $2 AND owner_id = $3 \
                     AND tenant_id = $4 AND state = 'ready' RETURNING {COLUMNS}"
                ),
                &[&used, &id.as_str(), &scope.owner_id, &scope.tenant_id],
            )?;
            let Some(touched) = touched else {
                let row = snapshot_in(&mut tx, &scope, &id)?;
                return Err(Error::IllegalSnapshotTransition {
                    snapshot: id.to_string(),
                    from: row.state,
                    to: SnapshotState::Ready,
                });
            };
            let touched = snapshot_from(&touched)?;
            tx.commit()?;
            Ok(touched)
        })
    }

    fn evict_plan(&self, profile: &str, budget_bytes: u64) -> Result<Vec<SnapshotRow>> {
        let profile = profile.to_string();
        let rows = self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM snapshots WHERE profile = $1 AND state = 'ready' \
                         ORDER BY last_used_at_ms DESC, created_at_ms DESC, id COLLATE \"C\" DESC"
                    ),
                    &[&profile],
                )?
                .iter()
                .map(snapshot_from)
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(eviction(rows, budget_bytes))
    }

    fn unsettled_snapshots(&self) -> Result<Vec<SnapshotRow>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM snapshots WHERE state IN ('capturing', 'deleting') \
                         ORDER BY created_at_ms, id COLLATE \"C\""
                    ),
                    &[],
                )?
                .iter()
                .map(snapshot_from)
                .collect()
        })
    }

    fn snapshot_known(&self, id: &SnapshotId) -> Result<bool> {
        let id = id.to_string();
        self.conn.run(move |conn| {
            Ok(conn
                .client
                .query_opt("SELECT 1 FROM snapshots WHERE id = $1", &[&id])?
                .is_some())
        })
    }
}
