//! The one helper every Skiff child process (`git`, `ssh`, `rsync`, `sshd`, a lease CLI, `bash`
//! for the exec tool) is started through. The exceptions are a sandboxed local box's two start
//! stages, which must outlive their caller (`skiff-providers`' `local/sandbox.rs`).
//!
//! It gives each child a clean environment (nothing of the gateway's — no API keys — leaks
//! in), its own process group, a timeout and a cancellation token, and kills the whole group
//! when the child ends, times out, is cancelled or the handle is dropped. Output is captured
//! with a byte cap so a chatty child cannot exhaust memory. It deliberately knows nothing about
//! what it runs.
//!
//! A process group is only as good as its members' manners: anything that calls `setsid`
//! leaves it. Commands run on the agent's behalf are therefore [`Cmd::contained`]: they run in
//! a PID namespace of their own and die with their parent, so nothing they start outlives them
//! (see `contain.rs`), and a [`Ledger`] lets the next process kill what a crashed one left.

mod capture;
mod contain;
mod ledger;
mod procfs;
pub mod sandbox;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

pub use capture::CappedOutput;
pub use ledger::{Ledger, Leftover};
pub use sandbox::Sandbox;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not start `{program}`: {source}; is it installed and on PATH?")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` did not finish within {timeout:?} and was killed")]
    TimedOut { command: String, timeout: Duration },
    #[error("`{command}` was cancelled")]
    Cancelled { command: String },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error(
        "cannot run a command in a PID namespace of its own ({reason}); contained commands need \
         util-linux's `setpriv` and `unshare`, and either root or unprivileged user namespaces \
         (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1)"
    )]
    Contain { reason: String },
    #[error(
        "cannot record a running process in {path}: {source}; check that the directory is \
         writable by this user"
    )]
    Ledger {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "refusing to run the command unsandboxed: this host cannot make its sandbox ({reason}). \
         It needs bubblewrap (`bwrap`: Debian's and Ubuntu's package `bubblewrap`, Fedora's \
         `bubblewrap`) and user namespaces (as an unprivileged user: \
         `sysctl kernel.unprivileged_userns_clone=1` where that setting exists, and \
         `user.max_user_namespaces` above 0){hint}"
    )]
    Sandbox { reason: String, hint: String },
    #[error("i/o error while running `{command}`: {source}")]
    Io {
        command: String,
        #[source]
        source: std::io::Error,
    },
}

/// Variables a child may inherit from Skiff's own environment. Everything else — provider API
/// keys, tokens, `SSH_AUTH_SOCK` — is dropped.
const INHERITED: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "TZ",
];
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// The clean environment every child starts from ([`INHERITED`]'s variables this process has,
/// and a default `PATH`), for the rare child that cannot be a [`Cmd`] (a long-lived server
/// whose pipes another library drives: the gateway's MCP servers).
pub fn inherited_env() -> Vec<(String, OsString)> {
    let mut env: Vec<(String, OsString)> = INHERITED
        .iter()
        .filter_map(|key| std::env::var_os(key).map(|v| ((*key).to_owned(), v)))
        .collect();
    if std::env::var_os("PATH").is_none() {
        env.push(("PATH".to_owned(), DEFAULT_PATH.into()));
    }
    env
}

/// How a finished command ended.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: CappedOutput,
    pub stderr: CappedOutput,
}

impl Finished {
    /// Exit code, or `128 + signal` when killed by a signal (the shell convention).
    pub fn code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        self.status
            .code()
            .or_else(|| self.status.signal().map(|s| 128 + s))
            .unwrap_or(-1)
    }
}

/// What a child reads on stdin.
#[derive(Debug, Clone)]
enum Input {
    Bytes(Vec<u8>),
    File(PathBuf),
}

/// A command to run. Build it, then call [`Cmd::run`] or [`Cmd::run_checked`].
#[derive(Debug, Clone)]
pub struct Cmd {
    program: String,
    args: Vec<OsString>,
    cwd: Option<PathBuf>,
    env: Vec<(String, OsString)>,
    timeout: Duration,
    stdin: Option<Input>,
    output_cap: usize,
    merge_stderr: bool,
    discard_output: bool,
    contained: bool,
    sandbox: Option<Sandbox>,
    ledger: Option<Ledger>,
    tee: Option<Tee>,
}

