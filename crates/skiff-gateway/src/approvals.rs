//! Approvals: a tool call the session's policy holds waits here for a person.
//!
//! The waiting call ([`Core::ask_approval`], from a gateway-placed loop's backend or a
//! worker's `approval.request`) writes a `pending` row, moves its run to `waiting_approval`,
//! publishes an `approval` event and waits for one of: a decision (`skiff approve|deny`, the
//! UI's card — through this gateway or another on the database, whose settled row it learns
//! from the session's events, `control.rs`), `approval_timeout` (expired: denied), or a revocation (the turn cancelled, the
//! session dispatched, pulled back or failed over). The row leaves `pending` once, by a
//! compare-and-swap in the store, so whichever comes first wins and the call reads the row.
//! Every settlement is published and audited, with ids, states and who decided, never the
//! command or diff.
//!
//! Deliberately absent: which calls wait (`skiff_agent::approval` decides, next to the tools).

use crate::Core;
use crate::error::{Error, Result};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::json;
use skiff_agent::approval::{Approvals as Compiled, Ask};
use skiff_protocol::api::RunStatus;
use skiff_protocol::approval::{
    ApprovalList, ApprovalPolicy, ApprovalState, ApprovalView, DecideApprovalRequest,
};
use skiff_protocol::event::EventKind;
use skiff_protocol::{ApprovalId, RunId, SessionId};
use skiff_store::{NewApproval, Scope, SessionRow};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The longest reason a person may give.
const MAX_REASON_BYTES: usize = 2048;

/// The gateway's approval settings and the calls waiting now.
pub(crate) struct Approvals {
    /// `[gateway] approval`: gateway-placed sessions' policy unless they set their own.
    gateway_policy: ApprovalPolicy,
    /// `[gateway] approval_timeout`.
    timeout: Duration,
    waiting: Mutex<HashMap<ApprovalId, (SessionId, Arc<Notify>)>>,
}

impl Approvals {
    pub(crate) fn new(gateway_policy: ApprovalPolicy, timeout: Duration) -> Self {
        Self {
            gateway_policy,
            timeout,
            waiting: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ApprovalId, (SessionId, Arc<Notify>)>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self, id: &ApprovalId) {
        if let Some((_, notify)) = self.lock().get(id) {
            notify.notify_one();
        }
    }
}

/// Compiles `policy`, naming the key it came from (`gateway.approval`, `approval`) in the
/// error.
pub(crate) fn compile(policy: &ApprovalPolicy, key: &str) -> std::result::Result<Compiled, String> {
    Compiled::compile(policy).map_err(|e| format!("at `{key}.{}`: {}", e.key, e.message))
}

impl Core {
    /// The policy a session's next call runs under: its own, else its worker profile's, else
    /// the gateway's.
    pub(crate) fn approval_policy(&self, scope: &Scope, session: &SessionRow) -> ApprovalPolicy {
        if let Some(own) = &session.approval {
            return own.clone();
        }
        if session.placement != skiff_protocol::environment::PlacementState::Local.as_str()
            && let Ok(Some(p)) = self.store.placement(scope, &session.id)
        {
            return self.envs.approval(&p.profile).unwrap_or_default();
        }
        self.approvals.gateway_policy.clone()
    }

    /// The session's policy, compiled for its tools.
    pub(crate) fn compiled_approvals(
        &self,
        scope: &Scope,
        session: &SessionRow,
    ) -> Result<Compiled> {
        compile(&self.approval_policy(scope, session), "approval").map_err(Error::BadRequest)
    }

