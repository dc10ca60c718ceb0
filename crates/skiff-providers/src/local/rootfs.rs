//! The filesystem a sandboxed box sees, built inside the box's own mount namespace and made its
//! root with `pivot_root`:
//!
//! ```text
//! /usr /bin /sbin /lib* the host's, read-only, nosuid (symlinks stay symlinks: merged /usr)
//! /etc                  the host's, read-only, with secrets overmounted (shadow, sudoers, ssh
//!                       host keys, …) and passwd/group cut down to root, nobody, sshd, the box user
//! /dev                  null zero full random urandom tty, a devpts of its own (+ ptmx), shm
//! /proc                 of the box's PID namespace
//! /run /tmp /dev/shm    tmpfs of its own, size-limited (/run/sshd for sshd's privilege separation)
//! <box dir>             the box's own directory at its host path (sshd config, home)
//! <shares>              the profile's `share` directories at their host paths, read-only,
//!                       nosuid, nodev (toolchains)
//! ```
//!
//! Nothing else of the host is there: no `/home`, `/root`, `/var`, `/opt`, `/sys`, no other box,
//! no gateway state. Deliberately absent: a copy of `/etc` (new secrets the host adds later are
//! visible unless they are unreadable to others, as secrets should be; the overmounts are a
//! second fence for the ones every Debian host has).

use crate::{Error, Result};
use rustix::mount::{
    MountFlags, MountPropagationFlags, UnmountFlags, mount, mount_bind, mount_bind_recursive,
    mount_change, mount_remount, unmount,
};
use std::ffi::CString;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What the view is built from.
pub(super) struct View<'a> {
    /// The box's directory (absolute); it appears at the same path inside.
    pub box_dir: &'a Path,
    /// The box's user: the only user besides root, nobody and sshd in `/etc/passwd`.
    pub user: &'a str,
    /// Size of the private `/tmp`.
    pub tmp_bytes: u64,
    /// Host directories shown read-only at their own paths.
    pub shares: &'a [PathBuf],
}

/// System paths from the host, read-only. Where the host has a symlink (Debian's merged /usr:
/// `/bin -> usr/bin`) the view gets the same symlink.
const SYSTEM: &[&str] = &["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// Files under `/etc` replaced by an empty, unreadable file.
const HIDDEN_FILES: &[&str] = &[
    "shadow",
    "shadow-",
    "gshadow",
    "gshadow-",
    "passwd-",
    "group-",
    "subuid",
    "subuid-",
    "subgid",
    "subgid-",
    "sudoers",
    "security/opasswd",
    ".pwd.lock",
];

/// Directories under `/etc` replaced by an empty, unlistable one.
const HIDDEN_DIRS: &[&str] = &["sudoers.d", "ssl/private", "skiff"];

/// Users kept in the box's `/etc/passwd` besides the box user: root (sshd runs as it), nobody,
/// and sshd's privilege-separation user.
const KEPT_USERS: &[&str] = &["root", "nobody", "sshd", "_sshd"];

/// Groups kept besides those of the kept users (`tty` owns pseudo-terminals).
const KEPT_GROUPS: &[&str] = &["root", "nogroup", "tty"];

/// Device nodes bound from the host's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

struct Builder<'a> {
    view: &'a View<'a>,
    /// The new root while it is built (a tmpfs mounted on `<box>/rootfs`).
    root: PathBuf,
}

