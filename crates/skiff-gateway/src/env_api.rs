//! API routes for environments, their snapshots and worker profiles (`/v1/environments`,
//! `/v1/snapshots`, `/v1/profiles`).

use crate::Core;
use crate::error::Error;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Json};
use serde::Deserialize;
use skiff_protocol::environment::{
    CreateEnvironmentRequest, EnvironmentList, ProfileList, SnapshotList, TakeSnapshotRequest,
};
use skiff_protocol::{EnvironmentId, SnapshotId};
use skiff_store::{Scope, Sight};
use std::sync::Arc;

type Shared = State<Arc<Core>>;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/profiles", get(profiles))
        .route("/v1/environments", get(list).post(create))
        .route("/v1/environments/sweep", post(sweep))
        .route("/v1/environments/{id}", get(show).delete(destroy))
        .route("/v1/environments/{id}/check", post(check))
        .route("/v1/environments/{id}/exec", post(exec))
        .route("/v1/environments/{id}/snapshot", post(take_snapshot))
        .route("/v1/snapshots", get(snapshots))
        .route("/v1/snapshots/{id}", delete(delete_snapshot))
}

fn snapshot_id(raw: &str) -> Result<SnapshotId, Error> {
    SnapshotId::parse(raw).ok_or_else(|| {
        Error::BadRequest(format!(
            "{raw:?} is not a snapshot id (`snap_` and 16 lowercase hex characters)"
        ))
    })
}

fn env_id(raw: &str) -> Result<EnvironmentId, Error> {
    EnvironmentId::parse(raw)
        .ok_or_else(|| Error::BadRequest(format!("{raw:?} is not an environment id (env_…)")))
}

async fn profiles(State(core): Shared) -> Json<ProfileList> {
    Json(ProfileList {
        profiles: core.envs.profile_views(),
    })
}

async fn list(State(core): Shared, Extension(sight): Extension<Sight>) -> Result<Response, Error> {
    Ok(Json(EnvironmentList {
        environments: core
            .envs
            .list(&sight)?
            .into_iter()
            .map(|v| core.workers.with_worker(v))
            .collect(),
    })
    .into_response())
}

#[derive(Deserialize)]
struct CreateQuery {
    #[serde(default)]
    reuse: bool,
}

async fn create(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Query(q): Query<CreateQuery>,
    body: Result<Json<CreateEnvironmentRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let view = match &req.from_snapshot {
        Some(snapshot) => core
            .envs
            .create_from_snapshot(&scope, &req.profile, snapshot)?,
        None => core.envs.create(&scope, &req.profile, q.reuse).await?,
    };
    Ok((StatusCode::ACCEPTED, Json(view)).into_response())
}

