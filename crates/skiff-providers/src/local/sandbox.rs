//! A local box as a sandbox (when the gateway is root): its own mount namespace with a minimal
//! filesystem view ([`super::rootfs`]), its own PID namespace, resource limits, optionally its
//! network namespace, and `sshd` in the foreground under a PID 1 of the box's own.
//!
//! ```text
//! provider: setsid -w unshare --mount --pid --propagation private -- skiff box sandbox-start DIR
//!   sandbox-start  new session and mount namespace, the host's PID namespace: starts the init,
//!                  waits for its "ready" line, records its pid in DIR/box.pid, exits
//!   sandbox-init   PID 1 of the box's PID namespace: cgroup (v2, where the host lets us), netns,
//!                  the filesystem view (pivot_root), rlimits, then `sshd -D` as its child; reaps
//!                  orphans, forwards SIGTERM/SIGINT to sshd, exits when sshd does
//! ```
//!
//! Killing the init (the pid in `box.pid`) ends the PID namespace, so every process of the box
//! with it. The stages are separate processes because after `unshare --pid` only the children
//! of a process live in the new namespace, and the starter must leave the caller's process group
//! (which the process helper kills) without waiting for the box to end.
//!
//! Deliberately absent: a user namespace (the box user is a real, unprivileged user of the host,
//! so files the box writes are owned by it), seccomp filters, and cgroup v1 (rlimits are the
//! limits there).

use super::boxes::{BoxRecord, read_record_at};
use super::rootfs;
use crate::{Error, Limits, Result};
use skiff_process::Cmd;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Where the box's process is recorded (the init's pid; for an unsandboxed box, sshd's).
pub(super) const PID_FILE: &str = "box.pid";
/// The hidden `skiff box` subcommands of the two stages.
pub const START: &str = "sandbox-start";
pub const INIT: &str = "sandbox-init";
const LOG: &str = "sandbox.log";
/// sshd's pid file inside the box (its own `/run`): written once sshd listens.
pub(super) const SSHD_PID_INSIDE: &str = "/run/sshd.pid";
const SSHD_READY_WITHIN: Duration = Duration::from_secs(15);
const PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The command that starts the box in `dir` with `exe` (this `skiff`); it returns once the
/// box's sshd listens.
pub(super) fn launch(exe: &Path, dir: &Path) -> Cmd {
    // `setsid -w`: the starter runs in a session of its own, so the init it leaves behind is
    // not in the process group the helper kills when this command ends.
    Cmd::new("setsid")
        .args([
            "-w",
            "unshare",
            "--mount",
            "--pid",
            "--propagation",
            "private",
            "--",
        ])
        .arg(exe)
        .args(["box", START])
        .arg(dir)
}

/// What the init's command line contains (checked with the recorded pid: a pid file can
/// outlive its process, and the number may since belong to someone else).
pub(super) fn init_marker(dir: &Path) -> String {
    format!("\0box\0{INIT}\0{}", dir.display())
}

/// The cgroup v2 directory of box `id`, where one was made.
pub(super) fn cgroup_dir(id: &str) -> PathBuf {
    Path::new(CGROUP_ROOT).join("skiff").join(id)
}

fn fail(dir: &Path, step: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let dir = dir.display().to_string();
    let step = step.into();
    move |source| Error::Sandbox { dir, step, source }
}

/// Stage 1 (`skiff box sandbox-start DIR`), run by `unshare` in the box's new mount namespace
/// with a PID namespace for its children. Single-threaded: after `unshare --pid` this process
/// cannot start threads.
pub fn start(dir: &Path) -> Result<()> {
    let exe = std::env::current_exe().map_err(fail(dir, "locate the skiff executable"))?;
    let log_path = dir.join(LOG);
    let log = std::fs::File::create(&log_path).map_err(fail(dir, "create sandbox.log"))?;
    // Not through the process helper: the init must outlive this process, which exits as soon
    // as the box is up.
    let mut init = std::process::Command::new(&exe)
        .args(["box", INIT])
        .arg(dir)
        .env_clear()
        .env("PATH", PATH)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(fail(dir, "start the sandbox init"))?;
    let mut line = String::new();
    if let Some(out) = init.stdout.take() {
        // End of file (the init exited) leaves `line` empty: handled below.
        let _ = BufReader::new(out).read_line(&mut line);
    }
    if line.trim() == "ready" {
        let pid_file = dir.join(PID_FILE);
        let tmp = dir.join(format!("{PID_FILE}.tmp"));
        std::fs::write(&tmp, format!("{}\n", init.id()))
            .and_then(|()| std::fs::rename(&tmp, &pid_file))
            .map_err(fail(dir, "record the init's pid"))?;
        return Ok(());
    }
    let status = init
        .wait()
        .map(|s| s.to_string())
        .unwrap_or_else(|e| e.to_string());
    let said = std::fs::read_to_string(&log_path).unwrap_or_default();
    Err(Error::Provider {
        provider: "local",
        message: format!(
            "the sandbox of box {} did not start (init {status}): {}",
            dir.display(),
            said.trim()
        ),
    })
}

