//! The gateway as an OpenID Connect client (`[auth.oidc]`): the provider's endpoints and keys
//! (read from its discovery document at start), the two calls to its token endpoint (a code
//! with its PKCE verifier, a device code), the ID token's checks, and who the token names.
//!
//! Who may sign in: a person whose ID token (signed by a key of the provider's JWKS, issued by
//! the configured issuer for this client, unexpired, carrying the nonce the sign-in started
//! with when there was one) names a **verified** email in an **allowed domain**, and who is a
//! Skiff user. A person who is not one yet is created only when `[auth.oidc.roles]` says
//! `create_users = true` and their role claim matches the mapping (the highest matching role);
//! an existing user keeps the role an admin gave them.
//!
//! The client secret is opened from the vault at each use (so one set after start, or rotated,
//! counts at once) and, like codes and tokens, is never logged, audited or put in an error.

use super::jwks::{Jwks, Source};
use super::{OidcConfig, RoleMapping};
use crate::Core;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use skiff_protocol::people::Role;
use skiff_store::{DEFAULT_TENANT, UserRow};
use std::sync::Arc;
use std::time::Duration;

/// The scopes every sign-in asks for: an ID token with the person's email.
const SCOPES: &str = "openid email profile";
/// The lifetime of a `skiff login` token unless `token_lifetime` says otherwise.
const DEFAULT_TOKEN_LIFETIME: &str = "30d";

/// The configured provider.
pub(crate) struct Oidc {
    /// The issuer as the discovery document states it (what ID tokens must carry).
    pub(crate) issuer: String,
    pub(crate) client_id: String,
    /// The vault name of the client secret.
    secret_name: String,
    allowed_domains: Vec<String>,
    pub(crate) redirect_uri: Option<String>,
    pub(crate) token_lifetime: Duration,
    roles: Option<RoleMapping>,
    pub(crate) authorization_endpoint: String,
    token_endpoint: String,
    pub(crate) device_endpoint: Option<String>,
    jwks: Jwks,
    http: reqwest::Client,
    vault: Arc<crate::vault::Vault>,
    /// Browser sign-ins under way (`browser.rs`).
    pub(crate) browsers: super::browser::Pending,
    /// CLI sign-ins under way (`device.rs`).
    pub(crate) devices: super::device::Pending,
}

/// The part of the discovery document the gateway uses.
#[derive(Deserialize)]
struct Discovery {
    issuer: String,
    authorization_endpoint: String,
    token_endpoint: String,
    jwks_uri: String,
    #[serde(default)]
    device_authorization_endpoint: Option<String>,
}

/// Why a sign-in failed, in words for the person (the page or the CLI shows it) and for the
/// audit. Never holds a code, a token or the secret.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SignInError {
    /// The gateway could not talk to the provider, or the provider answered nonsense.
    #[error("{0}")]
    Provider(String),
    /// The client secret is not in the vault (or does not open).
    #[error("{0}")]
    Secret(String),
    /// The provider refused (an `error` it answered with).
    #[error("the identity provider refused: {0}")]
    Refused(String),
    /// The ID token failed a check.
    #[error("the identity provider's ID token is refused: {0}")]
    Token(String),
    /// A valid token for someone who may not sign in here.
    #[error("{0}")]
    NotAllowed(String),
    /// The store failed.
    #[error("{0}")]
    Internal(String),
    /// Too many sign-ins are under way to start another now.
    #[error("{}", .0.message())]
    Busy(super::pending::Full),
}

/// What the token endpoint answered.
pub(crate) enum TokenAnswer {
    IdToken(String),
    /// An OAuth error code (`authorization_pending`, `access_denied`, …) and its description.
    Error(String, Option<String>),
}

fn invalid(key: &str, message: impl std::fmt::Display) -> String {
    format!("at `auth.oidc.{key}`: {message}")
}

/// A URL of the provider's: http(s) only.
fn checked_url(key: &str, url: &str) -> Result<String, String> {
    let parsed = reqwest::Url::parse(url)
        .map_err(|e| invalid(key, format!("{url:?} is not a URL ({e})")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid(key, format!("{url:?} is not an http(s) URL")));
    }
    Ok(url.to_owned())
}

