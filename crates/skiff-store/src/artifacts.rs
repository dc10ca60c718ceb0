//! Artifact rows: metadata of content-addressed blobs (checkpoints, manifests, results, logs)
//! and their retention. The blobs themselves live on disk (`<state>/artifacts/<blake3>`, owned
//! by `skiff-sync`'s content store); this module never touches them.
//!
//! Retention: a checkpoint stays while any retryable run depends on it (an attempt resumes
//! from it, or it is its session's newest checkpoint while the session's newest run can still
//! be retried); `transient` rows (logs) may expire early; every delete is scoped by owner and
//! tenant and removes only that scope's row — a blob another row names stays.

use crate::{Error, Result, Scope, Store, id_col, now_ms};
use rusqlite::{OptionalExtension, Row, params};
use skiff_protocol::ids::ArtifactId;
use skiff_protocol::{AttemptId, RunId, SessionId};

/// What an artifact is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArtifactRole {
    Checkpoint,
    Manifest,
    Result,
    Log,
    /// What a box produced that reconciliation refused, kept for an operator's decision.
    Quarantine,
}

impl ArtifactRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactRole::Checkpoint => "checkpoint",
            ArtifactRole::Manifest => "manifest",
            ArtifactRole::Result => "result",
            ArtifactRole::Log => "log",
            ArtifactRole::Quarantine => "quarantine",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Checkpoint,
            Self::Manifest,
            Self::Result,
            Self::Log,
            Self::Quarantine,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

/// How long an artifact is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retention {
    /// While any retryable run depends on it (checkpoints).
    WhileRetryable,
    /// As long as its session (results, manifests).
    Session,
    /// May expire early, at `expires_at_ms` (logs, progress).
    Transient,
}

