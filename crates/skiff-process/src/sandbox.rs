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
//! command cannot undo its mounts. As root, only what every user may read of `/etc` is shown
//! (not `shadow`, `sudoers` or ssh host keys), since the command runs as uid 0 and would
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
        let as_root = rustix::process::geteuid().is_root();
        for dir in &system().dirs {
            if as_root && dir == Path::new(ETC) {
                // Read now, not once per process: `/etc` changes under a running gateway.
                let etc = public_etc();
                push(&etc.iter().map(OsString::as_os_str).collect::<Vec<_>>());
            } else {
                push(&["--ro-bind".as_ref(), dir.as_os_str(), dir.as_os_str()]);
            }
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
}

fn system() -> &'static System {
    static SYSTEM_PATHS: OnceLock<System> = OnceLock::new();
    SYSTEM_PATHS.get_or_init(|| {
        let mut system = System {
            links: Vec::new(),
            dirs: Vec::new(),
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
        system
    })
}

/// The one system directory that holds secrets only their owner may read.
const ETC: &str = "/etc";

/// How many levels of `/etc` are looked at entry by entry; deeper directories are bound whole.
const ETC_DEPTH: u32 = 2;

/// `bwrap`'s arguments that show a command run as root only what every user may read of `/etc`
/// (two levels deep): an empty read-only `/etc` with each such entry bound into it. A list of
/// what to hide instead would race the host: `useradd` makes and removes `/etc/shadow.PID` and
/// `/etc/shadow+` in passing, and a name that vanished before the mount fails the whole command.
/// Binding what may be seen fails closed: an entry that vanished is skipped (`--ro-bind-try`),
/// one that appeared since is not there.
fn public_etc() -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["--tmpfs".into(), ETC.into()];
    public_entries(Path::new(ETC), ETC_DEPTH, &mut args);
    args.extend(["--remount-ro".into(), ETC.into()]);
    args
}

/// Adds the binds for what every user may read in `dir` (down `depth` levels); returns whether
/// anything there was left out.
fn public_entries(dir: &Path, depth: u32, args: &mut Vec<OsString>) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return true;
    };
    let mut left_out = false;
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = path.symlink_metadata() else {
            continue;
        };
        let mode = meta.permissions().mode();
        if meta.file_type().is_symlink() {
            if let Ok(target) = std::fs::read_link(&path) {
                args.extend(["--symlink".into(), target.into(), path.into()]);
            }
        } else if meta.is_dir() {
            if mode & 0o005 != 0o005 {
                // Kept as an empty directory: its shape stays, nothing inside shows.
                args.extend(["--dir".into(), path.into()]);
                left_out = true;
                continue;
            }
            let mut inside = Vec::new();
            if depth > 1 && public_entries(&path, depth - 1, &mut inside) {
                args.extend(["--dir".into(), path.into()]);
                args.extend(inside);
                left_out = true;
            } else {
                args.extend(["--ro-bind-try".into(), path.clone().into(), path.into()]);
            }
        } else if mode & 0o004 != 0 {
            args.extend(["--ro-bind-try".into(), path.clone().into(), path.into()]);
        } else {
            left_out = true;
        }
    }
    left_out
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

    #[test]
    fn only_what_every_user_may_read_is_bound_and_a_private_directory_stays_empty() {
        let etc = tempfile::tempdir().unwrap();
        let at = |p: &str| etc.path().join(p);
        let mode = |p: &str, m: u32| {
            std::fs::set_permissions(at(p), std::fs::Permissions::from_mode(m)).unwrap()
        };
        std::fs::write(at("passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        std::fs::write(at("shadow"), "root:$6$secret\n").unwrap();
        mode("shadow", 0o640);
        std::fs::create_dir_all(at("ssh")).unwrap();
        std::fs::write(at("ssh/ssh_config"), "Host *\n").unwrap();
        std::fs::write(at("ssh/ssh_host_ed25519_key"), "key").unwrap();
        mode("ssh/ssh_host_ed25519_key", 0o600);
        std::fs::create_dir_all(at("apt/sources.list.d")).unwrap();
        std::fs::create_dir_all(at("sudoers.d")).unwrap();
        mode("sudoers.d", 0o750);
        std::os::unix::fs::symlink("/proc/self/mounts", at("mtab")).unwrap();

        let mut args = Vec::new();
        assert!(public_entries(etc.path(), ETC_DEPTH, &mut args));
        let args: Vec<String> = args
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let has = |word: &str, path: &str| {
            let path = at(path).to_string_lossy().into_owned();
            args.windows(2).any(|w| w[0] == word && w[1] == path)
                || args.windows(3).any(|w| w[0] == word && w[2] == path)
        };
        assert!(has("--ro-bind-try", "passwd"), "{args:?}");
        assert!(has("--dir", "ssh") && has("--ro-bind-try", "ssh/ssh_config"));
        // A directory with nothing private is bound whole.
        assert!(has("--ro-bind-try", "apt") && !has("--dir", "apt"));
        assert!(has("--dir", "sudoers.d") && has("--symlink", "mtab"));
        for secret in ["shadow", "ssh/ssh_host_ed25519_key"] {
            let secret = at(secret).to_string_lossy().into_owned();
            assert!(!args.contains(&secret), "{secret} is shown: {args:?}");
        }
    }
}
