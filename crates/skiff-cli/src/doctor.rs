//! `skiff doctor`: checks this machine for what the gateway and its local worker boxes need,
//! and says for each missing piece which Debian package brings it. It only reads and probes:
//! it installs nothing and changes no setting. The check results never leave this process, so
//! they are plain CLI types, not `skiff-protocol` ones.

use anyhow::Result;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Where box sandboxes start sshd from (an absolute path: the box's sshd is not looked up on
/// anyone's PATH).
const SSHD: &str = "/usr/sbin/sshd";

/// One line of the report.
struct Check {
    check: &'static str,
    ok: bool,
    /// A failed optional check is a warning (`!`) and does not fail the command.
    required: bool,
    detail: String,
    /// What to run to fix it, when it failed.
    fix: Option<String>,
}

impl Check {
    fn mark(&self) -> &'static str {
        match (self.ok, self.required) {
            (true, _) => "✓",
            (false, true) => "✗",
            (false, false) => "!",
        }
    }
}

/// Runs every check, prints the report, and exits 1 when a required check failed.
pub async fn run(json: bool) -> Result<ExitCode> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let find = |tool: &str| which(tool, &path);
    let mut checks = vec![root()];
    checks.push(file_check(
        "sshd",
        Path::new(SSHD).to_path_buf(),
        is_executable(Path::new(SSHD)),
        "openssh-server",
        "each box runs its own sshd",
    ));
    for (tool, package, why) in [
        (
            "ssh",
            "openssh-client",
            "the gateway reaches boxes over SSH",
        ),
        ("rsync", "rsync", "workspaces travel to and from boxes"),
        ("git", "git", "sessions work in git worktrees"),
        ("ip", "iproute2", "boxes get network namespaces"),
        ("useradd", "passwd", "boxes get users of their own"),
        (
            "unshare",
            "util-linux",
            "boxes get mount and PID namespaces",
        ),
        (
            "setpriv",
            "util-linux",
            "box commands drop to the box's user",
        ),
    ] {
        checks.push(tool_check(tool, find(tool), package, why));
    }
    checks.push(user_namespaces(find("unshare"), find("setpriv")).await);
    checks.push(cgroup_v2());
    let mut python = tool_check(
        "python3",
        find("python3"),
        "python3",
        "optional: sample repositories and setup scripts that use it",
    );
    python.required = false;
    checks.push(python);

    let failed: Vec<&Check> = checks.iter().filter(|c| !c.ok && c.required).collect();
    if json {
        let list: Vec<serde_json::Value> = checks
            .iter()
            .map(|c| {
                serde_json::json!({
                    "check": c.check,
                    "ok": c.ok,
                    "required": c.required,
                    "detail": c.detail,
                    "fix": c.fix,
                })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&list)?)?;
    } else {
        let width = checks.iter().map(|c| c.check.len()).max().unwrap_or(0);
        for c in &checks {
            let fix = match (&c.fix, c.ok) {
                (Some(fix), false) => format!(" — fix: {fix}"),
                _ => String::new(),
            };
            outln!("{} {:<width$}  {}{fix}", c.mark(), c.check, c.detail)?;
        }
        if failed.is_empty() {
            outln!("\nready: every required check passed")?;
        } else {
            let names: Vec<&str> = failed.iter().map(|c| c.check).collect();
            outln!(
                "\nnot ready: {} of {} required checks failed ({})",
                failed.len(),
                checks.iter().filter(|c| c.required).count(),
                names.join(", ")
            )?;
            // One package can fix several checks (util-linux: unshare, setpriv); name it once.
            let mut packages: Vec<&str> = Vec::new();
            for fix in failed.iter().filter_map(|c| c.fix.as_deref()) {
                if let Some(package) = fix.strip_prefix("apt-get install ")
                    && !packages.contains(&package)
                {
                    packages.push(package);
                }
            }
            if !packages.is_empty() {
                outln!("install: apt-get install {}", packages.join(" "))?;
            }
        }
    }
    Ok(if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn root() -> Check {
    let ok = skiff_providers::running_as_root();
    Check {
        check: "root",
        ok,
        required: true,
        detail: if ok {
            "running as root: local boxes get users and namespaces of their own".to_owned()
        } else {
            "not root: local boxes would run as you, without users or namespaces of their own"
                .to_owned()
        },
        fix: (!ok).then(|| "run the gateway (and this check) as root".to_owned()),
    }
}

fn tool_check(tool: &'static str, found: Option<PathBuf>, package: &str, why: &str) -> Check {
    match found {
        Some(path) => file_check(tool, path, true, package, why),
        None => Check {
            check: tool,
            ok: false,
            required: true,
            detail: format!("not found on PATH ({why})"),
            fix: Some(format!("apt-get install {package}")),
        },
    }
}

fn file_check(tool: &'static str, path: PathBuf, ok: bool, package: &str, why: &str) -> Check {
    Check {
        check: tool,
        ok,
        required: true,
        detail: if ok {
            path.display().to_string()
        } else {
            format!("no executable {} ({why})", path.display())
        },
        fix: (!ok).then(|| format!("apt-get install {package}")),
    }
}

/// The per-exec PID namespace of a box's user is made by that (unprivileged) user, so the
/// kernel must allow unprivileged user namespaces. As root we can ask the kernel directly by
/// trying it as `nobody`; otherwise we try it as ourselves.
async fn user_namespaces(unshare: Option<PathBuf>, setpriv: Option<PathBuf>) -> Check {
    let fix = "sysctl -w user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1 \
               (and, on Ubuntu, kernel.apparmor_restrict_unprivileged_userns=0)"
        .to_owned();
    let sysctl = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
    };
    if sysctl("/proc/sys/user/max_user_namespaces").as_deref() == Some("0")
        || sysctl("/proc/sys/kernel/unprivileged_userns_clone").as_deref() == Some("0")
    {
        return Check {
            check: "user namespaces",
            ok: false,
            required: true,
            detail: "the kernel does not allow unprivileged user namespaces".to_owned(),
            fix: Some(fix),
        };
    }
    let Some(unshare) = unshare else {
        return Check {
            check: "user namespaces",
            ok: false,
            required: true,
            detail: "cannot try them without unshare".to_owned(),
            fix: Some("apt-get install util-linux".to_owned()),
        };
    };
    let probe = match (skiff_providers::running_as_root(), setpriv) {
        (true, Some(setpriv)) => skiff_process::Cmd::new(setpriv.display().to_string())
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(unshare),
        _ => skiff_process::Cmd::new(unshare.display().to_string()),
    };
    let tried = probe
        .args(["--user", "--map-root-user", "true"])
        .timeout(Duration::from_secs(10))
        .run(&CancellationToken::new())
        .await;
    match tried {
        Ok(done) if done.code() == 0 => Check {
            check: "user namespaces",
            ok: true,
            required: true,
            detail: "an unprivileged user can make one".to_owned(),
            fix: None,
        },
        Ok(done) => Check {
            check: "user namespaces",
            ok: false,
            required: true,
            detail: format!(
                "an unprivileged user cannot make one: {}",
                done.stderr.into_string().trim()
            ),
            fix: Some(fix),
        },
        Err(e) => Check {
            check: "user namespaces",
            ok: false,
            required: true,
            detail: format!("cannot try: {e}"),
            fix: Some(fix),
        },
    }
}

/// Informational: boxes get memory and process limits from cgroup v2 where the host has it,
/// and rlimits only where it does not.
fn cgroup_v2() -> Check {
    let controllers = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers");
    let (ok, detail) = match controllers {
        Ok(text) => {
            let has = |c: &str| text.split_whitespace().any(|x| x == c);
            if has("memory") && has("pids") {
                (
                    true,
                    "memory and pids controllers: boxes get cgroup limits".to_owned(),
                )
            } else {
                (
                    false,
                    format!(
                        "cgroup v2 without memory and pids delegated (has: {}): boxes get rlimits only",
                        text.trim()
                    ),
                )
            }
        }
        Err(_) => (
            false,
            "no cgroup v2 at /sys/fs/cgroup: boxes get rlimits only".to_owned(),
        ),
    };
    Check {
        check: "cgroup v2",
        ok,
        required: false,
        detail,
        fix: (!ok).then(|| {
            "boot with systemd.unified_cgroup_hierarchy=1, or run the gateway with Delegate=yes"
                .to_owned()
        }),
    }
}

/// The first executable `tool` on `path` (as a shell would find it).
fn which(tool: &str, path: &std::ffi::OsStr) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(tool))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
