//! Snapshots of local boxes: what a snapshot keeps and leaves out, a box started from one, and
//! deletion. Boxes here are unsandboxed (no `skiff` executable to run a sandbox with) but have
//! users of their own; the CLI's tests start sandboxed boxes from snapshots.

use skiff_protocol::SnapshotId;
use skiff_protocol::lease::LeaseCliStatus;
use skiff_providers::local::Boxes;
use skiff_providers::{Error, Isolation};
use skiff_ssh::{Ssh, Target};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A box root of its own (0711 under /tmp, so box users reach their homes); every box made
/// through it is destroyed on drop, also when the test panics.
struct Root {
    boxes: Boxes,
    made: std::sync::Mutex<Vec<String>>,
    ssh_dir: tempfile::TempDir,
    dir: tempfile::TempDir,
}

fn unique(prefix: &str, len: usize) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let seed = format!(
        "{}-{:?}-{}",
        std::process::id(),
        std::time::SystemTime::now(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    format!("{prefix}{}", &blake3::hash(seed.as_bytes()).to_hex()[..len])
}

fn snapshot_id() -> SnapshotId {
    SnapshotId::parse(&unique("snap_", 16)).unwrap()
}

impl Root {
    fn new() -> Root {
        let dir = tempfile::Builder::new()
            .prefix("skiff-snapshot-boxes-")
            .tempdir_in("/tmp")
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let boxes =
            Boxes::new(dir.path().to_path_buf(), PathBuf::from("/bin/false")).without_sandbox();
        Root {
            boxes,
            made: std::sync::Mutex::new(Vec::new()),
            ssh_dir: tempfile::tempdir().unwrap(),
            dir,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    async fn create(&self, from: Option<&SnapshotId>) -> skiff_providers::Result<LeaseCliStatus> {
        let id = unique("lbx_", 12);
        self.made.lock().unwrap().push(id.clone());
        let ttl = Duration::from_secs(3600);
        match from {
            Some(snapshot) => {
                self.boxes
                    .create_from_snapshot(&id, snapshot, Isolation::None, ttl)
                    .await
            }
            None => self.boxes.create(&id, Isolation::None, ttl).await,
        }
    }

    fn ssh(&self, status: &LeaseCliStatus) -> Ssh {
        Ssh::pin(
            Target {
                alias: status.id.clone(),
                host: status.ssh_host.clone(),
                port: status.ssh_port,
                user: status.ssh_user.clone(),
                identity_file: PathBuf::from(&status.ssh_key),
                host_key: status.ssh_host_key.clone(),
                proxy_command: status.proxy_command.clone(),
            },
            &self.ssh_dir.path().join(&status.id),
        )
        .unwrap()
    }

    fn snapshot_home(&self, id: &SnapshotId) -> PathBuf {
        self.path().join("snapshots").join(id.as_str()).join("home")
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let boxes = self.boxes.clone();
        let made = std::mem::take(&mut *self.made.lock().unwrap());
        // Drop may run inside the test's runtime: tear down on a thread of our own.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            for id in made {
                if let Err(e) = rt.block_on(boxes.destroy(&id)) {
                    eprintln!("could not destroy box {id}: {e}");
                }
            }
        });
        let _ = done.join();
    }
}

async fn sh(ssh: &Ssh, script: &str) -> String {
    ssh.run(script, &CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("on the box: {script}: {e}"))
}

/// What a setup script leaves behind, plus what a session and the worker would have put there.
const PREPARE: &str = "set -e
mkdir -p .toolchain/bin
printf 'installed by setup' > .toolchain/bin/marker
chmod 750 .toolchain/bin/marker
printf x > .toolchain/bin/suid && chmod 4755 .toolchain/bin/suid
ln -s /etc/hostname outside-link
ln -s .toolchain/bin/marker inside-link
mkfifo fifo
mkdir -p workspaces/ses_a && printf work > workspaces/ses_a/file
printf work > workspace/file
mkdir -p .skiff/bundles/abc && printf secret > .skiff/credential.1 && printf log > .skiff/worker.log
printf bin > .skiff/bundles/abc/skiff";

