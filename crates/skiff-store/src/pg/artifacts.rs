//! Artifact rows on PostgreSQL.

use super::conn::PgConn;
use super::{PgStore, bigint, count, id, json, optional_id};
use crate::aggregates::Artifacts;
use crate::artifacts::{COLUMNS, RETRYABLE};
use crate::{
    ArtifactRole, ArtifactRow, Error, NewArtifact, Result, Retention, Scope, mint, now_ms, to_json,
};
use postgres::{Row, Transaction};
use skiff_protocol::ids::ArtifactId;
use skiff_protocol::{AttemptId, RunId, SessionId};

fn artifact_from(row: &Row) -> Result<ArtifactRow> {
    let role: &str = row.try_get(5)?;
    let retention: &str = row.try_get(6)?;
    Ok(ArtifactRow {
        id: id("artifact", row.try_get(0)?, ArtifactId::parse)?,
        scope: Scope::new(row.try_get::<_, String>(1)?, row.try_get::<_, String>(2)?),
        session_id: optional_id("artifact", row.try_get(3)?, SessionId::parse)?,
        run_id: optional_id("artifact", row.try_get(4)?, RunId::parse)?,
        role: ArtifactRole::parse(role).ok_or_else(|| Error::Corrupt {
            what: "artifact",
            detail: format!("unknown role {role:?}"),
        })?,
        retention: Retention::parse(retention).ok_or_else(|| Error::Corrupt {
            what: "artifact",
            detail: format!("unknown retention {retention:?}"),
        })?,
        hash: row.try_get(7)?,
        size: count("artifact size", row.try_get(8)?)?,
        seq: row
            .try_get::<_, Option<i64>>(9)?
            .map(|seq| count("checkpoint sequence", seq))
            .transpose()?,
        meta: json("artifact metadata", row.try_get(10)?)?,
        created_at_ms: row.try_get(11)?,
        expires_at_ms: row.try_get(12)?,
    })
}

fn artifact_in(conn: &mut PgConn, scope: &Scope, artifact: &str) -> Result<ArtifactRow> {
    let row = conn
        .client
        .query_opt(
            &format!(
                "SELECT {COLUMNS} FROM artifacts WHERE id = $1 AND owner_id = $2 \
                 AND tenant_id = $3"
            ),
            &[&artifact, &scope.owner_id, &scope.tenant_id],
        )?
        .ok_or_else(|| Error::NotFound {
            what: "artifact",
            id: artifact.to_owned(),
        })?;
    artifact_from(&row)
}

/// `retained_by` on the connection's thread.
fn retained_in(conn: &mut PgConn, scope: &Scope, row: &ArtifactRow) -> Result<Option<String>> {
    if row.retention != Retention::WhileRetryable {
        return Ok(None);
    }
    let resuming = conn.client.query_opt(
        &format!(
            "SELECT r.id FROM attempts a JOIN runs r ON r.id = a.run_id \
             WHERE a.checkpoint_artifact_id = $1 AND a.owner_id = $2 AND a.tenant_id = $3 \
             AND r.status IN {RETRYABLE} LIMIT 1"
        ),
        &[&row.id.as_str(), &scope.owner_id, &scope.tenant_id],
    )?;
    if let Some(resuming) = resuming {
        let run: String = resuming.try_get(0)?;
        return Ok(Some(format!(
            "run {run} resumes from it and may be retried"
        )));
    }
    let Some(session) = &row.session_id else {
        return Ok(None);
    };
    let newest = conn.client.query_opt(
        "SELECT id FROM artifacts WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 \
         AND role = 'checkpoint' ORDER BY seq DESC LIMIT 1",
        &[&session.as_str(), &scope.owner_id, &scope.tenant_id],
    )?;
    let newest: Option<String> = newest.map(|r| r.try_get(0)).transpose()?;
    if newest.as_deref() != Some(row.id.as_str()) {
        return Ok(None);
    }
    let last_run = conn.client.query_opt(
        "SELECT id, status FROM runs WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 \
         ORDER BY created_at_ms DESC, ord DESC LIMIT 1",
        &[&session.as_str(), &scope.owner_id, &scope.tenant_id],
    )?;
    let Some(last_run) = last_run else {
        return Ok(None);
    };
    let (run, status): (String, String) = (last_run.try_get(0)?, last_run.try_get(1)?);
    Ok(RETRYABLE.contains(&format!("'{status}'")).then(|| {
        format!(
            "it is the newest checkpoint of session {session}, whose run {run} is {status} and may be retried"
        )
    }))
}

