//! Several gateways on one PostgreSQL database (issue 17), figures printed, never asserted.
//!
//! Takeover: two gateways on one fresh database and one `[store] workspaces` directory, a fake
//! OpenAI-compatible provider behind both. A session's turn is started through gateway one
//! (which takes the session's lease at admission); once the fake has received the turn's model
//! request — the turn is mid-step — gateway one is killed with SIGKILL. Gateway two takes the
//! session over when the lease expires and runs the turn again as a new attempt, whose model
//! request the fake answers. Measured: kill → the first event written after the kill (by the
//! new owner: the killed gateway writes nothing more) as it arrives at a client following the
//! session on gateway two's `GET /v1/sessions/{id}/events`; and kill → the run's end there.
//! [`ROUNDS`] rounds each at the default `[gateway] lease_ttl` (5 s, not written in the
//! config) and at `lease_ttl = "2s"`, medians printed.
//!
//! `cargo bench -p skiff-cli --bench gateways` (`-- takeover` for that part alone).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use skiff_test_support::postgres::PgCluster;
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SKIFF: &str = env!("CARGO_BIN_EXE_skiff");
const MODEL: &str = "openai/m";
/// Takeover rounds per lease TTL.
const ROUNDS: usize = 3;
/// How long any wait may take before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(120);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn now_ms() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// One reply of `text`, finished, with usage.
fn reply(text: &str) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&[text]);
    events.extend(openai_sse::finish("stop"));
    events.extend(openai_sse::usage(100, 1));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

/// A `skiff gateway` process on a state dir of its own. Killed when dropped.
struct Gateway {
    child: Child,
    state: PathBuf,
    home: PathBuf,
    url: String,
    token: String,
}

impl Gateway {
    /// Starts a gateway named `name` under `dir` with `config` and waits for its listening line.
    fn start(dir: &Path, name: &str, config: &str) -> Gateway {
        let state = dir.join(name).join("state");
        let home = dir.join(name).join("home");
        std::fs::create_dir_all(&home).unwrap();
        let config_path = dir.join(name).join("skiff.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = Command::new(SKIFF)
            .arg("--state-dir")
            .arg(&state)
            .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "warn")
            .env("HOME", &home)
            .env("SKIFF_BENCH_PROVIDER_KEY", "sk-bench")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
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
        Gateway {
            child,
            state,
            home,
            url,
            token: file["token"].as_str().unwrap().to_owned(),
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

    /// Every event of `session` from the start, as (arrival, JSON), read on a thread of its own
    /// so that nothing the bench does delays a timestamp.
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
                if let Some(data) = line.strip_prefix("data:")
                    && let Ok(event) = serde_json::from_str(data.trim())
                    && tx.send((at, event)).is_err()
                {
                    return;
                }
            }
        });
        rx
    }

    /// SIGKILL, then reaped.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

fn terminal(status: &Value) -> bool {
    matches!(
        status.as_str(),
        Some("succeeded" | "failed" | "cancelled" | "timed_out" | "orphaned")
    )
}

/// What one takeover looked like from gateway two's follower.
struct Takeover {
    /// Kill → the first event written after it, as it arrived.
    first_event: Duration,
    /// That event's type.
    first_kind: String,
    /// Kill → the run's terminal status.
    finished: Duration,
}

/// One takeover round on a fresh database of `cluster`, `ttl` written into the config unless
/// `None` (the default).
fn takeover_round(
    cluster: &PgCluster,
    rt: &tokio::runtime::Runtime,
    repo: &TempGitRepo,
    ttl: Option<&str>,
) -> Takeover {
    // The owner's model call hangs (it is mid-step when killed); the new attempt's is answered.
    let fake = rt.block_on(FakeProvider::start_with(|requests| {
        if requests.len() == 1 {
            FakeResponse::stall()
        } else {
            reply("Finished after the takeover.")
        }
    }));
    let database = cluster.fresh_database();
    let dir = tempfile::tempdir().unwrap();
    let workspaces = dir.path().join("workspaces");
    let lease_ttl = ttl.map_or(String::new(), |ttl| format!("lease_ttl = \"{ttl}\"\n"));
    let config = format!(
        "[gateway]\n{lease_ttl}local_sandbox = \"off\"\n\
         [store]\nurl = \"{database}\"\nworkspaces = \"{}\"\n\
         [providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\n\
         api_key_env = \"SKIFF_BENCH_PROVIDER_KEY\"\n",
        workspaces.display(),
        fake.base_url(),
    );
    let mut one = Gateway::start(dir.path(), "one", &config);
    let two = Gateway::start(dir.path(), "two", &config);

    let started = one.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--model",
        MODEL,
        "--workspace",
        repo.path().to_str().unwrap(),
        "go on until you are stopped",
    ]);
    let session = started["session"]["id"].as_str().unwrap().to_owned();
    let events = two.follow(&session);
    // Mid-step: the owner's model request has arrived and is being (not) answered.
    rt.block_on(async {
        tokio::time::timeout(PATIENCE, fake.wait_for_requests(1))
            .await
            .expect("the owner's model request never arrived")
    });

    let killed_at_ms = now_ms();
    let killed = Instant::now();
    one.kill();

    let mut first: Option<(Duration, String)> = None;
    let deadline = killed + PATIENCE;
    let finished = loop {
        let wait = deadline.saturating_duration_since(Instant::now());
        let (arrived, event) = events
            .recv_timeout(wait)
            .unwrap_or_else(|_| panic!("no end of the taken-over turn within {PATIENCE:?}"));
        // Written after the kill: the new owner's.
        if first.is_none() && event["at_ms"].as_i64().unwrap_or(0) > killed_at_ms {
            first = Some((
                arrived - killed,
                event["type"].as_str().unwrap_or("?").to_owned(),
            ));
        }
        if event["type"] == "run_status" && terminal(&event["status"]) {
            assert_eq!(event["status"], "succeeded", "{event}");
            break arrived - killed;
        }
    };
    let (first_event, first_kind) = first.expect("the turn ended with no event after the kill");
    let detail = two.json(&["session", "show", &session, "--json"]);
    let statuses: Vec<&str> = detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["orphaned", "succeeded"], "{detail}");
    drop(two);
    Takeover {
        first_event,
        first_kind,
        finished,
    }
}

fn takeover() {
    let cluster = PgCluster::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let repo = TempGitRepo::new(&[("README.md", "a repository for the bench\n")]);
    println!(
        "takeover: gateway one killed (SIGKILL) mid-step; gateway two takes the session over, \
         {ROUNDS} rounds per lease_ttl"
    );
    for (label, ttl) in [("5s (the default)", None), ("2s", Some("2s"))] {
        let rounds: Vec<Takeover> = (0..ROUNDS)
            .map(|_| takeover_round(&cluster, &rt, &repo, ttl))
            .collect();
        let firsts: Vec<f64> = rounds.iter().map(|r| ms(r.first_event)).collect();
        let ends: Vec<f64> = rounds.iter().map(|r| ms(r.finished)).collect();
        let kinds: Vec<&str> = rounds.iter().map(|r| r.first_kind.as_str()).collect();
        println!(
            "  lease_ttl {label}: kill → the new attempt's first event at a follower on gateway \
             two, median {:.0} ms (rounds {:?}; first event {kinds:?}); kill → the turn \
             finished, median {:.0} ms (goal ≤ 10 s)",
            median(firsts.clone()),
            firsts.iter().map(|f| f.round()).collect::<Vec<_>>(),
            median(ends),
        );
    }
}

fn main() {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let wants = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    if wants("takeover") {
        takeover();
    }
}
