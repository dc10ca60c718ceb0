//! `skiff login`: the device-code flow (RFC 8628), brokered by the gateway.
//!
//! `POST /v1/auth/device` asks the provider for a device code (with the gateway's client
//! credentials), keeps it under a login id of its own (stored as a hash), and answers the CLI
//! with that id, the verification URL and the user code. `POST /v1/auth/device/poll` asks the
//! provider, at most once per interval, whether the person confirmed; when they did, the ID
//! token is checked like the browser's (`oidc.rs`) and the CLI receives a Skiff token for the
//! user (stored hashed, with the configured lifetime, labelled `sso:EMAIL`). The provider's
//! device code and tokens never leave the gateway. `POST /v1/auth/logout` revokes such a token.
//! Pending sign-ins live in memory: a gateway restart ends them (the CLI says to start again).

use super::oidc::{Oidc, SignInError, TokenAnswer, describe, random};
use super::pending::{Full, make_room};
use crate::Core;
use crate::error::Error;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use skiff_protocol::login::{DeviceLoginStarted, DevicePoll, DevicePollRequest};
use skiff_protocol::people::TokenScope;
use skiff_store::{Scope, now_ms};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The most device sign-ins under way at once.
const MAX_PENDING: usize = 256;
/// RFC 8628 §3.2: the interval when the provider states none.
const DEFAULT_INTERVAL_S: u64 = 5;
/// RFC 8628 §3.5: what `slow_down` adds to the interval.
const SLOW_DOWN_S: u64 = 5;

struct Started {
    device_code: String,
    expires_at_ms: i64,
    interval_s: u64,
    /// No call to the provider before this.
    next_poll_ms: i64,
}

/// Device sign-ins under way, by the blake3 of their login id.
#[derive(Default)]
pub(crate) struct Pending {
    started: Mutex<HashMap<String, Started>>,
}

fn key(login_id: &str) -> String {
    blake3::hash(login_id.as_bytes()).to_hex().to_string()
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Started>> {
        self.started.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Evicts the expired sign-ins; `Full` when no place is free even so.
    fn make_room(&self, now: i64) -> Result<(), Full> {
        make_room(&mut self.lock(), MAX_PENDING, now, |s| s.expires_at_ms)
    }
}

/// A start refused on a full table: 503, and when to come back.
fn busy(full: Full) -> Response {
    full.retry_after(Error::Unavailable(full.message()).into_response())
}

fn refused(code: skiff_protocol::api::ErrorCode, message: String) -> Error {
    use skiff_protocol::api::ErrorCode as C;
    match code {
        C::Forbidden => Error::Forbidden(message),
        C::NotFound => Error::NotFound(message),
        C::Unauthorized => Error::Unauthorized(message),
        C::BadRequest => Error::BadRequest(message),
        _ => Error::Unavailable(message),
    }
}

fn oidc_of(core: &Core) -> Result<&Oidc, Error> {
    core.oidc.as_deref().ok_or_else(|| {
        Error::NotFound(
            "single sign-on is not configured on this gateway ([auth.oidc]); ask its admin for a token (`skiff admin token create`)".into(),
        )
    })
}

/// Audits a refusal of a device sign-in and turns it into the API's error.
fn denied(core: &Core, step: &str, e: SignInError) -> Error {
    use skiff_protocol::api::ErrorCode as C;
    core.audit(
        &Scope::new("-", "-"),
        "cli.login",
        "sso",
        "denied",
        json!({ "mode": "oidc", "step": step, "reason": e.to_string() }),
    );
    let code = match &e {
        SignInError::NotAllowed(_) => C::Forbidden,
        SignInError::Token(_) => C::Unauthorized,
        SignInError::Refused(_)
        | SignInError::Provider(_)
        | SignInError::Secret(_)
        | SignInError::Internal(_)
        | SignInError::Busy(_) => C::Unavailable,
    };
    refused(code, e.to_string())
}

/// `POST /v1/auth/device`.
pub(crate) async fn start(State(core): State<Arc<Core>>) -> Result<Response, Error> {
    let oidc = oidc_of(&core)?;
    // Before the provider is asked, and again when the sign-in is recorded.
    if let Err(full) = oidc.devices.make_room(now_ms()) {
        return Ok(busy(full));
    }
    let answer = oidc
        .device_authorization()
        .await
        .map_err(|e| denied(&core, "starting the sign-in", e))?;
    let text = |name: &str| answer.get(name).and_then(Value::as_str).map(str::to_owned);
    let (Some(device_code), Some(user_code), Some(verification_uri)) = (
        text("device_code"),
        text("user_code"),
        text("verification_uri"),
    ) else {
        return Err(denied(
            &core,
            "starting the sign-in",
            SignInError::Provider(
                "the identity provider's device answer lacks device_code, user_code or verification_uri".into(),
            ),
        ));
    };
    let expires_in = answer
        .get("expires_in")
        .and_then(Value::as_u64)
        .unwrap_or(600);
    let interval_s = answer
        .get("interval")
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_INTERVAL_S)
        .max(1);
    let now = now_ms();
    let expires_at_ms =
        now.saturating_add(i64::try_from(expires_in.saturating_mul(1000)).unwrap_or(i64::MAX));
    let login_id = random(2).map_err(|e| Error::Internal(e.to_string()))?;
    {
        let mut map = oidc.devices.lock();
        if let Err(full) = make_room(&mut map, MAX_PENDING, now, |s| s.expires_at_ms) {
            return Ok(busy(full));
        }
        map.insert(
            key(&login_id),
            Started {
                device_code,
                expires_at_ms,
                interval_s,
                next_poll_ms: now,
            },
        );
    }
    Ok((
        StatusCode::CREATED,
        Json(DeviceLoginStarted {
            login_id,
            verification_uri,
            verification_uri_complete: text("verification_uri_complete"),
            user_code,
            expires_at_ms,
            interval_s,
        }),
    )
        .into_response())
}

