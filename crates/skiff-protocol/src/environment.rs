//! Environments (leased boxes) as the API shows them.

use crate::ids::{EnvironmentId, SessionId, SnapshotId};
use serde::{Deserialize, Serialize};

/// The environment state machine (DESIGN §4):
/// `requested → provisioning → bootstrapping → ready → (attached|idle) → draining →
/// destroying → destroyed | failed | orphaned`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvironmentState {
    Requested,
    Provisioning,
    Bootstrapping,
    Ready,
    Attached,
    Idle,
    Draining,
    Destroying,
    Destroyed,
    Failed,
    Orphaned,
}

impl EnvironmentState {
    pub const ALL: [EnvironmentState; 11] = [
        EnvironmentState::Requested,
        EnvironmentState::Provisioning,
        EnvironmentState::Bootstrapping,
        EnvironmentState::Ready,
        EnvironmentState::Attached,
        EnvironmentState::Idle,
        EnvironmentState::Draining,
        EnvironmentState::Destroying,
        EnvironmentState::Destroyed,
        EnvironmentState::Failed,
        EnvironmentState::Orphaned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EnvironmentState::Requested => "requested",
            EnvironmentState::Provisioning => "provisioning",
            EnvironmentState::Bootstrapping => "bootstrapping",
            EnvironmentState::Ready => "ready",
            EnvironmentState::Attached => "attached",
            EnvironmentState::Idle => "idle",
            EnvironmentState::Draining => "draining",
            EnvironmentState::Destroying => "destroying",
            EnvironmentState::Destroyed => "destroyed",
            EnvironmentState::Failed => "failed",
            EnvironmentState::Orphaned => "orphaned",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Destroyed is final. Failed and orphaned still may hold a paid machine: they can be
    /// destroyed, so they are not terminal for the sweep.
    pub fn is_terminal(self) -> bool {
        self == EnvironmentState::Destroyed
    }
}

impl std::fmt::Display for EnvironmentState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Controlled-egress accounting of one environment: everything that left through the gateway
/// on its behalf.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressAccounting {
    pub model_requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub gateway_tool_calls: u64,
}

/// `GET /v1/environments`, `GET /v1/environments/{id}`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentView {
    pub id: EnvironmentId,
    pub profile: String,
    pub provider: String,
    pub state: EnvironmentState,
    /// The provider's id for the box, once known.
    #[serde(default)]
    pub lease_id: Option<String>,
    /// Static hosts and local boxes without root: not isolated, for development only.
    pub development_only: bool,
    /// `user@host:port` the gateway connects to, once known.
    #[serde(default)]
    pub ssh_target: Option<String>,
    #[serde(default)]
    pub bundle_hash: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Last time work used the box (for the idle timeout).
    pub last_used_at_ms: i64,
    #[serde(default)]
    pub expires_at_ms: Option<i64>,
    pub attached_sessions: Vec<SessionId>,
    /// `none` until a worker tunnel exists, then `up` / `reconnecting` / `down`.
    pub tunnel: String,
    #[serde(default)]
    pub error: Option<String>,
    pub accounting: EgressAccounting,
    /// The snapshot the box's home started from, when it did.
    #[serde(default)]
    pub from_snapshot: Option<SnapshotId>,
    /// What the box reached through the gateway's egress proxy, per phase and host.
    #[serde(default)]
    pub egress_hosts: Vec<EgressHost>,
}

/// One host's traffic through the egress proxy in one phase (`setup` or `agent`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressHost {
    pub phase: String,
    pub host: String,
    pub connections: u64,
    /// Bytes sent to the host.
    pub bytes_out: u64,
    /// Bytes received from it.
    pub bytes_in: u64,
    /// Requests the proxy refused (each answered with a 403 naming the key to change).
    pub refused: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentList {
    pub environments: Vec<EnvironmentView>,
}

/// `POST /v1/environments`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateEnvironmentRequest {
    pub profile: String,
    /// Start the box's home from this snapshot (of the same profile) instead of empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<SnapshotId>,
}

/// Where a snapshot is: being captured, usable, or on its way out. Only `ready` snapshots start
/// boxes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotState {
    Capturing,
    Ready,
    Deleting,
}

