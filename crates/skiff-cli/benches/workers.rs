//! Worker figures (printed, never asserted), all from one run.
//!
//! A. Streaming through a worker. A fake OpenAI-compatible provider answers every turn with
//!    20,000 small text chunks. The same reply goes to a session on the gateway itself
//!    ("direct") and to a worker session on a local box, whose model calls travel worker → SSH
//!    tunnel → the gateway's inference proxy → provider, and whose live events travel back the
//!    same way before the gateway publishes them. Each session is created with a warm-up turn
//!    (provisioning is not counted), then the two take turns (`session send`) for 5 rounds.
//!    One client follows each session on `GET /v1/sessions/{id}/events` and timestamps every
//!    event when its line arrives.
//!    - TTFT: the turn's `model_request` event → its first `text_delta`, both at that client.
//!      On a worker the `model_request` event crosses the tunnel just ahead of the model call,
//!      so the difference to direct is what the worker path adds between the call leaving the
//!      loop and its first token showing: proxy admission, the provider call, the token's trip
//!      back to the worker and the `text_delta` event's trip to the gateway.
//!    - send → first token: `skiff session send` spawned → first `text_delta` (turn dispatch
//!      included; the CLI's process start is in both).
//!    - throughput: `text_delta` events / (last arrival − first arrival).
//!    The ceiling is the bench itself reading the fake's reply over HTTP.
//! B. 50 worker sessions through one gateway (`[gateway] max_workers = 64`): the gateway
//!    process's CPU time (utime + stime) and RSS with no worker, after 50 sessions finished
//!    their first turn (creation and provisioning, all at once), over an idle window with the
//!    50 attached, and over one more short turn on each of the 50, all at once. Completion is
//!    polled with `skiff session list --json` once a second; those polls are in the figures.
//!
//! `cargo bench -p skiff-cli --bench workers` (as root: boxes get users and namespaces)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
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
                 [profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n",
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
        Rig {
            gateway,
            pid,
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
}

/// Reads `events` until `run` ends (it must succeed), timing its text.
fn collect(events: &mpsc::Receiver<(Instant, String)>, run: &str, sent: Instant) -> Turn {
    let (mut model_request, mut first, mut last, mut deltas) = (None, None, None, 0);
    loop {
        let (at, data) = events
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|e| panic!("no end of run {run}: {e}"));
        let event: Value = serde_json::from_str(&data).unwrap();
        if event["run_id"] != run {
            continue;
        }
        match event["type"].as_str().unwrap() {
            "model_request" => {
                model_request.get_or_insert(at);
            }
            "text_delta" => {
                first.get_or_insert(at);
                last = Some(at);
                deltas += 1;
            }
            "run_status" if terminal(&event["status"]) => {
                assert_eq!(event["status"], "succeeded", "run {run}: {event}");
                break;
            }
            _ => {}
        }
    }
    let (model_request, first, last) = (model_request.unwrap(), first.unwrap(), last.unwrap());
    Turn {
        ttft: first - model_request,
        send_to_first: first - sent,
        tokens_per_s: deltas as f64 / (last - first).as_secs_f64(),
        deltas,
    }
}

