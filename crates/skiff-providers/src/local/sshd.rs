//! A box's own OpenSSH server: its host key, its config, and starting it.

use crate::{Error, Result, io_err};
use skiff_process::Cmd;
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

pub(crate) const SSHD: &str = "/usr/sbin/sshd";

/// Generates an ed25519 key pair at `path` (and `path.pub`) unless it exists.
pub(crate) async fn keygen(path: &Path, comment: &str) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    Cmd::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(path)
        .run_checked(&CancellationToken::new())
        .await?;
    Ok(())
}

pub(crate) struct Config<'a> {
    pub etc: &'a Path,
    pub dir: &'a Path,
    pub port: u16,
    pub user: &'a str,
    /// Runs inside the box's sandbox (its own `/run`), started by the sandbox init.
    pub sandboxed: bool,
}

impl Config<'_> {
    pub(crate) fn path(&self) -> PathBuf {
        self.etc.join("sshd_config")
    }

    /// Unsandboxed, sshd's own pid file is the box's pid file. Sandboxed, it is inside the box
    /// (a pid of the box's namespace, meaningless outside) and tells the init that sshd listens.
    pub(crate) fn pid_file(&self) -> PathBuf {
        if self.sandboxed {
            PathBuf::from(super::sandbox::SSHD_PID_INSIDE)
        } else {
            self.dir.join(super::sandbox::PID_FILE)
        }
    }

    /// Public keys only, no passwords, no agent or X11 forwarding, no user environment. Remote
    /// stream forwarding stays allowed: the worker tunnel is a reverse forward of a unix socket.
    pub(crate) fn render(&self) -> String {
        let etc = self.etc.display();
        format!(
            "Port {port}\n\
             ListenAddress 127.0.0.1\n\
             HostKey {etc}/ssh_host_ed25519_key\n\
             PidFile {pid}\n\
             AuthorizedKeysFile {etc}/authorized_keys\n\
             AllowUsers {user}\n\
             PubkeyAuthentication yes\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             UsePAM no\n\
             StrictModes no\n\
             PermitRootLogin no\n\
             AllowAgentForwarding no\n\
             AllowTcpForwarding remote\n\
             AllowStreamLocalForwarding remote\n\
             StreamLocalBindUnlink yes\n\
             X11Forwarding no\n\
             PermitTunnel no\n\
             PermitUserEnvironment no\n\
             PrintMotd no\n\
             PrintLastLog no\n\
             MaxStartups 100:30:200\n\
             LogLevel ERROR\n",
            port = self.port,
            pid = self.pid_file().display(),
            user = self.user,
        )
    }

    pub(crate) fn write(&self) -> Result<()> {
        let path = self.path();
        std::fs::write(&path, self.render()).map_err(io_err(&path))
    }
}

/// Starts the daemon of an unsandboxed box (optionally inside a network namespace) with a
/// clean environment and returns its pid. sshd binds its socket before it daemonizes, so it accepts connections once
/// this returns.
pub(crate) async fn start(config: &Config<'_>, netns: Option<&str>) -> Result<i32> {
    let pid_file = config.pid_file();
    let _ = std::fs::remove_file(&pid_file);
    let log = config.dir.join("sshd.log");
    // sshd is started in a session of its own (`setsid -w` waits for it to daemonize): the
    // process helper kills a finished command's whole process group, and the daemon must not be
    // caught in that before it leaves the group itself. A box outlives the gateway by design.
    let cmd = Cmd::new("setsid").arg("-w");
    let cmd = match netns {
        Some(ns) => cmd.args(["ip", "netns", "exec", ns, SSHD]),
        None => cmd.arg(SSHD),
    };
    cmd.arg("-f")
        .arg(config.path())
        .arg("-E")
        .arg(&log)
        .run_checked(&CancellationToken::new())
        .await?;
    // The pid file is written by the daemonized child right after it forks.
    // Bounded: 15 s covers a loaded machine; sshd that failed says why in its log.
    for _ in 0..1500 {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
        {
            return Ok(pid);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    Err(Error::Provider {
        provider: "local",
        message: format!(
            "sshd did not write {}: {}",
            pid_file.display(),
            log_text.trim()
        ),
    })
}

/// The pid recorded in the box's pid file, if any.
pub(crate) fn recorded_pid(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join(super::sandbox::PID_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}
