//! The worker's side of the durable protocol: sequence numbers per stream, operations kept
//! until the gateway answers them, live events kept until the gateway acknowledges them, and
//! model streams that resume from the last event received. A connection comes and goes
//! ([`Link::attach`], [`Link::detach`]); whatever was in flight is sent again on the next one,
//! and the gateway answers duplicates from its cache.

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{ModelEvent, ModelRequest, StopReason};
use skiff_protocol::worker::{
    Call, EVENT_WINDOW, ModelOptions, OpId, Reply, StreamKind, WorkerFrame,
};
use skiff_protocol::{RunId, SessionId};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// Who the gateway says this worker is (from the welcome).
#[derive(Clone, Debug)]
pub(crate) struct Ident {
    pub session_id: SessionId,
    pub lifecycle_revision: u64,
    pub owner_epoch: u64,
}

struct PendingCall {
    run_id: Option<RunId>,
    call: Call,
    reply: Option<oneshot::Sender<Reply>>,
}

struct ModelSub {
    run_id: Option<RunId>,
    request: ModelRequest,
    received: u64,
    events: mpsc::UnboundedSender<ModelEvent>,
}

#[derive(Default)]
struct State {
    out: Option<mpsc::UnboundedSender<String>>,
    ident: Option<Ident>,
    next_seq: HashMap<StreamKind, u64>,
    calls: BTreeMap<(StreamKind, u64), PendingCall>,
    /// Live events not yet acknowledged: `(seq, run, event)`.
    events: VecDeque<(u64, Option<RunId>, EventKind)>,
    models: HashMap<u64, ModelSub>,
    credential: String,
    credential_expires_at_ms: i64,
}

/// Shared by the connection loop and every task that talks to the gateway.
pub(crate) struct Link {
    state: Mutex<State>,
    event_space: Notify,
}

/// Every how many model events the worker acknowledges (the gateway's credit).
const MODEL_ACK_EVERY: u64 = 32;

