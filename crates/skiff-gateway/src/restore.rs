//! Going back to a checkpoint: `POST /v1/sessions/{id}/restore {checkpoint}` puts the
//! session's workspace back to checkpoint N (its transcript stays whole and a notice says what
//! happened), and `POST /v1/sessions/{id}/fork {at, title?}` makes a new session whose
//! transcript is this one's up to the end of turn N and whose workspace starts at checkpoint N.
//!
//! A restore never loses anything: the later checkpoints stay listed and restorable, and in
//! git mode the branch gains a commit rather than being rewound (see `skiff_sync::rewind`).
//! It runs only while the gateway holds the session's live workspace: no run open (and none
//! admitted until it is done), and no box holding it (a parked, reclaimed or failed placement
//! is laid onto its next box from the gateway's copy, so restoring that copy is enough).
//!
//! A fork copies the original's records it starts from — what the original started from (so
//! `diff` and `apply` measure the fork against the same base) and checkpoints 1..N (so its own
//! numbering goes on from N+1) — and keeps the original's run ids on the copied transcript
//! entries. The original session is only read.
//!
//! Deliberately absent: restoring a session whose workspace is on a box (bring it home
//! first), and forking at a point that is not a checkpoint.

use crate::error::{Error, Result};
use crate::{Core, workspace};
use axum::extract::{Path as AxumPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json};
use serde_json::json;
use skiff_protocol::SessionId;
use skiff_protocol::api::{SessionView, WorkspaceView};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::sync::{ForkRequest, RestoreRequest, RestoreResult};
use skiff_store::{ArtifactRole, ArtifactRow, NewArtifact, NewSession, RunRow, Scope};
use skiff_sync::cas::Cas;
use skiff_sync::checkpoint::{GitStores, LargeFiles};
use skiff_sync::rewind::{self, Rewound};
use std::path::Path;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/sessions/{id}/restore", post(restore))
        .route("/v1/sessions/{id}/fork", post(fork))
}

type Body<T> = std::result::Result<Json<T>, axum::extract::rejection::JsonRejection>;

fn session_id(raw: &str) -> Result<SessionId> {
    SessionId::parse(raw)
        .ok_or_else(|| Error::BadRequest(format!("{raw:?} is not a session id (ses_…)")))
}

async fn restore(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    AxumPath(id): AxumPath<String>,
    body: Body<RestoreRequest>,
) -> Result<Response> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    Ok(Json(core.restore_checkpoint(&scope, &id, req.checkpoint).await?).into_response())
}

async fn fork(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    AxumPath(id): AxumPath<String>,
    body: Body<ForkRequest>,
) -> Result<Response> {
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let id = session_id(&id)?;
    let view = core.fork_session(&scope, &id, req.at, req.title).await?;
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

/// Where a checkpoint's content is.
enum Content {
    Git {
        commit: String,
        /// The large untracked files kept in the content store.
        outside: Option<String>,
    },
    Plain {
        manifest: String,
    },
}

fn content(row: &ArtifactRow) -> Result<Content> {
    let text = |key: &str| row.meta[key].as_str().map(str::to_owned);
    let corrupt = |detail: &str| {
        Error::Store(skiff_store::Error::Corrupt {
            what: "checkpoint",
            detail: format!("{}: {detail}", row.id),
        })
    };
    match row.meta["mode"].as_str() {
        Some("git") => Ok(Content::Git {
            commit: text("commit").ok_or_else(|| corrupt("no commit"))?,
            outside: text("manifest"),
        }),
        Some("plain") => Ok(Content::Plain {
            manifest: text("manifest").ok_or_else(|| corrupt("no manifest"))?,
        }),
        _ => Err(corrupt("no mode")),
    }
}

/// `1, 2, 3`.
fn numbers(seqs: impl IntoIterator<Item = u64>) -> String {
    seqs.into_iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Holds a session against new turns while its workspace is rewritten.
struct Restoring<'a> {
    core: &'a Core,
    session: SessionId,
}

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        self.core.restoring_lock().remove(&self.session);
    }
}

