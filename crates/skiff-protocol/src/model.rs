//! The normalized model conversation: what the agent loop sends to a model and the events it
//! gets back, independent of any provider's wire format.
//!
//! These cross a process boundary (a worker sends a [`ModelRequest`] to the gateway's inference
//! proxy and gets the events back), which is why they live here.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A model reference, `provider/model-id` (for example `anthropic/claude-sonnet-4-5`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModelRef(String);

impl ModelRef {
    /// Parses `provider/model-id`; both halves must be non-empty.
    pub fn parse(s: &str) -> Option<Self> {
        let (provider, model) = s.split_once('/')?;
        let ok = !provider.is_empty()
            && !model.is_empty()
            && !s.chars().any(|c| c.is_whitespace() || c.is_control());
        ok.then(|| Self(s.to_owned()))
    }

    pub fn provider(&self) -> &str {
        self.0.split_once('/').map_or("", |(p, _)| p)
    }

    pub fn model_id(&self) -> &str {
        self.0.split_once('/').map_or("", |(_, m)| m)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ModelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A tool the model may call, with the JSON schema of its arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: Value,
}

/// A tool call as the model made it. `arguments` is the parsed JSON when the model produced
/// valid JSON, else the raw text as a JSON string (the tool then reports the error).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

/// A model's reasoning exactly as its provider returned it, kept so it can be sent back
/// unchanged on the following requests of the turn (providers verify the signatures and the
/// encrypted content, so not one byte may change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reasoning {
    /// An Anthropic `thinking` block.
    Thinking { thinking: String, signature: String },
    /// An Anthropic `redacted_thinking` block: encrypted, never shown.
    RedactedThinking { data: String },
    /// An OpenAI Responses API `reasoning` output item: its summary parts and, when requested,
    /// its encrypted content.
    OpenaiReasoning {
        id: String,
        summary: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        encrypted_content: Option<String>,
    },
}

impl Reasoning {
    /// What a person may read of it: the thinking or the summary; nothing for redacted blocks.
    pub fn readable_text(&self) -> String {
        match self {
            Reasoning::Thinking { thinking, .. } => thinking.clone(),
            Reasoning::RedactedThinking { .. } => String::new(),
            Reasoning::OpenaiReasoning { summary, .. } => summary.join("\n\n"),
        }
    }
}

/// How hard a reasoning model should think: a per-model setting in skiff.toml and the
/// `--reasoning` option. Adapters map it to their provider's knob (Anthropic's thinking budget,
/// OpenAI's reasoning effort).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    Off,
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "off" => Some(Self::Off),
            "low" => Some(Self::Low),
            "medium" => Some(Self::Medium),
            "high" => Some(Self::High),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }
}

/// An image given to the model (a `read` of a PNG, JPEG, GIF or WebP file), base64-encoded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Image {
    /// `image/png`, `image/jpeg`, `image/gif` or `image/webp`.
    pub media_type: String,
    pub data_base64: String,
}

/// One message of the model context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case", deny_unknown_fields)]
pub enum Message {
    User {
        text: String,
    },
    Assistant {
        text: String,
        tool_calls: Vec<ToolCall>,
        /// The response's reasoning, in the order the provider sent it; sent back verbatim.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        reasoning: Vec<Reasoning>,
    },
    ToolResult {
        call_id: String,
        name: String,
        content: String,
        is_error: bool,
        /// Images the tool returned; a model that takes no images gets `content` alone.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<Image>,
    },
}

/// Everything a provider request is built from. The request body is a pure function of this
/// value: the same request gives byte-identical bodies, whichever process builds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRequest {
    pub model: ModelRef,
    pub system: String,
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    pub max_output_tokens: u32,
    /// The session's `--reasoning` choice; `None` leaves it to the model's setting in
    /// skiff.toml (or the adapter's default for the model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningEffort>,
}

/// Token usage of one model response (or the sum of several).
///
/// `input_tokens` is the whole prompt, whichever way the provider billed it: the cache fields
/// say how much of it was read from the provider's prompt cache and how much written to it
/// (each part of `input_tokens`, never beyond it). Absent from transcripts written before
/// prompt caching, hence the defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_read_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
}

impl Usage {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens += other.cache_read_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Why the model stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndTurn,
    ToolUse,
    MaxTokens,
    Cancelled,
    Other,
}

/// What went wrong with a model call, coarse enough for callers to decide on retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelErrorKind {
    /// The provider could not be reached, or the connection dropped mid-response.
    Connection,
    /// The provider answered 429 and retrying did not help (or would wait too long).
    RateLimited,
    /// The provider rejected the request (4xx other than 429).
    Rejected,
    /// The provider failed (5xx).
    ProviderFailed,
    /// The response did not follow the provider's wire format.
    MalformedResponse,
    /// The gateway's own configuration is incomplete (missing key, unknown model).
    Configuration,
    /// The provider sent nothing for too long.
    Timeout,
    /// A token or cost budget is used up; the provider was not asked (`[budgets]`).
    BudgetExhausted,
}

/// The normalized stream every adapter produces. A stream ends with exactly one `Done` or one
/// `Error`; nothing follows either.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelEvent {
    TextDelta {
        text: String,
    },
    /// Readable reasoning as it streams (thinking text, a reasoning summary), for display.
    ReasoningDelta {
        text: String,
    },
    /// A complete reasoning block, to be kept and sent back verbatim.
    Reasoning {
        reasoning: Reasoning,
    },
    /// A complete tool call (argument fragments are assembled by the adapter).
    ToolCall {
        call: ToolCall,
    },
    Usage {
        usage: Usage,
    },
    Done {
        stop_reason: StopReason,
    },
    Error {
        kind: ModelErrorKind,
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ref_needs_both_halves() {
        let r = ModelRef::parse("anthropic/claude-sonnet-4-5").unwrap();
        assert_eq!(r.provider(), "anthropic");
        assert_eq!(r.model_id(), "claude-sonnet-4-5");
        assert!(ModelRef::parse("gpt-4o").is_none());
        assert!(ModelRef::parse("/x").is_none());
        assert!(ModelRef::parse("x/").is_none());
        assert!(ModelRef::parse("a/b c").is_none());
    }

    #[test]
    fn usage_written_before_prompt_caching_still_reads() {
        let old: Usage = serde_json::from_str(r#"{"input_tokens":12,"output_tokens":3}"#).unwrap();
        assert_eq!(old.cache_read_tokens + old.cache_write_tokens, 0);
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"input_tokens":12,"output_tokens":3}"#
        );
    }
}