impl Retention {
    pub fn as_str(self) -> &'static str {
        match self {
            Retention::WhileRetryable => "while_retryable",
            Retention::Session => "session",
            Retention::Transient => "transient",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::WhileRetryable, Self::Session, Self::Transient]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// Run statuses from which a run may still be retried (a new attempt from a checkpoint).
pub(crate) const RETRYABLE: &str = "('queued','starting','running','waiting_input','waiting_approval',\
    'cancelling','failed','timed_out','orphaned')";

#[derive(Clone, Debug, PartialEq)]
pub struct NewArtifact {
    pub session_id: Option<SessionId>,
    pub run_id: Option<RunId>,
    pub role: ArtifactRole,
    pub retention: Retention,
    /// blake3 (hex) of the stored blob.
    pub hash: String,
    pub size: u64,
    /// Metadata only (refs, counts, mode): never content, never secrets.
    pub meta: serde_json::Value,
    pub expires_at_ms: Option<i64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ArtifactRow {
    pub id: ArtifactId,
    pub scope: Scope,
    pub session_id: Option<SessionId>,
    pub run_id: Option<RunId>,
    pub role: ArtifactRole,
    pub retention: Retention,
    pub hash: String,
    pub size: u64,
    /// Checkpoints: 1, 2, 3… per session.
    pub seq: Option<u64>,
    pub meta: serde_json::Value,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
}

pub(crate) const COLUMNS: &str = "id, owner_id, tenant_id, session_id, run_id, role, retention, hash, size, \
    seq, meta, created_at_ms, expires_at_ms";

fn conversion(idx: usize, message: String) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(idx, rusqlite::types::Type::Text, message.into())
}

fn from_row(row: &Row<'_>) -> rusqlite::Result<ArtifactRow> {
    let session: Option<String> = row.get(3)?;
    let run: Option<String> = row.get(4)?;
    let role: String = row.get(5)?;
    let retention: String = row.get(6)?;
    let size: i64 = row.get(8)?;
    let seq: Option<i64> = row.get(9)?;
    Ok(ArtifactRow {
        id: id_col(row, 0, ArtifactId::parse)?,
        scope: Scope::new(row.get::<_, String>(1)?, row.get::<_, String>(2)?),
        session_id: session
            .map(|s| SessionId::parse(&s).ok_or_else(|| conversion(3, format!("bad id {s:?}"))))
            .transpose()?,
        run_id: run
            .map(|s| RunId::parse(&s).ok_or_else(|| conversion(4, format!("bad id {s:?}"))))
            .transpose()?,
        role: ArtifactRole::parse(&role)
            .ok_or_else(|| conversion(5, format!("unknown role {role:?}")))?,
        retention: Retention::parse(&retention)
            .ok_or_else(|| conversion(6, format!("unknown retention {retention:?}")))?,
        hash: row.get(7)?,
        size: u64::try_from(size).unwrap_or(0),
        seq: seq.and_then(|s| u64::try_from(s).ok()),
        meta: crate::json_col(row, 10)?,
        created_at_ms: row.get(11)?,
        expires_at_ms: row.get(12)?,
    })
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Inserts an artifact row inside `tx`; a checkpoint gets the session's next sequence number.
pub(crate) fn insert_artifact(
    tx: &rusqlite::Transaction<'_>,
    scope: &Scope,
    new: &NewArtifact,
) -> Result<ArtifactId> {
    let id = ArtifactId::from_suffix(&crate::mint()?);
    let meta = crate::to_json("artifact metadata", &new.meta)?;
    let seq: Option<i64> = match (new.role, &new.session_id) {
        (ArtifactRole::Checkpoint, Some(session)) => Some(tx.query_row(
            "SELECT COALESCE(MAX(seq), 0) + 1 FROM artifacts \
             WHERE session_id = ?1 AND role = 'checkpoint'",
            params![session.as_str()],
            |r| r.get(0),
        )?),
        _ => None,
    };
    tx.execute(
        &format!("INSERT INTO artifacts ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"),
        params![
            id.as_str(),
            scope.owner_id,
            scope.tenant_id,
            new.session_id.as_ref().map(SessionId::as_str),
            new.run_id.as_ref().map(RunId::as_str),
            new.role.as_str(),
            new.retention.as_str(),
            new.hash,
            to_i64(new.size),
            seq,
            meta,
            now_ms(),
            new.expires_at_ms,
        ],
    )?;
    Ok(id)
}

impl Store {
    /// Records an artifact whose blob is already stored. Checkpoints get the session's next
    /// sequence number, in the same transaction.
    pub fn create_artifact(&self, scope: &Scope, new: &NewArtifact) -> Result<ArtifactRow> {
        let mut conn = self.conn();
        // Immediate: the sequence number read is the one written, even against another
        // connection checkpointing the same session.
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let id = insert_artifact(&tx, scope, new)?;
        tx.commit()?;
        drop(conn);
        self.artifact(scope, &id)
    }

    pub fn artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM artifacts WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3"),
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "artifact",
                id: id.to_string(),
            })
    }

    /// A session's artifacts of one role, oldest first (checkpoints in sequence order).
    pub fn artifacts(
        &self,
        scope: &Scope,
        session: &SessionId,
        role: ArtifactRole,
    ) -> Result<Vec<ArtifactRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM artifacts WHERE owner_id = ?1 AND tenant_id = ?2 \
             AND session_id = ?3 AND role = ?4 ORDER BY seq, created_at_ms, id"
        ))?;
        let rows = stmt
            .query_map(
                params![
                    scope.owner_id,
                    scope.tenant_id,
                    session.as_str(),
                    role.as_str()
                ],
                from_row,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Records that `attempt` resumes from checkpoint `artifact` (both in the caller's scope).
    pub fn set_attempt_checkpoint(
        &self,
        scope: &Scope,
        attempt: &AttemptId,
        artifact: &ArtifactId,
    ) -> Result<()> {
        self.artifact(scope, artifact)?;
        let changed = self.conn().execute(
            "UPDATE attempts SET checkpoint_artifact_id = ?1 \
             WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![
                artifact.as_str(),
                attempt.as_str(),
                scope.owner_id,
                scope.tenant_id
            ],
        )?;
        if changed == 0 {
            return Err(Error::NotFound {
                what: "attempt",
                id: attempt.to_string(),
            });
        }
        Ok(())
    }

    /// Why a checkpoint must be kept, if it must: a retryable run depends on it.
    pub fn retained_by(&self, scope: &Scope, row: &ArtifactRow) -> Result<Option<String>> {
        if row.retention != Retention::WhileRetryable {
            return Ok(None);
        }
        let conn = self.conn();
        let resuming: Option<String> = conn
            .query_row(
                &format!(
                    "SELECT r.id FROM attempts a JOIN runs r ON r.id = a.run_id \
                     WHERE a.checkpoint_artifact_id = ?1 AND a.owner_id = ?2 AND a.tenant_id = ?3 \
                     AND r.status IN {RETRYABLE} LIMIT 1"
                ),
                params![row.id.as_str(), scope.owner_id, scope.tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(run) = resuming {
            return Ok(Some(format!(
                "run {run} resumes from it and may be retried"
            )));
        }
        let Some(session) = &row.session_id else {
            return Ok(None);
        };
        let newest: Option<String> = conn
            .query_row(
                "SELECT id FROM artifacts WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3 \
                 AND role = 'checkpoint' ORDER BY seq DESC LIMIT 1",
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        if newest.as_deref() != Some(row.id.as_str()) {
            return Ok(None);
        }
        let last_run: Option<(String, String)> = conn
            .query_row(
                "SELECT id, status FROM runs WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3 \
                 ORDER BY created_at_ms DESC, rowid DESC LIMIT 1",
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        Ok(last_run
            .filter(|(_, status)| RETRYABLE.contains(&format!("'{status}'")))
            .map(|(run, status)| {
                format!("it is the newest checkpoint of session {session}, whose run {run} is {status} and may be retried")
            }))
    }

    /// Deletes the scope's artifact row, unless retention keeps it (`Error::Retained`). The
    /// caller removes the blob when [`Store::blob_referenced`] says no row names it any more.
    pub fn delete_artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow> {
        let row = self.artifact(scope, id)?;
        if let Some(reason) = self.retained_by(scope, &row)? {
            return Err(Error::Retained {
                id: id.to_string(),
                reason,
            });
        }
        self.conn().execute(
            "DELETE FROM artifacts WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
            params![id.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(row)
    }

    /// Replaces the artifact's metadata (a quarantine whose paths were partly accepted).
    pub fn set_artifact_meta(
        &self,
        scope: &Scope,
        id: &ArtifactId,
        meta: &serde_json::Value,
    ) -> Result<()> {
        let changed = self.conn().execute(
            "UPDATE artifacts SET meta = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
            params![
                meta.to_string(),
                id.as_str(),
                scope.owner_id,
                scope.tenant_id
            ],
        )?;
        if changed == 0 {
            return Err(Error::NotFound {
                what: "artifact",
                id: id.to_string(),
            });
        }
        Ok(())
    }

    /// Deletes the scope's transient artifacts that expired by `now_ms`; returns them.
    pub fn expire_artifacts(&self, scope: &Scope, now_ms: i64) -> Result<Vec<ArtifactRow>> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let expired = {
            let mut stmt = tx.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM artifacts WHERE owner_id = ?1 AND tenant_id = ?2 \
                 AND retention = 'transient' AND expires_at_ms IS NOT NULL AND expires_at_ms <= ?3"
            ))?;
            stmt.query_map(params![scope.owner_id, scope.tenant_id, now_ms], from_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        for row in &expired {
            tx.execute(
                "DELETE FROM artifacts WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                params![row.id.as_str(), scope.owner_id, scope.tenant_id],
            )?;
        }
        tx.commit()?;
        Ok(expired)
    }

    /// Whether any row, in any scope, still names the blob `hash`. The one unscoped artifact
    /// query: blob collection needs it, and it reveals nothing but a yes or no.
    pub fn blob_referenced(&self, hash: &str) -> Result<bool> {
        Ok(self
            .conn()
            .query_row(
                "SELECT 1 FROM artifacts WHERE hash = ?1 LIMIT 1",
                params![hash],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::plain_session_for_tests;
    use skiff_protocol::api::RunStatus;

    fn new(
        session: &SessionId,
        role: ArtifactRole,
        retention: Retention,
        hash: &str,
    ) -> NewArtifact {
        NewArtifact {
            session_id: Some(session.clone()),
            run_id: None,
            role,
            retention,
            hash: hash.into(),
            size: 3,
            meta: serde_json::json!({ "mode": "plain" }),
            expires_at_ms: (retention == Retention::Transient).then_some(1_000),
        }
    }

    fn finish(store: &Store, scope: &Scope, run: &RunId, end: RunStatus) {
        for status in [RunStatus::Starting, RunStatus::Running, end] {
            store.transition_run(scope, run, status, None).unwrap();
        }
    }

    #[test]
    fn checkpoints_are_numbered_and_scoped() {
        let store = Store::open_in_memory().unwrap();
        let (alice, bob) = (Scope::new("a", "t1"), Scope::new("b", "t2"));
        let s = plain_session_for_tests(&store, &alice);
        let one = store
            .create_artifact(
                &alice,
                &new(
                    &s,
                    ArtifactRole::Checkpoint,
                    Retention::WhileRetryable,
                    "h1",
                ),
            )
            .unwrap();
        let two = store
            .create_artifact(
                &alice,
                &new(
                    &s,
                    ArtifactRole::Checkpoint,
                    Retention::WhileRetryable,
                    "h2",
                ),
            )
            .unwrap();
        assert_eq!((one.seq, two.seq), (Some(1), Some(2)));
        assert!(one.id.as_str().starts_with("art_"));
        let listed = store
            .artifacts(&alice, &s, ArtifactRole::Checkpoint)
            .unwrap();
        assert_eq!(listed, vec![one.clone(), two]);
        assert!(
            store
                .artifacts(&bob, &s, ArtifactRole::Checkpoint)
                .unwrap()
                .is_empty()
        );
        assert!(matches!(
            store.artifact(&bob, &one.id),
            Err(Error::NotFound { .. })
        ));
        assert!(matches!(
            store.delete_artifact(&bob, &one.id),
            Err(Error::NotFound { .. })
        ));
    }

    #[test]
    fn checkpoints_live_while_a_retryable_run_depends_on_them() {
        let store = Store::open_in_memory().unwrap();
        let scope = Scope::new("a", "t1");
        let s = plain_session_for_tests(&store, &scope);
        let old = store
            .create_artifact(
                &scope,
                &new(
                    &s,
                    ArtifactRole::Checkpoint,
                    Retention::WhileRetryable,
                    "h1",
                ),
            )
            .unwrap();
        let newest = store
            .create_artifact(
                &scope,
                &new(
                    &s,
                    ArtifactRole::Checkpoint,
                    Retention::WhileRetryable,
                    "h2",
                ),
            )
            .unwrap();
        // The newest checkpoint of a session whose last run failed is what a retry resumes from.
        let run = store.create_run(&scope, &s, "scripted/demo").unwrap();
        finish(&store, &scope, &run.id, RunStatus::Failed);
        let err = store.delete_artifact(&scope, &newest.id).unwrap_err();
        assert!(err.to_string().contains("may be retried"), "{err}");
        // An attempt resuming from an older checkpoint pins that one too.
        let run2 = store.create_run(&scope, &s, "scripted/demo").unwrap();
        store
            .transition_run(&scope, &run2.id, RunStatus::Starting, None)
            .unwrap();
        let attempt = store.start_attempt(&scope, &run2, "gateway", 1).unwrap();
        store
            .set_attempt_checkpoint(&scope, &attempt, &old.id)
            .unwrap();
        assert!(matches!(
            store.delete_artifact(&scope, &old.id),
            Err(Error::Retained { .. })
        ));
        // Once the run succeeds, nothing depends on either.
        store
            .transition_run(&scope, &run2.id, RunStatus::Running, None)
            .unwrap();
        store
            .transition_run(&scope, &run2.id, RunStatus::Succeeded, None)
            .unwrap();
        store.delete_artifact(&scope, &old.id).unwrap();
        store.delete_artifact(&scope, &newest.id).unwrap();
        assert!(!store.blob_referenced("h1").unwrap());
    }

    #[test]
    fn logs_expire_and_shared_blobs_stay_referenced() {
        let store = Store::open_in_memory().unwrap();
        let (alice, bob) = (Scope::new("a", "t1"), Scope::new("b", "t2"));
        let (sa, sb) = (
            plain_session_for_tests(&store, &alice),
            plain_session_for_tests(&store, &bob),
        );
        let log = store
            .create_artifact(
                &alice,
                &new(&sa, ArtifactRole::Log, Retention::Transient, "same"),
            )
            .unwrap();
        store
            .create_artifact(
                &bob,
                &new(&sb, ArtifactRole::Log, Retention::Transient, "same"),
            )
            .unwrap();
        assert!(store.expire_artifacts(&alice, 999).unwrap().is_empty());
        let expired = store.expire_artifacts(&alice, 1_000).unwrap();
        assert_eq!(expired, vec![log]);
        // Bob's row for the same content is untouched: the blob must stay.
        assert!(store.blob_referenced("same").unwrap());
        assert_eq!(
            store.artifacts(&bob, &sb, ArtifactRole::Log).unwrap().len(),
            1
        );
    }
}
