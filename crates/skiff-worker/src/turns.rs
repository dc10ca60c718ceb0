//! The turns a gateway hands this worker, the readiness canary, and credential rotation.

use crate::backend::{RpcBackend, RpcModel};
use crate::link::Link;
use futures_util::StreamExt;
use skiff_agent::tools::{Processes, Tools};
use skiff_agent::{AgentConfig, TurnOutcome, run_turn};
use skiff_protocol::RunId;
use skiff_protocol::model::{Message, ModelEvent, ModelRef, ModelRequest};
use skiff_protocol::worker::{Call, Reply, StreamKind, TurnAssignment, TurnEnd, WorkerFrame};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::{Rules, manifest};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct State {
    workspace: PathBuf,
    running: HashMap<RunId, CancellationToken>,
    /// Runs this worker started; a turn handed over again after a reconnect is not rerun.
    seen: HashSet<RunId>,
}

pub(crate) struct Turns {
    link: Arc<Link>,
    state: Mutex<State>,
    /// The session's background processes: a worker serves one session, so `keep` processes
    /// live across its turns and end with the worker (contained, they die with it).
    processes: Processes,
    /// The lay-down a turn with `wait_for_workspace` waits for.
    gate: crate::gate::Gate,
}

impl Turns {
    pub(crate) fn new(link: Arc<Link>, home: PathBuf) -> Turns {
        Turns {
            link,
            state: Mutex::new(State {
                workspace: home,
                ..State::default()
            }),
            processes: Processes::for_session(),
            gate: crate::gate::Gate::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_workspace(&self, workspace: PathBuf) {
        self.lock().workspace = workspace;
    }

    /// The gateway says how the workspace's lay-down ended.
    pub(crate) fn workspace_laid(&self, error: Option<String>) {
        tracing::info!(?error, "the workspace's lay-down ended");
        self.gate.laid(error.map_or(Ok(()), Err));
    }

    pub(crate) fn start(self: &Arc<Self>, turn: TurnAssignment) {
        let cancel = CancellationToken::new();
        let workspace = {
            let mut state = self.lock();
            if !state.seen.insert(turn.run_id.clone()) {
                tracing::debug!(run = %turn.run_id, "turn already started here");
                return;
            }
            state.running.insert(turn.run_id.clone(), cancel.clone());
            state.workspace.clone()
        };
        let gate = self
            .gate
            .applies(turn.wait_for_workspace)
            .then(|| self.gate.clone());
        if gate.is_some() {
            // The lay-down moves the whole workspace into place in one rename, onto this
            // empty directory: the tools have a root to resolve paths against meanwhile, and
            // nothing runs in it before the gate opens.
            if let Err(e) = std::fs::create_dir_all(&workspace) {
                tracing::warn!(error = %e, "could not make the workspace's directory");
            }
        }
        let this = self.clone();
        tokio::spawn(async move {
            let run = turn.run_id.clone();
            tracing::info!(%run, "turn started");
            let end = this
                .run(turn, workspace.clone(), gate.clone(), &cancel)
                .await;
            // A workspace still being laid down is never scanned: the gateway would take the
            // missing files for deletions.
            let laid = match &gate {
                Some(gate) => tokio::select! {
                    biased;
                    laid = gate.wait() => laid,
                    () = cancel.cancelled() => Err("the turn was cancelled before the workspace was laid onto the box".into()),
                },
                None => Ok(()),
            };
            let scanned = std::time::Instant::now();
            let scanning = async {
                laid?;
                scan(&workspace).await
            };
            let (manifest, manifest_error) = match scanning.await {
                Ok(m) => (Some(m), None),
                Err(why) => (None, Some(why)),
            };
            tracing::debug!(%run, ms = scanned.elapsed().as_millis() as u64, "workspace scanned");
            let reply = this
                .link
                .call(
                    StreamKind::Control,
                    Some(run.clone()),
                    Call::TurnFinish {
                        end,
                        manifest,
                        manifest_error,
                    },
                )
                .await;
            tracing::info!(%run, ?reply, "turn finished");
            this.lock().running.remove(&run);
        });
    }

    async fn run(
        &self,
        turn: TurnAssignment,
        workspace: PathBuf,
        gate: Option<crate::gate::Gate>,
        cancel: &CancellationToken,
    ) -> TurnEnd {
        let approvals = match skiff_agent::approval::Approvals::compile(&turn.approval) {
            Ok(approvals) => approvals,
            Err(e) => {
                return TurnEnd::Failed {
                    error: format!("the session's approval policy is unusable: {e}"),
                };
            }
        };
        let tools = match Tools::new(workspace.clone(), egress_env()) {
            Ok(tools) => tools
                .with_processes(self.processes.clone())
                .with_gateway_tools(turn.gateway_tools)
                .with_approvals(approvals),
            Err(e) => {
                return TurnEnd::Failed {
                    error: format!("the workspace {} is unusable: {e}", workspace.display()),
                };
            }
        };
        // The session's agent spec: tools outside its list are not offered at all.
        let tools = match turn.tools_allowed {
            Some(allowed) => tools.with_allowlist(allowed),
            None => tools,
        };
        let config = AgentConfig {
            model: turn.model,
            model_label: turn.model_label,
            max_steps: turn.max_steps,
            max_output_tokens: turn.max_output_tokens,
            reasoning: turn.reasoning,
            context_window: turn.context_window,
            compact_at: turn.compact_at,
            agent_instructions: turn.agent_instructions,
        };
        let model = RpcModel {
            link: self.link.clone(),
            run: Some(turn.run_id.clone()),
            gate,
        };
        let backend = RpcBackend {
            link: self.link.clone(),
            run: turn.run_id,
            transcript: turn.transcript,
        };
        match run_turn(&model, &backend, &tools, &config, cancel).await {
            TurnOutcome::Completed => TurnEnd::Completed,
            TurnOutcome::Cancelled => TurnEnd::Cancelled,
            TurnOutcome::Failed(error) => TurnEnd::Failed { error },
            // A worker's backend never asks for it: the gateway holds its next model call.
            TurnOutcome::HandedOff => TurnEnd::Failed {
                error: "the turn stopped for a handoff the worker was never told about".into(),
            },
        }
    }

    pub(crate) fn cancel(&self, run: &RunId) {
        if let Some(token) = self.lock().running.get(run) {
            token.cancel();
        }
        // A cancel may arrive before the turn: it must not start afterwards.
        self.lock().seen.insert(run.clone());
    }

    pub(crate) fn cancel_all(&self) {
        for token in self.lock().running.values() {
            token.cancel();
        }
    }

    /// Streams the nonce through the inference proxy and answers with what came back.
    pub(crate) fn canary(&self, nonce: String, model: ModelRef) {
        let link = self.link.clone();
        tokio::spawn(async move {
            let request = ModelRequest {
                model,
                system: String::new(),
                messages: vec![Message::User {
                    text: nonce.clone(),
                }],
                tools: Vec::new(),
                max_output_tokens: 64,
                reasoning: None,
            };
            let model = RpcModel {
                link: link.clone(),
                run: None,
                gate: None,
            };
            let mut stream =
                skiff_agent::ModelClient::stream(&model, request, CancellationToken::new());
            let mut text = String::new();
            while let Some(event) = stream.next().await {
                match event {
                    ModelEvent::TextDelta { text: t } => text.push_str(&t),
                    ModelEvent::Done { .. } | ModelEvent::Error { .. } => break,
                    _ => {}
                }
            }
            link.send_frame(&WorkerFrame::CanaryAnswer { nonce, text });
        });
    }
}

/// What the workspace holds now, for the gateway's reconciliation, or why it cannot be listed
/// (the gateway shows the reason to the user).
async fn scan(workspace: &std::path::Path) -> Result<skiff_protocol::sync::Manifest, String> {
    scan_workspace(workspace).await.map_err(|e| {
        tracing::warn!(error = %e, "could not list the workspace for the gateway");
        e.to_string()
    })
}

/// The manifest of a box workspace as the gateway reconciles it: what a finishing turn
/// reports, and what `skiff box scan` prints when the gateway must capture a box's work
/// without a worker.
pub async fn scan_workspace(
    workspace: &std::path::Path,
) -> Result<skiff_protocol::sync::Manifest, skiff_sync::Error> {
    let mode = if workspace.join(".git").exists() {
        Mode::Git
    } else {
        Mode::Plain
    };
    let rules = Rules::load(workspace)?;
    manifest::scan(
        workspace,
        mode,
        &rules,
        &Limits::default(),
        &CancellationToken::new(),
    )
    .await
}

/// Asks for the next credential when a third of the current one's life is left.
pub(crate) async fn rotate_credentials(link: Arc<Link>) {
    loop {
        let expires = link.credential_expires_at_ms();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        let left = u64::try_from(expires - now).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis((left * 2 / 3).max(1000))).await;
        match link
            .call(StreamKind::Control, None, Call::CredentialRotate {})
            .await
        {
            Reply::Credential {
                credential,
                expires_at_ms,
            } => link.set_credential(credential, expires_at_ms),
            other => tracing::warn!(?other, "credential rotation was refused"),
        }
    }
}

/// The variables that point `exec` at the gateway's egress proxy, when the gateway launched
/// this worker with them (a profile with `egress.agent`); nothing else of the worker's
/// environment reaches a tool.
fn egress_env() -> Vec<(String, String)> {
    const KEYS: [&str; 6] = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
    ];
    KEYS.iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| ((*k).to_owned(), v)))
        .collect()
}
