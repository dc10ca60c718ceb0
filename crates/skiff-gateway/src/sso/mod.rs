//! Single sign-on: who a request is when a person signs in through an identity provider rather
//! than with a Skiff token.
//!
//! - `[auth.proxy]` (`proxy.rs`): the gateway sits behind an identity-aware proxy, which signs
//!   an assertion (a JWT) onto every request it forwards. The gateway verifies it against the
//!   proxy's keys (`jwks.rs`) on every authenticated request and maps its one verified email to
//!   a user; with the mode on, no bearer token or cookie is accepted instead.

pub(crate) mod jwks;
pub(crate) mod proxy;

use serde::Deserialize;

/// `[auth]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Access-proxy mode; off unless configured.
    #[serde(default)]
    pub proxy: Option<ProxyConfig>,
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
