//! The worker protocol: what a `skiff worker` on a box and the gateway's worker endpoint say to
//! each other over the SSH tunnel (DESIGN §6).
//!
//! Frames are JSON objects, one per line, at most [`MAX_FRAME_BYTES`]. The first frame from a
//! worker is [`WorkerFrame::Hello`]; the gateway answers [`GatewayFrame::Welcome`] or
//! [`GatewayFrame::Refused`] and closes. After that, every worker operation is a
//! [`WorkerFrame::Call`] whose [`OpId`] names the session, lifecycle revision, run, owner epoch,
//! stream and sequence number; the gateway keeps the terminal result of each, so a duplicate
//! gets the same answer and changes nothing.
//!
//! The RPC set is closed: [`Method`] lists it, every frame rejects unknown fields, and there is
//! deliberately no field for a model endpoint, an API key, a header, an entry id or a parent id.

use crate::event::EventKind;
use crate::ids::{EntryId, EnvironmentId, RunId, SessionId};
use crate::model::{ModelEvent, ModelRef, ModelRequest};
use crate::transcript::{EntryBody, TranscriptEntry};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The protocol version this build speaks. A worker and gateway must agree exactly.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest frame either side accepts, in bytes (a line of JSON). Model requests carry the
/// whole context, so this bounds the context a worker can send.
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// How many model events the gateway sends ahead of the worker's acknowledgements.
pub const MODEL_CREDIT: u64 = 256;

/// How many live events a worker keeps unacknowledged before it waits (its retention window).
pub const EVENT_WINDOW: u64 = 1024;

/// The methods a worker may call. Adding one is a protocol change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Method {
    #[serde(rename = "transcript.commit")]
    TranscriptCommit,
    #[serde(rename = "event.publish")]
    EventPublish,
    #[serde(rename = "model.stream")]
    ModelStream,
    #[serde(rename = "tool.gateway")]
    ToolGateway,
    #[serde(rename = "turn.finish")]
    TurnFinish,
    #[serde(rename = "credential.rotate")]
    CredentialRotate,
    #[serde(rename = "approval.request")]
    ApprovalRequest,
    #[serde(rename = "tool.start")]
    ToolStart,
}

impl Method {
    pub const ALL: [Method; 8] = [
        Method::TranscriptCommit,
        Method::EventPublish,
        Method::ModelStream,
        Method::ToolGateway,
        Method::TurnFinish,
        Method::CredentialRotate,
        Method::ApprovalRequest,
        Method::ToolStart,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Method::TranscriptCommit => "transcript.commit",
            Method::EventPublish => "event.publish",
            Method::ModelStream => "model.stream",
            Method::ToolGateway => "tool.gateway",
            Method::TurnFinish => "turn.finish",
            Method::CredentialRotate => "credential.rotate",
            Method::ApprovalRequest => "approval.request",
            Method::ToolStart => "tool.start",
        }
    }
}

/// The independent sequences of a worker's operations. Each counts from 1 per owner epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    Transcript,
    Events,
    Model,
    Tool,
    Control,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Transcript => "transcript",
            StreamKind::Events => "events",
            StreamKind::Model => "model",
            StreamKind::Tool => "tool",
            StreamKind::Control => "control",
        }
    }
}

/// The durable identity of one operation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpId {
    pub session_id: SessionId,
    pub lifecycle_revision: u64,
    /// The run the operation belongs to (`None` for the readiness canary and credential
    /// rotation, which belong to no run).
    pub run_id: Option<RunId>,
    pub owner_epoch: u64,
    pub stream: StreamKind,
    pub seq: u64,
}

/// What a credential allows; signed by the gateway. The worker treats the credential as an
/// opaque string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialClaims {
    /// Unique per credential; a credential is admitted once.
    pub credential_id: String,
    pub environment_id: EnvironmentId,
    /// The box's pinned SSH host key (`type base64`): the worker the credential was minted for.
    pub worker_key: String,
    pub bundle_hash: String,
    pub session_id: SessionId,
    pub owner_epoch: u64,
    pub methods: Vec<Method>,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
}

