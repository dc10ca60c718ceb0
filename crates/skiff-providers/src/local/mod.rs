//! The `local` provider: boxes on this machine (see [`Boxes`]) and snapshots of their homes
//! (see `snapshots.rs`). The same boxes are exposed through the lease-CLI contract by
//! `skiff box`, which the `command` provider consumes.

mod boxes;
mod netns;
mod procs;
mod rootfs;
pub mod sandbox;
mod snapshots;
mod sshd;
mod user;

pub use boxes::Boxes;

use crate::config::Isolation;
use crate::{Lease, LeaseStatus, Result, SnapshotInfo, WorkerProvider, derive_lease_id};
use futures_util::future::BoxFuture;
use skiff_protocol::SnapshotId;
use skiff_protocol::lease::LeaseCliStatus;
use std::time::Duration;

pub struct LocalProvider {
    boxes: Boxes,
    isolation: Isolation,
    ttl: Duration,
}

impl LocalProvider {
    pub fn new(boxes: Boxes, isolation: Isolation, ttl: Duration) -> Self {
        Self {
            boxes,
            isolation,
            ttl,
        }
    }
}

/// A lease from a lease-CLI status (shared with the `command` provider).
pub(crate) fn lease_from_status(
    status: LeaseCliStatus,
    identity_file: std::path::PathBuf,
) -> Lease {
    Lease {
        lease_id: status.id,
        host: status.ssh_host,
        port: status.ssh_port,
        user: status.ssh_user,
        identity_file,
        host_key: status.ssh_host_key,
        proxy_command: status.proxy_command,
        expires_at_ms: status.expires_at,
    }
}

pub(crate) fn lease_status(state: &str) -> LeaseStatus {
    match state {
        "running" | "ready" => LeaseStatus::Running,
        "stopped" | "destroyed" | "gone" => LeaseStatus::Gone,
        other => LeaseStatus::Failed(format!("the box reports state `{other}`")),
    }
}

impl WorkerProvider for LocalProvider {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn development_only(&self) -> bool {
        // Without root, boxes run as the gateway's own user and can read what it can.
        !rustix::process::geteuid().is_root()
    }

    fn lease_id_for(&self, op_id: &str) -> String {
        derive_lease_id("lbx_", op_id)
    }

    fn provision<'a>(&'a self, op_id: &'a str) -> BoxFuture<'a, Result<Lease>> {
        Box::pin(async move {
            let id = self.lease_id_for(op_id);
            let status = self.boxes.create(&id, self.isolation, self.ttl).await?;
            let key = status.ssh_key.clone().into();
            Ok(lease_from_status(status, key))
        })
    }

    fn inspect<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<LeaseStatus>> {
        Box::pin(async move {
            Ok(match self.boxes.status(lease_id)? {
                Some(status) => lease_status(&status.state),
                None => LeaseStatus::Gone,
            })
        })
    }

    fn renew<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.boxes.heartbeat(lease_id, self.ttl).map(drop) })
    }

    fn destroy<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.boxes.destroy(lease_id).await })
    }

    fn list<'a>(&'a self) -> BoxFuture<'a, Result<Vec<String>>> {
        Box::pin(async move { self.boxes.list() })
    }

    fn snapshots(&self) -> bool {
        true
    }

    fn snapshot<'a>(
        &'a self,
        lease_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<SnapshotInfo>> {
        Box::pin(async move { self.boxes.snapshot(lease_id, snapshot_id).await })
    }

    fn provision_from_snapshot<'a>(
        &'a self,
        op_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<Lease>> {
        Box::pin(async move {
            let id = self.lease_id_for(op_id);
            let status = self
                .boxes
                .create_from_snapshot(&id, snapshot_id, self.isolation, self.ttl)
                .await?;
            let key = status.ssh_key.clone().into();
            Ok(lease_from_status(status, key))
        })
    }

    fn restore_snapshot<'a>(
        &'a self,
        lease_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.boxes.restore(lease_id, snapshot_id).await })
    }

    fn delete_snapshot<'a>(&'a self, snapshot_id: &'a SnapshotId) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.boxes.delete_snapshot(snapshot_id).await })
    }

    fn list_snapshots<'a>(&'a self) -> BoxFuture<'a, Result<Vec<SnapshotInfo>>> {
        Box::pin(async move { self.boxes.list_snapshots() })
    }
}
