//! Worker figures (printed, never asserted), all from one run.
//!
//! Part A, streaming through a worker. A fake OpenAI-compatible provider answers every turn
//! with 20,000 small text chunks. The same reply goes to a session on the gateway itself
//! ("direct") and to a worker session on a local box, whose model calls travel worker → SSH
//! tunnel → the gateway's inference proxy → provider, and whose live events travel back the
//! same way before the gateway publishes them. Each session is created with a warm-up turn
//! (provisioning is not counted), then the two take turns (`session send`) for 5 rounds. One
//! client follows each session on `GET /v1/sessions/{id}/events` and timestamps every event
//! when its line arrives.
//!
//! - TTFT: the turn's `model_request` event → its first `text_delta`, both at that client. On
//!   a worker the `model_request` event crosses the tunnel just ahead of the model call, so
//!   the difference to direct is what the worker path adds between the call leaving the loop
//!   and its first token showing: proxy admission, the provider call, the token's trip back
//!   to the worker and the `text_delta` event's trip to the gateway.
//! - send → first token: `skiff session send` spawned → first `text_delta` (turn dispatch
//!   included; the CLI's process start is in both).
//! - throughput: `text_delta` events / (last arrival − first arrival). The ceiling is the
//!   bench itself reading the fake's reply over HTTP.
//! - CPU per turn (send to run end): the gateway process, the children it reaped, and the
//!   worker path outside it (ssh masters, everything in the box's network namespace).
//!
//! A turn that goes silent for a minute is reported as stalled and cancelled, not waited on.
//!
//! Part B, 50 worker sessions through one gateway (`[gateway] max_workers = 64`): the gateway
//! process's CPU time (utime + stime) and RSS with no worker, after 50 sessions finished their
//! first turn (created one after the other, detached; placed all at once), over an idle
//! window with the 50 attached, and over one more short turn on each of the 50, all at once.
//! Completion is polled with `skiff session list --json` once a second; those polls are in
//! the figures. Beside the gateway: the ssh masters and everything in the boxes, as PSS.
//!
//! Part C, boxes coming back (parking): `session new --profile local` spawned → the turn's
//! first `model_request` event on the CLI's `--json` stream, median of [`PARK_RUNS`], for
//! - warm, parked: the previous session was parked by the lifetime tick (`keep_attached =
//!   "1s"`), its box is idle in the pool and the new session takes it;
//! - cold: the idle boxes were destroyed first, the new session leases a fresh box;
//! - warm, parked on demand: `max_workers = 1` and the previous session idle on its box — the
//!   new session's request parks it (worker stopped, workspace removed, box back in the pool)
//!   and then takes the box, all inside the measured time.
//!
//! Part D, the setup phase: the same measure for a workspace whose `.skiff/setup.sh` installs a
//! wheel with `pip` from a registry on loopback through the egress proxy — on a cold box, on a
//! warm box from the pool (both with a key no snapshot has, so setup runs and its box is kept),
//! on the warm box that setup prepared (back in the pool, setup skipped), on a box made from the
//! snapshot (the pool emptied first), on a warm box prepared for another key with its home
//! restored from the snapshot — and, as the baseline, a warm box of a workspace without setup.
//! Then a 64 MiB download from the box through the proxy against
//! the same download on the host.
//!
//! Part E, live handoff: one session moves with its turn running, [`ROUNDS`] times each way —
//! `dispatch --live` (gateway → a warm box from the pool) and `pull-back --live` (box →
//! gateway) — each asked while the turn's first model step streams. The pause is the last
//! event of the old owner (the last one before the barrier's first step after the claim) →
//! the first event of the new owner (the first one after the placement settled), by the
//! gateway's event timestamps; median of the rounds.
//!
//! `cargo bench -p skiff-cli --bench workers` (as root: boxes get users and namespaces);
//! `cargo bench -p skiff-cli --bench workers -- parking` runs part C alone, `-- setup` part D,
//! `-- handoff` part E.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SKIFF: &str = env!("CARGO_BIN_EXE_skiff");
const TOKENS: usize = 20_000;
const ROUNDS: usize = 5;
const SESSIONS: usize = 50;
const MODEL: &str = "openai/m";
/// How long a turn or a wait may take before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(600);
/// How long a followed turn may go without any event before it counts as stalled.
const STALL: Duration = Duration::from_secs(60);
/// Sessions measured per figure of part C.
const PARK_RUNS: usize = 5;

fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One reply of `texts`, finished, with usage.
fn reply(texts: &[&str]) -> FakeResponse {
    let mut events = openai_sse::text_chunks(texts);
    events.extend(openai_sse::finish("stop"));
    events.extend(openai_sse::usage(100, texts.len() as u64));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

fn long_reply() -> FakeResponse {
    let pieces: Vec<String> = (0..TOKENS).map(|i| format!("t{} ", i % 10)).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    reply(&pieces)
}

/// Tears down every box under the root when dropped, so a failed run leaves no sshd, user or
/// namespace behind.
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

/// A gateway process with a fake `openai` provider and a `local` worker profile, a box root
/// and a home of its own. Dropping it kills the gateway, then destroys whatever boxes are left.
struct Rig {
    gateway: Child,
    pid: u32,
    /// The kernel's clock ticks per second (CPU times in /proc are in ticks).
    ticks_per_s: f64,
    state: PathBuf,
    home: PathBuf,
    boxes: PathBuf,
    url: String,
    token: String,
    repo: TempGitRepo,
    fake: FakeProvider,
    _rt: tokio::runtime::Runtime,
    _cleanup: Cleanup,
    _dir: tempfile::TempDir,
}

impl Rig {
    fn start(responses: Vec<FakeResponse>, extra_config: &str) -> Rig {
        Rig::start_with(responses, extra_config, "")
    }

    /// `profile_config`: more keys of `[profiles.local]`.
    fn start_with(responses: Vec<FakeResponse>, extra_config: &str, profile_config: &str) -> Rig {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let fake = rt.block_on(FakeProvider::start(responses));
        // Box users must reach their homes under the root: 0711 under /tmp.
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
        let config = dir.path().join("skiff.toml");
        std::fs::write(
            &config,
            format!(
                "{extra_config}\n[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\napi_key_env = \"SKIFF_BENCH_PROVIDER_KEY\"\n\
                 [profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n{profile_config}",
                fake.base_url(),
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
            .env("HOME", &home)
            .env("SKIFF_BENCH_PROVIDER_KEY", "sk-bench")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = gateway.id();
        let mut stdout = BufReader::new(gateway.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let url = line
            .trim()
            .strip_prefix("skiff gateway listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the gateway: {line:?}"))
            .to_owned();
        // Keep the pipe drained: a gateway blocked on stdout would skew every figure.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let file: Value =
            serde_json::from_str(&std::fs::read_to_string(state.join("gateway.json")).unwrap())
                .unwrap();
        let ticks_per_s = String::from_utf8(
            Command::new("getconf")
                .arg("CLK_TCK")
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim()
        .parse()
        .unwrap();
        Rig {
            gateway,
            pid,
            ticks_per_s,
            state,
            home,
            boxes,
            url,
            token: file["token"].as_str().unwrap().to_owned(),
            repo: TempGitRepo::new(&[("README.md", "a repository for the bench\n")]),
            fake,
            _rt: rt,
            _cleanup: cleanup,
            _dir: dir,
        }
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

    /// `session new --detach`: the run it started.
    fn new_session(&self, profile: Option<&str>, prompt: &str) -> Value {
        let workspace = self.repo.path().to_str().unwrap();
        let mut args = vec![
            "session",
            "new",
            "--detach",
            "--json",
            "--model",
            MODEL,
            "--workspace",
            workspace,
        ];
        if let Some(profile) = profile {
            args.extend(["--profile", profile]);
        }
        args.push(prompt);
        self.json(&args)
    }

    /// Every event of `session` from the start, as (arrival, JSON), read on a thread of its own
    /// so that nothing the bench does delays a timestamp.
    fn follow(&self, session: &str) -> mpsc::Receiver<(Instant, String)> {
        let (tx, rx) = mpsc::channel();
        let request = reqwest::blocking::Client::builder()
            .timeout(None)
            .build()
            .unwrap()
            .get(format!("{}/v1/sessions/{session}/events?after=0", self.url))
            .bearer_auth(&self.token);
        std::thread::spawn(move || {
            let response = request.send().unwrap().error_for_status().unwrap();
            let mut reader = BufReader::with_capacity(1 << 16, response);
            let mut line = String::new();
            loop {
                line.clear();
                if !matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                    return;
                }
                let at = Instant::now();
                if let Some(data) = line.strip_prefix("data:")
                    && tx.send((at, data.trim().to_owned())).is_err()
                {
                    return;
                }
            }
        });
        rx
    }

    /// Waits until every run in `runs` (session id → run id) has ended; each must succeed.
    fn wait_runs(&self, runs: &[(String, String)]) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let list = self.json(&["session", "list", "--json"]);
            let sessions = list["sessions"].as_array().unwrap();
            let mut pending = 0;
            for (session, run) in runs {
                let s = sessions
                    .iter()
                    .find(|s| s["id"] == session.as_str())
                    .unwrap();
                let last = &s["last_run"];
                if last["id"] != run.as_str() || !terminal(&last["status"]) {
                    pending += 1;
                    continue;
                }
                assert_eq!(last["status"], "succeeded", "{session}: {s}");
                assert_eq!(s["placement"], "active", "{session}: {s}");
            }
            if pending == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{pending} runs still unfinished after {PATIENCE:?}"
            );
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.gateway.kill();
        let _ = self.gateway.wait();
    }
}

fn terminal(status: &Value) -> bool {
    matches!(
        status.as_str(),
        Some("succeeded" | "failed" | "cancelled" | "timed_out" | "orphaned")
    )
}

/// What one turn looked like to a client following its session.
struct Turn {
    ttft: Duration,
    send_to_first: Duration,
    tokens_per_s: f64,
    deltas: usize,
    /// Filled in by [`turn`]: CPU seconds spent from the send to the run's end.
    cpu: Cpu,
}

/// CPU seconds over one turn: the gateway itself, the children it reaped (git, rsync, ssh
/// commands), and the worker path outside it (ssh masters and their box proxies, the box's
/// sshd, the worker).
#[derive(Clone, Copy, Default)]
struct Cpu {
    gateway: f64,
    reaped: f64,
    outside: f64,
}

type Events = mpsc::Receiver<(Instant, String)>;

/// Reads `events` until `run` ends, timing its text. `Err` says how far a run got that
/// failed or went silent for [`STALL`].
fn collect(events: &Events, run: &str, sent: Instant) -> Result<Turn, String> {
    let (mut model_request, mut first, mut last, mut deltas) = (None, None, None, 0);
    let mut last_type = String::from("none");
    loop {
        let Ok((at, data)) = events.recv_timeout(STALL) else {
            return Err(format!(
                "stalled: no event for {} s after {deltas} of {TOKENS} text_delta events (last event: {last_type})",
                STALL.as_secs()
            ));
        };
        let event: Value = serde_json::from_str(&data).unwrap();
        if event["run_id"] != run {
            continue;
        }
        last_type = event["type"].as_str().unwrap().to_owned();
        match last_type.as_str() {
            "model_request" => {
                model_request.get_or_insert(at);
            }
            "text_delta" => {
                first.get_or_insert(at);
                last = Some(at);
                deltas += 1;
            }
            "run_status" if terminal(&event["status"]) => {
                if event["status"] != "succeeded" {
                    return Err(format!(
                        "run {run} ended after {deltas} text_delta events: {event}"
                    ));
                }
                break;
            }
            _ => {}
        }
    }
    let (model_request, first, last) = (model_request.unwrap(), first.unwrap(), last.unwrap());
    Ok(Turn {
        ttft: first - model_request,
        send_to_first: first - sent,
        tokens_per_s: deltas as f64 / (last - first).as_secs_f64(),
        deltas,
        cpu: Cpu::default(),
    })
}

/// Cancels a stalled run and waits for it to end, so that its environment can go.
fn cancel(rig: &Rig, events: &Events, session: &str, run: &str) {
    rig.json(&["session", "cancel", session, "--json"]);
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        let Ok((_, data)) = events.recv_timeout(STALL) else {
            break;
        };
        let event: Value = serde_json::from_str(&data).unwrap();
        if event["run_id"] == run && event["type"] == "run_status" && terminal(&event["status"]) {
            return;
        }
    }
    eprintln!("run {run} did not end after its cancel");
}

/// `session send` (detached) and the turn as the follower saw it; a failed or stalled turn is
/// cancelled.
fn turn(rig: &Rig, events: &Events, session: &str) -> Result<Turn, String> {
    // Whatever is still queued belongs to earlier runs.
    while events.try_recv().is_ok() {}
    let before = rig.cpu_snapshot();
    let sent = Instant::now();
    let started = rig.json(&["session", "send", session, "go", "--detach", "--json"]);
    let run = started["run"]["id"].as_str().unwrap();
    let mut turn = collect(events, run, sent).inspect_err(|_| cancel(rig, events, session, run))?;
    turn.cpu = rig.cpu_since(&before);
    Ok(turn)
}

/// The ceiling: the fake's reply read by the bench over HTTP, with nothing in between.
fn provider_alone() -> f64 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let fake = rt.block_on(FakeProvider::start((0..3).map(|_| long_reply()).collect()));
    let client = reqwest::blocking::Client::builder()
        .timeout(None)
        .build()
        .unwrap();
    let mut rates = Vec::new();
    for _ in 0..3 {
        let response = client
            .post(format!("{}/v1/chat/completions", fake.base_url()))
            .body("{}")
            .send()
            .unwrap();
        let mut reader = BufReader::with_capacity(1 << 16, response);
        let (mut line, mut first, mut last, mut n) = (String::new(), None, None, 0);
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap() == 0 {
                break;
            }
            if line.contains(r#""delta":{"content":"t"#) {
                let at = Instant::now();
                first.get_or_insert(at);
                last = Some(at);
                n += 1;
            }
        }
        let span: Duration = last.unwrap() - first.unwrap();
        rates.push(n as f64 / span.as_secs_f64());
    }
    median(rates)
}