/// Generation options a worker may ask for; everything else is the gateway's decision.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

/// How a turn ended on the worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case", deny_unknown_fields)]
pub enum TurnEnd {
    Completed,
    Cancelled,
    Failed { error: String },
}

/// The worker's operations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method", content = "params", deny_unknown_fields)]
pub enum Call {
    /// Appends entries under `base_leaf` (compare-and-swap). The gateway assigns ids and
    /// parent ids and answers [`Reply::Committed`].
    #[serde(rename = "transcript.commit")]
    TranscriptCommit {
        base_leaf: Option<EntryId>,
        entries: Vec<EntryBody>,
    },
    /// A live event; acknowledged by [`GatewayFrame::EventAck`].
    #[serde(rename = "event.publish")]
    EventPublish { event: EventKind },
    /// A model call through the gateway's inference proxy. Events come back as
    /// [`GatewayFrame::Model`] frames from `resume_from` (the number the worker already has).
    #[serde(rename = "model.stream")]
    ModelStream {
        request: ModelRequest,
        #[serde(default)]
        options: ModelOptions,
        #[serde(default)]
        resume_from: u64,
    },
    /// A tool that runs on the gateway (controlled egress).
    #[serde(rename = "tool.gateway")]
    ToolGateway {
        name: String,
        arguments: serde_json::Value,
    },
    /// The turn ended on the worker; the gateway reconciles the workspace (against the
    /// worker's `manifest` of it, which it checks) and ends the run.
    #[serde(rename = "turn.finish")]
    TurnFinish {
        end: TurnEnd,
        manifest: Option<crate::sync::Manifest>,
        /// Why there is no `manifest` (a file over the per-file limit, say), for the user.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        manifest_error: Option<String>,
    },
    /// Asks for the next credential before this one expires.
    #[serde(rename = "credential.rotate")]
    CredentialRotate {},
    /// A tool call the session's approval policy holds: the gateway records an approval and
    /// answers [`Reply::Approval`] once a person decided, it expired, or it was revoked.
    #[serde(rename = "approval.request")]
    ApprovalRequest {
        tool: String,
        kind: crate::approval::ApprovalKind,
        /// The command, a diff of the write, or what the model asked to do.
        subject: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Asks whether a tool call of the worker's committed step may start now. The gateway
    /// answers [`Reply::Finished`] only while the worker's owner epoch is the session's
    /// current one (checked like every call); a fenced worker is refused and never runs the
    /// tool. Nothing is recorded: asking again after a reconnect is checked again.
    #[serde(rename = "tool.start")]
    ToolStart { call_id: String, name: String },
}

impl Call {
    pub fn method(&self) -> Method {
        match self {
            Call::TranscriptCommit { .. } => Method::TranscriptCommit,
            Call::EventPublish { .. } => Method::EventPublish,
            Call::ModelStream { .. } => Method::ModelStream,
            Call::ToolGateway { .. } => Method::ToolGateway,
            Call::TurnFinish { .. } => Method::TurnFinish,
            Call::CredentialRotate { .. } => Method::CredentialRotate,
            Call::ApprovalRequest { .. } => Method::ApprovalRequest,
            Call::ToolStart { .. } => Method::ToolStart,
        }
    }
}

/// Frames a worker sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[allow(
    clippy::large_enum_variant,
    reason = "nearly every frame is a call; boxing it would allocate for each one to save room in the rare others"
)]
pub enum WorkerFrame {
    Hello {
        protocol_version: u32,
        build_hash: String,
        features: Vec<String>,
        credential: String,
    },
    Call {
        op: OpId,
        call: Call,
    },
    /// The worker has processed model events of operation `seq` up to `received` (credit).
    ModelAck {
        seq: u64,
        received: u64,
    },
    /// The worker gave up on model operation `seq` (its turn was cancelled).
    ModelCancel {
        seq: u64,
    },
    /// The readiness canary's answer: the text the model proxy streamed back.
    CanaryAnswer {
        nonce: String,
        text: String,
    },
}

