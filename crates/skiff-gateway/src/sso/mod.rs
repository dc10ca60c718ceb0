//! Single sign-on: who a request is when a person signs in through an identity provider rather
//! than with a Skiff token.
//!
//! - `[auth.proxy]` (`proxy.rs`): the gateway sits behind an identity-aware proxy, which signs
//!   an assertion (a JWT) onto every request it forwards. The gateway verifies it against the
//!   proxy's keys (`jwks.rs`) on every authenticated request and maps its one verified email to
//!   a user; with the mode on, no bearer token or cookie is accepted instead.
//! - `[auth.oidc]` (`oidc.rs`): the gateway is an OpenID Connect client of the provider. The
//!   Control UI signs in with the authorization-code flow with PKCE (`browser.rs`:
//!   `/auth/login`, `/auth/callback`); `skiff login` with the device-code flow the gateway
//!   brokers (`device.rs`: `/v1/auth/device`, `/v1/auth/device/poll`, `/v1/auth/logout`), so
//!   the client secret and the provider's tokens never leave the gateway.

pub(crate) mod browser;
pub(crate) mod device;
pub(crate) mod jwks;
pub(crate) mod oidc;
mod pending;
pub(crate) mod proxy;

use crate::Core;
use axum::Router;
use axum::routing::{get, post};
use serde::Deserialize;
use skiff_protocol::people::Role;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The sign-in routes anyone may reach: each answers "not configured" without `[auth.oidc]`.
pub(crate) fn public_routes() -> Router<Arc<Core>> {
    Router::new()
        .route("/auth/methods", get(browser::methods))
        .route("/auth/login", get(browser::login))
        .route("/auth/callback", get(browser::callback))
        .route("/v1/auth/device", post(device::start))
        .route("/v1/auth/device/poll", post(device::poll))
        .route("/v1/auth/logout", post(device::logout))
}

/// `[auth]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Access-proxy mode; off unless configured.
    #[serde(default)]
    pub proxy: Option<ProxyConfig>,
    /// OpenID Connect sign-in for the Control UI and `skiff login`; off unless configured.
    #[serde(default)]
    pub oidc: Option<OidcConfig>,
}

/// `[auth.oidc]`: the OpenID provider people sign in with.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OidcConfig {
    /// The provider's issuer URL; its `/.well-known/openid-configuration` is read at start.
    pub issuer: String,
    /// This gateway's client id at the provider.
    pub client_id: String,
    /// `vault:NAME`: the client secret (set it with `skiff secret set NAME`).
    pub client_secret: String,
    /// The email domains that may sign in (`example.com`); a verified email elsewhere is
    /// refused.
    pub allowed_domains: Vec<String>,
    /// The redirect URI registered at the provider [default: `/auth/callback` under the
    /// address the browser used].
    #[serde(default)]
    pub redirect_uri: Option<String>,
    /// How long a token from `skiff login` lives [default: "30d"].
    #[serde(default)]
    pub token_lifetime: Option<String>,
    /// Which people Skiff does not know yet are created, with which role.
    #[serde(default)]
    pub roles: Option<RoleMapping>,
}

/// `[auth.oidc.roles]`: a claim → role mapping for people who are not Skiff users yet. A
/// person who is a user signs in with the role an admin gave them; the mapping never changes
/// it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleMapping {
    /// The ID token's claim that names the person's groups (a string or a list of strings).
    pub claim: String,
    /// A value of that claim → the role a new user gets (the highest of those that match).
    pub map: BTreeMap<String, Role>,
    /// Whether a person whose claim matches is created as a user at their first sign-in
    /// [default: false: only people an admin added may sign in].
    #[serde(default)]
    pub create_users: bool,
    /// The tenant created users join [default: the gateway's first tenant].
    #[serde(default)]
    pub tenant: Option<String>,
}

/// `[auth.proxy]`: the identity-aware proxy in front of the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// The proxy's signing keys as a JWK Set: an `https://` (or `http://`) URL, or a file path
    /// (relative to skiff.toml).
    pub jwks: String,
    /// The `iss` every assertion must carry.
    pub issuer: String,
    /// The `aud` every assertion must carry (the proxy's id for this gateway).
    pub audience: String,
    /// The request header the proxy puts its assertion in (for example
    /// `Cf-Access-Jwt-Assertion` or `X-Goog-IAP-JWT-Assertion`).
    pub header: String,
    /// The claim naming the person [default: "email"].
    #[serde(default)]
    pub email_claim: Option<String>,
}
