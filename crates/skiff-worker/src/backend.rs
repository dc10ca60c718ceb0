//! The agent loop's backends on a worker: every model call, transcript commit, live event and
//! gateway tool is an operation of the worker protocol.

use crate::link::Link;
use futures_util::stream::BoxStream;
use skiff_agent::tools::ToolOutput;
use skiff_agent::{BackendError, ModelClient, SessionBackend};
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{ModelEvent, ModelRequest};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::worker::{Call, Reply, StreamKind};
use skiff_protocol::{EntryId, RunId};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) struct RpcModel {
    pub link: Arc<Link>,
    pub run: Option<RunId>,
    /// Set while the turn's workspace is still being laid onto the box: what leads to a tool
    /// waits at it.
    pub gate: Option<crate::gate::Gate>,
}

impl ModelClient for RpcModel {
    fn stream(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        let events = self.link.model_stream(self.run.clone(), request, cancel);
        match &self.gate {
            Some(gate) => gate.hold(events),
            None => events,
        }
    }
}

/// One run's backend. The transcript is the one the gateway handed over with the turn.
pub(crate) struct RpcBackend {
    pub link: Arc<Link>,
    pub run: RunId,
    pub transcript: Vec<TranscriptEntry>,
}

fn refused(reply: Reply, what: &str) -> BackendError {
    match reply {
        Reply::Refused { code, message } => BackendError(format!(
            "the gateway refused {what} ({}): {message}",
            code.as_str()
        )),
        other => BackendError(format!("the gateway answered {what} with {other:?}")),
    }
}

impl SessionBackend for RpcBackend {
    async fn transcript(&self) -> Result<Vec<TranscriptEntry>, BackendError> {
        Ok(self.transcript.clone())
    }

    async fn commit(
        &self,
        base_leaf: Option<EntryId>,
        bodies: Vec<EntryBody>,
    ) -> Result<Vec<TranscriptEntry>, BackendError> {
        let reply = self
            .link
            .call(
                StreamKind::Transcript,
                Some(self.run.clone()),
                Call::TranscriptCommit {
                    base_leaf,
                    entries: bodies,
                },
            )
            .await;
        match reply {
            Reply::Committed { entries } => Ok(entries),
            other => Err(refused(other, "a transcript commit")),
        }
    }

    async fn publish(&self, event: EventKind) {
        // Committed entries reach subscribers through the gateway's commit path, and streamed
        // text and reasoning through its inference proxy: none travels back over the tunnel.
        if matches!(
            event,
            EventKind::Entry { .. }
                | EventKind::TextDelta { .. }
                | EventKind::ReasoningDelta { .. }
        ) {
            return;
        }
        self.link.publish(Some(self.run.clone()), event).await;
    }

    async fn admit_tool(&self, call: &skiff_protocol::model::ToolCall) -> Result<(), String> {
        // One round trip per tool call, answered from memory and one placement read: the
        // gateway admits it only while this worker's epoch owns the session, so a worker
        // fenced while its step ran starts none of the step's remaining tools.
        let reply = self
            .link
            .call(
                StreamKind::Tool,
                Some(self.run.clone()),
                Call::ToolStart {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                },
            )
            .await;
        match reply {
            Reply::Finished => Ok(()),
            other => Err(refused(other, "the tool's start").0),
        }
    }

    async fn gateway_tool(
        &self,
        name: &str,
        arguments: &serde_json::Value,
        _cancel: &CancellationToken,
    ) -> ToolOutput {
        let reply = self
            .link
            .call(
                StreamKind::Tool,
                Some(self.run.clone()),
                Call::ToolGateway {
                    name: name.to_owned(),
                    arguments: arguments.clone(),
                },
            )
            .await;
        match reply {
            Reply::ToolOutput { content, is_error } => ToolOutput {
                content,
                is_error,
                images: Vec::new(),
            },
            other => ToolOutput::error(refused(other, "the tool call").0),
        }
    }

    async fn request_approval(
        &self,
        ask: &skiff_agent::approval::Ask,
        _cancel: &CancellationToken,
    ) -> Result<(), String> {
        // A cancel reaches the gateway as the run's cancel, which ends the wait there.
        let reply = self
            .link
            .call(
                StreamKind::Tool,
                Some(self.run.clone()),
                Call::ApprovalRequest {
                    tool: ask.tool.clone(),
                    kind: ask.kind,
                    subject: ask.subject.clone(),
                    reason: ask.reason.clone(),
                },
            )
            .await;
        match reply {
            Reply::Approval { approved: true, .. } => Ok(()),
            Reply::Approval {
                approved: false,
                message,
            } => Err(message.unwrap_or_else(|| "not run: the call was denied".to_owned())),
            other => Err(format!(
                "not run: {}",
                refused(other, "the approval request").0
            )),
        }
    }
}