impl Builder<'_> {
    fn fail(&self, step: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let dir = self.view.box_dir.display().to_string();
        let step = step.into();
        move |source| Error::Sandbox { dir, step, source }
    }

    /// `path` (absolute, as the box will see it) under the new root.
    fn at(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    fn mkdir(&self, path: &Path, mode: u32) -> Result<()> {
        match std::fs::DirBuilder::new().mode(mode).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(self.fail(format!("create {}", path.display()))(e)),
        }
        // The umask must not decide the mode of what the box sees.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(self.fail(format!("set the mode of {}", path.display())))
    }

    fn tmpfs(&self, target: &Path, flags: MountFlags, options: &str) -> Result<()> {
        let data = CString::new(options).map_err(|e| self.fail("build tmpfs options")(e.into()))?;
        mount("tmpfs", target, "tmpfs", flags, data.as_c_str())
            .map_err(|e| self.fail(format!("mount a tmpfs on {}", target.display()))(e.into()))
    }

    fn bind(&self, source: &Path, target: &Path, recursive: bool) -> Result<()> {
        let done = if recursive {
            mount_bind_recursive(source, target)
        } else {
            mount_bind(source, target)
        };
        done.map_err(|e| {
            self.fail(format!(
                "bind {} onto {}",
                source.display(),
                target.display()
            ))(e.into())
        })
    }

    fn remount_bind(&self, target: &Path, flags: MountFlags) -> Result<()> {
        mount_remount(target, MountFlags::BIND | flags, "")
            .map_err(|e| self.fail(format!("remount {}", target.display()))(e.into()))
    }

    fn system(&self) -> Result<()> {
        for name in SYSTEM {
            let host = Path::new("/").join(name);
            let target = self.at(name);
            match std::fs::symlink_metadata(&host) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.fail(format!("inspect {}", host.display()))(e)),
                Ok(meta) if meta.file_type().is_symlink() => {
                    let to = std::fs::read_link(&host)
                        .map_err(self.fail(format!("read the link {}", host.display())))?;
                    std::os::unix::fs::symlink(&to, &target)
                        .map_err(self.fail(format!("link {}", target.display())))?;
                }
                Ok(meta) if meta.is_dir() => {
                    self.mkdir(&target, 0o755)?;
                    self.bind(&host, &target, true)?;
                    // nosuid: nothing in a box becomes root again through su, sudo or the like.
                    self.remount_bind(
                        &target,
                        MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
                    )?;
                }
                Ok(_) => {}
            }
        }
        Ok(())
    }

    fn etc(&self) -> Result<()> {
        let etc = self.at("/etc");
        self.mkdir(&etc, 0o755)?;
        self.bind(Path::new("/etc"), &etc, true)?;
        self.remount_bind(
            &etc,
            MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
        )?;

        // What goes over the host's files lives in a root-only directory of the new root.
        let own = self.at("/.sandbox");
        self.mkdir(&own, 0o700)?;
        let empty = own.join("empty");
        self.write(&empty, "", 0o000)?;
        let empty_dir = own.join("empty.d");
        self.mkdir(&empty_dir, 0o000)?;

        let read = |name: &str| {
            std::fs::read_to_string(Path::new("/etc").join(name))
                .map_err(self.fail(format!("read /etc/{name}")))
        };
        let passwd = read("passwd")?;
        let group = read("group")?;
        let (passwd, gids) = filter_passwd(&passwd, self.view.user);
        let group = filter_group(&group, &gids, self.view.user);
        for (name, text) in [("passwd", passwd), ("group", group)] {
            let file = own.join(name);
            self.write(&file, &text, 0o644)?;
            self.bind(&file, &etc.join(name), false)?;
        }

        let mut files: Vec<String> = HIDDEN_FILES.iter().map(|f| (*f).to_owned()).collect();
        // Host private keys of the machine's own sshd.
        if let Ok(dir) = std::fs::read_dir("/etc/ssh") {
            for entry in dir.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("ssh_host_") && name.ends_with("_key") {
                    files.push(format!("ssh/{name}"));
                }
            }
        }
        for name in &files {
            let host = Path::new("/etc").join(name);
            if std::fs::symlink_metadata(&host).is_ok_and(|m| m.is_file()) {
                self.bind(&empty, &etc.join(name), false)?;
            }
        }
        for name in HIDDEN_DIRS {
            let host = Path::new("/etc").join(name);
            if std::fs::symlink_metadata(&host).is_ok_and(|m| m.is_dir()) {
                self.bind(&empty_dir, &etc.join(name), false)?;
            }
        }
        Ok(())
    }

    fn write(&self, path: &Path, text: &str, mode: u32) -> Result<()> {
        std::fs::write(path, text).map_err(self.fail(format!("write {}", path.display())))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(self.fail(format!("set the mode of {}", path.display())))
    }

    fn dev(&self) -> Result<()> {
        let dev = self.at("/dev");
        self.mkdir(&dev, 0o755)?;
        self.tmpfs(
            &dev,
            MountFlags::NOSUID | MountFlags::NOEXEC,
            "mode=0755,size=64k",
        )?;
        for name in DEVICES {
            if !Path::new("/dev").join(name).exists() {
                continue;
            }
            let target = dev.join(name);
            self.write(&target, "", 0o644)?;
            self.bind(&Path::new("/dev").join(name), &target, false)?;
        }
        let pts = dev.join("pts");
        self.mkdir(&pts, 0o755)?;
        // A devpts instance of its own: the box's ptys are not the host's, and it sees no other.
        let options = format!(
            "newinstance,ptmxmode=0666,mode=0620,gid={}",
            tty_gid(&std::fs::read_to_string("/etc/group").unwrap_or_default())
        );
        let data =
            CString::new(options).map_err(|e| self.fail("build devpts options")(e.into()))?;
        mount(
            "devpts",
            &pts,
            "devpts",
            MountFlags::NOSUID | MountFlags::NOEXEC,
            data.as_c_str(),
        )
        .map_err(|e| self.fail("mount a devpts instance")(e.into()))?;
        let links = [
            ("ptmx", "pts/ptmx"),
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ];
        for (name, to) in links {
            std::os::unix::fs::symlink(to, dev.join(name))
                .map_err(self.fail(format!("link /dev/{name}")))?;
        }
        let shm = dev.join("shm");
        self.mkdir(&shm, 0o1777)?;
        self.tmpfs(
            &shm,
            MountFlags::NOSUID | MountFlags::NODEV,
            "mode=1777,size=64m",
        )
    }

    fn proc_run_tmp(&self) -> Result<()> {
        let proc = self.at("/proc");
        self.mkdir(&proc, 0o555)?;
        // Mounted by the box's PID 1, so it lists the box's processes only.
        mount(
            "proc",
            &proc,
            "proc",
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
            None,
        )
        .map_err(|e| self.fail("mount /proc")(e.into()))?;

        let run = self.at("/run");
        self.mkdir(&run, 0o755)?;
        self.tmpfs(
            &run,
            MountFlags::NOSUID | MountFlags::NODEV,
            "mode=0755,size=4m",
        )?;
        // sshd's privilege separation directory: root-owned, not writable by others.
        self.mkdir(&run.join("sshd"), 0o755)?;

        let tmp = self.at("/tmp");
        self.mkdir(&tmp, 0o1777)?;
        self.tmpfs(
            &tmp,
            MountFlags::NOSUID | MountFlags::NODEV,
            &format!("mode=1777,size={}", self.view.tmp_bytes),
        )?;
        let var = self.at("/var");
        self.mkdir(&var, 0o755)?;
        std::os::unix::fs::symlink("/tmp", var.join("tmp")).map_err(self.fail("link /var/tmp"))
    }

    /// The box directory at its own path: parents are fresh directories (inside the private
    /// `/tmp` when the box lives under `/tmp`), so no sibling box shows.
    fn box_dir(&self) -> Result<()> {
        let inside = self
            .root
            .join(self.view.box_dir.strip_prefix("/").map_err(|_| {
                self.fail("place the box directory")(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "the box directory is not an absolute path",
                ))
            })?);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&inside)
            .map_err(self.fail(format!("create {}", inside.display())))?;
        self.bind(self.view.box_dir, &inside, false)?;
        self.remount_bind(&inside, MountFlags::NOSUID | MountFlags::NODEV)
    }

    /// Each shared directory at its host path, read-only. Not recursive: a mount below it
    /// (which could be writable) is not carried in.
    fn shares(&self) -> Result<()> {
        for share in self.view.shares {
            let inside = self.root.join(share.strip_prefix("/").map_err(|_| {
                self.fail("place a shared directory")(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{} is not an absolute path", share.display()),
                ))
            })?);
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&inside)
                .map_err(self.fail(format!("create {}", inside.display())))?;
            self.bind(share, &inside, false)?;
            self.remount_bind(
                &inside,
                MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
            )?;
        }
        Ok(())
    }

    fn pivot(&self) -> Result<()> {
        let old = self.root.join(".old");
        self.mkdir(&old, 0o700)?;
        rustix::process::pivot_root(&self.root, &old)
            .map_err(|e| self.fail("pivot_root into the new root")(e.into()))?;
        rustix::process::chdir("/").map_err(|e| self.fail("chdir to /")(e.into()))?;
        // INVARIANT: after this, nothing of the host's tree is reachable from the box.
        unmount("/.old", UnmountFlags::DETACH)
            .map_err(|e| self.fail("unmount the host's root")(e.into()))?;
        std::fs::remove_dir("/.old").map_err(self.fail("remove /.old"))?;
        // Without MS_BIND this reaches the tmpfs itself, and with it every bind of its files.
        for (path, flags) in [
            ("/", MountFlags::NOSUID | MountFlags::NODEV),
            ("/dev", MountFlags::NOSUID | MountFlags::NOEXEC),
        ] {
            mount_remount(path, MountFlags::RDONLY | flags, "")
                .map_err(|e| self.fail(format!("make {path} read-only"))(e.into()))?;
        }
        Ok(())
    }
}

