//! Model catalog, provider adapters and the normalized model stream.
//!
//! This is the only crate that sees provider URLs and API keys: everything above it speaks
//! [`ModelRequest`](skiff_protocol::model::ModelRequest) and
//! [`ModelEvent`](skiff_protocol::model::ModelEvent) and names models by
//! [`ModelRef`](skiff_protocol::model::ModelRef). It deliberately knows nothing of sessions, runs,
//! tools or transcripts, and it retries nothing but a busy provider (429/503/529) asking for a
//! short wait before anything was streamed.
//!
//! Module map: `catalog` owns configuration and dispatch, `cache` the prompt-cache key,
//! `http` the transport shared by the HTTP adapters ([`openai`] for Chat Completions,
//! [`responses`] for OpenAI's Responses API, [`anthropic`]), `sse` the
//! event-stream framing, `scripted` the stand-in model, and `drive` the guarantee that every
//! stream ends with exactly one terminal event.

pub mod anthropic;
mod cache;
mod catalog;
mod drive;
mod http;
pub mod openai;
pub mod responses;
mod scripted;
pub mod sse;

pub use cache::CacheKey;
pub use catalog::{Api, Catalog, ModelConfig, ModelSettings, PriceConfig, ProviderConfig};

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

/// Where `api_key = "vault:NAME"` keys are opened: the gateway's vault. Asked at each call, so
/// a secret set or rotated reaches the next request.
pub trait Secrets: Send + Sync + std::fmt::Debug {
    /// The plaintext of secret `name`, or why it cannot be had. The error names the secret
    /// and the key source, never a value.
    fn reveal(
        &self,
        name: &str,
    ) -> std::result::Result<String, Box<dyn std::error::Error + Send + Sync>>;
}

/// Configuration errors found while building or querying the [`Catalog`]. Failures of a model
/// call are not errors of this type: they arrive in the stream as `ModelEvent::Error`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("provider `{provider}`: {problem}")]
    InvalidProvider { provider: String, problem: String },

    #[error("provider `{provider}`: script {}: {problem}", path.display())]
    InvalidScript {
        provider: String,
        path: PathBuf,
        problem: String,
    },

    #[error(
        "model `{model}` is not of the form `provider/model` (for example `scripted/demo`); configured providers: {configured}"
    )]
    MalformedModelRef { model: String, configured: String },

    #[error(
        "model `{model}` names the unknown provider `{provider}`; configured providers: {configured}. Add a `[providers.{provider}]` table to skiff.toml or use one of those"
    )]
    UnknownProvider {
        model: String,
        provider: String,
        configured: String,
    },

    #[error(
        "model `{model}` does not exist: the built-in `scripted` provider only has `scripted/demo`. To replay your own script, configure a provider with `api = \"scripted\"` and a `script` file"
    )]
    UnknownScriptedModel { model: String },

    #[error("{key}: {problem}")]
    InvalidPrice { key: String, problem: String },

    #[error("{key}: {problem}")]
    InvalidModelSetting { key: String, problem: String },

    #[error("default_model: {0}")]
    InvalidDefaultModel(Box<Error>),

    #[error("could not set up the HTTP client for model providers: {0}")]
    HttpClient(reqwest::Error),
}
