//! The Control UI's edge of the gateway: its static files, browser login (a one-use ticket or
//! the admin token, traded for an HttpOnly `SameSite=Strict` session cookie), logout, and the
//! cross-site checks for cookie-authenticated requests.
//!
//! The UI itself talks only to the public API that the CLI uses. Deliberately absent: any
//! UI-only data route, and any way for a page to see a token (the cookie is HttpOnly; a ticket
//! leaves the URL with the redirect that trades it).

mod assets;
mod cookie;
mod tickets;

pub(crate) use assets::security_headers;

use crate::Core;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::json;
use skiff_protocol::api::{ApiError, ErrorCode, UiLoginRequest, UiTicket};
use skiff_store::Scope;
use skiff_store::now_ms;
use std::sync::Arc;

type Shared = State<Arc<Core>>;

/// What the UI needs on [`Core`].
#[derive(Default)]
pub(crate) struct UiState {
    tickets: tickets::Tickets,
    cookies: cookie::Cookies,
}

impl UiState {
    /// Called once the admin token is known: cookies are signed with a key derived from it.
    pub(crate) fn set_key(&self, admin_token: &str) {
        self.cookies.set_key(admin_token);
    }
}

/// A cookie that is ours, unexpired and not logged out (the store keeps logouts across
/// restarts). A store that cannot answer refuses the cookie: the browser logs in again.
fn valid_cookie(core: &Core, value: &str, now: i64) -> Option<cookie::Verified> {
    let verified = core.ui.cookies.verify(value, now)?;
    match core
        .store
        .ui_cookie_revoked(&verified.scope, &verified.nonce_hash())
    {
        Ok(false) => Some(verified),
        Ok(true) => None,
        Err(e) => {
            tracing::error!(error = %e, "cannot check a UI cookie against the logouts; refusing it");
            None
        }
    }
}

/// Routes anyone may reach: the page, its files, and login/logout (which check for themselves).
pub(crate) fn public_routes() -> Router<Arc<Core>> {
    Router::new()
        .route("/", get(assets::index))
        .route("/assets/{name}", get(assets::asset))
        .route("/ui/login", get(login_with_ticket).post(login_with_token))
        .route("/ui/logout", post(logout))
}

/// Routes behind the API's authentication.
pub(crate) fn api_routes() -> crate::people::Routes {
    crate::people::Routes::new().route("/v1/ui/tickets", post(mint_ticket))
}

/// Why a token narrower than its user's role cannot sign in to the Control UI.
const NARROW_TOKEN: &str = "this token's scope is narrower than your role, and the Control UI signs you in with your role's full reach: use a token whose --scope covers your role (`skiff admin token create --scope admin`)";

/// Why no one-time link or token signs a browser in behind an identity-aware proxy.
const PROXY_ONLY: &str = "this gateway is behind an identity-aware proxy (`[auth.proxy]`), the only way in: open the Control UI through the proxy, which signs you in; one-time links (`skiff ui`) and tokens do not";

/// In access-proxy mode, the refusal of `action` (a ticket minted, a login by `how`), audited
/// under `scope`; `None` otherwise.
fn proxy_only(core: &Core, scope: &Scope, action: &str, how: &str) -> Option<Response> {
    core.proxy.as_ref()?;
    core.audit(
        scope,
        action,
        how,
        "denied",
        json!({ "reason": "access-proxy mode" }),
    );
    Some(refuse(ErrorCode::Forbidden, PROXY_ONLY))
}

/// How a request without a bearer token fared with its cookie.
pub(crate) enum CookieAuth {
    /// No `skiff_session` cookie, or one that is not (or no longer) valid.
    Missing,
    Scope(Scope),
    /// A valid cookie on a request that may come from another site; refuse it.
    CrossSite(&'static str),
}

/// Authenticates a request by its session cookie. A state-changing request (anything but GET
/// and HEAD) must carry an `Origin` naming this gateway; any request that carries a foreign
/// `Origin` (a cross-site WebSocket, say) is refused whatever its method.
pub(crate) fn cookie_auth(core: &Core, req: &Request) -> CookieAuth {
    let Some(value) = cookie::from_headers(req.headers()) else {
        return CookieAuth::Missing;
    };
    let Some(scope) = valid_cookie(core, &value, now_ms()).map(|v| v.scope) else {
        return CookieAuth::Missing;
    };
    let safe = matches!(*req.method(), Method::GET | Method::HEAD);
    match same_origin(req.headers()) {
        Origin::Same => CookieAuth::Scope(scope),
        Origin::Absent if safe => CookieAuth::Scope(scope),
        Origin::Absent => {
            CookieAuth::CrossSite("no Origin header on a cookie-authenticated change")
        }
        Origin::Foreign => CookieAuth::CrossSite("Origin is not this gateway"),
    }
}

enum Origin {
    Same,
    Absent,
    Foreign,
}

/// Compares `Origin` with the `Host` the browser addressed. The gateway may be reached under
/// several names (127.0.0.1, localhost, a forwarded port), so its "own origin" is the one the
/// request was sent to; a page elsewhere cannot make its browser send our cookie *and* an
/// `Origin` naming our host, because the cookie is host-bound and SameSite=Strict.
fn same_origin(headers: &HeaderMap) -> Origin {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Origin::Absent;
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin = origin.to_str().ok();
    match (origin, host) {
        (Some(origin), Some(host))
            if origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                == Some(host) =>
        {
            Origin::Same
        }
        _ => Origin::Foreign,
    }
}

/// The value of the cookie `name` among a request's `Cookie` headers.
pub(crate) fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    cookie::named(headers, name)
}

