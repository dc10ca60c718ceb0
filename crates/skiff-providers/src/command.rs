//! The `command` provider: any lease CLI in the Crabbox shape.
//!
//! ```text
//! COMMAND warmup --lease-id cbx_… --json   lease (idempotent for the same id); prints the status
//! COMMAND status --id cbx_… --json         {"id","state","sshHost","sshPort","sshUser","sshKey","sshHostKey","expiresAt"}
//! COMMAND heartbeat --id cbx_…             extend the lease
//! COMMAND stop cbx_…                       release it
//! COMMAND list --json                      every lease, as status objects
//! ```
//!
//! Snapshots are optional verbs. A profile says its CLI has them with `snapshots = true`: the
//! operator knows what they installed, and a declared capability cannot be mistaken for a
//! probe that failed for another reason. Without it, [`WorkerProvider::snapshots`] is false
//! and none of these is ever run.
//!
//! ```text
//! COMMAND snapshot --id cbx_… --snapshot-id snap_… --json   capture the box's prepared home
//!                                                             (idempotent); prints {"id","sizeBytes"}
//! COMMAND warmup --lease-id cbx_… --from-snapshot snap_… --json
//!                                                             lease a box whose home starts as the
//!                                                             snapshot; prints the status
//! COMMAND restore --id cbx_… --snapshot-id snap_…             replace the running box's home (but
//!                                                             its workspaces and ~/.skiff) with
//!                                                             the snapshot, owned by the box user
//! COMMAND snapshot-rm snap_…                                  delete it (an unknown one is not an error)
//! COMMAND snapshot-list --json                                every snapshot, as {"id","sizeBytes"}
//! ```
//!
//! A command that fails, times out or prints something that does not parse is an error that
//! carries the command's stderr; nothing half-parsed is returned.

use crate::local::{lease_from_status, lease_status};
use crate::{
    Error, Lease, LeaseStatus, ProfileConfig, Result, SnapshotInfo, WorkerProvider,
    derive_lease_id, io_err,
};
use futures_util::future::BoxFuture;
use skiff_process::Cmd;
use skiff_protocol::SnapshotId;
use skiff_protocol::lease::{LeaseCliSnapshot, LeaseCliStatus, is_lease_cli_id};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub struct CommandProvider {
    profile: String,
    argv: Vec<String>,
    keys_dir: PathBuf,
    /// The profile's `snapshots = true`.
    snapshots: bool,
}

/// Long enough to copy a home full of toolchains.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(3600);

fn failed(message: String) -> Error {
    Error::Provider {
        provider: "command",
        message,
    }
}

impl CommandProvider {
    pub fn new(name: &str, profile: &ProfileConfig, keys_dir: PathBuf) -> Result<Self> {
        Ok(Self {
            profile: name.to_owned(),
            argv: profile.command.clone().unwrap_or_default(),
            keys_dir,
            snapshots: profile.snapshots.unwrap_or(false),
        })
    }

    fn snapshot_info(what: &str, snapshot: LeaseCliSnapshot) -> Result<SnapshotInfo> {
        let id = SnapshotId::parse(&snapshot.id).ok_or_else(|| {
            failed(format!(
                "`{what}` answered with {:?}, which is not a snapshot id",
                snapshot.id
            ))
        })?;
        Ok(SnapshotInfo {
            id,
            size_bytes: snapshot.size_bytes,
        })
    }

    /// The lease a `warmup` answered with, checked.
    fn leased(&self, id: &str, out: &str) -> Result<Lease> {
        let status: LeaseCliStatus = Self::parse("warmup", out)?;
        if status.id != id || !is_lease_cli_id(&status.id) {
            return Err(failed(format!(
                "`warmup --lease-id {id}` answered with lease {:?}",
                status.id
            )));
        }
        if status.ssh_host.is_empty() || status.ssh_port == 0 || status.ssh_host_key.is_empty() {
            return Err(failed(format!(
                "lease {id} has no SSH endpoint or host key yet (state {})",
                status.state
            )));
        }
        let key = self.identity_file(&status)?;
        Ok(lease_from_status(status, key))
    }

    async fn run(&self, args: &[&str], timeout: Duration) -> Result<String> {
        let (program, fixed) = self
            .argv
            .split_first()
            .ok_or_else(|| failed(format!("profile `{}` has an empty command", self.profile)))?;
        let cmd = Cmd::new(program.clone())
            .args(fixed)
            .args(args)
            .timeout(timeout);
        let shown = format!("{} {}", self.argv.join(" "), args.join(" "));
        let done = cmd
            .run(&CancellationToken::new())
            .await
            .map_err(|e| failed(format!("`{shown}`: {e}")))?;
        if !done.status.success() {
            return Err(failed(format!(
                "`{shown}` failed ({}): {}",
                done.status,
                done.stderr.into_string().trim()
            )));
        }
        Ok(done.stdout.into_string())
    }

    fn parse<T: serde::de::DeserializeOwned>(what: &str, out: &str) -> Result<T> {
        serde_json::from_str(out.trim()).map_err(|e| {
            let shown: String = out.trim().chars().take(200).collect();
            failed(format!(
                "`{what}` printed something that is not the expected JSON ({e}): {shown}"
            ))
        })
    }

    async fn status(&self, lease_id: &str) -> Result<LeaseCliStatus> {
        let out = self
            .run(
                &["status", "--id", lease_id, "--json"],
                Duration::from_secs(60),
            )
            .await?;
        let status: LeaseCliStatus = Self::parse("status", &out)?;
        if status.id != lease_id {
            return Err(failed(format!(
                "`status --id {lease_id}` answered for lease {}",
                status.id
            )));
        }
        Ok(status)
    }

