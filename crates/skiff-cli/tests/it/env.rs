//! Environments end to end: real sshd boxes (loopback and network namespaces), the real ssh
//! client with pinned keys, the lease-CLI contract through `skiff box`, crash adoption, the
//! orphan sweep and staged destroy.

use crate::harness::{Gateway, SKIFF, stderr, stdout};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A directory for local boxes that box users can reach (0711 under /tmp). Dropping it tears
/// down whatever a failed test left behind.
pub struct BoxRoot {
    dir: tempfile::TempDir,
}

impl BoxRoot {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("skiff-boxes-")
            .tempdir_in("/tmp")
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        BoxRoot { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The boxes under the root (none once the root is gone: the last destroy removes it).
    pub fn boxes(&self) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(self.path()) else {
            return Vec::new();
        };
        let mut ids: Vec<String> = dir
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        ids.sort();
        ids
    }

    /// sshd processes started from this root's configs.
    pub fn sshd_count(&self) -> usize {
        let root = self.path().display().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains("sshd") && c.contains(&root) && !c.contains("ip netns"))
            .count()
    }
}

impl Drop for BoxRoot {
    fn drop(&mut self) {
        let boxes =
            skiff_providers::local::Boxes::new(self.path().to_path_buf(), PathBuf::from(SKIFF));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for id in self.boxes() {
            let _ = rt.block_on(boxes.destroy(&id));
        }
    }
}

/// The host's pid of the process that a box's own PID namespace calls `inside`, among those
/// whose command line contains every one of `needles` (boxes of tests running side by side
/// have colliding pids of their own).
pub fn host_pid(inside: i64, needles: &[&str]) -> i32 {
    let found: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let ns: Vec<&str> = status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))?
                .split_whitespace()
                .collect();
            let cmd = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?)
                .into_owned();
            (ns.len() > 1
                && ns.last() == Some(&inside.to_string().as_str())
                && needles.iter().all(|n| cmd.contains(n)))
            .then_some(pid)
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "processes called {inside} in a box with {needles:?}: {found:?}"
    );
    found[0]
}

/// A lease id no other run of these tests uses (box users and namespaces are host-wide).
fn fresh_lease_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let hash = blake3::hash(format!("{nanos}-{}", std::process::id()).as_bytes()).to_hex();
    format!("cbx_{}", &hash[..12])
}