impl Link {
    pub(crate) fn new(credential: String) -> Link {
        Link {
            state: Mutex::new(State {
                credential,
                ..State::default()
            }),
            event_space: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn credential(&self) -> String {
        self.lock().credential.clone()
    }

    pub(crate) fn credential_expires_at_ms(&self) -> i64 {
        self.lock().credential_expires_at_ms
    }

    pub(crate) fn set_credential(&self, credential: String, expires_at_ms: i64) {
        let mut state = self.lock();
        state.credential = credential;
        state.credential_expires_at_ms = expires_at_ms;
    }

    /// A connection was admitted: send everything still in flight on it.
    pub(crate) fn attach(
        &self,
        ident: Ident,
        applied: &BTreeMap<StreamKind, u64>,
        out: mpsc::UnboundedSender<String>,
    ) {
        let mut state = self.lock();
        if state
            .ident
            .as_ref()
            .is_some_and(|i| i.owner_epoch != ident.owner_epoch)
        {
            // A different epoch means a different worker's numbering; this one starts afresh.
            state.next_seq.clear();
        }
        state.ident = Some(ident);
        if let Some(&acked) = applied.get(&StreamKind::Events) {
            while state.events.front().is_some_and(|(seq, ..)| *seq <= acked) {
                state.events.pop_front();
            }
            self.event_space.notify_waiters();
        }
        let mut frames = Vec::new();
        for (seq, run, event) in &state.events {
            frames.push(frame_of(
                &state,
                StreamKind::Events,
                *seq,
                run.clone(),
                Call::EventPublish {
                    event: event.clone(),
                },
            ));
        }
        for ((stream, seq), pending) in &state.calls {
            frames.push(frame_of(
                &state,
                *stream,
                *seq,
                pending.run_id.clone(),
                pending.call.clone(),
            ));
        }
        for (seq, sub) in &state.models {
            frames.push(frame_of(
                &state,
                StreamKind::Model,
                *seq,
                sub.run_id.clone(),
                Call::ModelStream {
                    request: sub.request.clone(),
                    options: ModelOptions::default(),
                    resume_from: sub.received,
                },
            ));
        }
        for frame in frames.into_iter().flatten() {
            let _ = out.send(frame);
        }
        state.out = Some(out);
    }

    /// The connection is gone; keep everything for the next one.
    pub(crate) fn detach(&self) {
        self.lock().out = None;
    }

    fn send(state: &State, frame: Option<String>) {
        if let (Some(out), Some(frame)) = (&state.out, frame) {
            let _ = out.send(frame);
        }
    }

    fn next(state: &mut State, stream: StreamKind) -> u64 {
        let seq = state.next_seq.entry(stream).or_insert(0);
        *seq += 1;
        *seq
    }

    /// Calls a gateway method and waits for its terminal answer (across reconnects).
    pub(crate) async fn call(
        &self,
        stream: StreamKind,
        run_id: Option<RunId>,
        call: Call,
    ) -> Reply {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.lock();
            let seq = Self::next(&mut state, stream);
            let frame = frame_of(&state, stream, seq, run_id.clone(), call.clone());
            state.calls.insert(
                (stream, seq),
                PendingCall {
                    run_id,
                    call,
                    reply: Some(tx),
                },
            );
            Self::send(&state, frame);
        }
        rx.await.unwrap_or_else(|_| Reply::Refused {
            code: skiff_protocol::worker::RefusalCode::Unavailable,
            message: "the worker is shutting down".into(),
        })
    }

    /// Publishes a live event; waits while the retention window is full (backpressure).
    pub(crate) async fn publish(&self, run_id: Option<RunId>, event: EventKind) {
        loop {
            let space = self.event_space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            {
                let mut state = self.lock();
                if (state.events.len() as u64) < EVENT_WINDOW {
                    let seq = Self::next(&mut state, StreamKind::Events);
                    let frame = frame_of(
                        &state,
                        StreamKind::Events,
                        seq,
                        run_id.clone(),
                        Call::EventPublish {
                            event: event.clone(),
                        },
                    );
                    state.events.push_back((seq, run_id, event));
                    Self::send(&state, frame);
                    return;
                }
            }
            space.await;
        }
    }

    /// Streams a model call through the gateway's inference proxy.
    pub(crate) fn model_stream(
        self: &std::sync::Arc<Self>,
        run_id: Option<RunId>,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        let seq = {
            let mut state = self.lock();
            let seq = Self::next(&mut state, StreamKind::Model);
            let frame = frame_of(
                &state,
                StreamKind::Model,
                seq,
                run_id.clone(),
                Call::ModelStream {
                    request: request.clone(),
                    options: ModelOptions::default(),
                    resume_from: 0,
                },
            );
            state.models.insert(
                seq,
                ModelSub {
                    run_id,
                    request,
                    received: 0,
                    events: tx,
                },
            );
            Self::send(&state, frame);
            seq
        };
        let link = self.clone();
        let events = tokio_stream_of(rx);
        let cancelled = async move {
            cancel.cancelled().await;
            let mut state = link.lock();
            if state.models.remove(&seq).is_some() {
                let frame = serde_json::to_string(&WorkerFrame::ModelCancel { seq }).ok();
                Self::send(&state, frame);
            }
            ModelEvent::Done {
                stop_reason: StopReason::Cancelled,
            }
        };
        // The stream ends at its terminal event, or with `Done(Cancelled)` when cancelled.
        let cancel_stream = futures_util::stream::once(cancelled).boxed();
        futures_util::stream::select(events, cancel_stream)
            .scan(false, |ended, event| {
                if *ended {
                    return futures_util::future::ready(None);
                }
                *ended = matches!(event, ModelEvent::Done { .. } | ModelEvent::Error { .. });
                futures_util::future::ready(Some(event))
            })
            .boxed()
    }

    /// Applies a frame from the gateway that concerns the durable state.
    pub(crate) fn on_reply(&self, stream: StreamKind, seq: u64, reply: Reply) {
        let mut state = self.lock();
        if let Some(mut pending) = state.calls.remove(&(stream, seq))
            && let Some(tx) = pending.reply.take()
        {
            let _ = tx.send(reply);
        }
    }

    pub(crate) fn on_event_ack(&self, acked: u64) {
        let mut state = self.lock();
        while state.events.front().is_some_and(|(seq, ..)| *seq <= acked) {
            state.events.pop_front();
        }
        drop(state);
        self.event_space.notify_waiters();
    }

    pub(crate) fn on_model_event(&self, seq: u64, index: u64, event: ModelEvent) {
        let mut state = self.lock();
        let Some(sub) = state.models.get_mut(&seq) else {
            return;
        };
        // Duplicates after a resume, and anything out of order, are dropped.
        if index != sub.received {
            return;
        }
        sub.received += 1;
        let received = sub.received;
        let terminal = matches!(event, ModelEvent::Done { .. } | ModelEvent::Error { .. });
        let _ = sub.events.send(event);
        if terminal {
            state.models.remove(&seq);
        }
        if terminal || received % MODEL_ACK_EVERY == 0 {
            let frame = serde_json::to_string(&WorkerFrame::ModelAck { seq, received }).ok();
            Self::send(&state, frame);
        }
    }

    /// Sends a frame that needs no answer (the canary's).
    pub(crate) fn send_frame(&self, frame: &WorkerFrame) {
        let state = self.lock();
        Self::send(&state, serde_json::to_string(frame).ok());
    }

    /// The work in flight (for logs).
    pub(crate) fn in_flight(&self) -> (usize, usize, usize) {
        let state = self.lock();
        (state.calls.len(), state.events.len(), state.models.len())
    }
}

fn frame_of(
    state: &State,
    stream: StreamKind,
    seq: u64,
    run_id: Option<RunId>,
    call: Call,
) -> Option<String> {
    let ident = state.ident.as_ref()?;
    let frame = WorkerFrame::Call {
        op: OpId {
            session_id: ident.session_id.clone(),
            lifecycle_revision: ident.lifecycle_revision,
            run_id,
            owner_epoch: ident.owner_epoch,
            stream,
            seq,
        },
        call,
    };
    serde_json::to_string(&frame).ok()
}

fn tokio_stream_of(mut rx: mpsc::UnboundedReceiver<ModelEvent>) -> BoxStream<'static, ModelEvent> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}