/// The gateway's terminal answer to a [`Call`]; cached and replayed for duplicates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Committed {
        entries: Vec<TranscriptEntry>,
    },
    ToolOutput {
        content: String,
        is_error: bool,
    },
    Finished,
    Credential {
        credential: String,
        expires_at_ms: i64,
    },
    /// The decision on an [`Call::ApprovalRequest`]: `approved`, or the error the model reads
    /// (denied with its reason, expired, revoked).
    Approval {
        approved: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// The operation was refused; nothing changed. `code` is stable, `message` for people.
    Refused {
        code: RefusalCode,
        message: String,
    },
}

/// Why the gateway refused a frame or an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    /// Not a frame of this protocol (unknown type, method or field; too large; not JSON).
    BadFrame,
    BadCredential,
    CredentialExpired,
    CredentialReplayed,
    BuildMismatch,
    ProtocolMismatch,
    /// A method outside the credential's set.
    Forbidden,
    /// A session, revision or run the credential does not cover.
    WrongScope,
    /// An owner epoch that is no longer current.
    StaleEpoch,
    /// The base leaf moved (compare-and-swap failed).
    Conflict,
    TooLarge,
    /// A model reference or option the gateway does not allow.
    NotAllowed,
    Unavailable,
}

impl RefusalCode {
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalCode::BadFrame => "bad_frame",
            RefusalCode::BadCredential => "bad_credential",
            RefusalCode::CredentialExpired => "credential_expired",
            RefusalCode::CredentialReplayed => "credential_replayed",
            RefusalCode::BuildMismatch => "build_mismatch",
            RefusalCode::ProtocolMismatch => "protocol_mismatch",
            RefusalCode::Forbidden => "forbidden",
            RefusalCode::WrongScope => "wrong_scope",
            RefusalCode::StaleEpoch => "stale_epoch",
            RefusalCode::Conflict => "conflict",
            RefusalCode::TooLarge => "too_large",
            RefusalCode::NotAllowed => "not_allowed",
            RefusalCode::Unavailable => "unavailable",
        }
    }
}

