//! Sync figures (printed, never asserted), all from one run: Skiff against raw `rsync -a` of
//! the same files over the same SSH path to the same local box.
//!
//! The workspace is a git repository of 10,000 files and ~120 MB (text-like files of varied
//! sizes, twenty of 2 MB), with three commits, packed (`git repack -ad`, as a clone or a
//! `git gc` leaves it), and a few uncommitted and untracked changes. A fake OpenAI server
//! answers every turn with a short reply.
//!
//! Per round (interleaved, so the machine's noise falls on all alike):
//! - worktree: `skiff session new --detach` of a gateway-placed session, spawned → returned
//!   (the CLI returns once the session's worktree exists);
//! - first model request: `skiff session new --profile local` spawned → its `model_request`
//!   event at a client following the session (an idle box was leased beforehand, so box
//!   provisioning is not counted; the worker's start and readiness canary are);
//! - syncing: the placement's `syncing` event → its `starting` event;
//! - turn tail with no changes: a second turn's last `text_delta` → its terminal
//!   `run_status`, for the worker session and for the gateway-placed one;
//! - re-sync: a session of profile `parks` (`keep_attached = "1s"`) parks after its first
//!   turn (its box keeps its workspace); the next message's placement `syncing` → `starting`,
//!   back onto that box, workspace unchanged;
//! - raw rsync: `rsync -a` of the same working tree (without `.git`) into a fresh directory
//!   of the session's box, over the gateway's own multiplexed transfer connection, then the
//!   same command again (no change).
//!
//! Figures are medians of the rounds. Below them, a phase breakdown read from the gateway's
//! debug log (packing, the box's checkout, listing, scans, reconciliation).
//!
//! `cargo bench -p skiff-cli --bench sync` (as root: boxes get users and namespaces)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use skiff_test_support::{FakeProvider, FakeResponse, openai_sse};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SKIFF: &str = env!("CARGO_BIN_EXE_skiff");
/// Rounds (`SKIFF_BENCH_ROUNDS` overrides, for a quick look).
fn rounds() -> usize {
    std::env::var("SKIFF_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
}
const FILES: usize = 10_000;
const MODEL: &str = "openai/m";
const PATIENCE: Duration = Duration::from_secs(600);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn reply() -> FakeResponse {
    let mut events = openai_sse::text_chunks(&["all ", "done"]);
    events.extend(openai_sse::finish("stop"));
    events.extend(openai_sse::usage(100, 2));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A small xorshift generator: the same tree every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const WORDS: [&str; 32] = [
    "fn", "let", "mut", "struct", "impl", "match", "Some", "None", "Ok", "Err", "self", "return",
    "pub", "use", "crate", "where", "async", "await", "loop", "if", "else", "for", "in", "while",
    "value", "index", "buffer", "count", "state", "error", "result", "config",
];

/// Text that compresses like source code does, `len` bytes.
fn text(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 64);
    while out.len() < len {
        for _ in 0..rng.below(4) {
            out.extend_from_slice(b"    ");
        }
        for _ in 0..(3 + rng.below(8)) {
            out.extend_from_slice(WORDS[rng.below(32) as usize].as_bytes());
            if rng.below(3) == 0 {
                out.extend_from_slice(format!("_{}", rng.below(100_000)).as_bytes());
            }
            out.push(b' ');
        }
        out.push(b'\n');
    }
    out.truncate(len);
    out
}

fn file_path(i: usize) -> String {
    format!("src/m{:02}/p{}/file{i:05}.rs", i % 50, (i / 50) % 8)
}

/// The bench's repository: 10,000 files, ~120 MB, three commits, packed, a few uncommitted
/// changes. Returns the total bytes of the working tree.
fn make_repo(dir: &Path) -> u64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    git(dir, &["init", "-q", "-b", "main"]);
    git(dir, &["config", "user.name", "Bench"]);
    git(dir, &["config", "user.email", "bench@skiff.invalid"]);
    git(dir, &["config", "commit.gpgsign", "false"]);
    let mut total = 0u64;
    let write = |rel: &str, bytes: &[u8]| {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    };
    for i in 0..FILES - 100 {
        let len = if i % 500 == 7 {
            2_000_000
        } else {
            1_000 + rng.below(14_000) as usize
        };
        total += len as u64;
        write(&file_path(i), &text(&mut rng, len));
    }
    git(dir, &["add", "-A"]);
    git(dir, &["commit", "-q", "-m", "first"]);
    for i in (0..FILES - 100).step_by(37) {
        let len = 1_000 + rng.below(14_000) as usize;
        write(&file_path(i), &text(&mut rng, len));
    }
    git(dir, &["commit", "-q", "-am", "second"]);
    for i in FILES - 100..FILES {
        let len = 1_000 + rng.below(14_000) as usize;
        total += len as u64;
        write(&file_path(i), &text(&mut rng, len));
    }
    git(dir, &["add", "-A"]);
    git(dir, &["commit", "-q", "-m", "third"]);
    git(dir, &["repack", "-adq"]);
    // The user's working state: a few edits and new files.
    for i in [3usize, 1_234, 5_678] {
        write(&file_path(i), &text(&mut rng, 4_000));
    }
    for i in 0..3 {
        write(&format!("notes/new{i}.md"), &text(&mut rng, 2_000));
    }
    std::fs::remove_file(dir.join(file_path(42))).unwrap();
    total
}