    /// Records an approval for `ask` and waits for its outcome: `Ok` when approved, else the
    /// message the model reads as the call's error.
    pub(crate) async fn ask_approval(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        ask: &Ask,
        requested_by: &str,
        cancel: &CancellationToken,
    ) -> std::result::Result<(), String> {
        let refused = |e: &dyn std::fmt::Display| {
            format!("not run: the approval it needs could not be recorded ({e})")
        };
        let suffix = skiff_store::mint().map_err(|e| refused(&e))?;
        let id = ApprovalId::from_suffix(&suffix);
        let timeout = self.approvals.timeout;
        let expires_at_ms = skiff_store::now_ms()
            .saturating_add(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX));
        let new = NewApproval {
            id: id.clone(),
            session_id: session.clone(),
            run_id: run.clone(),
            tool: ask.tool.clone(),
            kind: ask.kind,
            subject: ask.subject.clone(),
            requested_by: requested_by.to_owned(),
            request_reason: ask.reason.clone(),
            expires_at_ms,
        };
        // Before the row exists: its settlement through another gateway is announced after.
        let from = self
            .store
            .last_event_cursor(scope, session)
            .map_err(|e| refused(&e))?;
        let notify = Arc::new(Notify::new());
        // Registered before the row exists, so a decision right after it wakes this call.
        self.approvals
            .lock()
            .insert(id.clone(), (session.clone(), notify.clone()));
        let row = match self.store.create_approval(scope, &new) {
            Ok(row) => row,
            Err(e) => {
                self.approvals.lock().remove(&id);
                return Err(refused(&e));
            }
        };
        self.audit(
            scope,
            "approval.request",
            id.as_str(),
            "pending",
            json!({
                "session": session.as_str(),
                "run": run.as_str(),
                "tool": ask.tool,
                "kind": ask.kind.as_str(),
                "requested_by": requested_by,
            }),
        );
        self.set_waiting(scope, session, run, true);
        self.revoker().publish_approval(scope, &row);
        let timed_out = tokio::select! {
            () = notify.notified() => None,
            // Decided (or revoked) through another gateway: the row says how.
            () = self.approval_settled(scope, session, &id, from) => None,
            () = tokio::time::sleep(timeout) => Some((
                ApprovalState::Expired,
                format!(
                    "nobody decided within {} (`approval_timeout`)",
                    humantime::format_duration(timeout)
                ),
            )),
            () = cancel.cancelled() => Some((
                ApprovalState::Revoked,
                "the turn was cancelled".to_owned(),
            )),
        };
        if let Some((state, why)) = timed_out {
            // Loses to a decision that landed first; the row says which.
            self.settle(scope, &id, state, "gateway", Some(&why)).ok();
        }
        self.approvals.lock().remove(&id);
        self.set_waiting(scope, session, run, false);
        let row = self.store.approval(scope, &id).map_err(|e| refused(&e))?;
        outcome(&row)
    }

    /// Moves the run to `waiting_approval` and back; a run being cancelled or ended is left
    /// as it is.
    fn set_waiting(&self, scope: &Scope, session: &SessionId, run: &RunId, waiting: bool) {
        let (from, to) = if waiting {
            (RunStatus::Running, RunStatus::WaitingApproval)
        } else {
            (RunStatus::WaitingApproval, RunStatus::Running)
        };
        // Another call of the same run may still wait (none do today: calls run one by one).
        if !waiting && self.approvals.lock().values().any(|(s, _)| s == session) {
            return;
        }
        match self.store.run(scope, run) {
            Ok(r) if r.status == from => {
                if let Err(e) = self.set_run_status(scope, session, run, to, None) {
                    tracing::warn!(%run, error = %e, "could not record the run waiting for approval");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%run, error = %e, "could not read the run waiting for approval")
            }
        }
    }

    /// Settles a pending approval (`Ok(None)`: it was settled already), publishes and audits
    /// it, and wakes its call.
    fn settle(
        &self,
        scope: &Scope,
        id: &ApprovalId,
        state: ApprovalState,
        by: &str,
        reason: Option<&str>,
    ) -> Result<Option<ApprovalView>> {
        self.revoker().settle(scope, id, state, by, reason)
    }

    /// The handle that settles approvals without the rest of the core.
    fn revoker(&self) -> Revoker {
        Revoker {
            store: self.store.clone(),
            hub: self.hub.clone(),
            approvals: self.approvals.clone(),
        }
    }

