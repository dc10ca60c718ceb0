//! Snapshot rows: which prepared-box snapshots exist, what key they serve, and when they were
//! last used. The copy itself is the provider's; a row is written (`capturing`) before the
//! provider is asked for it and leaves (`deleting`, then gone) only after the provider
//! deleted it, so every snapshot a provider holds has a row until it is gone.

use crate::transition::snapshot_allowed;
use crate::{Error, Result, Scope, Store, id_col, now_ms};
use rusqlite::{OptionalExtension, Row, TransactionBehavior, params};
use skiff_protocol::environment::SnapshotState;
use skiff_protocol::{EnvironmentId, SnapshotId};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRow {
    pub id: SnapshotId,
    pub scope: Scope,
    pub profile: String,
    /// Lowercase hex; the gateway decides what goes into it.
    pub key: String,
    pub environment_id: EnvironmentId,
    pub lease_id: String,
    pub size_bytes: u64,
    pub state: SnapshotState,
    pub created_at_ms: i64,
    pub last_used_at_ms: i64,
}

/// What [`Store::record_snapshot`] needs.
#[derive(Clone, Debug)]
pub struct NewSnapshot<'a> {
    pub id: &'a SnapshotId,
    pub profile: &'a str,
    pub key: &'a str,
    pub environment_id: &'a EnvironmentId,
    pub lease_id: &'a str,
}

pub(crate) const COLUMNS: &str = "id, owner_id, tenant_id, profile, key, environment_id, lease_id, \
    size_bytes, state, created_at_ms, last_used_at_ms";

fn from_row(row: &Row<'_>) -> rusqlite::Result<SnapshotRow> {
    let state: String = row.get(8)?;
    Ok(SnapshotRow {
        id: id_col(row, 0, SnapshotId::parse)?,
        scope: Scope::new(row.get::<_, String>(1)?, row.get::<_, String>(2)?),
        profile: row.get(3)?,
        key: row.get(4)?,
        environment_id: id_col(row, 5, EnvironmentId::parse)?,
        lease_id: row.get(6)?,
        size_bytes: u64::try_from(row.get::<_, i64>(7)?).unwrap_or(0),
        state: SnapshotState::parse(&state).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                8,
                rusqlite::types::Type::Text,
                format!("unknown snapshot state {state:?}").into(),
            )
        })?,
        created_at_ms: row.get(9)?,
        last_used_at_ms: row.get(10)?,
    })
}

/// The time of a use: now, or just after the latest recorded use when the clock has not moved
/// past it. LRU needs a strict order of uses, and two in one millisecond are still two.
fn next_use_ms(tx: &rusqlite::Transaction<'_>) -> Result<i64> {
    let latest: Option<i64> =
        tx.query_row("SELECT MAX(last_used_at_ms) FROM snapshots", [], |r| {
            r.get(0)
        })?;
    Ok(latest.map_or(now_ms(), |l| now_ms().max(l.saturating_add(1))))
}

/// The eviction plan of [`Store::evict_plan`] from a profile's ready snapshots, most recently
/// used first: the most recently used ones that fit together stay; everything older goes.
pub(crate) fn eviction(rows: Vec<SnapshotRow>, budget_bytes: u64) -> Vec<SnapshotRow> {
    let mut kept = 0u64;
    let mut full = false;
    let mut plan = Vec::new();
    for row in rows {
        if row.size_bytes > budget_bytes {
            plan.push(row);
            continue;
        }
        match kept.checked_add(row.size_bytes) {
            Some(total) if !full && total <= budget_bytes => kept = total,
            _ => {
                full = true;
                plan.push(row);
            }
        }
    }
    plan.reverse();
    plan
}

pub(crate) fn not_found(id: &SnapshotId) -> Error {
    Error::NotFound {
        what: "snapshot",
        id: id.to_string(),
    }
}