/// The gateway's debug lines the phase breakdown reads (`SKIFF_BENCH_LOG` replaces it, and
/// then the gateway's log is echoed too).
const PHASE_LOG: &str = "warn,skiff_sync::outbound=debug,skiff_sync::manifest=debug,skiff_gateway::worker::turn=debug,skiff_gateway::workspace=debug";

/// Phase timings from the gateway's debug log: the message, and what its `ms=` field means.
const PHASES: [(&str, &str); 8] = [
    ("worktree: filled", "worktree fill (background)"),
    ("outbound: packed", "lay-down: base commit packed at"),
    ("outbound: listed", "lay-down: workspace listed at"),
    (
        "outbound: the box checked the base commit out",
        "lay-down: box checkout done at",
    ),
    ("outbound: files sent", "lay-down: done at"),
    ("outbound: a kept workspace resumed", "re-sync: resumed in"),
    ("manifest: scanned", "gateway scan (list + hash)"),
    ("reconciled", "reconcile (turn end)"),
];

/// Every phase timing the gateway logged, by phase.
#[derive(Clone, Default)]
struct Phases(std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<usize, Vec<f64>>>>);

impl Phases {
    fn note(&self, line: &str) {
        let Some(i) = PHASES.iter().position(|(msg, _)| line.contains(msg)) else {
            return;
        };
        let Some(ms) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("ms="))
            .and_then(|v| v.parse::<f64>().ok())
        else {
            return;
        };
        self.0.lock().unwrap().entry(i).or_default().push(ms);
    }

    fn print(&self) {
        let all = self.0.lock().unwrap();
        if all.is_empty() {
            return;
        }
        println!("phases (gateway debug log; median ms over every occurrence, n in brackets)");
        for (i, v) in all.iter() {
            println!(
                "  {:<46}{:>8.0} ms   [n={}]",
                PHASES[*i].1,
                median(v.clone()),
                v.len()
            );
        }
    }
}

/// Tears down every box under the root when dropped.
struct Cleanup(PathBuf);

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

struct Rig {
    gateway: Child,
    state: PathBuf,
    home: PathBuf,
    url: String,
    token: String,
    repo: PathBuf,
    phases: Phases,
    _fake: FakeProvider,
    _rt: tokio::runtime::Runtime,
    _cleanup: Cleanup,
    _dir: tempfile::TempDir,
}