/// What one poll decided.
enum Next {
    Wait(u64),
    Ask(String),
}

/// `POST /v1/auth/device/poll`.
pub(crate) async fn poll(
    State(core): State<Arc<Core>>,
    body: Result<Json<DevicePollRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let oidc = oidc_of(&core)?;
    let Json(body) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = key(&body.login_id);
    let now = now_ms();
    let next = {
        let mut map = oidc.devices.lock();
        let Some(started) = map.get_mut(&id) else {
            return Err(Error::NotFound(
                "no such sign-in under way: it finished, expired, or the gateway restarted; run `skiff login` again".into(),
            ));
        };
        if started.expires_at_ms <= now {
            map.remove(&id);
            return Err(denied(
                &core,
                "waiting for the person",
                SignInError::Token(
                    "the sign-in code expired before it was confirmed; run `skiff login` again"
                        .into(),
                ),
            ));
        }
        if now < started.next_poll_ms {
            Next::Wait(started.interval_s)
        } else {
            started.next_poll_ms =
                now + i64::try_from(started.interval_s * 1000).unwrap_or(i64::MAX);
            Next::Ask(started.device_code.clone())
        }
    };
    let device_code = match next {
        Next::Wait(interval_s) => {
            return Ok(Json(DevicePoll::Pending { interval_s }).into_response());
        }
        Next::Ask(code) => code,
    };
    let answer = oidc
        .token(&[
            ("grant_type", "urn:ietf:params:oauth:grant-type:device_code"),
            ("device_code", &device_code),
            ("client_id", &oidc.client_id),
        ])
        .await
        .map_err(|e| denied(&core, "asking the identity provider", e))?;
    let id_token = match answer {
        TokenAnswer::IdToken(t) => t,
        TokenAnswer::Error(error, description) => {
            let mut map = oidc.devices.lock();
            match error.as_str() {
                "authorization_pending" | "slow_down" => {
                    let interval_s = match map.get_mut(&id) {
                        Some(s) if error == "slow_down" => {
                            s.interval_s += SLOW_DOWN_S;
                            s.next_poll_ms =
                                now_ms() + i64::try_from(s.interval_s * 1000).unwrap_or(i64::MAX);
                            s.interval_s
                        }
                        Some(s) => s.interval_s,
                        None => DEFAULT_INTERVAL_S,
                    };
                    return Ok(Json(DevicePoll::Pending { interval_s }).into_response());
                }
                _ => {
                    map.remove(&id);
                    drop(map);
                    let e = match error.as_str() {
                        "access_denied" => SignInError::NotAllowed(
                            "the sign-in was denied at the identity provider".into(),
                        ),
                        "expired_token" => SignInError::Token(
                            "the sign-in code expired before it was confirmed; run `skiff login` again".into(),
                        ),
                        _ => SignInError::Refused(describe(&error, description.as_deref())),
                    };
                    return Err(denied(&core, "waiting for the person", e));
                }
            }
        }
    };
    // Whatever follows, this device code is spent.
    oidc.devices.lock().remove(&id);
    let claims = oidc
        .verify(&id_token, None)
        .await
        .map_err(|e| denied(&core, "checking the ID token", e))?;
    let user = oidc
        .email(&claims)
        .and_then(|email| oidc.user(&core, &email, &claims))
        .map_err(|e| denied(&core, "checking who you are", e))?;
    let token = crate::auth::mint()?;
    let hash = blake3::hash(token.as_bytes()).to_hex().to_string();
    let lifetime_ms = i64::try_from(oidc.token_lifetime.as_millis()).unwrap_or(i64::MAX);
    let expires_at_ms = now_ms().saturating_add(lifetime_ms);
    let row = core.store.add_token(
        &user.scope(),
        &hash,
        &format!("{SSO_LABEL}{}", user.email),
        TokenScope::Admin,
        Some(expires_at_ms),
    )?;
    crate::people::ACTOR.sync_scope(user.email.clone(), || {
        core.audit(
            &user.scope(),
            "cli.login",
            &row.id,
            "applied",
            json!({ "mode": "oidc", "role": user.role, "expires_at_ms": expires_at_ms }),
        )
    });
    Ok(Json(DevicePoll::SignedIn {
        token,
        email: user.email.clone(),
        role: user.role,
        tenant: user.tenant_id.clone(),
        expires_at_ms,
    })
    .into_response())
}

/// The label prefix of tokens `skiff login` made.
pub(crate) const SSO_LABEL: &str = "sso:";

/// `POST /v1/auth/logout` (bearer): revokes a token `skiff login` made.
pub(crate) async fn logout(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
) -> Result<Response, Error> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or_else(|| {
            Error::Unauthorized("send the token to revoke as `Authorization: Bearer`".into())
        })?;
    let row = match core.tokens.verify(presented)? {
        crate::auth::Verified::Valid(row) | crate::auth::Verified::Expired(row) => row,
        crate::auth::Verified::Unknown => {
            return Err(Error::Unauthorized(
                "that token is not known here (already revoked?)".into(),
            ));
        }
    };
    if !row.label.starts_with(SSO_LABEL) {
        return Err(Error::BadRequest(
            "only a token from `skiff login` is revoked by logout; revoke others with `skiff admin token revoke`".into(),
        ));
    }
    let row = core.store.revoke_token(&row.id, None)?;
    core.audit(
        &row.scope,
        "cli.logout",
        &row.id,
        "applied",
        json!({ "mode": "oidc" }),
    );
    Ok(StatusCode::NO_CONTENT.into_response())
}
