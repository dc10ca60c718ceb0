//! What interrupted work leaves behind, removed when the gateway starts: staging directories
//! and private indexes under `<state>/tmp` (a gateway killed mid-reconciliation leaves its
//! pulled bytes there), half-written blobs (`.tmp-*`) under `<state>/artifacts/`, worker sockets
//! under `<state>/workers/` whose environment no placement holds, and local-box roots that hold
//! no box. After each use the owners clean up themselves (scratch directories on drop, an
//! endpoint's socket when it closes, a box root when its last box is destroyed); this sweep is
//! for what a killed process could not.
//!
//! It runs before this process uses any of them (before restart reconciliation), and the state
//! dir belongs to one gateway, so nothing here can be in use — except blobs in a shared
//! `[store] workspaces` (several gateways), swept only by the `sweeper` lease's holder while
//! no other gateway is alive (`chores.rs`). Deliberately absent: anything
//! outside the state dir but the box roots this gateway's profiles name, and any failure that
//! stops the gateway — a leftover that cannot be removed is logged and left.

use crate::Core;
use skiff_protocol::environment::PlacementState;
use std::collections::BTreeSet;
use std::path::Path;

/// What a sweep removed, for the log.
#[derive(Debug, Default)]
struct Swept {
    staging: usize,
    blobs: usize,
    sockets: usize,
    box_roots: usize,
}

impl Core {
    /// Removes the leftovers of a previous process (see the module docs).
    pub(crate) fn sweep_leftovers_on_start(&self) {
        let mut swept = Swept::default();
        for entry in entries(&self.state.tmp()) {
            if remove(&entry) {
                swept.staging += 1;
            }
        }
        // Artifacts in a shared workspaces directory may be another gateway's blob being
        // written: swept only by the sweeper, and only while no other gateway is alive.
        let artifacts_mine = self.state.workspaces_root() == self.state.root()
            || (self.holds_chore(crate::chores::SWEEPER, crate::chores::START_ROUND)
                && !self.others_alive());
        for entry in entries(&self.state.artifacts())
            .into_iter()
            .filter(|_| artifacts_mine)
        {
            let partial = entry
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".tmp-"));
            if partial && remove(&entry) {
                swept.blobs += 1;
            }
        }
        swept.sockets = self.sweep_worker_sockets();
        for root in self
            .envs
            .local_box_roots(&crate::default_box_root(&self.state))
        {
            let boxes = skiff_providers::local::Boxes::new(root.clone(), Default::default());
            match boxes.remove_root_if_empty() {
                Ok(true) => swept.box_roots += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(root = %root.display(), error = %e, "cannot remove an empty box root")
                }
            }
        }
        if swept.staging + swept.blobs + swept.sockets + swept.box_roots > 0 {
            tracing::info!(?swept, "removed what a previous gateway left behind");
        }
    }

    /// Sockets of environments that no live placement holds: nothing will listen on them.
    fn sweep_worker_sockets(&self) -> usize {
        let attached: BTreeSet<String> = match self.store.live_placements() {
            Ok(placements) => placements
                .into_iter()
                .filter(|p| {
                    matches!(
                        p.state,
                        PlacementState::Active | PlacementState::Reconciling
                    )
                })
                .filter_map(|p| p.environment_id)
                .map(|env| format!("{env}.sock"))
                .collect(),
            Err(e) => {
                // Without knowing which are live, keep them all.
                tracing::warn!(error = %e, "cannot list placements; worker sockets are kept");
                return 0;
            }
        };
        let mut removed = 0;
        for entry in entries(&self.workers.socket_dir) {
            let name = entry
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_owned();
            if name.ends_with(".sock") && !attached.contains(&name) && remove(&entry) {
                removed += 1;
            }
        }
        removed
    }
}

/// The entries of `dir` (none when it does not exist or cannot be read).
fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    match std::fs::read_dir(dir) {
        Ok(read) => read.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot list leftovers");
            Vec::new()
        }
    }
}

/// Removes a file, socket or directory tree; whether it is gone.
fn remove(path: &Path) -> bool {
    let result = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover");
            false
        }
    }
}
