//! The streamable-HTTP transport's requests over the workspace's reqwest (rmcp's own reqwest
//! feature would bring a second reqwest): a POST per message answered with JSON or an SSE
//! stream, a GET for the server's stream, a DELETE to end the session. No redirects.

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use http::{HeaderName, HeaderValue};
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
};
use sse_stream::{Sse, SseStream};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

const SESSION_ID: &str = "mcp-session-id";
const LAST_EVENT_ID: &str = "last-event-id";
const ACCEPT_BOTH: &str = "application/json, text/event-stream";

/// A reqwest client without redirects; headers come from `[mcp.NAME]` per request.
#[derive(Clone)]
pub(crate) struct Http(pub reqwest::Client);

type Result<T> = std::result::Result<T, StreamableHttpError<reqwest::Error>>;

fn request(
    mut builder: reqwest::RequestBuilder,
    session_id: Option<&str>,
    auth: Option<String>,
    headers: HashMap<HeaderName, HeaderValue>,
) -> reqwest::RequestBuilder {
    if let Some(token) = auth {
        builder = builder.bearer_auth(token);
    }
    for (name, value) in headers {
        builder = builder.header(name, value);
    }
    if let Some(id) = session_id {
        builder = builder.header(SESSION_ID, id);
    }
    builder
}

fn unexpected(status: reqwest::StatusCode) -> StreamableHttpError<reqwest::Error> {
    StreamableHttpError::UnexpectedServerResponse(Cow::Owned(format!("HTTP {status}")))
}

fn content_type(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
}

fn sse(response: reqwest::Response) -> BoxStream<'static, std::result::Result<Sse, SseError>> {
    SseStream::from_bytes_stream(response.bytes_stream()).boxed()
}

impl StreamableHttpClient for Http {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth: Option<String>,
        headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse> {
        let builder = self
            .0
            .post(uri.as_ref())
            .header(reqwest::header::ACCEPT, ACCEPT_BOTH);
        let response = request(builder, session_id.as_deref(), auth, headers)
            .json(&message)
            .send()
            .await
            .map_err(|e| StreamableHttpError::Client(e.without_url()))?;
        let status = response.status();
        if matches!(
            status,
            reqwest::StatusCode::ACCEPTED | reqwest::StatusCode::NO_CONTENT
        ) {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if status == reqwest::StatusCode::NOT_FOUND && session_id.is_some() {
            return Err(StreamableHttpError::SessionExpired);
        }
        if !status.is_success() {
            return Err(unexpected(status));
        }
        let session = response
            .headers()
            .get(SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        match content_type(&response).as_deref() {
            Some("text/event-stream") => {
                Ok(StreamableHttpPostResponse::Sse(sse(response), session))
            }
            Some("application/json") => {
                let body = response
                    .bytes()
                    .await
                    .map_err(|e| StreamableHttpError::Client(e.without_url()))?;
                if body.is_empty() {
                    return Ok(StreamableHttpPostResponse::Accepted);
                }
                let message: ServerJsonRpcMessage = serde_json::from_slice(&body)?;
                Ok(StreamableHttpPostResponse::Json(message, session))
            }
            _ if response.content_length() == Some(0) => Ok(StreamableHttpPostResponse::Accepted),
            other => Err(StreamableHttpError::UnexpectedContentType(
                other.map(str::to_owned),
            )),
        }
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth: Option<String>,
        headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<()> {
        let response = request(
            self.0.delete(uri.as_ref()),
            Some(&session_id),
            auth,
            headers,
        )
        .send()
        .await
        .map_err(|e| StreamableHttpError::Client(e.without_url()))?;
        let status = response.status();
        if status.is_success() || status == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            Ok(())
        } else {
            Err(unexpected(status))
        }
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth: Option<String>,
        headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxStream<'static, std::result::Result<Sse, SseError>>> {
        let mut builder = self
            .0
            .get(uri.as_ref())
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(id) = last_event_id {
            builder = builder.header(LAST_EVENT_ID, id);
        }
        let response = request(builder, session_id.as_deref(), auth, headers)
            .send()
            .await
            .map_err(|e| StreamableHttpError::Client(e.without_url()))?;
        let status = response.status();
        if status == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Err(StreamableHttpError::ServerDoesNotSupportSse);
        }
        if !status.is_success() {
            return Err(unexpected(status));
        }
        if content_type(&response).as_deref() != Some("text/event-stream") {
            return Err(StreamableHttpError::ServerDoesNotSupportSse);
        }
        Ok(sse(response))
    }
}
