//! Snapshots of local boxes: a prepared box's home, kept under the box root, that new boxes'
//! homes start as.
//!
//! ```text
//! <root>/snapshots/                  root 0700: box users can neither list nor enter it
//!   snap_<hex>/                      a complete snapshot (renamed into place last), 0700
//!     snapshot.json                  id, the lease it came from, size, time
//!     home/                          the copy, owned by root
//!   .staging/<snap>.<pid>.<n>/       captures and deletions under way (a dead pid's are
//!                                    removed by the next capture)
//! ```
//!
//! Capture: `tar` reads the home as the box user, from inside the box's own mount namespace
//! (`nsenter` + `setpriv`; unsandboxed boxes: as the box user on the host), so a box that swaps
//! a directory for a symlink mid-copy gets into its snapshot only what it could read itself.
//! Left out: `workspace/`, `workspaces/` (sessions' work) and `~/.skiff` (the worker's socket,
//! credentials, logs and bundle). The stream is unpacked as root into a private staging
//! directory with owners dropped; then FIFOs, sockets and devices are removed, setuid and
//! setgid bits cleared, the size summed, the file system synced, and the directory renamed
//! into place — so a snapshot directory that exists is complete. Symlinks stay symlinks (tar
//! never follows them), modes stay. A tar that saw a file change while reading fails the
//! capture rather than keep a torn copy.
//!
//! Start from: `cp -a` into the new box's home before anything of that box runs, then `chown -R`
//! (which never follows symlinks) to its user.
//!
//! Restore onto a running box ([`Boxes::restore`]): root streams the snapshot (its own private
//! copy, which nothing else writes) as a tar; the box user, from inside the box's mount
//! namespace (`nsenter` + `setpriv`, as the capture reads), empties its home of everything but
//! `workspace/`, `workspaces/` and `~/.skiff` and unpacks the stream. The home is the box
//! user's to plant symlinks in, so root never walks it: whatever a planted symlink redirects,
//! the removal and the unpacking can only touch what the box user could have touched itself,
//! and the files come out owned by that user without a `chown` that would have to be careful.
//! (The alternative — root builds a staging home and swaps it in by renames — needs the swap
//! to happen in a root-owned parent and every kept directory moved across, and still has to
//! chown a tree the box then owns.)
//!
//! Deliberately absent: rewriting absolute paths. A home lives at `<root>/<box>/home`, so a
//! tool that recorded its own absolute path (a Python virtualenv, say) points into the old
//! box's home from a new box; tools that find themselves through `$HOME` work.

use super::boxes::provider_err;
use super::{Boxes, procs, user};
use crate::{Error, Result, SnapshotInfo, io_err, now_ms};
use serde::{Deserialize, Serialize};
use skiff_process::Cmd;
use skiff_protocol::SnapshotId;
use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The directory under the box root that holds snapshots.
pub(super) const DIR: &str = "snapshots";
const STAGING: &str = ".staging";
const RECORD: &str = "snapshot.json";
/// Bounds a capture or restore of a large home (toolchains run to gigabytes).
const COPY_TIMEOUT: Duration = Duration::from_secs(3600);

/// The reading side runs as the box user (see the module docs); the writing side as root into
/// a private directory. `pipefail`: a reader that failed (a file changed as it was read) fails
/// the whole.
const CAPTURE: &str = r#"set -o pipefail
home=$1 dest=$2
shift 2
"$@" tar --create --file=- --directory="$home" --anchored \
    --exclude=./workspace --exclude=./workspaces --exclude=./.skiff \
    --numeric-owner --sparse --warning=no-file-ignored . |
    tar --extract --file=- --directory="$dest" --no-same-owner --preserve-permissions
"#;

/// Runs as root: the first stage reads the snapshot, the rest (after `"$@"`: `nsenter`,
/// `setpriv`) as the box user. The box user's stage clears what a snapshot replaces — making
/// its own read-only directories writable first, or `rm` could not empty them — and unpacks.
/// `find -type d` and `rm -rf` never follow symlinks; and being the box user, nothing they do
/// reaches past what the box may write anyway.
const RESTORE: &str = r#"set -o pipefail
snap=$1 home=$2
shift 2
tar --create --file=- --directory="$snap" --numeric-owner --sparse . |
    "$@" bash -c 'set -e
