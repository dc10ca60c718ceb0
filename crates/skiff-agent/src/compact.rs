//! Compaction: when a session's context grows past a share of the model's window (or past
//! what a worker frame carries), the conversation so far is summarised by the same model and
//! the summary becomes an [`EntryBody::Compaction`] entry. The model context restarts there
//! (see `context.rs`); the transcript keeps every entry for people and audit.
//!
//! Where it cuts: a compaction always covers everything before it, and is written at the
//! leaf — before the first request of a turn or between two steps of one. The user's most
//! recent message is kept verbatim inside the compaction entry (`request`), so the model
//! still reads the current request after the summary however long the turn has run.
//!
//! The estimate of a request's size, in tokens: the last reply's real `usage` (its prompt
//! plus its output) plus a quarter of the serialized bytes of what was added since; without a
//! reply since the last compaction, a quarter of the serialized request (system, messages and
//! tools). Bytes/4 is the usual rule of thumb for English and code; it is an estimate, which
//! is why the threshold (`compact_at`) leaves room below the window.
//!
//! Deliberately absent: choosing what to keep by relevance (the model's summary decides), and
//! compacting with a different model than the session's.

use crate::ModelClient;
use futures_util::StreamExt;
use skiff_protocol::model::{
    Image, Message, ModelEvent, ModelRef, ModelRequest, StopReason, Usage,
};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::worker::MAX_FRAME_BYTES;
use std::collections::BTreeSet;
use tokio_util::sync::CancellationToken;

/// The most a serialized model request may weigh before the loop compacts, whatever the
/// window, images aside (they have their own 3 MiB, `tools::MAX_CONTEXT_IMAGE_BYTES`): 3 MiB,
/// so that with its images a worker's model request stays under the gateway's inference-proxy
/// limit for it (7 MiB, under a frame's 8), and the next turn's hand-over (what follows the
/// compaction) fits its frame.
pub const FRAME_BUDGET_BYTES: usize = MAX_FRAME_BYTES * 3 / 8;

/// The default of `[gateway] compact_at`.
pub const DEFAULT_COMPACT_AT: f64 = 0.8;

/// The range `[gateway] compact_at` must lie in.
pub const COMPACT_AT_RANGE: std::ops::RangeInclusive<f64> = 0.1..=0.95;

/// How much of one tool result or argument the summarising model reads.
const CLIP_CHARS: usize = 2_000;

const INSTRUCTION: &str = "The conversation above is about to be replaced by your summary, \
because it no longer fits the context window. Write the summary that you will work from \
afterwards. Include: what the user asked for (their goals and constraints, in their words where \
it matters); the decisions made and why; what has been done so far; what remains to do, with \
the next step; every file path that was read, created or changed; and any facts, names, \
commands, errors or values that must not be lost. Be complete but terse. Reply with the summary \
only.";

/// Why a compaction cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("there is nothing to compact: no messages since the last compaction")]
    Nothing,
    #[error("the compaction call to the model failed: {0}")]
    Model(String),
    #[error("the compaction was cancelled")]
    Cancelled,
    #[error("the model returned an empty summary; nothing was compacted")]
    Empty,
}

/// The limits a context is held to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// The model's context window in tokens (0: unknown, only the frame budget applies).
    pub context_window: u64,
    /// The fraction of the window past which a request compacts first.
    pub compact_at: f64,
}

impl Limits {
    /// The token count past which the context compacts (`None`: no window known).
    pub fn threshold(&self) -> Option<u64> {
        if self.context_window == 0 {
            return None;
        }
        // Precision loss is irrelevant at token counts.
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
        #[allow(clippy::cast_sign_loss)]
        Some((self.context_window as f64 * self.compact_at) as u64)
    }

