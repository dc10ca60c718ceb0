//! Environments: leased boxes and their state machine (DESIGN §4).
//!
//! The intent row and its operation id are written before a provider is called, and the lease
//! id derives from the operation id, so a gateway that dies mid-provision adopts its lease on
//! restart instead of leasing twice. Restart reconciliation inspects every live environment;
//! the orphan sweep destroys leases the providers hold that no environment owns. Destroy is
//! staged and needs evidence: without proof of teardown an environment stays `destroying`.
//!
//! Deliberately absent: provider names and policy of providers. They come from `[profiles]`.

mod attach;
mod bootstrap;
mod lifetimes;
mod snapshots;
mod teardown;

use crate::bundle::Bundle;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::environment::{EnvironmentState, EnvironmentView, ProfileView};
use skiff_protocol::{EnvironmentId, SnapshotId};
use skiff_providers::{Context, Lease, LeaseStatus, ProfileConfig, WorkerProvider};
use skiff_ssh::{Ssh, Target};
use skiff_store::now_ms;
use skiff_store::{Backend, EnvironmentRow, Scope};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::OnceCell;

pub(crate) use bootstrap::BundleInstall;
pub(crate) use snapshots::{Captured, SnapshotKey, snapshot_view};

/// The lease an environment's row names: the one the provider reported, else the one its
/// operation id determines (a provision cut short before the provider answered; the id is
/// deterministic, so that lease is found, never a second one made).
pub(crate) fn lease_id(provider: &dyn WorkerProvider, row: &EnvironmentRow) -> String {
    row.lease_id
        .clone()
        .unwrap_or_else(|| provider.lease_id_for(&row.op_id))
}

struct Profile {
    config: ProfileConfig,
    provider: Arc<dyn WorkerProvider>,
}

pub(crate) struct Environments {
    store: Arc<dyn Backend>,
    profiles: BTreeMap<String, Profile>,
    /// Per-environment SSH client state (pinned known_hosts, control sockets); 0700 via the
    /// state dir.
    ssh_root: PathBuf,
    bundle: OnceCell<Bundle>,
    /// One operation at a time per environment (bring-up, check, destroy).
    locks: Mutex<HashMap<EnvironmentId, Arc<tokio::sync::Mutex<()>>>>,
    /// What makes a bootstrapped box `ready` (a worker admitted and the canary answered).
    readiness: std::sync::OnceLock<Arc<dyn crate::worker::probe::Readiness>>,
}

impl Environments {
    pub(crate) fn new(
        store: Arc<dyn Backend>,
        configured: BTreeMap<String, ProfileConfig>,
        ctx: &Context,
        ssh_root: PathBuf,
    ) -> Result<Self> {
        let mut configured = configured;
        configured
            .entry("local".to_owned())
            .or_insert_with(ProfileConfig::default_local);
        let mut profiles = BTreeMap::new();
        for (name, config) in configured {
            let provider = skiff_providers::build(&name, &config, ctx)?;
            profiles.insert(name, Profile { config, provider });
        }
        Ok(Self {
            store,
            profiles,
            ssh_root,
            bundle: OnceCell::new(),
            locks: Mutex::new(HashMap::new()),
            readiness: std::sync::OnceLock::new(),
        })
    }