impl Rig {
    fn start() -> (Rig, u64) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let fake = rt.block_on(FakeProvider::start((0..200).map(|_| reply()).collect()));
        let dir = tempfile::Builder::new()
            .prefix("skiff-bench-")
            .tempdir_in("/tmp")
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let boxes = dir.path().join("boxes");
        std::fs::create_dir(&boxes).unwrap();
        std::fs::set_permissions(&boxes, std::fs::Permissions::from_mode(0o711)).unwrap();
        let cleanup = Cleanup(boxes.clone());
        let state = dir.path().join("state");
        let home = dir.path().join("home");
        std::fs::create_dir(&home).unwrap();
        let repo = dir.path().join("repo");
        std::fs::create_dir(&repo).unwrap();
        let bytes = make_repo(&repo);
        let config = dir.path().join("skiff.toml");
        std::fs::write(
            &config,
            format!(
                "[gateway]\nmax_workers = 16\nlifetime_tick = \"100ms\"\n\
                 [providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\napi_key_env = \"SKIFF_BENCH_PROVIDER_KEY\"\n\
                 [profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n\
                 [profiles.parks]\nprovider = \"local\"\nroot = \"{}\"\nkeep_attached = \"1s\"\n",
                fake.base_url(),
                boxes.display(),
                boxes.display()
            ),
        )
        .unwrap();
        let mut gateway = Command::new(SKIFF)
            .arg("--state-dir")
            .arg(&state)
            .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config)
            .env(
                "RUST_LOG",
                std::env::var("SKIFF_BENCH_LOG").unwrap_or_else(|_| PHASE_LOG.into()),
            )
            .env("HOME", &home)
            .env("SKIFF_BENCH_PROVIDER_KEY", "sk-bench")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let phases = Phases::default();
        let log = BufReader::new(gateway.stderr.take().unwrap());
        let seen = phases.clone();
        let echo = std::env::var_os("SKIFF_BENCH_LOG").is_some();
        std::thread::spawn(move || {
            for line in log.lines().map_while(Result::ok) {
                seen.note(&line);
                if echo {
                    eprintln!("{line}");
                }
            }
        });
        let mut stdout = BufReader::new(gateway.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let url = line
            .trim()
            .strip_prefix("skiff gateway listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the gateway: {line:?}"))
            .to_owned();
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let file: Value =
            serde_json::from_str(&std::fs::read_to_string(state.join("gateway.json")).unwrap())
                .unwrap();
        let rig = Rig {
            gateway,
            state,
            home,
            url,
            token: file["token"].as_str().unwrap().to_owned(),
            repo,
            phases,
            _fake: fake,
            _rt: rt,
            _cleanup: cleanup,
            _dir: dir,
        };
        (rig, bytes)
    }

    fn cli(&self, args: &[&str]) -> Output {
        Command::new(SKIFF)
            .arg("--state-dir")
            .arg(&self.state)
            .args(args)
            .env("HOME", &self.home)
            .env_remove("SKIFF_URL")
            .env_remove("SKIFF_TOKEN")
            .output()
            .unwrap()
    }

    fn json(&self, args: &[&str]) -> Value {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "skiff {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `session new --detach`: (session id, run id).
    fn new_session(&self, profile: Option<&str>) -> (String, String) {
        let mut args = vec![
            "session",
            "new",
            "--detach",
            "--json",
            "--model",
            MODEL,
            "--workspace",
            self.repo.to_str().unwrap(),
        ];
        if let Some(profile) = profile {
            args.extend(["--profile", profile]);
        }
        args.push("go");
        let v = self.json(&args);
        (
            v["session"]["id"].as_str().unwrap().to_owned(),
            v["run"]["id"].as_str().unwrap().to_owned(),
        )
    }

    fn send(&self, session: &str) -> String {
        let v = self.json(&["session", "send", session, "go", "--detach", "--json"]);
        v["run"]["id"].as_str().unwrap().to_owned()
    }

    /// An idle box of profile `local`, for the next placement to reuse.
    fn idle_box(&self) -> String {
        let env = self.json(&["env", "create", "--profile", "local", "--json"]);
        assert_eq!(env["state"], "idle", "{env}");
        env["id"].as_str().unwrap().to_owned()
    }

    /// Every event of `session` from the start, with its arrival time.
    fn follow(&self, session: &str) -> mpsc::Receiver<(Instant, Value)> {
        let (tx, rx) = mpsc::channel();
        let request = reqwest::blocking::Client::builder()
            .timeout(None)
            .build()
            .unwrap()
            .get(format!("{}/v1/sessions/{session}/events?after=0", self.url))
            .bearer_auth(&self.token);
        std::thread::spawn(move || {
            let response = request.send().unwrap().error_for_status().unwrap();
            let mut reader = BufReader::new(response);
            let mut line = String::new();
            loop {
                line.clear();
                if !matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                    return;
                }
                let at = Instant::now();
                if let Some(data) = line.strip_prefix("data:") {
                    let Ok(v) = serde_json::from_str(data.trim()) else {
                        continue;
                    };
                    if tx.send((at, v)).is_err() {
                        return;
                    }
                }
            }
        });
        rx
    }

    /// rsync -a of the working tree (no `.git`) into `dest` on the box of `env`, over the
    /// gateway's transfer connection to it.
    fn raw_rsync(&self, env: &str, dest: &str) -> Duration {
        let dir = self.state.join("ssh").join(env);
        let socket = ["transfer.sock", "control.sock"]
            .iter()
            .map(|s| dir.join(s))
            .find(|s| s.exists())
            .unwrap_or_else(|| panic!("no ssh master for {env} under {}", dir.display()));
        let shell = format!(
            "ssh -F /dev/null -o ControlMaster=no -o ControlPath={} -o BatchMode=yes",
            socket.display()
        );
        let mut src = self.repo.clone().into_os_string();
        src.push("/");
        let started = Instant::now();
        let out = Command::new("rsync")
            .args(["-a", "--exclude=/.git", "-e", &shell])
            .arg(&src)
            .arg(format!("box:{dest}/"))
            .output()
            .unwrap();
        let took = started.elapsed();
        assert!(
            out.status.success(),
            "raw rsync: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        took
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.gateway.kill();
        let _ = self.gateway.wait();
    }
}

