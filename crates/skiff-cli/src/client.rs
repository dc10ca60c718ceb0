//! A small client of the gateway API, used by every session command and the demo.

use anyhow::{Context, Result, anyhow};
use futures_util::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use skiff_protocol::SessionId;
use skiff_protocol::api::{
    ApiError, CreateSessionRequest, ErrorCode, RunStarted, RunView, SESSION_PAGE_MAX,
    SendMessageRequest, SessionDetail, SessionList,
};
use skiff_protocol::event::SessionEvent;
use std::path::Path;

/// Why a command failed, for the exit code.
#[derive(Debug)]
pub enum Failure {
    /// The gateway could not be reached (exit 3).
    Unreachable(String),
    /// The gateway refused; the exit code follows the code it gave (`exit_code`).
    Refused(ApiError),
    /// An argument the CLI itself refuses before asking the gateway (exit 2).
    Usage(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Unreachable(m) | Failure::Usage(m) => f.write_str(m),
            Failure::Refused(e) => write!(f, "{} ({})", e.message, e.code),
        }
    }
}

impl std::error::Error for Failure {}

impl Failure {
    /// The exit code `skiff --help` promises for this failure (`EXIT_CODES` in main.rs).
    pub fn exit_code(&self) -> u8 {
        let code = match self {
            Failure::Unreachable(_) => return 3,
            Failure::Usage(_) => return 2,
            Failure::Refused(e) => e.kind(),
        };
        match code {
            Some(
                ErrorCode::BadRequest
                | ErrorCode::Unauthorized
                | ErrorCode::Forbidden
                | ErrorCode::BadWorkspace
                | ErrorCode::BadModel
                | ErrorCode::BadProfile
                | ErrorCode::SyncRefused,
            ) => 2,
            Some(ErrorCode::AtCapacity | ErrorCode::Unavailable) => 3,
            Some(ErrorCode::NotFound) => 4,
            Some(ErrorCode::Conflict | ErrorCode::SessionBusy | ErrorCode::TranscriptConflict) => 5,
            Some(
                ErrorCode::ProviderFailed
                | ErrorCode::BoxUnreachable
                | ErrorCode::BoxNotReady
                | ErrorCode::BoxFailed
                | ErrorCode::PublishFailed,
            ) => 6,
            Some(ErrorCode::Internal) => 7,
            // The user's directory refused the result: what they asked for did not happen.
            Some(ErrorCode::ApplyConflict | ErrorCode::TargetNotEmpty) => 1,
            // A code this build does not know (a newer gateway), or an answer that was not the
            // gateway's JSON.
            None => 1,
        }
    }
}

