//! Access-proxy mode (`[auth.proxy]`): an identity-aware proxy signs an assertion about the
//! person onto every request it forwards, and the gateway believes nothing else.
//!
//! Every authenticated request must carry the assertion in the configured header; it must be
//! signed (RS256/ES256) by a key of the proxy's JWKS, issued by the configured issuer for the
//! configured audience, unexpired, and name exactly one verified email, which must be a user's.
//! **Invariant:** with the mode on, a bearer token or a UI cookie authenticates nothing: the
//! assertion is checked first and alone, so a leaked token cannot go around the proxy.

use super::ProxyConfig;
use super::jwks::{Jwks, Source};
use crate::Core;
use axum::Json;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use skiff_protocol::api::{ApiError, ErrorCode};
use skiff_protocol::people::TokenScope;
use skiff_store::{Scope, UserRow};
use std::path::Path;

/// The configured proxy: its keys and what its assertions must say.
pub(crate) struct Proxy {
    jwks: Jwks,
    issuer: String,
    audience: String,
    header: HeaderName,
    /// The header as the operator spelled it, for messages.
    header_name: String,
    email_claim: String,
}

/// A refused request: what the caller is told (and the audit records).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    pub code: ErrorCode,
    pub message: String,
}

impl Refused {
    fn unauthorized(message: String) -> Refused {
        Refused {
            code: ErrorCode::Unauthorized,
            message,
        }
    }
}

impl Proxy {
    /// Checks `[auth.proxy]` and reads the proxy's keys; the message names the key at fault.
    pub(crate) async fn from_config(
        config_path: &Path,
        config: &ProxyConfig,
    ) -> Result<Proxy, String> {
        let header = HeaderName::from_bytes(config.header.trim().as_bytes()).map_err(|_| {
            format!(
                "at `auth.proxy.header`: {:?} is not an HTTP header name",
                config.header
            )
        })?;
        for (key, value) in [("issuer", &config.issuer), ("audience", &config.audience)] {
            if value.trim().is_empty() {
                return Err(format!(
                    "at `auth.proxy.{key}`: empty; set the value your proxy puts in its assertions' `{}`",
                    if key == "issuer" { "iss" } else { "aud" }
                ));
            }
        }
        let source = if config.jwks.starts_with("https://") || config.jwks.starts_with("http://") {
            Source::Url(config.jwks.clone())
        } else {
            let dir = config_path.parent().unwrap_or(Path::new("."));
            Source::File(dir.join(&config.jwks))
        };
        let jwks = Jwks::load(source)
            .await
            .map_err(|e| format!("at `auth.proxy.jwks`: {e}"))?;
        Ok(Proxy {
            jwks,
            issuer: config.issuer.clone(),
            audience: config.audience.clone(),
            header,
            header_name: config.header.trim().to_owned(),
            email_claim: config
                .email_claim
                .clone()
                .unwrap_or_else(|| "email".to_owned()),
        })
    }

    /// The user a request's assertion names, or why there is none.
    pub(crate) async fn user(&self, core: &Core, headers: &HeaderMap) -> Result<UserRow, Refused> {
        let values: Vec<_> = headers.get_all(&self.header).iter().collect();
        let assertion = match values.as_slice() {
            [] => {
                return Err(Refused::unauthorized(format!(
                    "no identity assertion: this gateway only answers requests its identity-aware proxy forwards (it sends the `{}` header); reach it through the proxy",
                    self.header_name
                )));
            }
            [one] => one.to_str().unwrap_or_default().trim(),
            _ => {
                return Err(Refused::unauthorized(format!(
                    "more than one `{}` header: send exactly one identity assertion",
                    self.header_name
                )));
            }
        };
        let claims = self
            .jwks
            .verify(assertion, &self.issuer, &self.audience)
            .await
            .map_err(|why| {
                Refused::unauthorized(format!("the identity assertion is refused: {why}"))
            })?;
        let email = one_verified_email(&claims, &self.email_claim).map_err(|why| {
            Refused::unauthorized(format!("the identity assertion is refused: {why}"))
        })?;
        match core.store.user_by_email(&email, None) {
            Ok(user) => Ok(user),
            Err(skiff_store::Error::NotFound { .. }) => Err(Refused {
                code: ErrorCode::Forbidden,
                message: format!(
                    "{email} signed in through the proxy but is not a Skiff user: ask an admin to run `skiff admin user add {email} --role member`"
                ),
            }),
            Err(e) => {
                tracing::error!(error = %e, "cannot look up the user an assertion names");
                Err(Refused {
                    code: ErrorCode::Internal,
                    message: "cannot look up your user; see the gateway log".to_owned(),
                })
            }
        }
    }
}

