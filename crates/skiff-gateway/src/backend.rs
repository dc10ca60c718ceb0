//! The agent loop's backends for local placement: model calls through the gateway's own
//! catalog, transcript commits into the store, live events into the hub.

use crate::Core;
use futures_util::stream::BoxStream;
use skiff_agent::tools::ToolOutput;
use skiff_agent::{BackendError, ModelClient, SessionBackend};
use skiff_llm::CacheKey;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{ModelEvent, ModelRequest};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{EntryId, RunId, SessionId};
use skiff_store::Scope;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Model calls of one session, through [`Core::model_stream`] (its budgets checked first),
/// with the session's prompt-cache key: the same key the inference proxy gives the session's
/// calls when its loop runs on a worker.
pub(crate) struct CatalogClient {
    pub core: Arc<Core>,
    pub scope: Scope,
    pub session: SessionId,
    pub cache_key: CacheKey,
}

impl CatalogClient {
    pub fn for_session(core: Arc<Core>, scope: &Scope, session: &SessionId) -> Self {
        let cache_key = prompt_cache_key(session);
        Self {
            core,
            scope: scope.clone(),
            session: session.clone(),
            cache_key,
        }
    }
}

/// The one derivation of a session's prompt-cache key, for both placements.
pub(crate) fn prompt_cache_key(session: &SessionId) -> CacheKey {
    CacheKey::for_conversation(session.as_str())
}

impl ModelClient for CatalogClient {
    fn stream(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        let traced = Some((self.session.clone(), request.model.to_string()));
        let stream = self.core.model_stream(
            &self.scope,
            &self.session,
            request,
            self.cache_key.clone(),
            cancel,
        );
        self.core.telemetry.model_stream("gateway", traced, stream)
    }
}

/// Writes one run's transcript entries and events.
pub(crate) struct StoreBackend {
    pub core: Arc<Core>,
    pub scope: Scope,
    pub session: SessionId,
    pub run: RunId,
}

impl SessionBackend for StoreBackend {
    fn handing_off(&self) -> bool {
        matches!(
            self.core.workers.live(&self.session).asked(),
            Some(crate::worker::Handoff::Profile(_))
        )
    }

    async fn transcript(&self) -> Result<Vec<TranscriptEntry>, BackendError> {
        self.core
            .store
            .transcript(&self.scope, &self.session)
            .map_err(|e| BackendError(e.to_string()))
    }

    async fn commit(
        &self,
        base_leaf: Option<EntryId>,
        bodies: Vec<EntryBody>,
    ) -> Result<Vec<TranscriptEntry>, BackendError> {
        let store = &self.core.store;
        // Fenced by the session's lease: a turn whose session was taken over or handed over
        // (a drain) commits nothing more beside the new owner's attempt.
        let (scope, session, run) = (&self.scope, &self.session, Some(&self.run));
        let entries = self
            .core
            .hub
            .fenced_write(session, |fence| match fence {
                Some(fence) => {
                    store.append_entries_fenced(fence, scope, base_leaf.as_ref(), run, &bodies)
                }
                None => store.append_entries(scope, session, base_leaf.as_ref(), run, &bodies),
            })
            .map_err(|e| BackendError(e.to_string()))?;
        for body in &bodies {
            if let EntryBody::AssistantMessage { usage, .. } | EntryBody::Compaction { usage, .. } =
                body
            {
                self.core
                    .record_usage(&self.scope, &self.session, &self.run, *usage)
                    .map_err(|e| BackendError(e.to_string()))?;
            }
        }
        Ok(entries)
    }

    async fn publish(&self, event: EventKind) {
        if let Err(e) = self
            .core
            .hub
            .publish(&self.scope, &self.session, Some(&self.run), event)
        {
            tracing::warn!(session = %self.session, error = %e, "could not record a live event");
        }
    }

    async fn gateway_tool(
        &self,
        name: &str,
        arguments: &serde_json::Value,
        cancel: &CancellationToken,
    ) -> ToolOutput {
        self.core
            .gateway_tool(
                &self.scope,
                &self.session,
                None,
                Some(&self.run),
                name,
                arguments,
                cancel,
            )
            .await
    }

    async fn request_approval(
        &self,
        ask: &skiff_agent::approval::Ask,
        cancel: &CancellationToken,
    ) -> Result<(), String> {
        self.core
            .ask_approval(&self.scope, &self.session, &self.run, ask, "agent", cancel)
            .await
    }
}
