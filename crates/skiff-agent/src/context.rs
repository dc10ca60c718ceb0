//! Turning a transcript into model context.

use skiff_protocol::model::Message;
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};

/// The messages the model sees for a transcript (root to leaf). Notices are for people only;
/// a compaction replaces everything before it with its summary.
pub(crate) fn messages(entries: &[TranscriptEntry]) -> Vec<Message> {
    let mut messages = Vec::with_capacity(entries.len());
    for entry in entries {
        match &entry.body {
            EntryBody::UserMessage { text } => messages.push(Message::User { text: text.clone() }),
            EntryBody::AssistantMessage {
                text, tool_calls, ..
            } => messages.push(Message::Assistant {
                text: text.clone(),
                tool_calls: tool_calls.clone(),
            }),
            EntryBody::ToolResult {
                call_id,
                name,
                content,
                is_error,
            } => messages.push(Message::ToolResult {
                call_id: call_id.clone(),
                name: name.clone(),
                content: content.clone(),
                is_error: *is_error,
            }),
            EntryBody::Notice { .. } => {}
            EntryBody::Compaction { summary } => {
                messages.clear();
                messages.push(Message::User {
                    text: format!("Summary of the conversation so far:\n{summary}"),
                });
            }
        }
    }
    messages
}
