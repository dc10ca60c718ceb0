//! Throughput figures (printed, never asserted): transcript append rate in commits of 8
//! entries, and live event fan-out latency at 10,000 events/s to 100 subscribers. Each is
//! compared with a baseline measured in the same run: raw SQLite inserts of the same rows, and
//! a bare tokio broadcast channel.
//!
//! `cargo bench -p skiff-gateway --bench throughput`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use skiff_gateway::Hub;
use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{StopReason, Usage};
use skiff_protocol::transcript::EntryBody;
use skiff_store::{NewSession, Scope, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};

const COMMITS: usize = 2_000;
const BATCH: usize = 8;
const ROUNDS: usize = 5;
const EVENTS: usize = 10_000;
const SUBSCRIBERS: usize = 100;
const RATE_PER_S: f64 = 10_000.0;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn session(store: &Store, scope: &Scope) -> SessionId {
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    store
        .create_session(
            scope,
            &NewSession {
                id: id.clone(),
                title: "bench".into(),
                workspace: WorkspaceView::Plain {
                    source: "/s".into(),
                    path: "/p".into(),
                },
                model_ref: "scripted/demo".into(),
            },
        )
        .unwrap();
    id
}

fn batch() -> Vec<EntryBody> {
    (0..BATCH)
        .map(|i| {
            if i % 2 == 0 {
                EntryBody::AssistantMessage {
                    reasoning: Vec::new(),
                    text:
                        "I'll read the file and then fix the failing assertion in the parser test."
                            .into(),
                    tool_calls: Vec::new(),
                    model: "scripted/demo (scripted)".into(),
                    usage: Usage {
                        input_tokens: 1200,
                        output_tokens: 80,
                        ..Usage::default()
                    },
                    stop_reason: StopReason::ToolUse,
                }
            } else {
                EntryBody::ToolResult {
                    images: Vec::new(),
                    call_id: format!("call_{i}"),
                    name: "read".into(),
                    content: "     1\tfn parse(input: &str) -> Result<Ast> {\n     2\t    todo\n"
                        .repeat(4),
                    is_error: false,
                }
            }
        })
        .collect()
}

/// Entries per second appended through the store's CAS batch append.
fn append_round() -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("bench.db")).unwrap();
    let scope = Scope::new("usr_bench", "ten_bench");
    let id = session(&store, &scope);
    let bodies = batch();
    let start = Instant::now();
    let mut leaf = None;
    for _ in 0..COMMITS {
        let entries = store
            .append_entries(&scope, &id, leaf.as_ref(), None, &bodies)
            .unwrap();
        leaf = entries.last().map(|e| e.id.clone());
    }
    (COMMITS * BATCH) as f64 / start.elapsed().as_secs_f64()
}

/// The same rows inserted with plain SQLite transactions: no CAS read, no id minting, no leaf
/// update. What the storage engine alone costs on this machine.
fn raw_sqlite_round() -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = rusqlite::Connection::open(dir.path().join("raw.db")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
    conn.execute_batch(
        "CREATE TABLE entries (id TEXT PRIMARY KEY, parent_id TEXT, kind TEXT, body TEXT)",
    )
    .unwrap();
    let bodies: Vec<String> = batch()
        .iter()
        .map(|b| serde_json::to_string(b).unwrap())
        .collect();
    let start = Instant::now();
    let mut n = 0u64;
    for _ in 0..COMMITS {
        let tx = conn.transaction().unwrap();
        {
            let mut stmt = tx
                .prepare_cached("INSERT INTO entries VALUES (?1, ?2, 'k', ?3)")
                .unwrap();
            for body in &bodies {
                n += 1;
                stmt.execute(rusqlite::params![
                    format!("ent_{n}"),
                    format!("ent_{}", n - 1),
                    body
                ])
                .unwrap();
            }
        }
        tx.commit().unwrap();
    }
    (COMMITS * BATCH) as f64 / start.elapsed().as_secs_f64()
}

/// Publishes EVENTS at RATE_PER_S from a dedicated thread; `publish` returns the instant the
/// event was handed over.
fn paced_publisher(
    mut publish: impl FnMut(usize) + Send + 'static,
) -> std::thread::JoinHandle<Vec<Instant>> {
    std::thread::spawn(move || {
        let interval = Duration::from_secs_f64(1.0 / RATE_PER_S);
        let start = Instant::now();
        let mut sent = Vec::with_capacity(EVENTS);
        for i in 0..EVENTS {
            let due = start + interval * i as u32;
            // Sleep rather than spin: a spinning publisher would take one of the machine's two
            // cores away from the subscribers it is measuring.
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            sent.push(Instant::now());
            publish(i);
        }
        sent
    })
}