/// Where a copy of a command's output goes as it arrives (stdout and stderr chunks, in arrival
/// order), for callers that show a long command's progress.
pub type Tee = tokio::sync::mpsc::UnboundedSender<Vec<u8>>;

impl Cmd {
    pub fn new(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            cwd: None,
            env: Vec::new(),
            timeout: Duration::from_secs(120),
            stdin: None,
            output_cap: 1 << 20,
            merge_stderr: false,
            discard_output: false,
            contained: false,
            sandbox: None,
            ledger: None,
            tee: None,
        }
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    /// Sets a variable on top of the clean environment.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn stdin(mut self, bytes: Vec<u8>) -> Self {
        self.stdin = Some(Input::Bytes(bytes));
        self
    }

    /// Gives the child this file as its stdin (it reads it itself: nothing is buffered here,
    /// which matters for large files such as the worker bundle).
    pub fn stdin_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.stdin = Some(Input::File(path.into()));
        self
    }

    /// Keeps at most this many bytes of each output stream (head and tail, with a marker).
    pub fn output_cap(mut self, bytes: usize) -> Self {
        self.output_cap = bytes;
        self
    }

    /// Interleaves stderr into stdout, in arrival order, as a terminal would show them.
    pub fn merge_stderr(mut self) -> Self {
        self.merge_stderr = true;
        self
    }

    /// Also sends every chunk of output, as it arrives, to `tee` (the capture is unchanged).
    pub fn tee(mut self, tee: Tee) -> Self {
        self.tee = Some(tee);
        self
    }

    /// Sends stdout and stderr to /dev/null. For a command that leaves a daemon behind holding
    /// its standard streams (which would otherwise never reach end-of-file).
    pub fn discard_output(mut self) -> Self {
        self.discard_output = true;
        self
    }

    /// Runs the command in a PID namespace of its own with a parent-death signal: everything it
    /// starts — detached with `setsid`, double-forked, daemonized — is killed when it ends, times
    /// out, is cancelled, or when this process dies. For commands run on someone else's behalf
    /// (the exec tool); needs util-linux (`setpriv`, `unshare`).
    pub fn contained(mut self) -> Self {
        self.contained = true;
        self
    }

    /// Runs the command [`Cmd::contained`] and in `sandbox`: a mount namespace that shows it
    /// only the system's read-only paths and what `sandbox` names (see `sandbox.rs`). A host
    /// that cannot make the sandbox fails the command with [`Error::Sandbox`]; it is never run
    /// without it. Needs bubblewrap (`bwrap`).
    pub fn sandbox(mut self, sandbox: Sandbox) -> Self {
        self.contained = true;
        self.sandbox = Some(sandbox);
        self
    }

    /// Records the running command in `ledger` (see [`Ledger`]) until everything it started is
    /// gone. Only for [`Cmd::contained`] commands: a record names a tree to kill after a crash.
    pub fn ledger(mut self, ledger: Ledger) -> Self {
        self.ledger = Some(ledger);
        self
    }

    /// A short rendering for error messages: the program and its first arguments.
    pub fn display(&self) -> String {
        let mut s = self.program.clone();
        for a in self.args.iter().take(4) {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        if self.args.len() > 4 {
            s.push_str(" …");
        }
        s
    }

    /// Runs to completion. A non-zero exit is not an error here; see [`Cmd::run_checked`].
    pub async fn run(self, cancel: &CancellationToken) -> Result<Finished> {
        if self.contained {
            contain::run(self, cancel).await
        } else {
            self.run_with(cancel, None).await
        }
    }

    /// Runs here, wrapped in the namespace of `contain` when given.
    async fn run_with(
        self,
        cancel: &CancellationToken,
        contain: Option<contain::Variant>,
    ) -> Result<Finished> {
        let command = self.display();
        let mut cmd = match contain {
            Some(variant) => {
                let mut cmd = tokio::process::Command::new(contain::WRAPPER);
                cmd.args(contain::wrap(
                    variant,
                    self.sandbox.as_ref(),
                    self.cwd.as_deref(),
                    &self.program,
                    &self.args,
                ));
                cmd
            }
            None => {
                let mut cmd = tokio::process::Command::new(&self.program);
                cmd.args(&self.args);
                cmd
            }
        };
        cmd.env_clear()
            .stdin(match &self.stdin {
                None => Stdio::null(),
                Some(Input::Bytes(_)) => Stdio::piped(),
                Some(Input::File(path)) => match std::fs::File::open(path) {
                    Ok(file) => Stdio::from(file),
                    Err(source) => return Err(Error::Io { command, source }),
                },
            })
            .stdout(if self.discard_output {
                Stdio::null()
            } else {
                Stdio::piped()
            })
            .stderr(if self.discard_output {
                Stdio::null()
            } else {
                Stdio::piped()
            })
            .process_group(0)
            .kill_on_drop(true);
        for key in INHERITED {
            if let Some(v) = std::env::var_os(key) {
                cmd.env(key, v);
            }
        }
        if std::env::var_os("PATH").is_none() {
            cmd.env("PATH", DEFAULT_PATH);
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        if let Some(dir) = &self.cwd {
            cmd.current_dir(dir);
        }
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            program: match contain {
                Some(_) => format!("{} (to contain {})", contain::WRAPPER, self.program),
                None => self.program.clone(),
            },
            source,
        })?;
        let leader = child.id().and_then(|p| i32::try_from(p).ok());
        let mut group = GroupGuard {
            leader,
            contained: contain.is_some(),
            reaped: false,
        };
        let io_err = |source| Error::Io {
            command: command.clone(),
            source,
        };
        // Written before anything else can go wrong, removed (on drop) once the tree is gone.
        let recorded = match (&self.ledger, leader) {
            (Some(ledger), Some(pid)) => ledger.record(pid, &command),
            _ => Ok(None),
        };

        if let (Some(Input::Bytes(bytes)), Some(mut pipe)) = (self.stdin, child.stdin.take()) {
            // Write stdin concurrently so a child that fills its stdout first cannot deadlock us.
            tokio::spawn(async move {
                let _ = pipe.write_all(&bytes).await;
            });
        }
        let readers = capture::spawn_readers(
            child.stdout.take(),
            child.stderr.take(),
            self.output_cap,
            self.merge_stderr,
            self.tee.clone(),
        );

        let (record, mut outcome) = match recorded {
            Ok(record) => (
                record,
                tokio::select! {
                    status = child.wait() => status.map_err(io_err),
                    () = tokio::time::sleep(self.timeout) => Err(Error::TimedOut { command: command.clone(), timeout: self.timeout }),
                    () = cancel.cancelled() => Err(Error::Cancelled { command: command.clone() }),
                },
            ),
            // Not recorded: not run (a crash now would leave it unaccounted for).
            Err(e) => (None, Err(e)),
        };
        if outcome.is_err() {
            // Given up on: ask the group to stop first, so shells run their exit traps (a login
            // profile killed outright can leave lock files behind that stall every later shell),
            // then kill whatever is left. A contained command's leader is not asked: it must
            // outlive its namespace's init, which, were it still being set up, would miss its
            // parent-death signal and run on with the command.
            match (contain, leader) {
                (Some(_), Some(pid)) => contain::signal_below(pid, rustix::process::Signal::TERM),
                _ => group.signal(rustix::process::Signal::TERM),
            }
            let ended = tokio::time::timeout(TERM_GRACE, child.wait()).await;
            if let (Err(_), Some(pid), Some(_)) = (ended, leader, contain)
                // The namespace goes down with its init; `unshare` returns once it is empty.
                && let Err(source) = contain::end(&mut child, pid).await
            {
                outcome = Err(io_err(source));
            }
        }
        // The leader is done (or given up on): end every process it left behind, so pipes close
        // and nothing outlives the command.
        group.reaped = matches!(child.try_wait(), Ok(Some(_)));
        let reaped = group.reaped;
        drop(group);
        let (stdout, stderr) = readers.collect().await;
        if reaped {
            drop(record);
        } else {
            // Not known to be gone: the record stays for the next `kill_leftovers`.
            std::mem::forget(record);
        }
        let status = outcome?;
        Ok(Finished {
            status,
            stdout,
            stderr,
        })
    }

    /// Runs to completion and fails with the captured stderr unless the exit status is zero.
    /// Returns stdout as text.
    pub async fn run_checked(self, cancel: &CancellationToken) -> Result<String> {
        let command = self.display();
        let finished = self.run(cancel).await?;
        if finished.status.success() {
            Ok(finished.stdout.into_string())
        } else {
            Err(Error::Failed {
                command,
                status: finished.status.to_string(),
                stderr: finished.stderr.into_string().trim().to_owned(),
            })
        }
    }
}

