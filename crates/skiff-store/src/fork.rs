//! A fork of a session: the new session's row, its copy of the transcript up to where the
//! fork was taken, and its copies of the workspace records it starts from, in one transaction.
//!
//! Deliberately absent: anything of the original session is read or changed here (the caller
//! hands over what to copy), and runs (the fork has none until its first turn).

use crate::artifacts::insert_artifact;
use crate::sessions::NewSession;
use crate::{NewArtifact, Result, Scope, SessionRow, Store, mint, now_ms, to_json};
use rusqlite::{TransactionBehavior, params};
use skiff_protocol::transcript::TranscriptEntry;
use skiff_protocol::{EntryId, RunId};

impl Store {
    /// Creates session `new` with `entries` as its transcript (in order, as a chain with new
    /// ids; each keeps the run id, body and time it had: the turn of the original session that
    /// wrote it) and `artifacts` as its records (checkpoints numbered in the order given).
    /// Nothing is written unless all of it is.
    pub fn create_fork(
        &self,
        scope: &Scope,
        new: &NewSession,
        entries: &[TranscriptEntry],
        artifacts: &[NewArtifact],
    ) -> Result<SessionRow> {
        let now = now_ms();
        let workspace = to_json("session workspace", &new.workspace)?;
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
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
            let mut parent: Option<EntryId> = None;
            {
                let mut insert = tx.prepare_cached(
                    "INSERT INTO entries (id, session_id, owner_id, tenant_id, parent_id, run_id, \
                     kind, body, created_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                )?;
                for entry in entries {
                    let id = EntryId::from_suffix(&mint()?);
                    insert.execute(params![
                        id.as_str(),
                        new.id.as_str(),
                        scope.owner_id,
                        scope.tenant_id,
                        parent.as_ref().map(EntryId::as_str),
                        entry.run_id.as_ref().map(RunId::as_str),
                        entry.body.kind(),
                        to_json("transcript entry", &entry.body)?,
                        entry.created_at_ms
                    ])?;
                    parent = Some(id);
                }
            }
            tx.execute(
                "UPDATE sessions SET leaf_entry_id = ?1 WHERE id = ?2",
                params![parent.as_ref().map(EntryId::as_str), new.id.as_str()],
            )?;
            for artifact in artifacts {
                let mut artifact = artifact.clone();
                artifact.session_id = Some(new.id.clone());
                insert_artifact(&tx, scope, &artifact)?;
            }
            tx.commit()?;
        }
        self.session(scope, &new.id)
    }
}