fn refuse(code: ErrorCode, message: &str) -> Response {
    (
        crate::error::http_status(code),
        Json(ApiError {
            code: code.as_str().to_owned(),
            message: message.to_owned(),
        }),
    )
        .into_response()
}

fn anonymous() -> Scope {
    Scope::new("-", "-")
}

/// Whether the browser reached the gateway over HTTPS: a TLS-terminating proxy in front says so
/// (`X-Forwarded-Proto: https`, or `Forwarded: proto=https`), or the page's `Origin` is https.
/// A forged header costs nothing: `Secure` only keeps the cookie off plain HTTP.
pub(crate) fn over_https(headers: &HeaderMap) -> bool {
    let first = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(',').next())
            .map(|v| v.trim().to_ascii_lowercase())
    };
    first("x-forwarded-proto").is_some_and(|p| p == "https")
        || first("forwarded").is_some_and(|f| f.split(';').any(|pair| pair.trim() == "proto=https"))
        || first("origin").is_some_and(|o| o.starts_with("https://"))
}

/// The attributes every `skiff_session` cookie carries; `Secure` whenever the browser came over
/// HTTPS (on plain-HTTP loopback a Secure cookie would never be sent back).
fn cookie_attributes(headers: &HeaderMap) -> &'static str {
    if over_https(headers) {
        "HttpOnly; SameSite=Strict; Path=/; Secure"
    } else {
        "HttpOnly; SameSite=Strict; Path=/"
    }
}

/// `Set-Cookie` for a fresh browser session, or the answer explaining why there is none.
pub(crate) fn session_cookie(
    core: &Core,
    scope: &Scope,
    headers: &HeaderMap,
) -> Result<HeaderValue, Box<Response>> {
    let failed = || {
        Box::new(refuse(
            ErrorCode::Internal,
            "cannot start a browser session; see the gateway log",
        ))
    };
    let value = core.ui.cookies.mint(scope, now_ms()).map_err(|e| {
        tracing::error!(error = %e, "cannot mint a UI session cookie");
        failed()
    })?;
    let header = format!(
        "{}={value}; {}; Max-Age={}",
        cookie::COOKIE_NAME,
        cookie_attributes(headers),
        cookie::COOKIE_TTL_MS / 1000
    );
    HeaderValue::from_str(&header).map_err(|_| failed())
}

/// `POST /v1/ui/tickets` (bearer): a one-use login link for `skiff ui`.
async fn mint_ticket(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Extension(principal): Extension<crate::people::Principal>,
) -> Response {
    if let Some(refused) = proxy_only(&core, &scope, "ui.ticket", "-") {
        return refused;
    }
    if !principal.full_reach() {
        core.audit(
            &scope,
            "ui.ticket",
            "-",
            "denied",
            json!({ "reason": "narrow token" }),
        );
        return refuse(ErrorCode::Forbidden, NARROW_TOKEN);
    }
    match core.ui.tickets.mint(&scope, now_ms()) {
        Ok((ticket, expires_at_ms)) => {
            core.audit(&scope, "ui.ticket", "-", "applied", json!({}));
            let login_path = format!("/ui/login?ticket={ticket}");
            (
                StatusCode::CREATED,
                Json(UiTicket {
                    ticket,
                    login_path,
                    expires_at_ms,
                }),
            )
                .into_response()
        }
        Err(e) => crate::Error::Store(e).into_response(),
    }
}

#[derive(Deserialize)]
struct TicketQuery {
    ticket: Option<String>,
}

