//! Environments as worker sessions use them: acquired for a session (a warm idle box with the
//! gateway's bundle, else a new lease brought all the way up), attached while the session is
//! placed there, and abandoned when the box dies.

use super::Environments;
use crate::error::Result;
use skiff_protocol::EnvironmentId;
use skiff_protocol::environment::EnvironmentState;
use skiff_providers::{Lease, LeaseStatus};
use skiff_store::{EnvironmentRow, Scope};
use std::sync::Arc;

/// How often a session looks for a box again when the one it brought up was taken from the
/// idle pool by another session first.
const ACQUIRE_ATTEMPTS: usize = 3;

impl Environments {
    /// A ready box for a session, attached to it: a warm idle one when the pool has one,
    /// else a new lease brought all the way up.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        scope: &Scope,
        profile: &str,
    ) -> Result<EnvironmentId> {
        let mut taken = None;
        for _ in 0..ACQUIRE_ATTEMPTS {
            if let Some(row) = self.take_idle(scope, profile, true, None).await? {
                return Ok(row.id);
            }
            let view = self.create(scope, profile, false).await?;
            // Bringing up is idempotent and serialized per environment: this waits for the
            // background bring-up.
            self.bring_up(scope.clone(), view.id.clone()).await?;
            let lock = self.lock(&view.id);
            let _guard = lock.lock().await;
            let row = self.store.environment(scope, &view.id)?;
            match row.state {
                EnvironmentState::Idle => {
                    self.transition(&row, EnvironmentState::Attached, None)?;
                    self.store.touch_environment(scope, &row.id)?;
                    return Ok(row.id);
                }
                // Between its bring-up and this lock the new box sat in the idle pool, and
                // another session took it: look again.
                EnvironmentState::Attached => taken = Some(row.id),
                _ => {
                    return Err(crate::Error::BoxNotReady(format!(
                        "environment {} is {} after bring-up: {}",
                        row.id,
                        row.state,
                        row.error.as_deref().unwrap_or("no error recorded")
                    )));
                }
            }
        }
        Err(crate::Error::Unavailable(format!(
            "every box brought up for this session was taken by another one first (last {}); try again",
            taken.map(|id| id.to_string()).unwrap_or_default()
        )))
    }

    /// Gives an attached box back to the idle pool once its session was parked. `clear`
    /// stops the session's worker and removes its workspace; it runs under the box's lock, so
    /// nothing hands the box out or tears it down meanwhile. A box that cannot be cleared is
    /// destroyed instead: a box never goes back to the pool holding a session's files.
    /// Returns whether the box is in the pool.
    pub(crate) async fn release_to_pool(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        clear: impl std::future::Future<Output = Result<()>>,
    ) -> bool {
        let lock = self.lock(id);
        let _guard = lock.lock().await;
        let row = match self.store.environment(scope, id) {
            Ok(row) if row.state == EnvironmentState::Attached => row,
            // Gone or failed meanwhile (a dead box, an operator's destroy): nothing to give.
            Ok(_) => return false,
            Err(e) => {
                tracing::warn!(env = %id, error = %e, "cannot read the environment to release it");
                return false;
            }
        };
        let cleared = clear.await;
        let released = cleared.and_then(|()| {
            self.transition(&row, EnvironmentState::Idle, None)?;
            // Its idle time counts from now.
            self.store.touch_environment(scope, id)?;
            Ok(())
        });
        match released {
            Ok(()) => true,
            Err(e) => {
                let why = format!("could not be cleared for another session: {e}");
                tracing::warn!(env = %id, error = %e, "destroying a box that could not be cleared");
                if let Ok(row) = self.store.environment(scope, id)
                    && !matches!(
                        row.state,
                        EnvironmentState::Failed
                            | EnvironmentState::Destroying
                            | EnvironmentState::Destroyed
                    )
                    && let Err(e) = self.fail(&row, &why)
                {
                    tracing::warn!(env = %id, error = %e, "could not record the failed release");
                }
                if let Err(e) = self.destroy_locked(scope, id, true).await {
                    tracing::warn!(env = %id, error = %e, "could not tear down a box that could not be cleared");
                }
                false
            }
        }
    }

    /// The idle box `env` of `profile`, attached, when it is still in the pool with the
    /// gateway's bundle and checks out (a parked session's own previous box); `None`
    /// otherwise.
    pub(crate) async fn acquire_this(
        &self,
        scope: &Scope,
        profile: &str,
        env: &EnvironmentId,
    ) -> Result<Option<EnvironmentRow>> {
        let Some(row) = self
            .idle_candidates(scope, profile, None)
            .await?
            .into_iter()
            .find(|r| &r.id == env)
        else {
            return Ok(None);
        };
        let lock = self.lock(&row.id);
        let _guard = lock.lock().await;
        self.claim_idle_locked(&row, true).await
    }

    /// A warm idle box whose home already holds the result of the setup keyed `key`,
    /// attached; `None` when the pool has none.
    pub(crate) async fn acquire_prepared(
        &self,
        scope: &Scope,
        profile: &str,
        key: &str,
    ) -> Result<Option<EnvironmentId>> {
        Ok(self
            .take_idle(scope, profile, true, Some(key))
            .await?
            .map(|row| row.id))
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
        let lease_id = super::lease_id(profile.provider.as_ref(), row);
        matches!(
            profile.provider.inspect(&lease_id).await,
            Ok(LeaseStatus::Running)
        )
    }

    /// `[gateway] barrier_fault = "…:kill-box"` (tests only): the box dies as a machine does —
    /// its processes and sshd killed by its provider — with nothing recorded here, so the
    /// gateway learns of it only as it would of a real death.
    pub(crate) async fn kill_box_for_fault(&self, row: &EnvironmentRow) -> Result<()> {
        let profile = self.profile(&row.profile)?;
        let lease_id = super::lease_id(profile.provider.as_ref(), row);
        profile
            .provider
            .destroy(&lease_id)
            .await
            .map_err(|e| crate::Error::BoxFailed(e.to_string()))
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