#[tokio::test]
async fn a_snapshot_keeps_the_prepared_home_and_leaves_out_workspaces_worker_files_and_fifos() {
    let root = Root::new();
    let prepared = root.create(None).await.unwrap();
    let ssh = root.ssh(&prepared);
    sh(&ssh, PREPARE).await;

    let id = snapshot_id();
    let info = root.boxes.snapshot(&prepared.id, &id).await.unwrap();
    assert_eq!(info.id, id);
    assert!(info.size_bytes > 0, "{info:?}");

    let home = root.snapshot_home(&id);
    let marker = home.join(".toolchain/bin/marker");
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "installed by setup"
    );
    let meta = std::fs::metadata(&marker).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o750, "the mode was not kept");
    assert_eq!(
        meta.uid(),
        0,
        "a snapshot belongs to root until it is restored"
    );
    let suid = std::fs::metadata(home.join(".toolchain/bin/suid")).unwrap();
    assert_eq!(suid.mode() & 0o7777, 0o755, "a setuid bit was kept");
    // Symlinks are copied as symlinks, never followed.
    let link = std::fs::symlink_metadata(home.join("outside-link")).unwrap();
    assert!(link.file_type().is_symlink());
    assert_eq!(
        std::fs::read_link(home.join("outside-link")).unwrap(),
        Path::new("/etc/hostname")
    );
    assert_eq!(
        std::fs::read_link(home.join("inside-link")).unwrap(),
        Path::new(".toolchain/bin/marker")
    );
    for absent in ["fifo", "workspaces", "workspace", ".skiff"] {
        assert!(
            std::fs::symlink_metadata(home.join(absent)).is_err(),
            "the snapshot has {absent}"
        );
    }
    // Box users can neither list nor enter the snapshots.
    let store = std::fs::metadata(root.path().join("snapshots")).unwrap();
    assert_eq!((store.uid(), store.mode() & 0o777), (0, 0o700));
    let denied = sh(
        &ssh,
        &format!(
            "ls {} 2>&1 || true",
            root.path().join("snapshots").display()
        ),
    )
    .await;
    assert!(denied.contains("Permission denied"), "{denied}");

    // The snapshot store is not a box, and asking again returns the same snapshot.
    assert_eq!(
        root.boxes.list().unwrap(),
        std::slice::from_ref(&prepared.id)
    );
    assert_eq!(
        root.boxes.list_snapshots().unwrap(),
        std::slice::from_ref(&info)
    );
    assert_eq!(root.boxes.snapshot(&prepared.id, &id).await.unwrap(), info);
    let staging = root.path().join("snapshots/.staging");
    assert_eq!(
        std::fs::read_dir(&staging).map(|d| d.count()).unwrap_or(0),
        0,
        "a capture left its staging directory"
    );
    ssh.close().await;
}

#[tokio::test]
async fn a_box_from_a_snapshot_has_the_prepared_home_owned_by_its_own_user() {
    let root = Root::new();
    let prepared = root.create(None).await.unwrap();
    let ssh = root.ssh(&prepared);
    sh(&ssh, PREPARE).await;
    let id = snapshot_id();
    root.boxes.snapshot(&prepared.id, &id).await.unwrap();
    // The snapshot outlives the box it came from.
    ssh.close().await;
    root.boxes.destroy(&prepared.id).await.unwrap();

    let fresh = root.create(Some(&id)).await.unwrap();
    assert_ne!(fresh.ssh_user, prepared.ssh_user);
    let ssh = root.ssh(&fresh);
    let seen = sh(
        &ssh,
        "id -un; stat -c '%U %a' .toolchain/bin/marker; cat inside-link; echo; \
         readlink outside-link; stat -c '%U' -- . .toolchain workspace; \
         stat -c '%a' .; ls -A",
    )
    .await;
    let user = &fresh.ssh_user;
    assert_eq!(
        seen,
        format!(
            "{user}\n{user} 750\ninstalled by setup\n/etc/hostname\n{user}\n{user}\n{user}\n700\n\
             .toolchain\ninside-link\noutside-link\nworkspace\n"
        ),
        "the new box's home"
    );
    // The symlink itself was handed over, not what it points at.
    let host_link = root.path().join(&fresh.id).join("home/outside-link");
    assert_eq!(std::fs::symlink_metadata(&host_link).unwrap().uid(), {
        std::fs::metadata(root.path().join(&fresh.id).join("home"))
            .unwrap()
            .uid()
    });
    assert_eq!(std::fs::metadata("/etc/hostname").unwrap().uid(), 0);
    ssh.close().await;
}

