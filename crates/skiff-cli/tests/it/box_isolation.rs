//! A local box is a sandbox (DESIGN §7, invariant 5): from inside, the attacks that work on a
//! plain user account fail — the host's files, other users' checkouts, the gateway's state, the
//! shared `/tmp`, other processes, `/etc/shadow` — limits hold, another box is invisible, and
//! everything a worker needs still works.

use crate::env::{BoxRoot, create, destroy, exec};
use crate::harness::Gateway;
use crate::worker_faults::pids_with;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command};

/// A word no other run of these tests uses.
fn marker() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{:09}{}", nanos % 1_000_000_000, std::process::id())
}

/// A process on the host that a box must not see; killed when dropped.
struct HostProcess(Child);

impl HostProcess {
    /// `sleep` with an argument nothing else has.
    fn start(mark: &str) -> HostProcess {
        HostProcess(
            Command::new("sleep")
                .arg(format!("3600.{mark}"))
                .spawn()
                .unwrap(),
        )
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until a process whose command line holds `needle` shows on the host. (A new
/// process's command line can read empty for a moment after `spawn` returns: the parent resumes
/// during `execve`, before the kernel has set the new arguments up.)
fn wait_until_running(needle: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while pids_with(&[needle]).len() != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "no process with {needle} runs on the host"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A directory anyone may read, under `parent` (a host path no box should see).
fn readable_dir(parent: &str, prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn write_readable(path: &std::path::Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    for dir in path.ancestors().skip(1).take(2) {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

fn limited_profile(root: &BoxRoot) -> String {
    format!(
        "[profiles.sandboxed]\nprovider = \"local\"\nisolation = \"netns\"\nroot = \"{}\"\n\
         [profiles.sandboxed.limits]\nprocesses = 300\nopen_files = 1000\nfile_size = \"1GiB\"\nmemory = \"6GiB\"\n",
        root.path().display()
    )
}

#[test]
fn from_inside_a_box_the_host_the_gateway_and_other_users_are_out_of_reach() {
    let mark = marker();
    // What a box must not reach: root's files, another user's live checkout with a token in
    // its remote URL, the gateway's state, a host process.
    let root_dir = readable_dir("/root", "skiff-isolation-");
    let root_secret = root_dir.path().join("secret.txt");
    write_readable(&root_secret, &format!("root-secret-{mark}\n"));
    let home_dir = readable_dir("/home", "skiff-other-user-");
    let git_config = home_dir.path().join("checkout/.git/config");
    write_readable(
        &git_config,
        &format!(
            "[remote \"origin\"]\n\turl = https://x-access-token:ghp_{mark}@github.com/acme/app.git\n"
        ),
    );
    let _host_sleep = HostProcess::start(&mark);
    wait_until_running(&format!("3600.{mark}"));

    let boxes = BoxRoot::new();
    let gw = Gateway::start_with("", &limited_profile(&boxes));
    let env = create(&gw, "sandboxed", &[]);
    let id = env["id"].as_str().unwrap();
    assert_eq!(env["development_only"], false);
    let state = gw.state_dir.display().to_string();
    let tmp_file = format!("/tmp/skiff-box-wrote-{mark}");

    let probe = exec(
        &gw,
        id,
        &format!(
            "cat {root_secret} 2>&1; cat {git_config} 2>&1; ls -a /home /root 2>&1; \
             ls {state} 2>&1; cat {state}/gateway.json 2>&1; cat /etc/shadow 2>&1; \
             echo box > {tmp_file} && echo wrote-tmp; ps ax; \
             cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]' ",
            root_secret = root_secret.display(),
            git_config = git_config.display(),
        ),
    );
    assert!(!probe.contains(&format!("root-secret-{mark}")), "{probe}");
    assert!(!probe.contains(&format!("ghp_{mark}")), "{probe}");
    assert!(!probe.contains(&gw.token), "{probe}");
    assert!(!probe.contains(&format!("3600.{mark}")), "{probe}");
    for path in [
        root_secret.display().to_string(),
        git_config.display().to_string(),
        "/home".into(),
        "/root".into(),
        state.clone(),
    ] {
        assert!(
            probe.contains(&format!("{path}': No such file or directory"))
                || probe.contains(&format!("{path}: No such file or directory")),
            "{path} is visible in the box: {probe}"
        );
    }
    assert!(probe.contains("/etc/shadow: Permission denied"), "{probe}");
    // The box writes its own /tmp; the host's has nothing of it.
    assert!(probe.contains("wrote-tmp"), "{probe}");
    assert!(
        !std::path::Path::new(&tmp_file).exists(),
        "a box wrote the host's /tmp"
    );
    // Its processes are its own: PID 1 is its sandbox's init, and few others exist.
    let count: usize = probe.lines().last().unwrap().trim().parse().unwrap();
    assert!(count < 20, "the box sees {count} processes: {probe}");
    let first = probe
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_default();
    assert!(first.contains("sandbox-init"), "{probe}");

    // The configured limits hold, soft and hard.
    let limits = exec(
        &gw,
        id,
        "ulimit -u; ulimit -n; ulimit -f; ulimit -v; ulimit -Hu; ulimit -n 2000 2>&1 || true",
    );
    let lines: Vec<&str> = limits.lines().collect();
    assert_eq!(
        &lines[..5],
        ["300", "1000", "1048576", "6291456", "300"],
        "{limits}"
    );
    assert!(lines[5].contains("Operation not permitted"), "{limits}");
    // A fork loop stops at the process limit, and the box answers afterwards.
    let forks = exec(
        &gw,
        id,
        "sh -c 'i=0; while [ $i -lt 400 ]; do sleep 30 >/dev/null 2>&1 & i=$((i+1)); done' 2>&1 | \
         grep -c -i 'cannot fork'; pkill -u $(id -u) sleep; true",
    );
    assert!(
        forks.trim().parse::<u32>().unwrap() > 0,
        "400 processes started under a limit of 300: {forks}"
    );
    assert_eq!(exec(&gw, id, "echo still here").trim(), "still here");

    assert_eq!(destroy(&gw, id)["state"], "destroyed");
}

#[test]
fn two_boxes_see_neither_each_others_files_nor_processes() {
    let boxes = BoxRoot::new();
    let gw = Gateway::start_with("", &limited_profile(&boxes));
    let a = create(&gw, "sandboxed", &[]);
    let b = create(&gw, "sandboxed", &[]);
    let mark = marker();
    let mut homes = Vec::new();
    // Distinct numbers: `sleep` takes nothing else.
    let tag = |name: &str| if name == "a" { 1 } else { 2 };
    for (env, name) in [(&a, "a"), (&b, "b")] {
        let id = env["id"].as_str().unwrap();
        let home = boxes
            .path()
            .join(env["lease_id"].as_str().unwrap())
            .join("home");
        // A file in its workspace and a process that outlives the command.
        exec(
            &gw,
            id,
            &format!(
                "echo {name}-secret-{mark} > ~/workspace/secret; \
                 setsid sleep 3600.{mark}{tag} </dev/null >/dev/null 2>&1 &",
                tag = tag(name)
            ),
        );
        assert!(home.join("workspace/secret").exists());
        homes.push(home);
    }
    for name in ["a", "b"] {
        wait_until_running(&format!("3600.{mark}{}", tag(name)));
    }
    for (env, me, other, other_home) in [(&a, "a", "b", &homes[1]), (&b, "b", "a", &homes[0])] {
        let id = env["id"].as_str().unwrap();
        let other_dir = other_home.parent().unwrap();
        let seen = exec(
            &gw,
            id,
            &format!(
                "ls {dir} 2>&1; cat {home}/workspace/secret 2>&1; ls {root} 2>&1; ps ax; \
                 cat ~/workspace/secret",
                dir = other_dir.display(),
                home = other_home.display(),
                root = boxes.path().display(),
            ),
        );
        assert!(
            seen.contains(&format!(
                "{}: No such file or directory",
                other_dir.display()
            )) || seen.contains(&format!(
                "{}': No such file or directory",
                other_dir.display()
            )),
            "box {me} sees box {other}'s directory: {seen}"
        );
        assert!(
            !seen.contains(&format!("{other}-secret-{mark}")),
            "box {me} read box {other}'s workspace: {seen}"
        );
        assert!(
            !seen.contains(&format!("3600.{mark}{}", tag(other))),
            "box {me} sees box {other}'s process: {seen}"
        );
        // Its own are there.
        assert!(seen.contains(&format!("{me}-secret-{mark}")), "{seen}");
        assert!(seen.contains(&format!("3600.{mark}{}", tag(me))), "{seen}");
    }
    for env in [&a, &b] {
        assert_eq!(
            destroy(&gw, env["id"].as_str().unwrap())["state"],
            "destroyed"
        );
    }
    assert!(
        pids_with(&[&format!("3600.{mark}")]).is_empty(),
        "a box's process outlived its box"
    );
}

#[test]
fn a_sandboxed_box_still_runs_what_a_worker_needs() {
    let boxes = BoxRoot::new();
    let gw = Gateway::start_with("", &limited_profile(&boxes));
    let env = create(&gw, "sandboxed", &[]);
    let id = env["id"].as_str().unwrap();
    let tools = exec(
        &gw,
        id,
        "git --version; rsync --version | head -n 1; awk 'BEGIN { print 6 * 7 }'; \
         id -un; echo $HOME; ls /dev/null /dev/urandom /dev/ptmx",
    );
    assert!(tools.contains("git version"), "{tools}");
    assert!(tools.contains("rsync  version"), "{tools}");
    assert!(tools.lines().any(|l| l == "42"), "{tools}");
    assert!(tools.contains("skf-"), "{tools}");
    let lease = env["lease_id"].as_str().unwrap();
    assert!(tools.contains(&format!("{lease}/home")), "{tools}");
    // The workspace is the box's own directory on the host: what one command writes, the next
    // one reads.
    exec(&gw, id, "echo kept > ~/workspace/notes.txt");
    assert_eq!(exec(&gw, id, "cat ~/workspace/notes.txt").trim(), "kept");
    // A pseudo-terminal can be allocated (sshd's own devpts instance).
    let pty = exec(&gw, id, "script -qc tty /dev/null");
    assert!(pty.contains("/dev/pts/"), "{pty}");
    assert_eq!(destroy(&gw, id)["state"], "destroyed");
}

/// A descriptor the gateway inherited without `FD_CLOEXEC` (as under `flock LOCK cargo test`,
/// or from a service manager) is not held by the box's init, which lives as long as the box: it
/// would keep a lock for ever and give the box a handle on a host file.
#[test]
fn a_box_holds_no_descriptor_its_gateway_inherited() {
    let boxes = BoxRoot::new();
    let held = tempfile::NamedTempFile::new().unwrap();
    rustix::io::fcntl_setfd(held.as_file(), rustix::io::FdFlags::empty()).unwrap();
    let gw = Gateway::start_with("", &limited_profile(&boxes));
    let env = create(&gw, "sandboxed", &[]);
    let holders = |pid: &str| -> bool {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .any(|target| target == held.path())
    };
    // The gateway itself holds it (its pid is in its lock file): else this proves nothing.
    let gateway_pid = std::fs::read_to_string(gw.state_dir.join("gateway.lock")).unwrap();
    assert!(
        holders(gateway_pid.trim()),
        "the gateway did not inherit the descriptor"
    );
    let box_dir = boxes.path().join(env["lease_id"].as_str().unwrap());
    let init = std::fs::read_to_string(box_dir.join("box.pid")).unwrap();
    assert!(
        !holders(init.trim()),
        "the box's init holds a descriptor the gateway inherited"
    );
    assert_eq!(
        destroy(&gw, env["id"].as_str().unwrap())["state"],
        "destroyed"
    );
}
