//! Local boxes: each one a directory with its own home and workspace root, its own host key
//! and client key, optionally its own network namespace, and a real `sshd`. When we are root a
//! box is a sandbox ([`super::sandbox`]): its own user, mount and PID namespaces, a minimal
//! filesystem view and resource limits. Without root it is sshd as the gateway's own user
//! (development only).
//!
//! ```text
//! <root>/<box-id>/            root-owned 0755
//!   box.json                  what this box is (written before anything is started)
//!   client_key                the gateway's key for this box (0600, not readable by the box)
//!   etc/                      sshd_config, host key (0600), authorized_keys
//!   home/                     the box user's home (0700, owned by the box user)
//!     workspace/              where synced workspaces go
//!   rootfs/                   where the sandbox mounts the box's root (empty on the host)
//!   box.pid                   the sandbox init's pid (unsandboxed: sshd's)
//!   sandbox.log, sshd.log
//! <root>/snapshots/           prepared homes boxes can start from (see [`super::snapshots`]);
//!                             never a box, never listed as one
//! ```

use super::{netns, procs, sandbox, sshd, user};
use crate::config::{Isolation, Limits};
use crate::{Error, Result, io_err, now_ms};
use serde::{Deserialize, Serialize};
use skiff_protocol::SnapshotId;
use skiff_protocol::lease::LeaseCliStatus;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a box is, written before anything of it is started, so a crash mid-create leaves
/// enough behind to find and remove every piece.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct BoxRecord {
    pub(super) id: String,
    isolation: Isolation,
    port: u16,
    pub(super) user: String,
    /// Whether `user` was created for this box (and is removed with it).
    pub(super) own_user: bool,
    pub(super) netns: Option<String>,
    /// Whether the box runs in a sandbox (`box.pid` is then the sandbox init's).
    #[serde(default)]
    pub(super) sandboxed: bool,
    /// What the sandbox lets the box use.
    #[serde(default)]
    pub(super) limits: Limits,
    /// Host directories shown read-only at their own path inside the sandbox.
    #[serde(default)]
    pub(super) shares: Vec<PathBuf>,
    created_at_ms: i64,
    expires_at_ms: i64,
    /// `starting` until sshd runs, then `running`.
    state: String,
    /// The snapshot the home was copied from, if any (after a restore onto the running box:
    /// the one restored).
    #[serde(default)]
    pub(super) from_snapshot: Option<SnapshotId>,
}

