//! Snapshots of prepared boxes end to end: a box prepared by hand is snapshotted through the
//! gateway, listed, started from (a sandboxed box whose home is the copy, owned by its own
//! user), removed; the lease-CLI verbs through `skiff box`; least-recently-used eviction under
//! a small budget; a capture a crash interrupted, and snapshots nobody owns.

use crate::env::{BoxRoot, create, destroy, exec};
use crate::harness::{Gateway, SKIFF, stderr, stdout};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

/// `local` (sandboxed, own network namespace) and `cloud` (the command provider driving
/// `skiff box`, which declares the snapshot verbs) on one box root.
fn profiles(root: &BoxRoot, budget: &str) -> String {
    let r = root.path().display();
    format!(
        "[profiles.local]\nprovider = \"local\"\nroot = \"{r}\"\nsnapshot_budget = \"{budget}\"\n\
         [profiles.cloud]\nprovider = \"command\"\ncommand = [\"{SKIFF}\", \"box\", \"--root\", \"{r}\"]\n\
         snapshots = true\nsnapshot_budget = \"{budget}\"\n"
    )
}

fn take(gw: &Gateway, env: &str) -> serde_json::Value {
    gw.json(&["env", "snapshots", "take", env, "--json"])
}

fn listed(gw: &Gateway) -> Vec<String> {
    let list = gw.json(&["env", "snapshots", "--json"]);
    list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect()
}

