//! The transcript: a tree of entries with a leaf pointer per session. The gateway assigns ids
//! and parent ids; writers submit [`EntryBody`] values only.

use crate::ids::{EntryId, RunId};
use crate::model::{Image, Reasoning, ToolCall, Usage};
use serde::{Deserialize, Serialize};

/// The semantic content of an entry; what a writer submits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum EntryBody {
    UserMessage {
        text: String,
    },
    AssistantMessage {
        text: String,
        tool_calls: Vec<ToolCall>,
        model: String,
        usage: Usage,
        stop_reason: crate::model::StopReason,
        /// The response's reasoning, verbatim (absent from entries written before reasoning).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        reasoning: Vec<Reasoning>,
    },
    ToolResult {
        call_id: String,
        name: String,
        content: String,
        is_error: bool,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<Image>,
    },
    /// Something the user should know that is not part of the model context (an error, a
    /// cancellation, lost work).
    Notice {
        text: String,
    },
    /// A summary that replaces everything before it in the model context (the entries stay in
    /// the transcript for people). The fields after `summary` are absent from entries written
    /// before compaction had them.
    Compaction {
        summary: String,
        /// Workspace paths the compacted conversation's tool calls touched, taken from the
        /// calls themselves (not from the summary), sorted.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        files: Vec<String>,
        /// The user's most recent message at the time, verbatim: the model still reads it
        /// after the summary.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<String>,
        /// How many entries the summary replaced.
        #[serde(default)]
        entries: u64,
        /// The estimated size of the context it replaced, in tokens.
        #[serde(default)]
        tokens_before: u64,
        /// What the compaction call cost.
        #[serde(default)]
        usage: Usage,
    },
}

impl EntryBody {
    /// The stable name of this entry's kind, as stored.
    pub fn kind(&self) -> &'static str {
        match self {
            EntryBody::UserMessage { .. } => "user_message",
            EntryBody::AssistantMessage { .. } => "assistant_message",
            EntryBody::ToolResult { .. } => "tool_result",
            EntryBody::Notice { .. } => "notice",
            EntryBody::Compaction { .. } => "compaction",
        }
    }
}

/// A committed entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TranscriptEntry {
    pub id: EntryId,
    pub parent_id: Option<EntryId>,
    pub run_id: Option<RunId>,
    pub created_at_ms: i64,
    pub body: EntryBody,
}