/// The one email `claim` holds, if the assertion does not say it is unverified. A list of
/// emails is refused even when it holds one: the proxy was configured to vouch for one person.
fn one_verified_email(claims: &Map<String, Value>, claim: &str) -> Result<String, String> {
    let email = match claims.get(claim) {
        None => return Err(format!("it has no `{claim}` claim")),
        Some(Value::String(email)) => email.trim(),
        Some(Value::Array(list)) => {
            return Err(format!(
                "its `{claim}` claim holds {} values; exactly one email is accepted",
                list.len()
            ));
        }
        Some(_) => return Err(format!("its `{claim}` claim is not a string")),
    };
    let plausible = email
        .split_once('@')
        .is_some_and(|(user, domain)| !user.is_empty() && !domain.is_empty())
        && !email.contains(char::is_whitespace);
    if !plausible {
        return Err(format!("its `{claim}` claim is not an email address"));
    }
    match claims.get("email_verified") {
        None | Some(Value::Bool(true)) => Ok(email.to_owned()),
        Some(Value::String(s)) if s == "true" => Ok(email.to_owned()),
        Some(_) => Err("it says the email is not verified".to_owned()),
    }
}

/// The authentication step in access-proxy mode: the assertion's user, with their role's full
/// reach, or a refusal (audited, naming the check that failed, never the assertion).
pub(crate) async fn authenticate(
    core: &Core,
    proxy: &Proxy,
    mut req: Request,
    next: Next,
) -> Response {
    // Only the headers cross the await: a request's body is not `Sync`.
    let outcome = proxy.user(core, req.headers()).await;
    match outcome {
        Ok(user) => {
            let principal = crate::people::Principal {
                user,
                cap: TokenScope::Admin,
            };
            req.extensions_mut().insert(principal.scope());
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(refused) => {
            core.audit(
                &Scope::new("-", "-"),
                "auth",
                req.uri().path(),
                "denied",
                json!({ "mode": "proxy", "reason": refused.message }),
            );
            (
                crate::error::http_status(refused.code),
                Json(ApiError {
                    code: refused.code.as_str().to_owned(),
                    message: refused.message,
                }),
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn exactly_one_verified_email_is_accepted() {
        let ok = one_verified_email(&claims(json!({"email": "ana@example.com"})), "email");
        assert_eq!(ok.as_deref(), Ok("ana@example.com"));
        let verified = claims(json!({"email": "ana@example.com", "email_verified": true}));
        assert!(one_verified_email(&verified, "email").is_ok());

        let two = claims(json!({"email": ["ana@example.com", "bo@example.com"]}));
        let err = one_verified_email(&two, "email").unwrap_err();
        assert!(err.contains("holds 2 values"), "{err}");
        let unverified = claims(json!({"email": "ana@example.com", "email_verified": false}));
        let err = one_verified_email(&unverified, "email").unwrap_err();
        assert!(err.contains("not verified"), "{err}");
        let err = one_verified_email(&claims(json!({"sub": "x"})), "email").unwrap_err();
        assert!(err.contains("no `email` claim"), "{err}");
        let err = one_verified_email(&claims(json!({"email": "nobody"})), "email").unwrap_err();
        assert!(err.contains("not an email address"), "{err}");
    }
}
