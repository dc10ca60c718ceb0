//! A filesystem sandbox for a contained command run on the gateway's own host (the tools of a
//! gateway-placed session): the command sees the system's read-only paths, the directories it
//! was given, a private `/tmp` and home, and a `/proc` of its own PID namespace — nothing of
//! the gateway's state dir, other sessions' workspaces, the gateway's `/proc` entries or
//! anything else of the host.
//!
//! It is made by bubblewrap (`bwrap`), in place of `unshare`, under the same `setpriv
//! --pdeathsig KILL` (see `contain.rs`): `bwrap` is our child and the namespace's init its
//! child, so ending the command works exactly as for a plain contained command. We chose
//! bubblewrap over an `unshare --mount` script of our own or Landlock because it does the one
//! thing we need the same way as root (CI) and as an unprivileged user: it makes a user
//! namespace either way (as root that namespace maps only root, so the command keeps root's
//! file ownership in the workspace but none of its capabilities), builds a new root on a tmpfs
//! and pivots into it, so no mount of the host's tree is left underneath to be uncovered, and
//! mounts a `/proc` of the new PID namespace. Landlock can narrow paths but cannot give a
//! command a `/proc` where the gateway's process is absent, and a hand-written mount script would
//! repeat bubblewrap's careful ordering without its years of review.
//!
//! Every capability is dropped (`--cap-drop ALL`) and no new privileges can be gained, so a
//! command cannot undo its mounts. As root, files of `/etc` that not every user may read
//! (`shadow`, `sudoers`, ssh host keys) are hidden, since the command runs as uid 0 and would
//! otherwise read them as their owner.
//!
//! A host that cannot make the sandbox (no `bwrap`, user namespaces disabled) is told so on
//! every sandboxed command ([`crate::Error::Sandbox`]); nothing falls back to running the
//! command unsandboxed.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The program that builds the sandbox.
pub(crate) const BWRAP: &str = "bwrap";

/// The host's system paths a sandboxed command sees, read-only (a symlink, as merged-`/usr`
/// systems have for `/bin` and `/lib`, is made again as the same symlink).
const SYSTEM: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt",
];

/// Files under the home directory a command may read: git's own configuration, so commits
/// carry the user's name and email as they would outside the sandbox.
const HOME_READ_ONLY: &[&str] = &[".gitconfig", ".config/git"];

/// One mount on top of the system's, in order: later ones go over earlier ones.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Mount {
    /// The directory at its own path, read-write.
    Writable(PathBuf),
    /// The path (a file or directory) at its own path, read-only; skipped when it is missing.
    ReadOnly(PathBuf),
    /// An empty, read-only directory over the path: what was there is hidden.
    Hidden(PathBuf),
}

/// Where a sandboxed command may write and what else of the host it sees besides the system's
/// read-only paths. Built by the caller (the agent's tools know a workspace's layout), applied
/// by [`crate::Cmd::sandbox`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sandbox {
    mounts: Vec<Mount>,
    /// Said after the reason when this host cannot sandbox: what the operator can do.
    hint: String,
}

impl Sandbox {
    /// A sandbox that sees only the system's read-only paths, a private `/tmp` and home.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds `dir` read-write at its own path.
    pub fn writable(mut self, dir: impl Into<PathBuf>) -> Self {
        self.mounts.push(Mount::Writable(dir.into()));
        self
    }

    /// Binds `path` read-only at its own path, over what came before (a part of a writable
    /// directory that must not change); a missing path is skipped.
    pub fn read_only(mut self, path: impl Into<PathBuf>) -> Self {
        self.mounts.push(Mount::ReadOnly(path.into()));
        self
    }

    /// Hides `dir` (a part of a writable directory) behind an empty read-only directory. Note
    /// that a missing `dir` is created (empty) on the host, as the mount point.
    pub fn hidden(mut self, dir: impl Into<PathBuf>) -> Self {
        self.mounts.push(Mount::Hidden(dir.into()));
        self
    }

