//! Session rows.

use crate::{Error, Result, Scope, Store, id_col, json_col, now_ms, to_json};
use rusqlite::{OptionalExtension, Row, params};
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::{GroupId, SessionId};

/// What the gateway knows when it creates a session (it has already prepared the workspace).
#[derive(Clone, Debug)]
pub struct NewSession {
    pub id: SessionId,
    pub title: String,
    pub workspace: WorkspaceView,
    pub model_ref: String,
}

/// What a session runs its turns with from now on, each part `None` where it stays as it is.
/// Written whole or not at all ([`Store::set_session_choices`], or with the run a turn is
/// admitted by).
#[derive(Clone, Copy, Debug, Default)]
pub struct SessionChoices<'a> {
    /// How hard the model reasons (`off`, `low`, `medium`, `high`).
    pub reasoning: Option<&'a str>,
    pub approval: Option<&'a skiff_protocol::approval::ApprovalPolicy>,
    /// The agent spec version, `(name, digest)`.
    pub agent: Option<(&'a str, &'a str)>,
}

/// Writes `choices` inside the caller's transaction.
pub(crate) fn choose_in(
    conn: &rusqlite::Connection,
    scope: &Scope,
    id: &SessionId,
    choices: &SessionChoices<'_>,
) -> Result<()> {
    let not_found = || Error::NotFound {
        what: "session",
        id: id.to_string(),
    };
    if let Some(reasoning) = choices.reasoning {
        let changed = conn.execute(
            "UPDATE sessions SET reasoning = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![reasoning, id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        if changed == 0 {
            return Err(not_found());
        }
    }
    if let Some(approval) = choices.approval {
        let text = to_json("approval policy", approval)?;
        let changed = conn.execute(
            "UPDATE sessions SET approval = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![text, id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        if changed == 0 {
            return Err(not_found());
        }
    }
    if let Some((name, digest)) = choices.agent {
        crate::agents::pin_in(conn, scope, id, name, digest)?;
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq)]
pub struct SessionRow {
    pub id: SessionId,
    pub title: String,
    pub workspace: WorkspaceView,
    pub model_ref: String,
    pub placement: String,
    pub lifecycle_revision: i64,
    pub leaf_entry_id: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// The session whose agent dispatched this one.
    pub parent_id: Option<SessionId>,
    /// The session's reasoning choice (`off`, `low`, `medium`, `high`); `None` leaves it to
    /// the model's setting.
    pub reasoning: Option<String>,
    /// The fan-out group this session is one attempt of.
    pub group_id: Option<GroupId>,
    /// The session's own approval policy (`--approval`); `None` leaves it to its profile's
    /// or the gateway's.
    pub approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    /// Whose session it is: the scope every row of it is written under.
    pub owner: Scope,
}

pub(crate) const COLUMNS: &str = "id, title, workspace, model_ref, placement, lifecycle_revision, \
                       leaf_entry_id, created_at_ms, updated_at_ms, parent_id, reasoning, group_id, approval, \
                       owner_id, tenant_id";

fn from_row(row: &Row<'_>) -> rusqlite::Result<SessionRow> {
    from_row_at(row, 0)
}

pub(crate) fn from_row_at(row: &Row<'_>, o: usize) -> rusqlite::Result<SessionRow> {
    Ok(SessionRow {
        id: id_col(row, o, SessionId::parse)?,
        title: row.get(o + 1)?,
        workspace: json_col(row, o + 2)?,
        model_ref: row.get(o + 3)?,
        placement: row.get(o + 4)?,
        lifecycle_revision: row.get(o + 5)?,
        leaf_entry_id: row.get(o + 6)?,
        created_at_ms: row.get(o + 7)?,
        updated_at_ms: row.get(o + 8)?,
        parent_id: row
            .get::<_, Option<String>>(o + 9)?
            .map(|id| {
                SessionId::parse(&id).ok_or_else(|| {
                    rusqlite::Error::FromSqlConversionFailure(
                        o + 9,
                        rusqlite::types::Type::Text,
                        format!("{id} is not a session id").into(),
                    )
                })
            })
            .transpose()?,
        reasoning: row.get(o + 10)?,
        group_id: row
            .get::<_, Option<String>>(o + 11)?
            .map(|id| {
                GroupId::parse(&id).ok_or_else(|| {
                    rusqlite::Error::FromSqlConversionFailure(
                        o + 11,
                        rusqlite::types::Type::Text,
                        format!("{id} is not a group id").into(),
                    )
                })
            })
            .transpose()?,
        approval: row
            .get::<_, Option<String>>(o + 12)?
            .map(|text| {
                serde_json::from_str(&text).map_err(|e| {
                    rusqlite::Error::FromSqlConversionFailure(
                        o + 12,
                        rusqlite::types::Type::Text,
                        Box::new(e),
                    )
                })
            })
            .transpose()?,
        owner: Scope::new(row.get::<_, String>(o + 13)?, row.get::<_, String>(o + 14)?),
    })
}

impl Store {
    pub fn create_session(&self, scope: &Scope, new: &NewSession) -> Result<SessionRow> {
        self.create_session_placed(scope, new, None)
    }

