//! What the worker side reaches of the rest of the gateway beyond its store, hub and
//! environments: four narrow handles, each a trait the gateway's core implements
//! (`crate::placement`).
//!
//! - [`Runs`]: the runs this process executes — a run's cancel token, the usual cancel of a
//!   session's turn (its child sessions too), and a retried turn.
//! - [`Checkpoints`]: end-of-turn checkpoints and the quarantine of what reconciliation refused.
//! - [`TurnSpecs`]: what a turn runs with — the assignment a worker is handed (spec, policy,
//!   model, gateway tools), the session's pinned spec, the session's model stream (budgets,
//!   catalog, telemetry) and its usage ledger.
//! - [`GatewayTools`]: the gateway-resident tools and the approvals a person gives.
//!
//! They are held weakly: the core owns the worker side, and a worker task must never keep a
//! stopped gateway's core alive. A handle whose core is gone answers "the gateway is shutting
//! down".

use crate::error::{Error, Result};
use crate::quarantine::{Kept, Refused};
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use skiff_agent::approval::Ask;
use skiff_agent::tools::ToolOutput;
use skiff_protocol::model::{ModelEvent, ModelRequest, Usage};
use skiff_protocol::sync::Refusal;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::TurnAssignment;
use skiff_protocol::{EnvironmentId, RunId, SessionId};
use skiff_store::{RunRow, Scope, SessionRow};
use std::sync::{Arc, Weak};
use tokio_util::sync::CancellationToken;

/// The runs this gateway executes.
pub(crate) trait Runs: Send + Sync {
    /// The cancel token of a run this process is executing.
    fn cancel_token(&self, run: &RunId) -> Option<CancellationToken>;
    /// Cancels the session's open run as `session cancel` does (its child sessions too); the
    /// run's own task ends it.
    fn cancel(&self, scope: &Scope, id: &SessionId) -> Result<()>;
    /// Starts a new turn of the session whose first entry is `first` (a turn a gateway
    /// restart orphaned, retried).
    fn retry<'a>(
        self: Arc<Self>,
        scope: &'a Scope,
        id: &'a SessionId,
        first: EntryBody,
    ) -> BoxFuture<'a, Result<()>>;
}

/// End-of-turn checkpoints and the quarantine.
pub(crate) trait Checkpoints: Send + Sync {
    /// Checkpoints the session's workspace at the end of a turn; never fails the turn.
    fn checkpoint_turn<'a>(
        &'a self,
        scope: &'a Scope,
        session: &'a SessionRow,
        run: &'a RunId,
        known: Option<&'a skiff_sync::checkpoint::Known>,
    ) -> BoxFuture<'a, ()>;
    /// Captures what was refused into the session's quarantine.
    fn quarantine<'a>(&'a self, scope: &'a Scope, r: Refused<'a>) -> BoxFuture<'a, Result<Kept>>;
    /// Adds refusals found after the capture to a quarantine.
    fn add_to_quarantine(&self, scope: &Scope, kept: &mut Kept, more: &[Refusal]) -> Result<()>;
    /// Tells the session what was not adopted and how to resolve it.
    fn announce_quarantine(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kept: &Kept,
    );
}

/// What a session's turn runs with.
pub(crate) trait TurnSpecs: Send + Sync {
    /// The assignment that hands `run` to the session's worker.
    fn assignment(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunRow,
    ) -> Result<TurnAssignment>;
    /// The pinned spec a session's turn runs with, checked against its digest.
    fn session_spec(
        &self,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<Option<skiff_protocol::agent::AgentSpec>>;
    /// The session's model call (budgets first, then the catalog with the session's
    /// prompt-cache key), counted as a worker's.
    fn model_stream(
        &self,
        scope: &Scope,
        session: &SessionId,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent>;
    /// Adds a model response's usage to its run and to the usage ledger.
    fn record_usage(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        usage: Usage,
    ) -> Result<()>;
}

/// The gateway-resident tools, and a person's approval of a call.
pub(crate) trait GatewayTools: Send + Sync {
    /// Runs a gateway-resident tool for a worker session on `env`.
    #[allow(
        clippy::too_many_arguments,
        reason = "a gateway tool's call context: who, where, which run, what"
    )]
    fn call<'a>(
        self: Arc<Self>,
        scope: &'a Scope,
        session: &'a SessionId,
        env: &'a EnvironmentId,
        run: Option<&'a RunId>,
        name: &'a str,
        arguments: &'a serde_json::Value,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, ToolOutput>;
    /// Records an approval for `ask` and waits for its outcome: `Ok` when approved, else the
    /// message the model reads as the call's error.
    fn ask_approval<'a>(
        &'a self,
        scope: &'a Scope,
        session: &'a SessionId,
        run: &'a RunId,
        ask: &'a Ask,
        requested_by: &'a str,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, std::result::Result<(), String>>;
}

/// The four handles, as the worker side holds them.
pub(crate) struct Lent {
    pub(crate) runs: Weak<dyn Runs>,
    pub(crate) checkpoints: Weak<dyn Checkpoints>,
    pub(crate) specs: Weak<dyn TurnSpecs>,
    pub(crate) tools: Weak<dyn GatewayTools>,
}

fn gone() -> Error {
    Error::Unavailable("the gateway is shutting down".into())
}