#[derive(Clone)]
pub struct Client {
    url: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(url: &str, token: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            http: reqwest::Client::new(),
        }
    }

    /// `SKIFF_URL`/`SKIFF_TOKEN` win; then the sign-in of `skiff login` (`login.json`, for its
    /// gateway, unless `SKIFF_URL` names another); otherwise `<state-dir>/gateway.json`.
    pub fn discover(state_dir: &Path) -> Result<Self> {
        let env_url = std::env::var("SKIFF_URL").ok().filter(|s| !s.is_empty());
        let env_token = std::env::var("SKIFF_TOKEN").ok().filter(|s| !s.is_empty());
        if let (Some(url), Some(token)) = (&env_url, &env_token) {
            return Ok(Self::new(url, token));
        }
        if let Some(login) = crate::login::LoginFile::read(state_dir)?
            && env_url
                .as_deref()
                .is_none_or(|u| u.trim_end_matches('/') == login.gateway)
        {
            return Ok(Self::new(&login.gateway, &env_token.unwrap_or(login.token)));
        }
        let path = state_dir.join("gateway.json");
        let file: Option<skiff_gateway::GatewayFile> = match std::fs::read_to_string(&path) {
            Ok(text) => Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("{} is not a valid gateway file", path.display()))?,
            ),
            Err(_) => None,
        };
        let url = env_url.or_else(|| file.as_ref().map(|f| f.url.clone()));
        let token = env_token.or_else(|| file.as_ref().and_then(|f| f.token.clone()));
        match (url, token) {
            (Some(url), Some(token)) => Ok(Self::new(&url, &token)),
            (Some(_), None) if file.is_some() => Err(Failure::Refused(ApiError {
                code: ErrorCode::Unauthorized.as_str().to_owned(),
                message: format!(
                    "{} has the gateway's URL but no token: {}",
                    path.display(),
                    skiff_gateway::JOINED_WITHOUT_TOKEN
                ),
            })
            .into()),
            _ => Err(Failure::Unreachable(format!(
                "no gateway found: {} does not exist. Start one with `skiff gateway`, or set SKIFF_URL and SKIFF_TOKEN",
                path.display()
            ))
            .into()),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The same credentials for the gateway at `url` (gateways on one database share tokens).
    pub fn at(self, url: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            ..self
        }
    }

    /// `POST /v1/gateway/drain`: its lines as they come, the last one the report.
    pub async fn drain(
        &self,
        force: bool,
    ) -> Result<impl Stream<Item = Result<skiff_protocol::drain::DrainLine>> + use<>> {
        let body = skiff_protocol::drain::DrainRequest { force };
        let resp = self
            .post("/v1/gateway/drain", &body)
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| self.unreachable(e))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let err = resp.json::<ApiError>().await.unwrap_or_else(|_| ApiError {
                code: status.as_u16().to_string(),
                message: format!("the drain was refused ({status})"),
            });
            return Err(Failure::Refused(err).into());
        }
        let url = self.url.clone();
        let mut pending = Vec::new();
        Ok(resp.bytes_stream().flat_map(move |chunk| {
            let items: Vec<Result<skiff_protocol::drain::DrainLine>> = match chunk {
                Ok(bytes) => {
                    pending.extend_from_slice(&bytes);
                    let mut lines = Vec::new();
                    while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = pending.drain(..=end).collect();
                        lines.push(
                            serde_json::from_slice(&line)
                                .context("malformed drain progress from the gateway"),
                        );
                    }
                    lines
                }
                Err(e) => vec![Err(anyhow!(Failure::Unreachable(format!(
                    "lost the drain's progress from {url}: {e}"
                ))))],
            };
            futures_util::stream::iter(items)
        }))
    }

    /// Whether the gateway answers at all (`GET /healthz`, no token).
    pub async fn alive(&self) -> bool {
        self.http
            .get(format!("{}/healthz", self.url))
            .timeout(std::time::Duration::from_secs(2))
            .send()
            .await
            .is_ok()
    }

    fn unreachable(&self, e: reqwest::Error) -> anyhow::Error {
        Failure::Unreachable(format!(
            "cannot reach the gateway at {}: {e}. Is `skiff gateway` running?",
            self.url
        ))
        .into()
    }

    pub(crate) async fn send<T: DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
    ) -> Result<T> {
        let resp = req
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| self.unreachable(e))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| self.unreachable(e))?;
        if status.is_success() {
            return serde_json::from_slice(&bytes)
                .with_context(|| format!("unexpected answer from the gateway at {}", self.url));
        }
        let err = serde_json::from_slice::<ApiError>(&bytes).unwrap_or_else(|_| ApiError {
            code: status.as_u16().to_string(),
            message: String::from_utf8_lossy(&bytes).into_owned(),
        });
        Err(Failure::Refused(err).into())
    }

    /// The HTTP client, for a request the helpers below do not shape (a `PUT`).
    pub(crate) fn http(&self) -> &reqwest::Client {
        &self.http
    }

    pub(crate) fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.get(format!("{}{path}", self.url))
    }

    pub(crate) fn delete(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.delete(format!("{}{path}", self.url))
    }

    pub(crate) fn post(&self, path: &str, body: &impl Serialize) -> reqwest::RequestBuilder {
        self.http.post(format!("{}{path}", self.url)).json(body)
    }

    pub async fn create_session(&self, req: &CreateSessionRequest) -> Result<RunStarted> {
        self.send(self.post("/v1/sessions", req)).await
    }

    /// The `limit` most recently active sessions (all without one), read a page at a time;
    /// `next` is set when more exist beyond the limit.
    pub async fn sessions(&self, limit: Option<usize>) -> Result<SessionList> {
        let mut all = SessionList {
            sessions: Vec::new(),
            next: None,
        };
        let mut before: Option<SessionId> = None;
        loop {
            let wanted = limit.map_or(SESSION_PAGE_MAX, |l| l - all.sessions.len());
            let mut path = format!("/v1/sessions?limit={}", wanted.min(SESSION_PAGE_MAX));
            if let Some(id) = &before {
                path.push_str(&format!("&before={id}"));
            }
            let page: SessionList = self.send(self.get(&path)).await?;
            all.sessions.extend(page.sessions);
            all.next = page.next;
            match &all.next {
                Some(next) if limit.is_none_or(|l| all.sessions.len() < l) => {
                    before = Some(next.clone());
                }
                _ => return Ok(all),
            }
        }
    }

    pub async fn session(&self, id: &str) -> Result<SessionDetail> {
        self.send(self.get(&format!("/v1/sessions/{id}"))).await
    }

    pub async fn send_message(&self, id: &str, body: &SendMessageRequest) -> Result<RunStarted> {
        self.send(self.post(&format!("/v1/sessions/{id}/messages"), body))
            .await
    }

    /// Switches a session's agent spec between turns (no turn starts).
    pub async fn switch_agent(
        &self,
        id: &str,
        agent: &str,
    ) -> Result<skiff_protocol::api::SessionView> {
        let body = skiff_protocol::api::SwitchAgentRequest {
            agent: agent.to_owned(),
        };
        self.send(self.post(&format!("/v1/sessions/{id}/agent"), &body))
            .await
    }

    /// Who the token is: its user, role and tenant.
    pub async fn me(&self) -> Result<skiff_protocol::people::Me> {
        self.send(self.get("/v1/me")).await
    }

    /// A one-use login link for the Control UI (`skiff ui`).
    pub async fn ui_ticket(&self) -> Result<skiff_protocol::api::UiTicket> {
        self.send(self.post("/v1/ui/tickets", &serde_json::json!({})))
            .await
    }

    pub async fn cancel(&self, id: &str) -> Result<RunView> {
        self.send(self.post(&format!("/v1/sessions/{id}/cancel"), &serde_json::json!({})))
            .await
    }

    /// The session's events after `after`, live, until the caller stops reading.
    pub async fn events(
        &self,
        id: &SessionId,
        after: u64,
    ) -> Result<impl Stream<Item = Result<SessionEvent>> + use<>> {
        let resp = self
            .get(&format!("/v1/sessions/{id}/events?after={after}"))
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| self.unreachable(e))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let err = resp.json::<ApiError>().await.unwrap_or_else(|_| ApiError {
                code: status.as_u16().to_string(),
                message: format!("the event stream was refused ({status})"),
            });
            return Err(Failure::Refused(err).into());
        }
        let mut parser = skiff_llm::sse::SseParser::default();
        let url = self.url.clone();
        Ok(resp.bytes_stream().flat_map(move |chunk| {
            let items: Vec<Result<SessionEvent>> = match chunk {
                Ok(bytes) => parser
                    .push(&bytes)
                    .into_iter()
                    .map(|e| {
                        serde_json::from_str(&e.data).context("malformed event from the gateway")
                    })
                    .collect(),
                Err(e) => vec![Err(anyhow!(Failure::Unreachable(format!(
                    "lost the event stream from {url}: {e}"
                ))))],
            };
            futures_util::stream::iter(items)
        }))
    }
}
