//! API routes for workspace sync of a session: its checkpoints
//! (`GET /v1/sessions/{id}/checkpoints`), publishing its branch
//! (`POST /v1/sessions/{id}/publish`), and its quarantine (`GET /v1/sessions/{id}/quarantine`,
//! `POST …/quarantine/accept {paths}`, `POST …/quarantine/discard`), and its result coming home
//! (`GET /v1/sessions/{id}/diff?stat=`, `GET …/runs/{run}/changes?stat=`, `POST …/apply {to?}`,
//! `POST …/export {to}`; see `results.rs`), and the newest setup log of a worker session
//! (`GET /v1/sessions/{id}/setup-log`, see `worker/setup.rs`).
//!
//! Publishing is the gateway's own `git push` from the user's repository, with the gateway's
//! credentials (its user's git configuration and ssh agent); a box never holds any. Audited,
//! metadata only.

use crate::Core;
use crate::error::{Error, Result};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use serde_json::json;
use skiff_process::Cmd;
use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::sync::{PublishRequest, PublishResult};
use skiff_store::Scope;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

type Shared = State<Arc<Core>>;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/sessions/{id}/checkpoints", get(checkpoints))
        .route("/v1/sessions/{id}/publish", post(publish))
        .route("/v1/sessions/{id}/quarantine", get(quarantine))
        .route("/v1/sessions/{id}/quarantine/accept", post(accept))
        .route("/v1/sessions/{id}/quarantine/discard", post(discard))
        .route("/v1/sessions/{id}/diff", get(diff))
        .route("/v1/sessions/{id}/runs/{run}/changes", get(turn_changes))
        .route("/v1/sessions/{id}/apply", post(apply))
        .route("/v1/sessions/{id}/export", post(export))
        .route("/v1/sessions/{id}/setup-log", get(setup_log))
}

async fn setup_log(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response> {
    let id = session_id(&id)?;
    Ok(Json(core.workers.setup_log(&scope, &id)?).into_response())
}

type Body<T> = std::result::Result<Json<T>, axum::extract::rejection::JsonRejection>;
type DiffQuery = std::result::Result<
    Query<skiff_protocol::sync::DiffQuery>,
    axum::extract::rejection::QueryRejection,
>;

async fn diff(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    query: DiffQuery,
) -> Result<Response> {
    let Query(q) = query.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    Ok(Json(core.session_diff(&scope, &id, q.stat).await?).into_response())
}

async fn turn_changes(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path((id, run)): Path<(String, String)>,
    query: DiffQuery,
) -> Result<Response> {
    let Query(q) = query.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    let run = skiff_protocol::RunId::parse(&run)
        .ok_or_else(|| Error::BadRequest(format!("{run:?} is not a run id (run_…)")))?;
    Ok(Json(core.turn_changes(&scope, &id, &run, q.stat).await?).into_response())
}

async fn apply(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: Body<skiff_protocol::sync::ApplyRequest>,
) -> Result<Response> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    Ok(Json(core.apply_result(&scope, &id, req.to).await?).into_response())
}

async fn export(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: Body<skiff_protocol::sync::ExportRequest>,
) -> Result<Response> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    Ok(Json(core.export_result(&scope, &id, &req.to).await?).into_response())
}

async fn quarantine(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response> {
    Ok(Json(core.quarantines(&scope, &session_id(&id)?)?).into_response())
}

async fn accept(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: std::result::Result<
        Json<skiff_protocol::sync::AcceptRequest>,
        axum::extract::rejection::JsonRejection,
    >,
) -> Result<Response> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    Ok(Json(core.accept_quarantined(&scope, &id, &req.paths).await?).into_response())
}

