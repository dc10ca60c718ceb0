//! Moving bytes between the gateway and a box over the box's pinned SSH `Transfer` connection:
//! `rsync --files-from` when the box has rsync, a tar stream over ssh when it does not, and
//! single files through ssh's stdin and stdout.
//!
//! Pulls from a box land in a private staging directory, never in a workspace: rsync runs
//! without devices, specials, owners or permission bits (`-rltE`), and whatever arrives is
//! checked against the box's manifest before anything is applied.
//!
//! Deliberately absent: deciding what to send (callers pass explicit file lists) and any trust
//! setting of its own (every connection uses `skiff_ssh::Ssh::options`).

use crate::{Error, Result};
use skiff_process::Cmd;
use skiff_ssh::{Channel, Ssh, shell_quote};
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How a transfer moved its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Rsync,
    Tar,
}

impl Method {
    /// The method a [`Remote::method_probe`]'s last line of output names.
    pub fn from_probe(output: &str) -> Method {
        if output.lines().last().map(str::trim) == Some("rsync") {
            Method::Rsync
        } else {
            Method::Tar
        }
    }
}

/// A directory on a box, reached over a pinned SSH client.
#[derive(Clone, Debug)]
pub struct Remote {
    ssh: Ssh,
    dir: String,
    rsync_path: String,
    timeout: Duration,
}

/// How each box this process asked moves files (see [`Remote::known_method`]): whether a box
/// has rsync does not change while it lives, and asking costs a round trip per pull.
fn probed() -> &'static std::sync::Mutex<std::collections::HashMap<String, Method>> {
    static PROBED: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<String, Method>>,
    > = std::sync::OnceLock::new();
    PROBED.get_or_init(Default::default)
}

fn nul_list(paths: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in paths {
        out.extend_from_slice(p.as_bytes());
        out.push(0);
    }
    out
}

impl Remote {
    /// `dir` is the workspace directory on the box (relative paths are below the box user's
    /// home): letters, digits, `.`, `_`, `-` and `/`, no `..`.
    pub fn new(ssh: Ssh, dir: &str) -> Result<Remote> {
        let ok = !dir.is_empty()
            && !dir.starts_with('-')
            && dir
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
            && !dir.split('/').any(|p| p == "..");
        if !ok {
            return Err(Error::Invalid {
                what: format!("box directory {dir:?}"),
                detail: "use letters, digits, `.`, `_`, `-` and `/`, without `..`".into(),
            });
        }
        Ok(Remote {
            ssh,
            dir: dir.trim_end_matches('/').to_owned(),
            rsync_path: "rsync".into(),
            timeout: Duration::from_secs(3600),
        })
    }

    /// The rsync program on the box [default: `rsync` on its PATH]. A path that does not exist
    /// there makes every transfer fall back to tar.
    pub fn with_rsync_path(mut self, path: &str) -> Remote {
        path.clone_into(&mut self.rsync_path);
        self
    }

    pub fn dir(&self) -> &str {
        &self.dir
    }

    pub fn ssh(&self) -> &Ssh {
        &self.ssh
    }

    /// The box directory quoted for the box's shell.
    pub fn quoted_dir(&self) -> String {
        shell_quote(&self.dir)
    }

    fn destination(&self) -> String {
        let t = self.ssh.target();
        format!("{}@{}", t.user, t.host)
    }