fn latencies(sent: &[Instant], received: Vec<Vec<(usize, Instant)>>) -> (Duration, Duration) {
    let mut all: Vec<Duration> = received
        .into_iter()
        .flat_map(|r| {
            r.into_iter()
                .map(|(i, at)| at.saturating_duration_since(sent[i]))
        })
        .collect();
    assert_eq!(
        all.len(),
        EVENTS * SUBSCRIBERS,
        "some deliveries are missing"
    );
    all.sort();
    (percentile(&all, 0.50), percentile(&all, 0.99))
}

fn fanout_round(rt: &tokio::runtime::Runtime) -> (Duration, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("bench.db")).unwrap());
    let scope = Scope::new("usr_bench", "ten_bench");
    let id = session(&store, &scope);
    let hub = Arc::new(Hub::new(store));
    let subscribers: Vec<_> = (0..SUBSCRIBERS)
        .map(|_| {
            let stream = hub.subscribe(scope.clone(), id.clone(), 0).unwrap();
            rt.spawn(async move {
                let mut stream = std::pin::pin!(stream);
                let mut got = Vec::with_capacity(EVENTS);
                while got.len() < EVENTS {
                    let event = stream.next().await.unwrap().unwrap();
                    got.push((event.cursor as usize - 1, Instant::now()));
                }
                got
            })
        })
        .collect();
    let publisher = {
        let (hub, scope, id) = (hub.clone(), scope.clone(), id.clone());
        paced_publisher(move |i| {
            hub.publish(
                &scope,
                &id,
                None,
                EventKind::TextDelta {
                    text: format!("token {i} "),
                },
            )
            .unwrap();
        })
    };
    let sent = publisher.join().unwrap();
    let received = rt.block_on(async { futures_util::future::join_all(subscribers).await });
    latencies(&sent, received.into_iter().map(Result::unwrap).collect())
}

fn broadcast_round(rt: &tokio::runtime::Runtime) -> (Duration, Duration) {
    let (tx, _) = tokio::sync::broadcast::channel::<(usize, String)>(EVENTS);
    let subscribers: Vec<_> = (0..SUBSCRIBERS)
        .map(|_| {
            let mut rx = tx.subscribe();
            rt.spawn(async move {
                let mut got = Vec::with_capacity(EVENTS);
                while got.len() < EVENTS {
                    let (i, _text) = rx.recv().await.unwrap();
                    got.push((i, Instant::now()));
                }
                got
            })
        })
        .collect();
    let publisher = paced_publisher(move |i| {
        let _ = tx.send((i, format!("token {i} ")));
    });
    let sent = publisher.join().unwrap();
    let received = rt.block_on(async { futures_util::future::join_all(subscribers).await });
    latencies(&sent, received.into_iter().map(Result::unwrap).collect())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    println!(
        "transcript append: {ROUNDS} rounds of {COMMITS} CAS commits of {BATCH} entries (file-backed, WAL)"
    );
    let ours = median((0..ROUNDS).map(|_| append_round()).collect());
    let raw = median((0..ROUNDS).map(|_| raw_sqlite_round()).collect());
    println!("  skiff-store append      median {ours:>10.0} entries/s   (target >= 20000)");
    println!("  raw SQLite inserts      median {raw:>10.0} entries/s");
    println!("  ratio skiff/raw                {:>10.2}", ours / raw);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "event fan-out: {EVENTS} events at {RATE_PER_S} events/s to {SUBSCRIBERS} subscribers, 3 rounds"
    );
    let hub: Vec<_> = (0..3).map(|_| fanout_round(&rt)).collect();
    let bare: Vec<_> = (0..3).map(|_| broadcast_round(&rt)).collect();
    let (hub50, hub99) = (
        median(hub.iter().map(|r| ms(r.0)).collect()),
        median(hub.iter().map(|r| ms(r.1)).collect()),
    );
    let (raw50, raw99) = (
        median(bare.iter().map(|r| ms(r.0)).collect()),
        median(bare.iter().map(|r| ms(r.1)).collect()),
    );
    println!(
        "  hub (persisted + broadcast)  p50 {hub50:>7.3} ms   p99 {hub99:>7.3} ms   (target p99 <= 10 ms)"
    );
    println!("  bare tokio broadcast         p50 {raw50:>7.3} ms   p99 {raw99:>7.3} ms");
    println!(
        "  ratio hub/bare               p50 {:>7.2}      p99 {:>7.2}",
        hub50 / raw50.max(1e-9),
        hub99 / raw99.max(1e-9)
    );
}
