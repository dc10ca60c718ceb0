//! A session's quarantine (DESIGN §7.8): what a box produced that reconciliation refused,
//! kept as `quarantine` artifacts (the bytes and the box's bundle in the content-addressed
//! store, the refused paths and reasons in the row's metadata) until an operator accepts
//! paths into the session's workspace or discards them. Creating one also tells the session
//! (a notice naming every refused path and the commands to resolve it).
//!
//! Accepting is an explicit, audited decision and the one way a refused path is ever written;
//! a path that is not a plain workspace path (`..`, absolute, `.git`) is never accepted.

use crate::Core;
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::sync::{QuarantineList, QuarantineView, QuarantinedPath, Refusal, RefusalKind};
use skiff_protocol::{RunId, SessionId};
use skiff_store::{ArtifactRole, ArtifactRow, NewArtifact, Retention, Scope};
use skiff_sync::cas::Cas;
use skiff_sync::{Limits, Manifest, ManifestEntry, Remote, contain, manifest, quarantine};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// What reconciliation could not adopt, and where it came from.
pub(crate) struct Refused<'a> {
    pub session: &'a SessionId,
    pub run: Option<&'a RunId>,
    pub remote: &'a Remote,
    pub refused: &'a [Refusal],
    /// The box's manifest as it reported it.
    pub theirs: &'a Manifest,
    /// The box's bundle of its session branch, when it had commits.
    pub bundle: Option<&'a Path>,
}

/// How many refused paths a notice names; the quarantine lists them all.
const LISTED: usize = 20;

/// A quarantine just made: its row and what it holds.
pub(crate) struct Kept {
    pub row: ArtifactRow,
    pub paths: Vec<QuarantinedPath>,
}

fn meta_value(meta: &Meta) -> Result<serde_json::Value> {
    serde_json::to_value(meta).map_err(|e| {
        Error::Store(skiff_store::Error::Corrupt {
            what: "quarantine",
            detail: e.to_string(),
        })
    })
}

/// What the row's metadata holds.
#[derive(serde::Serialize, serde::Deserialize)]
struct Meta {
    paths: Vec<QuarantinedPath>,
    #[serde(default)]
    bundle: Option<String>,
    /// blake3 of each kept file, by path.
    #[serde(default)]
    blobs: std::collections::BTreeMap<String, String>,
}

fn bad_meta(row: &ArtifactRow, e: impl std::fmt::Display) -> Error {
    Error::Store(skiff_store::Error::Corrupt {
        what: "quarantine",
        detail: format!("{}: {e}", row.id),
    })
}

impl Core {
    /// Captures what was refused into the session's quarantine (before anything of the
    /// turn is adopted). The session is told separately ([`Core::announce_quarantine`]), once
    /// everything refused is known.
    pub(crate) async fn quarantine(&self, scope: &Scope, r: Refused<'_>) -> Result<Kept> {
        let cas = Cas::open(&self.artifacts_dir())?;
        let captured = quarantine::capture(
            r.remote,
            r.refused,
            r.theirs,
            r.bundle,
            &cas,
            &self.state.tmp(),
            &Limits::default(),
            &CancellationToken::new(),
        )
        .await?;
        let blobs = captured
            .paths
            .iter()
            .filter(|p| p.kept)
            .filter_map(|p| match &p.entry {
                Some(ManifestEntry::File { blake3, .. }) => Some((p.path.clone(), blake3.clone())),
                _ => None,
            })
            .collect();
        let meta = Meta {
            paths: captured.paths,
            bundle: captured.bundle,
            blobs,
        };
        let value = meta_value(&meta)?;
        // The row names a blob like every artifact: the record itself, stored beside the bytes.
        let record = value.to_string();
        let hash = cas.put_bytes(record.as_bytes())?;
        let row = self.store.create_artifact(
            scope,
            &NewArtifact {
                session_id: Some(r.session.clone()),
                run_id: r.run.cloned(),
                role: ArtifactRole::Quarantine,
                retention: Retention::Session,
                hash,
                size: record.len() as u64,
                meta: value,
                expires_at_ms: None,
            },
        )?;
        self.audit(
            scope,
            "quarantine.create",
            row.id.as_str(),
            "applied",
            json!({ "session": r.session.as_str(), "paths": r.refused.len() }),
        );
        Ok(Kept {
            row,
            paths: meta.paths,
        })
    }

