//! Turning a transcript into model context.

use crate::tools::image::keep_within_budget;
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
    keep_recent_images(&mut messages);
    messages
}

/// The tool calls of the transcript's last step that have no result (its runtime stopped
/// mid-step), as `(call id, tool name)`: the calls of the last assistant message, when only
/// results and notices follow it.
pub(crate) fn unanswered_at_leaf(entries: &[TranscriptEntry]) -> Vec<(String, String)> {
    let mut answered = Vec::new();
    for entry in entries.iter().rev() {
        match &entry.body {
            EntryBody::ToolResult { call_id, .. } => answered.push(call_id.as_str()),
            EntryBody::Notice { .. } => {}
            EntryBody::AssistantMessage { tool_calls, .. } => {
                return tool_calls
                    .iter()
                    .filter(|c| !answered.contains(&c.id.as_str()))
                    .map(|c| (c.id.clone(), c.name.clone()))
                    .collect();
            }
            EntryBody::UserMessage { .. } | EntryBody::Compaction { .. } => break,
        }
    }
    Vec::new()
}

/// What the model reads in place of an image older ones pushed out of the request.
pub(crate) const IMAGE_LEFT_OUT: &str =
    "(the image is no longer shown, to leave room for newer ones; read the file again to see it)";

/// Keeps the newest images up to
/// [`MAX_CONTEXT_IMAGE_BYTES`](crate::tools::image::MAX_CONTEXT_IMAGE_BYTES) of base64 in all, newest first;
/// an older one is replaced by a line saying so. However many images a session reads, its
/// requests stay within what providers and a worker's frame take.
fn keep_recent_images(messages: &mut [Message]) {
    let mut kept = 0usize;
    for message in messages.iter_mut().rev() {
        if let Message::ToolResult {
            content, images, ..
        } = message
        {
            keep_within_budget(content, images, &mut kept, IMAGE_LEFT_OUT);
        }
    }
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
    use crate::tools::image::MAX_CONTEXT_IMAGE_BYTES;
    use skiff_protocol::EntryId;
    use skiff_protocol::model::{Image, StopReason, ToolCall, Usage};

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

    #[test]
    fn only_the_newest_images_that_fit_stay_in_the_context() {
        let big = |tag: &str| Image {
            media_type: "image/png".into(),
            data_base64: tag.repeat(MAX_CONTEXT_IMAGE_BYTES / 2 - 10),
        };
        let mut entries = vec![entry(0, EntryBody::UserMessage { text: "go".into() })];
        for n in 1..=3 {
            let id = format!("c{n}");
            entries.push(entry(
                2 * n,
                EntryBody::AssistantMessage {
                    reasoning: Vec::new(),
                    text: String::new(),
                    tool_calls: vec![ToolCall {
                        id: id.clone(),
                        name: "read".into(),
                        arguments: serde_json::json!({"path": format!("{n}.png")}),
                    }],
                    model: "m".into(),
                    usage: Usage::default(),
                    stop_reason: StopReason::ToolUse,
                },
            ));
            entries.push(entry(
                2 * n + 1,
                EntryBody::ToolResult {
                    call_id: id,
                    name: "read".into(),
                    content: format!("image: {n}.png"),
                    is_error: false,
                    images: vec![big(&n.to_string())],
                },
            ));
        }
        let messages = messages(&entries);
        let results: Vec<(&str, usize)> = messages
            .iter()
            .filter_map(|m| match m {
                Message::ToolResult {
                    content, images, ..
                } => Some((content.as_str(), images.len())),
                _ => None,
            })
            .collect();
        let left_out = format!("image: 1.png\n{IMAGE_LEFT_OUT}");
        assert_eq!(
            results,
            [
                (left_out.as_str(), 0),
                ("image: 2.png", 1),
                ("image: 3.png", 1)
            ]
        );
    }
}
