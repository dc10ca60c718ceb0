//! The Control UI's single sign-on: the authorization-code flow with PKCE.
//!
//! `GET /auth/login` makes a state, a nonce and a PKCE verifier, keeps them (in memory, ten
//! minutes) under the state, binds them to this browser with a `skiff_oidc` cookie (HttpOnly,
//! `SameSite=Lax` so that it comes back on the provider's redirect, path `/auth`), and
//! redirects to the provider with the state, the nonce and the S256 challenge.
//! `GET /auth/callback` takes the state back (once), checks the browser's binding, exchanges
//! the code with the verifier, checks the ID token (`oidc.rs`: signature, issuer, audience,
//! expiry, nonce; a verified email in an allowed domain; a Skiff user) and sets the same
//! `skiff_session` cookie `/ui/login` sets. A failure is a page that says which step failed
//! and what to do, never quoting a code or a token; logins and refusals are audited (metadata).

use super::oidc::{Oidc, SignInError, TokenAnswer, describe, random};
use super::pending::{Full, make_room};
use crate::Core;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use skiff_store::{Scope, now_ms};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How long a started sign-in may take.
const PENDING_TTL_MS: i64 = 10 * 60 * 1000;
/// The most sign-ins under way at once (the route is public: a flood cannot grow the map).
const MAX_PENDING: usize = 1024;
/// The cookie that binds a sign-in to the browser that started it.
const BINDING_COOKIE: &str = "skiff_oidc";

/// One browser sign-in under way.
struct Started {
    nonce: String,
    verifier: String,
    /// blake3 of the `skiff_oidc` cookie value.
    binding: blake3::Hash,
    redirect_uri: String,
    at_ms: i64,
}

/// Browser sign-ins under way, by state.
#[derive(Default)]
pub(crate) struct Pending {
    started: Mutex<HashMap<String, Started>>,
}

impl Pending {
    fn insert(&self, state: String, started: Started) -> Result<(), Full> {
        let mut map = self.started.lock().unwrap_or_else(|p| p.into_inner());
        make_room(&mut map, MAX_PENDING, now_ms(), |s| {
            s.at_ms.saturating_add(PENDING_TTL_MS)
        })?;
        map.insert(state, started);
        Ok(())
    }

    /// Takes the sign-in `state` names, once, if it is not too old.
    fn take(&self, state: &str) -> Option<Started> {
        let mut map = self.started.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(state)
            .filter(|s| now_ms() - s.at_ms < PENDING_TTL_MS)
    }
}

/// Which step of the sign-in failed, for the page and the audit.
#[derive(Clone, Copy)]
enum Step {
    Start,
    Provider,
    State,
    Exchange,
    IdToken,
    Person,
}

impl Step {
    fn as_str(self) -> &'static str {
        match self {
            Step::Start => "starting the sign-in",
            Step::Provider => "signing in at the identity provider",
            Step::State => "matching the provider's answer to this browser's sign-in",
            Step::Exchange => "exchanging the code for tokens",
            Step::IdToken => "checking the ID token",
            Step::Person => "checking who you are",
        }
    }
}