impl Oidc {
    /// Checks `[auth.oidc]` and reads the provider's discovery document and keys; the message
    /// names the key at fault.
    pub(crate) async fn from_config(
        config: &OidcConfig,
        vault: Arc<crate::vault::Vault>,
    ) -> Result<Oidc, String> {
        let issuer = checked_url("issuer", config.issuer.trim())?;
        if config.client_id.trim().is_empty() {
            return Err(invalid(
                "client_id",
                "empty; set the client id the provider gave this gateway",
            ));
        }
        let secret_name = config
            .client_secret
            .strip_prefix("vault:")
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| {
                invalid(
                    "client_secret",
                    "must be a vault reference (`vault:NAME`; store the secret with `skiff secret set NAME`)",
                )
            })?;
        if config.allowed_domains.is_empty() {
            return Err(invalid(
                "allowed_domains",
                "empty, so nobody could sign in; list the email domains that may (`[\"example.com\"]`)",
            ));
        }
        let mut allowed_domains = Vec::new();
        for domain in &config.allowed_domains {
            let d = domain.trim().trim_start_matches('@').to_ascii_lowercase();
            if d.is_empty() || d.contains(['@', '/', ' ']) || !d.contains('.') {
                return Err(invalid(
                    "allowed_domains",
                    format!("{domain:?} is not an email domain (like \"example.com\")"),
                ));
            }
            allowed_domains.push(d);
        }
        let redirect_uri = match &config.redirect_uri {
            Some(uri) => Some(checked_url("redirect_uri", uri.trim())?),
            None => None,
        };
        let lifetime = config
            .token_lifetime
            .as_deref()
            .unwrap_or(DEFAULT_TOKEN_LIFETIME);
        let token_lifetime = humantime::parse_duration(lifetime)
            .ok()
            .filter(|d| d.as_secs() >= 60 && d.as_secs() <= crate::people::MAX_TOKEN_LIFETIME_S)
            .ok_or_else(|| {
                invalid(
                    "token_lifetime",
                    format!(
                        "{lifetime:?} is not a duration between a minute and a year, like \"30d\""
                    ),
                )
            })?;
        if let Some(roles) = &config.roles {
            if roles.claim.trim().is_empty() {
                return Err(invalid(
                    "roles.claim",
                    "empty; name the ID token claim with the groups (\"groups\")",
                ));
            }
            if roles.create_users && roles.map.is_empty() {
                return Err(invalid(
                    "roles.map",
                    "empty, so `create_users` could create nobody; map a claim value to a role",
                ));
            }
        }
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(15))
            .build()
            .map_err(|e| invalid("issuer", format!("cannot build an HTTP client: {e}")))?;
        let discovery_url = format!(
            "{}/.well-known/openid-configuration",
            issuer.trim_end_matches('/')
        );
        let discovery: Discovery = async {
            let resp = http
                .get(&discovery_url)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !resp.status().is_success() {
                return Err(format!("it answered {}", resp.status()));
            }
            resp.json().await.map_err(|e| e.to_string())
        }
        .await
        .map_err(|e| {
            invalid(
                "issuer",
                format!("cannot read the provider's discovery document {discovery_url}: {e}"),
            )
        })?;
        if discovery.issuer.trim_end_matches('/') != issuer.trim_end_matches('/') {
            return Err(invalid(
                "issuer",
                format!(
                    "the provider at {issuer} says its issuer is {}; set that",
                    discovery.issuer
                ),
            ));
        }
        let jwks = Jwks::load(Source::Url(discovery.jwks_uri.clone()))
            .await
            .map_err(|e| invalid("issuer", format!("the provider's keys: {e}")))?;
        if let Err(e) = vault.open(&secret_name) {
            // Not fatal: `skiff secret set` talks to this very gateway, so it must start first.
            tracing::warn!(error = %e, "the OIDC client secret is not usable yet; sign-ins fail until it is set");
        }
        Ok(Oidc {
            issuer: discovery.issuer,
            client_id: config.client_id.trim().to_owned(),
            secret_name,
            allowed_domains,
            redirect_uri,
            token_lifetime,
            roles: config.roles.clone(),
            authorization_endpoint: checked_url("issuer", &discovery.authorization_endpoint)?,
            token_endpoint: checked_url("issuer", &discovery.token_endpoint)?,
            device_endpoint: discovery.device_authorization_endpoint,
            jwks,
            http,
            vault,
            browsers: super::browser::Pending::default(),
            devices: super::device::Pending::default(),
        })
    }

    /// The client secret, from the vault.
    fn secret(&self) -> Result<String, SignInError> {
        self.vault.open(&self.secret_name).map_err(|e| {
            tracing::warn!(error = %e, "cannot open the OIDC client secret");
            SignInError::Secret(format!(
                "the gateway cannot use its OpenID client secret (`vault:{}`): an admin sets it with `skiff secret set {}`",
                self.secret_name, self.secret_name
            ))
        })
    }

    /// A form POST to one of the provider's endpoints with the client's credentials
    /// (`client_secret_basic`), and its JSON answer with the status.
    async fn post_form(
        &self,
        url: &str,
        form: &[(&str, &str)],
    ) -> Result<(reqwest::StatusCode, Map<String, Value>), SignInError> {
        let secret = self.secret()?;
        let body = form
            .iter()
            .map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let resp = self
            .http
            .post(url)
            // RFC 6749 §2.3.1: both halves form-encoded before the Basic encoding.
            .basic_auth(form_encode(&self.client_id), Some(form_encode(&secret)))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| {
                SignInError::Provider(format!(
                    "cannot reach the identity provider at {url}: {}",
                    without_url(&e)
                ))
            })?;
        let status = resp.status();
        let answer = resp.json::<Map<String, Value>>().await.map_err(|_| {
            SignInError::Provider(format!(
                "the identity provider answered {status} at {url} with something that is not JSON"
            ))
        })?;
        Ok((status, answer))
    }

    /// Asks the token endpoint for tokens under `grant` (its parameters); the ID token, or the
    /// OAuth error the provider answered.
    pub(crate) async fn token(&self, grant: &[(&str, &str)]) -> Result<TokenAnswer, SignInError> {
        let (status, answer) = self.post_form(&self.token_endpoint, grant).await?;
        if let Some(error) = answer.get("error").and_then(Value::as_str) {
            let description = answer
                .get("error_description")
                .and_then(Value::as_str)
                .map(str::to_owned);
            return Ok(TokenAnswer::Error(error.to_owned(), description));
        }
        match answer.get("id_token").and_then(Value::as_str) {
            Some(id_token) if status.is_success() => Ok(TokenAnswer::IdToken(id_token.to_owned())),
            _ => Err(SignInError::Provider(format!(
                "the identity provider's token endpoint answered {status} without an ID token; is the `openid` scope allowed for client {}?",
                self.client_id
            ))),
        }
    }

    /// Starts a device sign-in at the provider: its JSON answer.
    pub(crate) async fn device_authorization(&self) -> Result<Map<String, Value>, SignInError> {
        let Some(endpoint) = &self.device_endpoint else {
            return Err(SignInError::Provider(
                "the identity provider offers no device sign-in (its discovery document has no device_authorization_endpoint); sign in to the Control UI instead".into(),
            ));
        };
        let (status, answer) = self
            .post_form(
                endpoint,
                &[("client_id", &self.client_id), ("scope", SCOPES)],
            )
            .await?;
        if let Some(error) = answer.get("error").and_then(Value::as_str) {
            return Err(SignInError::Refused(describe(
                error,
                answer.get("error_description").and_then(Value::as_str),
            )));
        }
        if !status.is_success() {
            return Err(SignInError::Provider(format!(
                "the identity provider answered {status} to the device sign-in"
            )));
        }
        Ok(answer)
    }

    /// The claims of `id_token` once its signature, issuer, audience and expiry check out, and
    /// its nonce is `nonce` when the sign-in sent one.
    pub(crate) async fn verify(
        &self,
        id_token: &str,
        nonce: Option<&str>,
    ) -> Result<Map<String, Value>, SignInError> {
        let claims = self
            .jwks
            .verify(id_token, &self.issuer, &self.client_id)
            .await
            .map_err(|why| SignInError::Token(why.to_string()))?;
        if let Some(nonce) = nonce {
            let carried = claims.get("nonce").and_then(Value::as_str);
            // Compared as hashes: equal length, constant time.
            let same = carried
                .is_some_and(|c| blake3::hash(c.as_bytes()) == blake3::hash(nonce.as_bytes()));
            if !same {
                return Err(SignInError::Token(
                    "its nonce is not the one this sign-in started with (a replayed or foreign token)".into(),
                ));
            }
        }
        Ok(claims)
    }

    /// The person `claims` name: their verified email, which must be in an allowed domain.
    pub(crate) fn email(&self, claims: &Map<String, Value>) -> Result<String, SignInError> {
        let email = match claims.get("email") {
            Some(Value::String(e)) if e.contains('@') => e.trim().to_owned(),
            _ => {
                return Err(SignInError::NotAllowed(
                    "the identity provider sent no email for you: the gateway asks for the `email` scope; ask the provider's admin to release it to this client".into(),
                ));
            }
        };
        let verified = matches!(claims.get("email_verified"), Some(Value::Bool(true)))
            || matches!(claims.get("email_verified"), Some(Value::String(s)) if s == "true");
        if !verified {
            return Err(SignInError::NotAllowed(format!(
                "the identity provider does not say {email} is verified; verify it there, then sign in again"
            )));
        }
        let domain = email
            .rsplit_once('@')
            .map(|(_, d)| d.to_ascii_lowercase())
            .unwrap_or_default();
        if !self.allowed_domains.contains(&domain) {
            return Err(SignInError::NotAllowed(format!(
                "{email} is not in a domain allowed to sign in to this gateway ({}); sign in with an address in one of them",
                self.allowed_domains.join(", ")
            )));
        }
        Ok(email)
    }

    /// The Skiff user `email` is; created with the mapped role when the mapping says so.
    pub(crate) fn user(
        &self,
        core: &Core,
        email: &str,
        claims: &Map<String, Value>,
    ) -> Result<UserRow, SignInError> {
        let internal = |e: skiff_store::Error| {
            tracing::error!(error = %e, "cannot look up the user an ID token names");
            SignInError::Internal("cannot look up your user; see the gateway log".into())
        };
        // Providers keep the case a person typed; users are usually added in lower case.
        let lower = email.to_ascii_lowercase();
        for candidate in [email, lower.as_str()] {
            match core.store.user_by_email(candidate, None) {
                Ok(user) => return Ok(user),
                Err(skiff_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(internal(e)),
            }
        }
        let unknown = || {
            SignInError::NotAllowed(format!(
                "{email} signed in at the identity provider but is not a Skiff user: ask an admin to run `skiff admin user add {email} --role member`"
            ))
        };
        let Some(roles) = self.roles.as_ref().filter(|r| r.create_users) else {
            return Err(unknown());
        };
        let Some(role) = mapped_role(roles, claims) else {
            return Err(unknown());
        };
        let tenant = roles.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        let user = core.store.add_user(email, role, tenant).map_err(internal)?;
        core.audit(
            &user.scope(),
            "user.add",
            &user.id,
            "applied",
            json!({ "by": "sso", "role": user.role, "tenant": user.tenant_id }),
        );
        Ok(user)
    }
}

