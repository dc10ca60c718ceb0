//! One turn of the agent loop: ask the model, run the tools it calls, commit everything, until
//! the model stops calling tools, the run is cancelled, or something fails.

use crate::tools::Tools;
use crate::{BackendError, ModelClient, SessionBackend, compact, context, instructions};
use futures_util::StreamExt;
use skiff_protocol::EntryId;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{
    ModelEvent, ModelRef, ModelRequest, Reasoning, ReasoningEffort, StopReason, ToolCall, Usage,
};
use skiff_protocol::transcript::EntryBody;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// What the loop needs besides its model and backend.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub model: ModelRef,
    /// The label people see for the model (`scripted/demo (scripted)`).
    pub model_label: String,
    pub max_steps: usize,
    pub max_output_tokens: u32,
    /// The session's `--reasoning` choice; `None` leaves it to the model's setting.
    pub reasoning: Option<ReasoningEffort>,
    /// The model's context window in tokens (0: unknown; only the frame budget applies).
    pub context_window: u64,
    /// The fraction of the window past which the loop compacts before a request.
    pub compact_at: f64,
    /// The session's agent spec's extra instructions, added to the system prompt.
    pub agent_instructions: Option<String>,
}

/// How a turn ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnOutcome {
    Completed,
    Cancelled,
    Failed(String),
    /// Stopped between two model steps for a live handoff ([`SessionBackend::handing_off`]):
    /// the run is not over, it goes on elsewhere.
    HandedOff,
}

// INVARIANT: the system prompt names no absolute path, host or placement, so the provider
// request for a session is the same whether the loop runs on the gateway or on a worker
// (prompt-cache affinity across placements).
pub(crate) const SYSTEM_PROMPT: &str = "You are Skiff's coding agent. You work inside one workspace (a \
directory, usually a git repository) through the tools you are given; every path is relative to \
the workspace root. Read before you edit, keep changes focused, run the project's checks with \
`exec` when they exist, and commit finished work with git when the user asks for it. When you \
are done, reply with a short summary of what you changed.";

/// Runs one turn. The user's message is already in the transcript.
pub async fn run_turn<M: ModelClient, B: SessionBackend>(
    model: &M,
    backend: &B,
    tools: &Tools,
    config: &AgentConfig,
    cancel: &CancellationToken,
) -> TurnOutcome {
    let outcome = drive(model, backend, tools, config, cancel).await;
    // However the turn ended, what it started in the background ends with it.
    tools.end_turn().await;
    match outcome {
        Ok(outcome) => outcome,
        Err(e) => TurnOutcome::Failed(e.0),
    }
}

