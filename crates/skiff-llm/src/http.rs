//! The HTTP transport shared by the provider adapters: send the request, retry a short
//! `retry-after`, map HTTP failures to normalized errors, read the SSE body under an idle
//! timeout, and keep the API key out of every message.
//!
//! It knows no wire format: an [`Adapter`] builds the body and decodes the events.

use crate::drive::{Emitter, Failure};
use crate::sse::{SseEvent, SseParser};
use crate::{CacheKey, ModelSettings};
use futures_util::StreamExt;
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Client, StatusCode};
use skiff_protocol::model::{ModelErrorKind, ModelEvent, ModelRef, ModelRequest, StopReason};
use std::time::Duration;
use tokio::time::timeout;

/// Longest `retry-after` honoured by waiting. A longer one is reported instead: the person
/// waiting on the session is better placed to decide than a silent pause.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(10);
/// Wait before a retry when the provider did not say how long.
const DEFAULT_RETRY_WAIT: Duration = Duration::from_secs(1);
/// Keys shorter than this are placeholders for local servers (`none`, `x`): scrubbing them
/// would garble messages without protecting anything.
const MIN_REDACTED_KEY_LEN: usize = 8;
/// Provider error bodies can be whole HTML pages from a proxy; a message needs the start only.
const MAX_DETAIL_CHARS: usize = 500;

/// One provider wire format.
pub(crate) trait Adapter: Default + Send {
    /// Appended to the provider's `base_url`.
    const PATH: &'static str;

    /// The body for `request` to a model with `settings` (what it takes, how hard it
    /// reasons, with the session's `--reasoning` already applied); `cache_key` is the
    /// gateway's, for formats that carry one.
    fn request_body(
        request: &ModelRequest,
        settings: &ModelSettings,
        cache_key: Option<&CacheKey>,
    ) -> Vec<u8>;

    /// The provider's own headers; `api_key` is present when the provider is configured with one.
    fn headers(api_key: Option<&str>) -> Vec<(HeaderName, String)>;

    /// Decodes one SSE event into `out`; `Some` once the response is complete. A failure's
    /// message reads as the continuation of "provider `name` …".
    fn decode(
        &mut self,
        event: SseEvent,
        out: &mut Vec<ModelEvent>,
    ) -> Result<Option<StopReason>, Failure>;
}

/// A validated HTTP provider from the catalog.
#[derive(Debug)]
pub(crate) struct HttpProvider {
    pub(crate) name: String,
    /// Without a trailing `/`.
    pub(crate) base_url: String,
    pub(crate) key: Option<KeySource>,
    /// Opens `vault:` keys; the gateway's vault.
    pub(crate) secrets: Option<std::sync::Arc<dyn crate::Secrets>>,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_retries: u32,
}

/// Where a provider's API key is read from at each call.
#[derive(Debug, Clone)]
pub(crate) enum KeySource {
    /// The gateway's environment (`api_key_env = "VAR"` or `api_key = "env:VAR"`).
    Env { var: String },
    /// A secret of the gateway's vault.
    Vault { secret: String },
}

impl KeySource {
    /// Where to look when the key is refused: "OPENAI_API_KEY", "vault secret `openai`".
    fn place(&self) -> String {
        match self {
            KeySource::Env { var, .. } => var.clone(),
            KeySource::Vault { secret } => format!("vault secret `{secret}`"),
        }
    }
}

impl HttpProvider {
    /// Read at call time, not at startup, so that a key set or rotated in the gateway's
    /// environment or vault takes effect without touching the configuration.
    fn api_key(&self) -> Result<Option<String>, Failure> {
        let name = &self.name;
        let missing = |message: String| Failure::new(ModelErrorKind::Configuration, message);
        match &self.key {
            None => Ok(None),
            Some(KeySource::Env { var }) => match std::env::var(var) {
                Ok(key) if !key.trim().is_empty() => Ok(Some(key)),
                _ => Err(missing(format!(
                    "provider `{name}` needs an API key: set {var} in the gateway's environment"
                ))),
            },
            Some(KeySource::Vault { secret }) => {
                let Some(secrets) = &self.secrets else {
                    return Err(missing(format!(
                        "provider `{name}`: providers.{name}.api_key names vault secret `{secret}`, but this process has no vault"
                    )));
                };
                secrets.reveal(secret).map(Some).map_err(|e| {
                    missing(format!(
                        "provider `{name}`: providers.{name}.api_key = \"vault:{secret}\": {e}"
                    ))
                })
            }
        }
    }

    fn idle_failure(&self) -> Failure {
        Failure::new(
            ModelErrorKind::Timeout,
            format!(
                "provider `{name}` sent nothing for {secs}s, so the request was abandoned; if the model is just slow, raise idle_timeout_s in [providers.{name}]",
                name = self.name,
                secs = self.idle_timeout.as_secs(),
            ),
        )
    }
}

