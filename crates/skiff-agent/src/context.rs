//! Turning a transcript into model context.

use skiff_protocol::model::Message;
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};

/// What the model reads for a tool call whose result was never recorded (its runtime died
/// with the call in flight). The call is not run again behind the model's back.
pub(crate) const LOST_RESULT: &str = "no result was recorded for this call: the runtime running it stopped before it finished. \
     Check the workspace before repeating it.";

/// The messages the model sees for a transcript (root to leaf). Notices are for people only;
/// a compaction replaces everything before it with its summary (and the user's latest message). A tool call without a result
/// (its runtime died mid-call) gets an error result, so the context stays valid.
pub(crate) fn messages(entries: &[TranscriptEntry]) -> Vec<Message> {
    let mut messages = Vec::with_capacity(entries.len());
    let mut unanswered: Vec<(String, String)> = Vec::new();
    for entry in entries {
        if !matches!(
            entry.body,
            EntryBody::ToolResult { .. } | EntryBody::Notice { .. }
        ) {
            answer_lost(&mut messages, &mut unanswered);
        }
        match &entry.body {
            EntryBody::UserMessage { text } => messages.push(Message::User { text: text.clone() }),
            EntryBody::AssistantMessage {
                text,
                tool_calls,
                reasoning,
                ..
            } => {
                unanswered = tool_calls
                    .iter()
                    .map(|c| (c.id.clone(), c.name.clone()))
                    .collect();
                messages.push(Message::Assistant {
                    text: text.clone(),
                    tool_calls: tool_calls.clone(),
                    reasoning: reasoning.clone(),
                })
            }
            EntryBody::ToolResult {
                call_id,
                name,
                content,
                is_error,
                images,
            } => {
                unanswered.retain(|(id, _)| id != call_id);
                messages.push(Message::ToolResult {
                    call_id: call_id.clone(),
                    name: name.clone(),
                    content: content.clone(),
                    is_error: *is_error,
                    images: images.clone(),
                })
            }
            EntryBody::Notice { .. } => {}
            EntryBody::Compaction {
                summary,
                files,
                request,
                ..
            } => {
                messages.clear();
                messages.push(Message::User {
                    text: crate::compact::summary_text(summary, files, request.as_deref()),
                });
            }
        }
    }
    answer_lost(&mut messages, &mut unanswered);
    messages
}

fn answer_lost(messages: &mut Vec<Message>, unanswered: &mut Vec<(String, String)>) {
    for (call_id, name) in unanswered.drain(..) {
        messages.push(Message::ToolResult {
            call_id,
            name,
            content: LOST_RESULT.to_owned(),
            is_error: true,
            images: Vec::new(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::EntryId;
    use skiff_protocol::model::{StopReason, ToolCall, Usage};

    fn entry(n: usize, body: EntryBody) -> TranscriptEntry {
        TranscriptEntry {
            id: EntryId::from_suffix(&format!("e{n}")),
            parent_id: None,
            run_id: None,
            created_at_ms: 0,
            body,
        }
    }

    #[test]
    fn a_call_whose_runtime_died_gets_an_error_result() {
        let call = ToolCall {
            id: "c1".into(),
            name: "exec".into(),
            arguments: serde_json::json!({"command": "make"}),
        };
        let entries = vec![
            entry(0, EntryBody::UserMessage { text: "go".into() }),
            entry(
                1,
                EntryBody::AssistantMessage {
                    reasoning: Vec::new(),
                    text: String::new(),
                    tool_calls: vec![call],
                    model: "m".into(),
                    usage: Usage::default(),
                    stop_reason: StopReason::ToolUse,
                },
            ),
            entry(
                2,
                EntryBody::Notice {
                    text: "worker died".into(),
                },
            ),
        ];
        let messages = messages(&entries);
        assert_eq!(messages.len(), 3);
        assert_eq!(
            messages[2],
            Message::ToolResult {
                images: Vec::new(),
                call_id: "c1".into(),
                name: "exec".into(),
                content: LOST_RESULT.into(),
                is_error: true,
            }
        );
    }
}
