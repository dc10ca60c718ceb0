//! Where boxes come from. [`WorkerProvider`] is the contract the gateway's environment state
//! machine drives; `local` (boxes on this machine, each with its own sshd), `ssh` (a static
//! host, development only) and `command` (any lease CLI in the Crabbox shape) implement it.
//!
//! Snapshots are an optional capability ([`WorkerProvider::snapshots`]): a copy of a prepared
//! box's home (toolchains a setup script installed) that later boxes start from. What a
//! snapshot holds is the same for every provider: the box user's home without `workspace/`,
//! `workspaces/` (sessions' work) and `~/.skiff` (the worker's socket, credentials, logs and
//! bundle; bootstrap installs the bundle again, checked by its build hash at admission). A
//! snapshot is complete or absent, never half there.
//!
//! Deliberately absent: policy. Providers do not decide when a box is reused, reclaimed or
//! renewed, nor which snapshot to keep — the gateway does — and the gateway core names no
//! provider.

mod command;
mod config;
pub mod local;
mod static_ssh;

pub use config::{
    BudgetsConfig, EgressConfig, Failover, History, Isolation, Limits, LimitsConfig, ProfileConfig,
    ProviderKind,
};

use futures_util::future::BoxFuture;
use skiff_protocol::SnapshotId;
use std::path::PathBuf;
use std::sync::Arc;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("profile `{profile}`: {problem}")]
    Config { profile: String, problem: String },
    #[error("{provider} provider: {message}")]
    Provider {
        provider: &'static str,
        message: String,
    },
    #[error("lease {lease} was not found by the {provider} provider")]
    UnknownLease {
        provider: &'static str,
        lease: String,
    },
    /// The gateway falls back to preparing a fresh box when it sees this.
    #[error(
        "snapshot {snapshot} is not held by the {provider} provider (deleted or never completed); start a fresh box and run its setup instead"
    )]
    UnknownSnapshot {
        provider: &'static str,
        snapshot: SnapshotId,
    },
    #[error(
        "the {provider} provider does not take snapshots here, so boxes of this profile always run their setup (a `command` profile whose lease CLI has the snapshot verbs says `snapshots = true`)"
    )]
    SnapshotsUnsupported { provider: &'static str },
    #[error("{provider} provider could not prove that lease {lease} is gone: {evidence}")]
    NoEvidence {
        provider: &'static str,
        lease: String,
        evidence: String,
    },
    #[error(
        "the sandbox of box {dir} could not {step}: {source}; local boxes as root need util-linux \
         `unshare`, mount and PID namespaces, and OpenSSH's sshd at /usr/sbin/sshd (see its \
         sandbox.log and sshd.log)"
    )]
    Sandbox {
        dir: String,
        step: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Process(#[from] skiff_process::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What a provider hands back for a box: how to reach it and how to trust it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lease {
    pub lease_id: String,
    pub host: String,
    pub port: u16,
    pub user: String,
    /// The private key to log in with (mode 0600, readable by the gateway only).
    pub identity_file: PathBuf,
    /// The box's public host key, pinned for every connection.
    pub host_key: String,
    #[serde(default)]
    pub proxy_command: Option<Vec<String>>,
    #[serde(default)]
    pub expires_at_ms: Option<i64>,
}

/// What a provider can say about a lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// The box is up and should accept SSH.
    Running,
    /// The provider has no such box (never made, or torn down).
    Gone,
    /// The box exists but is broken (its sshd died, the provider reports a failure).
    Failed(String),
}

/// A snapshot a provider holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: SnapshotId,
    /// What it takes on the provider's disk.
    pub size_bytes: u64,
}

/// A source of boxes. Every method is idempotent; `destroy` returns only once the box is
/// proven gone.
///
/// Snapshot ids are minted by the gateway, one per capture; the snapshot methods default to
/// "not supported" ([`Error::SnapshotsUnsupported`]).
pub trait WorkerProvider: Send + Sync {
    /// `local`, `ssh` or `command`.
    fn kind(&self) -> &'static str;

    /// Whether boxes of this provider are not isolated from the host (static hosts, local
    /// boxes without root): such environments are labelled development-only.
    fn development_only(&self) -> bool;

    /// The lease id this provider uses for an operation id. Deterministic, so a gateway that
    /// died mid-provision finds (adopts) the lease it asked for instead of making a second one.
    fn lease_id_for(&self, op_id: &str) -> String;

    /// Leases a box for `op_id`; when the lease already exists, returns it.
    fn provision<'a>(&'a self, op_id: &'a str) -> BoxFuture<'a, Result<Lease>>;

    fn inspect<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<LeaseStatus>>;

