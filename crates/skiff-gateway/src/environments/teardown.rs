//! Taking boxes away: the staged destroy (with evidence), reclaiming idle boxes, and the orphan
//! sweep.

use super::{Environments, now_ms};
use crate::error::Result;
use serde_json::json;
use skiff_protocol::EnvironmentId;
use skiff_protocol::environment::{EnvironmentState, EnvironmentView};
use skiff_providers::LeaseStatus;
use skiff_store::Scope;
use std::time::{Duration, Instant};

impl Environments {
    /// Staged destroy: stop new work → wait for active work to end (`force` skips) → provider
    /// destroy → inspect proves absence → destroyed. Missing evidence leaves `destroying`.
    pub(crate) async fn destroy(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        force: bool,
    ) -> Result<EnvironmentView> {
        let lock = self.lock(id);
        let _guard = lock.lock().await;
        self.destroy_locked(scope, id, force).await
    }

    /// `destroy`, for a caller that holds the environment's lock.
    pub(super) async fn destroy_locked(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        force: bool,
    ) -> Result<EnvironmentView> {
        let mut row = self.store.environment(scope, id)?;
        if row.state == EnvironmentState::Destroyed {
            return Ok(self.view(&row));
        }
        if row.state == EnvironmentState::Attached && !force {
            return Err(crate::Error::Conflict(format!(
                "environment {id} runs a worker session; destroying it ends that session's worker (the session is kept and its next message starts a fresh box): pass --force to do so"
            )));
        }
        if matches!(
            row.state,
            EnvironmentState::Ready | EnvironmentState::Idle | EnvironmentState::Attached
        ) {
            // Worker sessions on the box were reclaimed by the caller (a forced destroy); the
            // stage is recorded so the timeline shows it.
            row = self.transition(&row, EnvironmentState::Draining, None)?;
        }
        if row.state != EnvironmentState::Destroying {
            row = self.transition(&row, EnvironmentState::Destroying, None)?;
        }
        let provider = self.profile(&row.profile)?.provider.clone();
        let lease_id = super::lease_id(provider.as_ref(), &row);
        if let Ok(ssh) = self.ssh(&row) {
            ssh.close().await;
        }
        let started = Instant::now();
        let destroyed = provider.destroy(&lease_id).await;
        self.audit(scope, "provider.destroy", id, if destroyed.is_ok() { "ok" } else { "error" }, json!({
            "provider": provider.kind(), "lease_id": lease_id, "duration_ms": started.elapsed().as_millis() as u64,
            "error": destroyed.as_ref().err().map(ToString::to_string),
        }));
        if let Err(e) = destroyed {
            let row = self.transition(&row, EnvironmentState::Destroying, Some(&e.to_string()))?;
            return Ok(self.view(&row));
        }
        match provider.inspect(&lease_id).await {
            Ok(LeaseStatus::Gone) => {}
            other => {
                let why = format!(
                    "after destroy the provider still reports lease {lease_id}: {other:?}; retry the destroy"
                );
                let row = self.transition(&row, EnvironmentState::Destroying, Some(&why))?;
                return Ok(self.view(&row));
            }
        }
        let _ = std::fs::remove_dir_all(self.ssh_root.join(id.as_str()));
        let row = self.transition(&row, EnvironmentState::Destroyed, None)?;
        Ok(self.view(&row))
    }

    /// Destroys the environment if, under its lock, it is still idle past `idle` or expired: it
    /// may have been handed out since the lifetime tick looked.
    pub(super) async fn reclaim_if_still_idle(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        idle: Duration,
    ) -> Result<()> {
        let lock = self.lock(id);
        let _guard = lock.lock().await;
        let row = self.store.environment(scope, id)?;
        let now = now_ms();
        let idle_for = Duration::from_millis(u64::try_from(now - row.last_used_at_ms).unwrap_or(0));
        let expired = row.expires_at_ms.is_some_and(|e| e <= now);
        if row.state != EnvironmentState::Idle || (idle_for < idle && !expired) {
            return Ok(());
        }
        self.destroy_locked(scope, id, false).await.map(drop)
    }

    /// Destroys every lease a provider holds that no live environment owns. Returns them.
    /// No row owns such a lease, so each is audited under `by`: the admin who asked for the
    /// sweep, or nobody's (`auth::unattributed_scope`) when the gateway sweeps at start.
    pub(crate) async fn sweep(&self, by: &Scope) -> Result<Vec<String>> {
        let mut swept = Vec::new();
        for (name, profile) in &self.profiles {
            let leases = match profile.provider.list().await {
                Ok(leases) => leases,
                Err(e) => {
                    tracing::warn!(profile = %name, error = %e, "cannot list leases for the sweep");
                    continue;
                }
            };
            // INVARIANT: read what we own only after the provider listed its leases. The intent
            // row is stored before any provider call, so a lease in that list that belongs to a
            // provision in flight already has its row here.
            let owned: Vec<String> = self
                .store
                .live_environments()?
                .into_iter()
                .filter_map(|r| {
                    let provider = &self.profiles.get(&r.profile)?.provider;
                    Some(super::lease_id(provider.as_ref(), &r))
                })
                .collect();
            for lease in leases {
                if owned.contains(&lease) || swept.contains(&lease) {
                    continue;
                }
                tracing::warn!(profile = %name, %lease, "destroying an orphaned lease");
                let result = profile.provider.destroy(&lease).await;
                let decision = if result.is_ok() { "destroyed" } else { "error" };
                let detail = json!({ "profile": name, "error": result.as_ref().err().map(ToString::to_string) });
                if let Err(e) =
                    self.store
                        .audit(by, "gateway", "provider.sweep", &lease, decision, &detail)
                {
                    tracing::warn!(error = %e, "could not write an audit row");
                }
                // One lease that will not die must not stop the sweep (or the gateway's start).
                match result {
                    Ok(()) => swept.push(lease),
                    Err(e) => {
                        tracing::warn!(profile = %name, %lease, error = %e, "could not destroy an orphaned lease")
                    }
                }
            }
        }
        Ok(swept)
    }
}
