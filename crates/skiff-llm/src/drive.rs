//! Turns an adapter's async function into the public event stream, and owns the stream's two
//! guarantees: exactly one terminal event (`Done` or `Error`) with nothing after it, and prompt
//! cancellation.
//!
//! Adapters only emit intermediate events and return how the call ended; they never build a
//! terminal event themselves, so they cannot emit two.

use futures_util::stream::{self, BoxStream};
use futures_util::{FutureExt, StreamExt};
use skiff_protocol::model::{ModelErrorKind, ModelEvent, StopReason};
use std::future::{self as std_future, Future};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Small: the consumer (the agent loop) reads as fast as events come, and a bounded channel
/// keeps a stalled consumer from buffering a whole response.
const CHANNEL_CAPACITY: usize = 32;

/// Why a model call ended without a `Done`.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) kind: ModelErrorKind,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(kind: ModelErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// Where an adapter sends intermediate events.
#[derive(Clone)]
pub(crate) struct Emitter(mpsc::Sender<ModelEvent>);

impl Emitter {
    pub(crate) async fn emit(&self, event: ModelEvent) {
        // The receiver lives in the same stream as the producer (see `drive`), so it cannot be
        // gone while the producer runs: the send fails only if the whole stream was dropped.
        let _ = self.0.send(event).await;
    }
}

/// Runs `producer` as the stream is polled. No task is spawned: dropping the stream drops the
/// producer and with it any HTTP request in flight.
pub(crate) fn drive<F, Fut>(
    cancel: CancellationToken,
    producer: F,
) -> BoxStream<'static, ModelEvent>
where
    F: FnOnce(Emitter) -> Fut,
    Fut: Future<Output = Result<StopReason, Failure>> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel(CHANNEL_CAPACITY);
    let emitter = Emitter(tx);
    let work = producer(emitter.clone());
    let run = async move {
        let terminal = tokio::select! {
            biased;
            () = cancel.cancelled() => ModelEvent::Done { stop_reason: StopReason::Cancelled },
            result = work => match result {
                Ok(stop_reason) => ModelEvent::Done { stop_reason },
                Err(Failure { kind, message }) => ModelEvent::Error { kind, message },
            },
        };
        emitter.emit(terminal).await;
    };
    // `run` yields no items; it only has to be polled alongside the receiver. Once it finished,
    // every sender is gone and the receiver ends after the terminal event.
    let run = run.into_stream().filter_map(|()| std_future::ready(None));
    let events = stream::poll_fn(move |cx| rx.poll_recv(cx));
    stream::select(events, run).boxed()
}
