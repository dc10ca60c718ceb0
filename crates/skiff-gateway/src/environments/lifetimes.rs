//! Time and restarts: reconciling what a previous gateway left, and the lifetime tick (idle
//! timeout, TTL, lease renewal).

use super::{Environments, now_ms};
use crate::error::Result;
use skiff_protocol::environment::EnvironmentState;
use skiff_providers::LeaseStatus;
use skiff_store::EnvironmentRow;
use std::time::Duration;

/// How long an attached box may go without a placement naming it before the lifetime tick
/// releases it. A session records its box right after attaching it; this only has to be long
/// enough that no live placement is ever caught between the two.
const UNOWNED_GRACE: Duration = Duration::from_secs(60);

impl Environments {
    /// Whether a live worker placement names this environment. A database error counts as
    /// "yes": nothing is destroyed on a guess.
    fn has_session(&self, row: &EnvironmentRow) -> bool {
        match self.store.sessions_on_environment(&row.id) {
            Ok(sessions) => !sessions.is_empty(),
            Err(e) => {
                tracing::warn!(env = %row.id, error = %e, "cannot tell whether a session uses the environment");
                true
            }
        }
    }

    /// Destroys an attached box that no placement owns (a gateway crashed between attaching
    /// it and recording it, or a placement ended without giving it back). Its contents are a
    /// half-laid workspace at most: the session's work lives on the gateway.
    async fn release_unowned(&self, row: &EnvironmentRow, why: &str) {
        let lock = self.lock(&row.id);
        let _guard = lock.lock().await;
        // Under the lock: it may have been recorded on a placement since the caller looked.
        match self.store.environment(&row.scope, &row.id) {
            Ok(now) if now.state == EnvironmentState::Attached && !self.has_session(&now) => {}
            _ => return,
        }
        tracing::warn!(env = %row.id, why, "releasing an environment no session owns");
        self.audit(
            &row.scope,
            "environment.release",
            &row.id,
            "applied",
            serde_json::json!({ "reason": why }),
        );
        if let Err(e) = self.destroy_locked(&row.scope, &row.id, true).await {
            tracing::warn!(env = %row.id, error = %e, "could not destroy an unowned environment");
        }
    }

    /// At gateway start, after placements were reconciled: no box stays attached without a
    /// live placement (no live placement can be between attaching and recording now).
    pub(crate) async fn release_unowned_on_start(&self) -> Result<()> {
        for row in self.store.live_environments()? {
            if row.state == EnvironmentState::Attached && !self.has_session(&row) {
                self.release_unowned(&row, "attached to no worker session at gateway start")
                    .await;
            }
        }
        Ok(())
    }

    /// At the start of the gateway holding the `sweeper` lease (one at a time, so a gateway
    /// joining a live one never adopts or fails the boxes that one is placing): finish or fail
    /// what a previous process left in flight, and check that every box believed alive still
    /// is; the same for snapshots. `elsewhere` are the environments of sessions another live
    /// gateway holds the lease of (a turn placing or using its box there): left alone.
    /// (Sweeping orphans is [`Self::sweep_orphans`].)
    pub(crate) async fn reconcile_on_start(
        &self,
        elsewhere: &std::collections::HashSet<skiff_protocol::EnvironmentId>,
    ) -> Result<()> {
        for row in self.store.live_environments()? {
            if elsewhere.contains(&row.id) {
                tracing::info!(env = %row.id, state = %row.state, "left to the gateway running its session");
                continue;
            }
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
        self.reconcile_snapshots_on_start().await
    }

    /// At the start of the gateway holding the `sweeper` lease (`chores.rs`): destroy
    /// provider leases no environment owns, and snapshots no row knows.
    pub(crate) async fn sweep_orphans(&self) -> Result<()> {
        // The gateway's own work at start: nobody asked, so no one's rows.
        let nobody = crate::auth::unattributed_scope();
        let swept = self.sweep(&nobody).await?;
        if !swept.is_empty() {
            tracing::warn!(?swept, "destroyed orphaned leases");
        }
        let swept = self.sweep_snapshots(&nobody).await?;
        if !swept.is_empty() {
            tracing::warn!(?swept, "deleted orphaned snapshots");
        }
        Ok(())
    }

    async fn inspect_only(&self, row: &EnvironmentRow) -> Result<()> {
        let provider = self.profile(&row.profile)?.provider.clone();
        let lease_id = super::lease_id(provider.as_ref(), row);
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
            } else if row.state == EnvironmentState::Attached && !self.has_session(&row) {
                // Never renewed: a box nobody uses is released instead (after a grace that
                // covers the moment between attaching a box and recording it on the placement).
                let since =
                    Duration::from_millis(u64::try_from(now - row.last_used_at_ms).unwrap_or(0));
                if since >= UNOWNED_GRACE {
                    self.release_unowned(&row, "attached to no worker session")
                        .await;
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