/// Calls `provider` with `request`, emitting its events; the API key never appears in a
/// failure's message.
pub(crate) async fn run<A: Adapter>(
    client: &Client,
    provider: &HttpProvider,
    request: &ModelRequest,
    settings: &ModelSettings,
    cache_key: Option<&CacheKey>,
    emitter: &Emitter,
) -> Result<StopReason, Failure> {
    let key = provider.api_key()?;
    let key = key.as_deref();
    let body = A::request_body(request, settings, cache_key);
    exchange::<A>(client, provider, key, request, body, emitter)
        .await
        .map_err(|f| Failure::new(f.kind, redact(&f.message, key)))
}

async fn exchange<A: Adapter>(
    client: &Client,
    provider: &HttpProvider,
    key: Option<&str>,
    request: &ModelRequest,
    body: Vec<u8>,
    emitter: &Emitter,
) -> Result<StopReason, Failure> {
    let name = &provider.name;
    let url = format!("{}{}", provider.base_url, A::PATH);
    let headers = headers::<A>(provider, key)?;

    let mut retries = 0;
    let response = loop {
        let send = client
            .post(&url)
            .headers(headers.clone())
            .body(body.clone())
            .send();
        let response = match timeout(provider.idle_timeout, send).await {
            Err(_) => return Err(provider.idle_failure()),
            Ok(Err(e)) => {
                return Err(Failure::new(
                    ModelErrorKind::Connection,
                    format!(
                        "could not reach provider `{name}` at {url}: {}; check base_url and that the provider is up",
                        chain(&e.without_url())
                    ),
                ));
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if status.is_success() {
            break response;
        }
        let retry_after = retry_after(response.headers());
        let body = timeout(provider.idle_timeout, response.text()).await;
        let detail = match body {
            Ok(Ok(text)) => detail(&text, key),
            _ => None,
        };
        let http = match detail {
            Some(detail) => format!("HTTP {}: {detail}", status_text(status)),
            None => format!("HTTP {}", status_text(status)),
        };
        if !matches!(status.as_u16(), 429 | 503 | 529) {
            return Err(status_failure(provider, status, &http, request));
        }
        let wait = retry_after.unwrap_or(DEFAULT_RETRY_WAIT);
        if wait <= MAX_RETRY_WAIT && retries < provider.max_retries {
            retries += 1;
            tokio::time::sleep(wait).await;
            continue;
        }
        let still = match retries {
            0 => String::new(),
            1 => " and still was after 1 retry".to_owned(),
            n => format!(" and still was after {n} retries"),
        };
        let when = match retry_after {
            Some(wait) if !wait.is_zero() => format!("in {}s", wait.as_secs()),
            _ => "in a minute".to_owned(),
        };
        return Err(Failure::new(
            ModelErrorKind::RateLimited,
            format!(
                "provider `{name}` is rate limiting or overloaded ({http}){still}; try again {when}"
            ),
        ));
    };

    let mut body = response.bytes_stream();
    let mut parser = SseParser::default();
    let mut decoder = A::default();
    let mut out = Vec::new();
    loop {
        let (events, ended) = match timeout(provider.idle_timeout, body.next()).await {
            Err(_) => return Err(provider.idle_failure()),
            Ok(Some(Ok(chunk))) => (parser.push(&chunk), false),
            Ok(Some(Err(e))) => return Err(closed(name, Some(&e))),
            Ok(None) => (std::mem::take(&mut parser).finish(), true),
        };
        for event in events {
            let stop = decoder
                .decode(event, &mut out)
                .map_err(|f| Failure::new(f.kind, format!("provider `{name}` {}", f.message)))?;
            for event in out.drain(..) {
                emitter.emit(event).await;
            }
            if let Some(stop) = stop {
                return Ok(stop);
            }
        }
        if ended {
            return Err(closed(name, None));
        }
    }
}

/// A model's tool-call arguments as JSON. Text that is not JSON is kept as a JSON string, so
/// the agent can report the mistake to the model as a tool error instead of failing the whole
/// response; no text at all means no arguments.
/// `Authorization: Bearer <key>` when there is a key: the OpenAI apis' one header.
pub(crate) fn bearer(api_key: Option<&str>) -> Vec<(HeaderName, String)> {
    api_key
        .map(|key| (reqwest::header::AUTHORIZATION, format!("Bearer {key}")))
        .into_iter()
        .collect()
}

pub(crate) fn tool_arguments(raw: String) -> serde_json::Value {
    if raw.trim().is_empty() {
        return serde_json::Value::Object(serde_json::Map::new());
    }
    serde_json::from_str(&raw).unwrap_or(serde_json::Value::String(raw))
}

/// What a model that takes no images reads after a tool result's text in place of its images
/// (`[providers.NAME.models."MODEL"] images = false`, or a model the defaults do not know).
pub(crate) fn images_not_shown(model: &ModelRef, count: usize) -> String {
    let what = if count == 1 {
        "the image is".to_owned()
    } else {
        format!("the {count} images are")
    };
    format!(
        "({what} not shown: model {model} takes no images; set images = true in \
         [providers.{}.models.\"{}\"] if it does)",
        model.provider(),
        model.model_id()
    )
}

/// The failure for an SSE event an adapter could not decode, quoting the start of its data.
pub(crate) fn malformed(event: &SseEvent, error: &serde_json::Error) -> Failure {
    let mut excerpt: String = event.data.chars().take(200).collect();
    if excerpt.len() < event.data.len() {
        excerpt.push('…');
    }
    Failure::new(
        ModelErrorKind::MalformedResponse,
        format!("sent a malformed stream event ({error}): {excerpt}"),
    )
}

fn headers<A: Adapter>(provider: &HttpProvider, key: Option<&str>) -> Result<HeaderMap, Failure> {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
    for (header, value) in A::headers(key) {
        let mut value = HeaderValue::try_from(value).map_err(|_| {
            Failure::new(
                ModelErrorKind::Configuration,
                format!(
                    "provider `{}`: the value for header `{header}` cannot be sent over HTTP; check the API key in {}",
                    provider.name,
                    provider
                        .key
                        .as_ref()
                        .map_or_else(|| "api_key".to_owned(), KeySource::place),
                ),
            )
        })?;
        // Keeps the key out of reqwest's and hyper's debug output.
        value.set_sensitive(true);
        headers.insert(header, value);
    }
    Ok(headers)
}

fn status_failure(
    provider: &HttpProvider,
    status: StatusCode,
    http: &str,
    request: &ModelRequest,
) -> Failure {
    let name = &provider.name;
    if !status.is_client_error() {
        return Failure::new(
            ModelErrorKind::ProviderFailed,
            format!("provider `{name}` failed ({http}); try again later"),
        );
    }
    let hint = match (status.as_u16(), &provider.key) {
        (401 | 403, Some(key)) => format!("; check the API key in {}", key.place()),
        (401 | 403, None) => {
            format!("; the provider may need an API key: set api_key in [providers.{name}]")
        }
        (404, _) => format!(
            "; check base_url and that the model `{}` exists",
            request.model.model_id()
        ),
        _ => String::new(),
    };
    Failure::new(
        ModelErrorKind::Rejected,
        format!("provider `{name}` rejected the request ({http}){hint}"),
    )
}

fn closed(provider: &str, error: Option<&reqwest::Error>) -> Failure {
    let cause = error.map_or_else(String::new, |e| format!(" ({})", chain(e)));
    Failure::new(
        ModelErrorKind::Connection,
        format!("provider `{provider}`: connection closed before the response finished{cause}"),
    )
}

/// `retry-after` in seconds; the HTTP-date form is not used by model providers.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse().ok().map(Duration::from_secs)
}

fn status_text(status: StatusCode) -> String {
    match status.canonical_reason() {
        Some(reason) => format!("{} {reason}", status.as_u16()),
        None => status.as_u16().to_string(),
    }
}

/// The provider's own explanation from an error body: `error.message` (OpenAI and Anthropic),
/// a bare `error` or `message` string (common in compatible servers), else the text itself.
fn detail(body: &str, key: Option<&str>) -> Option<String> {
    // Redacted before truncating, so that a cut cannot leave part of the key behind.
    let body = redact(body, key);
    let json: Option<serde_json::Value> = serde_json::from_str(&body).ok();
    let message = json.as_ref().and_then(|json| {
        [
            json.pointer("/error/message"),
            json.get("error"),
            json.get("message"),
        ]
        .into_iter()
        .flatten()
        .find_map(serde_json::Value::as_str)
    });
    let text = message.unwrap_or(&body).trim();
    if text.is_empty() {
        return None;
    }
    let mut chars = text.chars();
    let mut detail: String = chars.by_ref().take(MAX_DETAIL_CHARS).collect();
    if chars.next().is_some() {
        detail.push('…');
    }
    Some(detail)
}

fn redact(text: &str, key: Option<&str>) -> String {
    match key {
        Some(key) if key.len() >= MIN_REDACTED_KEY_LEN => text.replace(key, "[redacted]"),
        _ => text.to_owned(),
    }
}

/// An error and its sources, without the repetition hyper's layered errors tend to have.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detail_prefers_the_providers_message_and_redacts_first() {
        let key = Some("sk-secret-123456");
        let openai =
            r#"{"error":{"message":"bad key sk-secret-123456","type":"invalid_request_error"}}"#;
        assert_eq!(detail(openai, key).unwrap(), "bad key [redacted]");
        assert_eq!(detail(r#"{"error":"nope"}"#, key).unwrap(), "nope");
        assert_eq!(detail("  plain text \n", key).unwrap(), "plain text");
        assert_eq!(detail("", key), None);
        let long = "x".repeat(2 * MAX_DETAIL_CHARS);
        assert_eq!(
            detail(&long, None).unwrap().chars().count(),
            MAX_DETAIL_CHARS + 1
        );
    }

    #[test]
    fn placeholder_keys_are_not_scrubbed() {
        assert_eq!(redact("none of it", Some("none")), "none of it");
        assert_eq!(
            redact("a sk-0123456789 b", Some("sk-0123456789")),
            "a [redacted] b"
        );
    }
}
