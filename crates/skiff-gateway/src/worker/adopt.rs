//! Re-adopting a session's box when this gateway takes the session over from one that died
//! (issue 17). The box outlives its gateway (a local box runs in a session of its own, a leased
//! one on its provider), so the new owner reaches it over SSH itself, stops what the old
//! worker still runs there and starts a replacement under a higher owner epoch — the fence,
//! exactly as a dead worker is replaced ([`super::recover`]). A box that cannot be reached
//! from here is reclaimed with the lost-work notice: a session is never left `active` on a
//! box nobody owns.
//!
//! **The box's SSH key.** The pinned host key is in the environment's row (the store every
//! gateway shares); the private key is a file of the gateway that leased the box. When the
//! vault key is `SKIFF_VAULT_KEY` — the key every gateway of a deployment is given — the
//! private key is sealed in the vault (`_skiff.box-key.<env>`) when the box's first worker
//! is admitted, and the adopting gateway opens it into its own 0700 state dir
//! (`ssh/<env>/identity`, 0600). The vault rather than the shared workspaces directory:
//! the key then sits only in the database, encrypted, never as a readable file on shared
//! storage, and goes wherever the database goes with nothing more to configure. Without a
//! shared vault key the lease's own key file is used when this gateway can read it.

use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::{EnvironmentId, SessionId};
use skiff_store::{PlacementChange, Scope};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The vault name (after the vault's internal prefix) of a box's private SSH key.
fn key_name(env: &EnvironmentId) -> String {
    format!("box-key.{env}")
}

impl super::WorkerSide {
    /// Whether `session`'s worker is attached to this gateway: connected here, or being
    /// repaired or adopted here. Such a session's lease stays this gateway's between turns.
    pub(crate) fn attached_here(&self, session: &SessionId) -> bool {
        self.tunnel_up(session) || self.recovering(session)
    }

    /// The sessions whose worker is connected to this gateway now.
    pub(crate) fn connected_sessions(&self) -> Vec<SessionId> {
        super::lock(&self.live)
            .iter()
            .filter(|(_, l)| l.connected_epoch().is_some())
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Claims the adoption of `session`'s box for this gateway (it counts as attached here
    /// from now on); false when a recovery of it already runs here.
    pub(crate) fn claim_adoption(&self, session: &SessionId) -> bool {
        self.live(session).begin_recovery()
    }

    /// Re-adopts `session`'s box after taking the session over from gateway `from` (claimed
    /// with [`Self::claim_adoption`]): the old worker stopped and fenced, a new one started
    /// here — or the placement reclaimed, or failed when it was caught mid-placement.
    pub(crate) async fn adopt(self: &Arc<Self>, scope: &Scope, session: &SessionId, from: &str) {
        if let Err(e) = self.adopt_claimed(scope, session, from).await {
            tracing::warn!(%session, error = %e, "could not re-adopt the session's box");
        }
        self.live(session).end_recovery();
    }

    async fn adopt_claimed(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        from: &str,
    ) -> Result<()> {
        let Some(p) = self.store.placement(scope, session)? else {
            return Ok(());
        };
        let env_id = match (&p.state, &p.environment_id) {
            (
                PlacementState::Active
                | PlacementState::Reconciling
                | PlacementState::Draining
                | PlacementState::HandingOff,
                Some(env),
            ) => env.clone(),
            (
                PlacementState::Requested
                | PlacementState::Provisioning
                | PlacementState::Syncing
                | PlacementState::Setup
                | PlacementState::Starting
                | PlacementState::Reconciling
                | PlacementState::Draining
                | PlacementState::HandingOff,
                _,
            ) => {
                // Caught mid-placement: what the old gateway was doing is not known well
                // enough to finish; the next message (or the taken-over turn) places it again.
                let why = format!(
                    "gateway {from} stopped while placing this session; it is placed again on its next turn"
                );
                let e = Error::Unavailable(why.clone());
                self.fail_placement(scope, &p, e, &why).await;
                return Ok(());
            }
            // At home, parked, reclaimed or failed: no box to adopt.
            _ => return Ok(()),
        };
        if p.state != PlacementState::Active {
            // A pull-back or a reconciliation cut short leaves the session on its box: a
            // pull-back again finishes it, and a message runs there meanwhile.
            self.place(
                scope,
                session,
                PlacementState::Active,
                &PlacementChange::default(),
                &format!(
                    "gateway {from} stopped during a {} step; the session stays on its box",
                    p.state.as_str()
                ),
            )?;
        }
        let env = self.store.environment(scope, &env_id)?;
        if let Err(e) = self.take_box_key(&env) {
            let reason =
                format!("gateway {from} stopped and this gateway cannot reach its box: {e}");
            self.reclaim_on(scope, session, &env_id, &reason).await;
            return Ok(());
        }
        let ssh = self.envs.ssh(&env)?;
        if let Err(e) = ssh.run("true", &CancellationToken::new()).await
            && !self.envs.box_alive(&env).await
        {
            let reason = format!("gateway {from} stopped and its box cannot be reached: {e}");
            self.reclaim_on(scope, session, &env_id, &reason).await;
            return Ok(());
        }
        self.audit(
            scope,
            "worker.adopt",
            session.as_str(),
            "applied",
            json!({ "env": env_id.as_str(), "from": from, "epoch": p.owner_epoch }),
        );
        // The bundle's hash names what the new worker runs (the same binary: the same hash).
        self.envs.warm_bundle().await;
        self.replace_with_retries(scope, session, &env, &ssh).await;
        Ok(())
    }

    /// Makes the box's private SSH key usable here: opened from the vault when it was sealed
    /// there, else the lease's own file when this gateway can read it.
    fn take_box_key(&self, env: &skiff_store::EnvironmentRow) -> Result<()> {
        let name = key_name(&env.id);
        if self.vault.has_internal(&name)? {
            let key = self.vault.open_internal(&name)?;
            let path = self.envs.adopted_identity(&env.id);
            return write_private(&path, &key).map_err(|e| {
                Error::Internal(format!(
                    "cannot keep the box's key at {}: {e}",
                    path.display()
                ))
            });
        }
        let lease = self.envs.lease(env)?;
        match std::fs::metadata(&lease.identity_file) {
            Ok(_) => Ok(()),
            Err(e) => Err(Error::Unavailable(format!(
                "its SSH key is not in the vault and {} cannot be read here ({e}); give every gateway the same {}",
                lease.identity_file.display(),
                crate::vault::KEY_ENV
            ))),
        }
    }

    /// Seals the box's private SSH key in the vault, once, when the deployment's gateways
    /// share the vault key: any of them can then adopt the box.
    pub(super) fn share_box_key(&self, scope: &Scope, env: &EnvironmentId) {
        if !self.vault.key_is_shared() {
            return;
        }
        let name = key_name(env);
        let shared = (|| -> Result<()> {
            if self.vault.has_internal(&name)? {
                return Ok(());
            }
            let row = self.store.environment(scope, env)?;
            let lease = self.envs.lease(&row)?;
            let key = std::fs::read_to_string(&lease.identity_file).map_err(|e| {
                Error::Internal(format!(
                    "cannot read the box's key {}: {e}",
                    lease.identity_file.display()
                ))
            })?;
            self.vault.keep_internal(&name, &key)
        })();
        if let Err(e) = shared {
            tracing::warn!(%env, error = %e, "could not seal the box's SSH key for the other gateways; only this one can reach the box");
        }
    }
}

/// Writes `text` to `path` (0600, through a temporary file) in a 0700 directory.
fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}