/// Stage 2 (`skiff box sandbox-init DIR`): PID 1 of the box. Builds the sandbox, runs sshd
/// in it and returns sshd's exit code when it ends.
pub fn init(dir: &Path) -> Result<i32> {
    if rustix::process::getpid() != rustix::process::Pid::INIT {
        // On the host this would pivot the host's own mount namespace.
        return Err(fail(dir, "start")(std::io::Error::other(
            "sandbox-init runs only as PID 1 of a new PID namespace (started by sandbox-start)",
        )));
    }
    close_inherited_descriptors();
    let record = read_record_at(dir).ok_or_else(|| {
        fail(dir, "read box.json")(std::io::Error::from(std::io::ErrorKind::NotFound))
    })?;
    match join_cgroup(&record) {
        Ok(_) => {}
        // The rlimits below still hold; cgroup v2 limits are a second fence where the host has one.
        Err(e) => eprintln!("warning: cgroup v2 limits not applied: {e}; rlimits apply"),
    }
    if let Some(ns) = &record.netns {
        enter_netns(dir, ns)?;
    }
    rootfs::enter(&rootfs::View {
        box_dir: dir,
        user: &record.user,
        tmp_bytes: record.limits.tmp_bytes,
        shares: &record.shares,
    })?;
    apply_limits(dir, &record.limits)?;
    // Current-thread: signals and timers without threads of its own.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(fail(dir, "start its runtime"))?;
    runtime.block_on(supervise(dir))
}