/// What the lease CLI itself says it holds.
fn held(root: &BoxRoot) -> Vec<String> {
    let out = Command::new(SKIFF)
        .args(["box", "--root", root.path().to_str().unwrap()])
        .args(["snapshot-list", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut ids: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

#[test]
fn a_prepared_box_is_snapshotted_listed_started_from_and_removed() {
    let root = BoxRoot::new();
    let gw = Gateway::start_with("", &profiles(&root, "10GiB"));
    let prepared = create(&gw, "local", &[]);
    let prepared_id = prepared["id"].as_str().unwrap();
    // What a setup script would leave, plus a session's workspace and a FIFO.
    exec(
        &gw,
        prepared_id,
        "set -e; mkdir -p .toolchain/bin; printf ready > .toolchain/bin/tool; \
         ln -s /etc/hostname host-link; mkfifo pipe; \
         mkdir -p workspaces/ses_a; printf work > workspaces/ses_a/notes",
    );
    let first_user = exec(&gw, prepared_id, "id -un").trim().to_owned();

    let snapshot = take(&gw, prepared_id);
    let snap = snapshot["id"].as_str().unwrap().to_owned();
    assert!(snap.starts_with("snap_"), "{snapshot}");
    assert_eq!(snapshot["state"], "ready");
    assert_eq!(snapshot["profile"], "local");
    assert_eq!(snapshot["environment_id"], prepared["id"]);
    assert_eq!(snapshot["key_prefix"].as_str().unwrap().len(), 12);
    assert!(snapshot["size_bytes"].as_u64().unwrap() > 0, "{snapshot}");

    assert_eq!(listed(&gw), std::slice::from_ref(&snap));
    let table = stdout(&gw.run(&["env", "snapshots"]));
    assert!(table.starts_with("ID "), "{table}");
    let row = table.lines().find(|l| l.starts_with(&snap)).unwrap();
    assert!(
        row.contains("local") && row.contains("KiB") && row.contains("ready"),
        "{table}"
    );

    // A box started from it: its own user owns the copied home, and it is the same sandbox as
    // any other box.
    let fresh = create(&gw, "local", &["--from-snapshot", &snap]);
    assert_eq!(fresh["state"], "idle", "{fresh}");
    assert_eq!(fresh["from_snapshot"], snap.as_str());
    let fresh_id = fresh["id"].as_str().unwrap();
    let seen = exec(
        &gw,
        fresh_id,
        "id -un; stat -c %U .toolchain/bin/tool; cat .toolchain/bin/tool; echo; readlink host-link; \
         ls -A | grep -v '^\\.skiff$'",
    );
    let lines: Vec<&str> = seen.lines().collect();
    let user = lines[0];
    assert!(user.starts_with("skf-") && user != first_user, "{seen}");
    assert_eq!(
        &lines[1..],
        [
            user,
            "ready",
            "/etc/hostname",
            ".toolchain",
            "host-link",
            "workspace"
        ],
        "the new box's home"
    );
    let probe = exec(
        &gw,
        fresh_id,
        &format!(
            "ls {} /home 2>&1; /usr/sbin/ip -o link show | wc -l",
            gw.state_dir.display()
        ),
    );
    assert_eq!(
        probe.matches("No such file or directory").count(),
        2,
        "the box sees the host: {probe}"
    );
    assert!(
        probe.trim_end().ends_with('1'),
        "more than loopback: {probe}"
    );

    // Removed: from the list and from the box root.
    let out = gw.run(&["env", "snapshots", "rm", &snap]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(&format!("deleted snapshot {snap}")));
    assert!(listed(&gw).is_empty());
    assert!(!root.path().join("snapshots").join(&snap).exists());
    assert!(
        stdout(&gw.run(&["env", "snapshots"])).starts_with("no snapshots"),
        "an empty list says so"
    );

    // Unknown and malformed ids are refused with words that say so.
    let out = gw.run(&["env", "snapshots", "rm", &snap]);
    assert_eq!(out.status.code(), Some(4));
    assert!(
        stderr(&out).contains(&format!("snapshot {snap} not found")),
        "{}",
        stderr(&out)
    );
    let out = gw.run(&["env", "snapshots", "rm", "snap_nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("is not a snapshot id"),
        "{}",
        stderr(&out)
    );
    let out = gw.run(&[
        "env",
        "create",
        "--profile",
        "local",
        "--from-snapshot",
        &snap,
    ]);
    assert_eq!(out.status.code(), Some(4));
    assert!(stderr(&out).contains("not found"), "{}", stderr(&out));

    assert_eq!(destroy(&gw, fresh_id)["state"], "destroyed");
    assert_eq!(destroy(&gw, prepared_id)["state"], "destroyed");
    assert!(!root.path().exists(), "the emptied box root survived");
}

#[test]
fn snapshots_past_the_budget_are_evicted_least_recently_used_first() {
    let root = BoxRoot::new();
    // Room for two snapshots of a home holding 1 MiB, not three.
    let gw = Gateway::start_with("", &profiles(&root, "2560K"));
    let prepared = create(&gw, "cloud", &[]);
    let prepared_id = prepared["id"].as_str().unwrap();
    exec(
        &gw,
        prepared_id,
        "head -c 1048576 /dev/urandom > payload && sha256sum payload > payload.sum",
    );
    let first = take(&gw, prepared_id)["id"].as_str().unwrap().to_owned();
    let second = take(&gw, prepared_id)["id"].as_str().unwrap().to_owned();
    let mut both = vec![first.clone(), second.clone()];
    both.sort();
    assert_eq!(held(&root), both, "the lease CLI holds both");

    // A box starts from the older one (through `skiff box warmup --from-snapshot`): it is now
    // the more recently used.
    let fresh = create(&gw, "cloud", &["--from-snapshot", &first]);
    let fresh_id = fresh["id"].as_str().unwrap();
    assert_eq!(
        exec(
            &gw,
            fresh_id,
            "sha256sum -c payload.sum && stat -c %U payload"
        ),
        format!("payload: OK\n{}\n", exec(&gw, fresh_id, "id -un").trim())
    );

    let third = take(&gw, prepared_id)["id"].as_str().unwrap().to_owned();
    assert_eq!(
        listed(&gw),
        [third.clone(), first.clone()],
        "the least recently used one goes, not the oldest"
    );
    let mut kept = vec![first, third];
    kept.sort();
    assert_eq!(
        held(&root),
        kept,
        "the evicted snapshot is still on the box root"
    );

    // One larger than the whole budget is not kept, and the operator is told why.
    exec(&gw, prepared_id, "head -c 3145728 /dev/urandom > payload");
    let out = gw.run(&["env", "snapshots", "take", prepared_id]);
    assert_eq!(out.status.code(), Some(5));
    assert!(stderr(&out).contains("snapshot_budget"), "{}", stderr(&out));
    assert_eq!(held(&root), kept);

    destroy(&gw, fresh_id);
    destroy(&gw, prepared_id);
}

#[test]
fn a_capture_cut_short_by_a_crash_is_removed_and_unowned_snapshots_are_swept() {
    let root = BoxRoot::new();
    let scratch = tempfile::tempdir().unwrap();
    let started = scratch.path().join("started");
    let release = scratch.path().join("release");
    for fifo in [&started, &release] {
        assert!(Command::new("mkfifo").arg(fifo).status().unwrap().success());
    }
    // A lease CLI that captures, then (the first time only) stalls before answering.
    let wrapper = scratch.path().join("slow-lease-cli");
    std::fs::write(
        &wrapper,
        format!(
            "#!/usr/bin/env bash\nset -e\nout=$(\"{SKIFF}\" box --root \"{root}\" \"$@\")\n\
             if [ \"$1\" = snapshot ] && [ ! -e \"{once}\" ]; then touch \"{once}\"; echo > \"{started}\"; read -r _ < \"{release}\"; fi\n\
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
        "[profiles.slow]\nprovider = \"command\"\ncommand = [\"{}\"]\nsnapshots = true\n",
        wrapper.display()
    );
    let mut gw = Gateway::start_with("", &config);
    let env = create(&gw, "slow", &[]);
    let env_id = env["id"].as_str().unwrap();

    let mut taking = gw
        .cli()
        .args(["env", "snapshots", "take", env_id, "--json"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The lease CLI holds the copy and is mid-answer: now the gateway dies.
    std::fs::read(&started).unwrap();
    let half_taken = held(&root);
    assert_eq!(half_taken.len(), 1);
    gw.crash_and_restart();
    let _ = taking.kill();
    let _ = taking.wait();
    std::fs::write(&release, "\n").unwrap();

    // Restart reconciliation removed what the gateway never recorded as ready.
    assert!(listed(&gw).is_empty());
    assert!(held(&root).is_empty(), "the half-taken snapshot survived");

    // A snapshot taken behind the gateway's back is nobody's: the sweep deletes it.
    let lease = env["lease_id"].as_str().unwrap();
    let out = Command::new(SKIFF)
        .args(["box", "--root", root.path().to_str().unwrap()])
        .args([
            "snapshot",
            "--id",
            lease,
            "--snapshot-id",
            "snap_0123456789abcdef",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["id"], "snap_0123456789abcdef");
    assert!(printed["sizeBytes"].as_u64().is_some(), "{printed}");
    let swept = gw.json(&["env", "sweep", "--json"]);
    assert_eq!(
        swept["deleted_snapshots"],
        serde_json::json!(["snap_0123456789abcdef"])
    );
    assert!(held(&root).is_empty());
    destroy(&gw, env_id);
}