impl Lent {
    pub(crate) fn runs(&self) -> Result<Arc<dyn Runs>> {
        self.runs.upgrade().ok_or_else(gone)
    }

    pub(crate) fn checkpoints(&self) -> Result<Arc<dyn Checkpoints>> {
        self.checkpoints.upgrade().ok_or_else(gone)
    }

    pub(crate) fn specs(&self) -> Result<Arc<dyn TurnSpecs>> {
        self.specs.upgrade().ok_or_else(gone)
    }

    pub(crate) fn tools(&self) -> Result<Arc<dyn GatewayTools>> {
        self.tools.upgrade().ok_or_else(gone)
    }
}

/// The worker side's calls through its handles, named as the gateway's own.
impl super::WorkerSide {
    /// `<state>/tmp`: scratch space of syncs, scans and setup logs.
    pub(super) fn tmp(&self) -> std::path::PathBuf {
        self.tmp_dir.clone()
    }

    /// `<state>/artifacts`: the content-addressed store of logs and checkpoints.
    pub(super) fn artifacts_dir(&self) -> std::path::PathBuf {
        self.artifacts_dir.clone()
    }

    /// Waits until the session's worktree is filled (at once when it is).
    pub(super) async fn workspace_ready(&self, id: &SessionId) -> Result<()> {
        crate::sessions::workspace_ready(&self.fills, id).await
    }

    pub(super) fn notify(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        text: &str,
    ) {
        self.transcript().notify(scope, session, run, text);
    }

    pub(super) fn set_run_status(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        status: skiff_protocol::api::RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        self.transcript()
            .set_run_status(scope, session, run, status, error)
    }

    pub(super) fn run_cancel_token(&self, run: &RunId) -> Option<CancellationToken> {
        self.lent.runs().ok()?.cancel_token(run)
    }

    /// Cancels the session's open run as `session cancel` does.
    pub(super) fn cancel(&self, scope: &Scope, id: &SessionId) -> Result<()> {
        self.lent.runs()?.cancel(scope, id)
    }

    /// Starts a new turn of the session whose first entry is `first`.
    pub(super) async fn start_run_with(
        &self,
        scope: &Scope,
        id: &SessionId,
        first: EntryBody,
    ) -> Result<()> {
        self.lent.runs()?.retry(scope, id, first).await
    }

    pub(super) async fn checkpoint_turn(
        &self,
        scope: &Scope,
        session: &SessionRow,
        run: &RunId,
        known: Option<&skiff_sync::checkpoint::Known>,
    ) {
        match self.lent.checkpoints() {
            Ok(c) => c.checkpoint_turn(scope, session, run, known).await,
            Err(e) => {
                tracing::warn!(session = %session.id, error = %e, "could not checkpoint the session's workspace");
            }
        }
    }

    pub(super) async fn quarantine(&self, scope: &Scope, r: Refused<'_>) -> Result<Kept> {
        self.lent.checkpoints()?.quarantine(scope, r).await
    }

    pub(super) fn add_to_quarantine(
        &self,
        scope: &Scope,
        kept: &mut Kept,
        more: &[Refusal],
    ) -> Result<()> {
        self.lent
            .checkpoints()?
            .add_to_quarantine(scope, kept, more)
    }

    pub(super) fn announce_quarantine(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kept: &Kept,
    ) {
        match self.lent.checkpoints() {
            Ok(c) => c.announce_quarantine(scope, session, run, kept),
            Err(e) => {
                tracing::warn!(%session, error = %e, "could not announce a quarantine");
            }
        }
    }

    pub(super) fn session_spec(
        &self,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<Option<skiff_protocol::agent::AgentSpec>> {
        self.lent.specs()?.session_spec(scope, id)
    }

    pub(super) fn record_usage(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        usage: Usage,
    ) -> Result<()> {
        self.lent.specs()?.record_usage(scope, session, run, usage)
    }

    /// The session's model call, or one error event when the gateway is going.
    pub(super) fn model_stream(
        &self,
        scope: &Scope,
        session: &SessionId,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        match self.lent.specs() {
            Ok(specs) => specs.model_stream(scope, session, request, cancel),
            Err(e) => {
                use futures_util::StreamExt;
                futures_util::stream::iter([ModelEvent::Error {
                    kind: skiff_protocol::model::ModelErrorKind::Connection,
                    message: e.to_string(),
                }])
                .boxed()
            }
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "a gateway tool's call context: who, where, which run, what"
    )]
    pub(super) async fn gateway_tool(
        &self,
        scope: &Scope,
        session: &SessionId,
        env: &EnvironmentId,
        run: Option<&RunId>,
        name: &str,
        arguments: &serde_json::Value,
        cancel: &CancellationToken,
    ) -> ToolOutput {
        match self.lent.tools() {
            Ok(tools) => {
                tools
                    .call(scope, session, env, run, name, arguments, cancel)
                    .await
            }
            Err(e) => ToolOutput::error(format!("not run: {e}")),
        }
    }

    pub(super) async fn ask_approval(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        ask: &Ask,
        requested_by: &str,
        cancel: &CancellationToken,
    ) -> std::result::Result<(), String> {
        match self.lent.tools() {
            Ok(tools) => {
                tools
                    .ask_approval(scope, session, run, ask, requested_by, cancel)
                    .await
            }
            Err(e) => Err(format!("not run: {e}")),
        }
    }
}
