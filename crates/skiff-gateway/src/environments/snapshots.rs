//! Snapshots of prepared boxes, the gateway's side: taking one of an environment's box
//! (recorded, then the profile's least recently used snapshots evicted past its
//! `snapshot_budget`), restoring one onto a warm idle box for a key, starting a new box from
//! one (through the normal environment state machine), deleting, listing, and cleaning up
//! after a crash.
//!
//! A snapshot row is stored (`capturing`) before the provider hears of it and removed only
//! after the provider deleted the snapshot, so restart reconciliation finds every capture or
//! deletion a crash interrupted, and the sweep deletes what providers hold that no row names.
//! Only `ready` rows start boxes; the provider's copy is complete or absent.
//!
//! Deliberately absent: what goes into a key and when to snapshot. The setup phase decides
//! both (its key: setup script, profile, bundle hash, declared key files); here a key is an
//! opaque hex string.

use super::Environments;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::environment::{
    DeletedSnapshot, EnvironmentState, EnvironmentView, SnapshotState, SnapshotView,
};
use skiff_protocol::{EnvironmentId, SnapshotId};
use skiff_store::{NewSnapshot, Scope, SnapshotRow};
use std::sync::Arc;
use std::time::Instant;

/// What a snapshot serves: sessions asking with the same key start from it. Lowercase hex.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SnapshotKey(String);

impl SnapshotKey {
    /// The key of `parts` (the blake3 of each part, length first, so `["ab", "c"]` and
    /// `["a", "bc"]` differ).
    pub(crate) fn derive(parts: &[&[u8]]) -> Self {
        let mut hasher = blake3::Hasher::new();
        for part in parts {
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().to_hex().to_string())
    }

    /// A key written down elsewhere: 1 to 128 lowercase hex characters.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let ok = (1..=128).contains(&text.len())
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        ok.then(|| Self(text.to_owned()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// How a capture ended.
pub(crate) enum Captured {
    /// The profile's provider takes no snapshots.
    Unsupported(skiff_providers::Error),
    /// Taken, and deleted at once: alone it is larger than the profile's whole budget.
    OverBudget {
        size_bytes: u64,
        budget_bytes: u64,
    },
    Kept(SnapshotRow),
}

pub(crate) fn snapshot_view(row: &SnapshotRow) -> SnapshotView {
    SnapshotView {
        id: row.id.clone(),
        profile: row.profile.clone(),
        key_prefix: row.key.chars().take(12).collect(),
        state: row.state,
        size_bytes: row.size_bytes,
        environment_id: row.environment_id.clone(),
        created_at_ms: row.created_at_ms,
        last_used_at_ms: row.last_used_at_ms,
    }
}

fn mint_snapshot_id() -> Result<SnapshotId> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::Internal(format!("no randomness for a snapshot id: {e}")))?;
    Ok(SnapshotId::from_random(bytes))
}

impl Environments {
    fn audit_snapshot(
        &self,
        scope: &Scope,
        action: &str,
        id: &SnapshotId,
        decision: &str,
        detail: serde_json::Value,
    ) {
        if let Err(e) = self
            .store
            .audit(scope, "gateway", action, id.as_str(), decision, &detail)
        {
            tracing::warn!(action, error = %e, "could not write an audit row");
        }
    }

    /// Snapshots the prepared box of `env` for `key`, records it, then evicts the profile's
    /// least recently used snapshots past its `snapshot_budget`. `None` when the provider
    /// takes no snapshots, or when this one alone exceeds the budget (it is deleted again).
    /// The box must be up (ready, idle or attached); it is not changed.
    pub(crate) async fn snapshot_box(
        &self,
        scope: &Scope,
        env: &EnvironmentId,
        key: &SnapshotKey,
    ) -> Result<Option<SnapshotId>> {
        Ok(match self.capture(scope, env, key).await? {
            Captured::Kept(row) => Some(row.id),
            Captured::Unsupported(_) => None,
            Captured::OverBudget {
                size_bytes,
                budget_bytes,
            } => {
                tracing::warn!(%env, size_bytes, budget_bytes, "a snapshot larger than its profile's snapshot_budget was deleted; raise the budget to keep one");
                None
            }
        })
    }

