//! Agent dispatch: the gateway-resident `dispatch`, `dispatch_status` and `dispatch_wait`
//! tools. `dispatch` starts a child session on a worker box from the parent's workspace as it
//! is now (uncommitted changes included), on its own branch `skiff/<child-id>`, records the
//! parent on it, and with `wait` returns how the child ended: status, branch, diffstat and
//! final message. A child's failure is a tool result, never a failure of the parent's turn.
//!
//! Deliberately absent: recursion. Only a gateway-placed session that is not itself a child is
//! offered these tools (`Tools::with_dispatch`), and a call from anywhere else — a worker's
//! `tool.gateway` RPC, a child pulled back home — is refused here as well. How many children a
//! session may start is `[gateway] max_children`; the gateway's worker capacity applies too.

use crate::error::{Error, Result};
use crate::{Core, sessions, workspace};
use futures_util::future::BoxFuture;
use serde::Deserialize;
use serde_json::json;
use skiff_agent::tools::{DISPATCH, DISPATCH_STATUS, DISPATCH_WAIT, ToolOutput};
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::{EnvironmentId, SessionId};
use skiff_store::{NewSession, RunRow, Scope, SessionRow};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long `dispatch_wait` waits when the model names no `timeout_s`.
const DEFAULT_WAIT: Duration = Duration::from_secs(30 * 60);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DispatchArgs {
    prompt: String,
    #[serde(default)]
    profile: Option<String>,
    #[serde(default)]
    title: Option<String>,
    #[serde(default = "yes")]
    wait: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusArgs {
    id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WaitArgs {
    id: String,
    #[serde(default)]
    timeout_s: Option<u64>,
}

/// How waiting for a child's run ended.
enum Waited {
    Finished,
    TimedOut,
    Cancelled,
}

impl Core {
    /// Runs one of the dispatch tools for `session`'s turn. Boxed: the child's turn runs the
    /// agent loop whose tools lead back here, and the future's type must not contain itself.
    pub(crate) fn dispatch_tool<'a>(
        self: &'a Arc<Self>,
        scope: &'a Scope,
        session: &'a SessionId,
        env: Option<&'a EnvironmentId>,
        name: &'a str,
        arguments: &'a serde_json::Value,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, ToolOutput> {
        Box::pin(async move {
            let parent = match self.store.session(scope, session) {
                Ok(row) => row,
                Err(e) => return ToolOutput::error(format!("{name} failed: {e}")),
            };
            if env.is_some() || parent.parent_id.is_some() {
                return ToolOutput::error(format!(
                    "{name} is only for sessions placed on the gateway that are not themselves children; this session cannot start children"
                ));
            }
            let done = match name {
                DISPATCH => match parse::<DispatchArgs>(name, arguments) {
                    Ok(args) => self.dispatch_child(scope, &parent, args, cancel).await,
                    Err(e) => return e,
                },
                DISPATCH_STATUS => match parse::<StatusArgs>(name, arguments) {
                    Ok(args) => match self.child_of(scope, &parent, &args.id) {
                        Ok(child) => self.report(scope, &child).await,
                        Err(e) => Err(e),
                    },
                    Err(e) => return e,
                },
                DISPATCH_WAIT => match parse::<WaitArgs>(name, arguments) {
                    Ok(args) => {
                        let limit = args.timeout_s.map_or(DEFAULT_WAIT, Duration::from_secs);
                        match self.child_of(scope, &parent, &args.id) {
                            Ok(child) => {
                                self.wait_and_report(scope, &child, limit, cancel, false)
                                    .await
                            }
                            Err(e) => Err(e),
                        }
                    }
                    Err(e) => return e,
                },
                other => Err(Error::Internal(format!("{other} is not a dispatch tool"))),
            };
            done.unwrap_or_else(|e| ToolOutput::error(format!("{name} failed: {e}")))
        })
    }

    async fn dispatch_child(
        self: &Arc<Self>,
        scope: &Scope,
        parent: &SessionRow,
        args: DispatchArgs,
        cancel: &CancellationToken,
    ) -> Result<ToolOutput> {
        let child = self.start_child(scope, parent, &args).await?;
        if !args.wait {
            let branch = match &child.workspace {
                WorkspaceView::Git { branch, .. } => format!(" on branch {branch}"),
                WorkspaceView::Plain { .. } => String::new(),
            };
            return Ok(ToolOutput::ok(format!(
                "started child session {}{branch}; it runs on its own. Read it with dispatch_status {{\"id\": \"{}\"}} or dispatch_wait {{\"id\": \"{}\"}}.",
                child.id, child.id, child.id
            )));
        }
        // A parent that stops waiting (its turn cancelled or out of time) stops the child too:
        // nobody would read what it did.
        self.wait_and_report(scope, &child, Duration::MAX, cancel, true)
            .await
    }

    /// Creates the child session, placed on a worker, and starts its first turn.
    async fn start_child(
        self: &Arc<Self>,
        scope: &Scope,
        parent: &SessionRow,
        args: &DispatchArgs,
    ) -> Result<SessionRow> {
        sessions::check_prompt(&args.prompt)?;
        let profile = match &args.profile {
            Some(p) => {
                self.check_profile(p)?;
                p.clone()
            }
            None => self
                .envs
                .profile_views()
                .into_iter()
                .next()
                .map(|p| p.name)
                .ok_or_else(|| {
                    Error::BadRequest(
                        "the gateway has no worker profile to run a child on; add a [profiles.NAME] table to skiff.toml".into(),
                    )
                })?,
        };
        // The quick refusals before the slow workspace step (both are checked again, in one
        // transaction, when the row is written).
        let started = self.store.children(scope, &parent.id)?.len() as u64;
        if started >= self.max_children {
            return Err(skiff_store::Error::TooManyChildren {
                parent: parent.id.to_string(),
                max: self.max_children,
            }
            .into());
        }
        self.workers.make_worker_room().await?;
        let id = SessionId::from_suffix(&skiff_store::mint()?);
        // The parent's own workspace is the source: the child starts from its current state,
        // uncommitted changes included, on a branch of the same repository.
        self.workspace_ready(&parent.id).await?;
        let source = Path::new(parent.workspace.path());
        let workspace = workspace::prepare(source, &id, &self.state).await?;
        let new = NewSession {
            id: id.clone(),
            title: args
                .title
                .as_deref()
                .map(sessions::title_of)
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| sessions::title_of(&args.prompt)),
            workspace: workspace.clone(),
            model_ref: parent.model_ref.clone(),
        };
        let max_children = self.max_children;
        let created = self
            .workers
            .claim_worker_slot(|max| {
                self.store.create_child_session(
                    scope,
                    &new,
                    &parent.id,
                    (&profile, max),
                    max_children,
                )
            })
            .await;
        // A child thinks as hard as its parent does.
        let created = match (created, parent.reasoning.as_deref()) {
            (Ok(_), Some(reasoning)) => self
                .store
                .set_session_reasoning(scope, &id, Some(reasoning))
                .map_err(Into::into),
            (created, _) => created,
        };
        let child = match created {
            Ok(row) => row,
            Err(e) => {
                workspace::discard(&workspace).await;
                return Err(e);
            }
        };
        self.audit(
            scope,
            "session.dispatch_child",
            id.as_str(),
            "allowed",
            json!({ "parent": parent.id.as_str(), "profile": profile, "model": parent.model_ref }),
        );
        self.workers.publish_claim(
            scope,
            &id,
            &format!(
                "claimed a worker slot on profile {profile} for a child of session {}",
                parent.id
            ),
        );
        self.record_base(scope, &id, &workspace).await;
        self.start_run_with(
            scope,
            &id,
            EntryBody::UserMessage {
                text: args.prompt.clone(),
            },
        )
        .await?;
        Ok(child)
    }

    /// `id`, when it names a child of `parent`.
    fn child_of(&self, scope: &Scope, parent: &SessionRow, id: &str) -> Result<SessionRow> {
        let not_child = || {
            Error::NotFound(format!(
                "{id} is not a child session of {}; use an id that dispatch returned",
                parent.id
            ))
        };
        let id = SessionId::parse(id).ok_or_else(not_child)?;
        match self.store.session(scope, &id) {
            Ok(child) if child.parent_id.as_ref() == Some(&parent.id) => Ok(child),
            Ok(_) | Err(skiff_store::Error::NotFound { .. }) => Err(not_child()),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits up to `limit` for the child's newest run to end, then reports on it. With
    /// `stop_on_cancel`, the parent's cancellation cancels the child.
    async fn wait_and_report(
        self: &Arc<Self>,
        scope: &Scope,
        child: &SessionRow,
        limit: Duration,
        cancel: &CancellationToken,
        stop_on_cancel: bool,
    ) -> Result<ToolOutput> {
        match self.wait_child(scope, child, limit, cancel).await? {
            Waited::Finished | Waited::TimedOut => self.report(scope, child).await,
            Waited::Cancelled => {
                if stop_on_cancel {
                    self.cancel_open_run(scope, &child.id);
                }
                Ok(ToolOutput::error(format!(
                    "stopped waiting for child session {}: this turn was cancelled",
                    child.id
                )))
            }
        }
    }

    async fn wait_child(
        &self,
        scope: &Scope,
        child: &SessionRow,
        limit: Duration,
        cancel: &CancellationToken,
    ) -> Result<Waited> {
        // Subscribed before the first read: a run that ends after the read is a notice here.
        let mut changes = self.hub.session_changes();
        let deadline = tokio::time::Instant::now().checked_add(limit);
        loop {
            if self
                .newest_run(scope, &child.id)?
                .is_none_or(|r| r.status.is_terminal())
            {
                return Ok(Waited::Finished);
            }
            let expired = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                notice = changes.recv() => match notice {
                    // A lagged receiver missed notices, not state: the loop re-reads.
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        return Err(Error::Internal(
                            "the gateway's session notices ended while a child was awaited".into(),
                        ));
                    }
                },
                () = cancel.cancelled() => return Ok(Waited::Cancelled),
                () = expired => return Ok(Waited::TimedOut),
            }
        }
    }

    fn newest_run(&self, scope: &Scope, session: &SessionId) -> Result<Option<RunRow>> {
        Ok(self.store.runs(scope, session)?.pop())
    }

    /// The child's status, branch, diffstat and final message, as the parent's model reads
    /// them. A child that failed is an error result naming why.
    async fn report(&self, scope: &Scope, child: &SessionRow) -> Result<ToolOutput> {
        let run = self.newest_run(scope, &child.id)?;
        let status = run.as_ref().map_or(RunStatus::Queued, |r| r.status);
        let mut text = format!("child session {}: {status}", child.id);
        if let Some(error) = run.as_ref().and_then(|r| r.error.as_deref()) {
            text.push_str(&format!(" ({error})"));
        }
        text.push('\n');
        match &child.workspace {
            WorkspaceView::Git { branch, .. } => text.push_str(&format!("branch: {branch}\n")),
            WorkspaceView::Plain { path, .. } => {
                text.push_str(&format!("workspace: {path} (not a git repository)\n"));
            }
        }
        if !status.is_terminal() {
            text.push_str("still running; call dispatch_wait to wait for it\n");
            return Ok(ToolOutput::ok(text));
        }
        // The run's own changes (its checkpoint against where the child started): the
        // parent's uncommitted work the child started from is not the child's doing.
        let diff = match &run {
            Some(run) => match self.turn_changes(scope, &child.id, &run.id, true).await {
                Ok(diff) => Ok(diff),
                Err(e) => {
                    tracing::warn!(child = %child.id, error = %e, "no turn diff for a child; reporting the session's");
                    self.session_diff(scope, &child.id, true).await
                }
            },
            None => self.session_diff(scope, &child.id, true).await,
        };
        match diff {
            Ok(diff) => {
                text.push_str(&format!(
                    "diffstat: {} file(s) changed, {} insertion(s)(+), {} deletion(s)(-)\n",
                    diff.files.len(),
                    diff.insertions,
                    diff.deletions
                ));
                for file in &diff.files {
                    let lines = if file.binary {
                        "binary".to_owned()
                    } else {
                        format!("+{} -{}", file.insertions, file.deletions)
                    };
                    text.push_str(&format!(" {} | {lines}\n", file.path));
                }
                for c in &diff.commits {
                    let short = c.commit.get(..12).unwrap_or(&c.commit);
                    text.push_str(&format!("commit: {short} {}\n", c.summary));
                }
            }
            Err(e) => text.push_str(&format!("diffstat: not available ({e})\n")),
        }
        let last = self
            .store
            .transcript(scope, &child.id)?
            .into_iter()
            .rev()
            .find_map(|e| match e.body {
                EntryBody::AssistantMessage { text, .. } if !text.trim().is_empty() => Some(text),
                _ => None,
            });
        text.push_str("final message:\n");
        text.push_str(last.as_deref().unwrap_or("(none)"));
        Ok(if status == RunStatus::Succeeded {
            ToolOutput::ok(text)
        } else {
            ToolOutput::error(text)
        })
    }

    /// Cancels the children of `parent` that are running a turn: cancelling a parent's run
    /// cancels its children.
    pub(crate) fn cancel_children(&self, scope: &Scope, parent: &SessionId) {
        match self.store.children(scope, parent) {
            Ok(children) => {
                for child in children {
                    self.cancel_open_run(scope, &child.id);
                }
            }
            Err(e) => {
                tracing::warn!(%parent, error = %e, "could not read the children to cancel them");
            }
        }
    }

    fn cancel_open_run(&self, scope: &Scope, child: &SessionId) {
        match self.store.open_run(scope, child) {
            Ok(None) => {}
            Ok(Some(_)) => {
                // A run that ended between the read and the cancel is a conflict: nothing to do.
                if let Err(e) = self.cancel(scope, child)
                    && !matches!(e, Error::Conflict(_))
                {
                    tracing::warn!(%child, error = %e, "could not cancel a child session's run");
                }
            }
            Err(e) => tracing::warn!(%child, error = %e, "could not read a child session's run"),
        }
    }
}

fn parse<T: serde::de::DeserializeOwned>(
    name: &str,
    arguments: &serde_json::Value,
) -> std::result::Result<T, ToolOutput> {
    serde_json::from_value(arguments.clone())
        .map_err(|e| ToolOutput::error(format!("invalid arguments for {name}: {e}")))
}
