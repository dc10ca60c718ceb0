//! Containment of a command's whole process tree, for commands Skiff runs on the agent's
//! behalf (the `exec` tool).
//!
//! A process group is not a container: `setsid`, a double fork or a daemonizing program leave
//! it, and killing the group then misses them. So a contained command runs as the first
//! process (the init) of a PID namespace of its own — `unshare --pid --fork --kill-child`, with
//! `--user --map-current-user` when Skiff is not root, as on a worker box. Every process the
//! command starts, however it detaches, stays in that namespace, and the kernel kills all of
//! them when its init dies. Ending a command is therefore one SIGKILL to the init; `unshare`
//! (our direct child) waits for the init, whose exit in turn waits until the namespace is
//! empty, so once our child is reaped nothing of the command is left. A side effect worth
//! having: `kill -9 -1` inside a command reaches only the command's own processes.
//!
//! We chose this over a subreaper that hunts descendants: a subreaper needs a helper process of
//! our own (the library cannot assume one is installed) and still races with processes that
//! fork while it kills; a namespace has no such race and needs only util-linux.
//!
//! A gateway that dies (even by SIGKILL) takes its commands with it: `setpriv --pdeathsig KILL`
//! kills `unshare` when its parent dies, and `--kill-child` then kills the init. The parent
//! that counts is the *thread* that forked, so contained commands are all spawned from one
//! thread that lives as long as the process (a small runtime of their own), never from a pool
//! thread that may retire while the command runs. For what the signal cannot cover (a crash
//! in the instant between fork and `prctl`), a [`crate::Ledger`] records each leader.
//!
//! A command given a [`Sandbox`] is contained by `bwrap` instead, which adds a mount namespace
//! (`sandbox.rs`). Deliberately absent otherwise: a mount namespace (the command sees the
//! host's `/proc`) and resource limits; a process the command has started through a daemon (cron, systemd, ssh) is not its
//! descendant and is out of reach.

use crate::sandbox::{BWRAP, Sandbox};
use crate::{Cmd, Error, Finished, Result, procfs};
use rustix::process::{Pid, Signal};
use std::ffi::OsString;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a contained command's init gets to die before its `unshare` is killed outright.
const KILL_BOUND: Duration = Duration::from_secs(5);
/// How often the init is looked for (and killed) while waiting for `unshare` to exit.
const KILL_POLL: Duration = Duration::from_millis(20);

/// How the namespace is made; chosen once per process by trying.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    /// As root: a PID namespace alone.
    Pid,
    /// Without root (or without the right to make a PID namespace): a user namespace that
    /// maps only the current user, owning the PID namespace.
    UserPid,
    /// In a filesystem sandbox (`sandbox.rs`): `bwrap` makes the user, PID and mount
    /// namespaces, root or not.
    Sandboxed,
    /// Tests only: [`Variant::UserPid`] after dropping to this uid and gid, as on a worker box.
    #[cfg(test)]
    UserPidAs(u32),
}

impl Variant {
    fn unshare_args(self) -> &'static [&'static str] {
        const USER_PID: &[&str] = &[
            "--user",
            "--map-current-user",
            "--pid",
            "--fork",
            "--kill-child",
        ];
        match self {
            Variant::Pid => &["--pid", "--fork", "--kill-child"],
            Variant::UserPid => USER_PID,
            Variant::Sandboxed => USER_PID,
            #[cfg(test)]
            Variant::UserPidAs(_) => USER_PID,
        }
    }
}

/// The argv that runs `program args…` contained: `setpriv --pdeathsig KILL -- unshare … --
/// program args…`, or `… -- bwrap … -- program args…` in `sandbox` (`cwd` is where it
/// starts).
pub(crate) fn wrap(
    variant: Variant,
    sandbox: Option<&Sandbox>,
    cwd: Option<&Path>,
    program: &str,
    args: &[OsString],
) -> Vec<OsString> {
    let mut argv: Vec<OsString> = Vec::new();
    #[cfg(test)]
    if let Variant::UserPidAs(id) = variant {
        argv.extend(
            [
                format!("--reuid={id}"),
                format!("--regid={id}"),
                "--clear-groups".to_owned(),
            ]
            .map(OsString::from),
        );
    }
    // The sandbox, not the variant, decides: a command given one never runs without it.
    match sandbox {
        Some(sandbox) => {
            argv.extend(["--pdeathsig", "KILL", "--", BWRAP].map(OsString::from));
            argv.extend(sandbox.bwrap_args(cwd));
            argv.push("--".into());
        }
        _ => argv.extend(
            ["--pdeathsig", "KILL", "--", "unshare"]
                .iter()
                .chain(variant.unshare_args())
                .chain(&["--"])
                .map(OsString::from),
        ),
    }
    argv.push(program.into());
    argv.extend(args.iter().cloned());
    argv
}