/// Reads `events` until the session is parked.
fn wait_parked(events: &mpsc::Receiver<(Instant, Value)>) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, e) = events
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("the session was not parked"));
        if e["type"] == "placement" && e["state"] == "parked" {
            return;
        }
    }
}

fn terminal(status: &Value) -> bool {
    matches!(
        status.as_str(),
        Some("succeeded" | "failed" | "cancelled" | "timed_out" | "orphaned")
    )
}

/// What a run looked like to a follower.
#[derive(Default)]
struct Seen {
    model_request: Option<Instant>,
    last_delta: Option<Instant>,
    syncing: Option<Instant>,
    starting: Option<Instant>,
    end: Option<Instant>,
}

impl Seen {
    fn tail(&self) -> Duration {
        self.end.unwrap() - self.last_delta.unwrap()
    }
    fn syncing(&self) -> Duration {
        self.starting.unwrap() - self.syncing.unwrap()
    }
}

/// Reads `events` until `run` ends (it must succeed).
fn watch(events: &mpsc::Receiver<(Instant, Value)>, run: &str) -> Seen {
    let mut seen = Seen::default();
    let deadline = Instant::now() + PATIENCE;
    while seen.end.is_none() {
        let (at, e) = events
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("run {run} did not end"));
        if e["run_id"] != run {
            continue;
        }
        match e["type"].as_str().unwrap_or("") {
            "model_request" => {
                seen.model_request.get_or_insert(at);
            }
            "text_delta" => seen.last_delta = Some(at),
            "placement" if e["state"] == "syncing" => seen.syncing = Some(at),
            "placement" if e["state"] == "starting" && seen.syncing.is_some() => {
                seen.starting.get_or_insert(at);
            }
            "run_status" if terminal(&e["status"]) => {
                assert_eq!(e["status"], "succeeded", "run {run}: {e}");
                seen.end = Some(at);
            }
            _ => {}
        }
    }
    seen
}

#[derive(Default)]
struct Figures {
    worktree: Vec<f64>,
    first_request: Vec<f64>,
    syncing: Vec<f64>,
    tail_worker: Vec<f64>,
    tail_local: Vec<f64>,
    resync: Vec<f64>,
    rsync_initial: Vec<f64>,
    rsync_nochange: Vec<f64>,
}