    /// Adds refusals found after the capture (the box's commits, whose bundle the capture
    /// already kept) to a quarantine.
    pub(crate) fn add_to_quarantine(
        &self,
        scope: &Scope,
        kept: &mut Kept,
        more: &[Refusal],
    ) -> Result<()> {
        let row = self.store.artifact(scope, &kept.row.id)?;
        let mut meta: Meta =
            serde_json::from_value(row.meta.clone()).map_err(|e| bad_meta(&row, e))?;
        for r in more {
            let q = QuarantinedPath {
                path: r.path.clone(),
                reason: r.reason.clone(),
                kind: r.kind,
                entry: None,
                kept: meta.bundle.is_some(),
            };
            meta.paths.push(q.clone());
            kept.paths.push(q);
        }
        self.store
            .set_artifact_meta(scope, &row.id, &meta_value(&meta)?)?;
        Ok(())
    }

    /// Tells the session what was not adopted and how to resolve it (at most
    /// [`LISTED`] paths by name; the quarantine lists them all).
    pub(crate) fn announce_quarantine(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kept: &Kept,
    ) {
        let mut listed: Vec<String> = kept
            .paths
            .iter()
            .take(LISTED)
            .map(|x| format!("`{}` ({})", x.path, x.reason))
            .collect();
        if kept.paths.len() > LISTED {
            listed.push(format!("and {} more", kept.paths.len() - LISTED));
        }
        let s = session;
        let text = format!(
            "Not everything the box produced was adopted. Refused and kept in quarantine {}: {}. \
             Inspect with `skiff session quarantine {s}`; take a path anyway with \
             `skiff session quarantine accept {s} PATH…`; drop them with `skiff session quarantine discard {s}`.",
            kept.row.id,
            listed.join("; ")
        );
        self.notify(scope, s, run, &text);
    }

    fn quarantine_rows(&self, scope: &Scope, session: &SessionId) -> Result<Vec<ArtifactRow>> {
        Ok(self
            .store
            .artifacts(scope, session, ArtifactRole::Quarantine)?)
    }

    fn view_of(&self, row: &ArtifactRow) -> Result<QuarantineView> {
        let meta: Meta = serde_json::from_value(row.meta.clone()).map_err(|e| bad_meta(row, e))?;
        let cas = Cas::open(&self.artifacts_dir())?;
        let bundle = match &meta.bundle {
            Some(hash) => Some(cas.path(hash)?.display().to_string()),
            None => None,
        };
        Ok(QuarantineView {
            id: row.id.clone(),
            session_id: row
                .session_id
                .clone()
                .ok_or_else(|| bad_meta(row, "no session"))?,
            run_id: row.run_id.clone(),
            paths: meta.paths,
            bundle,
            created_at_ms: row.created_at_ms,
        })
    }

    /// `GET /v1/sessions/{id}/quarantine`.
    pub(crate) fn quarantines(&self, scope: &Scope, session: &SessionId) -> Result<QuarantineList> {
        self.store.session(scope, session)?;
        let quarantines = self
            .quarantine_rows(scope, session)?
            .iter()
            .map(|row| self.view_of(row))
            .collect::<Result<_>>()?;
        Ok(QuarantineList { quarantines })
    }

