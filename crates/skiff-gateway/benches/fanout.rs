//! Live event fan-out through the hub (issue 17), figures printed, never asserted: the time
//! from `Hub::publish`'s call to each of 100 subscribers receiving the event, p50 and p99 over
//! every (event, subscriber) pair, in one run:
//!
//! - **same gateway**: the subscribers follow the publishing hub (the in-process broadcast);
//! - **across gateways**: they follow a second hub on a second `PgStore` on the same database
//!   (NOTIFY wake-up, one read by cursor per session, fanned out) — goal p99 ≤ 50 ms;
//! - and the same-gateway figure on SQLite, as the baseline.
//!
//! Each event is published once every subscriber has the one before (closed loop), so the
//! figures are delivery latency, not queueing behind a backlog.
//!
//! `cargo bench -p skiff-gateway --bench fanout`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use skiff_gateway::Hub;
use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::event::EventKind;
use skiff_store::{Backend, NewSession, PgStore, Scope, Store};
use skiff_test_support::postgres::{Durability, PgCluster};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

const SUBSCRIBERS: usize = 100;
const EVENTS: usize = 300;

fn scope() -> Scope {
    Scope::new("usr_bench", "ten_bench")
}

fn session(store: &dyn Backend) -> SessionId {
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    store
        .create_session(
            &scope(),
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

#[derive(Default)]
struct Delivered {
    count: Mutex<usize>,
    changed: Condvar,
}

/// Every (event, subscriber) latency in ms, sorted: published through `publisher` (whose
/// store is `store`), followed through `follower`.
fn deliver(
    rt: &tokio::runtime::Runtime,
    store: &dyn Backend,
    publisher: &Arc<Hub>,
    follower: &Arc<Hub>,
) -> Vec<f64> {
    let id = session(store);
    let sent: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; EVENTS + 1]));
    let delivered = Arc::new(Delivered::default());
    let tasks: Vec<_> = (0..SUBSCRIBERS)
        .map(|_| {
            let stream = follower.subscribe(scope(), id.clone(), 0).unwrap();
            let (sent, delivered) = (sent.clone(), delivered.clone());
            rt.spawn(async move {
                let mut stream = std::pin::pin!(stream);
                let mut latencies = Vec::with_capacity(EVENTS);
                while latencies.len() < EVENTS {
                    let event = stream.next().await.unwrap().unwrap();
                    let at = sent.lock().unwrap()[event.cursor as usize].unwrap();
                    latencies.push(at.elapsed().as_secs_f64() * 1e3);
                    *delivered.count.lock().unwrap() += 1;
                    delivered.changed.notify_all();
                }
                latencies
            })
        })
        .collect();
    for i in 1..=EVENTS {
        sent.lock().unwrap()[i] = Some(Instant::now());
        let event = publisher
            .publish(
                &scope(),
                &id,
                None,
                EventKind::TextDelta {
                    text: format!("word {i}"),
                },
            )
            .unwrap();
        assert_eq!(event.cursor, i as u64);
        let mut count = delivered.count.lock().unwrap();
        while *count < i * SUBSCRIBERS {
            count = delivered.changed.wait(count).unwrap();
        }
    }
    let mut all: Vec<f64> = tasks
        .into_iter()
        .flat_map(|t| rt.block_on(t).unwrap())
        .collect();
    all.sort_by(f64::total_cmp);
    all
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn report(what: &str, sorted: &[f64], baseline: Option<f64>) {
    let (p50, p99) = (percentile(sorted, 0.5), percentile(sorted, 0.99));
    let ratio = baseline.map_or(String::new(), |b| {
        format!("  (p99 {:.1}× the baseline)", p99 / b)
    });
    println!(
        "{what:<48} p50 {p50:>7.2} ms   p99 {p99:>7.2} ms   max {:>7.2} ms   n={}{ratio}",
        sorted[sorted.len() - 1],
        sorted.len()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "hub fan-out to {SUBSCRIBERS} subscribers, {EVENTS} events (from Hub::publish's call to each subscriber's stream)"
    );
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn Backend> = Arc::new(Store::open(&dir.path().join("skiff.db")).unwrap());
    let hub = Arc::new(Hub::new(sqlite.clone()));
    let base = deliver(&rt, &*sqlite, &hub, &hub);
    report("SQLite, same gateway (baseline)", &base, None);
    let baseline = percentile(&base, 0.99);

    let cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
    let url = cluster.fresh_database();
    let one: Arc<dyn Backend> = Arc::new(PgStore::connect(&url).unwrap());
    let two: Arc<dyn Backend> = Arc::new(PgStore::connect(&url).unwrap());
    let (hub_one, hub_two) = (Arc::new(Hub::new(one.clone())), Arc::new(Hub::new(two)));
    report(
        "PostgreSQL, same gateway",
        &deliver(&rt, &*one, &hub_one, &hub_one),
        Some(baseline),
    );
    report(
        "PostgreSQL, across gateways (goal p99 ≤ 50 ms)",
        &deliver(&rt, &*one, &hub_one, &hub_two),
        Some(baseline),
    );
}