    /// Creates a session, and when `placement` names a worker profile (and the gateway's
    /// worker limit), places it there claiming a worker slot — in one transaction, so a
    /// session refused for capacity leaves no row behind.
    pub fn create_session_placed(
        &self,
        scope: &Scope,
        new: &NewSession,
        placement: Option<(&str, u64)>,
    ) -> Result<SessionRow> {
        self.create_session_in(scope, new, placement, None)
    }

    /// Creates `parent`'s child session placed on `profile` (its worker slot claimed under
    /// `max_live`), unless `parent` has started `max_children` children already — counted and
    /// written in one transaction, so two dispatches at once cannot both pass the cap.
    pub fn create_child_session(
        &self,
        scope: &Scope,
        new: &NewSession,
        parent: &SessionId,
        (profile, max_live): (&str, u64),
        max_children: u64,
    ) -> Result<SessionRow> {
        self.create_session_in(
            scope,
            new,
            Some((profile, max_live)),
            Some((parent, max_children)),
        )
    }

    /// The sessions `parent`'s agent dispatched, oldest first.
    pub fn children(&self, scope: &Scope, parent: &SessionId) -> Result<Vec<SessionRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM sessions WHERE parent_id = ?1 AND owner_id = ?2 \
             AND tenant_id = ?3 ORDER BY created_at_ms, rowid"
        ))?;
        let rows = stmt
            .query_map(
                params![parent.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    pub(crate) fn create_session_in(
        &self,
        scope: &Scope,
        new: &NewSession,
        placement: Option<(&str, u64)>,
        parent: Option<(&SessionId, u64)>,
    ) -> Result<SessionRow> {
        let now = now_ms();
        let workspace = to_json("session workspace", &new.workspace)?;
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some((parent, max)) = parent {
                let started: u64 = tx.query_row(
                    "SELECT COUNT(*) FROM sessions WHERE parent_id = ?1 AND owner_id = ?2 \
                     AND tenant_id = ?3",
                    params![parent.as_str(), scope.owner_id, scope.tenant_id],
                    |r| r.get(0),
                )?;
                if started >= max {
                    return Err(Error::TooManyChildren {
                        parent: parent.to_string(),
                        max,
                    });
                }
            }
            tx.execute(
                "INSERT INTO sessions (id, owner_id, tenant_id, title, workspace, model_ref, \
                 created_at_ms, updated_at_ms, parent_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8)",
                params![
                    new.id.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                    new.title,
                    workspace,
                    new.model_ref,
                    now,
                    parent.map(|(p, _)| p.as_str())
                ],
            )?;
            if let Some((profile, max_live)) = placement {
                crate::placements::request_in(&tx, scope, &new.id, profile, max_live)?;
            }
            tx.commit()?;
        }
        self.session(scope, &new.id)
    }

    /// Sets what `choices` carries, whole or not at all (one transaction): a switch to
    /// another agent spec never leaves the new pin with the old reasoning or approval.
    pub fn set_session_choices(
        &self,
        scope: &Scope,
        id: &SessionId,
        choices: &SessionChoices<'_>,
    ) -> Result<SessionRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction()?;
            choose_in(&tx, scope, id, choices)?;
            tx.commit()?;
        }
        self.session(scope, id)
    }

    /// Sets how hard the session's model reasons from its next turn on (`None`: as the
    /// model's setting says).
    pub fn set_session_reasoning(
        &self,
        scope: &Scope,
        id: &SessionId,
        reasoning: Option<&str>,
    ) -> Result<SessionRow> {
        let changed = self.conn().execute(
            "UPDATE sessions SET reasoning = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![reasoning, id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        if changed == 0 {
            return Err(Error::NotFound {
                what: "session",
                id: id.to_string(),
            });
        }
        self.session(scope, id)
    }

    /// Sets the session's own approval policy from its next tool call on.
    pub fn set_session_approval(
        &self,
        scope: &Scope,
        id: &SessionId,
        approval: &skiff_protocol::approval::ApprovalPolicy,
    ) -> Result<SessionRow> {
        let text = to_json("approval policy", approval)?;
        let changed = self.conn().execute(
            "UPDATE sessions SET approval = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![text, id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        if changed == 0 {
            return Err(Error::NotFound {
                what: "session",
                id: id.to_string(),
            });
        }
        self.session(scope, id)
    }

    pub fn session(&self, scope: &Scope, id: &SessionId) -> Result<SessionRow> {
        self.conn()
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM sessions WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
            ))?
            .query_row(
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "session",
                id: id.to_string(),
            })
    }

    /// Sessions of the scope, newest activity first.
    pub fn sessions(&self, scope: &Scope) -> Result<Vec<SessionRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM sessions WHERE owner_id = ?1 AND tenant_id = ?2 \
             ORDER BY updated_at_ms DESC, id"
        ))?;
        let rows = stmt
            .query_map(params![scope.owner_id, scope.tenant_id], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }
}

/// A plain session with placeholder paths, for the store's own unit tests.
#[cfg(test)]
pub(crate) fn plain_session_for_tests(store: &Store, scope: &Scope) -> SessionId {
    let id = SessionId::from_suffix(&crate::mint().unwrap());
    store
        .create_session(
            scope,
            &NewSession {
                id: id.clone(),
                title: "t".into(),
                workspace: WorkspaceView::Plain {
                    source: "/s".into(),
                    path: "/p".into(),
                },
                model_ref: "scripted/demo".into(),
            },
        )
        .unwrap();
    id
}