fn part_a() {
    let ceiling = provider_alone();
    let rig = Rig::start((0..2 * (ROUNDS + 1)).map(|_| long_reply()).collect(), "");

    // Warm-up turns create the sessions; a worker session's includes leasing and provisioning
    // its box.
    let mut warmups = Vec::new();
    let mut sessions = Vec::new();
    for profile in [None, Some("local")] {
        let started = Instant::now();
        let run = rig.new_session(profile, "go");
        let session = run["session"]["id"].as_str().unwrap().to_owned();
        let run = run["run"]["id"].as_str().unwrap().to_owned();
        let events = rig.follow(&session);
        let warmup = collect(&events, &run, started).map(|_| started.elapsed());
        if warmup.is_err() {
            cancel(&rig, &events, &session, &run);
        }
        warmups.push(warmup);
        sessions.push((session, events));
    }
    let detail = rig.json(&["session", "show", "--json", &sessions[1].0]);
    let env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap_or_else(|| panic!("the worker session has no box: {detail}"))
        .to_owned();
    let direct_warmup = warmups[0].clone().unwrap();
    let mut worker_failure = warmups[1].clone().err();

    // Alternate, so that the box's background noise falls on both alike.
    let (mut direct, mut worker) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        direct.push(turn(&rig, &sessions[0].1, &sessions[0].0).unwrap());
        if worker_failure.is_none() {
            match turn(&rig, &sessions[1].1, &sessions[1].0) {
                Ok(t) => worker.push(t),
                Err(e) => worker_failure = Some(e),
            }
        }
    }
    for t in direct.iter().chain(&worker) {
        assert_eq!(t.deltas, TOKENS, "every chunk is one text_delta event");
    }
    rig.json(&["env", "destroy", &env, "--force", "--json"]);

    let figures = |turns: &[Turn]| {
        (
            median(turns.iter().map(|t| ms(t.ttft)).collect()),
            median(turns.iter().map(|t| ms(t.send_to_first)).collect()),
            median(turns.iter().map(|t| t.tokens_per_s).collect()),
        )
    };
    let all = |turns: &[Turn], f: fn(&Turn) -> f64| {
        turns
            .iter()
            .map(|t| format!("{:.0}", f(t)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (d_ttft, d_send, d_rate) = figures(&direct);
    println!("A. one {TOKENS}-chunk reply per turn, median of {ROUNDS} turns each");
    println!("  provider alone (bench reads the fake)  {ceiling:>9.0} tokens/s");
    match &warmups[1] {
        Ok(w) => println!(
            "  warm-up turn incl. creation  direct {:>7.0} ms   worker {:>7.0} ms (with provisioning)",
            ms(direct_warmup),
            ms(*w)
        ),
        Err(_) => println!(
            "  warm-up turn incl. creation  direct {:>7.0} ms   worker -",
            ms(direct_warmup)
        ),
    }
    if let Some(failure) = &worker_failure {
        println!(
            "  WORKER TURN FAILED after {} good worker turns: {failure}",
            worker.len()
        );
    }
    if worker.is_empty() {
        println!("                       direct");
        println!("  TTFT (ms)          {d_ttft:>8.1}");
        println!("  send → first (ms)  {d_send:>8.1}");
        println!("  tokens/s           {d_rate:>8.0}");
        println!(
            "  gateway CPU s/turn {:>8.2}",
            median(direct.iter().map(|t| t.cpu.gateway).collect())
        );
        println!("  throughput worker/direct         -   (target >= 0.90)");
        println!("  added TTFT                       -   (target <= 5 ms)");
        println!(
            "  per turn: tokens/s direct [{}]",
            all(&direct, |t| t.tokens_per_s)
        );
        return;
    }
    let (w_ttft, w_send, w_rate) = figures(&worker);
    let cpu =
        |turns: &[Turn], f: fn(&Cpu) -> f64| median(turns.iter().map(|t| f(&t.cpu)).collect());
    println!(
        "                       direct       worker{}",
        if worker.len() < ROUNDS {
            format!(" ({} of {ROUNDS} turns)", worker.len())
        } else {
            String::new()
        }
    );
    println!("  TTFT (ms)          {d_ttft:>8.1}     {w_ttft:>8.1}");
    println!("  send → first (ms)  {d_send:>8.1}     {w_send:>8.1}");
    println!("  tokens/s           {d_rate:>8.0}     {w_rate:>8.0}");
    println!(
        "  throughput worker/direct     {:>8.3}   (target >= 0.90)",
        w_rate / d_rate
    );
    println!(
        "  added TTFT                   {:>8.1} ms   (target <= 5 ms)",
        w_ttft - d_ttft
    );
    println!("  added send → first token     {:>8.1} ms", w_send - d_send);
    println!("  CPU s per turn, send to run end (median):");
    println!(
        "    gateway process    {:>8.2}     {:>8.2}",
        cpu(&direct, |c| c.gateway),
        cpu(&worker, |c| c.gateway)
    );
    println!(
        "    its reaped children{:>8.2}     {:>8.2}   (git, rsync, ssh commands)",
        cpu(&direct, |c| c.reaped),
        cpu(&worker, |c| c.reaped)
    );
    println!(
        "    outside the gateway{:>8.2}     {:>8.2}   (ssh masters, box proxies, sshd, worker)",
        cpu(&direct, |c| c.outside),
        cpu(&worker, |c| c.outside)
    );
    println!(
        "  per turn: tokens/s direct [{}] worker [{}]",
        all(&direct, |t| t.tokens_per_s),
        all(&worker, |t| t.tokens_per_s)
    );
    println!(
        "  per turn: TTFT ms direct [{}] worker [{}]",
        all(&direct, |t| ms(t.ttft)),
        all(&worker, |t| ms(t.ttft))
    );
}

/// The gateway process's CPU time and memory.
#[derive(Clone, Copy)]
struct Sample {
    cpu: Duration,
    rss_kb: u64,
    hwm_kb: u64,
    threads: u64,
}

fn sample(rig: &Rig) -> Sample {
    let pid = rig.pid;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After the command name (in parentheses, which may hold spaces): state is field 3,
    // utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    Sample {
        cpu: Duration::from_secs_f64(ticks as f64 / rig.ticks_per_s),
        rss_kb: field("VmRSS:"),
        hwm_kb: field("VmHWM:"),
        threads: field("Threads:"),
    }
}

/// One process as /proc shows it.
struct Proc {
    pid: u32,
    ppid: u32,
    cmdline: String,
    /// utime + stime, and cutime + cstime (children reaped), in ticks.
    ticks: u64,
    reaped_ticks: u64,
    /// The inode of its network namespace.
    netns: u64,
}

fn procs() -> Vec<Proc> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(cmdline), Ok(stat)) = (
            std::fs::read(entry.path().join("cmdline")),
            std::fs::read_to_string(entry.path().join("stat")),
        ) else {
            continue;
        };
        // After the command name (in parentheses, which may hold spaces): state is field 3,
        // ppid 4, utime and stime 14 and 15, cutime and cstime 16 and 17.
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let f: Vec<u64> = stat[close + 2..]
            .split(' ')
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        if f.len() < 15 {
            continue;
        }
        let netns = std::fs::read_link(entry.path().join("ns/net"))
            .ok()
            .and_then(|l| {
                let l = l.to_string_lossy().into_owned();
                l.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
            })
            .unwrap_or(0);
        all.push(Proc {
            pid,
            netns,
            ppid: u32::try_from(f[1]).unwrap_or(0),
            cmdline: String::from_utf8_lossy(&cmdline).replace('\0', " "),
            ticks: f[11] + f[12],
            reaped_ticks: f[13] + f[14],
        });
    }
    all
}