cd -- "$1"
find . -mindepth 1 \( -path ./workspace -o -path ./workspaces -o -path ./.skiff \) -prune \
    -o -type d ! -perm -u=rwx -exec chmod u+rwx -- {} +
find . -mindepth 1 -maxdepth 1 ! -name workspace ! -name workspaces ! -name .skiff \
    -exec rm -rf -- {} +
tar --extract --file=- --no-same-owner --preserve-permissions --no-overwrite-dir' skiff-restore "$home"
"#;

#[derive(Debug, Serialize, Deserialize)]
struct SnapshotRecord {
    id: SnapshotId,
    lease_id: String,
    size_bytes: u64,
    created_at_ms: i64,
}

impl SnapshotRecord {
    fn info(&self) -> SnapshotInfo {
        SnapshotInfo {
            id: self.id.clone(),
            size_bytes: self.size_bytes,
        }
    }
}

fn unknown(id: &SnapshotId) -> Error {
    Error::UnknownSnapshot {
        provider: "local",
        snapshot: id.clone(),
    }
}

/// A private directory: root-only, whatever the umask.
fn private_dir(path: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(path)(e)),
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(io_err(path))
}

impl Boxes {
    fn snapshots_dir(&self) -> PathBuf {
        self.root.join(DIR)
    }

    fn snapshot_dir(&self, id: &SnapshotId) -> PathBuf {
        self.snapshots_dir().join(id.as_str())
    }

