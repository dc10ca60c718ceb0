//! The one helper every Skiff child process (`git`, `bash` for the exec tool, later `ssh`,
//! `rsync`, `sshd`) is started through.
//!
//! It gives each child a clean environment (nothing of the gateway's — no API keys — leaks
//! in), its own process group, a timeout and a cancellation token, and kills the whole group
//! when the child ends, times out, is cancelled or the handle is dropped, so no grandchild
//! outlives its command. Output is captured with a byte cap so a chatty child cannot exhaust
//! memory. It deliberately knows nothing about what it runs.

mod capture;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

pub use capture::CappedOutput;

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
}

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

    /// Sends stdout and stderr to /dev/null. For a command that leaves a daemon behind holding
    /// its standard streams (which would otherwise never reach end-of-file).
    pub fn discard_output(mut self) -> Self {
        self.discard_output = true;
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
        let command = self.display();
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.args(&self.args)
            .env_clear()
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
            program: self.program.clone(),
            source,
        })?;
        let group = GroupGuard(child.id());
        let io_err = |source| Error::Io {
            command: command.clone(),
            source,
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
        );

        let outcome = tokio::select! {
            status = child.wait() => Ok(status.map_err(io_err)?),
            () = tokio::time::sleep(self.timeout) => Err(Error::TimedOut { command: command.clone(), timeout: self.timeout }),
            () = cancel.cancelled() => Err(Error::Cancelled { command: command.clone() }),
        };
        if outcome.is_err() {
            // Given up on: ask the group to stop first, so shells run their exit traps (a login
            // profile killed outright can leave lock files behind that stall every later shell),
            // then kill whatever is left.
            group.signal(rustix::process::Signal::TERM);
            let _ = tokio::time::timeout(TERM_GRACE, child.wait()).await;
        }
        // The leader is done (or given up on): end every process it left behind, so pipes close
        // and nothing outlives the command.
        drop(group);
        let (stdout, stderr) = readers.collect().await;
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

/// Kills the child's whole process group when dropped.
struct GroupGuard(Option<u32>);

impl GroupGuard {
    fn signal(&self, signal: rustix::process::Signal) {
        let Some(pid) = self.0.and_then(|p| i32::try_from(p).ok()) else {
            return;
        };
        if let Some(pid) = rustix::process::Pid::from_raw(pid) {
            // ESRCH (the group is already empty) is the normal case after a clean exit.
            let _ = rustix::process::kill_process_group(pid, signal);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.signal(rustix::process::Signal::KILL);
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
        assert!(!process_alive(pid), "background sleep {pid} survived");
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

    fn process_alive(pid: i32) -> bool {
        // A zombie still has a /proc entry; treat state Z as gone.
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => !stat.contains(") Z "),
            Err(_) => false,
        }
    }
}