impl Core {
    fn restoring_lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<SessionId>> {
        self.restoring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a turn (the store's one-open-run rule) with what its admission writes — its
    /// choices, and the worker slot on `claim`'s profile when it dispatches or places the
    /// session again — unless the session's workspace is being restored: both are decided
    /// under one lock, so a restore never runs beside a turn. The run, the choices and the
    /// claim are one store transaction: a refused turn claims and changes nothing. When every
    /// slot is taken, the session idle on its box the longest is parked first.
    pub(crate) async fn admit_run(
        &self,
        scope: &Scope,
        id: &SessionId,
        model_ref: &str,
        choices: skiff_store::SessionChoices<'_>,
        claim: Option<&str>,
    ) -> Result<RunRow> {
        // The store's refusals go to `claim_worker_slot` (it parks on a full gateway); the
        // restore's is the inner result.
        let admit = |claim: Option<(&str, u64)>| -> skiff_store::Result<Result<RunRow>> {
            let restoring = self.restoring_lock();
            if restoring.contains(id) {
                return Ok(Err(Error::Conflict(format!(
                    "session {id}'s workspace is being restored to a checkpoint; send the message again once that is done"
                ))));
            }
            let admission = skiff_store::Admission { choices, claim };
            self.store
                .admit_run(scope, id, model_ref, &admission)
                .map(Ok)
        };
        match claim {
            None => admit(None)?,
            Some(profile) => {
                self.workers
                    .claim_worker_slot(|max| admit(Some((profile, max))))
                    .await?
            }
        }
    }

    /// Claims the session for a restore: refused while a run is open.
    fn hold_for_restore(&self, scope: &Scope, id: &SessionId) -> Result<Restoring<'_>> {
        let mut restoring = self.restoring_lock();
        if let Some(run) = self.store.open_run(scope, id)? {
            return Err(skiff_store::Error::SessionBusy {
                session: id.to_string(),
                run: run.id.to_string(),
            }
            .into());
        }
        if !restoring.insert(id.clone()) {
            return Err(Error::Conflict(format!(
                "session {id} is already being restored; wait for that to finish"
            )));
        }
        Ok(Restoring {
            core: self,
            session: id.clone(),
        })
    }

    /// Refuses while a box holds the session's live workspace.
    fn check_workspace_home(&self, scope: &Scope, id: &SessionId) -> Result<()> {
        let Some(p) = self.store.placement(scope, id)? else {
            return Ok(());
        };
        match p.state {
            PlacementState::Local
            | PlacementState::Parked
            | PlacementState::Reclaimed
            | PlacementState::FailedOver
            | PlacementState::Failed => Ok(()),
            other => Err(Error::Conflict(format!(
                "session {id} is placed on a worker box (placement {other}), and the box holds its live workspace: restoring the gateway's copy now would be overwritten by the box's next turn. Bring it home first (`skiff session pull-back {id}`), or restore once it is parked (its box goes back to the pool after the profile's keep_attached)"
            ))),
        }
    }

    /// The session's checkpoints and the position of number `n` among them, or an error that
    /// names the ones there are.
    fn find_checkpoint(
        &self,
        scope: &Scope,
        id: &SessionId,
        n: u64,
    ) -> Result<(Vec<ArtifactRow>, usize)> {
        let rows = self.store.artifacts(scope, id, ArtifactRole::Checkpoint)?;
        if let Some(pos) = rows.iter().position(|r| r.seq == Some(n)) {
            return Ok((rows, pos));
        }
        let have = if rows.is_empty() {
            "it has none yet (one is taken at the end of every turn)".to_owned()
        } else {
            format!(
                "its checkpoints are {} (`skiff session checkpoints {id}`)",
                numbers(rows.iter().filter_map(|r| r.seq))
            )
        };
        Err(Error::NotFound(format!(
            "session {id} has no checkpoint {n}; {have}"
        )))
    }

    fn git_stores<'a>(&self, scratch: &'a Path, cas: &'a Cas) -> GitStores<'a> {
        GitStores {
            scratch,
            cas,
            large: LargeFiles::default(),
        }
    }

    /// Lays checkpoint `content` onto the workspace `view`.
    async fn rewind(
        &self,
        view: &WorkspaceView,
        content: &Content,
        message: &str,
    ) -> Result<Rewound> {
        let cancel = CancellationToken::new();
        let cas = Cas::open(&self.artifacts_dir())?;
        let scratch = self.state.tmp();
        let path = Path::new(view.path());
        Ok(match (view, content) {
            (WorkspaceView::Git { .. }, Content::Git { commit, outside }) => {
                let stores = self.git_stores(&scratch, &cas);
                rewind::rewind_git(path, commit, outside.as_deref(), message, &stores, &cancel)
                    .await?
            }
            (WorkspaceView::Plain { .. }, Content::Plain { manifest }) => {
                rewind::rewind_plain(path, &cas, manifest, &scratch, &cancel).await?
            }
            _ => {
                return Err(Error::Store(skiff_store::Error::Corrupt {
                    what: "checkpoint",
                    detail: format!("its mode is not the mode of the workspace {}", view.path()),
                }));
            }
        })
    }

    /// Puts the session's workspace back to checkpoint `n`.
    pub(crate) async fn restore_checkpoint(
        &self,
        scope: &Scope,
        id: &SessionId,
        n: u64,
    ) -> Result<RestoreResult> {
        let session = self.store.session(scope, id)?;
        self.workspace_ready(id).await?;
        let _held = self.hold_for_restore(scope, id)?;
        self.check_workspace_home(scope, id)?;
        let (rows, pos) = self.find_checkpoint(scope, id, n)?;
        let later: Vec<u64> = rows[pos + 1..].iter().filter_map(|r| r.seq).collect();
        let message = format!("skiff: workspace restored to checkpoint {n} of {id}");
        let done = match content(&rows[pos]) {
            Ok(content) => self.rewind(&session.workspace, &content, &message).await,
            Err(e) => Err(e),
        };
        let rewound = match done {
            Ok(r) => r,
            Err(e) => {
                self.audit(
                    scope,
                    "session.restore",
                    id.as_str(),
                    "failed",
                    json!({ "checkpoint": n }),
                );
                return Err(e);
            }
        };
        self.audit(
            scope,
            "session.restore",
            id.as_str(),
            "applied",
            json!({
                "checkpoint": n, "written": rewound.written.len(),
                "deleted": rewound.deleted.len(), "commit": rewound.commit,
            }),
        );
        let kept = if later.is_empty() {
            "there were no later checkpoints".to_owned()
        } else {
            format!(
                "later checkpoints are kept: {} (`skiff session restore {id} --checkpoint {}` goes back)",
                numbers(later.iter().copied()),
                later.last().copied().unwrap_or(n)
            )
        };
        let recorded = match &rewound.commit {
            Some(c) => format!(
                "; the session branch records it in commit {}",
                &c[..c.len().min(12)]
            ),
            None => String::new(),
        };
        self.notify(
            scope,
            id,
            None,
            &format!("workspace restored to checkpoint {n} (end of turn {n}); {kept}{recorded}"),
        );
        Ok(RestoreResult {
            session_id: id.clone(),
            checkpoint: n,
            written: rewound.written,
            deleted: rewound.deleted,
            commit: rewound.commit,
            later,
        })
    }

    /// A new session from the session's checkpoint `at`: the transcript up to the end of that
    /// turn, the workspace as the checkpoint holds it.
    pub(crate) async fn fork_session(
        &self,
        scope: &Scope,
        id: &SessionId,
        at: u64,
        title: Option<String>,
    ) -> Result<SessionView> {
        let session = self.store.session(scope, id)?;
        self.workspace_ready(id).await?;
        let (rows, pos) = self.find_checkpoint(scope, id, at)?;
        let content = content(&rows[pos])?;
        let transcript = self.store.transcript(scope, id)?;
        let end = rows[pos]
            .run_id
            .as_ref()
            .and_then(|run| {
                transcript
                    .iter()
                    .rposition(|e| e.run_id.as_ref() == Some(run))
            })
            .ok_or_else(|| {
                Error::BadRequest(format!(
                    "turn {at} of session {id} has no entries in its transcript, so there is nothing to fork from there"
                ))
            })?;
        let title = match title.map(|t| t.trim().to_owned()) {
            Some(t) if !t.is_empty() => t,
            _ => format!("{} (fork at {at})", session.title),
        };
        // What the original started from (the first base, as `diff` reads it), then
        // checkpoints 1..N.
        let base = self
            .store
            .artifacts(scope, id, ArtifactRole::Manifest)?
            .into_iter()
            .find(|r| r.meta["purpose"] == "base");
        let records: Vec<NewArtifact> = base
            .into_iter()
            .chain(rows.into_iter().take(pos + 1))
            .map(|r| NewArtifact {
                session_id: None,
                run_id: r.run_id,
                role: r.role,
                retention: r.retention,
                hash: r.hash,
                size: r.size,
                meta: r.meta,
                expires_at_ms: r.expires_at_ms,
            })
            .collect();

        let new_id = SessionId::from_suffix(&skiff_store::mint()?);
        let view = match (&session.workspace, &content) {
            (
                WorkspaceView::Git {
                    source,
                    base_commit,
                    ..
                },
                Content::Git { commit, .. },
            ) => {
                // The branch starts on the commit the checkpoint was taken on; the checkpoint's
                // uncommitted and untracked files are laid over it below.
                workspace::fork_worktree(
                    Path::new(source),
                    &new_id,
                    &self.state,
                    &format!("{commit}^"),
                    base_commit,
                )
                .await?
            }
            (WorkspaceView::Plain { source, .. }, Content::Plain { .. }) => {
                let path = self.state.workspace_copy(new_id.as_str());
                std::fs::create_dir_all(&path).map_err(|source| {
                    Error::Workspace(workspace::WorkspaceError::Io {
                        path: path.display().to_string(),
                        source,
                    })
                })?;
                WorkspaceView::Plain {
                    source: source.clone(),
                    path: path.display().to_string(),
                }
            }
            _ => {
                return Err(Error::Store(skiff_store::Error::Corrupt {
                    what: "checkpoint",
                    detail: format!("checkpoint {at} of {id}: its mode is not the session's"),
                }));
            }
        };
        let message = format!("skiff: fork of {id} at checkpoint {at}");
        let made = match self.rewind(&view, &content, &message).await {
            Ok(_) => self
                .store
                .create_fork(
                    scope,
                    &NewSession {
                        id: new_id.clone(),
                        title,
                        workspace: view.clone(),
                        model_ref: session.model_ref.clone(),
                    },
                    &transcript[..=end],
                    &records,
                )
                .map_err(Error::from),
            Err(e) => Err(e),
        };
        // The fork keeps the session's reasoning choice.
        let made = match (made, session.reasoning.as_deref()) {
            (Ok(_), Some(reasoning)) => self
                .store
                .set_session_reasoning(scope, &new_id, Some(reasoning))
                .map_err(Error::from),
            (made, _) => made,
        };
        let row = match made {
            Ok(row) => row,
            Err(e) => {
                workspace::discard(&view).await;
                self.audit(
                    scope,
                    "session.fork",
                    id.as_str(),
                    "failed",
                    json!({ "at": at }),
                );
                return Err(e);
            }
        };
        self.audit(
            scope,
            "session.fork",
            new_id.as_str(),
            "applied",
            json!({ "from": id.as_str(), "at": at }),
        );
        self.notify(
            scope,
            &new_id,
            None,
            &format!(
                "forked from session {id} at checkpoint {at} (end of turn {at}): the workspace starts as that checkpoint holds it"
            ),
        );
        self.session_view(scope, row)
    }
}