impl Store {
    /// Records the intent to capture a snapshot: state `capturing`, before the provider is
    /// called.
    pub fn record_snapshot(&self, scope: &Scope, new: &NewSnapshot<'_>) -> Result<SnapshotRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let now = next_use_ms(&tx)?;
            tx.execute(
                "INSERT INTO snapshots (id, owner_id, tenant_id, profile, key, environment_id, lease_id, \
                 state, created_at_ms, last_used_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'capturing', ?8, ?8)",
                params![
                    new.id.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                    new.profile,
                    new.key,
                    new.environment_id.as_str(),
                    new.lease_id,
                    now
                ],
            )?;
            tx.commit()?;
        }
        self.snapshot(scope, new.id)
    }

    pub fn snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        self.conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM snapshots WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
                ),
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| not_found(id))
    }

    /// The snapshots the sight sees, most recently used first.
    pub fn snapshots(&self, sight: &crate::Sight) -> Result<Vec<SnapshotRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE {seen} \
             ORDER BY last_used_at_ms DESC, created_at_ms DESC, id",
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

    /// Moves a snapshot to `to` if allowed; `size_bytes` replaces the recorded size when
    /// given. `deleting → deleting` records a retry.
    fn transition_snapshot(
        &self,
        scope: &Scope,
        id: &SnapshotId,
        to: SnapshotState,
        size_bytes: Option<u64>,
    ) -> Result<SnapshotRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let from: Option<String> = tx
                .query_row(
                    "SELECT state FROM snapshots WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                    params![id.as_str(), scope.owner_id, scope.tenant_id],
                    |r| r.get(0),
                )
                .optional()?;
            let from = from
                .as_deref()
                .and_then(SnapshotState::parse)
                .ok_or_else(|| not_found(id))?;
            if !snapshot_allowed(from, to) {
                return Err(Error::IllegalSnapshotTransition {
                    snapshot: id.to_string(),
                    from,
                    to,
                });
            }
            let size = size_bytes.map(|s| i64::try_from(s).unwrap_or(i64::MAX));
            tx.execute(
                "UPDATE snapshots SET state = ?1, size_bytes = COALESCE(?2, size_bytes) WHERE id = ?3",
                params![to.as_str(), size, id.as_str()],
            )?;
            if to == SnapshotState::Ready {
                // Its capture counts as a use: a new snapshot is not the first to be evicted.
                tx.execute(
                    "UPDATE snapshots SET last_used_at_ms = ?1 WHERE id = ?2",
                    params![next_use_ms(&tx)?, id.as_str()],
                )?;
            }
            tx.commit()?;
        }
        self.snapshot(scope, id)
    }

    /// The provider has the snapshot, `size_bytes` large: it is `ready` to start boxes.
    pub fn snapshot_captured(
        &self,
        scope: &Scope,
        id: &SnapshotId,
        size_bytes: u64,
    ) -> Result<SnapshotRow> {
        self.transition_snapshot(scope, id, SnapshotState::Ready, Some(size_bytes))
    }

    /// No box starts from it any more; the provider's copy is to be deleted next.
    pub fn mark_snapshot_deleting(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        self.transition_snapshot(scope, id, SnapshotState::Deleting, None)
    }

    /// Forgets a snapshot the provider has deleted. Only a `deleting` row can go.
    pub fn delete_snapshot_row(&self, scope: &Scope, id: &SnapshotId) -> Result<()> {
        let row = self.snapshot(scope, id)?;
        if row.state != SnapshotState::Deleting {
            return Err(Error::IllegalSnapshotTransition {
                snapshot: id.to_string(),
                from: row.state,
                to: SnapshotState::Deleting,
            });
        }
        self.conn().execute(
            "DELETE FROM snapshots WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3 AND state = 'deleting'",
            params![id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }

    /// The newest ready snapshot of `profile` for `key` in the scope, marked used now.
    pub fn find_ready_snapshot(
        &self,
        scope: &Scope,
        profile: &str,
        key: &str,
    ) -> Result<Option<SnapshotRow>> {
        let found: Option<String> = {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let found: Option<String> = tx
                .query_row(
                    "SELECT id FROM snapshots WHERE owner_id = ?1 AND tenant_id = ?2 AND profile = ?3 \
                     AND key = ?4 AND state = 'ready' ORDER BY created_at_ms DESC, id DESC LIMIT 1",
                    params![scope.owner_id, scope.tenant_id, profile, key],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(id) = &found {
                tx.execute(
                    "UPDATE snapshots SET last_used_at_ms = ?1 WHERE id = ?2",
                    params![next_use_ms(&tx)?, id],
                )?;
            }
            tx.commit()?;
            found
        };
        match found.as_deref().and_then(SnapshotId::parse) {
            Some(id) => self.snapshot(scope, &id).map(Some),
            None => Ok(None),
        }
    }

    /// Marks a ready snapshot used now (a box is about to start from it).
    pub fn touch_snapshot(&self, scope: &Scope, id: &SnapshotId) -> Result<SnapshotRow> {
        let changed = {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let changed = tx.execute(
                "UPDATE snapshots SET last_used_at_ms = ?1 WHERE id = ?2 AND owner_id = ?3 \
                 AND tenant_id = ?4 AND state = 'ready'",
                params![
                    next_use_ms(&tx)?,
                    id.as_str(),
                    scope.owner_id,
                    scope.tenant_id
                ],
            )?;
            tx.commit()?;
            changed
        };
        let row = self.snapshot(scope, id)?;
        if changed == 0 {
            return Err(Error::IllegalSnapshotTransition {
                snapshot: id.to_string(),
                from: row.state,
                to: SnapshotState::Ready,
            });
        }
        Ok(row)
    }

    /// The ready snapshots of `profile` (every scope's: they share the provider's disk) to
    /// delete so the rest take at most `budget_bytes`: the least recently used first, until
    /// what is left fits. One larger than the whole budget goes whatever its age (it never
    /// fits) without taking the others with it. Deleting ones are already on their way out and
    /// count for nothing.
    pub fn evict_plan(&self, profile: &str, budget_bytes: u64) -> Result<Vec<SnapshotRow>> {
        let rows = {
            let conn = self.conn();
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM snapshots WHERE profile = ?1 AND state = 'ready' \
                 ORDER BY last_used_at_ms DESC, created_at_ms DESC, id DESC"
            ))?;
            stmt.query_map(params![profile], from_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        Ok(eviction(rows, budget_bytes))
    }

    /// Snapshots, across scopes, whose capture or deletion did not finish (what restart
    /// reconciliation cleans up).
    pub fn unsettled_snapshots(&self) -> Result<Vec<SnapshotRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE state IN ('capturing', 'deleting') ORDER BY created_at_ms"
        ))?;
        let rows = stmt
            .query_map([], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Whether any scope has a row for snapshot `id` (the sweep deletes the provider's
    /// snapshots that none has).
    pub fn snapshot_known(&self, id: &SnapshotId) -> Result<bool> {
        let found: Option<i64> = self
            .conn()
            .query_row(
                "SELECT 1 FROM snapshots WHERE id = ?1",
                params![id.as_str()],
                |r| r.get(0),
            )
            .optional()?;
        Ok(found.is_some())
    }
}
