//! The transcript tree: batch appends with compare-and-swap on the session's leaf, and the
//! path from the leaf to the root.

use crate::aggregates::leases::Fence;
use crate::{Error, Result, Scope, Store, id_col, json_col, mint, now_ms, to_json};
use rusqlite::{OptionalExtension, TransactionBehavior, params};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{EntryId, RunId, SessionId};

impl Store {
    /// Appends `bodies` as a chain under the session's leaf, if the leaf is still `base_leaf`.
    /// The store assigns ids and parent ids; the caller never supplies either.
    pub fn append_entries(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>> {
        self.append_entries_with(None, scope, session, base_leaf, run, bodies)
    }

    /// `append_entries`, first checking `fence` (issue 17) in the same transaction.
    pub(crate) fn append_entries_with(
        &self,
        fence: Option<&Fence>,
        scope: &Scope,
        session: &SessionId,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(fence) = fence {
            crate::leases::check_fence(&tx, fence)?;
        }
        let leaf: Option<Option<String>> = tx
            .query_row(
                "SELECT leaf_entry_id FROM sessions WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        let Some(leaf) = leaf else {
            return Err(Error::NotFound {
                what: "session",
                id: session.to_string(),
            });
        };
        if leaf.as_deref() != base_leaf.map(EntryId::as_str) {
            return Err(Error::LeafConflict {
                session: session.to_string(),
                expected: base_leaf.map_or("(empty)".into(), ToString::to_string),
                actual: leaf.unwrap_or_else(|| "(empty)".into()),
            });
        }

        let now = now_ms();
        let mut parent = base_leaf.cloned();
        let mut committed = Vec::with_capacity(bodies.len());
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO entries (id, session_id, owner_id, tenant_id, parent_id, run_id, \
                 kind, body, created_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            for body in bodies {
                let id = EntryId::from_suffix(&mint()?);
                insert.execute(params![
                    id.as_str(),
                    session.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                    parent.as_ref().map(EntryId::as_str),
                    run.map(RunId::as_str),
                    body.kind(),
                    to_json("transcript entry", body)?,
                    now
                ])?;
                committed.push(TranscriptEntry {
                    id: id.clone(),
                    parent_id: parent.replace(id),
                    run_id: run.cloned(),
                    created_at_ms: now,
                    body: body.clone(),
                });
            }
        }
        tx.execute(
            "UPDATE sessions SET leaf_entry_id = ?1, updated_at_ms = ?2 WHERE id = ?3",
            params![parent.as_ref().map(EntryId::as_str), now, session.as_str()],
        )?;
        tx.commit()?;
        Ok(committed)
    }

    /// The session's current leaf entry, if the transcript is not empty.
    pub fn leaf(&self, scope: &Scope, session: &SessionId) -> Result<Option<EntryId>> {
        Ok(self
            .session(scope, session)?
            .leaf_entry_id
            .and_then(|id| EntryId::parse(&id)))
    }

    /// The transcript from the root to the leaf.
    pub fn transcript(&self, scope: &Scope, session: &SessionId) -> Result<Vec<TranscriptEntry>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "WITH RECURSIVE path(id, depth) AS (
                 SELECT leaf_entry_id, 0 FROM sessions
                  WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3 AND leaf_entry_id IS NOT NULL
                 UNION ALL
                 SELECT e.parent_id, p.depth + 1 FROM entries e JOIN path p ON e.id = p.id
                  WHERE e.parent_id IS NOT NULL
             )
             SELECT e.id, e.parent_id, e.run_id, e.created_at_ms, e.body
               FROM path p JOIN entries e ON e.id = p.id
              ORDER BY p.depth DESC",
        )?;
        let rows = stmt
            .query_map(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                |row| {
                    Ok(TranscriptEntry {
                        id: id_col(row, 0, EntryId::parse)?,
                        parent_id: row
                            .get::<_, Option<String>>(1)?
                            .and_then(|s| EntryId::parse(&s)),
                        run_id: row
                            .get::<_, Option<String>>(2)?
                            .and_then(|s| RunId::parse(&s)),
                        created_at_ms: row.get(3)?,
                        body: json_col(row, 4)?,
                    })
                },
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }
}
