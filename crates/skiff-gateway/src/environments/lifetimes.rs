//! Time and restarts: reconciling what a previous gateway left, and the lifetime tick (idle
//! timeout, TTL, lease renewal).

use super::{Environments, now_ms};
use crate::error::Result;
use skiff_protocol::environment::EnvironmentState;
use skiff_providers::LeaseStatus;
use skiff_store::EnvironmentRow;
use std::time::Duration;

impl Environments {
    /// At gateway start: finish or fail what a previous process left in flight, and check that
    /// every box believed alive still is. Then sweep orphans.
    pub(crate) async fn reconcile_on_start(&self) -> Result<()> {
        for row in self.store.live_environments()? {
            let result = match row.state {
                EnvironmentState::Requested
                | EnvironmentState::Provisioning
                | EnvironmentState::Bootstrapping => {
                    tracing::info!(env = %row.id, state = %row.state, "adopting an environment left in flight");
                    self.bring_up(row.scope.clone(), row.id.clone()).await
                }
                EnvironmentState::Ready | EnvironmentState::Idle | EnvironmentState::Attached => {
                    let lock = self.lock(&row.id);
                    let _guard = lock.lock().await;
                    self.inspect_only(&row).await
                }
                EnvironmentState::Draining | EnvironmentState::Destroying => {
                    self.destroy(&row.scope, &row.id, true).await.map(drop)
                }
                _ => Ok(()),
            };
            if let Err(e) = result {
                tracing::warn!(env = %row.id, error = %e, "reconciling the environment failed");
            }
        }
        let swept = self.sweep().await?;
        if !swept.is_empty() {
            tracing::warn!(?swept, "destroyed orphaned leases");
        }
        Ok(())
    }

    async fn inspect_only(&self, row: &EnvironmentRow) -> Result<()> {
        let provider = self.profile(&row.profile)?.provider.clone();
        let lease_id = row
            .lease_id
            .clone()
            .unwrap_or_else(|| provider.lease_id_for(&row.op_id));
        match provider.inspect(&lease_id).await {
            Ok(LeaseStatus::Running) => Ok(()),
            Ok(other) => self
                .fail(
                    row,
                    &format!("found lease {lease_id} {other:?} at gateway start"),
                )
                .map(drop),
            Err(e) => self
                .fail(
                    row,
                    &format!("inspecting lease {lease_id} at gateway start failed: {e}"),
                )
                .map(drop),
        }
    }

    /// Destroys idle environments past their idle timeout and any unattached one past its
    /// TTL; renews leases that are close to expiring but still in use.
    pub(crate) async fn enforce_lifetimes(&self) {
        let now = now_ms();
        let Ok(rows) = self.store.live_environments() else {
            return;
        };
        for row in rows {
            let Some(profile) = self.profiles.get(&row.profile) else {
                continue;
            };
            let idle = profile
                .config
                .idle_timeout()
                .unwrap_or(Duration::from_secs(1800));
            let expired = row.expires_at_ms.is_some_and(|e| e <= now);
            let idle_for =
                Duration::from_millis(u64::try_from(now - row.last_used_at_ms).unwrap_or(0));
            let reclaim = row.state == EnvironmentState::Idle && (idle_for >= idle || expired);
            if reclaim {
                tracing::info!(env = %row.id, "reclaiming an idle environment");
                if let Err(e) = self.reclaim_if_still_idle(&row.scope, &row.id, idle).await {
                    tracing::warn!(env = %row.id, error = %e, "reclaiming failed");
                }
            } else if row.state == EnvironmentState::Attached
                && let (Some(expires), Some(lease)) = (row.expires_at_ms, &row.lease_id)
                && expires - now < 10 * 60 * 1000
            {
                match profile.provider.renew(lease).await {
                    Ok(()) => {
                        let ttl = profile
                            .config
                            .ttl()
                            .unwrap_or(Duration::from_secs(8 * 3600));
                        let until = now + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2);
                        if let Err(e) = self
                            .store
                            .set_environment_expiry(&row.scope, &row.id, until)
                        {
                            tracing::warn!(env = %row.id, error = %e, "could not record the renewed expiry");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(env = %row.id, error = %e, "renewing the lease failed")
                    }
                }
            }
        }
    }
}