/// The highest role the mapping gives the values of the role claim (a string or a list).
fn mapped_role(roles: &RoleMapping, claims: &Map<String, Value>) -> Option<Role> {
    let values: Vec<&str> = match claims.get(&roles.claim) {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    values
        .into_iter()
        .filter_map(|v| roles.map.get(v).copied())
        .max()
}

/// An OAuth error for a person: its code and the provider's description.
pub(crate) fn describe(error: &str, description: Option<&str>) -> String {
    match description {
        Some(d) if !d.is_empty() => format!("{error} ({d})"),
        _ => error.to_owned(),
    }
}

/// A reqwest error without the URL it carries (a URL may hold a code in its query).
fn without_url(e: &reqwest::Error) -> String {
    let mut message = e.to_string();
    if let Some(url) = e.url() {
        message = message.replace(url.as_str(), "the endpoint");
    }
    message
}

/// `application/x-www-form-urlencoded` for one name or value.
pub(crate) fn form_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'*' => {
                out.push(char::from(b));
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A fresh random string of `parts` × 16 base32 characters (80 bits each).
pub(crate) fn random(parts: usize) -> Result<String, SignInError> {
    let mut out = String::new();
    for _ in 0..parts {
        out.push_str(&skiff_store::mint().map_err(|e| SignInError::Internal(e.to_string()))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_mapped_role_wins_and_unmapped_values_give_none() {
        let roles = RoleMapping {
            claim: "groups".into(),
            map: [
                ("eng".to_owned(), Role::Member),
                ("ops".to_owned(), Role::Operator),
            ]
            .into_iter()
            .collect(),
            create_users: true,
            tenant: None,
        };
        let claims = |v: Value| json!({ "groups": v }).as_object().unwrap().clone();
        assert_eq!(
            mapped_role(&roles, &claims(json!(["eng", "ops", "x"]))),
            Some(Role::Operator)
        );
        assert_eq!(
            mapped_role(&roles, &claims(json!("eng"))),
            Some(Role::Member)
        );
        assert_eq!(mapped_role(&roles, &claims(json!(["sales"]))), None);
        assert_eq!(mapped_role(&roles, &Map::new()), None);
    }

    use skiff_test_support::oidc_provider::{
        Browser, Choice, OidcAccount, OidcApp, OidcProvider, OidcSetup, Stop,
    };

    fn app(id: &str) -> OidcApp {
        OidcApp {
            client_id: id.to_owned(),
            client_secret: format!("{id}-secret-0123456789"),
        }
    }

    async fn idp(apps: &[&str]) -> OidcProvider {
        OidcProvider::start_with(&OidcSetup {
            apps: apps.iter().map(|a| app(a)).collect(),
            accounts: vec![OidcAccount::verified("ana@example.com")],
            ..OidcSetup::default()
        })
        .await
    }

    /// An ID token `provider` issues `client` for ana, by the code flow (no PKCE is needed for
    /// a client with a secret).
    async fn id_token(provider: &OidcProvider, client: &str) -> String {
        let redirect = "http://127.0.0.1:1/auth/callback";
        let start = format!(
            "{}/auth?response_type=code&client_id={client}&scope=openid%20email&nonce=n&state=s&redirect_uri={}",
            provider.issuer,
            form_encode(redirect)
        );
        let back = tokio::task::spawn_blocking(move || {
            match Browser::new().follow(&start, &Choice::Account("ana@example.com".into()), |u| {
                u.starts_with("http://127.0.0.1:1/")
            }) {
                Stop::At(url) => url,
                Stop::Page(page) => panic!("{page:?}"),
            }
        })
        .await
        .unwrap();
        let code = back
            .split(['?', '&'])
            .find_map(|p| p.strip_prefix("code="))
            .unwrap()
            .to_owned();
        let answer: Value = reqwest::Client::new()
            .post(format!("{}/token", provider.issuer))
            .basic_auth(client, Some(format!("{client}-secret-0123456789")))
            .form(&[
                ("grant_type", "authorization_code"),
                ("code", &code),
                ("redirect_uri", redirect),
            ])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        answer["id_token"].as_str().unwrap().to_owned()
    }

    /// The gateway's check of an ID token against real tokens: its own provider's for it
    /// passes; one for another client of that provider, and one from another provider (another
    /// signer) under the same client id, are refused naming why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_configured_providers_tokens_for_this_client_pass() {
        let ours = idp(&["skiff", "other-app"]).await;
        let elsewhere = idp(&["skiff"]).await;
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(skiff_store::Store::open(&dir.path().join("skiff.db")).unwrap());
        let vault = Arc::new(crate::vault::Vault::new(store, dir.path(), None));
        vault.set("oidc", "skiff-secret-0123456789").unwrap();
        let config = OidcConfig {
            issuer: ours.issuer.clone(),
            client_id: "skiff".into(),
            client_secret: "vault:oidc".into(),
            allowed_domains: vec!["example.com".into()],
            redirect_uri: None,
            token_lifetime: None,
            roles: None,
        };
        let oidc = Oidc::from_config(&config, vault).await.unwrap();

        let good = id_token(&ours, "skiff").await;
        let claims = oidc.verify(&good, None).await.unwrap();
        assert_eq!(oidc.email(&claims).unwrap(), "ana@example.com");
        let err = oidc.verify(&good, Some("another-nonce")).await.unwrap_err();
        assert!(err.to_string().contains("nonce is not the one"), "{err}");

        let other_client = id_token(&ours, "other-app").await;
        let err = oidc.verify(&other_client, None).await.unwrap_err();
        assert!(
            err.to_string().contains("not meant for this gateway"),
            "{err}"
        );

        let foreign = id_token(&elsewhere, "skiff").await;
        let err = oidc.verify(&foreign, None).await.unwrap_err();
        assert!(
            err.to_string().contains("is not one of the issuer's keys"),
            "{err}"
        );
        assert!(!err.to_string().contains("eyJ"), "{err}");
    }

    #[test]
    fn form_encoding_escapes_everything_but_the_unreserved() {
        assert_eq!(form_encode("a b&c=d/é"), "a+b%26c%3Dd%2F%C3%A9");
        assert_eq!(form_encode("skiff-ui_1.0"), "skiff-ui_1.0");
    }
}