    /// Drops every quarantine of the session.
    pub(crate) fn discard_quarantine(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<QuarantineList> {
        self.store.session(scope, session)?;
        for row in self.quarantine_rows(scope, session)? {
            let meta: Meta =
                serde_json::from_value(row.meta.clone()).map_err(|e| bad_meta(&row, e))?;
            // The rows go; the blobs stay: a checkpoint's manifest or another quarantine may
            // name the same bytes, and nothing counts those references yet.
            self.store.delete_artifact(scope, &row.id)?;
            self.audit(
                scope,
                "quarantine.discard",
                row.id.as_str(),
                "applied",
                json!({ "session": session.as_str(), "paths": meta.paths.len() }),
            );
        }
        self.quarantines(scope, session)
    }

    /// Writes quarantined `paths` into the session's workspace: an operator's decision,
    /// audited. The session must be between turns. A worker session's box gets the same
    /// change, and its base manifest records it, so the next reconciliation sees no drift.
    pub(crate) async fn accept_quarantined(
        &self,
        scope: &Scope,
        session_id: &SessionId,
        paths: &[String],
    ) -> Result<QuarantineList> {
        let session = self.store.session(scope, session_id)?;
        if let Some(run) = self.store.open_run(scope, session_id)? {
            return Err(skiff_store::Error::SessionBusy {
                session: session_id.to_string(),
                run: run.id.to_string(),
            }
            .into());
        }
        if paths.is_empty() {
            return Err(Error::BadRequest(
                "name at least one quarantined path to accept".into(),
            ));
        }
        let rows = self.quarantine_rows(scope, session_id)?;
        let cas = Cas::open(&self.artifacts_dir())?;
        self.workspace_ready(&session.id).await?;
        let root = Path::new(session.workspace.path());
        // Newest quarantine first: a path refused twice is accepted as the box last had it.
        let mut plan: Vec<(ArtifactRow, QuarantinedPath, Option<String>)> = Vec::new();
        for path in paths {
            contain::check_path(path)
                .map_err(|e| Error::BadRequest(format!("{path} can never be accepted: {e}")))?;
            let found = rows.iter().rev().find_map(|row| {
                let meta: Meta = serde_json::from_value(row.meta.clone()).ok()?;
                let q = meta.paths.into_iter().find(|q| &q.path == path)?;
                Some((row.clone(), q, meta.blobs.get(path).cloned()))
            });
            let Some((row, q, blob)) = found else {
                return Err(Error::NotFound(format!(
                    "{path} is not in session {session_id}'s quarantine; `skiff session quarantine {session_id}` lists what is"
                )));
            };
            if q.kind != RefusalKind::Path {
                return Err(Error::BadRequest(format!(
                    "{path} is not a path: commits are not accepted here — fetch them from the quarantine's bundle (`git -C {} fetch BUNDLE skiff/{session_id}:refs/skiff/quarantine/{session_id}`) and merge what you want",
                    match &session.workspace {
                        WorkspaceView::Git { source, .. } => source.as_str(),
                        WorkspaceView::Plain { source, .. } => source.as_str(),
                    }
                )));
            }
            if !q.kept {
                return Err(Error::Conflict(format!(
                    "{path} was refused ({}) and its bytes were not kept; it is still on the box, if the box is",
                    q.reason
                )));
            }
            match (&q.entry, &blob) {
                (Some(ManifestEntry::File { .. }), Some(_))
                | (Some(ManifestEntry::Symlink { .. }), _) => {}
                _ => {
                    return Err(Error::Conflict(format!(
                        "{path}: the quarantine holds no bytes for it"
                    )));
                }
            }
            let full = root.join(path);
            if std::fs::symlink_metadata(&full).is_ok_and(|m| m.is_dir()) {
                return Err(Error::Conflict(format!(
                    "{path} is a directory in the session's workspace; remove it first"
                )));
            }
            if let Some(problem) = contain::parent_chain_problem(root, path) {
                return Err(Error::Conflict(format!(
                    "{path} cannot be written: {problem}"
                )));
            }
            plan.push((row, q, blob));
        }
        // Everything is checked; the accepted entries are laid out in a private staging
        // directory first, so the box (when the session has one) gets them before this side
        // changes — a box that cannot be reached leaves both sides as they were.
        let staging = skiff_sync::Scratch::new(&self.state.tmp(), "accept")?;
        for (_, q, blob) in &plan {
            materialize(&cas, staging.path(), q, blob.as_deref())?;
        }
        self.give_accepted_to_box(scope, session_id, staging.path(), &plan)
            .await?;
        let mut written = Vec::new();
        for (_, q, _) in &plan {
            let full = root.join(&q.path);
            contain::create_parents(root, &q.path)?;
            if std::fs::symlink_metadata(&full).is_ok() {
                std::fs::remove_file(&full).map_err(|e| io(&full, e))?;
            }
            let src = staging.path().join(&q.path);
            std::fs::rename(&src, &full)
                .or_else(|_| std::fs::copy(&src, &full).map(drop))
                .map_err(|e| io(&full, e))?;
            written.push(q.path.clone());
        }
        self.record_accepted_base(scope, session_id, root, &written)?;
        // What was accepted leaves its quarantine; an emptied quarantine goes.
        for (row, q, _) in &plan {
            let row = self.store.artifact(scope, &row.id)?;
            let mut meta: Meta =
                serde_json::from_value(row.meta.clone()).map_err(|e| bad_meta(&row, e))?;
            meta.paths.retain(|p| p.path != q.path);
            meta.blobs.remove(&q.path);
            if meta.paths.is_empty() {
                self.store.delete_artifact(scope, &row.id)?;
            } else {
                self.store
                    .set_artifact_meta(scope, &row.id, &meta_value(&meta)?)?;
            }
        }
        self.audit(
            scope,
            "quarantine.accept",
            session_id.as_str(),
            "applied",
            json!({ "paths": written }),
        );
        self.quarantines(scope, session_id)
    }

    /// The session's live worker placement, when it has one; accepting while it is between
    /// states (being placed, reconciling) is refused.
    fn live_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<Option<skiff_store::PlacementRow>> {
        let Some(p) = self.store.placement(scope, session)? else {
            return Ok(None);
        };
        match p.state {
            // No box holds the session's workspace: the next placement lays this one down.
            PlacementState::Local
            | PlacementState::Parked
            | PlacementState::Reclaimed
            | PlacementState::FailedOver
            | PlacementState::Failed => Ok(None),
            PlacementState::Active => Ok(Some(p)),
            other => Err(Error::Conflict(format!(
                "session {session}'s placement is {other}; accept once it is active (or home)"
            ))),
        }
    }

    /// A live worker placement: the box gets the accepted paths (from `staging`) first.
    async fn give_accepted_to_box(
        &self,
        scope: &Scope,
        session: &SessionId,
        staging: &Path,
        plan: &[(ArtifactRow, QuarantinedPath, Option<String>)],
    ) -> Result<()> {
        let Some(p) = self.live_placement(scope, session)? else {
            return Ok(());
        };
        let env = self.workers.placement_env(scope, &p)?;
        let remote = Remote::new(self.envs.ssh(&env)?, &crate::worker::box_workspace(session))?;
        let paths: Vec<String> = plan.iter().map(|(_, q, _)| q.path.clone()).collect();
        remote
            .push_files(staging, &paths, &CancellationToken::new())
            .await?;
        Ok(())
    }

    /// The base manifest records the accepted paths, so the next reconciliation sees no drift.
    fn record_accepted_base(
        &self,
        scope: &Scope,
        session: &SessionId,
        root: &Path,
        written: &[String],
    ) -> Result<()> {
        let Some(p) = self.live_placement(scope, session)? else {
            return Ok(());
        };
        let mut base = manifest::from_json(p.base_manifest.as_deref().unwrap_or(""))?;
        for path in written {
            base.entries
                .insert(path.clone(), manifest::entry_of(root, path)?);
        }
        self.store
            .set_placement_base_manifest(scope, session, &manifest::to_json(&base)?)?;
        Ok(())
    }
}

/// Writes a quarantined entry below `dir` (a file from the content store, or a symlink).
fn materialize(cas: &Cas, dir: &Path, q: &QuarantinedPath, blob: Option<&str>) -> Result<()> {
    contain::create_parents(dir, &q.path)?;
    let full = dir.join(&q.path);
    match (&q.entry, blob) {
        (Some(ManifestEntry::File { mode, .. }), Some(hash)) => {
            std::fs::copy(cas.path(hash)?, &full).map_err(|e| io(&full, e))?;
            std::fs::set_permissions(&full, std::fs::Permissions::from_mode(mode & 0o777))
                .map_err(|e| io(&full, e))?;
        }
        (Some(ManifestEntry::Symlink { target }), _) => {
            std::os::unix::fs::symlink(target, &full).map_err(|e| io(&full, e))?;
        }
        _ => {
            return Err(Error::Conflict(format!(
                "{}: the quarantine holds no bytes for it",
                q.path
            )));
        }
    }
    Ok(())
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Sync(skiff_sync::Error::Io {
        path: path.display().to_string(),
        source: e,
    })
}