    /// `ssh <pinned options> user@host --`, for a command line to follow.
    fn ssh_argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec!["ssh".into()];
        argv.extend(self.ssh.options(Channel::Transfer));
        argv.push(self.destination().into());
        argv.push("--".into());
        argv
    }

    /// The `-e` argument of rsync: rsync splits it on spaces and honours single quotes (but
    /// not backslashes), so an option holding a quote cannot be passed through it.
    fn rsync_shell(&self) -> Result<String> {
        let opts = self.ssh.options(Channel::Transfer);
        let mut line = String::from("ssh");
        for o in opts {
            let o = o.to_string_lossy().into_owned();
            if o.contains('\'') {
                return Err(Error::Invalid {
                    what: format!("ssh option {o}"),
                    detail: "rsync cannot pass an argument holding a single quote".into(),
                });
            }
            line.push(' ');
            line.push_str(&shell_quote(&o));
        }
        Ok(line)
    }

    /// Runs a shell command line on the box (on the transfer connection) with `input` on its
    /// stdin; returns its stdout.
    pub async fn run(
        &self,
        script: &str,
        input: Vec<u8>,
        cancel: &CancellationToken,
    ) -> Result<String> {
        Ok(self
            .ssh
            .run_with_input(script, input, self.timeout, cancel)
            .await?)
    }

    /// Whether the box can run rsync (asked of the box every time).
    pub async fn method(&self, cancel: &CancellationToken) -> Result<Method> {
        let out = self.run(&self.method_probe(), Vec::new(), cancel).await?;
        let method = Method::from_probe(&out);
        self.remember(method);
        Ok(method)
    }

    /// [`Remote::method`], asked of a box once: what this process learnt of the box before
    /// (by any `Remote` of it with the same rsync program) serves without a round trip.
    pub async fn known_method(&self, cancel: &CancellationToken) -> Result<Method> {
        let known = probed()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&self.probe_key())
            .copied();
        match known {
            Some(method) => Ok(method),
            None => self.method(cancel).await,
        }
    }

    /// Records what a [`Remote::method_probe`] folded into a caller's script found, for
    /// [`Remote::known_method`].
    pub fn remember(&self, method: Method) {
        probed()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(self.probe_key(), method);
    }

    /// What a probe's answer holds for: the box (its alias is the environment's id, never
    /// reused, and its endpoint) and the rsync program asked about.
    fn probe_key(&self) -> String {
        let t = self.ssh.target();
        format!(
            "{}\0{}@{}:{}\0{}",
            t.alias, t.user, t.host, t.port, self.rsync_path
        )
    }

    async fn bash(
        &self,
        script: &str,
        args: Vec<OsString>,
        stdin: Vec<u8>,
        cancel: &CancellationToken,
    ) -> Result<()> {
        self.ssh.ensure_master(Channel::Transfer, cancel).await?;
        Cmd::new("bash")
            .args(["-c", script, "bash"])
            .args(args)
            .stdin(stdin)
            .timeout(self.timeout)
            .run_checked(cancel)
            .await?;
        Ok(())
    }

    /// Copies `paths` (files and symlinks of `root`, relative) into the box directory,
    /// creating it. Existing files there with the same names are replaced.
    pub async fn push_files(
        &self,
        root: &Path,
        paths: &[String],
        cancel: &CancellationToken,
    ) -> Result<Method> {
        self.run(
            &format!("mkdir -p {}", self.quoted_dir()),
            Vec::new(),
            cancel,
        )
        .await?;
        let method = self.method(cancel).await?;
        self.push_files_by(root, paths, method, cancel).await?;
        Ok(method)
    }

    /// The shell test that prints `rsync` when the box can run rsync, else `tar` (what
    /// [`Remote::method`] asks), for a caller folding it into a script of its own.
    pub fn method_probe(&self) -> String {
        format!(
            "if command -v {} >/dev/null 2>&1; then echo rsync; else echo tar; fi",
            shell_quote(&self.rsync_path)
        )
    }

    /// [`Remote::push_files`] into a box directory that exists, by a `method` already known:
    /// no round trip before the copy itself, and none at all for no paths.
    pub async fn push_files_by(
        &self,
        root: &Path,
        paths: &[String],
        method: Method,
        cancel: &CancellationToken,
    ) -> Result<()> {
        if paths.is_empty() {
            return Ok(());
        }
        match method {
            Method::Rsync => {
                let mut src = root.as_os_str().to_owned();
                src.push("/");
                // `--ignore-times`: a file there with the same size and mtime (a checkout in
                // the same second) is replaced all the same, as promised.
                let args: Vec<OsString> = vec![
                    "-a".into(),
                    "--ignore-times".into(),
                    "--no-D".into(),
                    "--no-o".into(),
                    "--no-g".into(),
                    "--from0".into(),
                    "--files-from=-".into(),
                    format!("--rsync-path={}", self.rsync_path).into(),
                    "-e".into(),
                    self.rsync_shell()?.into(),
                    src,
                    format!("{}:{}/", self.destination(), self.dir).into(),
                ];
                self.ssh.ensure_master(Channel::Transfer, cancel).await?;
                Cmd::new("rsync")
                    .args(args)
                    .stdin(nul_list(paths))
                    .timeout(self.timeout)
                    .run_checked(cancel)
                    .await?;
            }
            Method::Tar => {
                let mut args: Vec<OsString> = vec![root.as_os_str().to_owned()];
                args.extend(self.ssh_argv());
                args.push(format!("tar -C {} -xf -", self.quoted_dir()).into());
                self.bash(
                    r#"set -o pipefail; root="$1"; shift; tar -C "$root" --null --no-recursion -T - -cf - | "$@""#,
                    args,
                    nul_list(paths),
                    cancel,
                )
                .await?;
            }
        }
        Ok(())
    }

    /// Copies `paths` (relative to the box directory) into `staging`, a private directory of
    /// the gateway. Devices, FIFOs and sockets do not arrive (rsync skips them; the check
    /// against the manifest then refuses the transfer); owners and permission bits other than
    /// executability are not kept.
    pub async fn pull_files(
        &self,
        paths: &[String],
        staging: &Path,
        cancel: &CancellationToken,
    ) -> Result<Method> {
        let method = self.known_method(cancel).await?;
        if paths.is_empty() {
            return Ok(method);
        }
        match method {
            Method::Rsync => {
                let mut dest = staging.as_os_str().to_owned();
                dest.push("/");
                let args: Vec<OsString> = vec![
                    "-rltE".into(),
                    "--from0".into(),
                    "--files-from=-".into(),
                    format!("--rsync-path={}", self.rsync_path).into(),
                    "-e".into(),
                    self.rsync_shell()?.into(),
                    format!("{}:{}/", self.destination(), self.dir).into(),
                    dest,
                ];
                self.ssh.ensure_master(Channel::Transfer, cancel).await?;
                let cmd = Cmd::new("rsync")
                    .args(args)
                    .stdin(nul_list(paths))
                    .timeout(self.timeout);
                let command = cmd.display();
                let done = cmd.run(cancel).await?;
                // 23 and 24: some files did not come (gone, or not regular files). What did
                // come is checked against the manifest, which refuses anything missing.
                if !matches!(done.code(), 0 | 23 | 24) {
                    return Err(skiff_process::Error::Failed {
                        command,
                        status: done.status.to_string(),
                        stderr: done.stderr.into_string().trim().to_owned(),
                    }
                    .into());
                }
            }
            Method::Tar => {
                let mut args: Vec<OsString> = vec![staging.as_os_str().to_owned()];
                args.extend(self.ssh_argv());
                args.push(
                    format!(
                        "cd {} && tar --null --no-recursion -T - -cf -",
                        self.quoted_dir()
                    )
                    .into(),
                );
                self.bash(
                    // The box's tar exits 2 when a listed file is missing; what did come is checked
                    // against the manifest. ssh's own failures (255) and ours are errors.
                    r#"dest="$1"; shift; "$@" | tar -C "$dest" -xf - --no-same-owner --no-same-permissions --no-overwrite-dir; s=("${PIPESTATUS[@]}"); [ "${s[0]}" -le 2 ] && [ "${s[1]}" -eq 0 ]"#,
                    args,
                    nul_list(paths),
                    cancel,
                )
                .await?;
            }
        }
        Ok(method)
    }

    /// Writes the local file `local` to `remote_path` on the box (relative to the box user's
    /// home), creating its directory.
    pub async fn send_file(
        &self,
        local: &Path,
        remote_path: &str,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let q = shell_quote(remote_path);
        let mut args: Vec<OsString> = vec![local.as_os_str().to_owned()];
        args.extend(self.ssh_argv());
        args.push(format!("mkdir -p \"$(dirname {q})\" && cat > {q}").into());
        self.bash(
            r#"src="$1"; shift; "$@" < "$src""#,
            args,
            Vec::new(),
            cancel,
        )
        .await
    }

    /// Runs `script` on the box (on the transfer connection) with a tar stream of the local
    /// directory `dir`'s contents on its stdin, made as it is sent; returns the script's exit
    /// and stdout (the script may refuse without reading its stdin).
    pub async fn run_with_tar(
        &self,
        script: &str,
        dir: &Path,
        cancel: &CancellationToken,
    ) -> Result<skiff_process::Finished> {
        let mut args: Vec<OsString> = vec![dir.as_os_str().to_owned()];
        args.extend(self.ssh_argv());
        args.push(script.into());
        self.ssh.ensure_master(Channel::Transfer, cancel).await?;
        Ok(Cmd::new("bash")
            .args([
                "-c",
                r#"set -o pipefail; d="$1"; shift; tar -C "$d" -cf - . | "$@""#,
                "bash",
            ])
            .args(args)
            .timeout(self.timeout)
            .run(cancel)
            .await?)
    }

    /// Runs `script` on the box and writes its stdout to the local file `local`; more than
    /// `max_bytes` of output is refused (and the file removed), so a box cannot fill the disk.
    pub async fn fetch_output(
        &self,
        script: &str,
        local: &Path,
        max_bytes: u64,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let mut args: Vec<OsString> = vec![
            local.as_os_str().to_owned(),
            max_bytes.saturating_add(1).to_string().into(),
        ];
        args.extend(self.ssh_argv());
        args.push(script.into());
        // `head` stops reading past the cap, and the box's side then fails one way or another
        // (SIGPIPE, a write error): the size decides first, the exit status second.
        self.ssh.ensure_master(Channel::Transfer, cancel).await?;
        let cmd = Cmd::new("bash")
            .args([
                "-c",
                r#"out="$1"; max="$2"; shift 2; set -o pipefail; "$@" | head -c "$max" > "$out""#,
                "bash",
            ])
            .args(args)
            .timeout(self.timeout);
        let command = cmd.display();
        let done = cmd.run(cancel).await?;
        let size = std::fs::metadata(local).map(|m| m.len()).unwrap_or(0);
        if size > max_bytes {
            let _ = std::fs::remove_file(local);
            return Err(Error::Unsafe {
                path: local.display().to_string(),
                reason: format!("the box sent more than {max_bytes} bytes"),
            });
        }
        if !done.status.success() {
            return Err(skiff_process::Error::Failed {
                command,
                status: done.status.to_string(),
                stderr: done.stderr.into_string().trim().to_owned(),
            }
            .into());
        }
        Ok(())
    }
}
