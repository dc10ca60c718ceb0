//! The inference proxy. A worker sends an approved model reference, the context and
//! constrained options; the provider, endpoint, key and headers come from the gateway's own
//! catalog. Streamed text is published to the session's followers here, as the provider sends
//! it, exactly as a local session's loop would; the worker uses it for its loop only. The provider call runs in a task of its own, independent of the worker's
//! connection: a tunnel blip does not stop it, and the worker resumes from the last event it
//! received. A finished call's events are cached, so a worker that comes back after the end
//! gets the same answer (terminal replay) and the provider is not asked twice. A gateway that
//! restarts mid-call has nothing to resume: the call fails, and the turn is retried as a new
//! turn rather than replayed. Prompt-cache metadata is the gateway's too: a worker's request
//! has no field for it, and the session's key is added here exactly as for a local loop.

use super::endpoint::Admitted;
use super::{CANARY_MODEL, canary_answer, lock};
use futures_util::StreamExt;
use serde_json::json;
use skiff_protocol::environment::EgressAccounting;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, ModelRequest, ReasoningEffort, StopReason,
};
use skiff_protocol::worker::{Call, GatewayFrame, MODEL_CREDIT, OpId, RefusalCode, StreamKind};
use skiff_protocol::{EnvironmentId, SessionId};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The largest context a worker may send, serialized.
pub(crate) const MAX_MODEL_REQUEST_BYTES: usize = 7 * 1024 * 1024;
// INVARIANT: the agent loop compacts before a request's text passes its budget and carries at
// most MAX_CONTEXT_IMAGE_BYTES of images, so a long worker session's requests stay under this
// limit, which itself leaves the frame that carries it room for its envelope.
const _: () = assert!(
    skiff_agent::compact::FRAME_BUDGET_BYTES + skiff_agent::tools::MAX_CONTEXT_IMAGE_BYTES
        < MAX_MODEL_REQUEST_BYTES
);
const _: () = assert!(MAX_MODEL_REQUEST_BYTES < skiff_protocol::worker::MAX_FRAME_BYTES);
/// How many model calls one session may have in flight (a loop needs one).
const MAX_MODEL_CALLS_IN_FLIGHT: usize = 2;
/// The most output tokens a worker may ask for.
const MAX_OUTPUT_TOKENS: u32 = 32 * 1024;

/// One model call in flight (or just finished) on the gateway.
pub(crate) struct ModelCall {
    request_hash: String,
    events: Mutex<Vec<ModelEvent>>,
    acked: Mutex<u64>,
    changed: Notify,
    cancel: CancellationToken,
}

impl ModelCall {
    /// The provider's answer is complete (the worker may not have all of it yet).
    fn finished(&self) -> bool {
        lock(&self.events).last().is_some_and(terminal)
    }
}

fn terminal(event: &ModelEvent) -> bool {
    matches!(event, ModelEvent::Done { .. } | ModelEvent::Error { .. })
}

fn error_event(message: impl Into<String>) -> ModelEvent {
    ModelEvent::Error {
        kind: ModelErrorKind::Connection,
        message: message.into(),
    }
}

