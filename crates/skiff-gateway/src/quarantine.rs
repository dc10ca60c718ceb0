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
use skiff_protocol::event::EventKind;
use skiff_protocol::sync::{QuarantineList, QuarantineView, QuarantinedPath, Refusal};
use skiff_protocol::transcript::EntryBody;
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
    /// Captures what was refused into the session's quarantine, and tells the session.
    pub(crate) async fn quarantine(&self, scope: &Scope, r: Refused<'_>) -> Result<ArtifactRow> {
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
        let meta = serde_json::to_value(&meta).map_err(|e| Error::BadRequest(e.to_string()))?;
        // The row names a blob like every artifact: the record itself, stored beside the bytes.
        let record = meta.to_string();
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
                meta,
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
        let listed: Vec<String> = r
            .refused
            .iter()
            .map(|x| format!("`{}` ({})", x.path, x.reason))
            .collect();
        let s = r.session;
        let text = format!(
            "Not everything the box produced was adopted. Refused and kept in quarantine {}: {}. \
             Inspect with `skiff session quarantine {s}`; take a path anyway with \
             `skiff session quarantine accept {s} PATH…`; drop them with `skiff session quarantine discard {s}`.",
            row.id,
            listed.join("; ")
        );
        self.notify(scope, s, r.run, &text);
        Ok(row)
    }

    /// Appends a notice to the session's transcript (re-reading the leaf when it moved) and
    /// publishes it. A notice that cannot be written is logged: it never undoes the work.
    pub(crate) fn notify(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        text: &str,
    ) {
        let body = [EntryBody::Notice {
            text: text.to_owned(),
        }];
        for _ in 0..3 {
            let leaf = match self.store.leaf(scope, session) {
                Ok(leaf) => leaf,
                Err(e) => {
                    tracing::warn!(%session, error = %e, "could not read the leaf for a notice");
                    return;
                }
            };
            match self
                .store
                .append_entries(scope, session, leaf.as_ref(), run, &body)
            {
                Ok(entries) => {
                    for entry in entries {
                        if let Err(e) =
                            self.hub
                                .publish(scope, session, run, EventKind::Entry { entry })
                        {
                            tracing::warn!(%session, error = %e, "could not publish a notice");
                        }
                    }
                    return;
                }
                Err(skiff_store::Error::LeafConflict { .. }) => continue,
                Err(e) => {
                    tracing::warn!(%session, error = %e, "could not write a notice");
                    return;
                }
            }
        }
        tracing::warn!(%session, "the transcript kept moving; a notice was not written");
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

    /// Drops every quarantine of the session (and the blobs no other row names).
    pub(crate) fn discard_quarantine(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<QuarantineList> {
        self.store.session(scope, session)?;
        let cas = Cas::open(&self.artifacts_dir())?;
        for row in self.quarantine_rows(scope, session)? {
            let meta: Meta =
                serde_json::from_value(row.meta.clone()).map_err(|e| bad_meta(&row, e))?;
            self.store.delete_artifact(scope, &row.id)?;
            let hashes = meta
                .blobs
                .values()
                .cloned()
                .chain(meta.bundle)
                .chain(std::iter::once(row.hash.clone()));
            for hash in hashes {
                if !self.store.blob_referenced(&hash)? {
                    cas.remove(&hash)?;
                }
            }
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
        let root = Path::new(session.workspace.path());
        // Newest quarantine first: a path refused twice is accepted as the box last had it.
        let mut plan: Vec<(ArtifactRow, QuarantinedPath, Option<String>)> = Vec::new();
        for path in paths {
            if path == "(commits)" {
                return Err(Error::BadRequest(format!(
                    "commits are not accepted path by path: fetch them from the quarantine's bundle (`git -C {} fetch BUNDLE skiff/{session_id}:refs/skiff/quarantine/{session_id}`), then merge what you want",
                    match &session.workspace {
                        WorkspaceView::Git { source, .. } => source.as_str(),
                        WorkspaceView::Plain { source, .. } => source.as_str(),
                    }
                )));
            }
            contain::check_path(path)
                .map_err(|e| Error::BadRequest(format!("{path} can never be accepted: {e}")))?;
            let found = rows.iter().rev().find_map(|row| {
                let meta: Meta = serde_json::from_value(row.meta.clone()).ok()?;
                let q = meta.paths.into_iter().find(|q| &q.path == path)?;
                Some((row.clone(), q, meta.blobs.get(path).cloned()))
            });
            let Some((row, q, blob)) = found else {
                return Err(Error::BadRequest(format!(
                    "{path} is not in session {session_id}'s quarantine; `skiff session quarantine {session_id}` lists what is"
                )));
            };
            if !q.kept {
                return Err(Error::BadRequest(format!(
                    "{path} was refused ({}) and its bytes were not kept; it can only be recreated on the box",
                    q.reason
                )));
            }
            plan.push((row, q, blob));
        }
        let mut written = Vec::new();
        for (_, q, blob) in &plan {
            let full = root.join(&q.path);
            contain::create_parents(root, &q.path)?;
            if let Ok(meta) = std::fs::symlink_metadata(&full) {
                if meta.is_dir() {
                    return Err(Error::BadRequest(format!(
                        "{} is a directory in the session's workspace; remove it first",
                        q.path
                    )));
                }
                std::fs::remove_file(&full).map_err(|e| io(&full, e))?;
            }
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
                    return Err(Error::BadRequest(format!(
                        "{}: the quarantine holds no bytes for it",
                        q.path
                    )));
                }
            }
            written.push(q.path.clone());
        }
        self.give_accepted_to_box(scope, session_id, root, &plan)
            .await?;
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
                let meta = serde_json::to_value(&meta).map_err(|e| bad_meta(&row, e))?;
                self.store.set_artifact_meta(scope, &row.id, &meta)?;
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

    /// A live worker placement: the box gets the accepted paths too, and the base manifest
    /// says so.
    async fn give_accepted_to_box(
        &self,
        scope: &Scope,
        session: &SessionId,
        root: &Path,
        plan: &[(ArtifactRow, QuarantinedPath, Option<String>)],
    ) -> Result<()> {
        let Some(p) = self.store.placement(scope, session)? else {
            return Ok(());
        };
        if matches!(
            p.state,
            PlacementState::Local | PlacementState::Reclaimed | PlacementState::Failed
        ) {
            return Ok(());
        }
        let mut base = manifest::from_json(p.base_manifest.as_deref().unwrap_or(""))?;
        let env = self.placement_env(scope, &p)?;
        let remote = Remote::new(self.envs.ssh(&env)?, &crate::worker::box_workspace(session))?;
        let paths: Vec<String> = plan.iter().map(|(_, q, _)| q.path.clone()).collect();
        remote
            .push_files(root, &paths, &CancellationToken::new())
            .await?;
        for path in &paths {
            base.entries
                .insert(path.clone(), manifest::entry_of(root, path)?);
        }
        self.store
            .set_placement_base_manifest(scope, session, &manifest::to_json(&base)?)?;
        Ok(())
    }
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Sync(skiff_sync::Error::Io {
        path: path.display().to_string(),
        source: e,
    })
}
