//! A gateway started inside the test process on a temp state dir, and a typed client for its
//! API. No binary is spawned and nothing needs root: what a test proves here is the gateway's
//! own logic (admission, validation, auth, the event stream), in milliseconds.

use futures_util::StreamExt;
use skiff_protocol::SessionId;
use skiff_protocol::api::{
    ApiError, CreateSessionRequest, RunStarted, SendMessageRequest, SessionDetail, SessionList,
};
use skiff_protocol::event::SessionEvent;
use skiff_test_support::{FakeProvider, FakeResponse};
use std::path::PathBuf;

/// A session request for `workspace` on `model` (a gateway session, the model's own reasoning).
pub fn session_request(
    workspace: &std::path::Path,
    model: &str,
    prompt: impl Into<String>,
) -> CreateSessionRequest {
    CreateSessionRequest {
        prompt: prompt.into(),
        workspace: workspace.display().to_string(),
        repo: None,
        model: Some(model.to_owned()),
        profile: None,
        reasoning: None,
        attempts: None,
        approval: None,
        agent: None,
    }
}

/// A gateway for one test. Providers: `fake` (scripted, from the test's script) and, when
/// started with [`TestGateway::with_provider`], `http` (an OpenAI-compatible fake server).
pub struct TestGateway {
    running: Option<skiff_gateway::Running>,
    pub client: Client,
    pub state_dir: PathBuf,
    /// Kept alive as long as the gateway; its recorded requests are the test's evidence.
    pub provider: Option<FakeProvider>,
    dir: tempfile::TempDir,
}

impl TestGateway {
    /// A gateway whose scripted provider `fake` replays `script` (TOML).
    pub async fn start(script: &str) -> TestGateway {
        Self::configured(script, "", None).await
    }

    /// Like [`TestGateway::start`], with an OpenAI-compatible provider `http` served by a
    /// fake that answers `responses` in order.
    pub async fn with_provider(script: &str, responses: Vec<FakeResponse>) -> TestGateway {
        Self::configured(script, "", Some(responses)).await
    }

    /// The general form: `extra_config` is appended to `skiff.toml`; with `responses`, the
    /// provider `http` exists.
    pub async fn configured(
        script: &str,
        extra_config: &str,
        responses: Option<Vec<FakeResponse>>,
    ) -> TestGateway {
        let provider = match responses {
            Some(responses) => Some(FakeProvider::start(responses).await),
            None => None,
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("script.toml"), script).unwrap();
        let mut config =
            String::from("[providers.fake]\napi = \"scripted\"\nscript = \"script.toml\"\n");
        if let Some(provider) = &provider {
            config.push_str(&format!(
                "[providers.http]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\n",
                provider.base_url()
            ));
        }
        config.push_str(extra_config);
        let config_path = dir.path().join("skiff.toml");
        std::fs::write(&config_path, config).unwrap();
        let state_dir = dir.path().join("state");
        let running = skiff_gateway::start(skiff_gateway::Options {
            state_dir: state_dir.clone(),
            listen: "127.0.0.1:0".into(),
            config: Some(config_path),
        })
        .await
        .unwrap();
        let client = Client::new(&running.url, running.token.as_deref().unwrap());
        TestGateway {
            running: Some(running),
            client,
            state_dir,
            provider,
            dir,
        }
    }

    /// A directory of the test's, with `files`, usable as a plain workspace.
    pub fn plain_dir(&self, name: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = self.dir.path().join(name);
        for (path, content) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, content).unwrap();
        }
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    /// Shuts the gateway down and starts a new one in this process on the same state dir and
    /// configuration, the way an embedding program restarts it.
    pub async fn restart(mut self) -> TestGateway {
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
        let running = skiff_gateway::start(skiff_gateway::Options {
            state_dir: self.state_dir.clone(),
            listen: "127.0.0.1:0".into(),
            config: Some(self.dir.path().join("skiff.toml")),
        })
        .await
        .unwrap_or_else(|e| panic!("the gateway did not start again on its state dir: {e}"));
        self.client = Client::new(&running.url, running.token.as_deref().unwrap());
        self.running = Some(running);
        self
    }

    /// Stops the gateway the way `skiff gateway` does on a signal (running turns cancelled).
    pub async fn shutdown(mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
    }
}

/// A refusal, as the API sent it.
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub error: ApiError,
}

/// The API, typed with `skiff-protocol`'s request and response types.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    pub url: String,
    token: String,
}

impl Client {
    pub fn new(url: &str, token: &str) -> Client {
        Client {
            http: reqwest::Client::new(),
            url: url.to_owned(),
            token: token.to_owned(),
        }
    }

