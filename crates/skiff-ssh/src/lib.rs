//! The system OpenSSH client, driven with pinned trust.
//!
//! Every connection to a box uses a per-lease `known_hosts` file written from the provisioning
//! output and `StrictHostKeyChecking=yes`, the lease's own identity only, batch mode (never a
//! prompt), no agent or X11 forwarding and keepalives. Two multiplexed connections exist per
//! box: `Channel::Control` for commands and the worker tunnel's forwards, and
//! `Channel::Transfer` for bulk copies, so a big copy never delays a control command.
//!
//! Deliberately absent: `StrictHostKeyChecking=no` or `accept-new`, agent forwarding, the user's
//! `~/.ssh/config`, and any reimplementation of SSH.

use skiff_process::Cmd;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "the host key of {alias} differs from the one pinned when it was provisioned; refusing to connect. Destroy the environment and provision a new one"
    )]
    HostKeyChanged { alias: String },
    #[error("cannot reach {alias} over ssh: {detail}")]
    Unreachable { alias: String, detail: String },
    #[error("`{command}` on {alias} failed (exit {code}): {stderr}")]
    Remote {
        alias: String,
        command: String,
        code: i32,
        stderr: String,
    },
    #[error("cannot write the pinned trust for {alias} to {path}: {source}")]
    Pin {
        alias: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Process(#[from] skiff_process::Error),
}

/// Where and how to reach one box.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The name the pinned key is recorded under (`HostKeyAlias`): the environment id.
    pub alias: String,
    pub host: String,
    pub port: u16,
    pub user: String,
    /// Private key of this lease (mode 0600).
    pub identity_file: PathBuf,
    /// The box's public host key, `ssh-ed25519 AAAA…`, from the provisioning output.
    pub host_key: String,
    /// A command OpenSSH runs instead of opening TCP (`ProxyCommand`), as argv.
    pub proxy_command: Option<Vec<String>>,
}

/// Which of the two connections to a box.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    Control,
    Transfer,
}

/// A box's SSH client state: its pinned `known_hosts` and its multiplexing sockets, kept in a
/// private directory of the gateway.
#[derive(Clone, Debug)]
pub struct Ssh {
    target: Target,
    dir: PathBuf,
    /// Transfers ride the control connection (see [`Ssh::transfers_over_control`]).
    transfer_over_control: bool,
}

