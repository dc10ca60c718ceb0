//! Environments as worker sessions use them: acquired for a session (a warm idle box with the
//! gateway's bundle, else a new lease brought all the way up), attached while the session is
//! placed there, and abandoned when the box dies.

use super::{Environments, invalid};
use crate::error::Result;
use skiff_protocol::EnvironmentId;
use skiff_protocol::environment::EnvironmentState;
use skiff_providers::{Lease, LeaseStatus};
use skiff_store::{EnvironmentRow, Scope};
use std::sync::Arc;

impl Environments {
    /// A ready box for a session, attached to it.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        scope: &Scope,
        profile: &str,
    ) -> Result<EnvironmentId> {
        let view = self.create(scope, profile, true).await?;
        // Bringing up is idempotent and serialized per environment: this waits for the
        // background bring-up (or finds the reused box idle).
        self.bring_up(scope.clone(), view.id.clone()).await?;
        let lock = self.lock(&view.id);
        let _guard = lock.lock().await;
        let row = self.store.environment(scope, &view.id)?;
        if row.state != EnvironmentState::Idle {
            return Err(invalid(format!(
                "environment {} is {} after bring-up: {}",
                row.id,
                row.state,
                row.error.as_deref().unwrap_or("no error recorded")
            )));
        }
        self.transition(&row, EnvironmentState::Attached, None)?;
        self.store.touch_environment(scope, &row.id)?;
        Ok(row.id)
    }

    /// Hashes the gateway's bundle now, so workers can be admitted before any bring-up.
    pub(crate) async fn warm_bundle(&self) {
        if let Err(e) = self.bundle().await {
            tracing::warn!(error = %e, "cannot hash the worker bundle");
        }
    }

    /// The gateway's bundle hash, once known (it is computed at the first bring-up).
    pub(crate) fn bundle_hash_now(&self) -> Option<String> {
        self.bundle.get().map(|b| b.hash.clone())
    }

    /// The box's pinned host key: the worker key credentials are bound to.
    pub(crate) fn host_key(&self, row: &EnvironmentRow) -> Option<String> {
        row.lease
            .as_deref()
            .and_then(|l| serde_json::from_str::<Lease>(l).ok())
            .map(|l| l.host_key)
    }

    /// Whether the provider still reports the box running.
    pub(crate) async fn box_alive(&self, row: &EnvironmentRow) -> bool {
        let Ok(profile) = self.profile(&row.profile) else {
            return false;
        };
        let lease_id = row
            .lease_id
            .clone()
            .unwrap_or_else(|| profile.provider.lease_id_for(&row.op_id));
        matches!(
            profile.provider.inspect(&lease_id).await,
            Ok(LeaseStatus::Running)
        )
    }

    /// The box died under a session: the environment failed; tear down what is left.
    pub(crate) async fn abandon(&self, scope: &Scope, id: &EnvironmentId, reason: &str) {
        let lock = self.lock(id);
        let _guard = lock.lock().await;
        if let Ok(row) = self.store.environment(scope, id)
            && !matches!(
                row.state,
                EnvironmentState::Failed
                    | EnvironmentState::Destroyed
                    | EnvironmentState::Destroying
            )
        {
            let _ = self.fail(&row, reason);
        }
        if let Err(e) = self.destroy_locked(scope, id, true).await {
            tracing::warn!(env = %id, error = %e, "could not tear down a dead box");
        }
    }
}