/// How long a timed-out or cancelled command's process group gets between SIGTERM and SIGKILL.
const TERM_GRACE: Duration = Duration::from_millis(300);

/// Kills the child's whole process group when dropped. A contained child's namespace is taken
/// down through its init first, unless the child has been reaped: then the namespace is empty
/// already, and its pid may belong to someone else by now.
struct GroupGuard {
    leader: Option<i32>,
    contained: bool,
    reaped: bool,
}

impl GroupGuard {
    fn signal(&self, signal: rustix::process::Signal) {
        if let Some(pid) = self.leader.and_then(rustix::process::Pid::from_raw) {
            // ESRCH (the group is already empty) is the normal case after a clean exit.
            let _ = rustix::process::kill_process_group(pid, signal);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        match (self.contained, self.reaped, self.leader) {
            (true, true, _) => {}
            (true, false, Some(leader)) => {
                contain::kill_init(leader);
                self.signal(rustix::process::Signal::KILL);
            }
            _ => self.signal(rustix::process::Signal::KILL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn environment_is_clean() {
        let out = Cmd::new("env")
            .env("EXTRA", "1")
            .run_checked(&CancellationToken::new())
            .await
            .unwrap();
        for line in out.lines() {
            let name = line.split('=').next().unwrap();
            assert!(
                INHERITED.contains(&name) || name == "EXTRA",
                "`{name}` leaked into a child's environment"
            );
        }
        assert!(out.contains("EXTRA=1"));
        assert!(out.contains("PATH="));
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        let script = format!("sleep 30 & echo $! > {}; wait", pidfile.display());
        let err = Cmd::new("bash")
            .args(["-c", &script])
            .timeout(Duration::from_millis(500))
            .run(&CancellationToken::new())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::TimedOut { .. }), "{err}");
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Signals are delivered asynchronously: await the sleep's exit (bounded far below its
        // 30 s) rather than look at it in the instant after the kill.
        assert!(
            exits_within(pid, Duration::from_secs(10)).await,
            "background sleep {pid} survived"
        );
    }

    /// Whether `pid` exits (or is gone already) within `limit`, awaited through a pidfd.
    async fn exits_within(pid: i32, limit: Duration) -> bool {
        let Some(pid) = rustix::process::Pid::from_raw(pid) else {
            return true;
        };
        let Ok(fd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
            return true;
        };
        tokio::task::spawn_blocking(move || {
            use rustix::event::{PollFd, PollFlags, Timespec, poll};
            let timeout = Timespec::try_from(limit).unwrap();
            let mut fds = [PollFd::new(&fd, PollFlags::IN)];
            poll(&mut fds, Some(&timeout)).unwrap() == 1
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn failure_carries_stderr() {
        let err = Cmd::new("bash")
            .args(["-c", "echo boom >&2; exit 3"])
            .run_checked(&CancellationToken::new())
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("boom") && msg.contains("exit status: 3"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn missing_program_is_named() {
        let err = Cmd::new("skiff-no-such-program")
            .run(&CancellationToken::new())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("skiff-no-such-program"));
    }

    /// Live processes whose command line is exactly `argv` (words joined by spaces), with the
    /// uid each runs as.
    fn running(argv: &str) -> Vec<(i32, u32)> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(std::result::Result::ok)
            .filter_map(|e| {
                let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                let raw = std::fs::read(e.path().join("cmdline")).ok()?;
                let words: Vec<_> = raw
                    .split(|&b| b == 0)
                    .filter(|w| !w.is_empty())
                    .map(String::from_utf8_lossy)
                    .collect();
                if words.join(" ") != argv {
                    return None;
                }
                let status = std::fs::read_to_string(e.path().join("status")).ok()?;
                let uid = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()?;
                Some((pid, uid))
            })
            .collect()
    }

    /// A command that leaves a `setsid`'d and a double-forked sleep behind, then waits for ever.
    fn escaping(n: u32) -> String {
        format!(
            "setsid sleep {n} & ( (sleep {} &) & ); sleep 1000{n}",
            n + 1
        )
    }

    /// Waits until both escapees of [`escaping`] run; returns the uid they run as.
    async fn escaped(n: u32) -> u32 {
        loop {
            let a = running(&format!("sleep {n}"));
            let b = running(&format!("sleep {}", n + 1));
            if let (Some(a), Some(_)) = (a.first(), b.first()) {
                return a.1;
            }
            tokio::task::yield_now().await;
        }
    }

    fn assert_gone(n: u32) {
        for argv in [format!("sleep {n}"), format!("sleep {}", n + 1)] {
            let left = running(&argv);
            assert!(left.is_empty(), "`{argv}` still runs: {left:?}");
        }
    }

    #[tokio::test]
    async fn a_contained_timeout_kills_what_left_the_group() {
        let ledger_dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(ledger_dir.path()).unwrap();
        let never = CancellationToken::new();
        let run = Cmd::new("bash")
            .args(["-c", &escaping(31311)])
            .contained()
            .ledger(ledger)
            .timeout(Duration::from_secs(2))
            .run(&never);
        let (result, _) = tokio::join!(run, escaped(31311));
        assert!(matches!(result, Err(Error::TimedOut { .. })), "{result:?}");
        assert_gone(31311);
        assert!(
            std::fs::read_dir(ledger_dir.path())
                .unwrap()
                .next()
                .is_none(),
            "the record outlived the command"
        );
    }

    #[tokio::test]
    async fn a_contained_cancel_kills_what_left_the_group() {
        let cancel = CancellationToken::new();
        let run = Cmd::new("bash")
            .args(["-c", &escaping(31321)])
            .contained()
            .run(&cancel);
        let canceller = async {
            escaped(31321).await;
            cancel.cancel();
        };
        let (result, ()) = tokio::join!(run, canceller);
        assert!(matches!(result, Err(Error::Cancelled { .. })), "{result:?}");
        assert_gone(31321);
    }

    #[tokio::test]
    async fn a_contained_command_that_finishes_takes_its_leftovers_along() {
        let done = Cmd::new("bash")
            .args([
                "-c",
                "setsid sleep 31331 >/dev/null 2>&1 & sleep 31332 >/dev/null 2>&1 & \
                 while [ ! -e /proc/$!/cmdline ]; do :; done; echo $$; echo done",
            ])
            .contained()
            .run(&CancellationToken::new())
            .await
            .unwrap();
        assert!(done.status.success());
        // The command is its namespace's init.
        assert_eq!(done.stdout.into_string(), "1\ndone\n");
        assert_gone(31331);
    }

    #[tokio::test]
    async fn an_unprivileged_user_gets_the_same_containment() {
        let nobody = 65534;
        let variant = if rustix::process::geteuid().is_root() {
            contain::Variant::UserPidAs(nobody)
        } else {
            contain::Variant::UserPid
        };
        let never = CancellationToken::new();
        let run = Cmd::new("bash")
            .args(["-c", &escaping(31341)])
            .cwd("/")
            .timeout(Duration::from_secs(2))
            .run_with(&never, Some(variant));
        let (result, uid) = tokio::join!(run, escaped(31341));
        assert!(matches!(result, Err(Error::TimedOut { .. })), "{result:?}");
        if rustix::process::geteuid().is_root() {
            assert_eq!(uid, nobody, "the command did not run unprivileged");
        }
        assert_gone(31341);
    }

    /// A cancel can land at any moment of a sandboxed command's start (`setpriv`, `bwrap`
    /// building the namespace, the shell's profile): wherever it lands, the command ends then,
    /// not when it would have finished by itself. A leader that died of the stop request first
    /// once left a namespace still being set up to run the whole command.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_cancel_at_any_moment_of_a_sandboxed_start_ends_the_command() {
        let ws = tempfile::tempdir().unwrap();
        for delay_ms in (0..120).step_by(4) {
            let cancel = CancellationToken::new();
            let stop = cancel.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                stop.cancel();
            });
            let run = Cmd::new("bash")
                .args(["-lc", "sleep 600"])
                .cwd(ws.path())
                .sandbox(Sandbox::new().writable(ws.path()))
                .run(&cancel);
            // A bound for a hang, far from any real figure: the command itself runs 600 s.
            let result = tokio::time::timeout(Duration::from_secs(120), run)
                .await
                .unwrap_or_else(|_| panic!("cancelled after {delay_ms} ms, it ran on"));
            assert!(
                matches!(result, Err(Error::Cancelled { .. })),
                "cancelled after {delay_ms} ms: {result:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_sandboxed_timeout_kills_what_left_the_group() {
        let ledger_dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(ledger_dir.path()).unwrap();
        let never = CancellationToken::new();
        let run = Cmd::new("bash")
            .args(["-c", &escaping(31361)])
            .sandbox(Sandbox::new())
            .ledger(ledger)
            .timeout(Duration::from_secs(2))
            .run(&never);
        let (result, _) = tokio::join!(run, escaped(31361));
        assert!(matches!(result, Err(Error::TimedOut { .. })), "{result:?}");
        assert_gone(31361);
        assert!(
            std::fs::read_dir(ledger_dir.path())
                .unwrap()
                .next()
                .is_none(),
            "the record outlived the command"
        );
    }

    #[tokio::test]
    async fn a_sandboxed_command_sees_its_directory_and_nothing_of_ours() {
        let secret = tempfile::tempdir().unwrap();
        std::fs::write(secret.path().join("token"), "s3cret").unwrap();
        let ws = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let script = format!(
            "cat {secret}/token; echo \"secret=$?\"; echo made > out; \
             cat /proc/{me}/environ; echo \"environ=$?\"; \
             ls /proc | grep -c '^[0-9]'; touch /usr/skiff-probe; echo \"usr=$?\"",
            secret = secret.path().display()
        );
        let done = Cmd::new("bash")
            .args(["-c", &script])
            .cwd(ws.path())
            .merge_stderr()
            .sandbox(Sandbox::new().writable(ws.path()))
            .run(&CancellationToken::new())
            .await
            .unwrap();
        let out = done.stdout.into_string();
        assert!(!out.contains("s3cret"), "{out}");
        assert!(out.contains("secret=1"), "{out}");
        assert!(out.contains("environ=1"), "{out}");
        assert!(out.contains("usr=1"), "{out}");
        // Only the sandbox's own processes: its init, bash, ls and grep.
        let procs: u32 = out
            .lines()
            .find_map(|l| l.parse().ok())
            .unwrap_or_else(|| panic!("{out}"));
        assert!(procs <= 4, "{out}");
        assert_eq!(
            std::fs::read_to_string(ws.path().join("out")).unwrap(),
            "made\n"
        );
    }

    #[tokio::test]
    async fn leftovers_of_a_crashed_process_are_killed_but_a_reused_pid_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        // A tree whose parent "crashed": recorded, never cleaned up.
        let mut leader = std::process::Command::new("bash")
            .args(["-c", "sleep 31351 & sleep 31352 & wait"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(leader.id()).unwrap();
        while running("sleep 31352").is_empty() || running("sleep 31351").is_empty() {
            std::thread::yield_now();
        }
        std::mem::forget(ledger.record(pid, "bash -c …").unwrap().unwrap());
        // A live process whose pid a record names, but with another start time.
        let mut stranger = std::process::Command::new("sleep")
            .arg("31353")
            .spawn()
            .unwrap();
        let stranger_pid = stranger.id();
        std::fs::write(
            dir.path().join(format!("{stranger_pid}-1")),
            format!("pid {stranger_pid}\nstart 1\ncommand sleep\n"),
        )
        .unwrap();

        let leftovers = ledger.kill_leftovers().unwrap();
        assert_eq!(leftovers.len(), 1, "{leftovers:?}");
        assert_eq!(leftovers[0].pid, pid);
        assert_eq!(leftovers[0].killed, 3);
        leader.wait().unwrap();
        assert_gone(31351);
        assert!(!running("sleep 31353").is_empty(), "a stranger was killed");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    }
}
