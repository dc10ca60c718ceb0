//! Session rows.

use crate::{Error, Result, Scope, Store, id_col, json_col, now_ms, to_json};
use rusqlite::{OptionalExtension, Row, params};
use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;

/// What the gateway knows when it creates a session (it has already prepared the workspace).
#[derive(Clone, Debug)]
pub struct NewSession {
    pub id: SessionId,
    pub title: String,
    pub workspace: WorkspaceView,
    pub model_ref: String,
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
}

const COLUMNS: &str = "id, title, workspace, model_ref, placement, lifecycle_revision, \
                       leaf_entry_id, created_at_ms, updated_at_ms";

fn from_row(row: &Row<'_>) -> rusqlite::Result<SessionRow> {
    Ok(SessionRow {
        id: id_col(row, 0, SessionId::parse)?,
        title: row.get(1)?,
        workspace: json_col(row, 2)?,
        model_ref: row.get(3)?,
        placement: row.get(4)?,
        lifecycle_revision: row.get(5)?,
        leaf_entry_id: row.get(6)?,
        created_at_ms: row.get(7)?,
        updated_at_ms: row.get(8)?,
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
        let now = now_ms();
        let workspace = to_json("session workspace", &new.workspace)?;
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            tx.execute(
                "INSERT INTO sessions (id, owner_id, tenant_id, title, workspace, model_ref, \
                 created_at_ms, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
                params![
                    new.id.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                    new.title,
                    workspace,
                    new.model_ref,
                    now
                ],
            )?;
            if let Some((profile, max_live)) = placement {
                crate::placements::request_in(&tx, scope, &new.id, profile, max_live)?;
            }
            tx.commit()?;
        }
        self.session(scope, &new.id)
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