    /// The record of a complete snapshot (only complete ones have a directory of their id).
    fn read_snapshot(&self, id: &SnapshotId) -> Option<SnapshotRecord> {
        let text = std::fs::read_to_string(self.snapshot_dir(id).join(RECORD)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The copied home of complete snapshot `id`.
    pub(super) fn snapshot_home(&self, id: &SnapshotId) -> Result<PathBuf> {
        self.read_snapshot(id)
            .map(|_| self.snapshot_dir(id).join("home"))
            .ok_or_else(|| unknown(id))
    }

    /// A fresh directory name under `.staging` for work on `id` by this process; the
    /// snapshot and staging directories are made (private) on the way. Leftovers of processes
    /// that died are removed first.
    fn staging_path(&self, id: &SnapshotId, what: &str) -> Result<PathBuf> {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = self.snapshots_dir();
        std::fs::create_dir_all(&self.root).map_err(io_err(&self.root))?;
        private_dir(&dir)?;
        let staging = dir.join(STAGING);
        private_dir(&staging)?;
        if let Ok(entries) = std::fs::read_dir(&staging) {
            for entry in entries.filter_map(std::result::Result::ok) {
                let name = entry.file_name();
                let pid = name
                    .to_str()
                    .and_then(|n| n.split('.').nth(1))
                    .and_then(|p| p.parse::<i32>().ok());
                if pid.is_some_and(|pid| !procs::alive(pid)) {
                    // Housekeeping: a failure here leaves garbage for the next try, no harm.
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        Ok(staging.join(format!(
            "{id}.{}.{}.{what}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )))
    }

    /// Captures the home of box `lease_id` as snapshot `id` (see the module docs).
    /// Idempotent: a complete snapshot `id` of the same box is returned as it is.
    pub async fn snapshot(&self, lease_id: &str, id: &SnapshotId) -> Result<SnapshotInfo> {
        if let Some(done) = self.read_snapshot(id) {
            if done.lease_id == lease_id {
                return Ok(done.info());
            }
            return Err(provider_err(format!(
                "snapshot {id} already exists and was taken from box {}, not {lease_id}",
                done.lease_id
            )));
        }
        let record = self
            .read_record(lease_id)
            .ok_or_else(|| Error::UnknownLease {
                provider: "local",
                lease: lease_id.to_owned(),
            })?;
        let home = self.dir(lease_id).join("home");
        let reader = self.as_box_user(lease_id, &record, "snapshotted").await?;

        let staging = self.staging_path(id, "capture")?;
        let captured = self.capture(&home, &staging, reader, lease_id, id).await;
        let info = match captured {
            Ok(info) => info,
            Err(e) => {
                // Nothing half-made stays: the staging directory never looked like a snapshot.
                let _ = std::fs::remove_dir_all(&staging);
                return Err(e);
            }
        };
        match std::fs::rename(&staging, self.snapshot_dir(id)) {
            Ok(()) => Ok(info),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                // Another capture of the same id finished first: it is the same snapshot.
                match self.read_snapshot(id) {
                    Some(done) if done.lease_id == lease_id => Ok(done.info()),
                    _ => Err(io_err(&self.snapshot_dir(id))(e)),
                }
            }
        }
    }

    /// Copies, settles and records the snapshot in `staging`; does not rename it into place.
    async fn capture(
        &self,
        home: &Path,
        staging: &Path,
        reader: Vec<OsString>,
        lease_id: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotInfo> {
        private_dir(staging)?;
        let dest = staging.join("home");
        private_dir(&dest)?;
        Cmd::new("bash")
            .args(["-c", CAPTURE, "skiff-snapshot"])
            .arg(home)
            .arg(&dest)
            .args(reader)
            .timeout(COPY_TIMEOUT)
            .run_checked(&CancellationToken::new())
            .await
            .map_err(|e| {
                provider_err(format!(
                    "copying the home of box {lease_id} into snapshot {id} failed (a file that changes while it is read fails the copy; snapshot a box with nothing running): {e}"
                ))
            })?;
        let settle_dir = dest.clone();
        let size_bytes = tokio::task::spawn_blocking(move || settle(&settle_dir))
            .await
            .map_err(|e| provider_err(format!("settling snapshot {id} crashed: {e}")))??;
        let record = SnapshotRecord {
            id: id.clone(),
            lease_id: lease_id.to_owned(),
            size_bytes,
            created_at_ms: now_ms(),
        };
        let path = staging.join(RECORD);
        let text =
            serde_json::to_string_pretty(&record).map_err(|e| provider_err(e.to_string()))?;
        std::fs::write(&path, text).map_err(io_err(&path))?;
        // INVARIANT: the copy is on disk before the rename makes it look complete.
        let dir = std::fs::File::open(staging).map_err(io_err(staging))?;
        rustix::fs::syncfs(&dir).map_err(|e| io_err(staging)(e.into()))?;
        Ok(record.info())
    }

    /// Removes snapshot `id`; one that is not here is already removed. It stops looking
    /// complete (renamed away) before its files go.
    pub async fn delete_snapshot(&self, id: &SnapshotId) -> Result<()> {
        let dir = self.snapshot_dir(id);
        if std::fs::symlink_metadata(&dir).is_err() {
            return Ok(());
        }
        let trash = self.staging_path(id, "deleting")?;
        match std::fs::rename(&dir, &trash) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(&dir)(e)),
        }
        let doomed = trash.clone();
        tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&doomed))
            .await
            .map_err(|e| provider_err(format!("deleting snapshot {id} crashed: {e}")))?
            .map_err(io_err(&trash))?;
        // Housekeeping: empty directories go, so an unused root can be removed; `remove_dir`
        // leaves ones that are in use.
        let _ = std::fs::remove_dir(self.snapshots_dir().join(STAGING));
        let _ = std::fs::remove_dir(self.snapshots_dir());
        let _ = self.remove_root_if_empty();
        Ok(())
    }

    /// Every complete snapshot under the root, by id.
    pub fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let Ok(dir) = std::fs::read_dir(self.snapshots_dir()) else {
            return Ok(Vec::new());
        };
        let mut found: Vec<SnapshotInfo> = dir
            .filter_map(std::result::Result::ok)
            .filter_map(|e| SnapshotId::parse(e.file_name().to_str()?))
            .filter_map(|id| self.read_snapshot(&id))
            .map(|r| r.info())
            .collect();
        found.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(found)
    }

    /// The command prefix that runs what follows as the box's user, from inside its sandbox's
    /// mount namespace when it has one (there, its view has none of the host's private paths).
    /// `doing` completes "only a running box can be …".
    async fn as_box_user(
        &self,
        lease_id: &str,
        record: &super::boxes::BoxRecord,
        doing: &str,
    ) -> Result<Vec<OsString>> {
        let mut prefix: Vec<OsString> = Vec::new();
        if record.sandboxed {
            let pid = self.box_pid(lease_id).ok_or_else(|| {
                provider_err(format!(
                    "box {lease_id} is not running; its home is reached from inside its sandbox, so only a running box can be {doing}"
                ))
            })?;
            prefix.extend(
                ["nsenter", "--target", &pid.to_string(), "--mount", "--"].map(OsString::from),
            );
        }
        if record.own_user {
            let uid = user::uid(&record.user).await?.ok_or_else(|| {
                provider_err(format!(
                    "the user {} of box {lease_id} is gone",
                    record.user
                ))
            })?;
            let gid = user::gid(&record.user).await?;
            prefix.extend(
                [
                    "setpriv".to_owned(),
                    format!("--reuid={uid}"),
                    format!("--regid={gid}"),
                    "--clear-groups".to_owned(),
                    "--no-new-privs".to_owned(),
                    "--".to_owned(),
                ]
                .map(OsString::from),
            );
        }
        Ok(prefix)
    }

    /// Makes the home of running box `lease_id` hold snapshot `id`: everything but
    /// `workspace/`, `workspaces/` and `~/.skiff` is replaced by the snapshot's copy, owned by
    /// the box's user (see the module docs for why the box user does the writing). A snapshot
    /// that is not here is [`Error::UnknownSnapshot`], with the home untouched. A restore that
    /// fails part-way leaves the home half replaced: the box is not fit for anyone then.
    pub async fn restore(&self, lease_id: &str, id: &SnapshotId) -> Result<()> {
        let source = self.snapshot_home(id)?;
        let mut record = self
            .read_record(lease_id)
            .ok_or_else(|| Error::UnknownLease {
                provider: "local",
                lease: lease_id.to_owned(),
            })?;
        if self.box_pid(lease_id).is_none() {
            return Err(provider_err(format!(
                "box {lease_id} is not running; a snapshot is restored onto a running box only"
            )));
        }
        let home = self.dir(lease_id).join("home");
        let writer = self.as_box_user(lease_id, &record, "restored").await?;
        Cmd::new("bash")
            .args(["-c", RESTORE, "skiff-restore"])
            .arg(&source)
            .arg(&home)
            .args(writer)
            .timeout(COPY_TIMEOUT)
            .run_checked(&CancellationToken::new())
            .await
            .map_err(|e| {
                provider_err(format!(
                    "restoring snapshot {id} onto the home of box {lease_id} failed, so that home is half replaced; destroy the box: {e}"
                ))
            })?;
        record.from_snapshot = Some(id.clone());
        self.write_record(&record)
    }

    /// Copies snapshot `id` into `home` and gives every file to `owner` (uid, gid) when the
    /// box has a user of its own. Run before the box starts: nothing races it.
    pub(super) async fn restore_home(
        &self,
        id: &SnapshotId,
        home: &Path,
        owner: Option<(u32, u32)>,
    ) -> Result<()> {
        let source = self.snapshot_home(id)?;
        let cancel = CancellationToken::new();
        Cmd::new("cp")
            .args(["-a", "--"])
            .arg(source.join("."))
            .arg(home)
            .timeout(COPY_TIMEOUT)
            .run_checked(&cancel)
            .await
            .map_err(|e| {
                provider_err(format!(
                    "copying snapshot {id} into {} failed (was it deleted meanwhile?): {e}",
                    home.display()
                ))
            })?;
        if let Some((uid, gid)) = owner {
            Cmd::new("chown")
                .args(["-R", "--no-dereference", &format!("{uid}:{gid}"), "--"])
                .arg(home)
                .timeout(COPY_TIMEOUT)
                .run_checked(&cancel)
                .await?;
        }
        Ok(())
    }
}

/// Makes an unpacked home safe to keep and returns what it takes on disk: removes anything
/// that is not a directory, regular file or symlink (FIFOs, sockets, devices) and clears
/// setuid/setgid bits of files (the copy is root's until it is restored). Nothing else writes
/// the private staging directory, so checking by path is not racy here.
fn settle(root: &Path) -> Result<u64> {
    let mut size = 0u64;
    let mut seen = std::collections::HashSet::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let meta = std::fs::symlink_metadata(&dir).map_err(io_err(&dir))?;
        size += meta.blocks() * 512;
        for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
            let path = entry.map_err(io_err(&dir))?.path();
            let meta = std::fs::symlink_metadata(&path).map_err(io_err(&path))?;
            let kind = meta.file_type();
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() || kind.is_symlink() {
                if kind.is_file() && meta.mode() & 0o6000 != 0 {
                    let mode = meta.mode() & 0o7777 & !0o6000;
                    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                        .map_err(io_err(&path))?;
                }
                // Hard links take their blocks once.
                if meta.nlink() < 2 || seen.insert((meta.dev(), meta.ino())) {
                    size += meta.blocks() * 512;
                }
            } else {
                std::fs::remove_file(&path).map_err(io_err(&path))?;
            }
        }
    }
    Ok(size)
}