    /// `skiff approve` / `skiff deny`: a person's decision.
    pub(crate) fn decide(
        &self,
        scope: &Scope,
        id: &ApprovalId,
        approve: bool,
        reason: Option<&str>,
    ) -> Result<ApprovalView> {
        let reason = reason.map(str::trim).filter(|r| !r.is_empty());
        if let Some(r) = reason
            && r.len() > MAX_REASON_BYTES
        {
            return Err(Error::BadRequest(format!(
                "the reason is {} bytes; the limit is {MAX_REASON_BYTES}",
                r.len()
            )));
        }
        let state = if approve {
            ApprovalState::Approved
        } else {
            ApprovalState::Denied
        };
        match self.settle(scope, id, state, &scope.owner_id, reason)? {
            Some(row) => Ok(row),
            None => {
                let row = self.store.approval(scope, id)?;
                Err(Error::Conflict(format!(
                    "approval {id} is already {}{}; nothing waits for a decision",
                    row.state,
                    row.decided_by
                        .as_deref()
                        .map(|by| format!(" (by {by})"))
                        .unwrap_or_default()
                )))
            }
        }
    }

    /// Revokes every pending approval of `session` (the migration barrier's step 3, and a
    /// cancelled turn): each waiting call gets an error saying `why`.
    pub(crate) fn revoke_approvals(&self, scope: &Scope, session: &SessionId, why: &str) {
        self.revoker().revoke(scope, session, why);
    }
}

/// What settles and revokes approvals, for whoever must not hold the core (the worker side's
/// barriers and failover): the store, the hub and the calls waiting, shared with the core.
#[derive(Clone)]
pub(crate) struct Revoker {
    store: Arc<dyn skiff_store::Backend>,
    hub: Arc<crate::Hub>,
    approvals: Arc<Approvals>,
}

impl Revoker {
    pub(crate) fn new(
        store: Arc<dyn skiff_store::Backend>,
        hub: Arc<crate::Hub>,
        approvals: Arc<Approvals>,
    ) -> Self {
        Self {
            store,
            hub,
            approvals,
        }
    }

    /// Settles a pending approval (`Ok(None)`: it was settled already), publishes and audits
    /// it, and wakes its call.
    pub(crate) fn settle(
        &self,
        scope: &Scope,
        id: &ApprovalId,
        state: ApprovalState,
        by: &str,
        reason: Option<&str>,
    ) -> Result<Option<ApprovalView>> {
        let Some(row) = self.store.settle_approval(scope, id, state, by, reason)? else {
            return Ok(None);
        };
        crate::sessions::audit_row(
            &*self.store,
            scope,
            "approval.decide",
            id.as_str(),
            state.as_str(),
            json!({
                "session": row.session_id.as_str(),
                "run": row.run_id.as_str(),
                "tool": row.tool,
                "kind": row.kind.as_str(),
                "decided_by": by,
                "with_reason": reason.is_some(),
            }),
        );
        self.publish_approval(scope, &row);
        self.approvals.wake(id);
        Ok(Some(row))
    }

    fn publish_approval(&self, scope: &Scope, row: &ApprovalView) {
        let event = EventKind::Approval {
            approval: row.clone(),
        };
        if let Err(e) = self
            .hub
            .publish(scope, &row.session_id, Some(&row.run_id), event)
        {
            tracing::warn!(approval = %row.id, error = %e, "could not publish an approval");
        }
    }

    /// Revokes every pending approval of `session` (the migration barrier's step 3, and a
    /// cancelled turn): each waiting call gets an error saying `why`.
    pub(crate) fn revoke(&self, scope: &Scope, session: &SessionId, why: &str) {
        let own = skiff_store::Sight::own(scope.clone());
        let pending = match self.store.approvals(&own, Some(session), true) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(%session, error = %e, "could not read the session's pending approvals");
                return;
            }
        };
        for row in pending {
            if let Err(e) =
                self.settle(scope, &row.id, ApprovalState::Revoked, "gateway", Some(why))
            {
                tracing::warn!(approval = %row.id, error = %e, "could not revoke an approval");
            }
        }
    }
}

