//! Live session events. Every event has a per-session cursor; a client that reconnects with
//! the last cursor it saw gets everything after it, nothing twice.

use crate::api::RunStatus;
use crate::ids::{RunId, SessionId};
use crate::transcript::TranscriptEntry;
use serde::{Deserialize, Serialize};

/// An event as delivered to clients.
// No `deny_unknown_fields` here: serde cannot combine it with `flatten`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionEvent {
    pub session_id: SessionId,
    /// Monotonic per session, starting at 1.
    pub cursor: u64,
    pub at_ms: i64,
    pub run_id: Option<RunId>,
    #[serde(flatten)]
    pub kind: EventKind,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum EventKind {
    /// A run changed status (queued, running, … and finally a terminal status).
    RunStatus {
        status: RunStatus,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// The loop asked the model for the next step; a client may show a spinner.
    ModelRequest { model: String },
    /// Streamed assistant text.
    TextDelta { text: String },
    /// Streamed readable reasoning (thinking text, a reasoning summary) before the answer. A
    /// client shows that the model is thinking; the whole block lands in the assistant entry.
    ReasoningDelta { text: String },
    /// A tool started. `summary` is the main argument, for one-line display.
    ToolStarted {
        call_id: String,
        name: String,
        summary: String,
    },
    /// A tool finished.
    ToolFinished {
        call_id: String,
        name: String,
        is_error: bool,
        duration_ms: u64,
    },
    /// A transcript entry was committed.
    Entry { entry: TranscriptEntry },
    /// A worker session's placement moved (provisioning, syncing, starting, active, …).
    Placement {
        state: crate::environment::PlacementState,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        environment_id: Option<crate::EnvironmentId>,
        /// What is happening, for people ("laying 12 files onto the box").
        detail: String,
    },
    /// A tool call waits for a person's decision (`state: pending`), or that approval was
    /// decided, expired or revoked.
    Approval {
        approval: crate::approval::ApprovalView,
    },
    /// Output of the box's setup as it runs (chunks of lines; the whole log is an artifact).
    SetupOutput { text: String },
}

impl EventKind {
    /// True for the event that ends a run; clients following one run stop here.
    pub fn is_run_end(&self) -> bool {
        matches!(self, EventKind::RunStatus { status, .. } if status.is_terminal())
    }
}
