//! Fan-out groups: sibling sessions started together with the same prompt and base, each on a
//! box of its own, one of which may be picked as the group's result. The group's sessions and
//! their worker slots are written in one transaction: all of them or none.

use crate::sessions::{COLUMNS, NewSession, SessionRow, from_row_at};
use crate::{Error, Result, Scope, Store, id_col, now_ms, to_json};
use rusqlite::{OptionalExtension, TransactionBehavior, params};
use skiff_protocol::{GroupId, SessionId};

#[derive(Clone, Debug, PartialEq)]
pub struct GroupRow {
    pub id: GroupId,
    pub title: String,
    pub picked: Option<SessionId>,
    pub picked_at_ms: Option<i64>,
    pub created_at_ms: i64,
}

impl Store {
    /// Creates group `id` and its sessions, each placed on `profile` with a worker slot of its
    /// own, in one immediate transaction: when fewer than `sessions.len()` slots of `max_live`
    /// are free, nothing is written and the refusal says how many are.
    pub fn create_group(
        &self,
        scope: &Scope,
        id: &GroupId,
        title: &str,
        sessions: &[NewSession],
        (profile, max_live): (&str, u64),
    ) -> Result<Vec<SessionRow>> {
        let now = now_ms();
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let needs = sessions.len() as u64;
            let live = crate::placements::slots_in(&tx)?.live;
            let free = max_live.saturating_sub(live);
            if free < needs {
                return Err(Error::GroupAtCapacity {
                    needs,
                    free,
                    max: max_live,
                });
            }
            tx.execute(
                "INSERT INTO session_groups (id, owner_id, tenant_id, title, created_at_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![id.as_str(), scope.owner_id, scope.tenant_id, title, now],
            )?;
            // One millisecond apart, in the order given: every reader (the session list, the
            // UI numbering attempts) sees the order they were started in.
            for (at, new) in (now..).zip(sessions) {
                let workspace = to_json("session workspace", &new.workspace)?;
                tx.execute(
                    "INSERT INTO sessions (id, owner_id, tenant_id, title, workspace, model_ref, \
                     created_at_ms, updated_at_ms, group_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8)",
                    params![
                        new.id.as_str(),
                        scope.owner_id,
                        scope.tenant_id,
                        new.title,
                        workspace,
                        new.model_ref,
                        at,
                        id.as_str()
                    ],
                )?;
                crate::placements::request_in(&tx, scope, &new.id, profile, max_live)?;
            }
            tx.commit()?;
        }
        self.group_sessions(scope, id)
    }

    pub fn group(&self, scope: &Scope, id: &GroupId) -> Result<GroupRow> {
        self.conn()
            .query_row(
                "SELECT id, title, picked_session_id, picked_at_ms, created_at_ms \
                 FROM session_groups WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                |r| {
                    Ok(GroupRow {
                        id: id_col(r, 0, GroupId::parse)?,
                        title: r.get(1)?,
                        picked: r
                            .get::<_, Option<String>>(2)?
                            .and_then(|s| SessionId::parse(&s)),
                        picked_at_ms: r.get(3)?,
                        created_at_ms: r.get(4)?,
                    })
                },
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "group",
                id: id.to_string(),
            })
    }

    /// The group's sessions, in the order they were started.
    pub fn group_sessions(&self, scope: &Scope, id: &GroupId) -> Result<Vec<SessionRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM sessions WHERE group_id = ?1 AND owner_id = ?2 \
             AND tenant_id = ?3 ORDER BY created_at_ms, rowid"
        ))?;
        let rows = stmt
            .query_map(params![id.as_str(), scope.owner_id, scope.tenant_id], |r| {
                from_row_at(r, 0)
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Marks `session` as its group's result. Picking the picked one again changes nothing;
    /// once another attempt is picked the pick is refused.
    pub fn pick(&self, scope: &Scope, group: &GroupId, session: &SessionId) -> Result<GroupRow> {
        let changed = self.conn().execute(
            "UPDATE session_groups SET picked_session_id = ?1, picked_at_ms = ?2 \
             WHERE id = ?3 AND owner_id = ?4 AND tenant_id = ?5 AND picked_session_id IS NULL \
             AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = ?1 AND s.group_id = ?3)",
            params![
                session.as_str(),
                now_ms(),
                group.as_str(),
                scope.owner_id,
                scope.tenant_id
            ],
        )?;
        picked(self.group(scope, group)?, group, session, changed > 0)
    }
}

/// What a pick of `session` answers once the conditional update ran (`changed`: whether it
/// wrote), from the group as it now reads.
pub(crate) fn picked(
    row: GroupRow,
    group: &GroupId,
    session: &SessionId,
    changed: bool,
) -> Result<GroupRow> {
    match &row.picked {
        Some(picked) if picked == session => Ok(row),
        Some(picked) => Err(Error::AlreadyPicked {
            group: group.to_string(),
            picked: picked.to_string(),
        }),
        None if !changed => Err(Error::NotFound {
            what: "session in group",
            id: session.to_string(),
        }),
        None => Err(Error::Corrupt {
            what: "group",
            detail: format!("group {group}'s pick was written but does not read back"),
        }),
    }
}
