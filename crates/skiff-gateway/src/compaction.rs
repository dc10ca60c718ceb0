//! Compaction on request: `POST /v1/sessions/{id}/compact` summarises the session's context
//! now, between turns, with the session's own model, and writes the summary as a compaction
//! entry at the leaf (`skiff session compact`). The loop compacts by itself when a context
//! outgrows its window (`skiff_agent::compact`); this is the same step, asked for.
//!
//! It runs on the gateway for every placement: the transcript lives here, and a worker
//! session's next turn is handed only what follows the compaction. Refused while a turn runs
//! (`session_busy`); a turn admitted while the summary is being written wins, and the
//! compaction is refused as a transcript conflict with nothing written.

use crate::Core;
use crate::backend::CatalogClient;
use crate::error::{Error, Result};
use axum::extract::{Path as AxumPath, State};
use axum::routing::post;
use axum::{Extension, Json};
use skiff_agent::compact::{self, CompactError, Limits};
use skiff_protocol::SessionId;
use skiff_protocol::api::CompactResult;
use skiff_protocol::model::ModelRef;
use skiff_store::Scope;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new().route("/v1/sessions/{id}/compact", post(compact_route))
}

async fn compact_route(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    AxumPath(id): AxumPath<String>,
) -> Result<Json<CompactResult>> {
    let id = SessionId::parse(&id)
        .ok_or_else(|| Error::BadRequest(format!("{id:?} is not a session id (ses_…)")))?;
    Ok(Json(core.compact_session(&scope, &id).await?))
}

impl Core {
    /// Summarises `id`'s context into a compaction entry at its leaf.
    pub(crate) async fn compact_session(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<CompactResult> {
        let session = self.store.session(scope, id)?;
        if let Some(run) = self.store.open_run(scope, id)? {
            return Err(skiff_store::Error::SessionBusy {
                session: id.to_string(),
                run: run.id.to_string(),
            }
            .into());
        }
        let model = ModelRef::parse(&session.model_ref).ok_or_else(|| {
            Error::Internal(format!(
                "session {id} records a malformed model {:?}",
                session.model_ref
            ))
        })?;
        self.workspace_ready(&session.id).await?;
        let workspace = skiff_agent::tools::Workspace::new(session.workspace.path().into())
            .map_err(|e| {
                Error::Internal(format!(
                    "workspace {} is gone: {e}",
                    session.workspace.path()
                ))
            })?;
        let system = compact::system_prompt(&workspace).await;
        let entries = self.store.transcript(scope, id)?;
        let limits = Limits {
            context_window: self.catalog.settings(&model).context_window,
            compact_at: self.compact_at,
        };
        let compacted = compact::summarize(
            &CatalogClient::for_session(self.clone(), scope, id),
            &model,
            &system,
            &entries,
            limits,
            crate::sessions::MAX_OUTPUT_TOKENS,
            &CancellationToken::new(),
        )
        .await
        .map_err(|e| match e {
            CompactError::Nothing => Error::Conflict(format!("session {id}: {e}")),
            CompactError::Model(_) | CompactError::Empty | CompactError::Cancelled => {
                Error::Unavailable(format!("session {id} was not compacted: {e}"))
            }
        })?;
        let leaf = entries.last().map(|e| e.id.clone());
        let (count, tokens_before) = match &compacted.body {
            skiff_protocol::transcript::EntryBody::Compaction {
                entries,
                tokens_before,
                ..
            } => (*entries, *tokens_before),
            _ => (0, 0),
        };
        let mut written =
            self.append_entries_published(scope, id, leaf.as_ref(), None, &[compacted.body])?;
        let entry = written
            .pop()
            .ok_or_else(|| Error::Internal("the store wrote no compaction entry".into()))?;
        self.audit(
            scope,
            "session.compact",
            id.as_str(),
            "applied",
            serde_json::json!({"entries": count, "tokens_before": tokens_before}),
        );
        Ok(CompactResult {
            entries: count,
            tokens_before,
            summary_tokens: compacted.summary_tokens,
            entry,
        })
    }
}