async fn discard(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response> {
    Ok(Json(core.discard_quarantine(&scope, &session_id(&id)?)?).into_response())
}

fn session_id(raw: &str) -> Result<SessionId> {
    SessionId::parse(raw)
        .ok_or_else(|| Error::BadRequest(format!("{raw:?} is not a session id (ses_…)")))
}

async fn checkpoints(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response> {
    Ok(Json(core.checkpoints(&scope, &session_id(&id)?)?).into_response())
}

async fn publish(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: std::result::Result<Json<PublishRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    let result = core.publish(&scope, &id, req).await;
    let (decision, detail) = match &result {
        Ok(r) => (
            "applied",
            json!({ "remote": r.remote, "branch": r.branch, "commit": r.commit }),
        ),
        Err(_) => ("failed", json!({})),
    };
    core.audit(&scope, "session.publish", id.as_str(), decision, detail);
    Ok(Json(result?).into_response())
}

/// Git on the user's repository with the gateway's own configuration (credential helpers
/// included), but never prompting, never running the repository's hooks, and never running a
/// command that repository configuration names (an agent's `exec` can write the shared
/// `.git/config`; `-c` on the command line wins over it).
pub(crate) fn git(dir: &str) -> Cmd {
    let mut cmd = Cmd::new("git")
        .args(["-C", dir, "-c", "core.hooksPath=/dev/null"])
        .args([
            "-c",
            "core.sshCommand=ssh",
            "-c",
            "protocol.ext.allow=never",
        ])
        .args([
            "-c",
            "core.fsmonitor=false",
            "-c",
            "uploadpack.packObjectsHook=",
        ])
        .env("GIT_TERMINAL_PROMPT", "0")
        .timeout(Duration::from_secs(300));
    if let Some(sock) = std::env::var_os("SSH_AUTH_SOCK") {
        cmd = cmd.env("SSH_AUTH_SOCK", sock);
    }
    cmd
}

pub(crate) fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(['-', '.'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Core {
    async fn publish(
        &self,
        scope: &Scope,
        id: &SessionId,
        req: PublishRequest,
    ) -> Result<PublishResult> {
        let session = self.store.session(scope, id)?;
        let WorkspaceView::Git { source, branch, .. } = &session.workspace else {
            return Err(Error::Conflict(format!(
                "session {id} works on a plain directory; there is no branch to publish"
            )));
        };
        let cancel = CancellationToken::new();
        let remote = req.remote.unwrap_or_else(|| "origin".into());
        if !plain_name(&remote) {
            return Err(Error::BadRequest(format!(
                "{remote:?} is not a remote name; name a remote configured in {source}"
            )));
        }
        let remotes = git(source)
            .arg("remote")
            .run_checked(&cancel)
            .await
            .map_err(|e| Error::Publish(e.to_string()))?;
        if !remotes.lines().any(|r| r.trim() == remote) {
            return Err(Error::BadRequest(format!(
                "{source} has no remote named {remote}; add one with `git remote add {remote} URL`"
            )));
        }
        let target = req.branch.unwrap_or_else(|| branch.clone());
        let valid = !target.starts_with('-')
            && git(source)
                .args(["check-ref-format", "--branch", &target])
                .run(&cancel)
                .await
                .map(|f| f.status.success())
                .unwrap_or(false);
        if !valid {
            return Err(Error::BadRequest(format!(
                "{target:?} is not a valid branch name"
            )));
        }
        let commit = git(source)
            .args(["rev-parse", "--verify", "--quiet"])
            .arg(format!("refs/heads/{branch}^{{commit}}"))
            .run_checked(&cancel)
            .await
            .map_err(|_| {
                Error::Conflict(format!("the session branch {branch} is gone from {source}"))
            })?
            .trim()
            .to_owned();
        // A remote the gateway has credentials for (a session made with `--repo`, or any
        // repository whose remote matches `[git.credentials]`) is pushed to with them alone.
        let url = crate::remote::remote_url(source, &remote).await;
        let credential = match &url {
            Some(url) => self.git_credentials.resolve(url, &self.vault)?,
            None => None,
        };
        let push = match &credential {
            Some(credential) => crate::remote::git(std::path::Path::new(source), Some(credential)),
            None => git(source),
        };
        push.args(["push", "--quiet", &remote])
            .arg(format!("refs/heads/{branch}:refs/heads/{target}"))
            .run_checked(&cancel)
            .await
            .map_err(|e| match (&url, &credential) {
                (Some(url), Some(_)) => Error::Publish(format!(
                    "pushing {branch} to {remote} as {target} failed: {}",
                    crate::remote::push_error(url, &self.git_credentials, e)
                )),
                _ => Error::Publish(format!(
                    "pushing {branch} to {remote} as {target} failed: {e}"
                )),
            })?;
        Ok(PublishResult {
            session_id: id.clone(),
            remote,
            branch: target,
            commit,
        })
    }
}