/// Snapshots a box prepared by hand. Without a key the snapshot gets one of its own: only
/// `env create --from-snapshot` starts boxes from it.
async fn take_snapshot(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: Result<Json<TakeSnapshotRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, Error> {
    use crate::environments::{Captured, SnapshotKey, snapshot_view};
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = env_id(&id)?;
    let key = match &req.key {
        Some(text) => SnapshotKey::parse(text).ok_or_else(|| {
            Error::BadRequest(format!(
                "key {text:?} is not 1 to 128 lowercase hex characters"
            ))
        })?,
        None => SnapshotKey::derive(&[
            b"manual",
            id.as_str().as_bytes(),
            &skiff_store::now_ms().to_le_bytes(),
        ]),
    };
    core.audit(
        &scope,
        "snapshot.create",
        id.as_str(),
        "allowed",
        serde_json::json!({ "key_given": req.key.is_some() }),
    );
    match core.envs.capture(&scope, &id, &key).await? {
        Captured::Kept(row) => Ok((StatusCode::CREATED, Json(snapshot_view(&row))).into_response()),
        Captured::Unsupported(e) => Err(Error::Provider(e)),
        Captured::OverBudget {
            size_bytes,
            budget_bytes,
        } => Err(Error::Conflict(format!(
            "the snapshot of {id} took {size_bytes} bytes, more than its profile's whole snapshot_budget ({budget_bytes} bytes), and was deleted again; raise snapshot_budget to keep it"
        ))),
    }
}

async fn snapshots(
    State(core): Shared,
    Extension(sight): Extension<Sight>,
) -> Result<Response, Error> {
    Ok(Json(SnapshotList {
        snapshots: core.envs.snapshot_views(&sight)?,
    })
    .into_response())
}

async fn delete_snapshot(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response, Error> {
    let id = snapshot_id(&id)?;
    match core.envs.delete_snapshot(&scope, &id).await {
        Ok(deleted) => {
            core.audit(
                &scope,
                "snapshot.delete",
                id.as_str(),
                "applied",
                serde_json::json!({ "size_bytes": deleted.size_bytes }),
            );
            Ok(Json(deleted).into_response())
        }
        Err(e) => {
            core.audit(
                &scope,
                "snapshot.delete",
                id.as_str(),
                "error",
                serde_json::json!({ "error": e.to_string() }),
            );
            Err(e)
        }
    }
}

async fn show(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response, Error> {
    Ok(Json(
        core.workers
            .with_worker(core.envs.show(&scope, &env_id(&id)?)?),
    )
    .into_response())
}

#[derive(Deserialize)]
struct DestroyQuery {
    #[serde(default)]
    force: bool,
}

async fn destroy(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    Query(q): Query<DestroyQuery>,
) -> Result<Response, Error> {
    let id = env_id(&id)?;
    if q.force {
        // Sessions on the box learn why it went: their placements are reclaimed first.
        core.store.environment(&scope, &id)?;
        for session in core.store.sessions_on_environment(&id)? {
            core.workers
                .reclaim(&scope, &session, "its box was destroyed by an operator")
                .await;
        }
    }
    Ok(Json(core.envs.destroy(&scope, &id, q.force).await?).into_response())
}

async fn check(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Response, Error> {
    let id = env_id(&id)?;
    let view = core.envs.check(&scope, &id).await?;
    if view.state == skiff_protocol::environment::EnvironmentState::Failed {
        // A failed box cannot run its sessions' turns: their placements are reclaimed now,
        // not left `active` until someone destroys the box by hand.
        let why = format!(
            "its box failed a check: {}",
            view.error.as_deref().unwrap_or("no reason recorded")
        );
        for session in core.store.sessions_on_environment(&id)? {
            core.workers.reclaim(&scope, &session, &why).await;
        }
    }
    // What the check found (the reclaim above may already be tearing the box down).
    Ok(Json(core.workers.with_worker(view)).into_response())
}

async fn exec(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
    body: std::result::Result<
        Json<skiff_protocol::environment::ExecRequest>,
        axum::extract::rejection::JsonRejection,
    >,
) -> Result<Response, Error> {
    let Json(body) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let output = core.envs.exec(&scope, &env_id(&id)?, &body.command).await?;
    Ok(Json(skiff_protocol::environment::ExecResult { output }).into_response())
}

/// The sweep looks at every tenant's leases, so only the admin may start it.
async fn sweep(State(core): Shared, Extension(scope): Extension<Scope>) -> Result<Response, Error> {
    if !crate::people::gateway_admin(&core, &scope) {
        core.audit(
            &scope,
            "environment.sweep",
            "-",
            "denied",
            serde_json::json!({}),
        );
        return Err(Error::Forbidden(
            "only the gateway's admin may sweep orphaned leases".into(),
        ));
    }
    core.audit(
        &scope,
        "environment.sweep",
        "-",
        "allowed",
        serde_json::json!({}),
    );
    let swept = core.envs.sweep(&scope).await?;
    let snapshots = core.envs.sweep_snapshots(&scope).await?;
    Ok(
        Json(serde_json::json!({ "destroyed": swept, "deleted_snapshots": snapshots }))
            .into_response(),
    )
}