impl SnapshotState {
    pub const ALL: [SnapshotState; 3] = [
        SnapshotState::Capturing,
        SnapshotState::Ready,
        SnapshotState::Deleting,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotState::Capturing => "capturing",
            SnapshotState::Ready => "ready",
            SnapshotState::Deleting => "deleting",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl std::fmt::Display for SnapshotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of a prepared box's home, as `GET /v1/snapshots` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotView {
    pub id: SnapshotId,
    pub profile: String,
    /// The first 12 hex characters of the key it serves (setup script, profile, bundle, key
    /// files); the whole key is the gateway's.
    pub key_prefix: String,
    pub state: SnapshotState,
    /// What it takes on the provider's disk (0 until captured).
    pub size_bytes: u64,
    /// The environment it was taken from.
    pub environment_id: EnvironmentId,
    pub created_at_ms: i64,
    /// Last time a box started from it (or its creation).
    pub last_used_at_ms: i64,
}

/// `GET /v1/snapshots`, most recently used first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotView>,
}

/// `DELETE /v1/snapshots/{id}`: what was deleted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeletedSnapshot {
    pub id: SnapshotId,
    /// What it took on the provider's disk.
    pub size_bytes: u64,
}

/// `POST /v1/environments/{id}/snapshot`: snapshot a box prepared by hand.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeSnapshotRequest {
    /// The key (lowercase hex) sessions that should start from it will ask for; without one,
    /// the snapshot gets a key of its own and is used only by `env create --from-snapshot`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// A worker profile as clients see it (for choosing where a session runs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileView {
    pub name: String,
    pub provider: String,
    pub development_only: bool,
    /// Human-readable durations, e.g. `30m`.
    pub idle_timeout: String,
    pub ttl: String,
}

/// `GET /v1/profiles`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileList {
    pub profiles: Vec<ProfileView>,
}

/// Where a session's loop runs (DESIGN §4): `local → requested → provisioning → syncing →
/// [setup →] starting → active → draining → reconciling → local | reclaimed | failed`. A worker session
/// comes back to `active` after each turn's reconciliation; `parked` means it gave its box back
/// between turns (DESIGN §11), `reclaimed` that its box is gone; either way the next message
/// places it again. `handing_off` is a live move of a running turn (`--live`): the turn's
/// current step finishes at its old owner, which is then stopped and fenced, and the same run
/// goes on at the new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementState {
    Local,
    Requested,
    Provisioning,
    Syncing,
    /// The workspace is on the box and its setup (`.skiff/setup.sh`) runs.
    Setup,
    Starting,
    Active,
    Draining,
    /// A live move: the running turn is drained at its old owner and continues at the new.
    HandingOff,
    Reconciling,
    Parked,
    Reclaimed,
    /// The box died mid-run: the run's attempt there failed, and a new attempt of the same run
    /// is being placed on a fresh box from the last checkpoint (automatic failover).
    FailedOver,
    Failed,
}

impl PlacementState {
    pub const ALL: [PlacementState; 14] = [
        PlacementState::Local,
        PlacementState::Requested,
        PlacementState::Provisioning,
        PlacementState::Syncing,
        PlacementState::Setup,
        PlacementState::Starting,
        PlacementState::Active,
        PlacementState::Draining,
        PlacementState::HandingOff,
        PlacementState::Reconciling,
        PlacementState::Parked,
        PlacementState::Reclaimed,
        PlacementState::FailedOver,
        PlacementState::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PlacementState::Local => "local",
            PlacementState::Requested => "requested",
            PlacementState::Provisioning => "provisioning",
            PlacementState::Syncing => "syncing",
            PlacementState::Setup => "setup",
            PlacementState::Starting => "starting",
            PlacementState::Active => "active",
            PlacementState::Draining => "draining",
            PlacementState::HandingOff => "handing_off",
            PlacementState::Reconciling => "reconciling",
            PlacementState::Parked => "parked",
            PlacementState::Reclaimed => "reclaimed",
            PlacementState::FailedOver => "failed_over",
            PlacementState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl std::fmt::Display for PlacementState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `POST /v1/environments/{id}/exec`: a shell command line to run on the box.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub command: String,
}

/// What an environment exec printed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecResult {
    pub output: String,
}

/// `GET /v1/sessions/{id}/setup-log`: the newest setup log of a worker session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetupLog {
    /// `.skiff/setup.sh`, or the profile whose `setup` ran.
    pub setup: String,
    /// The exit status (124 when it ran out of time).
    pub exit_code: i32,
    pub duration_ms: u64,
    /// The output, stdout and stderr interleaved, secrets redacted.
    pub text: String,
}
