//! The core's side of placement: the handles it lends the worker side
//! (`worker::handles`), and the API's placement moves — the worker side moves the session,
//! the answer carries the session's view.

use crate::Core;
use crate::error::Result;
use crate::quarantine::{Kept, Refused};
use crate::worker::handles::{Checkpoints, GatewayTools, Runs, TurnSpecs};
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use skiff_agent::approval::Ask;
use skiff_agent::tools::ToolOutput;
use skiff_protocol::api::PlacementMove;
use skiff_protocol::model::{ModelEvent, ModelRef, ModelRequest, ReasoningEffort, Usage};
use skiff_protocol::sync::Refusal;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::TurnAssignment;
use skiff_protocol::{EnvironmentId, RunId, SessionId};
use skiff_store::{RunRow, Scope, SessionRow};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

impl Core {
    /// `POST /v1/sessions/{id}/pull-back`: brings a worker session home (the worker side's
    /// barrier), answered with the session's view.
    pub(crate) async fn pull_back(
        &self,
        scope: &Scope,
        id: &SessionId,
        cancel: bool,
        live_move: bool,
    ) -> Result<PlacementMove> {
        let moved = self.workers.pull_back(scope, id, cancel, live_move).await?;
        self.placement_move(scope, id, moved)
    }

    /// `POST /v1/sessions/{id}/dispatch`: places a session on `profile` now, without a turn.
    pub(crate) async fn dispatch(
        &self,
        scope: &Scope,
        id: &SessionId,
        profile: &str,
        live_move: bool,
    ) -> Result<PlacementMove> {
        let moved = self.workers.dispatch(scope, id, profile, live_move).await?;
        self.placement_move(scope, id, moved)
    }

    /// A move the worker side answered, with the session's view as it is now.
    fn placement_move(
        &self,
        scope: &Scope,
        id: &SessionId,
        m: crate::worker::Moved,
    ) -> Result<PlacementMove> {
        let row = self.store.session(scope, id)?;
        Ok(PlacementMove {
            session: self.session_view(scope, row)?,
            moved: m.moved,
            message: m.message,
            after_cursor: m.after_cursor,
        })
    }
}

impl Runs for Core {
    fn cancel_token(&self, run: &RunId) -> Option<CancellationToken> {
        self.run_cancel_token(run)
    }

    fn cancel(&self, scope: &Scope, id: &SessionId) -> Result<()> {
        Core::cancel(self, scope, id).map(|_| ())
    }

    fn retry<'a>(
        self: Arc<Self>,
        scope: &'a Scope,
        id: &'a SessionId,
        first: EntryBody,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.start_run_with(scope, id, first).await.map(|_| ()) })
    }
}

impl Checkpoints for Core {
    fn checkpoint_turn<'a>(
        &'a self,
        scope: &'a Scope,
        session: &'a SessionRow,
        run: &'a RunId,
        known: Option<&'a skiff_sync::checkpoint::Known>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(Core::checkpoint_turn(self, scope, session, run, known))
    }

    fn quarantine<'a>(&'a self, scope: &'a Scope, r: Refused<'a>) -> BoxFuture<'a, Result<Kept>> {
        Box::pin(Core::quarantine(self, scope, r))
    }

    fn add_to_quarantine(&self, scope: &Scope, kept: &mut Kept, more: &[Refusal]) -> Result<()> {
        Core::add_to_quarantine(self, scope, kept, more)
    }

    fn announce_quarantine(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kept: &Kept,
    ) {
        Core::announce_quarantine(self, scope, session, run, kept);
    }
}

impl TurnSpecs for Core {
    fn assignment(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunRow,
    ) -> Result<TurnAssignment> {
        let model = ModelRef::parse(&run.model_ref).ok_or_else(|| {
            crate::Error::Internal(format!(
                "run {} records a malformed model {:?}",
                run.id, run.model_ref
            ))
        })?;
        let transcript = self.store.transcript(scope, session)?;
        let row = self.store.session(scope, session)?;
        let approval = self.approval_policy(scope, &row);
        let spec = self.session_spec(scope, session)?;
        Ok(TurnAssignment {
            agent_instructions: spec.as_ref().and_then(|s| s.instructions.clone()),
            tools_allowed: spec.and_then(|s| s.tools),
            approval,
            reasoning: row.reasoning.as_deref().and_then(ReasoningEffort::parse),
            run_id: run.id.clone(),
            model_label: self.catalog.describe(&model).label,
            context_window: self.catalog.settings(&model).context_window,
            compact_at: self.compact_at,
            model,
            max_steps: crate::sessions::MAX_STEPS,
            max_output_tokens: crate::sessions::MAX_OUTPUT_TOKENS,
            transcript: skiff_agent::compact::since_last_compaction(&transcript).to_vec(),
            gateway_tools: self.gateway_specs(),
            // Set by whoever hands the turn over, which knows how the workspace's lay-down is.
            wait_for_workspace: false,
        })
    }

    fn session_spec(
        &self,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<Option<skiff_protocol::agent::AgentSpec>> {
        Core::session_spec(self, scope, id)
    }

    fn model_stream(
        &self,
        scope: &Scope,
        session: &SessionId,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        // Decided here, not by the worker: the session's key, as in a local loop.
        let cache_key = crate::backend::prompt_cache_key(session);
        let traced = Some((session.clone(), request.model.to_string()));
        let stream = Core::model_stream(self, scope, session, request, cache_key, cancel);
        self.telemetry.model_stream("worker", traced, stream)
    }

    fn record_usage(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        usage: Usage,
    ) -> Result<()> {
        Core::record_usage(self, scope, session, run, usage)
    }
}

impl GatewayTools for Core {
    fn call<'a>(
        self: Arc<Self>,
        scope: &'a Scope,
        session: &'a SessionId,
        env: &'a EnvironmentId,
        run: Option<&'a RunId>,
        name: &'a str,
        arguments: &'a serde_json::Value,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, ToolOutput> {
        Box::pin(async move {
            self.gateway_tool(scope, session, Some(env), run, name, arguments, cancel)
                .await
        })
    }

    fn ask_approval<'a>(
        &'a self,
        scope: &'a Scope,
        session: &'a SessionId,
        run: &'a RunId,
        ask: &'a Ask,
        requested_by: &'a str,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, std::result::Result<(), String>> {
        Box::pin(Core::ask_approval(
            self,
            scope,
            session,
            run,
            ask,
            requested_by,
            cancel,
        ))
    }
}