    /// [`Environments::snapshot_box`], saying why there is no snapshot (for the API).
    pub(crate) async fn capture(
        &self,
        scope: &Scope,
        env: &EnvironmentId,
        key: &SnapshotKey,
    ) -> Result<Captured> {
        let row = self.store.environment(scope, env)?;
        let profile = self.profile(&row.profile)?;
        let provider = profile.provider.clone();
        if !provider.snapshots() {
            return Ok(Captured::Unsupported(
                skiff_providers::Error::SnapshotsUnsupported {
                    provider: provider.kind(),
                },
            ));
        }
        let budget_bytes = profile.config.snapshot_budget(&row.profile)?;
        let id = {
            // One operation at a time per box: no destroy or reclaim while it is copied.
            let lock = self.lock(env);
            let _guard = lock.lock().await;
            let row = self.store.environment(scope, env)?;
            if !matches!(
                row.state,
                EnvironmentState::Ready | EnvironmentState::Idle | EnvironmentState::Attached
            ) {
                return Err(Error::Conflict(format!(
                    "environment {env} is {}; only a box that is up can be snapshotted",
                    row.state
                )));
            }
            let lease_id = row
                .lease_id
                .clone()
                .ok_or_else(|| Error::Conflict(format!("environment {env} has no lease yet")))?;
            let id = mint_snapshot_id()?;
            // INVARIANT: the row exists before the provider hears of the snapshot.
            self.store.record_snapshot(
                scope,
                &NewSnapshot {
                    id: &id,
                    profile: &row.profile,
                    key: key.as_str(),
                    environment_id: env,
                    lease_id: &lease_id,
                },
            )?;
            let started = Instant::now();
            let taken = provider.snapshot(&lease_id, &id).await;
            self.audit_snapshot(scope, "provider.snapshot", &id, if taken.is_ok() { "ok" } else { "error" }, json!({
                "provider": provider.kind(), "environment": env, "lease_id": lease_id, "profile": row.profile,
                "duration_ms": started.elapsed().as_millis() as u64,
                "size_bytes": taken.as_ref().ok().map(|i| i.size_bytes),
                "error": taken.as_ref().err().map(ToString::to_string),
            }));
            let recorded = taken
                .map_err(Error::from)
                .and_then(|info| Ok(self.store.snapshot_captured(scope, &id, info.size_bytes)?));
            if let Err(e) = recorded {
                // Nothing usable was made: whatever the provider holds of it goes too.
                match self.store.snapshot(scope, &id) {
                    Ok(failed) => {
                        if let Err(cleanup) =
                            self.remove_snapshot(&failed, "its capture failed").await
                        {
                            tracing::warn!(snapshot = %id, error = %cleanup, "could not remove a failed snapshot; restart reconciliation retries");
                        }
                    }
                    Err(lookup) => {
                        tracing::warn!(snapshot = %id, error = %lookup, "a failed snapshot's row is unreadable")
                    }
                }
                return Err(e);
            }
            id
        };
        let evicted = self.evict(&row.profile, budget_bytes).await;
        let kept = self.store.snapshot(scope, &id);
        match kept {
            Ok(kept) if !evicted.contains(&id) => Ok(Captured::Kept(kept)),
            Ok(kept) => Ok(Captured::OverBudget {
                size_bytes: kept.size_bytes,
                budget_bytes,
            }),
            // Evicted and its row already gone.
            Err(skiff_store::Error::NotFound { .. }) => Ok(Captured::OverBudget {
                size_bytes: 0,
                budget_bytes,
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes the profile's least recently used snapshots until the rest fit `budget_bytes`.
    /// Returns the ones deleted; one that could not be stays `deleting` (restart
    /// reconciliation retries it) and is logged.
    async fn evict(&self, profile: &str, budget_bytes: u64) -> Vec<SnapshotId> {
        let plan = match self.store.evict_plan(profile, budget_bytes) {
            Ok(plan) => plan,
            Err(e) => {
                tracing::warn!(profile, error = %e, "cannot plan snapshot eviction");
                return Vec::new();
            }
        };
        let mut evicted = Vec::new();
        for row in plan {
            let why = format!(
                "evicted: profile `{profile}`'s snapshots exceed its snapshot_budget of {budget_bytes} bytes"
            );
            match self.remove_snapshot(&row, &why).await {
                Ok(()) => evicted.push(row.id),
                Err(e) => {
                    tracing::warn!(snapshot = %row.id, error = %e, "could not evict a snapshot")
                }
            }
        }
        evicted
    }

    /// Marks the snapshot `deleting` (no box starts from it any more), has the provider
    /// delete it, then forgets the row.
    async fn remove_snapshot(&self, row: &SnapshotRow, why: &str) -> Result<()> {
        self.store.mark_snapshot_deleting(&row.scope, &row.id)?;
        let provider = self.profile(&row.profile)?.provider.clone();
        let deleted = provider.delete_snapshot(&row.id).await;
        self.audit_snapshot(
            &row.scope,
            "provider.delete_snapshot",
            &row.id,
            if deleted.is_ok() { "ok" } else { "error" },
            json!({
                "provider": provider.kind(), "profile": row.profile, "reason": why,
                "size_bytes": row.size_bytes, "error": deleted.as_ref().err().map(ToString::to_string),
            }),
        );
        deleted?;
        self.store.delete_snapshot_row(&row.scope, &row.id)?;
        Ok(())
    }

    /// A box for a session, attached to it, whose home is the newest ready snapshot of
    /// `profile` for `key`. `None` when there is none, the provider takes no snapshots, or the
    /// box did not come up from it (logged; the caller prepares a fresh box instead).
    pub(crate) async fn acquire_from_snapshot(
        self: &Arc<Self>,
        scope: &Scope,
        profile: &str,
        key: &SnapshotKey,
    ) -> Result<Option<(EnvironmentId, SnapshotId)>> {
        if !self.profile(profile)?.provider.snapshots() {
            return Ok(None);
        }
        let Some(snapshot) = self
            .store
            .find_ready_snapshot(scope, profile, key.as_str())?
        else {
            return Ok(None);
        };
        let view = self.create_from(scope, profile, Some(&snapshot.id))?;
        // Bringing up is idempotent and serialized per environment: this waits for the
        // background bring-up that `create_from` started.
        match self.bring_up(scope.clone(), view.id.clone()).await {
            Ok(()) => {}
            Err(e @ Error::Store(_)) => return Err(e),
            Err(e) => {
                self.abandon_start(scope, &view.id, &snapshot, &e.to_string());
                if let Error::Provider(skiff_providers::Error::UnknownSnapshot { .. }) = e
                    && let Err(e) = self
                        .remove_snapshot(&snapshot, "the provider no longer has it")
                        .await
                {
                    tracing::warn!(snapshot = %snapshot.id, error = %e, "could not forget a snapshot the provider lost");
                }
                return Ok(None);
            }
        }
        let lock = self.lock(&view.id);
        let _guard = lock.lock().await;
        let row = self.store.environment(scope, &view.id)?;
        if row.state != EnvironmentState::Idle {
            let why = format!(
                "it is {} after bring-up: {}",
                row.state,
                row.error.as_deref().unwrap_or("no error recorded")
            );
            self.abandon_start(scope, &view.id, &snapshot, &why);
            return Ok(None);
        }
        self.transition(&row, EnvironmentState::Attached, None)?;
        self.store.touch_environment(scope, &row.id)?;
        Ok(Some((row.id, snapshot.id)))
    }

    /// A warm idle box of `profile`, attached, whose home was just restored from the newest
    /// ready snapshot for `key` — cheaper than a new box from it (no lease, sshd, user or
    /// bundle install to wait for). Any idle box with the gateway's bundle serves, one that
    /// another setup prepared too (boxes no setup prepared are taken first: they lose nothing).
    /// `None` when the provider takes no snapshots, there is no such snapshot or no idle box,
    /// or the restore failed: that box is destroyed (a half-replaced home is never pooled) and
    /// the caller falls back to a new box from the snapshot.
    pub(crate) async fn acquire_restored(
        self: &Arc<Self>,
        scope: &Scope,
        profile: &str,
        key: &SnapshotKey,
    ) -> Result<Option<(EnvironmentId, SnapshotId)>> {
        let provider = self.profile(profile)?.provider.clone();
        if !provider.snapshots() {
            return Ok(None);
        }
        let mut candidates = self.idle_candidates(scope, profile, None).await?;
        if candidates.is_empty() {
            return Ok(None);
        }
        let Some(snapshot) = self
            .store
            .find_ready_snapshot(scope, profile, key.as_str())?
        else {
            return Ok(None);
        };
        candidates.sort_by_key(|r| r.prepared_key.is_some());
        for candidate in candidates {
            let lock = self.lock(&candidate.id);
            let guard = lock.lock().await;
            // Attached under the lock: no other session takes it, and the lock keeps reclaim
            // and destroy off it while its home is replaced.
            let Some(row) = self.claim_idle_locked(&candidate, true).await? else {
                continue;
            };
            let lease_id = row
                .lease_id
                .clone()
                .unwrap_or_else(|| provider.lease_id_for(&row.op_id));
            let restored = async {
                // Until the copy is done the home holds no setup's result: a failure below
                // that somehow left the box in use must not pass it off as prepared.
                self.store.set_environment_prepared(scope, &row.id, None)?;
                let started = Instant::now();
                let done = provider.restore_snapshot(&lease_id, &snapshot.id).await;
                self.audit_snapshot(scope, "provider.restore_snapshot", &snapshot.id, if done.is_ok() { "ok" } else { "error" }, json!({
                    "provider": provider.kind(), "environment": row.id, "lease_id": lease_id, "profile": profile,
                    "duration_ms": started.elapsed().as_millis() as u64,
                    "error": done.as_ref().err().map(ToString::to_string),
                }));
                done?;
                // Still ready after the copy: a deletion marks the row first, so one that
                // began meanwhile (and may have torn the copy) shows here.
                self.store.touch_snapshot(scope, &snapshot.id)?;
                self.store
                    .set_environment_prepared(scope, &row.id, Some(key.as_str()))?;
                Ok::<(), Error>(())
            };
            let failure = match restored.await {
                Ok(()) => return Ok(Some((row.id, snapshot.id))),
                Err(e) => e,
            };
            let why = format!(
                "restoring snapshot {} onto it failed: {failure}",
                snapshot.id
            );
            tracing::warn!(env = %row.id, snapshot = %snapshot.id, error = %failure, "a warm box could not be restored from a snapshot; destroying it and falling back");
            if let Err(e) = self.fail(&row, &why) {
                tracing::warn!(env = %row.id, error = %e, "could not record the failed restore");
            }
            drop(guard);
            let (this, scope_owned, env) = (self.clone(), scope.clone(), row.id.clone());
            tokio::spawn(async move {
                if let Err(e) = this.destroy(&scope_owned, &env, true).await {
                    tracing::warn!(%env, error = %e, "could not tear down a box whose restore failed");
                }
            });
            if let Error::Provider(skiff_providers::Error::UnknownSnapshot { .. }) = failure
                && let Err(e) = self
                    .remove_snapshot(&snapshot, "the provider no longer has it")
                    .await
            {
                tracing::warn!(snapshot = %snapshot.id, error = %e, "could not forget a snapshot the provider lost");
            }
            return Ok(None);
        }
        Ok(None)
    }

    /// A box that did not come up from a snapshot: logged, and torn down in the background
    /// so the caller's fallback does not wait for it.
    fn abandon_start(
        self: &Arc<Self>,
        scope: &Scope,
        env: &EnvironmentId,
        snapshot: &SnapshotRow,
        why: &str,
    ) {
        tracing::warn!(%env, snapshot = %snapshot.id, error = why, "a box did not come up from its snapshot; falling back to a fresh one");
        let (this, scope, env) = (self.clone(), scope.clone(), env.clone());
        tokio::spawn(async move {
            if let Err(e) = this.destroy(&scope, &env, true).await {
                tracing::warn!(%env, error = %e, "could not tear down a box that failed to start from a snapshot");
            }
        });
    }

    /// A new environment of `profile` whose box starts from `snapshot` (operators: `env
    /// create --from-snapshot`). Returns at once, like [`Environments::create`].
    pub(crate) fn create_from_snapshot(
        self: &Arc<Self>,
        scope: &Scope,
        profile: &str,
        snapshot: &SnapshotId,
    ) -> Result<EnvironmentView> {
        let row = self.store.snapshot(scope, snapshot)?;
        if row.profile != profile {
            return Err(Error::BadRequest(format!(
                "snapshot {snapshot} was taken with profile `{}`, not `{profile}`; create the environment with --profile {}",
                row.profile, row.profile
            )));
        }
        let provider = self.profile(profile)?.provider.clone();
        if !provider.snapshots() {
            return Err(Error::Provider(
                skiff_providers::Error::SnapshotsUnsupported {
                    provider: provider.kind(),
                },
            ));
        }
        if row.state != SnapshotState::Ready {
            return Err(Error::Conflict(format!(
                "snapshot {snapshot} is {}; only a ready snapshot starts boxes",
                row.state
            )));
        }
        self.store.touch_snapshot(scope, snapshot)?;
        self.create_from(scope, profile, Some(snapshot))
    }

    /// The snapshots the sight sees, most recently used first.
    pub(crate) fn snapshot_views(&self, sight: &skiff_store::Sight) -> Result<Vec<SnapshotView>> {
        Ok(self
            .store
            .snapshots(sight)?
            .iter()
            .map(snapshot_view)
            .collect())
    }

    /// Deletes a snapshot of the scope (an operator's `env snapshots rm`). A deletion that
    /// failed before can be retried.
    pub(crate) async fn delete_snapshot(
        &self,
        scope: &Scope,
        id: &SnapshotId,
    ) -> Result<DeletedSnapshot> {
        let row = self.store.snapshot(scope, id)?;
        if row.state == SnapshotState::Capturing {
            return Err(Error::Conflict(format!(
                "snapshot {id} is still being captured; delete it once it is ready"
            )));
        }
        self.remove_snapshot(&row, "deleted by an operator").await?;
        Ok(DeletedSnapshot {
            id: row.id,
            size_bytes: row.size_bytes,
        })
    }

    /// At gateway start: captures and deletions a previous process did not finish are
    /// finished as deletions (a capture whose size was never recorded is not trusted).
    pub(crate) async fn reconcile_snapshots_on_start(&self) -> Result<()> {
        for row in self.store.unsettled_snapshots()? {
            let why = format!("left {} by a previous gateway", row.state);
            if let Err(e) = self.remove_snapshot(&row, &why).await {
                tracing::warn!(snapshot = %row.id, error = %e, "could not remove an unfinished snapshot");
            }
        }
        Ok(())
    }

    /// Deletes the snapshots providers hold that no row names (a lost database, a snapshot
    /// taken by hand with a lease CLI). Returns them. No row owns such a snapshot, so each
    /// is audited under `by`, as [`Environments::sweep`] does.
    pub(crate) async fn sweep_snapshots(&self, by: &Scope) -> Result<Vec<SnapshotId>> {
        let mut swept = Vec::new();
        for (name, profile) in &self.profiles {
            if !profile.provider.snapshots() {
                continue;
            }
            let held = match profile.provider.list_snapshots().await {
                Ok(held) => held,
                Err(e) => {
                    tracing::warn!(profile = %name, error = %e, "cannot list snapshots for the sweep");
                    continue;
                }
            };
            for snapshot in held {
                // INVARIANT: looked up after the provider listed it; a capture in flight
                // stored its row before the provider heard of it.
                if swept.contains(&snapshot.id) || self.store.snapshot_known(&snapshot.id)? {
                    continue;
                }
                tracing::warn!(profile = %name, snapshot = %snapshot.id, "deleting an orphaned snapshot");
                let result = profile.provider.delete_snapshot(&snapshot.id).await;
                self.audit_snapshot(
                    by,
                    "provider.sweep_snapshot",
                    &snapshot.id,
                    if result.is_ok() { "deleted" } else { "error" },
                    json!({
                        "profile": name, "size_bytes": snapshot.size_bytes,
                        "error": result.as_ref().err().map(ToString::to_string),
                    }),
                );
                match result {
                    Ok(()) => swept.push(snapshot.id),
                    Err(e) => {
                        tracing::warn!(profile = %name, snapshot = %snapshot.id, error = %e, "could not delete an orphaned snapshot")
                    }
                }
            }
        }
        Ok(swept)
    }
}

#[cfg(test)]
mod tests {
    use super::SnapshotKey;

    #[test]
    fn keys_are_lowercase_hex_and_parts_keep_their_boundaries() {
        let key = SnapshotKey::derive(&[b"ab", b"c"]);
        assert_eq!(key.as_str().len(), 64);
        assert_ne!(key, SnapshotKey::derive(&[b"a", b"bc"]));
        assert_eq!(SnapshotKey::parse(key.as_str()), Some(key));
        for bad in ["", "ABCD", "xyz", "ab cd"] {
            assert_eq!(SnapshotKey::parse(bad), None, "{bad:?}");
        }
    }
}