/// `session send` (detached) and the turn as the follower saw it.
fn turn(rig: &Rig, events: &mpsc::Receiver<(Instant, String)>, session: &str) -> Turn {
    // Whatever is still queued belongs to earlier runs.
    while events.try_recv().is_ok() {}
    let sent = Instant::now();
    let started = rig.json(&["session", "send", session, "go", "--detach", "--json"]);
    collect(events, started["run"]["id"].as_str().unwrap(), sent)
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
        let events = rig.follow(&session);
        collect(&events, run["run"]["id"].as_str().unwrap(), started);
        warmups.push(started.elapsed());
        sessions.push((session, events));
    }
    let detail = rig.json(&["session", "show", "--json", &sessions[1].0]);
    assert_eq!(detail["session"]["placement"], "active", "{detail}");
    assert!(detail["session"]["worker"]["environment_id"].is_string());

    // Alternate, so that the box's background noise falls on both alike.
    let (mut direct, mut worker) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        direct.push(turn(&rig, &sessions[0].1, &sessions[0].0));
        worker.push(turn(&rig, &sessions[1].1, &sessions[1].0));
    }
    for t in direct.iter().chain(&worker) {
        assert_eq!(t.deltas, TOKENS, "every chunk is one text_delta event");
    }
    assert_eq!(rig.fake.requests().len(), 2 * (ROUNDS + 1));
    let env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    rig.json(&["env", "destroy", &env, "--force", "--json"]);

    let figures = |turns: &[Turn]| {
        (
            median(turns.iter().map(|t| ms(t.ttft)).collect()),
            median(turns.iter().map(|t| ms(t.send_to_first)).collect()),
            median(turns.iter().map(|t| t.tokens_per_s).collect()),
        )
    };
    let (d_ttft, d_send, d_rate) = figures(&direct);
    let (w_ttft, w_send, w_rate) = figures(&worker);
    let all = |turns: &[Turn], f: fn(&Turn) -> f64| {
        turns
            .iter()
            .map(|t| format!("{:.0}", f(t)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("A. one {TOKENS}-chunk reply per turn, median of {ROUNDS} turns each");
    println!("  provider alone (bench reads the fake)   {ceiling:>10.0} tokens/s");
    println!(
        "  warm-up turn incl. creation   direct {:>8.0} ms   worker {:>8.0} ms (box provisioning)",
        ms(warmups[0]),
        ms(warmups[1])
    );
    println!("                       direct       worker");
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

fn sample(pid: u32, ticks_per_s: f64) -> Sample {
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
        cpu: Duration::from_secs_f64(ticks as f64 / ticks_per_s),
        rss_kb: field("VmRSS:"),
        hwm_kb: field("VmHWM:"),
        threads: field("Threads:"),
    }
}

/// Processes other than the gateway whose command line names `needle`, and their RSS in kB.
fn processes_naming(needle: &str, except: u32) -> (usize, u64) {
    let (mut count, mut rss) = (0, 0);
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if pid == except || !String::from_utf8_lossy(&cmdline).contains(needle) {
            continue;
        }
        count += 1;
        if let Ok(status) = std::fs::read_to_string(entry.path().join("status"))
            && let Some(line) = status.lines().find(|l| l.starts_with("VmRSS:"))
        {
            rss += line
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    (count, rss)
}

/// Runs `f` for every item on threads of its own, all at once, and returns the results in order.
fn all_at_once<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = items.into_iter().map(|item| s.spawn(|| f(item))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn part_b() {
    let ticks_per_s: f64 = String::from_utf8(
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
    let responses = (0..2 * SESSIONS).map(|_| reply(&["ok"])).collect();
    let rig = Rig::start(responses, "[gateway]\nmax_workers = 64\n");
    let state = rig.state.display().to_string();
    let boxes = rig.boxes.display().to_string();
    std::thread::sleep(Duration::from_secs(1));
    let empty = sample(rig.pid, ticks_per_s);

    let started = Instant::now();
    let first: Vec<(String, String)> = all_at_once((0..SESSIONS).collect(), |_| {
        let run = rig.new_session(Some("local"), "hi");
        (
            run["session"]["id"].as_str().unwrap().to_owned(),
            run["run"]["id"].as_str().unwrap().to_owned(),
        )
    });
    let created = started.elapsed();
    rig.wait_runs(&first);
    let placed = started.elapsed();
    let after_placing = sample(rig.pid, ticks_per_s);

    // Idle: let the last reconciliations settle, then watch a quiet window.
    std::thread::sleep(Duration::from_secs(2));
    let idle_from = sample(rig.pid, ticks_per_s);
    let window = Duration::from_secs(10);
    std::thread::sleep(window);
    let attached = sample(rig.pid, ticks_per_s);
    let helpers = processes_naming(&state, rig.pid);
    let on_boxes = processes_naming(&boxes, rig.pid);

    let turn_started = Instant::now();
    let second: Vec<(String, String)> = all_at_once(first.clone(), |(session, _)| {
        let run = rig.json(&["session", "send", &session, "hi", "--detach", "--json"]);
        (session, run["run"]["id"].as_str().unwrap().to_owned())
    });
    rig.wait_runs(&second);
    let turned = turn_started.elapsed();
    let after_turn = sample(rig.pid, ticks_per_s);
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
    println!("B. {SESSIONS} worker sessions through one gateway ({ticks_per_s} ticks/s)");
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
        "  gateway with {SESSIONS} attached, idle  RSS {:>7.1} MB   CPU {:>7.2} s   threads {}   (peak RSS {:.1} MB)",
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
        "  idle, {SESSIONS} attached: CPU {:.1} ms/s in all, {:.3} ms/s per worker",
        secs(idle_from, attached) * 1000.0 / window.as_secs_f64(),
        secs(idle_from, attached) * 1000.0 / window.as_secs_f64() / n
    );
    println!(
        "  one short turn on each of the {SESSIONS}, all at once: {:.1} s wall, CPU {:.2} s in all, {:.1} ms per turn",
        turned.as_secs_f64(),
        secs(attached, after_turn),
        secs(attached, after_turn) * 1000.0 / n
    );
    println!(
        "  other processes naming the state dir (ssh masters, tunnels): {} using {:.1} MB RSS",
        helpers.0,
        mb(helpers.1)
    );
    println!(
        "  processes naming the box root (sshd, workers): {} using {:.1} MB RSS",
        on_boxes.0,
        mb(on_boxes.1)
    );
    println!(
        "  teardown: {} environments destroyed in {:.1} s; boxes left {left}",
        envs.len(),
        torn_down.as_secs_f64()
    );
}

fn main() {
    assert!(
        skiff_providers::running_as_root(),
        "run as root: worker boxes get users and network namespaces"
    );
    let started = Instant::now();
    part_a();
    part_b();
    println!("\n(bench ran {:.0} s)", started.elapsed().as_secs_f64());
}