impl super::WorkerSide {
    pub(super) fn model_call(self: &Arc<Self>, a: &Admitted, op: OpId, call: Call) {
        let Call::ModelStream {
            request,
            options,
            resume_from,
        } = call
        else {
            return;
        };
        let key = (op.session_id.clone(), op.owner_epoch, op.seq);
        // A resent call differs only in `resume_from`: the request identifies it.
        let hash = request_hash(&request);
        let reused = |a: &Admitted| {
            a.live.send_on(a.conn_id, GatewayFrame::Model {
                seq: op.seq,
                index: resume_from,
                events: vec![ModelEvent::Error {
                    kind: ModelErrorKind::Rejected,
                    message: format!("model {} already answered another request; sequence numbers are not reusable", op.seq),
                }],
            });
        };
        // Every path below ends the worker's wait with events ending in a terminal one: a
        // worker that gets nothing waits for this call forever.
        let fail = |a: &Admitted, message: String| {
            a.live.send_on(
                a.conn_id,
                GatewayFrame::Model {
                    seq: op.seq,
                    index: resume_from,
                    events: vec![error_event(message)],
                },
            );
        };
        // Finished before: replay the cached answer. A cache that cannot be read is not taken
        // for "never asked": that would ask the provider a second time (billed twice).
        let cached = match self.store.worker_op(
            &op.session_id,
            op.owner_epoch,
            StreamKind::Model,
            op.seq,
        ) {
            Ok(cached) => cached,
            Err(e) => {
                tracing::warn!(session = %op.session_id, seq = op.seq, error = %e, "could not read a model call's cached answer");
                fail(
                    a,
                    format!(
                        "could not read whether model call {} was already answered ({e}); the turn may retry it",
                        op.seq
                    ),
                );
                return;
            }
        };
        if let Some(cached) = cached {
            if cached.call_hash != hash {
                reused(a);
                return;
            }
            let events = match serde_json::from_str::<Vec<ModelEvent>>(&cached.reply) {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(session = %op.session_id, seq = op.seq, error = %e, "a model call's cached answer is unreadable");
                    self.audit_worker(
                        &a.scope,
                        "worker.call",
                        op.session_id.as_str(),
                        "failed",
                        json!({
                            "method": "model.stream", "code": "unavailable",
                            "reason": format!("cached answer unreadable: {e}"),
                            "epoch": op.owner_epoch, "seq": op.seq,
                        }),
                    );
                    fail(
                        a,
                        format!(
                            "the answer to model call {} was cached but is unreadable ({e}); the provider is not asked twice",
                            op.seq
                        ),
                    );
                    return;
                }
            };
            let events: Vec<ModelEvent> = events.into_iter().skip(to_usize(resume_from)).collect();
            a.live.send_on(
                a.conn_id,
                GatewayFrame::Model {
                    seq: op.seq,
                    index: resume_from,
                    events,
                },
            );
            return;
        }
        let existing = lock(&self.models).get(&key).cloned();
        let call = match existing {
            Some(call) if call.request_hash != hash => {
                reused(a);
                return;
            }
            Some(call) => call,
            None if resume_from > 0 => {
                // The worker had part of an answer this process never produced: the gateway
                // restarted mid-call. Never replay a half-finished provider stream.
                a.live.send_on(a.conn_id, GatewayFrame::Model {
                    seq: op.seq,
                    index: resume_from,
                    events: vec![error_event("the gateway restarted during this model call; the turn is retried as a new turn")],
                });
                return;
            }
            None if op.run_id.is_some() && a.live.hold_for_handoff() => {
                // A live move home: the step before this call is committed; the call is
                // never answered, and its worker is stopped and fenced (`handoff`).
                tracing::info!(session = %op.session_id, seq = op.seq, "model call held for a live handoff");
                return;
            }
            None => {
                let in_flight = lock(&self.models)
                    .iter()
                    .filter(|((s, _, _), call)| *s == op.session_id && !call.finished())
                    .count();
                if in_flight >= MAX_MODEL_CALLS_IN_FLIGHT {
                    a.live.send_on(a.conn_id, GatewayFrame::Model {
                        seq: op.seq,
                        index: 0,
                        events: vec![ModelEvent::Error {
                            kind: ModelErrorKind::RateLimited,
                            message: format!("more than {MAX_MODEL_CALLS_IN_FLIGHT} model calls in flight for this session"),
                        }],
                    });
                    return;
                }
                // The readiness canary of a box being brought up has no session row to read.
                let canary = op.run_id.is_none()
                    && super::WorkerSide::canary_call(a, request.model.as_str());
                let (session_model, session_reasoning) = if canary {
                    (CANARY_MODEL.to_owned(), None)
                } else {
                    match self.store.session(&a.scope, &op.session_id) {
                        Ok(s) => (
                            s.model_ref,
                            s.reasoning.as_deref().and_then(ReasoningEffort::parse),
                        ),
                        // Not "this is not the session's model": the gateway could not look.
                        Err(e) => {
                            fail(
                                a,
                                format!(
                                    "could not read the session's model ({e}); the turn may retry"
                                ),
                            );
                            return;
                        }
                    }
                };
                let allowed = session_model.as_str();
                if let Err(reason) = check_request(&request, &options, allowed, session_reasoning) {
                    self.audit_worker(
                        &a.scope,
                        "worker.call",
                        op.session_id.as_str(),
                        "refused",
                        json!({
                            "method": "model.stream", "code": reason.0.as_str(), "reason": reason.1,
                        }),
                    );
                    a.live.send_on(
                        a.conn_id,
                        GatewayFrame::Model {
                            seq: op.seq,
                            index: 0,
                            events: vec![ModelEvent::Error {
                                kind: ModelErrorKind::Rejected,
                                message: reason.1,
                            }],
                        },
                    );
                    return;
                }
                // The session's agent spec: a tool outside its list never reaches the model,
                // whatever the worker put in the request.
                let mut request = request;
                if !canary {
                    match self.session_spec(&a.scope, &op.session_id) {
                        Ok(Some(spec)) => {
                            if let Some(allowed) = spec.tools {
                                request.tools.retain(|t| {
                                    allowed.contains(&t.name)
                                        || t.name == skiff_agent::approval::REQUEST_APPROVAL
                                });
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            fail(a, format!("the session's agent spec is refused: {e}"));
                            return;
                        }
                    }
                }
                let call = Arc::new(ModelCall {
                    request_hash: hash.clone(),
                    events: Mutex::new(Vec::new()),
                    acked: Mutex::new(0),
                    changed: Notify::new(),
                    cancel: CancellationToken::new(),
                });
                lock(&self.models).insert(key.clone(), call.clone());
                let stream_to = op.run_id.clone().map(|run| (a.scope.clone(), run));
                self.spawn_provider_call(
                    a.claims.environment_id.clone(),
                    key.clone(),
                    request,
                    call.clone(),
                    stream_to,
                    a.scope.clone(),
                );
                call
            }
        };
        *lock(&call.acked) = resume_from;
        let live = a.live.clone();
        let conn_id = a.conn_id;
        let seq = op.seq;
        tokio::spawn(async move {
            let mut sent = to_usize(resume_from);
            loop {
                let changed = call.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let (batch, end, done) = {
                    let events = lock(&call.events);
                    let window = to_usize(*lock(&call.acked) + MODEL_CREDIT);
                    let end = events.len().min(window.max(sent));
                    let batch: Vec<ModelEvent> = events[sent..end].to_vec();
                    let done = events.last().is_some_and(terminal) && end == events.len();
                    (batch, end, done)
                };
                // Whatever arrived since the last frame goes in one frame.
                if !batch.is_empty() {
                    let frame = GatewayFrame::Model {
                        seq,
                        index: sent as u64,
                        events: batch,
                    };
                    if !live.send_on(conn_id, frame) {
                        return;
                    }
                    sent = end;
                }
                if done {
                    return;
                }
                changed.await;
            }
        });
    }