async fn drive<M: ModelClient, B: SessionBackend>(
    model: &M,
    backend: &B,
    tools: &Tools,
    config: &AgentConfig,
    cancel: &CancellationToken,
) -> Result<TurnOutcome, BackendError> {
    let mut entries = backend.transcript().await?;
    // A step whose runtime stopped with tool calls in flight (a killed worker, a crashed
    // gateway) left calls without results; whatever they did is in the workspace. Each gets
    // its result entry now, saying so, before anything else: no effect without an entry,
    // and no call run again behind the model's back.
    let lost = context::unanswered_at_leaf(&entries);
    if !lost.is_empty() {
        let leaf = entries.last().map(|e| e.id.clone());
        let bodies = lost
            .into_iter()
            .map(|(call_id, name)| EntryBody::ToolResult {
                call_id,
                name,
                content: context::LOST_RESULT.to_owned(),
                is_error: true,
                images: Vec::new(),
            })
            .collect();
        commit(backend, &mut entries, leaf, bodies).await?;
    }
    // Read once per turn: an edit the agent makes to AGENTS.md applies from the next turn, so
    // every step of a turn (and its prompt cache) sees the same text.
    let instructions = instructions::load(tools.workspace(), tools.repository_root()).await;
    if let Some(text) = instructions.notice() {
        let leaf = entries.last().map(|e| e.id.clone());
        commit(
            backend,
            &mut entries,
            leaf,
            vec![EntryBody::Notice { text }],
        )
        .await?;
    }
    let system = with_agent_instructions(
        instructions.system(SYSTEM_PROMPT),
        config.agent_instructions.as_deref(),
    );
    for _ in 0..config.max_steps {
        // The barrier of a live handoff: the step before is committed, the next model
        // request is not made here.
        if backend.handing_off() {
            return Ok(TurnOutcome::HandedOff);
        }
        let mut request = ModelRequest {
            model: config.model.clone(),
            system: system.clone(),
            messages: context::messages(&entries),
            tools: tools.specs(),
            max_output_tokens: config.max_output_tokens,
            reasoning: config.reasoning,
        };
        if config.limits().exceeded(&request, &entries) {
            if let Some(failed) =
                compact(model, backend, &mut entries, &system, config, cancel).await?
            {
                return Ok(failed);
            }
            request.messages = context::messages(&entries);
        }
        let leaf = entries.last().map(|e| e.id.clone());
        backend
            .publish(EventKind::ModelRequest {
                model: config.model_label.clone(),
            })
            .await;
        let reply = stream_reply(model, backend, request, cancel).await;

        // An interrupted reply keeps its text but not its tool calls: they were never run, and
        // a call without a result would make the next request invalid.
        let interrupted = reply.error.is_some() || reply.stop_reason == StopReason::Cancelled;
        let assistant = EntryBody::AssistantMessage {
            text: reply.text.clone(),
            tool_calls: if interrupted {
                Vec::new()
            } else {
                reply.tool_calls.clone()
            },
            model: config.model_label.clone(),
            usage: reply.usage,
            stop_reason: reply.stop_reason,
            // Kept even when interrupted: it is what the model said, and only a complete
            // block (with its signature) ever reaches here.
            reasoning: reply.reasoning.clone(),
        };
        if interrupted {
            let mut bodies = Vec::new();
            if !reply.text.is_empty() || !reply.reasoning.is_empty() {
                bodies.push(assistant);
            }
            let outcome = match reply.error {
                Some(error) => {
                    bodies.push(EntryBody::Notice {
                        text: format!("The model call failed: {error}"),
                    });
                    TurnOutcome::Failed(format!("model call failed: {error}"))
                }
                None => {
                    bodies.push(cancelled_notice());
                    TurnOutcome::Cancelled
                }
            };
            commit(backend, &mut entries, leaf, bodies).await?;
            return Ok(outcome);
        }
        commit(backend, &mut entries, leaf, vec![assistant]).await?;
        if reply.tool_calls.is_empty() {
            return Ok(TurnOutcome::Completed);
        }

        let mut results = Vec::with_capacity(reply.tool_calls.len());
        for call in &reply.tool_calls {
            results.push(run_tool(backend, tools, call, cancel).await);
        }
        // A step's results are committed together (one worker frame): bound their images.
        crate::tools::image::bound_step(&mut results);
        let cancelled = cancel.is_cancelled();
        if cancelled {
            results.push(cancelled_notice());
        }
        let leaf = entries.last().map(|e| e.id.clone());
        commit(backend, &mut entries, leaf, results).await?;
        if cancelled {
            return Ok(TurnOutcome::Cancelled);
        }
    }
    let text = format!(
        "Stopped after {} model steps without finishing; send a message to continue.",
        config.max_steps
    );
    let leaf = entries.last().map(|e| e.id.clone());
    commit(
        backend,
        &mut entries,
        leaf,
        vec![EntryBody::Notice { text: text.clone() }],
    )
    .await?;
    Ok(TurnOutcome::Failed(text))
}

impl AgentConfig {
    fn limits(&self) -> compact::Limits {
        compact::Limits {
            context_window: self.context_window,
            compact_at: self.compact_at,
        }
    }
}

/// Summarises the context into a compaction entry at the leaf; a failure ends the turn with
/// a notice and nothing else written.
async fn compact<M: ModelClient, B: SessionBackend>(
    model: &M,
    backend: &B,
    entries: &mut Vec<skiff_protocol::transcript::TranscriptEntry>,
    system: &str,
    config: &AgentConfig,
    cancel: &CancellationToken,
) -> Result<Option<TurnOutcome>, BackendError> {
    backend
        .publish(EventKind::ModelRequest {
            model: config.model_label.clone(),
        })
        .await;
    let summarized = compact::summarize(
        model,
        &config.model,
        system,
        entries,
        config.limits(),
        config.max_output_tokens,
        cancel,
    )
    .await;
    let leaf = entries.last().map(|e| e.id.clone());
    let (body, outcome) = match summarized {
        Ok(compacted) => (compacted.body, None),
        Err(compact::CompactError::Cancelled) => (cancelled_notice(), Some(TurnOutcome::Cancelled)),
        Err(e) => {
            let text =
                format!("The context outgrew the model's window and could not be compacted: {e}");
            (
                EntryBody::Notice { text: text.clone() },
                Some(TurnOutcome::Failed(text)),
            )
        }
    };
    commit(backend, entries, leaf, vec![body]).await?;
    Ok(outcome)
}

fn cancelled_notice() -> EntryBody {
    EntryBody::Notice {
        text: "The run was cancelled.".to_owned(),
    }
}

