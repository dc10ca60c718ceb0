//! Cross-connection event delivery (issue 17), figures printed, never asserted: the time from
//! an append's call to its delivery at each of 100 followers (`Follower::next` returning it),
//! p50 and p99 over every (event, follower) pair.
//!
//! - **PostgreSQL, across stores**: appended through one `PgStore`, followed through another
//!   on the same database (as two gateways): the NOTIFY hint through the second store's
//!   listener, then each follower's read by cursor.
//! - **PostgreSQL, same store**: appended and followed through one `PgStore` (the in-process
//!   hint comes first).
//! - **SQLite, same process**: the baseline — one `Store`, in-process hints.
//!
//! - and, to tell the hint's trip from the fan-out's reads, PostgreSQL across stores with
//!   one follower.
//!
//! Each event is appended once every follower has the one before (closed loop), so the
//! figures are delivery latency, not queueing behind a backlog. The followers' reads share
//! their store's one connection, as a gateway's would.
//!
//! `cargo bench -p skiff-store --bench wakeups`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::event::EventKind;
use skiff_store::{Backend, Follower, NewSession, PgStore, Scope, Store};
use skiff_test_support::postgres::{Durability, PgCluster};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

const FOLLOWERS: usize = 100;
const EVENTS: usize = 200;
/// Followers read at least this often without a hint; long enough that the figures are the
/// hints'.
const POLL_EVERY: Duration = Duration::from_secs(1);

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

/// How many deliveries have been made, and a way to wait for a number of them.
struct Delivered {
    count: Mutex<usize>,
    changed: Condvar,
}

impl Delivered {
    fn add(&self, n: usize) {
        *self.count.lock().unwrap() += n;
        self.changed.notify_all();
    }

    fn wait_for(&self, n: usize) {
        let mut count = self.count.lock().unwrap();
        while *count < n {
            count = self.changed.wait(count).unwrap();
        }
    }
}

/// Every (event, follower) latency in milliseconds, sorted.
fn deliver(writer: &dyn Backend, reader: &dyn Backend, followers: usize) -> Vec<f64> {
    let s = session(writer);
    let sent: Mutex<Vec<Option<Instant>>> = Mutex::new(vec![None; EVENTS + 1]);
    let delivered = Delivered {
        count: Mutex::new(0),
        changed: Condvar::new(),
    };
    let ready = std::sync::Barrier::new(followers + 1);
    let mut latencies = std::thread::scope(|threads| {
        let readers: Vec<_> = (0..followers)
            .map(|_| {
                let (s, sent, delivered, ready) = (&s, &sent, &delivered, &ready);
                threads.spawn(move || {
                    let mut follower = Follower::new(reader, &scope(), s, 0, POLL_EVERY).unwrap();
                    ready.wait();
                    let mut latencies = Vec::with_capacity(EVENTS);
                    while follower.cursor() < EVENTS as u64 {
                        let events = follower.next(Duration::from_secs(30)).unwrap();
                        let now = Instant::now();
                        assert!(!events.is_empty(), "delivery stalled");
                        for event in &events {
                            let at = sent.lock().unwrap()[event.cursor as usize].unwrap();
                            latencies.push(now.duration_since(at).as_secs_f64() * 1e3);
                        }
                        delivered.add(events.len());
                    }
                    latencies
                })
            })
            .collect();
        ready.wait();
        for i in 1..=EVENTS {
            sent.lock().unwrap()[i] = Some(Instant::now());
            let event = writer
                .append_event(
                    &scope(),
                    &s,
                    None,
                    EventKind::TextDelta {
                        text: format!("word {i}"),
                    },
                )
                .unwrap();
            assert_eq!(event.cursor, i as u64);
            delivered.wait_for(i * followers);
        }
        readers
            .into_iter()
            .flat_map(|f| f.join().unwrap())
            .collect::<Vec<f64>>()
    });
    latencies.sort_by(f64::total_cmp);
    latencies
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank]
}

fn report(what: &str, sorted: &[f64], baseline: Option<f64>) -> f64 {
    let (p50, p99) = (percentile(sorted, 0.5), percentile(sorted, 0.99));
    let ratio = baseline.map_or(String::new(), |b| {
        format!("  (p99 {:.1}× the baseline)", p99 / b)
    });
    println!(
        "{what:<40} p50 {p50:>7.2} ms   p99 {p99:>7.2} ms   max {:>7.2} ms   n={}{ratio}",
        sorted[sorted.len() - 1],
        sorted.len()
    );
    p99
}

fn main() {
    println!(
        "event delivery to {FOLLOWERS} followers, {EVENTS} events each (from the append's call to Follower::next returning it)"
    );
    let dir = tempfile::tempdir().unwrap();
    let sqlite = Store::open(&dir.path().join("skiff.db")).unwrap();
    let baseline = report(
        "SQLite, same process (baseline)",
        &deliver(&sqlite, &sqlite, FOLLOWERS),
        None,
    );

    let cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
    let url = cluster.fresh_database();
    let (one, two) = (
        PgStore::connect(&url).unwrap(),
        PgStore::connect(&url).unwrap(),
    );
    report(
        "PostgreSQL, same store",
        &deliver(&two, &two, FOLLOWERS),
        Some(baseline),
    );
    report(
        "PostgreSQL, across stores",
        &deliver(&one, &two, FOLLOWERS),
        Some(baseline),
    );
    // One follower: the hint's own trip (NOTIFY, listener, read), without 100 reads
    // queueing on the reader's one connection.
    report(
        "PostgreSQL, across stores, 1 follower",
        &deliver(&one, &two, 1),
        None,
    );
}