    /// Whether `request`, built from `entries`, must wait for a compaction.
    pub fn exceeded(&self, request: &ModelRequest, entries: &[TranscriptEntry]) -> bool {
        if !compactable(entries) {
            return false;
        }
        let images: usize = request_images(&request.messages)
            .map(|i| i.data_base64.len())
            .sum();
        if serialized_len(request).saturating_sub(images) > FRAME_BUDGET_BYTES {
            return true;
        }
        self.threshold()
            .is_some_and(|limit| estimate_tokens(request, entries) > limit)
    }
}

/// A compaction, ready to commit.
#[derive(Clone, Debug, PartialEq)]
pub struct Compacted {
    pub body: EntryBody,
    /// The summary's size in tokens (the call's output, or an estimate without usage).
    pub summary_tokens: u64,
}

/// The entries the model context is built from: those from the last compaction on.
pub fn since_last_compaction(entries: &[TranscriptEntry]) -> &[TranscriptEntry] {
    let start = entries
        .iter()
        .rposition(|e| matches!(e.body, EntryBody::Compaction { .. }))
        .unwrap_or(0);
    &entries[start..]
}

/// Whether anything since the last compaction could be summarised (a compaction directly
/// followed by nothing but notices is as small as the context gets).
fn compactable(entries: &[TranscriptEntry]) -> bool {
    since_last_compaction(entries).iter().any(|e| {
        !matches!(
            e.body,
            EntryBody::Notice { .. } | EntryBody::Compaction { .. }
        )
    })
}

/// The estimated size in tokens of `request`, built from `entries` (see the module docs).
pub fn estimate_tokens(request: &ModelRequest, entries: &[TranscriptEntry]) -> u64 {
    let context = since_last_compaction(entries);
    let last_reply = context.iter().rposition(
        |e| matches!(&e.body, EntryBody::AssistantMessage { usage, .. } if usage.input_tokens > 0),
    );
    if let Some(i) = last_reply
        && let EntryBody::AssistantMessage { usage, .. } = &context[i].body
    {
        let added: usize = context[i + 1..]
            .iter()
            .filter(|e| !matches!(e.body, EntryBody::Notice { .. }))
            .map(|e| {
                let images = match &e.body {
                    EntryBody::ToolResult { images, .. } => images.as_slice(),
                    _ => &[],
                };
                serialized_len(&e.body) - image_data_len(images)
            })
            .sum();
        let images: usize = context[i + 1..]
            .iter()
            .map(|e| match &e.body {
                EntryBody::ToolResult { images, .. } => images.len(),
                _ => 0,
            })
            .sum();
        return usage.input_tokens
            + usage.output_tokens
            + bytes_to_tokens(added)
            + image_tokens(images);
    }
    bytes_to_tokens(
        request.system.len() + text_len(&request.messages) + serialized_len(&request.tools),
    ) + image_tokens(request_images(&request.messages).count())
}

/// What a model counts for one image, near enough: Anthropic bills about (width × height) / 750
/// tokens, about 1,600 for an image at its largest unscaled size. Its base64 bytes say nothing
/// about that, and counting them as text would compact at every request that carries one.
const IMAGE_TOKENS: u64 = 1_600;

fn image_tokens(count: usize) -> u64 {
    IMAGE_TOKENS.saturating_mul(u64::try_from(count).unwrap_or(u64::MAX))
}

fn request_images(messages: &[Message]) -> impl Iterator<Item = &Image> {
    messages.iter().flat_map(|m| match m {
        Message::ToolResult { images, .. } => images.as_slice(),
        _ => &[],
    })
}

fn image_data_len(images: &[Image]) -> usize {
    images.iter().map(|i| i.data_base64.len()).sum()
}

/// The serialized size of `messages` without their images' data: images have their own
/// bound ([`crate::tools::MAX_CONTEXT_IMAGE_BYTES`]), beside this budget.
fn text_len(messages: &[Message]) -> usize {
    serialized_len(messages)
        .saturating_sub(request_images(messages).map(|i| i.data_base64.len()).sum())
}

fn bytes_to_tokens(bytes: usize) -> u64 {
    u64::try_from(bytes.div_ceil(4)).unwrap_or(u64::MAX)
}