/// Builds the view and makes it this process's root (and that of its mount namespace). Must run
/// in a mount namespace of its own, as the PID 1 of the box's PID namespace.
pub(super) fn enter(view: &View<'_>) -> Result<()> {
    let b = Builder {
        view,
        root: view.box_dir.join("rootfs"),
    };
    // Nothing mounted here may reach the host's namespace.
    mount_change(
        "/",
        MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
    )
    .map_err(|e| b.fail("make mounts private")(e.into()))?;
    b.mkdir(&b.root, 0o700)?;
    b.tmpfs(
        &b.root,
        MountFlags::NOSUID | MountFlags::NODEV,
        "mode=0755,size=4m",
    )?;
    b.system()?;
    b.etc()?;
    b.dev()?;
    b.proc_run_tmp()?;
    b.box_dir()?;
    b.shares()?;
    b.pivot()
}

/// `/etc/passwd` cut down to the kept users and `user`; also the gids they use.
pub(super) fn filter_passwd(text: &str, user: &str) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut gids = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        let [name, _, _, gid, ..] = fields.as_slice() else {
            continue;
        };
        if *name == user || KEPT_USERS.contains(name) {
            out.push_str(line);
            out.push('\n');
            gids.push((*gid).to_owned());
        }
    }
    (out, gids)
}

