//! Any gateway serves any request (issue 17): a turn-starting request for a session whose
//! lease another live gateway holds between turns (a gateway with the session's worker box
//! attached keeps it) is forwarded there, and the answer relayed unchanged (status, type,
//! body, streamed); so is every turn sent to a draining gateway, to another live one.
//!
//! The caller's own credentials go along (`Authorization`, and the UI's cookie with the
//! headers its same-origin check reads): gateways on one database share tokens, so the
//! owner authenticates and authorizes the caller itself. A forwarded request carries
//! [`FORWARDED_BY`] and is never forwarded again, so two gateways never bounce a request. A
//! session busy with a turn is not forwarded: it is refused `409` naming its owner, as one
//! gateway refuses a second turn. The forward is audited and logged without the token.

use crate::{Core, Error, Result};
use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use skiff_protocol::{GatewayId, SessionId};
use skiff_store::{LeaseKey, Scope};
use std::sync::OnceLock;

/// Names the gateway that forwarded a request; a request carrying it is served where it
/// arrives.
pub(crate) const FORWARDED_BY: &str = "x-skiff-forwarded-by";

/// The caller's headers a forward carries: its credentials, and what the owner's checks of
/// them read (the UI cookie's same-origin check).
const PASSED: [HeaderName; 7] = [
    header::AUTHORIZATION,
    header::COOKIE,
    header::CONTENT_TYPE,
    header::ORIGIN,
    header::REFERER,
    header::HOST,
    HeaderName::from_static("sec-fetch-site"),
];

/// Where a turn-starting request is served.
pub(crate) enum Route {
    Here,
    There { gateway: GatewayId, address: String },
}

impl Core {
    /// Where a turn for `session` (in `scope`) is to be started: at the live gateway holding
    /// its lease between turns, at another live gateway when this one drains, else here
    /// (where a busy owner, or a draining gateway with no other, is refused).
    pub(crate) fn route_turn(
        &self,
        scope: &Scope,
        session: &SessionId,
        headers: &HeaderMap,
    ) -> Result<Route> {
        if headers.contains_key(FORWARDED_BY) {
            return Ok(Route::Here);
        }
        let me = self.cluster.id();
        let lease = self.store.lease(&LeaseKey::Session(session.clone()))?;
        let holder = lease
            .filter(|l| !l.expired && l.holder != *me)
            .map(|l| l.holder);
        if holder.is_none() && !self.cluster.is_draining() {
            return Ok(Route::Here);
        }
        // A turn running there: its owner is busy, and the refusal naming it is made here.
        if holder.is_some() && self.store.open_run(scope, session)?.is_some() {
            return Ok(Route::Here);
        }
        let others = self.cluster.others()?;
        let to = match &holder {
            Some(holder) => others.into_iter().find(|g| g.id == *holder),
            None => others.into_iter().next(),
        };
        Ok(match to {
            Some(g) => Route::There {
                gateway: g.id,
                address: g.address,
            },
            None => Route::Here,
        })
    }

    /// Sends the caller's request on to `gateway` at `address` and relays its answer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn forward(
        &self,
        scope: &Scope,
        session: &SessionId,
        (gateway, address): (&GatewayId, &str),
        path: &str,
        headers: &HeaderMap,
        body: Vec<u8>,
    ) -> Result<Response> {
        static HTTP: OnceLock<reqwest::Client> = OnceLock::new();
        let http = HTTP.get_or_init(reqwest::Client::new);
        let mut request = http
            .post(format!("http://{address}{path}"))
            .header(FORWARDED_BY, self.cluster.id().as_str())
            .body(body);
        for name in &PASSED {
            if let Some(value) = headers.get(name) {
                request = request.header(name.as_str(), value.as_bytes());
            }
        }
        tracing::info!(%session, to = %gateway, %address, path, "forwarding a turn to the gateway that holds its session");
        self.audit(
            scope,
            "request.forward",
            session.as_str(),
            "forwarded",
            json!({ "to": gateway.as_str(), "address": address, "path": path }),
        );
        let answer = request.send().await.map_err(|e| {
            Error::Unavailable(format!(
                "gateway {gateway} at {address}, which holds session {session}, did not answer \
                 ({}); send the message again: once its lease lapses any gateway runs it",
                e.without_url()
            ))
        })?;
        let status = answer.status();
        let kind = answer.headers().get(header::CONTENT_TYPE).cloned();
        let mut relayed = (status, Body::from_stream(answer.bytes_stream())).into_response();
        if let Some(kind) = kind {
            relayed.headers_mut().insert(header::CONTENT_TYPE, kind);
        }
        Ok(relayed)
    }
}