#[tokio::test]
async fn a_deleted_or_half_made_snapshot_starts_no_box() {
    let root = Root::new();
    let prepared = root.create(None).await.unwrap();
    let id = snapshot_id();
    root.boxes.snapshot(&prepared.id, &id).await.unwrap();
    root.boxes.delete_snapshot(&id).await.unwrap();
    assert!(!root.path().join("snapshots").join(id.as_str()).exists());
    assert!(root.boxes.list_snapshots().unwrap().is_empty());
    // Deleting again is not an error.
    root.boxes.delete_snapshot(&id).await.unwrap();

    // A capture that died half-way (its process gone) left a staging directory that has
    // everything but the rename into place.
    let torn = snapshot_id();
    let leftover = root
        .path()
        .join("snapshots/.staging")
        .join(format!("{torn}.999999999.0.capture"));
    std::fs::create_dir_all(leftover.join("home")).unwrap();
    std::fs::write(
        leftover.join("snapshot.json"),
        format!(
            "{{\"id\":\"{torn}\",\"lease_id\":\"{}\",\"size_bytes\":1,\"created_at_ms\":0}}",
            prepared.id
        ),
    )
    .unwrap();
    assert!(root.boxes.list_snapshots().unwrap().is_empty());

    let before = root.boxes.list().unwrap();
    for missing in [&id, &torn] {
        match root.create(Some(missing)).await {
            Err(Error::UnknownSnapshot { snapshot, .. }) => assert_eq!(&snapshot, missing),
            other => panic!("a box from a missing snapshot: {other:?}"),
        }
    }
    assert_eq!(
        root.boxes.list().unwrap(),
        before,
        "a box was leased anyway"
    );

    // The next capture clears what the dead one left.
    root.boxes
        .snapshot(&prepared.id, &snapshot_id())
        .await
        .unwrap();
    assert!(
        !leftover.exists(),
        "the dead capture's staging directory survived"
    );
}

#[tokio::test]
async fn a_restore_replaces_a_running_boxs_home_without_following_what_the_box_planted() {
    let root = Root::new();
    let prepared = root.create(None).await.unwrap();
    let ssh = root.ssh(&prepared);
    sh(&ssh, PREPARE).await;
    let id = snapshot_id();
    root.boxes.snapshot(&prepared.id, &id).await.unwrap();
    ssh.close().await;

    // Something of the host's that root may write and the box may not.
    let outside = tempfile::tempdir().unwrap();
    std::fs::set_permissions(outside.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir(outside.path().join("bin")).unwrap();
    let victim = outside.path().join("bin/marker");
    std::fs::write(&victim, "the host's own").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();

    // A box that was used for something else: stray files, a directory it made read-only,
    // its worker's files, a workspace — and symlinks where the snapshot has a directory and
    // a file, pointing out of the home.
    let used = root.create(None).await.unwrap();
    let ssh = root.ssh(&used);
    sh(
        &ssh,
        &format!(
            "set -e
printf old > stray
mkdir -p other/deep && printf old > other/deep/file && chmod 500 other/deep other
ln -s {dir} .toolchain
ln -s {victim} inside-link
printf work > workspace/file
mkdir -p .skiff/bundles/abc && printf bin > .skiff/bundles/abc/skiff",
            dir = outside.path().display(),
            victim = victim.display()
        ),
    )
    .await;

    root.boxes.restore(&used.id, &id).await.unwrap();

    let seen = sh(
        &ssh,
        "cat .toolchain/bin/marker; echo; stat -c '%F %U %a' .toolchain/bin/marker; \
         stat -c '%F' .toolchain; readlink inside-link; readlink outside-link; \
         cat workspace/file; echo; cat .skiff/bundles/abc/skiff; echo; stat -c '%a' .; \
         ls -A; find . ! -user \"$(id -un)\"",
    )
    .await;
    let user = &used.ssh_user;
    assert_eq!(
        seen,
        format!(
            "installed by setup\nregular file {user} 750\ndirectory\n.toolchain/bin/marker\n\
             /etc/hostname\nwork\nbin\n700\n.skiff\n.toolchain\ninside-link\noutside-link\n\
             workspace\n"
        ),
        "the restored home (the last line: files not the box user's)"
    );
    // Nothing outside the home was written through the planted symlinks.
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "the host's own");
    let meta = std::fs::metadata(&victim).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o644));
    assert_eq!(
        std::fs::read_dir(outside.path()).unwrap().count(),
        1,
        "something was made outside the home"
    );
    // The snapshot itself is unchanged and still root's.
    let kept = root.snapshot_home(&id).join(".toolchain/bin/marker");
    assert_eq!(std::fs::metadata(&kept).unwrap().uid(), 0);

    // A snapshot that is not here leaves the home as it is.
    let missing = snapshot_id();
    match root.boxes.restore(&used.id, &missing).await {
        Err(Error::UnknownSnapshot { snapshot, .. }) => assert_eq!(snapshot, missing),
        other => panic!("a restore from a missing snapshot: {other:?}"),
    }
    assert_eq!(
        sh(&ssh, "cat .toolchain/bin/marker").await,
        "installed by setup"
    );
    ssh.close().await;
}
