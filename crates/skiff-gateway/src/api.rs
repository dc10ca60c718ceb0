//! The client API: JSON over HTTP under `/v1`, and a per-session event stream as SSE or
//! WebSocket. Every route requires a bearer token (or the Control UI's session cookie, see
//! `ui`); the token's scope decides what is visible.

use crate::Core;
use crate::error::Error;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;
use skiff_protocol::SessionId;
use skiff_protocol::api::{
    ApiError, CreateSessionRequest, DispatchRequest, ErrorCode, PullBackRequest,
    SESSION_PAGE_DEFAULT, SESSION_PAGE_MAX, SendMessageRequest, SessionList, SwitchAgentRequest,
};
use skiff_store::{Scope, Sight};
use std::sync::Arc;
use std::time::Duration;

type Shared = State<Arc<Core>>;

/// Every authenticated route, each checked against `people::ACCESS`.
pub(crate) fn routes_table() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/health", get(health))
        .route("/metrics", get(crate::metrics::metrics))
        .route("/v1/sessions", get(list_sessions).post(create_session))
        .route("/v1/sessions/{id}", get(show_session))
        .route("/v1/sessions/{id}/messages", post(send_message))
        .route("/v1/sessions/{id}/agent", post(switch_agent))
        .route("/v1/sessions/{id}/cancel", post(cancel))
        .route("/v1/sessions/{id}/pull-back", post(pull_back))
        .route("/v1/sessions/{id}/dispatch", post(dispatch))
        .route("/v1/sessions/{id}/events", get(events_sse))
        .route("/v1/sessions/{id}/events/ws", get(events_ws))
        .route("/v1/events", get(session_changes))
        .route("/v1/gateway/drain", post(drain))
        .merge(crate::people::routes())
        .merge(crate::ui::api_routes())
        .merge(crate::env_api::routes())
        .merge(crate::sync_api::routes())
        .merge(crate::restore::routes())
        .merge(crate::groups::routes())
        .merge(crate::compaction::routes())
        .merge(crate::vault::routes())
        .merge(crate::approvals::routes())
        .merge(crate::budgets::routes())
        .merge(crate::audit_trail::routes())
        .merge(crate::agents::routes())
}

/// The path of every authenticated route, as the router is built (the whole-router test walks
/// them).
pub fn route_paths() -> Vec<&'static str> {
    routes_table().into_parts().1
}

pub(crate) fn router(core: Arc<Core>) -> Router {
    let (routes, _) = routes_table().into_parts();
    let authenticated = routes
        .route_layer(middleware::from_fn_with_state(
            core.clone(),
            crate::people::gate,
        ))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(core.clone(), authenticate));
    crate::ui::public_routes()
        .route("/healthz", get(crate::metrics::healthz))
        .route("/readyz", get(crate::metrics::readyz))
        // Slack signs its requests instead of presenting a token; absent unless configured.
        .merge(crate::ingress::routes(core.slack.is_some()))
        // Single sign-on's own steps check for themselves (a login has no token yet).
        .merge(crate::sso::public_routes())
        .merge(authenticated)
        .layer(middleware::from_fn(crate::ui::security_headers))
        .with_state(core)
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let (status, body) = self.to_api();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        }
        (status, Json(body)).into_response()
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    (
        crate::error::http_status(code),
        Json(ApiError {
            code: code.as_str().to_owned(),
            message: message.into(),
        }),
    )
        .into_response()
}

