//! The scripted stand-in model (`api = "scripted"`): replays the turns of a TOML script so that
//! Skiff can be tried and tested without a provider.
//!
//! Turn selection is stateless, the turn being the number of assistant messages in the request,
//! so a request always replays the same turn. It deliberately ignores what was asked.

use crate::drive::Emitter;
use serde::Deserialize;
use serde_json::Value;
use skiff_protocol::model::{Message, ModelEvent, ModelRequest, StopReason, ToolCall, Usage};
use std::time::Duration;

const EXHAUSTED: &str = "The scripted model has no more turns in its script.";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Script {
    /// Pause between streamed text chunks, so a person sees text arrive as from a real model.
    #[serde(default)]
    chunk_delay_ms: u64,
    #[serde(default)]
    turns: Vec<Turn>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Turn {
    #[serde(default)]
    text: String,
    #[serde(default)]
    tool_calls: Vec<ScriptedCall>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptedCall {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

impl Script {
    /// Parses a script; the error is the TOML parser's, which names the line and key.
    pub(crate) fn parse(text: &str) -> Result<Script, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Streams the turn `request` is at and returns how it stopped.
    pub(crate) async fn play(&self, request: &ModelRequest, emitter: &Emitter) -> StopReason {
        let turn = request
            .messages
            .iter()
            .filter(|m| matches!(m, Message::Assistant { .. }))
            .count();
        let (text, calls) = match self.turns.get(turn) {
            Some(t) => (t.text.as_str(), t.tool_calls.as_slice()),
            None => (EXHAUSTED, &[][..]),
        };
        let delay = Duration::from_millis(self.chunk_delay_ms);
        for (i, chunk) in text.split_inclusive(char::is_whitespace).enumerate() {
            if i > 0 {
                tokio::time::sleep(delay).await;
            }
            let text = chunk.to_owned();
            emitter.emit(ModelEvent::TextDelta { text }).await;
        }
        for (i, call) in calls.iter().enumerate() {
            let call = ToolCall {
                id: format!("call_{turn}_{i}"),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            };
            emitter.emit(ModelEvent::ToolCall { call }).await;
        }
        // Words, not tokens: enough for usage displays to move plausibly.
        let usage = Usage {
            input_tokens: words(&request.system)
                + request.messages.iter().map(message_words).sum::<u64>(),
            output_tokens: words(text) + calls.len() as u64,
            ..Usage::default()
        };
        emitter.emit(ModelEvent::Usage { usage }).await;
        if calls.is_empty() {
            StopReason::EndTurn
        } else {
            StopReason::ToolUse
        }
    }
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

fn message_words(message: &Message) -> u64 {
    match message {
        Message::User { text } => words(text),
        Message::Assistant {
            text, tool_calls, ..
        } => words(text) + tool_calls.len() as u64,
        Message::ToolResult { content, .. } => words(content),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_script_parses() {
        let script = Script::parse(include_str!("scripted/demo.toml")).unwrap();
        assert!(!script.turns.is_empty());
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = Script::parse("[[turns]]\ntxt = \"typo\"\n").unwrap_err();
        assert!(err.contains("txt"), "{err}");
    }
}