    /// What the error for a host that cannot sandbox adds (a configuration key to turn the
    /// sandbox off, say).
    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = hint.into();
        self
    }

    /// The hint [`Sandbox::hint`] set.
    pub fn hint_text(&self) -> &str {
        &self.hint
    }

    /// `bwrap`'s arguments (up to, not including, the `--` before the program), for a command
    /// that starts in `cwd`.
    pub(crate) fn bwrap_args(&self, cwd: Option<&Path>) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |words: &[&std::ffi::OsStr]| args.extend(words.iter().map(|w| w.into()));
        push(&[
            "--unshare-user".as_ref(),
            "--unshare-pid".as_ref(),
            "--unshare-ipc".as_ref(),
            "--unshare-uts".as_ref(),
            "--unshare-cgroup-try".as_ref(),
            "--die-with-parent".as_ref(),
            "--cap-drop".as_ref(),
            "ALL".as_ref(),
        ]);
        for (link, target) in &system().links {
            push(&["--symlink".as_ref(), target.as_os_str(), link.as_os_str()]);
        }
        for dir in &system().dirs {
            push(&["--ro-bind".as_ref(), dir.as_os_str(), dir.as_os_str()]);
        }
        for file in &system().masked_files {
            push(&["--ro-bind".as_ref(), "/dev/null".as_ref(), file.as_os_str()]);
        }
        for dir in &system().masked_dirs {
            push(&["--tmpfs".as_ref(), dir.as_os_str()]);
            push(&["--remount-ro".as_ref(), dir.as_os_str()]);
        }
        push(&[
            "--proc".as_ref(),
            "/proc".as_ref(),
            "--dev".as_ref(),
            "/dev".as_ref(),
            "--tmpfs".as_ref(),
            "/tmp".as_ref(),
            "--tmpfs".as_ref(),
            "/var/tmp".as_ref(),
            "--setenv".as_ref(),
            "TMPDIR".as_ref(),
            "/tmp".as_ref(),
        ]);
        if let Some(home) = private_home() {
            push(&["--tmpfs".as_ref(), home.as_os_str()]);
            for name in HOME_READ_ONLY {
                let path = home.join(name);
                push(&["--ro-bind-try".as_ref(), path.as_os_str(), path.as_os_str()]);
            }
        }
        for mount in &self.mounts {
            match mount {
                Mount::Writable(dir) => {
                    push(&["--bind".as_ref(), dir.as_os_str(), dir.as_os_str()]);
                }
                Mount::ReadOnly(path) => {
                    push(&["--ro-bind-try".as_ref(), path.as_os_str(), path.as_os_str()]);
                }
                Mount::Hidden(dir) => push(&["--tmpfs".as_ref(), dir.as_os_str()]),
            }
        }
        // Last: a hidden directory may have a writable mount below it (a worktree's own git dir
        // among the hidden others), which must exist before the directory turns read-only.
        for mount in &self.mounts {
            if let Mount::Hidden(dir) = mount {
                push(&["--remount-ro".as_ref(), dir.as_os_str()]);
            }
        }
        if let Some(cwd) = cwd {
            push(&["--chdir".as_ref(), cwd.as_os_str()]);
        }
        args
    }
}

/// `$HOME`, when a tmpfs can go over it: an absolute path that is not `/` and not one of the
/// system's paths (a home under `/usr` stays as the system has it).
fn private_home() -> Option<PathBuf> {
    let home = PathBuf::from(std::env::var_os("HOME")?);
    let usable = home.is_absolute()
        && home.parent().is_some()
        && !SYSTEM.iter().any(|sys| home.starts_with(sys));
    usable.then_some(home)
}