/// Closes every descriptor above stderr that the init inherited. The gateway's spawns inherit
/// whatever its own parent left open without `FD_CLOEXEC` (a `flock FILE cargo test` lock, a
/// service manager's socket), and the init lives as long as the box: holding such a descriptor
/// would keep a lock for ever and hand the box a handle on a host file. Runs first, before this
/// process opens anything of its own.
// The one `unsafe` of the workspace: the standard library has no `closefrom`, and taking
// ownership of a raw descriptor to close it is `unsafe` by definition.
#[allow(unsafe_code)]
fn close_inherited_descriptors() {
    use std::os::fd::{FromRawFd, OwnedFd, RawFd};
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let numbers: Vec<RawFd> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    // The directory handle that listed them is closed by now; its number is skipped because
    // it no longer resolves.
    for fd in numbers {
        if std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok() {
            // SAFETY: `fd` is open, and nothing in this process owns it: it was inherited across
            // `execve`, and this runs before the init has opened anything of its own.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

fn enter_netns(dir: &Path, ns: &str) -> Result<()> {
    let path = Path::new("/run/netns").join(ns);
    let file = std::fs::File::open(&path).map_err(fail(
        dir,
        format!("open network namespace {}", path.display()),
    ))?;
    use std::os::fd::AsFd;
    rustix::thread::move_into_link_name_space(
        file.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .map_err(|e| fail(dir, format!("enter network namespace {ns}"))(e.into()))
}

/// Soft and hard limits alike, so nothing in the box can raise them. `RLIMIT_NPROC` counts the
/// box user's processes (root's are exempt), and the box user is the box's alone.
fn apply_limits(dir: &Path, limits: &Limits) -> Result<()> {
    use rustix::process::{Resource, Rlimit, setrlimit};
    for (resource, value) in [
        (Resource::Nproc, limits.processes),
        (Resource::Nofile, limits.open_files),
        (Resource::Fsize, limits.file_size_bytes),
        (Resource::As, limits.memory_bytes),
        (Resource::Core, 0),
    ] {
        setrlimit(
            resource,
            Rlimit {
                current: Some(value),
                maximum: Some(value),
            },
        )
        .map_err(|e| fail(dir, format!("set {resource:?} to {value}"))(e.into()))?;
    }
    Ok(())
}

/// Puts this process (so the whole box) in a cgroup v2 of its own with `memory.max` and
/// `pids.max`, where the host has cgroup v2 at `/sys/fs/cgroup` with both controllers and lets
/// us write it. `Ok(false)` where it has not (cgroup v1, hybrid hierarchies).
fn join_cgroup(record: &BoxRecord) -> std::io::Result<bool> {
    let root = Path::new(CGROUP_ROOT);
    let controllers = match std::fs::read_to_string(root.join("cgroup.controllers")) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
    if !(has("memory") && has("pids")) {
        return Ok(false);
    }
    let leaf = cgroup_dir(&record.id);
    let Some(parent) = leaf.parent() else {
        return Ok(false);
    };
    std::fs::create_dir_all(parent)?;
    // A controller is usable in a cgroup only when every level above enables it.
    std::fs::write(root.join("cgroup.subtree_control"), "+memory +pids")?;
    std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids")?;
    match std::fs::create_dir(&leaf) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    std::fs::write(
        leaf.join("memory.max"),
        record.limits.memory_bytes.to_string(),
    )?;
    std::fs::write(leaf.join("pids.max"), record.limits.processes.to_string())?;
    std::fs::write(leaf.join("cgroup.procs"), "0")?;
    Ok(true)
}

async fn supervise(dir: &Path) -> Result<i32> {
    use tokio::signal::unix::{SignalKind, signal};
    // Watched before sshd starts, so no exit or signal falls between two looks.
    let watch =
        |kind: SignalKind, name: &str| signal(kind).map_err(fail(dir, format!("watch for {name}")));
    let mut term = watch(SignalKind::terminate(), "SIGTERM")?;
    let mut int = watch(SignalKind::interrupt(), "SIGINT")?;
    let mut child = watch(SignalKind::child(), "SIGCHLD")?;

    // Not through the process helper: PID 1 reaps every process of the box itself (orphans
    // are re-parented to it), which a helper that waits for its own child cannot do.
    let sshd = std::process::Command::new(super::sshd::SSHD)
        .arg("-D")
        .arg("-f")
        .arg(dir.join("etc/sshd_config"))
        .arg("-E")
        .arg(dir.join("sshd.log"))
        .env_clear()
        .env("PATH", PATH)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(fail(dir, format!("start {}", super::sshd::SSHD)))?;
    let sshd = i32::try_from(sshd.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| fail(dir, "start sshd")(std::io::Error::other("no pid")))?;

    // sshd writes its pid file once its socket is bound.
    let deadline = Instant::now() + SSHD_READY_WITHIN;
    while !Path::new(SSHD_PID_INSIDE).exists() {
        if let Some(code) = reap(sshd) {
            eprintln!("error: sshd exited with {code} before it listened; see sshd.log");
            return Ok(code.max(1));
        }
        if Instant::now() > deadline {
            let _ = rustix::process::kill_process(sshd, rustix::process::Signal::KILL);
            eprintln!("error: sshd did not listen within {SSHD_READY_WITHIN:?}; see sshd.log");
            return Ok(1);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut out = std::io::stdout();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .map_err(fail(dir, "report that it is ready"))?;

    loop {
        if let Some(code) = reap(sshd) {
            return Ok(code);
        }
        tokio::select! {
            _ = term.recv() => forward_term(sshd),
            _ = int.recv() => forward_term(sshd),
            _ = child.recv() => {}
        }
    }
}

fn forward_term(sshd: rustix::process::Pid) {
    // ESRCH: sshd is already gone, and its exit is reaped next.
    let _ = rustix::process::kill_process(sshd, rustix::process::Signal::TERM);
}

/// Reaps every exited child; sshd's exit code once it has exited.
fn reap(sshd: rustix::process::Pid) -> Option<i32> {
    use rustix::process::{WaitOptions, wait};
    loop {
        match wait(WaitOptions::NOHANG) {
            Ok(Some((pid, status))) if pid == sshd => {
                return Some(
                    status
                        .exit_status()
                        .unwrap_or_else(|| 128 + status.terminating_signal().unwrap_or(0)),
                );
            }
            // An orphan of the box, re-parented to PID 1.
            Ok(Some(_)) => {}
            Ok(None) => return None,
            // No child at all: sshd is gone without a status to report.
            Err(_) => return Some(1),
        }
    }
}