/// Processes other than `except` whose command line names one of `needles`, their
/// descendants, and every process in one of the network namespaces `netns` (a box's sshd and
/// worker name the box root; the box proxy that carries an ssh master's connection into the
/// box's namespace names nothing of ours and has left its parent behind).
fn ours(all: &[Proc], needles: &[&str], netns: &[u64], except: u32) -> Vec<u32> {
    let mut pids: Vec<u32> = all
        .iter()
        .filter(|p| p.pid != except)
        .filter(|p| needles.iter().any(|n| p.cmdline.contains(n)) || netns.contains(&p.netns))
        .map(|p| p.pid)
        .collect();
    loop {
        let more: Vec<u32> = all
            .iter()
            .filter(|p| p.pid != except && pids.contains(&p.ppid) && !pids.contains(&p.pid))
            .map(|p| p.pid)
            .collect();
        if more.is_empty() {
            return pids;
        }
        pids.extend(more);
    }
}

/// The network namespaces (inodes) of the boxes under `root`.
fn box_namespaces(root: &Path) -> Vec<u64> {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let record: Value =
                serde_json::from_str(&std::fs::read_to_string(e.path().join("box.json")).ok()?)
                    .ok()?;
            let name = record["netns"].as_str()?;
            Some(std::fs::metadata(format!("/run/netns/{name}")).ok()?.ino())
        })
        .collect()
}