/// The record of the box in `dir`, if it has a readable one.
pub(super) fn read_record_at(dir: &Path) -> Option<BoxRecord> {
    let text = std::fs::read_to_string(dir.join("box.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// The local boxes under one root directory.
#[derive(Clone, Debug)]
pub struct Boxes {
    pub(super) root: PathBuf,
    skiff_exe: PathBuf,
    limits: Limits,
    shares: Vec<PathBuf>,
    sandbox: bool,
}

pub(super) fn provider_err(message: String) -> Error {
    Error::Provider {
        provider: "local",
        message,
    }
}

impl Boxes {
    /// Boxes under `root`; `skiff_exe` is this `skiff` (the sandbox's init and the netns
    /// proxy run it).
    pub fn new(root: PathBuf, skiff_exe: PathBuf) -> Self {
        Self {
            // Absolute: sshd's config and the sandbox place the box by this path.
            root: std::path::absolute(&root).unwrap_or(root),
            skiff_exe,
            limits: Limits::default(),
            shares: Vec::new(),
            sandbox: true,
        }
    }

    /// What each new box may use.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Host directories each new box sees read-only (checked by the profile's validation).
    pub fn with_shares(mut self, shares: Vec<PathBuf>) -> Self {
        self.shares = shares;
        self
    }

    /// New boxes get a user of their own (as root) but no sandbox, for tests of other crates
    /// that have no `skiff` executable to run the sandbox with. Never used by the gateway.
    pub fn without_sandbox(mut self) -> Self {
        self.sandbox = false;
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub(super) fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    pub(super) fn read_record(&self, id: &str) -> Option<BoxRecord> {
        read_record_at(&self.dir(id))
    }

    pub(super) fn write_record(&self, record: &BoxRecord) -> Result<()> {
        let path = self.dir(&record.id).join("box.json");
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(record).map_err(|e| provider_err(e.to_string()))?;
        std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    /// Makes sure box users can reach their homes under the root: the root is 0711 and every
    /// directory above it lets others through.
    fn prepare_root(&self, own_users: bool) -> Result<()> {
        std::fs::create_dir_all(&self.root).map_err(io_err(&self.root))?;
        if !own_users {
            return Ok(());
        }
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o711))
            .map_err(io_err(&self.root))?;
        for dir in self.root.ancestors().skip(1) {
            let mode = std::fs::metadata(dir)
                .map_err(io_err(dir))?
                .permissions()
                .mode();
            if mode & 0o001 == 0 {
                return Err(provider_err(format!(
                    "box users cannot reach {}: {} is not searchable by others (mode {:o}); choose another `root` for local boxes",
                    self.root.display(),
                    dir.display(),
                    mode & 0o777
                )));
            }
        }
        Ok(())
    }

    /// Creates box `id` (or returns it, when it already runs). A half-made box from an
    /// interrupted create is removed and made again.
    pub async fn create(
        &self,
        id: &str,
        isolation: Isolation,
        ttl: Duration,
    ) -> Result<LeaseCliStatus> {
        self.create_inner(id, isolation, ttl, None).await
    }

    /// Like [`Boxes::create`], with the home a copy of snapshot `from` (owned by the new box's
    /// user). A snapshot that is not here is [`Error::UnknownSnapshot`], with nothing made.
    pub async fn create_from_snapshot(
        &self,
        id: &str,
        from: &SnapshotId,
        isolation: Isolation,
        ttl: Duration,
    ) -> Result<LeaseCliStatus> {
        self.create_inner(id, isolation, ttl, Some(from)).await
    }

    async fn create_inner(
        &self,
        id: &str,
        isolation: Isolation,
        ttl: Duration,
        from: Option<&SnapshotId>,
    ) -> Result<LeaseCliStatus> {
        if let Some(record) = self.read_record(id) {
            if record.state == "running" && self.sshd_alive(id) {
                if from.is_some() && record.from_snapshot.as_ref() != from {
                    // The caller would believe the home is prepared when it is not.
                    return Err(provider_err(format!(
                        "box {id} already runs with a home from {}, not from snapshot {}; use another lease id",
                        record
                            .from_snapshot
                            .as_ref()
                            .map_or_else(|| "no snapshot".to_owned(), |s| format!("snapshot {s}")),
                        from.map(SnapshotId::as_str).unwrap_or_default(),
                    )));
                }
                return self.status_of(&record);
            }
            self.destroy(id).await?;
        }
        if let Some(snapshot) = from {
            // Before anything of the box exists: a missing snapshot leases nothing.
            self.snapshot_home(snapshot)?;
        }
        let root_user = rustix::process::geteuid().is_root();
        let sandboxed = root_user && self.sandbox;
        self.prepare_root(root_user)?;
        let dir = self.dir(id);
        let etc = dir.join("etc");
        let home = dir.join("home");
        for d in [&dir, &etc, &home, &home.join("workspace")] {
            std::fs::create_dir_all(d).map_err(io_err(d))?;
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .map_err(io_err(&dir))?;

        let (user, own_user) = if root_user {
            (user::name(id), true)
        } else {
            (current_user().await?, false)
        };
        let port = match isolation {
            Isolation::Netns => 22,
            Isolation::None => free_port()?,
        };

        let now = now_ms();
        let mut record = BoxRecord {
            id: id.to_owned(),
            isolation,
            port,
            user: user.clone(),
            own_user,
            netns: (isolation == Isolation::Netns).then(|| netns::name(id)),
            sandboxed,
            limits: self.limits,
            shares: self.shares.clone(),
            created_at_ms: now,
            expires_at_ms: now + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2),
            state: "starting".into(),
            from_snapshot: from.cloned(),
        };
        self.write_record(&record)?;

        let owner = if own_user {
            let uid = user::create(&user, &home).await?;
            Some((uid, user::gid(&user).await?))
        } else {
            None
        };
        if let Some(snapshot) = from {
            // Before the box's sshd starts: no process of the new user exists yet to race
            // the copy.
            self.restore_home(snapshot, &home, owner).await?;
        }
        if let Some((uid, _)) = owner {
            for d in [&home, &home.join("workspace")] {
                std::os::unix::fs::chown(d, Some(uid), None).map_err(io_err(d))?;
            }
            std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700))
                .map_err(io_err(&home))?;
            if !sandboxed {
                // sshd's privilege separation directory (a sandbox has its own).
                std::fs::create_dir_all("/run/sshd").map_err(io_err(Path::new("/run/sshd")))?;
            }
        }
        if let Some(ns) = &record.netns {
            netns::create(ns).await?;
        }
        sshd::keygen(
            &etc.join("ssh_host_ed25519_key"),
            &format!("skiff box {id}"),
        )
        .await?;
        sshd::keygen(&dir.join("client_key"), &format!("skiff gateway for {id}")).await?;
        let client_pub = dir.join("client_key.pub");
        let authorized = etc.join("authorized_keys");
        std::fs::copy(&client_pub, &authorized).map_err(io_err(&authorized))?;
        std::fs::set_permissions(&authorized, std::fs::Permissions::from_mode(0o644))
            .map_err(io_err(&authorized))?;
        // A free loopback port can be taken by someone else before sshd binds it; then sshd
        // fails and another port is tried. (Inside a namespace, port 22 is always ours.)
        let mut tries = 0;
        loop {
            let config = sshd::Config {
                etc: &etc,
                dir: &dir,
                port: record.port,
                user: &user,
                sandboxed,
            };
            config.write()?;
            let started = if sandboxed {
                sandbox::launch(&self.skiff_exe, &dir)
                    .run_checked(&tokio_util::sync::CancellationToken::new())
                    .await
                    .map(drop)
                    .map_err(Error::from)
            } else {
                sshd::start(&config, record.netns.as_deref())
                    .await
                    .map(drop)
            };
            match started {
                Ok(()) => break,
                Err(_) if isolation == Isolation::None && tries < 3 => {
                    tries += 1;
                    record.port = free_port()?;
                    self.write_record(&record)?;
                }
                Err(e) => return Err(e),
            }
        }
        record.state = "running".into();
        self.write_record(&record)?;
        self.status_of(&record)
    }

    /// The box's process (its sandbox init, or sshd when unsandboxed), if the recorded pid is
    /// alive and really is that process of this box.
    pub(super) fn box_pid(&self, id: &str) -> Option<i32> {
        let dir = self.dir(id);
        let marker = match self.read_record(id) {
            Some(record) if record.sandboxed => sandbox::init_marker(&dir),
            _ => dir.join("etc/sshd_config").display().to_string(),
        };
        sshd::recorded_pid(&dir).filter(|pid| procs::alive_running(*pid, &marker))
    }

    fn sshd_alive(&self, id: &str) -> bool {
        self.box_pid(id).is_some()
    }

    fn status_of(&self, record: &BoxRecord) -> Result<LeaseCliStatus> {
        let dir = self.dir(&record.id);
        let host_key_path = dir.join("etc/ssh_host_ed25519_key.pub");
        let host_key = std::fs::read_to_string(&host_key_path).map_err(io_err(&host_key_path))?;
        // The comment is not part of the key.
        let host_key = host_key
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        let state = match record.state.as_str() {
            "running" if self.sshd_alive(&record.id) => "running",
            "running" => "failed",
            other => other,
        };
        Ok(LeaseCliStatus {
            id: record.id.clone(),
            state: state.to_owned(),
            ssh_host: "127.0.0.1".into(),
            ssh_port: record.port,
            ssh_user: record.user.clone(),
            ssh_key: dir.join("client_key").display().to_string(),
            ssh_host_key: host_key,
            expires_at: Some(record.expires_at_ms),
            proxy_command: record.netns.as_ref().map(|ns| {
                vec![
                    "ip".into(),
                    "netns".into(),
                    "exec".into(),
                    ns.clone(),
                    self.skiff_exe.display().to_string(),
                    "box".into(),
                    "proxy".into(),
                    "127.0.0.1".into(),
                    record.port.to_string(),
                ]
            }),
        })
    }

    /// The box's status, or `None` when there is no such box.
    pub fn status(&self, id: &str) -> Result<Option<LeaseCliStatus>> {
        match self.read_record(id) {
            Some(record) => self.status_of(&record).map(Some),
            None if self.dir(id).exists() => {
                Ok(Some(LeaseCliStatus::without_endpoint(id, "failed")))
            }
            None => Ok(None),
        }
    }

    /// Extends the box's expiry by `ttl` from now.
    pub fn heartbeat(&self, id: &str, ttl: Duration) -> Result<LeaseCliStatus> {
        let mut record = self.read_record(id).ok_or_else(|| Error::UnknownLease {
            provider: "local",
            lease: id.to_owned(),
        })?;
        record.expires_at_ms = now_ms() + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2);
        self.write_record(&record)?;
        self.status_of(&record)
    }

    /// Removes the root when it holds nothing (no box, nothing else); the next create makes it
    /// again. `remove_dir` refuses a directory that is not empty, so a box created meanwhile
    /// keeps its root. Whether it was removed; a root that is absent, in use or not empty is
    /// not an error.
    pub fn remove_root_if_empty(&self) -> Result<bool> {
        use std::io::ErrorKind;
        match std::fs::remove_dir(&self.root) {
            Ok(()) => Ok(true),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::NotFound | ErrorKind::DirectoryNotEmpty | ErrorKind::ResourceBusy
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(io_err(&self.root)(e)),
        }
    }

    /// Ids of every box under the root.
    pub fn list(&self) -> Result<Vec<String>> {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return Ok(Vec::new());
        };
        let mut ids: Vec<String> = dir
            .filter_map(std::result::Result::ok)
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            // INVARIANT: the snapshot store is never a box: the orphan sweep destroys what
            // this lists.
            .filter(|name| name != super::snapshots::DIR)
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Kills the box's process (the sandbox init, which takes its PID namespace with it; or
    /// sshd) and everything it started, removes its namespace, user, cgroup and directory, then
    /// checks each is gone. Idempotent.
    pub async fn destroy(&self, id: &str) -> Result<()> {
        if id == super::snapshots::DIR {
            return Err(provider_err(format!(
                "{} holds snapshots, not a box; delete snapshots one by one",
                self.dir(id).display()
            )));
        }
        let dir = self.dir(id);
        let record = self.read_record(id);
        let user = record
            .as_ref()
            .filter(|r| r.own_user)
            .map(|r| r.user.clone());
        let ns = record.as_ref().and_then(|r| r.netns.clone());
        let uid = match &user {
            Some(u) => user::uid(u).await?,
            None => None,
        };

        let box_pid = self.box_pid(id);
        // The box's process is looked up (pid file and command line) on every pass: once the
        // init is reaped, its pid may belong to someone else.
        let left = || {
            let mut pids = self.box_pid(id).map(procs::tree).unwrap_or_default();
            if let Some(uid) = uid {
                pids.extend(procs::owned_by(uid));
            }
            pids
        };
        // SIGKILL is delivered, not awaited: wait (bounded) until the processes are gone, so
        // the user can be removed and the evidence below is about a settled state.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let pids = left();
            if pids.is_empty() || std::time::Instant::now() > deadline {
                break;
            }
            procs::kill(&pids);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(ns) = &ns {
            netns::delete(ns).await?;
        }
        if let Some(user) = &user {
            user::delete(user).await?;
        }
        let cgroup = sandbox::cgroup_dir(id);
        if cgroup.exists() {
            std::fs::remove_dir(&cgroup).map_err(io_err(&cgroup))?;
        }
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }

        // Evidence, piece by piece.
        let mut missing = Vec::new();
        if let Some(pid) = box_pid
            && procs::alive(pid)
        {
            missing.push(format!("the box's process {pid} still runs"));
        }
        if let Some(uid) = uid {
            let left = procs::owned_by(uid);
            if !left.is_empty() {
                missing.push(format!("processes of the box user remain: {left:?}"));
            }
        }
        if let Some(ns) = &ns
            && netns::exists(ns).await?
        {
            missing.push(format!("network namespace {ns} still exists"));
        }
        if let Some(user) = &user
            && user::uid(user).await?.is_some()
        {
            missing.push(format!("user {user} still exists"));
        }
        if cgroup.exists() {
            missing.push(format!("cgroup {} still exists", cgroup.display()));
        }
        if dir.exists() {
            missing.push(format!("{} still exists", dir.display()));
        }
        if missing.is_empty() {
            // Housekeeping, not evidence: the box is gone either way, and the gateway's start
            // sweeps empty roots again.
            let _ = self.remove_root_if_empty();
            Ok(())
        } else {
            Err(Error::NoEvidence {
                provider: "local",
                lease: id.to_owned(),
                evidence: missing.join("; "),
            })
        }
    }
}

async fn current_user() -> Result<String> {
    let out = skiff_process::Cmd::new("id")
        .arg("-un")
        .run_checked(&tokio_util::sync::CancellationToken::new())
        .await?;
    Ok(out.trim().to_owned())
}

/// A loopback port nobody listens on right now.
fn free_port() -> Result<u16> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err(Path::new("127.0.0.1:0")))?;
    let port = listener
        .local_addr()
        .map_err(io_err(Path::new("127.0.0.1:0")))?
        .port();
    Ok(port)
}
