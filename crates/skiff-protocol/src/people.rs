//! People and roles (`/v1/admin/users`, `/v1/admin/tokens`, `/v1/me`): who may use the
//! gateway, in which tenant, with which role, and the tokens they sign in with. A token's
//! secret goes out exactly once (`CreatedToken`); only its hash is kept.

use serde::{Deserialize, Serialize};

/// What a person may do in their tenant. Each role includes the one before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Reads their own sessions and what hangs off them.
    Viewer,
    /// Creates and drives their own sessions.
    Member,
    /// A member who also manages environments and snapshots.
    Operator,
    /// Everything in their tenant, users and tokens included.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Admin, Role::Operator, Role::Member, Role::Viewer];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Member => "member",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most a token may do, whatever its user's role: `read` never writes, `write` never
/// manages users, tokens, the vault or the audit trail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenScope {
    Read,
    Write,
    Admin,
}

impl TokenScope {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenScope::Read => "read",
            TokenScope::Write => "write",
            TokenScope::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<TokenScope> {
        [TokenScope::Read, TokenScope::Write, TokenScope::Admin]
            .into_iter()
            .find(|t| t.as_str() == s)
    }
}

impl std::fmt::Display for TokenScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One user as listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserView {
    pub id: String,
    pub email: String,
    pub role: Role,
    pub tenant: String,
    pub created_at_ms: i64,
}

/// `GET /v1/admin/users`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserList {
    pub users: Vec<UserView>,
}

/// `POST /v1/admin/users`. Without `tenant`, the caller's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddUserRequest {
    pub email: String,
    pub role: Role,
    #[serde(default)]
    pub tenant: Option<String>,
}

/// `POST /v1/admin/tokens`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateTokenRequest {
    pub email: String,
    pub scope: TokenScope,
    /// Seconds from now until the token stops working.
    pub expires_in_s: u64,
}

/// One token as listed: never its secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenView {
    pub id: String,
    pub email: String,
    pub tenant: String,
    pub scope: TokenScope,
    pub created_at_ms: i64,
    /// `None` for the gateway's own admin token (in `gateway.json`), which never expires.
    pub expires_at_ms: Option<i64>,
}

/// `GET /v1/admin/tokens`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenList {
    pub tokens: Vec<TokenView>,
}

/// `POST /v1/admin/tokens`: the only time the secret is shown.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedToken {
    pub token: TokenView,
    pub secret: String,
}

impl std::fmt::Debug for CreatedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreatedToken")
            .field("token", &self.token)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// `GET /v1/me`: who the caller is signed in as, and what they may do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Me {
    pub email: String,
    pub role: Role,
    pub tenant: String,
    pub scope: TokenScope,
    /// `read`, `write`, `operate`, `admin`: what the UI may offer.
    pub can: Vec<String>,
}