/// A turn handed to the worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TurnAssignment {
    pub run_id: RunId,
    pub model: ModelRef,
    pub model_label: String,
    pub max_steps: usize,
    pub max_output_tokens: u32,
    /// The session's reasoning choice; `None` leaves it to the model's setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<crate::model::ReasoningEffort>,
    /// The model's context window in tokens (the catalog's setting for it).
    pub context_window: u64,
    /// `[gateway] compact_at`: the fraction of the window past which the loop compacts.
    pub compact_at: f64,
    /// The transcript from the session's last compaction (or its root) to the leaf the turn
    /// starts from: nothing before a compaction reaches the model, so it stays home.
    pub transcript: Vec<TranscriptEntry>,
    /// Tools the gateway runs beyond the built-in ones (MCP servers' `mcp__…` tools): their
    /// specs only, offered to the model as a gateway-placed loop offers them. The worker
    /// never sees a server, its command, URL or credentials.
    #[serde(default)]
    pub gateway_tools: Vec<crate::model::ToolSpec>,
    /// The session's approval policy for this turn: calls it holds are asked of the gateway
    /// with `approval.request`.
    #[serde(
        default,
        skip_serializing_if = "crate::approval::ApprovalPolicy::is_never"
    )]
    pub approval: crate::approval::ApprovalPolicy,
    /// The session's agent spec: its extra instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_instructions: Option<String>,
    /// The session's agent spec: the only tools the model is offered (absent: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools_allowed: Option<Vec<String>>,
    /// The workspace is still being laid onto the box (the placement started the worker
    /// meanwhile, so the first model call does not wait for it): no tool runs, and the turn's
    /// end is not scanned, before a [`GatewayFrame::WorkspaceLaid`] says how the lay-down
    /// ended. The directory may not exist before then.
    #[serde(default, skip_serializing_if = "is_false")]
    pub wait_for_workspace: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Frames the gateway sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum GatewayFrame {
    Welcome {
        session_id: SessionId,
        lifecycle_revision: u64,
        owner_epoch: u64,
        /// The credential for the next connection (each is admitted once).
        credential: String,
        credential_expires_at_ms: i64,
        /// The last sequence number the gateway has applied, per stream, for this epoch.
        cursors: BTreeMap<StreamKind, u64>,
        /// The workspace directory on the box, relative to the worker's home.
        workspace: String,
    },
    Refused {
        code: RefusalCode,
        message: String,
    },
    Reply {
        stream: StreamKind,
        seq: u64,
        reply: Reply,
    },
    /// Model events of model operation `seq`, numbered from `index` (the first is 0): as many
    /// as the provider had sent and the worker's credit allows, in one frame.
    Model {
        seq: u64,
        index: u64,
        events: Vec<ModelEvent>,
    },
    /// Live events up to `seq` are applied; the worker may forget them.
    EventAck {
        seq: u64,
    },
    Turn {
        turn: TurnAssignment,
    },
    CancelTurn {
        run_id: RunId,
    },
    /// Readiness: stream `nonce` through the inference proxy and answer with what came back.
    Canary {
        nonce: String,
        model: ModelRef,
    },
    /// The gateway is done with this worker: exit.
    Shutdown {
        reason: String,
    },
    /// The workspace's lay-down that a turn with `wait_for_workspace` waits for has ended:
    /// the workspace is in place, whole, or (`error`) it is not and never will be on this
    /// worker, so no tool runs and nothing of the box is brought back. Sent when the lay-down
    /// ends and again after every hand-over of a turn (a frame sent while the connection was
    /// down is lost); the first one a worker gets is the one it keeps.
    WorkspaceLaid {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// The features this build offers, sent in the hello.
pub fn features() -> Vec<String> {
    Method::ALL.iter().map(|m| m.as_str().to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_with_an_endpoint_is_not_a_frame() {
        let line = r#"{"type":"call","op":{"session_id":"ses_a","lifecycle_revision":0,"run_id":null,"owner_epoch":1,"stream":"model","seq":1},"call":{"method":"model.stream","params":{"request":{"model":"a/b","system":"","messages":[],"tools":[],"max_output_tokens":1},"endpoint":"http://evil"}}}"#;
        let err = serde_json::from_str::<WorkerFrame>(line).unwrap_err();
        assert!(err.to_string().contains("endpoint"), "{err}");
    }

    #[test]
    fn an_unknown_method_is_not_a_frame() {
        let line = r#"{"type":"call","op":{"session_id":"ses_a","lifecycle_revision":0,"run_id":null,"owner_epoch":1,"stream":"control","seq":1},"call":{"method":"sessions.list","params":{}}}"#;
        assert!(serde_json::from_str::<WorkerFrame>(line).is_err());
    }

    #[test]
    fn a_welcome_round_trips() {
        let frame = GatewayFrame::Welcome {
            session_id: SessionId::from_suffix("a"),
            lifecycle_revision: 0,
            owner_epoch: 1,
            credential: "c".into(),
            credential_expires_at_ms: 5,
            cursors: [(StreamKind::Events, 3)].into_iter().collect(),
            workspace: "workspaces/ses_a".into(),
        };
        let line = serde_json::to_string(&frame).unwrap();
        assert_eq!(serde_json::from_str::<GatewayFrame>(&line).unwrap(), frame);
    }

    #[test]
    fn calls_round_trip() {
        let frame = WorkerFrame::Call {
            op: OpId {
                session_id: SessionId::from_suffix("a"),
                lifecycle_revision: 0,
                run_id: Some(RunId::from_suffix("b")),
                owner_epoch: 3,
                stream: StreamKind::Transcript,
                seq: 7,
            },
            call: Call::TranscriptCommit {
                base_leaf: None,
                entries: vec![EntryBody::Notice { text: "hi".into() }],
            },
        };
        let line = serde_json::to_string(&frame).unwrap();
        assert_eq!(serde_json::from_str::<WorkerFrame>(&line).unwrap(), frame);
    }
}