fn serialized_len<T: serde::Serialize + ?Sized>(value: &T) -> usize {
    serde_json::to_vec(value).map_or(0, |v| v.len())
}

/// Summarises the context of `entries` (root to leaf) with `model` and returns the
/// compaction entry to commit at the leaf. `system` is the session's system prompt; no tools
/// are offered. Nothing is written here: a failure leaves the transcript as it was.
pub async fn summarize<M: ModelClient>(
    model: &M,
    model_ref: &ModelRef,
    system: &str,
    entries: &[TranscriptEntry],
    limits: Limits,
    max_output_tokens: u32,
    cancel: &CancellationToken,
) -> Result<Compacted, CompactError> {
    let context = since_last_compaction(entries);
    if !compactable(entries) {
        return Err(CompactError::Nothing);
    }
    let replaced = context
        .iter()
        .filter(|e| !matches!(e.body, EntryBody::Notice { .. }))
        .count();
    let messages = crate::context::messages(entries);
    let probe = ModelRequest {
        model: model_ref.clone(),
        system: system.to_owned(),
        messages,
        tools: Vec::new(),
        max_output_tokens,
        reasoning: None,
    };
    let tokens_before = estimate_tokens(&probe, entries);
    let budget = prompt_budget(limits, system);
    let request = ModelRequest {
        messages: vec![Message::User {
            text: format!("{}\n\n{INSTRUCTION}", render(context, budget)),
        }],
        ..probe
    };
    let (text, usage) = collect(model, request, cancel).await?;
    let summary = text.trim().to_owned();
    if summary.is_empty() {
        return Err(CompactError::Empty);
    }
    let summary_tokens = if usage.output_tokens > 0 {
        usage.output_tokens
    } else {
        bytes_to_tokens(summary.len())
    };
    Ok(Compacted {
        body: EntryBody::Compaction {
            summary,
            files: touched_files(context),
            request: latest_request(context),
            entries: u64::try_from(replaced).unwrap_or(u64::MAX),
            tokens_before,
            usage,
        },
        summary_tokens,
    })
}

/// The system prompt a turn in `workspace` starts with (its `AGENTS.md` included): what a
/// compaction outside a turn (`skiff session compact`) summarises under.
pub async fn system_prompt(workspace: &crate::tools::Workspace) -> String {
    crate::instructions::load(workspace, None)
        .await
        .system(crate::turn::SYSTEM_PROMPT)
}

/// How many bytes of conversation the summarising request may carry: the threshold's worth
/// (so it fits wherever the context did), never more than the frame budget.
fn prompt_budget(limits: Limits, system: &str) -> usize {
    let by_window = limits.threshold().map_or(usize::MAX, |t| {
        usize::try_from(t.saturating_mul(4)).unwrap_or(usize::MAX)
    });
    by_window
        .min(FRAME_BUDGET_BYTES)
        .saturating_sub(system.len() + INSTRUCTION.len())
        .max(4_096)
}

async fn collect<M: ModelClient>(
    model: &M,
    request: ModelRequest,
    cancel: &CancellationToken,
) -> Result<(String, Usage), CompactError> {
    let mut text = String::new();
    let mut usage = Usage::default();
    let mut stream = model.stream(request, cancel.clone());
    while let Some(event) = stream.next().await {
        match event {
            ModelEvent::TextDelta { text: delta } => text.push_str(&delta),
            ModelEvent::Usage { usage: u } => usage.add(u),
            ModelEvent::ReasoningDelta { .. }
            | ModelEvent::Reasoning { .. }
            | ModelEvent::ToolCall { .. } => {}
            ModelEvent::Done { stop_reason } => {
                return match stop_reason {
                    StopReason::Cancelled => Err(CompactError::Cancelled),
                    _ => Ok((text, usage)),
                };
            }
            ModelEvent::Error { message, .. } => return Err(CompactError::Model(message)),
        }
    }
    if cancel.is_cancelled() {
        return Err(CompactError::Cancelled);
    }
    Err(CompactError::Model(
        "the model stream ended without finishing".to_owned(),
    ))
}