/// The host's system paths as a sandbox shows them; looked at once per process.
struct System {
    links: Vec<(PathBuf, PathBuf)>,
    dirs: Vec<PathBuf>,
    /// As root: files of `/etc` (two levels deep) that not every user may read.
    masked_files: Vec<PathBuf>,
    /// As root: directories of `/etc` (two levels deep) that not every user may enter.
    masked_dirs: Vec<PathBuf>,
}

fn system() -> &'static System {
    static SYSTEM_PATHS: OnceLock<System> = OnceLock::new();
    SYSTEM_PATHS.get_or_init(|| {
        let mut system = System {
            links: Vec::new(),
            dirs: Vec::new(),
            masked_files: Vec::new(),
            masked_dirs: Vec::new(),
        };
        for path in SYSTEM.iter().map(PathBuf::from) {
            let Ok(meta) = path.symlink_metadata() else {
                continue;
            };
            if meta.file_type().is_symlink() {
                if let Ok(target) = std::fs::read_link(&path) {
                    system.links.push((path, target));
                }
            } else if meta.is_dir() {
                system.dirs.push(path);
            }
        }
        if rustix::process::geteuid().is_root() {
            mask_private(Path::new("/etc"), 2, &mut system);
        }
        system
    })
}

/// Collects what under `dir` (down `depth` levels) not every user may read.
fn mask_private(dir: &Path, depth: u32, system: &mut System) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = path.symlink_metadata() else {
            continue;
        };
        let mode = meta.permissions().mode();
        if meta.is_file() && mode & 0o004 == 0 {
            system.masked_files.push(path);
        } else if meta.is_dir() {
            if mode & 0o005 != 0o005 {
                system.masked_dirs.push(path);
            } else if depth > 1 {
                mask_private(&path, depth - 1, system);
            }
        }
    }
}

/// Whether this host can make the sandbox: tried once with `true` and remembered when it
/// worked. A failure is not remembered (the host may be fixed without a restart); its text is
/// the reason.
pub async fn probe() -> Result<(), String> {
    static WORKS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    WORKS
        .get_or_try_init(|| async {
            let mut argv: Vec<OsString> = ["--pdeathsig", "KILL", "--", BWRAP]
                .iter()
                .map(OsString::from)
                .collect();
            argv.extend(Sandbox::new().bwrap_args(Some(Path::new("/"))));
            argv.extend(["--", "true"].map(OsString::from));
            let probe = crate::Cmd::new(crate::contain::WRAPPER)
                .args(argv)
                .timeout(Duration::from_secs(10));
            match probe.run_with(&CancellationToken::new(), None).await {
                Ok(done) if done.status.success() => Ok(()),
                Ok(done) => Err(format!(
                    "`{BWRAP}` failed ({}): {}",
                    done.status,
                    done.stderr.into_string().trim()
                )),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_mounts_go_over_earlier_ones_in_the_order_given() {
        let sandbox = Sandbox::new()
            .writable("/w")
            .read_only("/w/.git/config")
            .hidden("/w/.git/worktrees")
            .writable("/w/.git/worktrees/mine");
        let args: Vec<String> = sandbox
            .bwrap_args(Some(Path::new("/w/src")))
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let at = |word: &str, path: &str| {
            args.windows(3)
                .position(|w| w[0] == word && w[1] == path)
                .unwrap_or_else(|| panic!("no `{word} … {path}` in {args:?}"))
        };
        let proc = args.iter().position(|a| a == "--proc").unwrap();
        assert!(proc < at("--bind", "/w"));
        assert!(at("--bind", "/w") < at("--ro-bind-try", "/w/.git/config"));
        assert!(at("--ro-bind-try", "/w/.git/config") < at("--tmpfs", "/w/.git/worktrees"));
        assert!(at("--tmpfs", "/w/.git/worktrees") < at("--bind", "/w/.git/worktrees/mine"));
        assert_eq!(args[args.len() - 2..], ["--chdir", "/w/src"]);
        assert!(args.windows(2).any(|w| w == ["--cap-drop", "ALL"]));
    }
}
