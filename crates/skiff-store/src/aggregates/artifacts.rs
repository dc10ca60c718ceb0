//! Artifact rows (metadata of content-addressed blobs) and their retention, on both backends:
//! the SQLite [`Store`] delegates to its own methods, [`PgStore`](crate::PgStore) is
//! `pg/artifacts.rs`.

use crate::{ArtifactRole, ArtifactRow, NewArtifact, Result, Scope, Store};
use skiff_protocol::ids::ArtifactId;
use skiff_protocol::{AttemptId, SessionId};

pub trait Artifacts: Send + Sync {
    /// Records an artifact whose blob is stored; a checkpoint gets its session's next
    /// sequence number (1, 2, 3…), whichever connection writes it.
    fn create_artifact(&self, scope: &Scope, new: &NewArtifact) -> Result<ArtifactRow>;
    fn artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow>;
    /// A session's artifacts of one role, oldest first (checkpoints in sequence order).
    fn artifacts(
        &self,
        scope: &Scope,
        session: &SessionId,
        role: ArtifactRole,
    ) -> Result<Vec<ArtifactRow>>;
    /// Records that `attempt` resumes from checkpoint `artifact`.
    fn set_attempt_checkpoint(
        &self,
        scope: &Scope,
        attempt: &AttemptId,
        artifact: &ArtifactId,
    ) -> Result<()>;
    /// Why a checkpoint must be kept, if it must.
    fn retained_by(&self, scope: &Scope, row: &ArtifactRow) -> Result<Option<String>>;
    /// Deletes the row unless retention keeps it (`Retained`).
    fn delete_artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow>;
    fn set_artifact_meta(
        &self,
        scope: &Scope,
        id: &ArtifactId,
        meta: &serde_json::Value,
    ) -> Result<()>;
    /// Deletes the scope's transient artifacts expired by `now_ms`; returns them.
    fn expire_artifacts(&self, scope: &Scope, now_ms: i64) -> Result<Vec<ArtifactRow>>;
    /// Whether any row, in any scope, names the blob `hash`.
    fn blob_referenced(&self, hash: &str) -> Result<bool>;
}

impl Artifacts for Store {
    fn create_artifact(&self, scope: &Scope, new: &NewArtifact) -> Result<ArtifactRow> {
        Store::create_artifact(self, scope, new)
    }
    fn artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow> {
        Store::artifact(self, scope, id)
    }
    fn artifacts(
        &self,
        scope: &Scope,
        session: &SessionId,
        role: ArtifactRole,
    ) -> Result<Vec<ArtifactRow>> {
        Store::artifacts(self, scope, session, role)
    }
    fn set_attempt_checkpoint(
        &self,
        scope: &Scope,
        attempt: &AttemptId,
        artifact: &ArtifactId,
    ) -> Result<()> {
        Store::set_attempt_checkpoint(self, scope, attempt, artifact)
    }
    fn retained_by(&self, scope: &Scope, row: &ArtifactRow) -> Result<Option<String>> {
        Store::retained_by(self, scope, row)
    }
    fn delete_artifact(&self, scope: &Scope, id: &ArtifactId) -> Result<ArtifactRow> {
        Store::delete_artifact(self, scope, id)
    }
    fn set_artifact_meta(
        &self,
        scope: &Scope,
        id: &ArtifactId,
        meta: &serde_json::Value,
    ) -> Result<()> {
        Store::set_artifact_meta(self, scope, id, meta)
    }
    fn expire_artifacts(&self, scope: &Scope, now_ms: i64) -> Result<Vec<ArtifactRow>> {
        Store::expire_artifacts(self, scope, now_ms)
    }
    fn blob_referenced(&self, hash: &str) -> Result<bool> {
        Store::blob_referenced(self, hash)
    }
}