/// The conversation as text for the summarising model, oldest first. Long tool results and
/// arguments are clipped; past `budget` bytes the oldest messages are left out (an earlier
/// summary is always kept).
fn render(context: &[TranscriptEntry], budget: usize) -> String {
    let mut head = String::new();
    let mut parts = Vec::new();
    for entry in context {
        match &entry.body {
            EntryBody::Compaction {
                summary,
                files,
                request,
                ..
            } => {
                head = format!(
                    "## Summary of the conversation before\n{}\n",
                    summary_text(summary, files, request.as_deref())
                );
            }
            EntryBody::UserMessage { text } => parts.push(format!("## User\n{text}\n")),
            EntryBody::AssistantMessage {
                text, tool_calls, ..
            } => {
                let mut part = String::from("## Assistant\n");
                if !text.is_empty() {
                    part.push_str(text);
                    part.push('\n');
                }
                for call in tool_calls {
                    let args = call.arguments.to_string();
                    part.push_str(&format!("[called {} {}]\n", call.name, clip(&args)));
                }
                parts.push(part);
            }
            EntryBody::ToolResult {
                name,
                content,
                is_error,
                ..
            } => {
                let status = if *is_error { ", failed" } else { "" };
                parts.push(format!("## Result of {name}{status}\n{}\n", clip(content)));
            }
            EntryBody::Notice { .. } => {}
        }
    }
    let mut used = head.len();
    let mut kept = 0;
    for part in parts.iter().rev() {
        if used + part.len() > budget {
            break;
        }
        used += part.len();
        kept += 1;
    }
    let omitted = parts.len() - kept;
    let mut out = head;
    if omitted > 0 {
        out.push_str(&format!(
            "[{omitted} earlier message(s) left out: they did not fit]\n"
        ));
    }
    for part in &parts[omitted..] {
        out.push_str(part);
    }
    out
}

fn clip(text: &str) -> String {
    if text.chars().count() <= CLIP_CHARS {
        return text.to_owned();
    }
    let kept: String = text.chars().take(CLIP_CHARS).collect();
    format!("{kept}… [clipped]")
}

/// What the model reads in place of everything before a compaction.
pub(crate) fn summary_text(summary: &str, files: &[String], request: Option<&str>) -> String {
    let mut text =
        format!("Summary of the conversation so far (earlier messages were compacted):\n{summary}");
    if !files.is_empty() {
        text.push_str("\n\nFiles touched so far:\n");
        for file in files {
            text.push_str(&format!("- {file}\n"));
        }
    }
    if let Some(request) = request {
        text.push_str(&format!(
            "\n\nThe user's most recent message, verbatim (the summary says how far it is done):\n{request}"
        ));
    }
    text
}

/// The user's most recent message in `context`, or the one an earlier compaction kept.
fn latest_request(context: &[TranscriptEntry]) -> Option<String> {
    context.iter().rev().find_map(|e| match &e.body {
        EntryBody::UserMessage { text } => Some(text.clone()),
        EntryBody::Compaction { request, .. } => request.clone(),
        _ => None,
    })
}

