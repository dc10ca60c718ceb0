//! The agent loop and its tools.
//!
//! The loop is generic over a [`ModelClient`] (where model calls go) and a [`SessionBackend`]
//! (where transcript commits and live events are written). It deliberately knows nothing of
//! SQL, HTTP or SSH: the gateway runs it with a store-backed backend, and a worker runs the
//! very same code with a backend made of gateway RPCs.

pub mod approval;
pub mod compact;
mod context;
mod instructions;
pub mod tools;
mod turn;

pub use instructions::{INSTRUCTIONS_FILE, MAX_INSTRUCTIONS_BYTES};
pub use turn::{AgentConfig, TurnOutcome, run_turn};

use futures_util::stream::BoxStream;
use skiff_protocol::EntryId;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{ModelEvent, ModelRequest};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use std::future::Future;
use tokio_util::sync::CancellationToken;

/// Where model calls go. The stream ends with exactly one `Done` or `Error`; when `cancel`
/// fires it ends promptly with `Done { stop_reason: Cancelled }`.
pub trait ModelClient: Send + Sync {
    fn stream(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent>;
}

/// A backend failure the loop cannot work around (the run fails with this message).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

/// Where the transcript lives and live events go, for one session and one run.
pub trait SessionBackend: Send + Sync {
    /// The transcript from the root to the current leaf.
    fn transcript(&self)
    -> impl Future<Output = Result<Vec<TranscriptEntry>, BackendError>> + Send;

    /// Appends entries under `base_leaf` (compare-and-swap) and returns them with the ids the
    /// backend assigned.
    fn commit(
        &self,
        base_leaf: Option<EntryId>,
        bodies: Vec<EntryBody>,
    ) -> impl Future<Output = Result<Vec<TranscriptEntry>, BackendError>> + Send;

    /// Publishes a live event. Delivery problems are the backend's to handle.
    fn publish(&self, event: EventKind) -> impl Future<Output = ()> + Send;

    /// Whether the session is being moved with its turn running (a live handoff): the loop
    /// stops before its next model request, with every entry of the step before committed,
    /// and the same run goes on at the new owner from the transcript. Backends that never
    /// hand a turn off (a worker's: the gateway holds its next model call instead) keep the
    /// default.
    fn handing_off(&self) -> bool {
        false
    }

    /// Asked right before a tool call runs (its approval, if any, given): `Err` says why it
    /// may not start, and it does not run. A worker's backend asks the gateway, which admits
    /// it only while the worker still owns the session (a fenced worker runs no tool); a
    /// backend that cannot be fenced admits everything.
    fn admit_tool(
        &self,
        call: &skiff_protocol::model::ToolCall,
    ) -> impl Future<Output = Result<(), String>> + Send {
        let _ = call;
        async { Ok(()) }
    }

    /// Runs a gateway-resident tool ([`tools::runs_on_gateway`]) on the gateway.
    fn gateway_tool(
        &self,
        name: &str,
        arguments: &serde_json::Value,
        cancel: &CancellationToken,
    ) -> impl Future<Output = tools::ToolOutput> + Send;

    /// Waits for a person's decision on a call the session's approval policy holds: `Ok`
    /// when approved, else the message the model reads as the call's error (denied and why,
    /// expired, revoked). A backend with nobody to ask refuses.
    fn request_approval(
        &self,
        ask: &approval::Ask,
        cancel: &CancellationToken,
    ) -> impl Future<Output = Result<(), String>> + Send {
        let _ = (ask, cancel);
        async { Err("this call needs approval, and nobody can approve it here".to_owned()) }
    }
}