/// How many processes match (see [`ours`]), and their proportional set size in kB (shared
/// pages split between the processes that map them, so the sum is what they cost together).
fn count_processes(rig: &Rig, needles: &[&str], netns: &[u64]) -> (usize, u64) {
    let pids = ours(&procs(), needles, netns, rig.pid);
    let pss = pids
        .iter()
        .filter_map(|pid| {
            let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
            let line = rollup.lines().find(|l| l.starts_with("Pss:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum();
    (pids.len(), pss)
}

/// Ticks per process at one moment: the gateway's own and reaped, and everything outside.
struct CpuSnapshot {
    gateway: (u64, u64),
    outside: std::collections::HashMap<u32, u64>,
}

impl Rig {
    fn cpu_snapshot(&self) -> CpuSnapshot {
        let all = procs();
        let needles = [self.state.to_str().unwrap(), self.boxes.to_str().unwrap()];
        let outside = ours(&all, &needles, &box_namespaces(&self.boxes), self.pid);
        let gateway = all
            .iter()
            .find(|p| p.pid == self.pid)
            .map_or((0, 0), |p| (p.ticks, p.reaped_ticks));
        CpuSnapshot {
            gateway,
            outside: all
                .iter()
                .filter(|p| outside.contains(&p.pid))
                .map(|p| (p.pid, p.ticks))
                .collect(),
        }
    }

    /// CPU seconds since `before` (a process that started and ended in between is not seen,
    /// unless the gateway reaped it).
    fn cpu_since(&self, before: &CpuSnapshot) -> Cpu {
        let after = self.cpu_snapshot();
        let tick = 1.0 / self.ticks_per_s;
        let outside: u64 = after
            .outside
            .iter()
            .map(|(pid, t)| t - before.outside.get(pid).copied().unwrap_or(0).min(*t))
            .sum();
        Cpu {
            gateway: (after.gateway.0 - before.gateway.0) as f64 * tick,
            reaped: (after.gateway.1 - before.gateway.1) as f64 * tick,
            outside: outside as f64 * tick,
        }
    }
}

/// Runs `f` for every item on threads of its own, all at once, and returns the results in order.
fn all_at_once<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = items.into_iter().map(|item| s.spawn(|| f(item))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn part_b() {
    let responses = (0..2 * SESSIONS).map(|_| reply(&["ok"])).collect();
    let rig = Rig::start(responses, "[gateway]\nmax_workers = 64\n");
    let state = rig.state.display().to_string();
    let boxes = rig.boxes.display().to_string();
    std::thread::sleep(Duration::from_secs(1));
    let empty = sample(&rig);

    let started = Instant::now();
    // One after the other: concurrent `git worktree add` on one repository fails in git
    // itself. Detached, each returns once its workspace exists, so the 50 placements
    // (provisioning, sync, worker start) still run all at once.
    let first: Vec<(String, String)> = (0..SESSIONS)
        .map(|_| {
            let run = rig.new_session(Some("local"), "hi");
            (
                run["session"]["id"].as_str().unwrap().to_owned(),
                run["run"]["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let created = started.elapsed();
    rig.wait_runs(&first);
    let placed = started.elapsed();
    let after_placing = sample(&rig);

    // Idle: let the last reconciliations settle, then watch a quiet window.
    std::thread::sleep(Duration::from_secs(2));
    let idle_from = sample(&rig);
    let window = Duration::from_secs(10);
    std::thread::sleep(window);
    let attached = sample(&rig);
    let helpers = count_processes(&rig, &[&state], &[]);
    let on_boxes = count_processes(&rig, &[&boxes], &box_namespaces(&rig.boxes));

    let turn_started = Instant::now();
    let second: Vec<(String, String)> = all_at_once(first.clone(), |(session, _)| {
        let run = rig.json(&["session", "send", &session, "hi", "--detach", "--json"]);
        (session, run["run"]["id"].as_str().unwrap().to_owned())
    });
    rig.wait_runs(&second);
    let turned = turn_started.elapsed();
    let after_turn = sample(&rig);
    assert_eq!(rig.fake.requests().len(), 2 * SESSIONS);

    // Teardown through the gateway; the rig's drop destroys anything it leaves.
    let teardown = Instant::now();
    let list = rig.json(&["env", "list", "--json"]);
    let envs: Vec<String> = list["environments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["state"] != "destroyed")
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    all_at_once(envs.clone(), |env| {
        rig.json(&["env", "destroy", &env, "--force", "--json"])
    });
    let torn_down = teardown.elapsed();
    let left = std::fs::read_dir(&rig.boxes).unwrap().count();

    let n = SESSIONS as f64;
    let mb = |kb: u64| kb as f64 / 1024.0;
    let secs = |a: Sample, b: Sample| (b.cpu - a.cpu).as_secs_f64();
    println!();
    println!(
        "B. {SESSIONS} worker sessions through one gateway ({} ticks/s)",
        rig.ticks_per_s
    );
    println!(
        "  created (detached) in {:.1} s; all first turns done after {:.1} s",
        created.as_secs_f64(),
        placed.as_secs_f64()
    );
    println!(
        "  gateway with 0 workers         RSS {:>7.1} MB   CPU {:>7.2} s   threads {}",
        mb(empty.rss_kb),
        empty.cpu.as_secs_f64(),
        empty.threads
    );
    println!(
        "  gateway with {SESSIONS} attached, idle  RSS {:>7.1} MB   CPU {:>7.2} s   threads {}   (peak RSS so far {:.1} MB)",
        mb(attached.rss_kb),
        attached.cpu.as_secs_f64(),
        attached.threads,
        mb(attached.hwm_kb)
    );
    println!(
        "  per attached worker: RSS {:>7.2} MB",
        mb(attached.rss_kb.saturating_sub(empty.rss_kb)) / n
    );
    println!(
        "  per worker, creation to first turn done: CPU {:>7.1} ms",
        secs(empty, after_placing) * 1000.0 / n
    );
    println!(
        "  idle, {SESSIONS} attached, over {} s: CPU {:.1} ms/s in all, {:.3} ms/s per worker (resolution {:.1} ms/s)",
        window.as_secs(),
        secs(idle_from, attached) * 1000.0 / window.as_secs_f64(),
        secs(idle_from, attached) * 1000.0 / window.as_secs_f64() / n,
        1000.0 / rig.ticks_per_s / window.as_secs_f64()
    );
    println!(
        "  one short turn on each of the {SESSIONS}, all at once: {:.1} s wall, CPU {:.2} s in all, {:.1} ms per turn",
        turned.as_secs_f64(),
        secs(attached, after_turn),
        secs(attached, after_turn) * 1000.0 / n
    );
    println!(
        "  ssh masters (gateway side): {} processes, {:.1} MB PSS, {:.2} MB per worker",
        helpers.0,
        mb(helpers.1),
        mb(helpers.1) / n
    );
    println!(
        "  in the boxes (sshd, workers, box proxies): {} processes, {:.1} MB PSS, {:.2} MB per worker",
        on_boxes.0,
        mb(on_boxes.1),
        mb(on_boxes.1) / n
    );
    println!(
        "  teardown: {} environments destroyed in {:.1} s; boxes left {left}",
        envs.len(),
        torn_down.as_secs_f64()
    );
}

impl Rig {
    /// `session new --profile local --json` spawned and followed: the time to the turn's first
    /// `model_request` event, and the session. Waits for the turn to succeed.
    fn new_until_model_request(&self, prompt: &str) -> (Duration, String) {
        self.new_in_until_model_request(self.repo.path(), prompt)
    }

    /// [`Rig::new_until_model_request`] on another workspace.
    fn new_in_until_model_request(&self, workspace: &Path, prompt: &str) -> (Duration, String) {
        let started = Instant::now();
        let mut child = Command::new(SKIFF)
            .arg("--state-dir")
            .arg(&self.state)
            .args([
                "session",
                "new",
                "--json",
                "--profile",
                "local",
                "--model",
                MODEL,
            ])
            .arg("--workspace")
            .arg(workspace)
            .arg(prompt)
            .env("HOME", &self.home)
            .env_remove("SKIFF_URL")
            .env_remove("SKIFF_TOKEN")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (mut first, mut session) = (None, String::new());
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
            session = event["session_id"].as_str().unwrap().to_owned();
            if event["type"] == "model_request" {
                first.get_or_insert_with(|| started.elapsed());
            }
        }
        assert!(child.wait().unwrap().success(), "session {session} failed");
        (first.expect("the turn asked no model"), session)
    }

    /// Polls (there is no event for an environment) until `ok` holds of the environment list.
    fn wait_envs(&self, what: &str, ok: impl Fn(&[Value]) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let list = self.json(&["env", "list", "--json"]);
            if ok(list["environments"].as_array().unwrap()) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {list:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Until every session is parked and its box idle in the pool.
    fn wait_all_parked(&self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let list = self.json(&["session", "list", "--json"]);
            if list["sessions"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s["placement"] == "parked")
            {
                break;
            }
            assert!(Instant::now() < deadline, "sessions not parked: {list:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_envs("a box still attached", |envs| {
            envs.iter().all(|e| e["state"] != "attached")
        });
    }
}

fn part_c() {
    println!(
        "\nC. boxes coming back: `session new --profile local` → first model request, median of {PARK_RUNS}"
    );
    let rig = Rig::start_with(
        (0..2 * PARK_RUNS + 1).map(|_| reply(&["ok"])).collect(),
        "[gateway]\nlifetime_tick = \"100ms\"\n",
        "keep_attached = \"1s\"\n",
    );
    // The first session pays what happens once per gateway (hashing the bundle, the first box).
    rig.new_until_model_request("prime");
    let (mut warm, mut cold) = (Vec::new(), Vec::new());
    for i in 0..PARK_RUNS {
        // The previous session was parked by the lifetime tick: its box is idle in the pool.
        rig.wait_all_parked();
        let (took, _) = rig.new_until_model_request(&format!("warm {i}"));
        warm.push(took);
        rig.wait_all_parked();
        // No box in the pool: the next session leases a fresh one.
        let list = rig.json(&["env", "list", "--json"]);
        for env in list["environments"].as_array().unwrap() {
            if env["state"] == "idle" {
                rig.json(&["env", "destroy", env["id"].as_str().unwrap(), "--json"]);
            }
        }
        let (took, _) = rig.new_until_model_request(&format!("cold {i}"));
        cold.push(took);
    }
    drop(rig);

    // A full gateway: each new session parks the one before it and takes its box.
    let rig = Rig::start(
        (0..PARK_RUNS + 1).map(|_| reply(&["ok"])).collect(),
        "[gateway]\nmax_workers = 1\n",
    );
    rig.new_until_model_request("prime");
    let mut on_demand = Vec::new();
    for i in 0..PARK_RUNS {
        let (took, _) = rig.new_until_model_request(&format!("full {i}"));
        on_demand.push(took);
    }
    let list = rig.json(&["env", "list", "--json"]);
    let boxes = list["environments"].as_array().unwrap().len();
    drop(rig);

    let (warm, cold, on_demand) = (median(warm), median(cold), median(on_demand));
    println!("  warm box, parked by the tick        {:>8.1} ms", ms(warm));
    println!("  cold box                            {:>8.1} ms", ms(cold));
    println!(
        "  warm box, parked on demand          {:>8.1} ms   ({boxes} leased for {} sessions)",
        ms(on_demand),
        PARK_RUNS + 1
    );
    println!(
        "  ratio cold/warm                     {:>8.2}",
        cold.as_secs_f64() / warm.as_secs_f64()
    );
    println!(
        "  ratio cold/parked on demand         {:>8.2}",
        cold.as_secs_f64() / on_demand.as_secs_f64()
    );
}

/// A Python static file server on 127.0.0.1 for part D, stopped on drop.
struct Registry {
    child: Child,
    port: u16,
}

impl Registry {
    fn start(dir: &Path) -> Registry {
        let script = format!(
            "import functools, http.server\n\
             class Quiet(http.server.SimpleHTTPRequestHandler):\n\
             \x20   def log_message(self, *args): pass\n\
             h = functools.partial(Quiet, directory={:?})\n\
             s = http.server.ThreadingHTTPServer(('127.0.0.1', 0), h)\n\
             print(s.server_address[1], flush=True)\n\
             s.serve_forever()\n",
            dir.display().to_string()
        );
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        Registry {
            child,
            port: line.trim().parse().unwrap(),
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A wheel of `skiffbench` 1.0 (with 2 MiB of data, so the install moves some bytes) and a
/// 64 MiB file, in `dir`.
fn registry_files(dir: &Path) {
    let script = r#"
import base64, hashlib, os, sys, zipfile
files = {
    "skiffbench/__init__.py": b"VALUE = 1\n",
    "skiffbench/data.bin": os.urandom(2 << 20),
    "skiffbench-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: skiffbench\nVersion: 1.0\n",
    "skiffbench-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for name, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{name},sha256={digest},{len(data)}\n"
record += "skiffbench-1.0.dist-info/RECORD,,\n"
with zipfile.ZipFile(sys.argv[1] + "/skiffbench-1.0-py3-none-any.whl", "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
    z.writestr("skiffbench-1.0.dist-info/RECORD", record)
with open(sys.argv[1] + "/big.bin", "wb") as f:
    f.write(os.urandom(64 << 20))
"#;
    assert!(
        Command::new("python3")
            .args(["-c", script])
            .arg(dir)
            .status()
            .unwrap()
            .success()
    );
}

/// Runs of each figure of part D.
const SETUP_RUNS: usize = 3;

fn part_d() {
    println!(
        "\nD. setup phase: `session new --profile local` → first model request, median of {SETUP_RUNS}; \
         setup = `pip install` of a 2 MiB wheel through the egress proxy"
    );
    let files = tempfile::tempdir().unwrap();
    registry_files(files.path());
    let registry = Registry::start(files.path());
    let rig = Rig::start_with(
        (0..6 * SETUP_RUNS + 3).map(|_| reply(&["ok"])).collect(),
        "[gateway]\nlifetime_tick = \"100ms\"\n",
        "keep_attached = \"1s\"\negress = { setup = [\"127.0.0.1\"] }\n",
    );
    let with_setup = TempGitRepo::new(&[
        ("README.md", "a repository whose setup installs a package\n"),
        ("requirements.txt", "skiffbench==1.0\n"),
        (
            ".skiff/setup.sh",
            &format!(
                "# skiff: key-files = requirements.txt\nset -e\n\
                 python3 -m pip install --user --break-system-packages --no-index --quiet \
                 --find-links http://127.0.0.1:{}/ -r requirements.txt\n",
                registry.port
            ),
        ),
    ]);
    let bump = |i: usize, what: &str| {
        std::fs::write(
            with_setup.path().join("requirements.txt"),
            format!("skiffbench==1.0\n# {what} {i}\n"),
        )
        .unwrap();
        with_setup.git(&["commit", "-qam", "A new key"]);
    };
    let destroy_idle = || {
        let list = rig.json(&["env", "list", "--json"]);
        for env in list["environments"].as_array().unwrap() {
            if env["state"] == "idle" {
                rig.json(&["env", "destroy", env["id"].as_str().unwrap(), "--json"]);
            }
        }
    };
    // Once per gateway: the bundle's hash and the first box.
    rig.new_until_model_request("prime");
    let (mut cold, mut warm, mut pool, mut snap, mut restored, mut plain) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for i in 0..SETUP_RUNS {
        // A key no snapshot has, and no box in the pool.
        rig.wait_all_parked();
        destroy_idle();
        bump(i, "cold");
        cold.push(rig.new_in_until_model_request(with_setup.path(), "cold").0);
        // A new key again, on a box from the pool.
        rig.wait_all_parked();
        bump(i, "warm");
        warm.push(rig.new_in_until_model_request(with_setup.path(), "warm").0);
        // The same key: the box that setup prepared, back in the pool.
        rig.wait_all_parked();
        pool.push(rig.new_in_until_model_request(with_setup.path(), "pool").0);
        // The same key, no box in the pool: a box made from the snapshot kept earlier.
        rig.wait_all_parked();
        destroy_idle();
        snap.push(
            rig.new_in_until_model_request(with_setup.path(), "snapshot")
                .0,
        );
        // The cold run's key again (its snapshot kept), with only the box prepared for the
        // warm run's key in the pool: that warm box, its home restored from the snapshot.
        rig.wait_all_parked();
        std::fs::write(
            with_setup.path().join("requirements.txt"),
            format!("skiffbench==1.0\n# cold {i}\n"),
        )
        .unwrap();
        with_setup.git(&["commit", "-qam", "The cold key again"]);
        restored.push(
            rig.new_in_until_model_request(with_setup.path(), "restored")
                .0,
        );
        // The baseline: a warm box, no setup at all.
        rig.wait_all_parked();
        plain.push(rig.new_until_model_request("plain").0);
    }
    let snapshots = rig.json(&["env", "snapshots", "--json"]);
    let kept = snapshots["snapshots"].as_array().map_or(0, Vec::len);
    drop(rig);
    let (cold, warm, pool, snap, restored, plain) = (
        median(cold),
        median(warm),
        median(pool),
        median(snap),
        median(restored),
        median(plain),
    );
    println!("  cold box, setup (+ snapshot kept)   {:>8.1} ms", ms(cold));
    println!("  warm box, setup (+ snapshot kept)   {:>8.1} ms", ms(warm));
    println!("  warm box setup already prepared     {:>8.1} ms", ms(pool));
    println!(
        "  box from the snapshot               {:>8.1} ms   ({kept} snapshots kept)",
        ms(snap)
    );
    println!(
        "  warm box, home restored from snap   {:>8.1} ms",
        ms(restored)
    );
    println!(
        "  warm box, no setup (baseline)       {:>8.1} ms",
        ms(plain)
    );
    println!(
        "  ratio snapshot/cold                 {:>8.2}",
        snap.as_secs_f64() / cold.as_secs_f64()
    );
    println!(
        "  ratio snapshot/warm without setup   {:>8.2}   (goal ≤ 1.5)",
        snap.as_secs_f64() / plain.as_secs_f64()
    );
    println!(
        "  ratio restored/warm without setup   {:>8.2}   (goal ≤ 1.5)",
        restored.as_secs_f64() / plain.as_secs_f64()
    );
    println!(
        "  ratio prepared/warm without setup   {:>8.2}",
        pool.as_secs_f64() / plain.as_secs_f64()
    );

    // Throughput: a 64 MiB download from the box through the proxy (the SSH forward and the
    // proxy) against the same download on the host, straight from the loopback server.
    let url = format!("http://127.0.0.1:{}/big.bin", registry.port);
    let curl = format!("curl -s -o /dev/null -w '%{{speed_download}}\\n' {url}");
    let mut direct = Vec::new();
    for _ in 0..SETUP_RUNS {
        let out = Command::new("sh").args(["-c", &curl]).output().unwrap();
        direct.push(
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse::<f64>()
                .unwrap(),
        );
    }
    let rig = Rig::start_with(
        vec![reply(&["ok"])],
        "",
        "egress = { setup = [\"127.0.0.1\"] }\n",
    );
    let downloads = TempGitRepo::new(&[
        ("README.md", "downloads\n"),
        (
            ".skiff/setup.sh",
            &format!("for i in $(seq {SETUP_RUNS}); do {curl}; done\n"),
        ),
    ]);
    let (_, session) = rig.new_in_until_model_request(downloads.path(), "download");
    let log = rig.json(&["session", "setup-log", "--json", &session]);
    let through: Vec<f64> = log["text"]
        .as_str()
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(through.len(), SETUP_RUNS, "{log}");
    let (direct, through) = (median(direct), median(through));
    println!(
        "  64 MiB download, host direct        {:>8.0} MB/s",
        direct / 1e6
    );
    println!(
        "  64 MiB download, box via the proxy  {:>8.0} MB/s   ratio {:.2} (goal ≥ 0.8)",
        through / 1e6,
        through / direct
    );
}

fn main() {
    assert!(
        skiff_providers::running_as_root(),
        "run as root: worker boxes get users and network namespaces"
    );
    let started = Instant::now();
    // `cargo bench` passes `--bench`; a bare word picks one part.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wants = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    if wants("streaming") {
        part_a();
    }
    if wants("scale") {
        part_b();
    }
    if wants("parking") {
        part_c();
    }
    if wants("setup") {
        part_d();
    }
    if wants("handoff") {
        part_e();
    }
    println!("\n(bench ran {:.0} s)", started.elapsed().as_secs_f64());
}

/// A model step that streams for about 2 s, then calls `exec` (part E).
fn slow_exec_step() -> FakeResponse {
    let words: Vec<String> = (0..20).map(|i| format!("s{i} ")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let mut events = openai_sse::text_chunks(&refs);
    events.extend(openai_sse::tool_call(
        0,
        "call_e",
        "exec",
        r#"{"command":"echo step >> steps.log"}"#,
        3,
    ));
    events.extend(openai_sse::finish("tool_calls"));
    events.extend(openai_sse::usage(100, 20));
    events.extend(openai_sse::done());
    FakeResponse::sse(events).with_delay(Duration::from_millis(100))
}

/// Sends a turn to `session`, asks `mover` (a `skiff session …` command line) once the
/// turn's first model step streams, and returns the turn's `--json` events.
fn moved_turn(rig: &Rig, session: &str, prompt: &str, mover: &[&str]) -> Vec<Value> {
    let mut child = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(&rig.state)
        .args(["session", "send", "--json", session, prompt])
        .env("HOME", &rig.home)
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen = Vec::new();
    let mut asked = false;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if !asked && event["type"] == "text_delta" {
            asked = true;
            let mut args = vec!["session"];
            args.extend(mover);
            let out = rig.cli(&args);
            assert!(
                out.status.success(),
                "skiff {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        seen.push(event);
    }
    assert!(child.wait().unwrap().success(), "the moved turn failed");
    seen
}

/// The handoff pause of a moved turn's events (see part E), in ms.
fn handoff_pause(seen: &[Value], settled: &str) -> f64 {
    let claim = seen
        .iter()
        .position(|e| e["type"] == "placement" && e["state"] == "handing_off")
        .unwrap_or_else(|| panic!("no handing_off step in {seen:#?}"));
    let barrier = claim
        + 1
        + seen[claim + 1..]
            .iter()
            .position(|e| e["type"] == "placement")
            .unwrap();
    let last_old = seen[..barrier]
        .iter()
        .rev()
        .find(|e| e["type"] != "placement")
        .unwrap();
    let settled_at = barrier
        + seen[barrier..]
            .iter()
            .position(|e| e["type"] == "placement" && e["state"] == settled)
            .unwrap();
    let first_new = seen[settled_at..]
        .iter()
        .find(|e| e["type"] != "placement")
        .unwrap();
    (first_new["at_ms"].as_i64().unwrap() - last_old["at_ms"].as_i64().unwrap()) as f64
}

fn part_e() {
    println!(
        "\nE. live handoff pause: last event at the old owner → first at the new, median of {ROUNDS}"
    );
    let mut responses = vec![reply(&["prime"])];
    for _ in 0..ROUNDS {
        responses.extend([slow_exec_step(), reply(&["on the box"])]);
        responses.extend([slow_exec_step(), reply(&["at home"])]);
    }
    let rig = Rig::start(responses, "");
    let started = rig.new_session(None, "prime");
    let session = started["session"]["id"].as_str().unwrap().to_owned();
    let run = started["run"]["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let detail = rig.json(&["session", "show", "--json", &session]);
        let last = detail["runs"].as_array().unwrap().last().unwrap().clone();
        if last["id"] == run.as_str() && terminal(&last["status"]) {
            break;
        }
        assert!(Instant::now() < deadline, "the first turn never ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A box in the idle pool, so every live dispatch takes a warm one.
    for args in [
        &["session", "dispatch", &session, "--profile", "local"][..],
        &["session", "pull-back", &session],
    ] {
        let out = rig.cli(args);
        assert!(
            out.status.success(),
            "skiff {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (mut out, mut home) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS {
        let seen = moved_turn(
            &rig,
            &session,
            &format!("out {i}"),
            &["dispatch", &session, "--profile", "local", "--live"],
        );
        out.push(handoff_pause(&seen, "active"));
        let seen = moved_turn(
            &rig,
            &session,
            &format!("home {i}"),
            &["pull-back", "--live", &session],
        );
        home.push(handoff_pause(&seen, "local"));
    }
    println!(
        "  gateway → warm box (dispatch --live)  {:>8.1} ms",
        median(out)
    );
    println!(
        "  box → gateway (pull-back --live)      {:>8.1} ms",
        median(home)
    );
}