    /// Extends the lease's expiry, where the provider has one.
    fn renew<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Tears the box down and returns only once the provider shows it gone.
    fn destroy<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Every lease the provider holds, for the orphan sweep.
    fn list<'a>(&'a self) -> BoxFuture<'a, Result<Vec<String>>>;

    /// Whether this provider takes snapshots. When false, every snapshot method fails with
    /// [`Error::SnapshotsUnsupported`].
    fn snapshots(&self) -> bool {
        false
    }

    /// Captures the prepared home of box `lease_id` as `snapshot_id` (see the crate docs for
    /// what is left out). Idempotent: a complete snapshot of that id from that lease is
    /// returned as it is. A capture that fails leaves nothing that looks like a snapshot.
    fn snapshot<'a>(
        &'a self,
        lease_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<SnapshotInfo>> {
        let _ = (lease_id, snapshot_id);
        let err = unsupported(self.kind());
        Box::pin(async move { Err(err) })
    }

    /// Leases a box for `op_id` (the same lease id as [`WorkerProvider::provision`]) whose
    /// home starts as a copy of `snapshot_id`, owned by the new box's user; when that lease
    /// already exists, returns it. A snapshot the provider does not hold is
    /// [`Error::UnknownSnapshot`], with nothing leased.
    fn provision_from_snapshot<'a>(
        &'a self,
        op_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<Lease>> {
        let _ = (op_id, snapshot_id);
        let err = unsupported(self.kind());
        Box::pin(async move { Err(err) })
    }

    /// Makes the home of `lease_id` — an existing, running box nothing of a session uses —
    /// hold `snapshot_id`: everything in it but `workspace/`, `workspaces/` and `~/.skiff`
    /// (the installed bundle stays) is replaced by the snapshot's copy, owned by the box's
    /// user. The box user is untrusted: a symlink it planted in its home never redirects a
    /// write outside it. Idempotent. A snapshot the provider does not hold is
    /// [`Error::UnknownSnapshot`]; a restore that fails otherwise may leave the home half
    /// replaced, so the caller destroys the box rather than use it.
    fn restore_snapshot<'a>(
        &'a self,
        lease_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = (lease_id, snapshot_id);
        let err = unsupported(self.kind());
        Box::pin(async move { Err(err) })
    }

    /// Removes a snapshot; one that does not exist is already removed.
    fn delete_snapshot<'a>(&'a self, snapshot_id: &'a SnapshotId) -> BoxFuture<'a, Result<()>> {
        let _ = snapshot_id;
        let err = unsupported(self.kind());
        Box::pin(async move { Err(err) })
    }

    /// Every complete snapshot the provider holds, for the gateway's sweep.
    fn list_snapshots<'a>(&'a self) -> BoxFuture<'a, Result<Vec<SnapshotInfo>>> {
        let err = unsupported(self.kind());
        Box::pin(async move { Err(err) })
    }
}

/// The error of the snapshot methods' defaults.
fn unsupported(provider: &'static str) -> Error {
    Error::SnapshotsUnsupported { provider }
}

/// What providers may need from the gateway's host.
#[derive(Clone, Debug)]
pub struct Context {
    /// The gateway's own executable (local boxes reach netns sshd through `skiff box proxy`).
    pub skiff_exe: PathBuf,
    /// Where a provider keeps private material (client keys written from a lease CLI's
    /// output). Inside the gateway's 0700 state dir.
    pub private_dir: PathBuf,
    /// Default root of local boxes.
    pub default_box_root: PathBuf,
    /// The gateway's state dir: nothing of it may be shared into a box.
    pub state_dir: PathBuf,
}

/// Builds the provider a profile names.
pub fn build(
    name: &str,
    profile: &ProfileConfig,
    ctx: &Context,
) -> Result<Arc<dyn WorkerProvider>> {
    profile.validate(name)?;
    Ok(match profile.provider {
        ProviderKind::Local => {
            let root = profile
                .root
                .clone()
                .unwrap_or_else(|| ctx.default_box_root.clone());
            let private = [ctx.state_dir.as_path(), root.as_path()];
            for share in &profile.share {
                config::check_share(name, share, &private)?;
            }
            Arc::new(local::LocalProvider::new(
                local::Boxes::new(root.clone(), ctx.skiff_exe.clone())
                    .with_limits(profile.limits(name)?)
                    .with_shares(profile.share.clone()),
                profile.isolation_or_default(),
                profile.ttl()?,
            ))
        }
        ProviderKind::Ssh => Arc::new(static_ssh::StaticSsh::new(name, profile)?),
        ProviderKind::Command => Arc::new(command::CommandProvider::new(
            name,
            profile,
            ctx.private_dir.join(name),
        )?),
    })
}

/// Whether this process runs as root (local boxes then get users and namespaces of their own).
pub fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// `prefix` + 12 lowercase hex characters of the operation id's hash.
pub fn derive_lease_id(prefix: &str, op_id: &str) -> String {
    let hash = blake3::hash(op_id.as_bytes()).to_hex();
    format!("{prefix}{}", &hash[..12])
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