impl Ssh {
    /// Pins the target's host key in `dir/known_hosts` (replacing what was there) and returns a
    /// client for it. `dir` must be private to the gateway.
    pub fn pin(target: Target, dir: &Path) -> Result<Self> {
        // These come from a provider (possibly an external lease CLI) and end up on ssh's
        // command line and in known_hosts: nothing may start an option or break a line.
        let suspicious = |v: &str| {
            v.is_empty()
                || v.starts_with('-')
                || v.chars().any(|c| c.is_whitespace() || c.is_control())
        };
        if suspicious(&target.user)
            || suspicious(&target.host)
            || target.host_key.contains(['\n', '\r'])
        {
            return Err(Error::Unreachable {
                alias: target.alias.clone(),
                detail: format!(
                    "the provider gave an unusable SSH endpoint (user {:?}, host {:?}); refusing to use it",
                    target.user, target.host
                ),
            });
        }
        let pin_err = |source| Error::Pin {
            alias: target.alias.clone(),
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(pin_err)?;
        let line = format!("{} {}\n", target.alias, target.host_key.trim());
        std::fs::write(dir.join("known_hosts"), line).map_err(pin_err)?;
        Ok(Self {
            target,
            dir: dir.to_path_buf(),
            transfer_over_control: false,
        })
    }

    /// This client with its transfers (rsync, bundles, file lists) carried over the control
    /// connection. For a half-dead box: its sshd accepts no new connection, but the
    /// connection the gateway already holds still works, and the box's work can come home
    /// through it.
    pub fn transfers_over_control(&self) -> Ssh {
        Ssh {
            transfer_over_control: true,
            ..self.clone()
        }
    }

    /// Whether the box accepts a new SSH connection now (one of its own, never a
    /// multiplexed one): `false` with a live control master means a half-dead box.
    pub async fn accepts_new_connections(&self) -> bool {
        let options = self.options(Channel::Control).into_iter().map(|o| {
            if o.to_string_lossy().starts_with("ControlMaster=") {
                OsString::from("ControlMaster=no")
            } else if o.to_string_lossy().starts_with("ControlPath=") {
                OsString::from("ControlPath=none")
            } else {
                o
            }
        });
        Cmd::new("ssh")
            .args(options)
            .arg(self.destination())
            .args(["--", "true"])
            .discard_output()
            .timeout(Duration::from_secs(15))
            .run(&CancellationToken::new())
            .await
            .is_ok_and(|done| done.status.success())
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    fn known_hosts(&self) -> PathBuf {
        self.dir.join("known_hosts")
    }

    /// The options every connection uses: pinned trust and nothing borrowed from the user.
    fn socket(&self, channel: Channel) -> PathBuf {
        self.dir.join(match channel {
            Channel::Transfer if !self.transfer_over_control => "transfer.sock",
            Channel::Control | Channel::Transfer => "control.sock",
        })
    }

    pub fn options(&self, channel: Channel) -> Vec<OsString> {
        let mut opts: Vec<OsString> = vec!["-F".into(), "/dev/null".into()];
        let mut o = |k: &str, v: &str| {
            opts.push("-o".into());
            opts.push(format!("{k}={v}").into());
        };
        o("StrictHostKeyChecking", "yes");
        o(
            "UserKnownHostsFile",
            &self.known_hosts().display().to_string(),
        );
        o("GlobalKnownHostsFile", "/dev/null");
        o("HostKeyAlias", &self.target.alias);
        o("CheckHostIP", "no");
        o("UpdateHostKeys", "no");
        o("IdentitiesOnly", "yes");
        o(
            "IdentityFile",
            &self.target.identity_file.display().to_string(),
        );
        o("IdentityAgent", "none");
        o("BatchMode", "yes");
        o("PasswordAuthentication", "no");
        o("KbdInteractiveAuthentication", "no");
        o("ForwardAgent", "no");
        o("ForwardX11", "no");
        o("ClearAllForwardings", "yes");
        o("ServerAliveInterval", "15");
        o("ServerAliveCountMax", "3");
        o("ConnectTimeout", "10");
        o("LogLevel", "ERROR");
        // Commands ride on the channel's master connection (see `ensure_master`) when it is up,
        // and fall back to a connection of their own when it is not.
        o("ControlMaster", "auto");
        o("ControlPath", &self.socket(channel).display().to_string());
        o("ControlPersist", "no");
        if let Some(proxy) = &self.target.proxy_command {
            o("ProxyCommand", &shell_join(proxy));
        }
        opts.push("-p".into());
        opts.push(self.target.port.to_string().into());
        opts
    }

    fn destination(&self) -> String {
        format!("{}@{}", self.target.user, self.target.host)
    }

    /// The `ssh` command that runs `remote` (a shell command line) on the box.
    pub fn command(&self, channel: Channel, remote: &str) -> Cmd {
        Cmd::new("ssh")
            .args(self.options(channel))
            .arg(self.destination())
            .arg("--")
            .arg(remote)
            .timeout(Duration::from_secs(60))
    }

    /// Opens the channel's master connection unless it is up: the one connection every later
    /// command of the channel multiplexes over. It runs in a session of its own (`setsid`), so
    /// it and its `ProxyCommand` outlive the command that started it — the process helper
    /// kills a finished command's whole process group.
    pub async fn ensure_master(&self, channel: Channel, cancel: &CancellationToken) -> Result<()> {
        if self.socket(channel).exists() {
            // The master answering on its socket is enough, and is asked without starting a
            // process (every command of a placement passes here).
            if mux_answers(&self.socket(channel)).await || self.master_alive(channel).await {
                return Ok(());
            }
            // A master that was killed leaves its socket behind.
            let _ = std::fs::remove_file(self.socket(channel));
        }
        let log = self.dir.join(match channel {
            Channel::Control => "control.log",
            Channel::Transfer => "transfer.log",
        });
        let _ = std::fs::remove_file(&log);
        let done = Cmd::new("setsid")
            .args(["-w", "ssh"])
            .args(self.options(channel))
            .args([
                "-o",
                "ControlMaster=yes",
                "-o",
                "ControlPersist=yes",
                "-f",
                "-N",
                "-E",
            ])
            .arg(&log)
            .arg(self.destination())
            .discard_output()
            .timeout(Duration::from_secs(30))
            .run(cancel)
            .await?;
        if done.status.success() {
            return Ok(());
        }
        let stderr = std::fs::read_to_string(&log).unwrap_or_default();
        Err(self.classify(done.code(), stderr.trim().to_owned(), "(connect)"))
    }

    /// Whether the channel's master connection is up and answering.
    pub async fn master_alive(&self, channel: Channel) -> bool {
        Cmd::new("ssh")
            .args(self.options(channel))
            .args(["-O", "check"])
            .arg(self.destination())
            .discard_output()
            .timeout(Duration::from_secs(5))
            .run(&CancellationToken::new())
            .await
            .is_ok_and(|done| done.status.success())
    }

    /// Forwards the unix socket `remote_socket` on the box to `local_socket` on this host, over
    /// the control master (a reverse tunnel: connections made on the box arrive here). The
    /// forward lives as long as the master; call again after [`Ssh::ensure_master`] restarted
    /// it.
    pub async fn forward_socket(
        &self,
        remote_socket: &str,
        local_socket: &Path,
        cancel: &CancellationToken,
    ) -> Result<()> {
        self.ensure_master(Channel::Control, cancel).await?;
        self.forward_op("forward", remote_socket, local_socket, cancel)
            .await
    }

    /// Stops forwarding `remote_socket` (see [`Ssh::forward_socket`]); the master stays up.
    /// Without a master there is no forward to stop.
    pub async fn cancel_forward(
        &self,
        remote_socket: &str,
        local_socket: &Path,
        cancel: &CancellationToken,
    ) -> Result<()> {
        if !self.master_alive(Channel::Control).await {
            return Ok(());
        }
        self.forward_op("cancel", remote_socket, local_socket, cancel)
            .await
    }

    /// `ssh -O forward|cancel -R remote:local` to the control master.
    async fn forward_op(
        &self,
        op: &str,
        remote_socket: &str,
        local_socket: &Path,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let spec = format!("{remote_socket}:{}", local_socket.display());
        let cmd = self.mux_forward(op, &spec);
        self.run_with(cmd, &format!("({op})"), cancel)
            .await
            .map(|_| ())
    }

    /// Forwards `port` on the box's loopback to `local_socket` on this host over the control
    /// master: connections made to it on the box arrive here. Removed with
    /// [`Ssh::cancel_port_forward`] (or with the master).
    pub async fn forward_port(
        &self,
        port: u16,
        local_socket: &Path,
        cancel: &CancellationToken,
    ) -> Result<()> {
        self.ensure_master(Channel::Control, cancel).await?;
        let spec = format!("127.0.0.1:{port}:{}", local_socket.display());
        self.run_with(self.mux_forward("forward", &spec), "(forward)", cancel)
            .await
            .map(|_| ())
    }

    /// Removes a forward made by [`Ssh::forward_port`].
    pub async fn cancel_port_forward(
        &self,
        port: u16,
        local_socket: &Path,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let spec = format!("127.0.0.1:{port}:{}", local_socket.display());
        self.run_with(
            self.mux_forward("cancel", &spec),
            "(cancel forward)",
            cancel,
        )
        .await
        .map(|_| ())
    }

    fn mux_forward(&self, verb: &str, spec: &str) -> Cmd {
        // `ClearAllForwardings=yes` (every other connection) would drop this very request.
        let options = self.options(Channel::Control).into_iter().map(|o| {
            if o == "ClearAllForwardings=yes" {
                OsString::from("ClearAllForwardings=no")
            } else {
                o
            }
        });
        Cmd::new("ssh")
            .args(options)
            .args(["-O", verb, "-R"])
            .arg(spec)
            .arg(self.destination())
            .timeout(Duration::from_secs(15))
    }

    /// Runs `remote` on the control connection with `input` on its stdin, a copy of its
    /// output (stdout and stderr interleaved) sent to `tee` as it arrives, for at most
    /// `timeout`. Returns the remote command's exit code and its output's last `cap` bytes;
    /// only ssh's own failures (it exits 255) are errors.
    pub async fn run_streaming(
        &self,
        remote: &str,
        input: Vec<u8>,
        timeout: Duration,
        tee: skiff_process::Tee,
        cancel: &CancellationToken,
    ) -> Result<(i32, String)> {
        self.ensure_master(Channel::Control, cancel).await?;
        let cmd = self
            .command(Channel::Control, remote)
            .stdin(input)
            .merge_stderr()
            .output_cap(64 << 10)
            .tee(tee)
            .timeout(timeout);
        let done = cmd.run(cancel).await?;
        let code = done.code();
        let output = done.stdout.into_string();
        if code == 255 {
            return Err(self.classify(code, output.trim().to_owned(), remote));
        }
        Ok((code, output))
    }

    /// Runs `remote` and returns its stdout; a non-zero exit is an error with its stderr.
    pub async fn run(&self, remote: &str, cancel: &CancellationToken) -> Result<String> {
        self.ensure_master(Channel::Control, cancel).await?;
        self.run_with(self.command(Channel::Control, remote), remote, cancel)
            .await
    }

    /// Runs `remote` on the transfer connection with `input` on its stdin.
    pub async fn run_with_input(
        &self,
        remote: &str,
        input: Vec<u8>,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Result<String> {
        self.ensure_master(Channel::Transfer, cancel).await?;
        let cmd = self
            .command(Channel::Transfer, remote)
            .stdin(input)
            .timeout(timeout);
        self.run_with(cmd, remote, cancel).await
    }

    /// Runs `remote` on the transfer connection with the file at `input` on its stdin (read
    /// by `ssh` itself, never held in memory here).
    pub async fn run_with_file_input(
        &self,
        remote: &str,
        input: &Path,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Result<String> {
        self.ensure_master(Channel::Transfer, cancel).await?;
        let cmd = self
            .command(Channel::Transfer, remote)
            .stdin_file(input)
            .timeout(timeout);
        self.run_with(cmd, remote, cancel).await
    }

    async fn run_with(&self, cmd: Cmd, remote: &str, cancel: &CancellationToken) -> Result<String> {
        let done = cmd.run(cancel).await?;
        if done.status.success() {
            return Ok(done.stdout.into_string());
        }
        let code = done.code();
        let stderr = done.stderr.into_string().trim().to_owned();
        Err(self.classify(code, stderr, remote))
    }

    /// Tells a refused host key and an unreachable box apart from a failing remote command.
    fn classify(&self, code: i32, stderr: String, remote: &str) -> Error {
        let alias = self.target.alias.clone();
        if stderr.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")
            || stderr.contains("Host key verification failed")
            || stderr.contains("host key for")
        {
            return Error::HostKeyChanged { alias };
        }
        // OpenSSH exits 255 for its own failures (connection, authentication).
        if code == 255 {
            return Error::Unreachable {
                alias,
                detail: if stderr.is_empty() {
                    "ssh exited 255".into()
                } else {
                    stderr
                },
            };
        }
        Error::Remote {
            alias,
            command: remote.chars().take(80).collect(),
            code,
            stderr,
        }
    }

    /// Closes the multiplexed connections (best effort; they also expire on their own).
    pub async fn close(&self) {
        for channel in [Channel::Control, Channel::Transfer] {
            let _ = Cmd::new("ssh")
                .args(self.options(channel))
                .args(["-O", "exit"])
                .arg(self.destination())
                .timeout(Duration::from_secs(5))
                .run(&CancellationToken::new())
                .await;
        }
    }
}

/// Quotes argv for the shell line OpenSSH passes `ProxyCommand` to.
pub fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Single-quotes a word for a POSIX shell.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:@%+,".contains(c))
    {
        return word.to_owned();
    }
    format!("'{}'", word.replace('\'', "'\\''"))
}

/// Whether an OpenSSH multiplexing master listens on `socket` and answers its hello (the
/// first exchange of every client, `PROTOCOL.mux`), within a second. What `ssh -O check`
/// learns, without a process.
async fn mux_answers(socket: &Path) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const MUX_MSG_HELLO: u32 = 1;
    let exchange = async {
        let mut stream = tokio::net::UnixStream::connect(socket).await?;
        let mut hello = Vec::with_capacity(12);
        hello.extend_from_slice(&8u32.to_be_bytes());
        hello.extend_from_slice(&MUX_MSG_HELLO.to_be_bytes());
        hello.extend_from_slice(&4u32.to_be_bytes());
        stream.write_all(&hello).await?;
        let mut head = [0u8; 8];
        stream.read_exact(&mut head).await?;
        Ok::<bool, std::io::Error>(head[4..8] == MUX_MSG_HELLO.to_be_bytes())
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), exchange).await,
        Ok(Ok(true))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_the_shell() {
        assert_eq!(shell_quote("abc/def-1"), "abc/def-1");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn options_pin_trust_and_never_relax_it() {
        let dir = tempfile::tempdir().unwrap();
        let ssh = Ssh::pin(
            Target {
                alias: "env_x".into(),
                host: "127.0.0.1".into(),
                port: 2222,
                user: "u".into(),
                identity_file: "/k".into(),
                host_key: "ssh-ed25519 AAAA".into(),
                proxy_command: None,
            },
            dir.path(),
        )
        .unwrap();
        let opts: Vec<String> = ssh
            .options(Channel::Control)
            .iter()
            .map(|o| o.to_string_lossy().into_owned())
            .collect();
        let joined = opts.join(" ");
        assert!(joined.contains("StrictHostKeyChecking=yes"));
        assert!(joined.contains("ForwardAgent=no"));
        assert!(joined.contains("BatchMode=yes"));
        assert!(!joined.contains("accept-new") && !joined.contains("StrictHostKeyChecking=no"));
        let pinned = std::fs::read_to_string(dir.path().join("known_hosts")).unwrap();
        assert_eq!(pinned, "env_x ssh-ed25519 AAAA\n");
    }
}