/// `/etc/group` cut down to the kept groups and those with a gid in `gids`; member lists keep
/// only the kept users and `user`.
pub(super) fn filter_group(text: &str, gids: &[String], user: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        let [name, password, gid, members] = fields.as_slice() else {
            continue;
        };
        if !(KEPT_GROUPS.contains(name) || gids.iter().any(|g| g == gid)) {
            continue;
        }
        let members: Vec<&str> = members
            .split(',')
            .filter(|m| !m.is_empty() && (*m == user || KEPT_USERS.contains(m)))
            .collect();
        out.push_str(&format!("{name}:{password}:{gid}:{}\n", members.join(",")));
    }
    out
}

/// The gid of the `tty` group (5 on Debian when the file does not say).
fn tty_gid(group: &str) -> String {
    group
        .lines()
        .find_map(|l| l.strip_prefix("tty:"))
        .and_then(|rest| rest.split(':').nth(1))
        .filter(|gid| !gid.is_empty())
        .unwrap_or("5")
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        alice:x:1000:1000:Alice:/home/alice:/bin/bash\n\
        sshd:x:102:65534::/run/sshd:/usr/sbin/nologin\n\
        skf-abc:x:998:997::/var/lib/skiff/boxes/lbx_abc/home:/bin/bash\n\
        skf-other:x:997:996::/var/lib/skiff/boxes/lbx_other/home:/bin/bash\n\
        nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";

    const GROUP: &str = "root:x:0:\n\
        tty:x:5:alice\n\
        sudo:x:27:alice\n\
        alice:x:1000:\n\
        skf-abc:x:997:\n\
        skf-other:x:996:\n\
        nogroup:x:65534:skf-abc,skf-other\n";

    #[test]
    fn passwd_keeps_root_nobody_sshd_and_the_box_user_only() {
        let (text, gids) = filter_passwd(PASSWD, "skf-abc");
        let names: Vec<&str> = text.lines().map(|l| l.split(':').next().unwrap()).collect();
        assert_eq!(names, ["root", "sshd", "skf-abc", "nobody"]);
        assert!(text.contains("/var/lib/skiff/boxes/lbx_abc/home"));
        assert_eq!(gids, ["0", "65534", "997", "65534"]);
    }

    #[test]
    fn group_keeps_the_kept_groups_and_no_other_member() {
        let (_, gids) = filter_passwd(PASSWD, "skf-abc");
        let text = filter_group(GROUP, &gids, "skf-abc");
        assert_eq!(
            text,
            "root:x:0:\ntty:x:5:\nskf-abc:x:997:\nnogroup:x:65534:skf-abc\n"
        );
    }

    #[test]
    fn tty_gid_comes_from_the_group_file() {
        assert_eq!(tty_gid(GROUP), "5");
        assert_eq!(tty_gid("tty:x:42:\n"), "42");
        assert_eq!(tty_gid(""), "5");
    }
}