async fn authenticate(State(core): Shared, mut req: Request, next: Next) -> Response {
    // Behind an identity-aware proxy its assertion decides alone: no token or cookie counts.
    if let Some(proxy) = &core.proxy {
        return crate::sso::proxy::authenticate(&core, proxy, req, next).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let anonymous = Scope::new("-", "-");
    // A bearer token, when present, decides alone; otherwise the UI's session cookie may.
    let principal = match presented {
        Some(token) => match core.tokens.verify(token) {
            Err(e) => return crate::Error::from(e).into_response(),
            Ok(crate::auth::Verified::Valid(row)) => crate::people::principal_of_token(&core, &row),
            Ok(crate::auth::Verified::Expired(row)) => {
                core.audit(
                    &row.scope,
                    "auth",
                    req.uri().path(),
                    "denied",
                    json!({ "reason": "expired token", "token": row.id }),
                );
                return error(
                    ErrorCode::Unauthorized,
                    crate::people::expired_message(&row),
                );
            }
            Ok(crate::auth::Verified::Unknown) => Ok(None),
        },
        None => match crate::ui::cookie_auth(&core, &req) {
            crate::ui::CookieAuth::Scope(scope) => crate::people::principal_of_scope(&core, &scope),
            crate::ui::CookieAuth::Missing => Ok(None),
            crate::ui::CookieAuth::CrossSite(reason) => {
                core.audit(
                    &anonymous,
                    "auth",
                    req.uri().path(),
                    "denied",
                    json!({ "reason": reason }),
                );
                return error(
                    ErrorCode::Forbidden,
                    "cross-site request refused: a cookie-authenticated change must come from the gateway's own page",
                );
            }
        },
    };
    let principal = match principal {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    match principal {
        Some(principal) => {
            req.extensions_mut().insert(principal.scope());
            req.extensions_mut().insert(principal.sight());
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        None => {
            let reason = if presented.is_some() {
                "invalid token"
            } else {
                "no token"
            };
            core.audit(
                &anonymous,
                "auth",
                req.uri().path(),
                "denied",
                json!({ "reason": reason }),
            );
            error(
                ErrorCode::Unauthorized,
                "missing or invalid token: send `Authorization: Bearer <token>` (the first admin's is in the gateway's gateway.json; others get one from `skiff admin token create`)",
            )
        }
    }
}

async fn not_found() -> Response {
    error(ErrorCode::NotFound, "no such route")
}

fn session_id(raw: &str) -> Result<SessionId, Error> {
    SessionId::parse(raw)
        .ok_or_else(|| Error::BadRequest(format!("{raw:?} is not a session id (ses_…)")))
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PageQuery {
    limit: Option<usize>,
    before: Option<String>,
}

async fn list_sessions(
    State(core): Shared,
    Extension(sight): Extension<Sight>,
    query: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<SessionList>, Error> {
    let Query(query) = query.map_err(|e| {
        Error::BadRequest(format!(
            "{}; the list takes ?limit=N (1 to {SESSION_PAGE_MAX}) and ?before=SESSION_ID",
            e.body_text()
        ))
    })?;
    let limit = query.limit.unwrap_or(SESSION_PAGE_DEFAULT);
    if !(1..=SESSION_PAGE_MAX).contains(&limit) {
        return Err(Error::BadRequest(format!(
            "limit={limit} is out of range: a page holds 1 to {SESSION_PAGE_MAX} sessions"
        )));
    }
    let before = match query.before.as_deref() {
        None => None,
        Some(raw) => Some(SessionId::parse(raw).ok_or_else(|| {
            Error::BadRequest(format!(
                "before={raw} is not a session id; pass the `next` of the previous page"
            ))
        })?),
    };
    Ok(Json(core.list_page(&sight, limit, before.as_ref())?))
}

async fn create_session(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    body: Result<Json<CreateSessionRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    if req.attempts.is_some() {
        let started = core.fan_out(&scope, req).await?;
        return Ok((StatusCode::CREATED, Json(started)).into_response());
    }
    let started = core.create_session(&scope, req).await?;
    Ok((StatusCode::CREATED, Json(started)).into_response())
}

async fn show_session(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response, Error> {
    Ok(Json(core.detail(&scope, &session_id(&id)?)?).into_response())
}

async fn send_message(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    body: Result<Json<SendMessageRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let session = session_id(&id)?;
    // Another scope's session is "not found" here, never forwarded.
    core.store.session(&scope, &session)?;
    if let crate::forward::Route::There { gateway, address } =
        core.route_turn(&scope, &session, &headers)?
    {
        let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
        let body = serde_json::to_vec(&req).map_err(|e| Error::Internal(e.to_string()))?;
        return core
            .forward(&scope, &session, (&gateway, &address), path, &headers, body)
            .await;
    }
    let started = core
        .send(
            &scope,
            &session,
            crate::sessions::Message {
                prompt: &req.prompt,
                profile: req.profile.as_deref(),
                reasoning: req.reasoning,
                approval: req.approval,
                agent: req.agent.as_deref(),
            },
        )
        .await?;
    Ok((StatusCode::CREATED, Json(started)).into_response())
}

/// Switches the agent spec between turns; no turn starts.
async fn switch_agent(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: Result<Json<SwitchAgentRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let session = core
        .switch_agent_between_turns(&scope, &session_id(&id)?, &req.agent)
        .await?;
    Ok(Json(session).into_response())
}

async fn cancel(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response, Error> {
    Ok(Json(core.cancel(&scope, &session_id(&id)?)?).into_response())
}

/// Answers 202: the move goes on; its steps are placement events.
async fn pull_back(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: Result<Json<PullBackRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let done = core
        .pull_back(&scope, &session_id(&id)?, req.cancel, req.live)
        .await?;
    Ok((StatusCode::ACCEPTED, Json(done)).into_response())
}

/// Answers 202: the placement goes on; its steps are placement events.
async fn dispatch(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: Result<Json<DispatchRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let done = core
        .dispatch(&scope, &session_id(&id)?, &req.profile, req.live)
        .await?;
    Ok((StatusCode::ACCEPTED, Json(done)).into_response())
}

/// `POST /v1/gateway/drain`: answers as the drain goes, one JSON line per step
/// (`application/x-ndjson`: progress, then the report); the gateway exits after the last.
async fn drain(
    State(core): Shared,
    body: Result<
        Json<skiff_protocol::drain::DrainRequest>,
        axum::extract::rejection::JsonRejection,
    >,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let lines = core.drain(req.force).await?;
    let body = futures_util::stream::unfold(lines, |mut lines| async move {
        let line = lines.recv().await?;
        let mut text = serde_json::to_vec(&line).ok()?;
        text.push(b'\n');
        Some((Ok::<_, std::convert::Infallible>(text), lines))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(body),
    )
        .into_response())
}

#[derive(Deserialize)]
struct EventsQuery {
    /// Resume after this cursor (0: from the beginning).
    after: Option<u64>,
}

fn resume_cursor(q: &EventsQuery, headers: &HeaderMap) -> u64 {
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    q.after.or(last_event_id).unwrap_or(0)
}

/// `GET /v1/sessions/{id}/events?after=N`: server-sent events, one per session event, with the
/// cursor as the SSE id (so the standard `Last-Event-ID` header resumes too).
async fn events_sse(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, Error> {
    let stream = core
        .hub
        .subscribe(scope, session_id(&id)?, resume_cursor(&q, &headers))?;
    let sse = stream.map(|item| {
        let event = item.map_err(axum::Error::new)?;
        Event::default()
            .id(event.cursor.to_string())
            .json_data(&*event)
            .map_err(axum::Error::new)
    });
    Ok(Sse::new(sse)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// `GET /v1/events`: the caller's sessions as server-sent `session` events, each a
/// `SessionView`: every session first, then a `ready` event, then a session again whenever its
/// runs or transcript change. A follower that falls behind gets the whole list again, so a
/// list built from this stream is never silently stale.
async fn session_changes(
    State(core): Shared,
    Extension(sight): Extension<Sight>,
) -> Result<Response, Error> {
    // Subscribe before reading the list: a change after this point is in the channel.
    let rx = core.hub.session_changes();
    // The newest page: older sessions are read a page at a time (`GET /v1/sessions`).
    let snapshot = core.list_page(&sight, SESSION_PAGE_DEFAULT, None)?.sessions;
    let state = (core, sight, rx, snapshot, true);
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let (core, sight, rx, pending, ready) = &mut s;
        loop {
            if let Some(view) = pending.pop() {
                let event = Event::default().event("session").json_data(&view);
                return Some((event.map_err(axum::Error::new), s));
            }
            if std::mem::take(ready) {
                return Some((Ok(Event::default().event("ready").data("{}")), s));
            }
            match rx.recv().await {
                Ok((changed, id)) if sight.sees(&changed) => {
                    match core.store.session(&changed, &id).map_err(Error::from) {
                        Ok(row) => match core.session_view(&changed, row) {
                            Ok(view) => pending.push(view),
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot describe a changed session")
                            }
                        },
                        Err(e) => tracing::warn!(error = %e, "cannot read a changed session"),
                    }
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    match core.list_page(sight, SESSION_PAGE_DEFAULT, None) {
                        Ok(page) => *pending = page.sessions,
                        Err(e) => return Some((Err(axum::Error::new(e)), s)),
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// `GET /v1/sessions/{id}/events/ws?after=N`: the same events as JSON text frames.
async fn events_ws(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, Error> {
    let stream = core
        .hub
        .subscribe(scope, session_id(&id)?, resume_cursor(&q, &headers))?;
    Ok(ws.on_upgrade(move |socket| forward_ws(socket, stream)))
}

async fn forward_ws(
    mut socket: WebSocket,
    stream: impl futures_util::Stream<
        Item = Result<Arc<skiff_protocol::event::SessionEvent>, skiff_store::Error>,
    > + Send,
) {
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            item = stream.next() => {
                let Some(Ok(event)) = item else { break };
                let Ok(text) = serde_json::to_string(&*event) else { break };
                if socket.send(Message::Text(text.into())).await.is_err() {
                    break;
                }
            }
            incoming = socket.recv() => {
                // The client only ever closes; anything else is ignored.
                if !matches!(incoming, Some(Ok(_))) {
                    break;
                }
            }
        }
    }
}