/// `GET /auth/login`: off to the provider.
pub(crate) async fn login(State(core): State<Arc<Core>>, headers: HeaderMap) -> Response {
    let Some(oidc) = core.oidc.as_deref() else {
        return not_configured();
    };
    match start(oidc, &headers) {
        Ok((location, cookie)) => {
            let mut resp = Redirect::to(&location).into_response();
            resp.headers_mut().append(header::SET_COOKIE, cookie);
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        Err(e) => {
            let resp = failure(&core, Step::Start, StatusCode::SERVICE_UNAVAILABLE, &e);
            match e {
                SignInError::Busy(full) => full.retry_after(resp),
                _ => resp,
            }
        }
    }
}

/// The provider's authorization URL for a fresh sign-in, and the cookie binding it here.
fn start(oidc: &Oidc, headers: &HeaderMap) -> Result<(String, HeaderValue), SignInError> {
    let state = random(2)?;
    let nonce = random(2)?;
    let verifier = random(3)?;
    let binding = random(2)?;
    let redirect_uri = redirect_uri(oidc, headers)?;
    let challenge = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(Sha256::digest(verifier.as_bytes()));
    let mut url = reqwest::Url::parse(&oidc.authorization_endpoint).map_err(|e| {
        SignInError::Provider(format!("the provider's authorization endpoint: {e}"))
    })?;
    url.query_pairs_mut()
        .append_pair("response_type", "code")
        .append_pair("client_id", &oidc.client_id)
        .append_pair("redirect_uri", &redirect_uri)
        .append_pair("scope", "openid email profile")
        .append_pair("state", &state)
        .append_pair("nonce", &nonce)
        .append_pair("code_challenge", &challenge)
        .append_pair("code_challenge_method", "S256");
    let started = Started {
        nonce,
        verifier,
        binding: blake3::hash(binding.as_bytes()),
        redirect_uri,
        at_ms: now_ms(),
    };
    oidc.browsers
        .insert(state, started)
        .map_err(SignInError::Busy)?;
    let cookie = format!(
        "{BINDING_COOKIE}={binding}; HttpOnly; SameSite=Lax; Path=/auth; Max-Age={}{}",
        PENDING_TTL_MS / 1000,
        secure(headers)
    );
    let cookie = HeaderValue::from_str(&cookie)
        .map_err(|_| SignInError::Internal("cannot make the sign-in cookie".into()))?;
    Ok((url.to_string(), cookie))
}

fn secure(headers: &HeaderMap) -> &'static str {
    if crate::ui::over_https(headers) {
        "; Secure"
    } else {
        ""
    }
}

/// The configured redirect URI, or `/auth/callback` under the address the browser used.
fn redirect_uri(oidc: &Oidc, headers: &HeaderMap) -> Result<String, SignInError> {
    if let Some(uri) = &oidc.redirect_uri {
        return Ok(uri.clone());
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.is_empty() && !h.contains(['/', '@', ' ']))
        .ok_or_else(|| {
            SignInError::Provider(
                "the request names no Host, so the gateway cannot tell the provider where to send you back; set `redirect_uri` under [auth.oidc]".into(),
            )
        })?;
    let scheme = if crate::ui::over_https(headers) {
        "https"
    } else {
        "http"
    };
    Ok(format!("{scheme}://{host}/auth/callback"))
}

#[derive(Deserialize)]
pub(crate) struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