/// `GET /ui/login?ticket=…`: trades the ticket (once) for a cookie and redirects to the UI, so
/// the ticket leaves the address bar and the history at once.
async fn login_with_ticket(
    State(core): Shared,
    headers: HeaderMap,
    Query(q): Query<TicketQuery>,
) -> Response {
    if let Some(refused) = proxy_only(&core, &anonymous(), "ui.login", "ticket") {
        return refused;
    }
    let scope = q
        .ticket
        .as_deref()
        .and_then(|t| core.ui.tickets.redeem(t, now_ms()));
    let Some(scope) = scope else {
        core.audit(
            &anonymous(),
            "ui.login",
            "ticket",
            "denied",
            json!({ "reason": "unknown, used or expired ticket" }),
        );
        // The page explains and offers the token form.
        return Redirect::to("/#login-expired").into_response();
    };
    let cookie = match session_cookie(&core, &scope, &headers) {
        Ok(c) => c,
        Err(resp) => return *resp,
    };
    core.audit(&scope, "ui.login", "ticket", "applied", json!({}));
    let mut resp = Redirect::to("/").into_response();
    resp.headers_mut().insert(header::SET_COOKIE, cookie);
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// `POST /ui/login` with `{token}` as JSON: a cookie for the token's scope. (JSON only: a
/// cross-site form cannot send it without a CORS preflight, which the gateway never grants.)
async fn login_with_token(
    State(core): Shared,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(refused) = proxy_only(&core, &anonymous(), "ui.login", "token") {
        return refused;
    }
    if !matches!(same_origin(&headers), Origin::Same) {
        core.audit(
            &anonymous(),
            "ui.login",
            "token",
            "denied",
            json!({ "reason": "cross-site or Origin-less login" }),
        );
        return refuse(ErrorCode::Forbidden, "log in from the gateway's own page");
    }
    let scope = serde_json::from_slice::<UiLoginRequest>(&body)
        .ok()
        .and_then(|p| match core.tokens.verify(p.token.trim()) {
            Ok(crate::auth::Verified::Valid(row)) => Some(row),
            Ok(crate::auth::Verified::Expired(_) | crate::auth::Verified::Unknown) => None,
            Err(e) => {
                tracing::error!(error = %e, "cannot check a login token against the store; refusing it");
                None
            }
        });
    let narrow = match &scope {
        Some(row) => matches!(
            crate::people::principal_of_token(&core, row),
            Ok(Some(p)) if !p.full_reach()
        ),
        None => false,
    };
    if narrow {
        core.audit(
            &anonymous(),
            "ui.login",
            "token",
            "denied",
            json!({ "reason": "narrow token" }),
        );
        return refuse(ErrorCode::Forbidden, NARROW_TOKEN);
    }
    let scope = scope.map(|row| row.scope);
    let Some(scope) = scope else {
        core.audit(
            &anonymous(),
            "ui.login",
            "token",
            "denied",
            json!({ "reason": "invalid token" }),
        );
        return refuse(
            ErrorCode::Unauthorized,
            "that token is not valid: the admin token is in the gateway's gateway.json, or run `skiff ui` for a login link",
        );
    };
    let cookie = match session_cookie(&core, &scope, &headers) {
        Ok(c) => c,
        Err(resp) => return *resp,
    };
    core.audit(&scope, "ui.login", "token", "applied", json!({}));
    let mut resp = StatusCode::NO_CONTENT.into_response();
    resp.headers_mut().insert(header::SET_COOKIE, cookie);
    resp
}

/// `POST /ui/logout`: revokes the cookie and tells the browser to drop it.
async fn logout(State(core): Shared, headers: HeaderMap) -> Response {
    if !matches!(same_origin(&headers), Origin::Same) {
        return refuse(ErrorCode::Forbidden, "log out from the gateway's own page");
    }
    if let Some(value) = cookie::from_headers(&headers) {
        let now = now_ms();
        if let Some(cookie) = valid_cookie(&core, &value, now) {
            let revoked = core.store.revoke_ui_cookie(
                &cookie.scope,
                &cookie.nonce_hash(),
                cookie.expires_at_ms,
                now,
            );
            if let Err(e) = revoked {
                // The cookie would keep working: say so rather than pretend it is gone.
                tracing::error!(error = %e, "cannot record a UI logout");
                core.audit(&cookie.scope, "ui.logout", "-", "failed", json!({}));
                return refuse(
                    ErrorCode::Internal,
                    "the logout could not be recorded; see the gateway log",
                );
            }
            core.audit(&cookie.scope, "ui.logout", "-", "applied", json!({}));
        }
    }
    let clear = format!(
        "{}=; {}; Max-Age=0",
        cookie::COOKIE_NAME,
        cookie_attributes(&headers)
    );
    let mut resp = StatusCode::NO_CONTENT.into_response();
    if let Ok(v) = HeaderValue::from_str(&clear) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.insert(*name, value.parse().unwrap());
        }
        h
    }

    #[test]
    fn https_is_seen_through_a_proxy_or_in_the_origin() {
        assert!(!over_https(&headers(&[])));
        assert!(!over_https(&headers(&[(
            "origin",
            "http://127.0.0.1:7777"
        )])));
        assert!(!over_https(&headers(&[("x-forwarded-proto", "http")])));
        assert!(over_https(&headers(&[("x-forwarded-proto", "HTTPS")])));
        assert!(over_https(&headers(&[(
            "x-forwarded-proto",
            "https, http"
        )])));
        assert!(over_https(&headers(&[(
            "forwarded",
            "for=192.0.2.60;proto=https;by=203.0.113.43"
        )])));
        assert!(over_https(&headers(&[("origin", "https://skiff.example")])));
    }
}