pub(crate) const WRAPPER: &str = "setpriv";

/// Runs `cmd` contained, on the spawner thread; `cancel` (or dropping this future) ends it.
pub(crate) async fn run(cmd: Cmd, cancel: &CancellationToken) -> Result<Finished> {
    let command = cmd.display();
    let variant = tokio::select! {
        variant = variant(cmd.sandbox.as_ref()) => variant?,
        () = cancel.cancelled() => return Err(Error::Cancelled { command }),
    };
    let spawner = spawner()?;
    let token = cancel.child_token();
    // Dropping this future does not stop the task; cancelling its token does, and the task
    // then kills the namespace the usual way.
    let on_drop = token.clone().drop_guard();
    let task = spawner.spawn(async move { cmd.run_with(&token, Some(variant)).await });
    let joined = task.await;
    on_drop.disarm();
    joined.map_err(|e| Error::Io {
        command,
        source: std::io::Error::other(format!("the task running it ended abnormally: {e}")),
    })?
}

async fn variant(sandbox: Option<&Sandbox>) -> Result<Variant> {
    if let Some(sandbox) = sandbox {
        return match crate::sandbox::probe().await {
            Ok(()) => Ok(Variant::Sandboxed),
            Err(reason) => Err(Error::Sandbox {
                reason,
                hint: sandbox.hint_text().to_owned(),
            }),
        };
    }
    static CHOSEN: tokio::sync::OnceCell<Variant> = tokio::sync::OnceCell::const_new();
    CHOSEN.get_or_try_init(probe).await.copied()
}

/// Tries each way of making the namespace with `true` as the command. A failure is not cached:
/// the host may be fixed without restarting Skiff.
async fn probe() -> Result<Variant> {
    let candidates: &[Variant] = if rustix::process::geteuid().is_root() {
        &[Variant::Pid, Variant::UserPid]
    } else {
        &[Variant::UserPid]
    };
    let mut failures = Vec::new();
    for &variant in candidates {
        let probe = Cmd::new(WRAPPER)
            .args(wrap(variant, None, None, "true", &[]))
            .timeout(Duration::from_secs(10));
        // Not `run`: that would come back here.
        match probe.run_with(&CancellationToken::new(), None).await {
            Ok(done) if done.status.success() => return Ok(variant),
            Ok(done) => failures.push(format!("{variant:?}: {}", done.stderr.into_string().trim())),
            Err(e) => failures.push(format!("{variant:?}: {e}")),
        }
    }
    Err(Error::Contain {
        reason: failures.join("; "),
    })
}

/// The runtime contained commands are spawned and driven on: one thread for the life of the
/// process, so a child's parent-death signal fires when the process dies and at no other time.
fn spawner() -> Result<tokio::runtime::Handle> {
    static SPAWNER: OnceLock<std::result::Result<tokio::runtime::Handle, String>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot build its runtime: {e}"))?;
            let handle = runtime.handle().clone();
            std::thread::Builder::new()
                .name("skiff-contained".to_owned())
                .spawn(move || runtime.block_on(std::future::pending::<()>()))
                .map_err(|e| format!("cannot start its thread: {e}"))?;
            Ok(handle)
        })
        .clone()
        .map_err(|reason| Error::Contain { reason })
}

/// Ends a contained command whose `unshare` (`leader`) is still running: SIGKILLs the
/// namespace's init (and only that: `unshare` must live to reap it, which happens once the
/// namespace is empty) until `unshare` exits. Should the init never appear or never die,
/// `unshare` itself is killed after [`KILL_BOUND`].
pub(crate) async fn end(
    child: &mut tokio::process::Child,
    leader: i32,
) -> std::io::Result<ExitStatus> {
    let deadline = Instant::now() + KILL_BOUND;
    loop {
        kill_init(leader);
        tokio::select! {
            status = child.wait() => return status,
            () = tokio::time::sleep(KILL_POLL) => {}
        }
        if Instant::now() >= deadline {
            if let Some(pid) = Pid::from_raw(leader) {
                let _ = rustix::process::kill_process_group(pid, Signal::KILL);
            }
            return child.wait().await;
        }
    }
}

/// Sends `signal` to every process below `leader`, the leader itself spared.
pub(crate) fn signal_below(leader: i32, signal: Signal) {
    for pid in procfs::descendants(leader) {
        if let Some(pid) = Pid::from_raw(pid) {
            // ESRCH: it is already gone.
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

/// SIGKILLs the children of `leader` (the namespace's init, once `unshare` has forked it).
pub(crate) fn kill_init(leader: i32) {
    for pid in procfs::children(leader) {
        if let Some(pid) = Pid::from_raw(pid) {
            // ESRCH: it is already gone.
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
    }
}
