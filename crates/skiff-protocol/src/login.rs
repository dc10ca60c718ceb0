//! Single sign-on for the CLI (`skiff login --gateway URL`): the device-code flow (RFC 8628)
//! brokered by the gateway. The gateway holds the OpenID client secret and talks to the
//! provider; the CLI only ever sees a login id of the gateway's, the code the person types at
//! the provider, and at the end a Skiff token. Also `GET /auth/methods`, which tells the
//! Control UI whether to offer "Sign in with SSO".

use crate::people::Role;
use serde::{Deserialize, Serialize};

/// `POST /v1/auth/device`: a sign-in started; the person opens `verification_uri` and types
/// `user_code` (or opens `verification_uri_complete`, which carries it).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLoginStarted {
    /// What the CLI polls with; the gateway's own id (never the provider's device code).
    pub login_id: String,
    pub verification_uri: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification_uri_complete: Option<String>,
    pub user_code: String,
    pub expires_at_ms: i64,
    /// How long to wait between polls.
    pub interval_s: u64,
}

impl std::fmt::Debug for DeviceLoginStarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLoginStarted")
            .field("login_id", &"<redacted>")
            .field("verification_uri", &self.verification_uri)
            .field("user_code", &"<redacted>")
            .field("expires_at_ms", &self.expires_at_ms)
            .field("interval_s", &self.interval_s)
            .finish()
    }
}

/// `POST /v1/auth/device/poll`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicePollRequest {
    pub login_id: String,
}

impl std::fmt::Debug for DevicePollRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DevicePollRequest { login_id: <redacted> }")
    }
}

/// The answer to a poll: still waiting for the person, or signed in. A refusal (denied,
/// expired, unknown person, disallowed domain) is an `ApiError` instead.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum DevicePoll {
    Pending {
        interval_s: u64,
    },
    SignedIn {
        /// A Skiff token for the person (shown this once; the gateway keeps its hash).
        token: String,
        email: String,
        role: Role,
        tenant: String,
        expires_at_ms: i64,
    },
}

impl std::fmt::Debug for DevicePoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DevicePoll::Pending { interval_s } => write!(f, "Pending({interval_s}s)"),
            DevicePoll::SignedIn { email, role, .. } => {
                write!(f, "SignedIn({email}, {role}, token: <redacted>)")
            }
        }
    }
}

/// `GET /auth/methods`: how people may sign in to this gateway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthMethods {
    /// `[auth.oidc]` is configured: `/auth/login` and `skiff login` work.
    pub sso: bool,
}