    fn spawn_provider_call(
        self: &Arc<Self>,
        env: EnvironmentId,
        key: (SessionId, u64, u64),
        request: ModelRequest,
        call: Arc<ModelCall>,
        stream_to: Option<(skiff_store::Scope, skiff_protocol::RunId)>,
        owner_scope: skiff_store::Scope,
    ) {
        let workers = self.clone();
        tokio::spawn(async move {
            let canary = request.model.as_str() == CANARY_MODEL;
            let bytes_out = serde_json::to_string(&request)
                .map(|s| s.len())
                .unwrap_or(0) as u64;
            let mut stream = if canary {
                let nonce = match request.messages.first() {
                    Some(Message::User { text }) => text.clone(),
                    _ => String::new(),
                };
                futures_util::stream::iter(vec![
                    ModelEvent::TextDelta {
                        text: canary_answer(&nonce),
                    },
                    ModelEvent::Done {
                        stop_reason: StopReason::EndTurn,
                    },
                ])
                .boxed()
            } else {
                workers.model_stream(&owner_scope, &key.0, request, call.cancel.clone())
            };
            let mut usage = (0u64, 0u64);
            let mut bytes_in = 0u64;
            while let Some(event) = stream.next().await {
                if let ModelEvent::Usage { usage: u } = &event {
                    usage.0 += u.input_tokens;
                    usage.1 += u.output_tokens;
                }
                bytes_in += serde_json::to_string(&event).map(|s| s.len()).unwrap_or(0) as u64;
                // Streamed text goes to the session's followers from here, as it arrives: the
                // worker gets it for its loop but does not send it back (half the tunnel
                // traffic, and the live stream does not wait on the box).
                let delta = match &event {
                    ModelEvent::TextDelta { text } => {
                        Some(EventKind::TextDelta { text: text.clone() })
                    }
                    ModelEvent::ReasoningDelta { text } => {
                        Some(EventKind::ReasoningDelta { text: text.clone() })
                    }
                    _ => None,
                };
                if let (Some(delta), Some((scope, run))) = (delta, &stream_to)
                    && let Err(e) = workers.hub.publish(scope, &key.0, Some(run), delta)
                {
                    tracing::warn!(error = %e, "could not publish streamed text");
                }
                let end = terminal(&event);
                lock(&call.events).push(event);
                call.changed.notify_waiters();
                if end {
                    break;
                }
            }
            {
                let mut events = lock(&call.events);
                if !events.last().is_some_and(terminal) {
                    events.push(error_event("the model stream ended without finishing"));
                }
            }
            call.changed.notify_waiters();
            let events = lock(&call.events).clone();
            let recorded = serde_json::to_string(&events)
                .map_err(|e| e.to_string())
                .and_then(|reply| {
                    let cached = skiff_store::CachedOp {
                        method: "model.stream".to_owned(),
                        call_hash: call.request_hash.clone(),
                        reply,
                    };
                    workers
                        .store
                        .record_worker_op(&key.0, key.1, StreamKind::Model, key.2, &cached)
                        .map_err(|e| e.to_string())
                });
            let op = OpId {
                session_id: key.0.clone(),
                lifecycle_revision: 0,
                run_id: stream_to.as_ref().map(|(_, run)| run.clone()),
                owner_epoch: key.1,
                stream: StreamKind::Model,
                seq: key.2,
            };
            // The admitted worker's own scope (its session's owner), for a call of a turn and
            // for one outside any (a readiness canary) alike.
            let scope = &owner_scope;
            // The answer stays in memory until the worker has all of it; only a worker that
            // comes back after that would find no cache (and get a terminal error).
            if let Err(e) = recorded {
                workers.report_lost_write(scope, &op, "model.stream", "reply", &e);
            } else if let Err(e) =
                workers
                    .store
                    .advance_worker_cursor(&key.0, key.1, StreamKind::Model, key.2)
            {
                workers.report_lost_write(scope, &op, "model.stream", "cursor", &e.to_string());
            }
            if !canary {
                let add = EgressAccounting {
                    model_requests: 1,
                    input_tokens: usage.0,
                    output_tokens: usage.1,
                    bytes_in,
                    bytes_out,
                    gateway_tool_calls: 0,
                };
                if let Err(e) = workers.store.add_environment_egress(&env, add) {
                    tracing::warn!(%env, error = %e, "could not account a model request");
                }
            }
            // The worker's acknowledgements move the sender's window: the call stays until the
            // worker has the whole answer (a worker that comes back later gets the cache).
            let mut models = lock(&workers.models);
            // One of the call's locks at a time: the sender takes `events` then `acked`, and
            // holding `acked` while waiting for `events` here deadlocked against it.
            let acked = *lock(&call.acked);
            if acked >= lock(&call.events).len() as u64 {
                models.remove(&key);
            }
        });
    }