/// Records an artifact inside the caller's transaction; a checkpoint gets its session's next
/// number.
pub(super) fn insert_artifact(
    tx: &mut Transaction<'_>,
    scope: &Scope,
    new: &NewArtifact,
) -> Result<ArtifactRow> {
    let artifact = ArtifactId::from_suffix(&mint()?).to_string();
    let meta = to_json("artifact metadata", &new.meta)?;
    let now = now_ms();
    let session = new.session_id.as_ref().map(ToString::to_string);
    if let (ArtifactRole::Checkpoint, Some(session)) = (new.role, &session) {
        // Checkpoints of one session are numbered one at a time (the session row's lock,
        // held until commit), so the next number is free when it is written.
        tx.execute(
            "SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE",
            &[session],
        )?;
    }
    let row = tx.query_one(
        &format!(
            "INSERT INTO artifacts ({COLUMNS}) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, \
             CASE WHEN $6 = 'checkpoint' AND $4::text IS NOT NULL THEN \
                 (SELECT COALESCE(MAX(seq), 0) + 1 FROM artifacts \
                  WHERE session_id = $4 AND role = 'checkpoint') END, \
             $10, $11, $12 \
             RETURNING {COLUMNS}"
        ),
        &[
            &artifact,
            &scope.owner_id,
            &scope.tenant_id,
            &session,
            &new.run_id.as_ref().map(ToString::to_string),
            &new.role.as_str(),
            &new.retention.as_str(),
            &new.hash,
            &bigint(new.size),
            &meta,
            &now,
            &new.expires_at_ms,
        ],
    )?;
    artifact_from(&row)
}

impl Artifacts for PgStore {
    fn create_artifact(&self, scope: &Scope, new: &NewArtifact) -> Result<ArtifactRow> {
        let (scope, new) = (scope.clone(), new.clone());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let row = insert_artifact(&mut tx, &scope, &new)?;
            tx.commit()?;
            Ok(row)
        })
    }

    fn artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| artifact_in(conn, &scope, &id))
    }

    fn artifacts(
        &self,
        scope: &Scope,
        session: &SessionId,
        role: ArtifactRole,
    ) -> Result<Vec<ArtifactRow>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM artifacts WHERE owner_id = $1 AND tenant_id = $2 \
                         AND session_id = $3 AND role = $4 ORDER BY seq, created_at_ms, id"
                    ),
                    &[&scope.owner_id, &scope.tenant_id, &session, &role.as_str()],
                )?
                .iter()
                .map(artifact_from)
                .collect()
        })
    }

    fn set_attempt_checkpoint(
        &self,
        scope: &Scope,
        attempt: &AttemptId,
        artifact: &ArtifactId,
    ) -> Result<()> {
        let args = (scope.clone(), attempt.to_string(), artifact.to_string());
        self.conn.run(move |conn| {
            let (scope, attempt, artifact) = args;
            artifact_in(conn, &scope, &artifact)?;
            let changed = conn.client.execute(
                "UPDATE attempts SET checkpoint_artifact_id = $1 \
                 WHERE id = $2 AND owner_id = $3 AND tenant_id = $4",
                &[&artifact, &attempt, &scope.owner_id, &scope.tenant_id],
            )?;
            if changed == 0 {
                return Err(Error::NotFound {
                    what: "attempt",
                    id: attempt,
                });
            }
            Ok(())
        })
    }

    fn retained_by(&self, scope: &Scope, row: &ArtifactRow) -> Result<Option<String>> {
        let (scope, row) = (scope.clone(), row.clone());
        self.conn.run(move |conn| retained_in(conn, &scope, &row))
    }

    fn delete_artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| {
            let row = artifact_in(conn, &scope, &id)?;
            if let Some(reason) = retained_in(conn, &scope, &row)? {
                return Err(Error::Retained { id, reason });
            }
            conn.client.execute(
                "DELETE FROM artifacts WHERE id = $1 AND owner_id = $2 AND tenant_id = $3",
                &[&id, &scope.owner_id, &scope.tenant_id],
            )?;
            Ok(row)
        })
    }

    fn set_artifact_meta(
        &self,
        scope: &Scope,
        id: &ArtifactId,
        meta: &serde_json::Value,
    ) -> Result<()> {
        let (scope, id, meta) = (scope.clone(), id.to_string(), meta.to_string());
        self.conn.run(move |conn| {
            let changed = conn.client.execute(
                "UPDATE artifacts SET meta = $1 WHERE id = $2 AND owner_id = $3 AND tenant_id = $4",
                &[&meta, &id, &scope.owner_id, &scope.tenant_id],
            )?;
            if changed == 0 {
                return Err(Error::NotFound {
                    what: "artifact",
                    id,
                });
            }
            Ok(())
        })
    }

    fn expire_artifacts(&self, scope: &Scope, now_ms: i64) -> Result<Vec<ArtifactRow>> {
        let scope = scope.clone();
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "DELETE FROM artifacts WHERE owner_id = $1 AND tenant_id = $2 \
                         AND retention = 'transient' AND expires_at_ms IS NOT NULL \
                         AND expires_at_ms <= $3 RETURNING {COLUMNS}"
                    ),
                    &[&scope.owner_id, &scope.tenant_id, &now_ms],
                )?
                .iter()
                .map(artifact_from)
                .collect()
        })
    }

    fn blob_referenced(&self, hash: &str) -> Result<bool> {
        let hash = hash.to_owned();
        self.conn.run(move |conn| {
            Ok(conn
                .client
                .query_opt("SELECT 1 FROM artifacts WHERE hash = $1 LIMIT 1", &[&hash])?
                .is_some())
        })
    }
}