    /// The bearer token this client sends.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The same gateway with another bearer token.
    pub fn with_token(&self, token: &str) -> Client {
        Client::new(&self.url, token)
    }

    pub async fn create_session(
        &self,
        request: &CreateSessionRequest,
    ) -> Result<RunStarted, Refused> {
        self.send_json(reqwest::Method::POST, "/v1/sessions", Some(request))
            .await
    }

    pub async fn send_message(&self, id: &SessionId, prompt: &str) -> Result<RunStarted, Refused> {
        let body = SendMessageRequest {
            prompt: prompt.to_owned(),
            profile: None,
            reasoning: None,
            approval: None,
            agent: None,
        };
        self.send(id, &body).await
    }

    /// `POST /v1/sessions/{id}/messages` with the whole request.
    pub async fn send(
        &self,
        id: &SessionId,
        body: &SendMessageRequest,
    ) -> Result<RunStarted, Refused> {
        self.send_json(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/messages"),
            Some(&body),
        )
        .await
    }

    pub async fn session(&self, id: &SessionId) -> Result<SessionDetail, Refused> {
        self.send_json::<(), _>(reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
            .await
    }

    pub async fn sessions(&self) -> Result<SessionList, Refused> {
        self.send_json::<(), _>(reqwest::Method::GET, "/v1/sessions", None)
            .await
    }

    pub async fn cancel(&self, id: &SessionId) -> Result<serde_json::Value, Refused> {
        self.send_json::<(), _>(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/cancel"),
            None,
        )
        .await
    }

    /// `GET /v1/approvals`, optionally one session's.
    pub async fn approvals(
        &self,
        session: Option<&SessionId>,
    ) -> Result<skiff_protocol::approval::ApprovalList, Refused> {
        let path = match session {
            Some(id) => format!("/v1/approvals?session={id}"),
            None => "/v1/approvals".to_owned(),
        };
        self.send_json::<(), _>(reqwest::Method::GET, &path, None)
            .await
    }

    /// `POST /v1/approvals/{id}/approve` or `/deny`.
    pub async fn decide(
        &self,
        id: &skiff_protocol::ApprovalId,
        approve: bool,
        reason: Option<&str>,
    ) -> Result<skiff_protocol::approval::ApprovalView, Refused> {
        let verb = if approve { "approve" } else { "deny" };
        let body = skiff_protocol::approval::DecideApprovalRequest {
            reason: reason.map(str::to_owned),
        };
        self.send_json(
            reqwest::Method::POST,
            &format!("/v1/approvals/{id}/{verb}"),
            Some(&body),
        )
        .await
    }

    /// A request with a raw body (for malformed input): the status and the body as JSON.
    pub async fn raw(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &str,
    ) -> (u16, serde_json::Value) {
        let resp = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.unwrap();
        let json = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
        });
        (status, json)
    }

    /// Follows the session's events from `after` until the run that is going on ends;
    /// returns every event seen, the run's end last.
    pub async fn follow_until_run_end(&self, id: &SessionId, after: u64) -> Vec<SessionEvent> {
        self.follow_until(id, after, |e| e.kind.is_run_end()).await
    }

    /// Follows the session's events from `after` until one satisfies `done`; returns every
    /// event seen, that one last.
    pub async fn follow_until(
        &self,
        id: &SessionId,
        after: u64,
        done: impl Fn(&SessionEvent) -> bool,
    ) -> Vec<SessionEvent> {
        let resp = self
            .http
            .get(format!(
                "{}/v1/sessions/{id}/events?after={after}",
                self.url
            ))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "events: {}", resp.status());
        let mut body = resp.bytes_stream();
        let mut buffer = String::new();
        let mut events = Vec::new();
        while let Some(chunk) = body.next().await {
            buffer.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            while let Some(end) = buffer.find('\n') {
                let line: String = buffer.drain(..=end).collect();
                if let Some(data) = line.trim_end().strip_prefix("data: ") {
                    let event: SessionEvent = serde_json::from_str(data).unwrap();
                    let done = done(&event);
                    events.push(event);
                    if done {
                        return events;
                    }
                }
            }
        }
        panic!("the event stream ended before the run did: {events:?}");
    }

    async fn send_json<B: serde::Serialize, T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, Refused> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(body);
        }
        let resp = request.send().await.unwrap();
        let status = resp.status();
        let bytes = resp.bytes().await.unwrap();
        if status.is_success() {
            Ok(serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("{path}: {e}: {}", String::from_utf8_lossy(&bytes))))
        } else {
            let error = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!(
                    "{path}: a refusal that is not an ApiError ({e}): {}",
                    String::from_utf8_lossy(&bytes)
                )
            });
            Err(Refused {
                status: status.as_u16(),
                error,
            })
        }
    }
}