/// `GET /auth/callback`: the provider sends the browser back here.
pub(crate) async fn callback(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    Query(q): Query<CallbackQuery>,
) -> Response {
    let Some(oidc) = core.oidc.as_deref() else {
        return not_configured();
    };
    // The state first: an answer this browser did not ask for is not read any further.
    let started = q.state.as_deref().and_then(|s| oidc.browsers.take(s));
    let Some(started) = started else {
        return failure(
            &core,
            Step::State,
            StatusCode::BAD_REQUEST,
            &SignInError::NotAllowed(
                "this answer does not match a sign-in this gateway started: it was already used, is older than ten minutes, or was never started here".into(),
            ),
        );
    };
    let bound = crate::ui::cookie_value(&headers, BINDING_COOKIE)
        .is_some_and(|v| blake3::hash(v.as_bytes()) == started.binding);
    if !bound {
        return failure(
            &core,
            Step::State,
            StatusCode::BAD_REQUEST,
            &SignInError::NotAllowed(
                "this sign-in was started in another browser (or its cookies are blocked)".into(),
            ),
        );
    }
    if let Some(error) = &q.error {
        let status = if error == "access_denied" {
            StatusCode::FORBIDDEN
        } else {
            StatusCode::BAD_GATEWAY
        };
        return failure(
            &core,
            Step::Provider,
            status,
            &SignInError::Refused(describe(error, q.error_description.as_deref())),
        );
    }
    let Some(code) = q.code.as_deref().filter(|c| !c.is_empty()) else {
        return failure(
            &core,
            Step::Provider,
            StatusCode::BAD_REQUEST,
            &SignInError::Provider("the identity provider sent you back without a code".into()),
        );
    };
    let answer = oidc
        .token(&[
            ("grant_type", "authorization_code"),
            ("code", code),
            ("redirect_uri", &started.redirect_uri),
            ("code_verifier", &started.verifier),
        ])
        .await;
    let id_token = match answer {
        Ok(TokenAnswer::IdToken(t)) => t,
        Ok(TokenAnswer::Error(error, description)) => {
            return failure(
                &core,
                Step::Exchange,
                StatusCode::BAD_GATEWAY,
                &SignInError::Refused(describe(&error, description.as_deref())),
            );
        }
        Err(e) => return failure(&core, Step::Exchange, StatusCode::BAD_GATEWAY, &e),
    };
    let claims = match oidc.verify(&id_token, Some(&started.nonce)).await {
        Ok(c) => c,
        Err(e) => return failure(&core, Step::IdToken, StatusCode::UNAUTHORIZED, &e),
    };
    let user = match oidc
        .email(&claims)
        .and_then(|email| oidc.user(&core, &email, &claims))
    {
        Ok(u) => u,
        Err(e) => return failure(&core, Step::Person, StatusCode::FORBIDDEN, &e),
    };
    let cookie = match crate::ui::session_cookie(&core, &user.scope(), &headers) {
        Ok(c) => c,
        Err(resp) => return *resp,
    };
    crate::people::ACTOR.sync_scope(user.email.clone(), || {
        core.audit(
            &user.scope(),
            "ui.login",
            "sso",
            "applied",
            json!({ "mode": "oidc", "role": user.role }),
        )
    });
    let mut resp = Redirect::to("/").into_response();
    resp.headers_mut().append(header::SET_COOKIE, cookie);
    if let Ok(clear) = HeaderValue::from_str(&format!(
        "{BINDING_COOKIE}=; HttpOnly; SameSite=Lax; Path=/auth; Max-Age=0{}",
        secure(&headers)
    )) {
        resp.headers_mut().append(header::SET_COOKIE, clear);
    }
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn not_configured() -> Response {
    page(
        StatusCode::NOT_FOUND,
        "Single sign-on is not configured",
        "This gateway has no [auth.oidc] section, so there is no identity provider to sign in with.",
        "Run `skiff ui` on the gateway host for a one-time login link, or paste a token on the login page.",
    )
}

/// The page for a failed step, after the audit row (the reason, never a code or token).
fn failure(core: &Core, step: Step, status: StatusCode, e: &SignInError) -> Response {
    core.audit(
        &Scope::new("-", "-"),
        "ui.login",
        "sso",
        "denied",
        json!({ "mode": "oidc", "step": step.as_str(), "reason": e.to_string() }),
    );
    let todo = match e {
        SignInError::Secret(_) | SignInError::Internal(_) => {
            "Tell the gateway's admin; the gateway log has the cause."
        }
        SignInError::NotAllowed(_) => {
            "Sign in again with an account this gateway accepts, or ask its admin for access."
        }
        SignInError::Refused(_) | SignInError::Token(_) | SignInError::Provider(_) => {
            "Start the sign-in again; if it keeps failing, tell the gateway's admin."
        }
        SignInError::Busy(_) => "Wait that long, then sign in again.",
    };
    page(
        status,
        &format!("Sign-in failed while {}", step.as_str()),
        &e.to_string(),
        todo,
    )
}

/// A plain page in the UI's style: what happened, what to do, a way back.
fn page(status: StatusCode, title: &str, what: &str, todo: &str) -> Response {
    let body = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>Skiff — {title}</title><link rel=\"icon\" href=\"/assets/icon.svg\" type=\"image/svg+xml\">\
         <link rel=\"stylesheet\" href=\"/assets/app.css\"></head>\
         <body><div class=\"login\"><main class=\"login-card\" id=\"sso-error\">\
         <h1>{title}</h1><p class=\"form-error\" role=\"alert\">{what}</p><p>{todo}</p>\
         <p><a class=\"button\" href=\"/auth/login\">Sign in with SSO again</a> \
         <a href=\"/\">Back to Skiff</a></p></main></div></body></html>\n",
        title = escape(title),
        what = escape(what),
        todo = escape(todo),
    );
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `GET /auth/methods`: whether the login page offers "Sign in with SSO".
pub(crate) async fn methods(State(core): State<Arc<Core>>) -> Response {
    axum::Json(skiff_protocol::login::AuthMethods {
        sso: core.oidc.is_some(),
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_escapes_what_the_provider_said() {
        assert_eq!(
            escape("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
    }
}
