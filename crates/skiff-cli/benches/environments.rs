//! Environment figures (printed, never asserted): `env create` to ready for a cold local box
//! and for a warm reuse, median of 5, and the bundle copy time. The baseline, measured in the
//! same run, is the provider alone: `skiff box warmup` (keys, sshd) without the gateway's
//! bootstrap.
//!
//! `cargo bench -p skiff-cli --bench environments` (as root: boxes get users and namespaces)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SKIFF: &str = env!("CARGO_BIN_EXE_skiff");
const RUNS: usize = 5;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn skiff(state: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "skiff {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// Tears down every box under the root when dropped, so a failed run leaves no sshd, user or
/// namespace behind.
struct Cleanup(std::path::PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let boxes = skiff_providers::local::Boxes::new(self.0.clone(), SKIFF.into());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for id in boxes.list().unwrap_or_default() {
            let _ = rt.block_on(boxes.destroy(&id));
        }
    }
}

fn main() {
    let dir = tempfile::Builder::new()
        .prefix("skiff-bench-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let boxes = dir.path().join("boxes");
    let _cleanup = Cleanup(boxes.clone());
    let state = dir.path().join("state");
    let config = dir.path().join("skiff.toml");
    let isolation = if skiff_providers::running_as_root() {
        "netns"
    } else {
        "none"
    };
    std::fs::write(
        &config,
        format!(
            "[profiles.bench]\nprovider = \"local\"\nisolation = \"{isolation}\"\nroot = \"{}\"\n",
            boxes.display()
        ),
    )
    .unwrap();
    let mut gateway = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(&state)
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(gateway.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();

    println!("local boxes (isolation {isolation}), median of {RUNS}");
    let mut cold = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..RUNS {
        let started = Instant::now();
        let env = skiff(&state, &["env", "create", "--profile", "bench", "--json"]);
        cold.push(started.elapsed());
        assert_eq!(env["state"], "idle", "{env}");
        ids.push(env["id"].as_str().unwrap().to_owned());
    }
    let mut warm = Vec::new();
    for _ in 0..RUNS {
        let started = Instant::now();
        let env = skiff(
            &state,
            &["env", "create", "--profile", "bench", "--reuse", "--json"],
        );
        warm.push(started.elapsed());
        assert!(
            ids.contains(&env["id"].as_str().unwrap().to_owned()),
            "reuse made a new box"
        );
    }
    for id in &ids {
        skiff(&state, &["env", "destroy", id, "--json"]);
    }
    let _ = gateway.kill();
    let _ = gateway.wait();

    let store = skiff_store::Store::open(&state.join("skiff.db")).unwrap();
    let copies: Vec<(u64, Duration)> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "bundle.install" && r.decision == "copied")
        .map(|r| {
            (
                r.detail["bytes"].as_u64().unwrap(),
                Duration::from_millis(r.detail["duration_ms"].as_u64().unwrap()),
            )
        })
        .collect();
    let copy = median(copies.iter().map(|c| c.1).collect());
    let bytes = copies[0].0;

    let mut provider_only = Vec::new();
    for i in 0..RUNS {
        let id = format!("cbx_{i:012x}");
        let root = boxes.to_str().unwrap();
        let started = Instant::now();
        skiff(
            &state,
            &[
                "box",
                "--root",
                root,
                "warmup",
                "--lease-id",
                &id,
                "--isolation",
                isolation,
                "--json",
            ],
        );
        provider_only.push(started.elapsed());
        skiff(&state, &["box", "--root", root, "stop", &id]);
    }

    let (cold, warm, base) = (median(cold), median(warm), median(provider_only));
    println!(
        "  cold env create → ready     {:>8.1} ms   (target <= 2000 ms)",
        ms(cold)
    );
    println!(
        "  warm reuse → ready          {:>8.1} ms   (target <= 200 ms)",
        ms(warm)
    );
    println!(
        "  bundle copy ({:.1} MB)        {:>8.1} ms   ({:.0} MB/s)",
        bytes as f64 / 1e6,
        ms(copy),
        bytes as f64 / 1e6 / copy.as_secs_f64()
    );
    println!("  baseline: box warmup alone  {:>8.1} ms", ms(base));
    println!(
        "  ratio cold/baseline         {:>8.2}",
        cold.as_secs_f64() / base.as_secs_f64()
    );
    println!(
        "  ratio warm/cold             {:>8.3}",
        warm.as_secs_f64() / cold.as_secs_f64()
    );
}
