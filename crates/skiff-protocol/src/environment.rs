//! Environments (leased boxes) as the API shows them.

use crate::ids::{EnvironmentId, SessionId};
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
/// starting → active → draining → reconciling → local | reclaimed | failed`. A worker session
/// comes back to `active` after each turn's reconciliation; `parked` means it gave its box back
/// between turns (DESIGN §11), `reclaimed` that its box is gone; either way the next message
/// places it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementState {
    Local,
    Requested,
    Provisioning,
    Syncing,
    Starting,
    Active,
    Draining,
    Reconciling,
    Parked,
    Reclaimed,
    Failed,
}

impl PlacementState {
    pub const ALL: [PlacementState; 11] = [
        PlacementState::Local,
        PlacementState::Requested,
        PlacementState::Provisioning,
        PlacementState::Syncing,
        PlacementState::Starting,
        PlacementState::Active,
        PlacementState::Draining,
        PlacementState::Reconciling,
        PlacementState::Parked,
        PlacementState::Reclaimed,
        PlacementState::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PlacementState::Local => "local",
            PlacementState::Requested => "requested",
            PlacementState::Provisioning => "provisioning",
            PlacementState::Syncing => "syncing",
            PlacementState::Starting => "starting",
            PlacementState::Active => "active",
            PlacementState::Draining => "draining",
            PlacementState::Reconciling => "reconciling",
            PlacementState::Parked => "parked",
            PlacementState::Reclaimed => "reclaimed",
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