/// The workspace paths the tool calls in `context` named (and those an earlier compaction
/// listed), sorted and deduplicated.
pub fn touched_files(context: &[TranscriptEntry]) -> Vec<String> {
    let mut files = BTreeSet::new();
    for entry in context {
        match &entry.body {
            EntryBody::Compaction { files: before, .. } => files.extend(before.iter().cloned()),
            EntryBody::AssistantMessage { tool_calls, .. } => {
                for call in tool_calls {
                    match call.name.as_str() {
                        "read" | "write" | "edit" => {
                            if let Some(path) = call.arguments.get("path").and_then(|p| p.as_str())
                            {
                                files.insert(path.to_owned());
                            }
                        }
                        "apply_patch" => {
                            let patch = call.arguments.get("patch").and_then(|p| p.as_str());
                            files.extend(patch.into_iter().flat_map(patch_paths));
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    files.into_iter().collect()
}

fn patch_paths(patch: &str) -> impl Iterator<Item = String> + '_ {
    patch.lines().filter_map(|line| {
        [
            "*** Add File: ",
            "*** Delete File: ",
            "*** Update File: ",
            "*** Move to: ",
        ]
        .iter()
        .find_map(|prefix| line.strip_prefix(prefix))
        .map(|path| path.trim().to_owned())
        .filter(|path| !path.is_empty())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::EntryId;
    use skiff_protocol::model::ToolCall;

    fn entry(n: usize, body: EntryBody) -> TranscriptEntry {
        TranscriptEntry {
            id: EntryId::from_suffix(&format!("e{n}")),
            parent_id: None,
            run_id: None,
            created_at_ms: 0,
            body,
        }
    }

    fn call(name: &str, arguments: serde_json::Value) -> EntryBody {
        EntryBody::AssistantMessage {
            text: String::new(),
            tool_calls: vec![ToolCall {
                id: "c".into(),
                name: name.into(),
                arguments,
            }],
            model: "m".into(),
            usage: Usage::default(),
            stop_reason: StopReason::ToolUse,
            reasoning: Vec::new(),
        }
    }

    #[test]
    fn touched_files_come_from_the_tool_calls_and_the_earlier_compaction() {
        let entries = vec![
            entry(
                0,
                EntryBody::Compaction {
                    summary: "s".into(),
                    files: vec!["old.rs".into()],
                    request: None,
                    entries: 3,
                    tokens_before: 10,
                    usage: Usage::default(),
                },
            ),
            entry(1, call("read", serde_json::json!({"path": "src/lib.rs"}))),
            entry(2, call("exec", serde_json::json!({"command": "cat x"}))),
            entry(
                3,
                call(
                    "apply_patch",
                    serde_json::json!({"patch": "*** Begin Patch\n*** Add File: new.rs\n+x\n*** Update File: src/lib.rs\n*** End Patch"}),
                ),
            ),
        ];
        assert_eq!(touched_files(&entries), ["new.rs", "old.rs", "src/lib.rs"]);
    }

    #[test]
    fn the_oldest_messages_are_left_out_past_the_budget_and_the_earlier_summary_stays() {
        let mut entries = vec![entry(
            0,
            EntryBody::Compaction {
                summary: "EARLIER".into(),
                files: Vec::new(),
                request: None,
                entries: 1,
                tokens_before: 1,
                usage: Usage::default(),
            },
        )];
        for n in 1..=10 {
            entries.push(entry(
                n,
                EntryBody::UserMessage {
                    text: format!("message {n} {}", "x".repeat(100)),
                },
            ));
        }
        let text = render(&entries, 600);
        assert!(text.contains("EARLIER"), "{text}");
        assert!(text.contains("message 10 "), "{text}");
        assert!(!text.contains("message 1 "), "{text}");
        assert!(text.contains("earlier message(s) left out"), "{text}");
    }

    #[test]
    fn real_usage_is_preferred_over_the_byte_estimate() {
        let mut reply = call("read", serde_json::json!({"path": "a"}));
        if let EntryBody::AssistantMessage { usage, .. } = &mut reply {
            usage.input_tokens = 5_000;
            usage.output_tokens = 100;
        }
        let entries = vec![
            entry(0, EntryBody::UserMessage { text: "go".into() }),
            entry(1, reply),
        ];
        let request = ModelRequest {
            model: ModelRef::parse("p/m").unwrap(),
            system: String::new(),
            messages: Vec::new(),
            tools: Vec::new(),
            max_output_tokens: 1,
            reasoning: None,
        };
        assert_eq!(estimate_tokens(&request, &entries), 5_100);
    }
}