/// What the waiting call answers for a settled row.
fn outcome(row: &ApprovalView) -> std::result::Result<(), String> {
    let why = row.reason.as_deref();
    match row.state {
        ApprovalState::Approved => Ok(()),
        ApprovalState::Denied => Err(match why {
            Some(why) => format!(
                "not run: {} denied this call ({}): {why}",
                row.decided_by.as_deref().unwrap_or("a person"),
                row.id
            ),
            None => format!(
                "not run: {} denied this call ({}); no reason was given",
                row.decided_by.as_deref().unwrap_or("a person"),
                row.id
            ),
        }),
        ApprovalState::Expired => Err(format!(
            "not run: the call needed approval and was denied because {} ({})",
            why.unwrap_or("nobody decided in time"),
            row.id
        )),
        ApprovalState::Revoked => Err(format!(
            "not run: its approval was revoked: {} ({})",
            why.unwrap_or("the session moved"),
            row.id
        )),
        ApprovalState::Pending => Err(format!(
            "not run: approval {} is still pending after its wait ended",
            row.id
        )),
    }
}

type Shared = State<Arc<Core>>;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/approvals", get(list))
        .route("/v1/approvals/{id}", get(show))
        .route("/v1/approvals/{id}/approve", post(approve))
        .route("/v1/approvals/{id}/deny", post(deny))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    session: Option<String>,
    #[serde(default)]
    pending: bool,
}

fn approval_id(raw: &str) -> Result<ApprovalId> {
    ApprovalId::parse(raw)
        .ok_or_else(|| Error::BadRequest(format!("{raw:?} is not an approval id (apr_…)")))
}

async fn list(
    State(core): Shared,
    Extension(sight): Extension<skiff_store::Sight>,
    query: std::result::Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<ApprovalList>> {
    let Query(query) = query.map_err(|e| {
        Error::BadRequest(format!(
            "{}; the list takes ?session=SESSION_ID and ?pending=true",
            e.body_text()
        ))
    })?;
    let session = match query.session.as_deref() {
        None => None,
        Some(raw) => {
            let id = SessionId::parse(raw).ok_or_else(|| {
                Error::BadRequest(format!("session={raw} is not a session id (ses_…)"))
            })?;
            // Not found is said about the session.
            if core
                .store
                .owner_of(&sight, skiff_store::Owned::Session, id.as_str())?
                .is_none()
            {
                return Err(skiff_store::Error::NotFound {
                    what: "session",
                    id: id.to_string(),
                }
                .into());
            }
            Some(id)
        }
    };
    let approvals = core
        .store
        .approvals(&sight, session.as_ref(), query.pending)?;
    Ok(Json(ApprovalList { approvals }))
}

async fn show(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<ApprovalView>> {
    Ok(Json(core.store.approval(&scope, &approval_id(&id)?)?))
}

async fn approve(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: std::result::Result<Json<DecideApprovalRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response> {
    let reason = reason_of(body)?;
    let row = core.decide(&scope, &approval_id(&id)?, true, reason.as_deref())?;
    Ok(Json(row).into_response())
}

async fn deny(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: std::result::Result<Json<DecideApprovalRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response> {
    let reason = reason_of(body)?;
    let row = core.decide(&scope, &approval_id(&id)?, false, reason.as_deref())?;
    Ok(Json(row).into_response())
}

/// The decision's reason; a request without a JSON body gives none.
fn reason_of(
    body: std::result::Result<Json<DecideApprovalRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Option<String>> {
    match body {
        Ok(Json(b)) => Ok(b.reason),
        Err(axum::extract::rejection::JsonRejection::MissingJsonContentType(_)) => Ok(None),
        Err(e) => Err(Error::BadRequest(e.body_text())),
    }
}