    fn profile(&self, name: &str) -> Result<&Profile> {
        self.profiles.get(name).ok_or_else(|| {
            Error::BadRequest(format!(
                "no worker profile `{name}`; configured profiles: {}. Add a [profiles.{name}] table to skiff.toml",
                self.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// A profile's configuration as `skiff.toml` gave it.
    pub(crate) fn profile_config(&self, name: &str) -> Result<&ProfileConfig> {
        Ok(&self.profile(name)?.config)
    }

    /// How long a worker session of `profile` keeps its box after a turn before it is parked
    /// (the default for an unknown profile; every profile's was checked at start).
    pub(crate) fn keep_attached(&self, profile: &str) -> std::time::Duration {
        self.profiles
            .get(profile)
            .and_then(|p| p.config.keep_attached().ok())
            .unwrap_or(std::time::Duration::from_secs(600))
    }

    /// How long a turn of a session on `profile` may run, when the profile says.
    pub(crate) fn turn_timeout(&self, profile: &str) -> Option<std::time::Duration> {
        self.profiles
            .get(profile)
            .and_then(|p| p.config.turn_timeout().ok().flatten())
    }

    /// `[profiles.P] approval`, when the profile sets one.
    pub(crate) fn approval(
        &self,
        profile: &str,
    ) -> Option<skiff_protocol::approval::ApprovalPolicy> {
        self.profiles
            .get(profile)
            .and_then(|p| p.config.approval.clone())
    }

    /// How many times a turn on `profile` may move to a fresh box after its box died.
    pub(crate) fn failovers_allowed(&self, profile: &str) -> u32 {
        self.profiles
            .get(profile)
            .map_or(0, |p| p.config.failovers_allowed())
    }

    /// How long a worker of `profile` may go without progress during a turn.
    pub(crate) fn stall_timeout(&self, profile: &str) -> std::time::Duration {
        self.profiles
            .get(profile)
            .and_then(|p| p.config.stall_timeout().ok())
            .unwrap_or(std::time::Duration::from_secs(15 * 60))
    }

    /// How much history a box of `profile` gets (the default for an unknown profile).
    pub(crate) fn history(&self, profile: &str) -> skiff_providers::History {
        self.profiles
            .get(profile)
            .map(|p| p.config.history)
            .unwrap_or_default()
    }

    /// The box roots of `local` profiles (`default` for those that name none).
    pub(crate) fn local_box_roots(&self, default: &std::path::Path) -> BTreeSet<PathBuf> {
        self.profiles
            .values()
            .filter(|p| p.config.provider == skiff_providers::ProviderKind::Local)
            .map(|p| {
                p.config
                    .root
                    .clone()
                    .unwrap_or_else(|| default.to_path_buf())
            })
            .collect()
    }

    pub(crate) fn profile_views(&self) -> Vec<ProfileView> {
        self.profiles
            .iter()
            .map(|(name, p)| ProfileView {
                name: name.clone(),
                provider: p.provider.kind().to_owned(),
                development_only: p.provider.development_only(),
                idle_timeout: p.config.idle_timeout_text(),
                ttl: p.config.ttl_text(),
            })
            .collect()
    }

    async fn bundle(&self) -> Result<&Bundle> {
        self.bundle
            .get_or_try_init(|| async {
                tokio::task::spawn_blocking(Bundle::of_current_exe)
                    .await
                    .map_err(|e| {
                        Error::Internal(format!("hashing the worker bundle crashed: {e}"))
                    })?
                    .map_err(|e| {
                        Error::Internal(format!(
                            "cannot read the skiff executable to bundle it: {e}"
                        ))
                    })
            })
            .await
    }

    fn lock(&self, id: &EnvironmentId) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.clone())
            .or_default()
            .clone()
    }

    pub(crate) fn view(&self, row: &EnvironmentRow) -> EnvironmentView {
        let development_only = self
            .profiles
            .get(&row.profile)
            .is_some_and(|p| p.provider.development_only());
        let lease = row
            .lease
            .as_deref()
            .and_then(|l| serde_json::from_str::<Lease>(l).ok());
        EnvironmentView {
            id: row.id.clone(),
            profile: row.profile.clone(),
            provider: row.provider.clone(),
            state: row.state,
            lease_id: row.lease_id.clone(),
            development_only,
            ssh_target: lease.map(|l| format!("{}@{}:{}", l.user, l.host, l.port)),
            bundle_hash: row.bundle_hash.clone(),
            created_at_ms: row.created_at_ms,
            updated_at_ms: row.updated_at_ms,
            last_used_at_ms: row.last_used_at_ms,
            expires_at_ms: row.expires_at_ms,
            attached_sessions: Vec::new(),
            tunnel: "none".into(),
            error: row.error.clone(),
            accounting: row.accounting,
            from_snapshot: row.snapshot_id.clone(),
            egress_hosts: Vec::new(),
        }
    }

    fn audit(
        &self,
        scope: &Scope,
        action: &str,
        id: &EnvironmentId,
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

    fn transition(
        &self,
        row: &EnvironmentRow,
        to: EnvironmentState,
        error: Option<&str>,
    ) -> Result<EnvironmentRow> {
        let next = self
            .store
            .transition_environment(&row.scope, &row.id, to, error)?;
        tracing::info!(env = %row.id, from = %row.state, to = %to, "environment");
        self.audit(&row.scope, "environment.transition", &row.id, "applied", json!({
            "from": row.state.as_str(), "to": to.as_str(), "profile": row.profile, "provider": row.provider,
            "op_id": row.op_id, "error": error,
        }));
        Ok(next)
    }

    fn fail(&self, row: &EnvironmentRow, error: &str) -> Result<EnvironmentRow> {
        tracing::warn!(env = %row.id, error, "environment failed");
        self.transition(row, EnvironmentState::Failed, Some(error))
    }

    /// Starts leasing a box for `profile` (or, with `reuse`, hands out a warm idle one with the
    /// gateway's bundle). Returns at once; the environment moves on in the background.
    pub(crate) async fn create(
        self: &Arc<Self>,
        scope: &Scope,
        profile_name: &str,
        reuse: bool,
    ) -> Result<EnvironmentView> {
        if reuse && let Some(view) = self.reuse(scope, profile_name).await? {
            return Ok(view);
        }
        self.create_from(scope, profile_name, None)
    }

    /// Records a new environment (its box's home from `snapshot` when given) and starts
    /// bringing it up in the background.
    fn create_from(
        self: &Arc<Self>,
        scope: &Scope,
        profile_name: &str,
        snapshot: Option<&SnapshotId>,
    ) -> Result<EnvironmentView> {
        let profile = self.profile(profile_name)?;
        let id = EnvironmentId::from_suffix(&skiff_store::mint()?);
        // INVARIANT: the operation id is persisted before the provider hears of it.
        let op_id = format!("op_{}", &id.as_str()[4..]);
        let row = self.store.create_environment_from(
            scope,
            &id,
            profile_name,
            profile.provider.kind(),
            &op_id,
            snapshot,
        )?;
        self.audit(
            scope,
            "environment.create",
            &id,
            "allowed",
            json!({ "profile": profile_name, "op_id": op_id, "from_snapshot": snapshot }),
        );
        let view = self.view(&row);
        let this = self.clone();
        tokio::spawn(async move {
            if let Err(e) = this.bring_up(row.scope.clone(), row.id.clone()).await {
                tracing::warn!(env = %row.id, error = %e, "bringing the environment up failed");
            }
        });
        Ok(view)
    }

    async fn reuse(&self, scope: &Scope, profile: &str) -> Result<Option<EnvironmentView>> {
        Ok(self
            .take_idle(scope, profile, false, None)
            .await?
            .map(|row| self.view(&row)))
    }

    /// A warm idle box of `profile` in `scope` with the gateway's bundle, checked (lease
    /// running, bundle in place) under its lock. With `attach` it is attached before the lock
    /// is let go, so two sessions can never both take the same box. With `prepared`, only a
    /// box whose home holds the result of that setup.
    pub(super) async fn take_idle(
        &self,
        scope: &Scope,
        profile: &str,
        attach: bool,
        prepared: Option<&str>,
    ) -> Result<Option<EnvironmentRow>> {
        for row in self.idle_candidates(scope, profile, prepared).await? {
            let lock = self.lock(&row.id);
            let _guard = lock.lock().await;
            if let Some(row) = self.claim_idle_locked(&row, attach).await? {
                return Ok(Some(row));
            }
        }
        Ok(None)
    }

    /// The idle boxes of `profile` in `scope` with the gateway's bundle (with `prepared`,
    /// only those whose home holds that setup's result), as last read: each must be claimed
    /// under its lock.
    pub(super) async fn idle_candidates(
        &self,
        scope: &Scope,
        profile: &str,
        prepared: Option<&str>,
    ) -> Result<Vec<EnvironmentRow>> {
        let hash = self.bundle().await?.hash.clone();
        Ok(self
            .store
            .environments(&skiff_store::Sight::own(scope.clone()))?
            .into_iter()
            .filter(|r| {
                r.profile == profile
                    && r.state == EnvironmentState::Idle
                    && r.bundle_hash.as_deref() == Some(&hash)
                    && prepared.is_none_or(|key| r.prepared_key.as_deref() == Some(key))
            })
            .collect())
    }

    /// Takes the idle box `row` (attached with `attach`) when it is still idle and checks out;
    /// `None` otherwise. The caller holds its lock.
    pub(super) async fn claim_idle_locked(
        &self,
        row: &EnvironmentRow,
        attach: bool,
    ) -> Result<Option<EnvironmentRow>> {
        let scope = &row.scope;
        let Ok(row) = self.check_locked(scope, &row.id, false).await else {
            return Ok(None);
        };
        if row.state != EnvironmentState::Idle {
            return Ok(None);
        }
        if attach {
            self.transition(&row, EnvironmentState::Attached, None)?;
        }
        self.store.touch_environment(scope, &row.id)?;
        self.audit(
            scope,
            "environment.reuse",
            &row.id,
            "allowed",
            json!({ "profile": row.profile }),
        );
        Ok(Some(self.store.environment(scope, &row.id)?))
    }

    /// Drives an environment from wherever it is (requested, provisioning, bootstrapping) to
    /// idle. Safe to repeat: provisioning with the same operation id adopts the lease.
    pub(crate) async fn bring_up(&self, scope: Scope, id: EnvironmentId) -> Result<()> {
        let lock = self.lock(&id);
        let _guard = lock.lock().await;
        let mut row = self.store.environment(&scope, &id)?;
        let provider = self.profile(&row.profile)?.provider.clone();
        if row.state == EnvironmentState::Requested {
            row = self.transition(&row, EnvironmentState::Provisioning, None)?;
        }
        if row.state == EnvironmentState::Provisioning {
            let started = Instant::now();
            // The same call on every attempt (a restart adopts the lease it asked for).
            let lease = match &row.snapshot_id {
                Some(snapshot) => provider.provision_from_snapshot(&row.op_id, snapshot).await,
                None => provider.provision(&row.op_id).await,
            };
            self.audit(&scope, "provider.provision", &id, if lease.is_ok() { "ok" } else { "error" }, json!({
                "provider": provider.kind(), "op_id": row.op_id, "duration_ms": started.elapsed().as_millis() as u64,
                "lease_id": lease.as_ref().ok().map(|l| l.lease_id.clone()),
                "from_snapshot": row.snapshot_id,
            }));
            let lease = match lease {
                Ok(lease) => lease,
                Err(e) => {
                    self.fail(&row, &e.to_string())?;
                    return Err(e.into());
                }
            };
            let lease_json =
                serde_json::to_string(&lease).map_err(|e| Error::Internal(e.to_string()))?;
            self.store.set_environment_lease(
                &scope,
                &id,
                &lease.lease_id,
                &lease_json,
                lease.expires_at_ms,
            )?;
            row = self.transition(&row, EnvironmentState::Bootstrapping, None)?;
        }
        if row.state == EnvironmentState::Bootstrapping {
            let row_now = self.store.environment(&scope, &id)?;
            let verified = match self.bootstrap(&row_now).await {
                Ok(_) => match self.readiness.get() {
                    Some(readiness) => readiness
                        .verify(&row_now)
                        .await
                        .map_err(|e| Error::BoxNotReady(format!("the box is not ready: {e}"))),
                    None => Ok(()),
                },
                Err(e) => Err(e),
            };
            match verified {
                Ok(()) => {
                    row = self.transition(&row, EnvironmentState::Ready, None)?;
                    self.transition(&row, EnvironmentState::Idle, None)?;
                    self.store.touch_environment(&scope, &id)?;
                }
                Err(e) => {
                    self.fail(&row, &e.to_string())?;
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Sets the readiness check every bring-up ends with.
    pub(crate) fn set_readiness(&self, readiness: Arc<dyn crate::worker::probe::Readiness>) {
        let _ = self.readiness.set(readiness);
    }

    /// The lease recorded for an environment.
    pub(crate) fn lease(&self, row: &EnvironmentRow) -> Result<Lease> {
        row.lease
            .as_deref()
            .and_then(|l| serde_json::from_str(l).ok())
            .ok_or_else(|| Error::Conflict(format!("environment {} has no lease yet", row.id)))
    }

    /// Where this gateway keeps the SSH key of a box another gateway leased, once it opened
    /// it from the vault to adopt the box (`worker/adopt.rs`); preferred over the lease's own
    /// path, which is the leasing gateway's.
    pub(crate) fn adopted_identity(&self, id: &EnvironmentId) -> PathBuf {
        self.ssh_root.join(id.as_str()).join("identity")
    }

    /// The pinned SSH client of an environment.
    pub(crate) fn ssh(&self, row: &EnvironmentRow) -> Result<Ssh> {
        let lease = self.lease(row)?;
        let adopted = self.adopted_identity(&row.id);
        let target = Target {
            alias: row.id.to_string(),
            host: lease.host,
            port: lease.port,
            user: lease.user,
            identity_file: if adopted.exists() {
                adopted
            } else {
                lease.identity_file
            },
            host_key: lease.host_key,
            proxy_command: lease.proxy_command,
        };
        Ok(Ssh::pin(target, &self.ssh_root.join(row.id.as_str()))?)
    }

    async fn bootstrap(&self, row: &EnvironmentRow) -> Result<BundleInstall> {
        let bundle = self.bundle().await?.clone();
        let ssh = self.ssh(row)?;
        let install = bootstrap::install(&ssh, &bundle).await?;
        self.store
            .set_environment_bundle(&row.scope, &row.id, &bundle.hash)?;
        self.audit(&row.scope, "bundle.install", &row.id, if install.copied { "copied" } else { "skipped" }, json!({
            "bundle_hash": bundle.hash, "bytes": install.bytes, "duration_ms": install.duration.as_millis() as u64,
        }));
        Ok(install)
    }

    /// Inspects the lease and opens a fresh SSH connection that verifies the installed bundle.
    /// A dead box or a changed host key fails the environment.
    pub(crate) async fn check(&self, scope: &Scope, id: &EnvironmentId) -> Result<EnvironmentView> {
        let lock = self.lock(id);
        let _guard = lock.lock().await;
        let row = self.check_locked(scope, id, true).await?;
        Ok(self.view(&row))
    }

    /// `fresh`: drop the multiplexed connection first, so the pinned host key is checked on a
    /// new one (an explicit check); otherwise reuse it (handing out a warm box).
    async fn check_locked(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        fresh: bool,
    ) -> Result<EnvironmentRow> {
        let row = self.store.environment(scope, id)?;
        if !matches!(
            row.state,
            EnvironmentState::Ready | EnvironmentState::Idle | EnvironmentState::Attached
        ) {
            return Ok(row);
        }
        let provider = self.profile(&row.profile)?.provider.clone();
        let lease_id = lease_id(provider.as_ref(), &row);
        match provider.inspect(&lease_id).await {
            Ok(LeaseStatus::Running) => {}
            Ok(LeaseStatus::Gone) => {
                return self.fail(
                    &row,
                    &format!("the provider no longer has lease {lease_id}"),
                );
            }
            Ok(LeaseStatus::Failed(why)) => {
                return self.fail(&row, &format!("lease {lease_id} is broken: {why}"));
            }
            Err(e) => return self.fail(&row, &format!("inspecting lease {lease_id} failed: {e}")),
        }
        if fresh {
            self.ssh(&row)?.close().await;
        }
        match self.bootstrap(&row).await {
            Ok(_) => Ok(self.store.environment(scope, id)?),
            Err(e) => self.fail(&row, &e.to_string()),
        }
    }

    pub(crate) fn list(&self, sight: &skiff_store::Sight) -> Result<Vec<EnvironmentView>> {
        Ok(self
            .store
            .environments(sight)?
            .iter()
            .map(|r| self.view(r))
            .collect())
    }

    pub(crate) fn show(&self, scope: &Scope, id: &EnvironmentId) -> Result<EnvironmentView> {
        Ok(self.view(&self.store.environment(scope, id)?))
    }

    /// Runs a shell command on the box (for operators and diagnostics).
    pub(crate) async fn exec(
        &self,
        scope: &Scope,
        id: &EnvironmentId,
        command: &str,
    ) -> Result<String> {
        let row = self.store.environment(scope, id)?;
        if !matches!(
            row.state,
            EnvironmentState::Ready | EnvironmentState::Idle | EnvironmentState::Attached
        ) {
            return Err(Error::Conflict(format!(
                "environment {id} is {}; there is no box to run on",
                row.state
            )));
        }
        let ssh = self.ssh(&row)?;
        self.audit(scope, "environment.exec", id, "allowed", json!({}));
        Ok(ssh
            .run(command, &tokio_util::sync::CancellationToken::new())
            .await?)
    }
}