/// Leases a loopback box with `skiff box`, without any gateway knowing of it.
fn warmup_behind_the_gateway(root: &BoxRoot, lease_id: &str) -> std::process::Output {
    let out = Command::new(SKIFF)
        .args([
            "box",
            "--root",
            root.path().to_str().unwrap(),
            "warmup",
            "--lease-id",
            lease_id,
        ])
        .args(["--isolation", "none", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    out
}

pub fn profiles(root: &BoxRoot) -> String {
    let r = root.path().display();
    format!(
        "[profiles.local]\nprovider = \"local\"\nroot = \"{r}\"\n\
         [profiles.plain]\nprovider = \"local\"\nisolation = \"none\"\nroot = \"{r}\"\n\
         [profiles.cloud]\nprovider = \"command\"\ncommand = [\"{SKIFF}\", \"box\", \"--root\", \"{r}\"]\n"
    )
}

pub fn create(gw: &Gateway, profile: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["env", "create", "--profile", profile, "--json"];
    args.extend_from_slice(extra);
    let out = gw.run(&args);
    assert!(
        out.status.success(),
        "env create --profile {profile}: {}",
        stderr(&out)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

pub fn exec(gw: &Gateway, id: &str, command: &str) -> String {
    let out = gw.run(&["env", "exec", id, "--", command]);
    assert!(out.status.success(), "env exec {command}: {}", stderr(&out));
    stdout(&out)
}

fn audit_decisions(gw: &Gateway, action: &str) -> Vec<String> {
    let store = gw.store();
    store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == action)
        .map(|r| r.decision)
        .collect()
}

pub fn user_exists(name: &str) -> bool {
    Command::new("id")
        .arg(name)
        .output()
        .unwrap()
        .status
        .success()
}

fn netns_list() -> String {
    stdout(&Command::new("ip").args(["netns", "list"]).output().unwrap())
}

pub fn destroy(gw: &Gateway, id: &str) -> serde_json::Value {
    let out = gw.run(&["env", "destroy", id, "--json"]);
    assert!(out.status.success(), "env destroy: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn local_box_lifecycle(profile: &str) {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, profile, &[]);
    let id = env["id"].as_str().unwrap().to_owned();
    assert_eq!(env["state"], "idle", "{env}");
    assert_eq!(env["development_only"], false, "root gets isolated boxes");
    let lease = env["lease_id"].as_str().unwrap().to_owned();
    assert_eq!(root.boxes(), std::slice::from_ref(&lease));
    assert_eq!(root.sshd_count(), 1);
    // The readiness probe's worker endpoint closed with it: no session is attached.
    let socket = gw.state_dir.join("workers").join(format!("{id}.sock"));
    assert!(!socket.exists(), "the probe left {}", socket.display());

    // The box runs as a user of its own, and the installed bundle is the gateway's build.
    let box_user = exec(&gw, &id, "id -un").trim().to_owned();
    assert!(box_user.starts_with("skf-"), "{box_user}");
    let hash = env["bundle_hash"].as_str().unwrap();
    let local_hash = stdout(&Command::new(SKIFF).arg("--build-hash").output().unwrap());
    assert_eq!(hash, local_hash.trim());
    let remote_hash = exec(
        &gw,
        &id,
        &format!("$HOME/.skiff/bundles/{hash}/skiff --build-hash"),
    );
    assert_eq!(remote_hash.trim(), hash);
    // The box sees nothing of the gateway's: not its state dir (not even that it exists), not
    // its environment.
    let probe = exec(
        &gw,
        &id,
        &format!("ls {} 2>&1; env", gw.state_dir.display()),
    );
    assert!(probe.contains("No such file or directory"), "{probe}");
    assert!(
        !probe.contains("SKIFF_") && !probe.contains("_KEY="),
        "{probe}"
    );

    // Warm: the same box is handed out again and the copy is skipped.
    let again = create(&gw, profile, &["--reuse"]);
    assert_eq!(again["id"], env["id"]);
    assert_eq!(
        audit_decisions(&gw, "bundle.install"),
        ["copied", "skipped"]
    );

    let gone = destroy(&gw, &id);
    assert_eq!(gone["state"], "destroyed");
    assert!(root.boxes().is_empty(), "the box directory survived");
    assert!(!root.path().exists(), "the emptied box root survived");
    assert_eq!(root.sshd_count(), 0, "an sshd survived");
    let root_path = root.path().display().to_string();
    assert_eq!(
        crate::worker_faults::pids_with(&["sandbox-init", &root_path]),
        Vec::<i32>::new(),
        "the sandbox init survived"
    );
    assert!(!user_exists(&box_user), "the box user survived");
    assert!(!netns_list().contains(&lease), "the namespace survived");
}

#[test]
fn a_loopback_box_is_provisioned_bootstrapped_reused_and_destroyed() {
    local_box_lifecycle("plain");
}

#[test]
fn a_netns_box_has_only_loopback_and_no_route() {
    local_box_lifecycle("local");
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, "local", &[]);
    let id = env["id"].as_str().unwrap();
    let links = exec(&gw, id, "/usr/sbin/ip -o link show");
    let names: Vec<&str> = links
        .lines()
        .map(|l| l.split(':').nth(1).unwrap().trim())
        .collect();
    assert_eq!(names, ["lo"], "{links}");
    let routes = exec(
        &gw,
        id,
        "/usr/sbin/ip -4 route show; /usr/sbin/ip -6 route show | grep -v '^::1 ' || true",
    );
    assert_eq!(routes.trim(), "", "the box has a route: {routes}");
    destroy(&gw, id);
}

#[test]
fn the_command_provider_drives_a_lease_cli() {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, "cloud", &[]);
    let id = env["id"].as_str().unwrap();
    let lease = env["lease_id"].as_str().unwrap();
    assert!(skiff_protocol::lease::is_lease_cli_id(lease), "{lease}");
    let listed = Command::new(SKIFF)
        .args([
            "box",
            "--root",
            root.path().to_str().unwrap(),
            "list",
            "--json",
        ])
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed[0]["id"], lease);
    assert_eq!(listed[0]["state"], "running");
    assert_eq!(
        exec(&gw, id, "echo hello from the box").trim(),
        "hello from the box"
    );
    assert_eq!(destroy(&gw, id)["state"], "destroyed");
    assert!(root.boxes().is_empty());
}

#[test]
fn the_ssh_provider_reaches_a_static_host_and_says_it_is_for_development() {
    let root = BoxRoot::new();
    let beef = fresh_lease_id();
    let out = warmup_behind_the_gateway(&root, &beef);
    let host: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lab = format!(
        "[profiles.lab]\nprovider = \"ssh\"\nhost = \"127.0.0.1\"\nport = {}\nuser = \"{}\"\nidentity_file = \"{}\"\nknown_host_key = \"{}\"\n",
        host["sshPort"],
        host["sshUser"].as_str().unwrap(),
        host["sshKey"].as_str().unwrap(),
        host["sshHostKey"].as_str().unwrap()
    );
    let gw = Gateway::start_with("", &lab);
    let env = create(&gw, "lab", &[]);
    assert_eq!(env["state"], "idle");
    assert_eq!(env["development_only"], true);
    let listing = stdout(&gw.run(&["env", "list"]));
    assert!(listing.contains("development only"), "{listing}");
    let id = env["id"].as_str().unwrap();
    assert_eq!(
        exec(&gw, id, "whoami").trim(),
        host["sshUser"].as_str().unwrap()
    );
    assert_eq!(destroy(&gw, id)["state"], "destroyed");
    // A static host is not ours to tear down.
    assert_eq!(root.boxes(), [beef]);
}

#[test]
fn an_orphaned_lease_is_swept() {
    let root = BoxRoot::new();
    let orphan = fresh_lease_id();
    let gw = Gateway::start_with("", &profiles(&root));
    let kept = create(&gw, "cloud", &[]);
    warmup_behind_the_gateway(&root, &orphan);
    assert_eq!(root.boxes().len(), 2);
    // Swept by an admin who is not the first: no row owns the lease, so the audit names who
    // asked, never the first admin.
    let out = gw.run(&[
        "admin",
        "user",
        "add",
        "ada@example.test",
        "--role",
        "admin",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = gw.run(&[
        "admin",
        "token",
        "create",
        "--user",
        "ada@example.test",
        "--scope",
        "admin",
        "--expires",
        "1d",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ada = stdout(&out).trim().to_owned();
    let out = gw
        .cli()
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", &ada)
        .args(["env", "sweep", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let swept: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(swept["destroyed"], serde_json::json!([&orphan]));
    assert_eq!(
        root.boxes(),
        [kept["lease_id"].as_str().unwrap().to_owned()],
        "the owned lease must survive the sweep"
    );
    assert_eq!(audit_decisions(&gw, "provider.sweep"), ["destroyed"]);
    let users = gw.json(&["--json", "admin", "user", "list"]);
    let ada_id = users["users"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["email"] == "ada@example.test")
        .unwrap()["id"]
        .clone();
    let store = gw.store();
    let owners: Vec<String> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "provider.sweep")
        .map(|r| r.owner_id)
        .collect();
    assert_eq!(owners, [ada_id.as_str().unwrap()]);
}

/// Kills the box's process (its sandbox init: the whole box goes with it).
fn kill_box(box_dir: &Path) {
    let pid = std::fs::read_to_string(box_dir.join("box.pid")).unwrap();
    assert!(
        Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .unwrap()
            .success()
    );
}

/// Gives the box's sshd a new host key (sshd reloads on SIGHUP) and waits until it serves it.
pub fn change_host_key(box_dir: &Path, port: u64) {
    for f in ["ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"] {
        std::fs::remove_file(box_dir.join("etc").join(f)).unwrap();
    }
    let key = box_dir.join("etc/ssh_host_ed25519_key");
    assert!(
        Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(&key)
            .status()
            .unwrap()
            .success()
    );
    let new_key = std::fs::read_to_string(box_dir.join("etc/ssh_host_ed25519_key.pub")).unwrap();
    let new_key: Vec<&str> = new_key.split_whitespace().take(2).collect();
    let config = format!("{}/etc/sshd_config", box_dir.display());
    let sshd = crate::worker_faults::pids_with(&["/usr/sbin/sshd -D", &config]);
    assert_eq!(sshd.len(), 1, "the box's sshd: {sshd:?}");
    assert!(
        Command::new("kill")
            .args(["-HUP", &sshd[0].to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let scan = Command::new("ssh-keyscan")
            .args(["-t", "ed25519", "-p", &port.to_string(), "127.0.0.1"])
            .output()
            .unwrap();
        if stdout(&scan).contains(&new_key.join(" ")) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "sshd never served its new host key"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn a_changed_host_key_is_refused_and_fails_the_environment() {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, "plain", &[]);
    let id = env["id"].as_str().unwrap();
    let lease = env["lease_id"].as_str().unwrap();
    let box_dir = root.path().join(lease);
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(box_dir.join("box.json")).unwrap()).unwrap();
    change_host_key(&box_dir, record["port"].as_u64().unwrap());
    let out = gw.run(&["env", "check", id, "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let checked: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(checked["state"], "failed");
    assert!(
        checked["error"].as_str().unwrap().contains("host key"),
        "{checked}"
    );
    assert_eq!(destroy(&gw, id)["state"], "destroyed");
}

#[test]
fn a_box_whose_sshd_died_fails_and_still_destroys() {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, "plain", &[]);
    let id = env["id"].as_str().unwrap();
    kill_box(&root.path().join(env["lease_id"].as_str().unwrap()));
    let out = gw.run(&["env", "check", id, "--json"]);
    let checked: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(checked["state"], "failed", "{checked}");
    assert_eq!(destroy(&gw, id)["state"], "destroyed");
    assert!(root.boxes().is_empty());
}

#[test]
fn a_gateway_killed_mid_provision_adopts_the_lease_on_restart() {
    let root = BoxRoot::new();
    let scratch = tempfile::tempdir().unwrap();
    let started = scratch.path().join("started");
    let release = scratch.path().join("release");
    for fifo in [&started, &release] {
        assert!(Command::new("mkfifo").arg(fifo).status().unwrap().success());
    }
    // A lease CLI that leases the box, then (the first time only) stalls before answering.
    let wrapper = scratch.path().join("slow-lease-cli");
    std::fs::write(
        &wrapper,
        format!(
            "#!/usr/bin/env bash\nset -e\nout=$(\"{SKIFF}\" box --root \"{root}\" \"$@\")\n\
             if [ \"$1\" = warmup ] && [ ! -e \"{once}\" ]; then touch \"{once}\"; echo > \"{started}\"; read -r _ < \"{release}\"; fi\n\
             printf '%s\\n' \"$out\"\n",
            root = root.path().display(),
            once = scratch.path().join("once").display(),
            started = started.display(),
            release = release.display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = format!(
        "[profiles.slow]\nprovider = \"command\"\ncommand = [\"{}\"]\n",
        wrapper.display()
    );
    let mut gw = Gateway::start_with("", &config);

    let mut create = gw
        .cli()
        .args(["env", "create", "--profile", "slow", "--json"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The box exists and the lease CLI is mid-answer: now the gateway dies.
    std::fs::read(&started).unwrap();
    assert_eq!(root.boxes().len(), 1);
    gw.crash_and_restart();
    let _ = create.kill();
    let _ = create.wait();
    // Let the stalled lease CLI of the dead gateway finish; its answer goes nowhere.
    std::fs::write(&release, "\n").unwrap();

    let list = gw.json(&["env", "list", "--json"]);
    let envs = list["environments"].as_array().unwrap();
    assert_eq!(envs.len(), 1);
    assert_eq!(envs[0]["state"], "idle", "{}", envs[0]);
    assert_eq!(
        root.boxes(),
        [envs[0]["lease_id"].as_str().unwrap().to_owned()],
        "a second box was leased"
    );
    assert_eq!(root.sshd_count(), 1, "an orphaned sshd exists");
    assert_eq!(
        destroy(&gw, envs[0]["id"].as_str().unwrap())["state"],
        "destroyed"
    );
}

#[test]
fn a_lease_cli_that_fails_or_prints_garbage_fails_the_environment_with_its_words() {
    let config = "[profiles.garbage]\nprovider = \"command\"\ncommand = [\"sh\", \"-c\", \"echo this-is-not-json\", \"lease-cli\"]\n\
                  [profiles.broken]\nprovider = \"command\"\ncommand = [\"sh\", \"-c\", \"echo quota exceeded for project >&2; exit 3\", \"lease-cli\"]\n";
    let gw = Gateway::start_with("", config);
    for (profile, words) in [
        ("garbage", "this-is-not-json"),
        ("broken", "quota exceeded for project"),
    ] {
        let out = gw.run(&["env", "create", "--profile", profile, "--json"]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        let env: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(env["state"], "failed");
        assert!(env["error"].as_str().unwrap().contains(words), "{env}");
        assert!(
            env["lease_id"].is_null(),
            "a lease was recorded from a failed command: {env}"
        );
    }
}

#[test]
fn an_idle_environment_is_reclaimed_after_its_idle_timeout() {
    let root = BoxRoot::new();
    let config = format!(
        "[gateway]\nlifetime_tick = \"100ms\"\n[profiles.brief]\nprovider = \"local\"\nisolation = \"none\"\nidle_timeout = \"1s\"\nroot = \"{}\"\n",
        root.path().display()
    );
    let gw = Gateway::start_with("", &config);
    let env = create(&gw, "brief", &[]);
    let id = env["id"].as_str().unwrap();
    let out = gw.run(&[
        "env",
        "wait",
        id,
        "--for",
        "destroyed",
        "--timeout",
        "60s",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(root.boxes().is_empty(), "the reclaimed box is still there");
    assert_eq!(audit_decisions(&gw, "provider.destroy"), ["ok"]);
}

#[test]
fn env_exec_keeps_the_boundaries_of_its_arguments() {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, "plain", &[]);
    let id = env["id"].as_str().unwrap();
    let run = |args: &[&str]| {
        let out = gw.run(&[&["env", "exec", id, "--"], args].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(run(&["bash", "-lc", "echo one; echo two"]), "one\ntwo\n");
    assert_eq!(run(&["printf", "%s|", "a b", "it's", ""]), "a b|it's||");
    // One argument is a whole command line, as before.
    assert_eq!(run(&["echo one | tr o 0"]), "0ne\n");
    assert_eq!(destroy(&gw, id)["state"], "destroyed");
}

/// A box a gateway leased and then left behind (the gateway killed and never restarted) shows in
/// `skiff box list` and ends with `skiff box stop lbx_…`: an operator needs no gateway for it.
#[test]
fn a_box_a_dead_gateway_left_behind_is_stopped_with_skiff_box() {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root));
    let env = create(&gw, "local", &[]);
    let lease = env["lease_id"].as_str().unwrap().to_owned();
    assert!(lease.starts_with("lbx_"), "{lease}");
    drop(gw);
    let skiff_box = |args: &[&str]| {
        Command::new(SKIFF)
            .args(["box", "--root", root.path().to_str().unwrap()])
            .args(args)
            .output()
            .unwrap()
    };
    let listed = skiff_box(&["list", "--json"]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed[0]["id"], lease.as_str(), "{listed}");

    let refused = skiff_box(&["stop", "lbx_nothex"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("is not `cbx_` or `lbx_` followed by 12 lowercase hex"),
        "{}",
        stderr(&refused)
    );
    let stopped = skiff_box(&["stop", &lease]);
    assert!(stopped.status.success(), "{}", stderr(&stopped));
    assert!(root.boxes().is_empty(), "the box directory survived");
    assert_eq!(root.sshd_count(), 0, "an sshd survived");
    assert_eq!(
        crate::worker_faults::pids_with(&["sandbox-init", &root.path().display().to_string()]),
        Vec::<i32>::new(),
        "the sandbox init survived"
    );
}