fn main() {
    if !skiff_providers::running_as_root() {
        println!("sync bench: needs root (local boxes get users and namespaces); skipped");
        return;
    }
    let made = Instant::now();
    let (rig, bytes) = Rig::start();
    let files = git(&rig.repo, &["ls-files", "-co", "--exclude-standard"])
        .lines()
        .count();
    println!(
        "workspace: {files} files, {:.1} MB, packed, 3 commits, a few uncommitted changes (made in {:.1} s)",
        bytes as f64 / 1e6,
        made.elapsed().as_secs_f64()
    );
    let mut f = Figures::default();
    let rounds = rounds();
    for round in 0..rounds {
        // A gateway-placed session: the CLI returns once its worktree exists.
        let started = Instant::now();
        let (local, local_run) = rig.new_session(None);
        f.worktree.push(ms(started.elapsed()));
        let local_events = rig.follow(&local);
        watch(&local_events, &local_run);

        // A worker session onto an idle box.
        let env = rig.idle_box();
        let started = Instant::now();
        let (session, run) = rig.new_session(Some("local"));
        let events = rig.follow(&session);
        let first = watch(&events, &run);
        f.first_request
            .push(ms(first.model_request.unwrap() - started));
        f.syncing.push(ms(first.syncing()));

        // Raw rsync over the same connection, into a fresh directory of the same box.
        let dest = format!("raw-{round}");
        f.rsync_initial.push(ms(rig.raw_rsync(&env, &dest)));
        f.rsync_nochange.push(ms(rig.raw_rsync(&env, &dest)));

        // Turns that change nothing.
        let run = rig.send(&session);
        f.tail_worker.push(ms(watch(&events, &run).tail()));
        let run = rig.send(&local);
        f.tail_local.push(ms(watch(&local_events, &run).tail()));

        // A session that parks after its turn, and the next placement of its unchanged
        // workspace (back onto the box that kept it).
        let (parks, run) = rig.new_session(Some("parks"));
        let parks_events = rig.follow(&parks);
        watch(&parks_events, &run);
        wait_parked(&parks_events);
        let run = rig.send(&parks);
        f.resync.push(ms(watch(&parks_events, &run).syncing()));
        rig.json(&["env", "destroy", &env, "--force", "--json"]);
        eprintln!("round {} of {rounds} done", round + 1);
    }

    let m = |v: &Vec<f64>| median(v.clone());
    let all = |v: &Vec<f64>| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (raw, raw_nc) = (m(&f.rsync_initial), m(&f.rsync_nochange));
    let mut out = std::io::stdout().lock();
    let mut row = |name: &str, v: &Vec<f64>, against: Option<(f64, &str, &str)>| {
        let ratio = against
            .map(|(base, what, target)| format!("{:>6.2}× {what}  (target {target})", m(v) / base))
            .unwrap_or_default();
        writeln!(out, "  {name:<34}{:>8.0} ms  {ratio}   [{}]", m(v), all(v)).unwrap();
    };
    println!("median of {rounds} interleaved rounds (ms; every round in brackets)");
    row("raw rsync -a, initial", &f.rsync_initial, None);
    row("raw rsync -a, no change", &f.rsync_nochange, None);
    row("worktree (session new --detach)", &f.worktree, None);
    row(
        "first model request (--profile)",
        &f.first_request,
        Some((raw, "raw initial", "<= 1.3×")),
    );
    row(
        "  of which syncing",
        &f.syncing,
        Some((raw, "raw initial", "-")),
    );
    row("turn tail, no change, worker", &f.tail_worker, None);
    row("turn tail, no change, gateway", &f.tail_local, None);
    row(
        "re-sync, next placement (parked)",
        &f.resync,
        Some((raw_nc, "raw no-change", "<= 0.5×")),
    );
    println!("  targets: worktree <= 500 ms; turn tails <= 300 ms");
    rig.phases.print();
}