    /// The key to log in with: a path as given, or key material written to a private file.
    fn identity_file(&self, status: &LeaseCliStatus) -> Result<PathBuf> {
        if !status.ssh_key.contains("PRIVATE KEY") {
            return Ok(PathBuf::from(&status.ssh_key));
        }
        std::fs::create_dir_all(&self.keys_dir).map_err(io_err(&self.keys_dir))?;
        let path = self.keys_dir.join(format!("{}.key", status.id));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(&path))?;
        std::io::Write::write_all(&mut file, status.ssh_key.as_bytes()).map_err(io_err(&path))?;
        Ok(path)
    }
}

impl WorkerProvider for CommandProvider {
    fn kind(&self) -> &'static str {
        "command"
    }

    fn development_only(&self) -> bool {
        false
    }

    fn lease_id_for(&self, op_id: &str) -> String {
        derive_lease_id("cbx_", op_id)
    }

    fn provision<'a>(&'a self, op_id: &'a str) -> BoxFuture<'a, Result<Lease>> {
        Box::pin(async move {
            let id = self.lease_id_for(op_id);
            let out = self
                .run(
                    &["warmup", "--lease-id", &id, "--json"],
                    Duration::from_secs(600),
                )
                .await?;
            self.leased(&id, &out)
        })
    }

    fn inspect<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<LeaseStatus>> {
        Box::pin(async move { Ok(lease_status(&self.status(lease_id).await?.state)) })
    }

    fn renew<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.run(&["heartbeat", "--id", lease_id], Duration::from_secs(60))
                .await
                .map(drop)
        })
    }

    fn destroy<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.run(&["stop", lease_id], Duration::from_secs(600))
                .await?;
            match lease_status(&self.status(lease_id).await?.state) {
                LeaseStatus::Gone => {
                    let _ = std::fs::remove_file(self.keys_dir.join(format!("{lease_id}.key")));
                    Ok(())
                }
                other => Err(Error::NoEvidence {
                    provider: "command",
                    lease: lease_id.to_owned(),
                    evidence: format!("after `stop`, `status` still says {other:?}"),
                }),
            }
        })
    }

    fn list<'a>(&'a self) -> BoxFuture<'a, Result<Vec<String>>> {
        Box::pin(async move {
            let out = self
                .run(&["list", "--json"], Duration::from_secs(60))
                .await?;
            let leases: Vec<LeaseCliStatus> = Self::parse("list", &out)?;
            Ok(leases
                .into_iter()
                .filter(|l| lease_status(&l.state) != LeaseStatus::Gone)
                .map(|l| l.id)
                .collect())
        })
    }

    fn snapshots(&self) -> bool {
        self.snapshots
    }

    fn snapshot<'a>(
        &'a self,
        lease_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<SnapshotInfo>> {
        Box::pin(async move {
            if !self.snapshots {
                return Err(self.unsupported_here());
            }
            let args = [
                "snapshot",
                "--id",
                lease_id,
                "--snapshot-id",
                snapshot_id.as_str(),
                "--json",
            ];
            let out = self.run(&args, SNAPSHOT_TIMEOUT).await?;
            let info = Self::snapshot_info("snapshot", Self::parse("snapshot", &out)?)?;
            if &info.id != snapshot_id {
                return Err(failed(format!(
                    "`snapshot --snapshot-id {snapshot_id}` answered for snapshot {}",
                    info.id
                )));
            }
            Ok(info)
        })
    }

    fn provision_from_snapshot<'a>(
        &'a self,
        op_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<Lease>> {
        Box::pin(async move {
            if !self.snapshots {
                return Err(self.unsupported_here());
            }
            let id = self.lease_id_for(op_id);
            let args = [
                "warmup",
                "--lease-id",
                &id,
                "--from-snapshot",
                snapshot_id.as_str(),
                "--json",
            ];
            let out = self.run(&args, SNAPSHOT_TIMEOUT).await?;
            self.leased(&id, &out)
        })
    }

    fn restore_snapshot<'a>(
        &'a self,
        lease_id: &'a str,
        snapshot_id: &'a SnapshotId,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if !self.snapshots {
                return Err(self.unsupported_here());
            }
            let args = [
                "restore",
                "--id",
                lease_id,
                "--snapshot-id",
                snapshot_id.as_str(),
            ];
            self.run(&args, SNAPSHOT_TIMEOUT).await.map(drop)
        })
    }

    fn delete_snapshot<'a>(&'a self, snapshot_id: &'a SnapshotId) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if !self.snapshots {
                return Err(self.unsupported_here());
            }
            self.run(&["snapshot-rm", snapshot_id.as_str()], SNAPSHOT_TIMEOUT)
                .await
                .map(drop)
        })
    }

    fn list_snapshots<'a>(&'a self) -> BoxFuture<'a, Result<Vec<SnapshotInfo>>> {
        Box::pin(async move {
            if !self.snapshots {
                return Err(self.unsupported_here());
            }
            let out = self
                .run(&["snapshot-list", "--json"], Duration::from_secs(60))
                .await?;
            let listed: Vec<LeaseCliSnapshot> = Self::parse("snapshot-list", &out)?;
            listed
                .into_iter()
                .map(|s| Self::snapshot_info("snapshot-list", s))
                .collect()
        })
    }
}

impl CommandProvider {
    fn unsupported_here(&self) -> Error {
        Error::SnapshotsUnsupported {
            provider: "command",
        }
    }
}