async fn commit<B: SessionBackend>(
    backend: &B,
    entries: &mut Vec<skiff_protocol::transcript::TranscriptEntry>,
    leaf: Option<EntryId>,
    bodies: Vec<EntryBody>,
) -> Result<(), BackendError> {
    let committed = backend.commit(leaf, bodies).await?;
    for entry in &committed {
        backend
            .publish(EventKind::Entry {
                entry: entry.clone(),
            })
            .await;
    }
    entries.extend(committed);
    Ok(())
}

struct Reply {
    text: String,
    reasoning: Vec<Reasoning>,
    tool_calls: Vec<ToolCall>,
    usage: Usage,
    stop_reason: StopReason,
    error: Option<String>,
}

async fn stream_reply<M: ModelClient, B: SessionBackend>(
    model: &M,
    backend: &B,
    request: ModelRequest,
    cancel: &CancellationToken,
) -> Reply {
    let mut reply = Reply {
        text: String::new(),
        reasoning: Vec::new(),
        tool_calls: Vec::new(),
        usage: Usage::default(),
        stop_reason: StopReason::Other,
        error: None,
    };
    let mut stream = model.stream(request, cancel.clone());
    while let Some(event) = stream.next().await {
        match event {
            ModelEvent::TextDelta { text } => {
                reply.text.push_str(&text);
                backend.publish(EventKind::TextDelta { text }).await;
            }
            ModelEvent::ReasoningDelta { text } => {
                backend.publish(EventKind::ReasoningDelta { text }).await;
            }
            ModelEvent::Reasoning { reasoning } => reply.reasoning.push(reasoning),
            ModelEvent::ToolCall { call } => reply.tool_calls.push(call),
            ModelEvent::Usage { usage } => reply.usage.add(usage),
            ModelEvent::Done { stop_reason } => {
                reply.stop_reason = stop_reason;
                return reply;
            }
            ModelEvent::Error { message, .. } => {
                reply.error = Some(message);
                return reply;
            }
        }
    }
    // A client that ends without a terminal event broke its contract; never hang or guess.
    if cancel.is_cancelled() {
        reply.stop_reason = StopReason::Cancelled;
    } else {
        reply.error = Some("the model stream ended without finishing".to_owned());
    }
    reply
}

/// The system prompt with the agent spec's instructions under their own heading.
fn with_agent_instructions(system: String, extra: Option<&str>) -> String {
    match extra {
        Some(text) if !text.trim().is_empty() => {
            format!("{system}\n\n# Agent instructions\n\n{text}")
        }
        _ => system,
    }
}

async fn run_tool<B: SessionBackend>(
    backend: &B,
    tools: &Tools,
    call: &ToolCall,
    cancel: &CancellationToken,
) -> EntryBody {
    backend
        .publish(EventKind::ToolStarted {
            call_id: call.id.clone(),
            name: call.name.clone(),
            summary: crate::tools::summary(call),
        })
        .await;
    let started = Instant::now();
    let ask = tools.approvals().ask(call, tools.workspace());
    let mut denied = match &ask {
        Some(ask) if !cancel.is_cancelled() => backend.request_approval(ask, cancel).await.err(),
        _ => None,
    };
    // Last, right before it runs: an owner fenced meanwhile (even during a long approval
    // wait) does not start it.
    if denied.is_none() && !cancel.is_cancelled() && tools.allows(&call.name) {
        denied = backend
            .admit_tool(call)
            .await
            .err()
            .map(|why| format!("not run: {why}"));
    }
    let output = if cancel.is_cancelled() {
        crate::tools::ToolOutput::error("not run: the run was cancelled")
    } else if !tools.allows(&call.name) {
        crate::tools::ToolOutput::error(format!(
            "not run: `{}` is not one of this agent's tools",
            call.name
        ))
    } else if let Some(message) = denied {
        crate::tools::ToolOutput::error(message)
    } else if call.name == crate::approval::REQUEST_APPROVAL && ask.is_some() {
        crate::tools::ToolOutput::ok("approved: go ahead")
    } else if crate::tools::runs_on_gateway(&call.name) {
        backend
            .gateway_tool(&call.name, &call.arguments, cancel)
            .await
    } else {
        tools.call(call, cancel).await
    };
    backend
        .publish(EventKind::ToolFinished {
            call_id: call.id.clone(),
            name: call.name.clone(),
            is_error: output.is_error,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
        .await;
    EntryBody::ToolResult {
        call_id: call.id.clone(),
        name: call.name.clone(),
        content: output.content,
        is_error: output.is_error,
        images: output.images,
    }
}
