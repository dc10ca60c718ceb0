//! What a newcomer touches first: `skiff doctor`, shell completions, the global `--json`, and
//! the systemd unit in `contrib/`.

use crate::harness::{Gateway, SKIFF, stderr, stdout};
use std::path::{Path, PathBuf};
use std::process::Command;

fn skiff(args: &[&str]) -> std::process::Output {
    Command::new(SKIFF)
        .args(args)
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .output()
        .unwrap()
}

#[test]
fn doctor_passes_on_a_machine_with_everything_installed() {
    let out = skiff(&["doctor"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let text = stdout(&out);
    for check in [
        "root", "sshd", "rsync", "git", "ip", "useradd", "unshare", "setpriv",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("✓ ") && l[4..].starts_with(check)),
            "no passing line for {check}:\n{text}"
        );
    }
    assert!(text.contains("user namespaces"), "{text}");
    assert!(
        text.ends_with("ready: every required check passed\n"),
        "{text}"
    );

    let json = skiff(&["doctor", "--json"]);
    assert_eq!(json.status.code(), Some(0), "{}", stderr(&json));
    let list: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let rsync = list
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "rsync")
        .unwrap();
    assert_eq!(rsync["ok"], true);
    assert_eq!(rsync["fix"], serde_json::Value::Null);
}

/// A directory of symlinks to every program on this PATH except `left_out`.
fn path_without(left_out: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let path = std::env::var_os("PATH").unwrap();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .collect();
    for d in dirs {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let link = dir.path().join(&name);
            if name == left_out || link.symlink_metadata().is_ok() {
                continue;
            }
            std::os::unix::fs::symlink(entry.path(), &link).unwrap();
        }
    }
    dir
}

#[test]
fn doctor_names_a_missing_tool_and_the_package_that_brings_it() {
    let bin = path_without("rsync");
    let out = Command::new(SKIFF)
        .arg("doctor")
        .env("PATH", bin.path())
        .output()
        .unwrap();
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    let line = text
        .lines()
        .find(|l| l.contains("rsync"))
        .unwrap_or_else(|| panic!("no rsync line:\n{text}"));
    assert!(line.starts_with("✗ "), "{line}");
    assert!(line.contains("apt-get install rsync"), "{line}");
    assert!(
        text.contains("1 of 10 required checks failed (rsync)"),
        "only rsync should be missing:\n{text}"
    );
    assert!(text.ends_with("install: apt-get install rsync\n"), "{text}");

    let json = Command::new(SKIFF)
        .args(["--json", "doctor"])
        .env("PATH", bin.path())
        .output()
        .unwrap();
    assert_eq!(json.status.code(), Some(1));
    let list: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let rsync = list
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "rsync")
        .unwrap();
    assert_eq!(rsync["ok"], false);
    assert_eq!(rsync["fix"], "apt-get install rsync");
}

#[test]
fn bash_completions_are_valid_bash_and_know_the_commands() {
    let out = skiff(&["completions", "bash"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let script = stdout(&out);
    for word in ["session", "env", "doctor", "--json"] {
        assert!(script.contains(word), "completion lacks {word}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("skiff.bash");
    std::fs::write(&file, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(check.status.success(), "bash -n: {}", stderr(&check));

    for shell in ["zsh", "fish"] {
        let out = skiff(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        assert!(stdout(&out).contains("session"), "{shell}");
    }
}

#[test]
fn json_is_accepted_before_or_after_the_command_and_refused_where_there_is_none() {
    let gw = Gateway::start("");
    let after = gw.json(&["session", "list", "--json"]);
    let before = gw.json(&["--json", "session", "list"]);
    assert_eq!(after, before);
    assert!(
        before["sessions"].as_array().unwrap().is_empty(),
        "{before}"
    );

    let refused = skiff(&["--json", "completions", "bash"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(refused.stdout.is_empty());
    assert!(
        stderr(&refused).contains("`skiff completions` has no JSON form"),
        "{}",
        stderr(&refused)
    );
}

fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .unwrap()
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let unit =
        std::fs::read_to_string(repo_root().join("contrib/systemd/skiff-gateway.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap();
    assert!(
        exec.ends_with("--state-dir /var/lib/skiff/gateway gateway --listen 127.0.0.1:7777"),
        "{exec}"
    );
    // The flags the unit passes are ones this binary accepts.
    let help = skiff(&["gateway", "--help"]);
    for flag in ["--listen", "--state-dir"] {
        assert!(stdout(&help).contains(flag), "gateway has no {flag}");
    }
    let settings: Vec<&str> = unit.lines().filter(|l| !l.starts_with('#')).collect();
    for absent in [
        "PrivateUsers=",
        "ProtectSystem=strict",
        "RestrictNamespaces=",
        "User=",
    ] {
        assert!(
            !settings.iter().any(|l| l.starts_with(absent)),
            "{absent} breaks a root gateway that makes boxes"
        );
    }
    // verify checks that ExecStart's program exists: point it at this build.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("skiff-gateway.service");
    std::fs::write(&copy, unit.replace("/usr/local/bin/skiff", SKIFF)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "", "systemd-analyze has complaints");
}

/// ARCHITECTURE.md's code map names every module of every crate in that crate's section (as
/// `name.rs`, `dir/`, or a backticked `name`), so a newcomer finds each file described.
#[test]
fn the_code_map_names_every_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let code_map = doc.split("## Code map").nth(1).unwrap();
    let code_map = code_map.split("\n## ").next().unwrap();
    let section = |krate: &str| -> String {
        let head = format!("### `{krate}`\n");
        code_map
            .split_once(&head)
            .map(|(_, rest)| rest.split("\n### ").next().unwrap().to_owned())
            .unwrap_or_default()
    };
    fn modules(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                modules(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut missing = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let krate = krate.unwrap().path();
        let name = krate.file_name().unwrap().to_str().unwrap().to_owned();
        let text = section(&name);
        let mut files = Vec::new();
        modules(&krate.join("src"), &mut files);
        for file in files {
            let rel = file.strip_prefix(krate.join("src")).unwrap();
            let file_name = rel.file_name().unwrap().to_str().unwrap();
            if matches!(rel.to_str(), Some("lib.rs" | "main.rs")) {
                continue;
            }
            let named = if file_name == "mod.rs" {
                let dir = rel.parent().unwrap().file_name().unwrap().to_str().unwrap();
                text.contains(&format!("{dir}/"))
            } else {
                let stem = file_name.trim_end_matches(".rs");
                text.contains(file_name) || text.contains(&format!("`{stem}`"))
            };
            if !named {
                missing.push(format!("{name}: {}", rel.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "modules ARCHITECTURE.md's code map does not name:\n{}",
        missing.join("\n")
    );
}