    pub(super) fn model_ack(&self, session: &SessionId, epoch: u64, seq: u64, received: u64) {
        let key = (session.clone(), epoch, seq);
        let mut models = lock(&self.models);
        let Some(call) = models.get(&key).cloned() else {
            return;
        };
        let acked = {
            let mut acked = lock(&call.acked);
            *acked = (*acked).max(received);
            *acked
        };
        call.changed.notify_waiters();
        if call.finished() && acked >= lock(&call.events).len() as u64 {
            models.remove(&key);
        }
    }

    pub(super) fn model_cancel(&self, session: &SessionId, epoch: u64, seq: u64) {
        if let Some(call) = lock(&self.models).get(&(session.clone(), epoch, seq)) {
            call.cancel.cancel();
        }
    }

    /// Cancels every provider call of a session (its run was cancelled or its owner fenced).
    pub(crate) fn cancel_model_calls(&self, session: &SessionId) {
        let mut models = lock(&self.models);
        for ((s, _, _), call) in models.iter() {
            if s == session {
                call.cancel.cancel();
            }
        }
        // Finished calls are in the cache; a fenced worker has nothing more to receive.
        models.retain(|(s, _, _), call| s != session || !call.finished());
    }
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The policy on what a worker may ask of a model.
fn check_request(
    request: &ModelRequest,
    options: &skiff_protocol::worker::ModelOptions,
    allowed_model: &str,
    allowed_reasoning: Option<ReasoningEffort>,
) -> Result<(), (RefusalCode, String)> {
    // How hard the model thinks is the session's choice (and its cost), not the worker's.
    if request.reasoning != allowed_reasoning {
        let name = |r: Option<ReasoningEffort>| r.map_or("the model's setting", |r| r.as_str());
        return Err((
            RefusalCode::NotAllowed,
            format!(
                "reasoning {} is not this session's choice ({})",
                name(request.reasoning),
                name(allowed_reasoning)
            ),
        ));
    }
    if request.model.as_str() != allowed_model {
        return Err((
            RefusalCode::NotAllowed,
            format!(
                "model {} is not this session's model ({allowed_model})",
                request.model
            ),
        ));
    }
    let size = serde_json::to_string(request)
        .map(|s| s.len())
        .unwrap_or(usize::MAX);
    if size > MAX_MODEL_REQUEST_BYTES {
        return Err((
            RefusalCode::TooLarge,
            format!(
                "the model request is {size} bytes; the gateway's limit is {MAX_MODEL_REQUEST_BYTES}"
            ),
        ));
    }
    if request.max_output_tokens == 0 || request.max_output_tokens > MAX_OUTPUT_TOKENS {
        return Err((
            RefusalCode::NotAllowed,
            format!("max_output_tokens must be 1 to {MAX_OUTPUT_TOKENS}"),
        ));
    }
    if let Some(t) = options.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err((RefusalCode::NotAllowed, "temperature must be 0 to 2".into()));
    }
    if let Some(r) = &options.reasoning
        && !["low", "medium", "high"].contains(&r.as_str())
    {
        return Err((
            RefusalCode::NotAllowed,
            "reasoning must be low, medium or high".into(),
        ));
    }
    Ok(())
}

pub(super) fn request_hash(request: &ModelRequest) -> String {
    let json = serde_json::to_vec(request).unwrap_or_default();
    blake3::hash(&json).to_hex().to_string()
}
