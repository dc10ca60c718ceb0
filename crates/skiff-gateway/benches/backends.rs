//! The gateway on SQLite and on PostgreSQL in one run (issue 17), figures printed, never
//! asserted:
//!
//! - **`GET /v1/sessions` with 10,000 sessions** (each with a finished run), through a real
//!   gateway listening on loopback, as its admin: the first page and a deep page
//!   (`?limit=100&before=` the 9,000th session), p50/p99 of sequential requests on one
//!   keep-alive connection. The sessions are seeded through the store's traits before the
//!   gateway starts (10,000 HTTP creations would make workspaces and cost minutes).
//! - **Event fan-out to 100 followers on one gateway**: the hub's subscribers of one session
//!   (what each `…/events` stream reads), events published at a steady rate from a thread of
//!   their own; the time from the publish call (which appends to the store) to each
//!   follower's receipt, p50/p99 over every (event, follower) pair, median of the rounds.
//!
//! PostgreSQL is a throwaway local cluster on a Unix socket with production durability
//! (`fsync = on`; the store's own sessions `synchronous_commit = off`), SQLite the state dir's
//! file in WAL mode; the ratios are PostgreSQL's figure over SQLite's.
//!
//! `cargo bench -p skiff-gateway --bench backends`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures_util::StreamExt;
use skiff_gateway::Hub;
use skiff_protocol::SessionId;
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::event::EventKind;
use skiff_store::{Backend, Location, NewSession, Scope, Sight};
use skiff_test_support::postgres::{Durability, PgCluster};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SESSIONS: usize = 10_000;
const PAGE: usize = 100;
/// Where the deep page starts: after this many sessions.
const DEEP: usize = 9_000;
const REQUESTS: usize = 200;
const FOLLOWERS: usize = 100;
const EVENTS: usize = 1_000;
/// A turn's streamed text arrives at this rate or below; PostgreSQL's serial append
/// (~0.1–0.2 ms here) keeps up with it, which 10,000/s it would not.
const RATE_PER_S: f64 = 1_000.0;
const FANOUT_ROUNDS: usize = 3;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn admin() -> Scope {
    Scope::new(skiff_store::FIRST_ADMIN, skiff_store::DEFAULT_TENANT)
}

fn new_session(store: &dyn Backend, scope: &Scope, n: usize) -> SessionId {
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    store
        .create_session(
            scope,
            &NewSession {
                id: id.clone(),
                title: format!("session {n}"),
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

/// `SESSIONS` sessions of the admin, each with a finished run; how long seeding took.
fn seed(store: &dyn Backend) -> Duration {
    let started = Instant::now();
    let scope = admin();
    for n in 0..SESSIONS {
        let id = new_session(store, &scope, n);
        let run = store.create_run(&scope, &id, "scripted/demo").unwrap();
        store
            .transition_run(&scope, &run.id, RunStatus::Cancelled, None)
            .unwrap();
    }
    started.elapsed()
}

/// The id the deep page starts after (the `DEEP`th session in the list's order).
fn deep_mark(store: &dyn Backend) -> SessionId {
    let rows = store
        .session_page(&Sight::own(admin()), DEEP, None)
        .unwrap();
    rows.last().unwrap().session.id.clone()
}

struct Listing {
    seeding: Duration,
    first: (Duration, Duration),
    deep: (Duration, Duration),
}

/// p50/p99 of `REQUESTS` sequential GETs of `url` (after a few warm-up requests), each
/// answered with `PAGE` sessions.
async fn timed_gets(client: &reqwest::Client, url: &str, token: &str) -> (Duration, Duration) {
    let get = || async {
        let response = client.get(url).bearer_auth(token).send().await.unwrap();
        assert!(
            response.status().is_success(),
            "{url}: {}",
            response.status()
        );
        let page: serde_json::Value = response.json().await.unwrap();
        assert_eq!(page["sessions"].as_array().unwrap().len(), PAGE, "{url}");
    };
    for _ in 0..5 {
        get().await;
    }
    let mut times = Vec::with_capacity(REQUESTS);
    for _ in 0..REQUESTS {
        let started = Instant::now();
        get().await;
        times.push(started.elapsed());
    }
    times.sort();
    (percentile(&times, 0.5), percentile(&times, 0.99))
}

/// Seeds `store` (then closes it), starts a gateway on the same store from `state_dir` with
/// `config` as its `skiff.toml`, and times its session list.
fn listing(
    rt: &tokio::runtime::Runtime,
    state_dir: &Path,
    config: &str,
    store: Arc<dyn Backend>,
) -> Listing {
    let seeding = seed(&*store);
    let mark = deep_mark(&*store);
    drop(store);
    std::fs::write(state_dir.join("skiff.toml"), config).unwrap();
    rt.block_on(async {
        let gateway = skiff_gateway::start(skiff_gateway::Options {
            state_dir: state_dir.to_path_buf(),
            listen: "127.0.0.1:0".into(),
            config: None,
        })
        .await
        .unwrap();
        let client = reqwest::Client::new();
        let base = format!("{}/v1/sessions?limit={PAGE}", gateway.url);
        let first = timed_gets(&client, &base, gateway.token.as_deref().unwrap_or_default()).await;
        let deep = timed_gets(
            &client,
            &format!("{base}&before={mark}"),
            gateway.token.as_deref().unwrap_or_default(),
        )
        .await;
        gateway.shutdown().await;
        Listing {
            seeding,
            first,
            deep,
        }
    })
}

/// One round of fan-out through a hub on `store`: p50 and p99 delivery latency.
fn fanout_round(rt: &tokio::runtime::Runtime, store: Arc<dyn Backend>) -> (Duration, Duration) {
    let scope = admin();
    let id = new_session(&*store, &scope, 0);
    let hub = Arc::new(Hub::new(store));
    let followers: Vec<_> = (0..FOLLOWERS)
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
    let publisher = std::thread::spawn(move || {
        let interval = Duration::from_secs_f64(1.0 / RATE_PER_S);
        let start = Instant::now();
        let mut sent = Vec::with_capacity(EVENTS);
        for i in 0..EVENTS {
            let due = start + interval * i as u32;
            // Sleep rather than spin: a spinning publisher would take one of the machine's
            // two cores away from the followers it is measuring.
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            sent.push(Instant::now());
            hub.publish(
                &scope,
                &id,
                None,
                EventKind::TextDelta {
                    text: format!("token {i} "),
                },
            )
            .unwrap();
        }
        sent
    });
    let sent = publisher.join().unwrap();
    let received = rt.block_on(futures_util::future::join_all(followers));
    let mut all: Vec<Duration> = received
        .into_iter()
        .flat_map(|r| {
            r.unwrap()
                .into_iter()
                .map(|(i, at)| at.saturating_duration_since(sent[i]))
        })
        .collect();
    assert_eq!(all.len(), EVENTS * FOLLOWERS, "some deliveries are missing");
    all.sort();
    (percentile(&all, 0.5), percentile(&all, 0.99))
}

/// Median p50 and median p99 (ms) of `FANOUT_ROUNDS` rounds.
fn fanout(rt: &tokio::runtime::Runtime, store: &Arc<dyn Backend>) -> (f64, f64) {
    fanout_round(rt, store.clone()); // warm-up
    let rounds: Vec<_> = (0..FANOUT_ROUNDS)
        .map(|_| fanout_round(rt, store.clone()))
        .collect();
    (
        median(rounds.iter().map(|r| ms(r.0)).collect()),
        median(rounds.iter().map(|r| ms(r.1)).collect()),
    )
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();

    // SQLite: the state dir's own file.
    let sqlite_dir = tempfile::tempdir().unwrap();
    let sqlite_store =
        skiff_store::open_backend(Location::Sqlite(&sqlite_dir.path().join("skiff.db"))).unwrap();
    let sqlite_fanout = fanout(&rt, &sqlite_store);
    let sqlite_list = listing(&rt, sqlite_dir.path(), "", sqlite_store);

    // PostgreSQL: a fresh database on a throwaway cluster.
    let cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
    let url = cluster.fresh_database();
    let pg_store = skiff_store::open_backend(Location::Postgres {
        url: &url,
        password: None,
    })
    .unwrap();
    let pg_fanout = fanout(&rt, &pg_store);
    let pg_dir = tempfile::tempdir().unwrap();
    let pg_list = listing(
        &rt,
        pg_dir.path(),
        &format!("[store]\nurl = \"{url}\"\n"),
        pg_store,
    );

    println!(
        "GET /v1/sessions?limit={PAGE}, {SESSIONS} sessions with a run each, as the admin, \
         {REQUESTS} sequential requests on one connection:"
    );
    println!(
        "  seeding through the store: SQLite {:.1} s, PostgreSQL {:.1} s",
        sqlite_list.seeding.as_secs_f64(),
        pg_list.seeding.as_secs_f64()
    );
    for (what, sqlite, pg) in [
        ("first page", sqlite_list.first, pg_list.first),
        ("deep page (after 9,000)", sqlite_list.deep, pg_list.deep),
    ] {
        println!(
            "  {what:<24} SQLite p50 {:7.2} ms  p99 {:7.2} ms | PostgreSQL p50 {:7.2} ms  \
             p99 {:7.2} ms | ratio p50 {:.2}  p99 {:.2}",
            ms(sqlite.0),
            ms(sqlite.1),
            ms(pg.0),
            ms(pg.1),
            ms(pg.0) / ms(sqlite.0),
            ms(pg.1) / ms(sqlite.1),
        );
    }
    println!(
        "event fan-out on one gateway: {EVENTS} events at {RATE_PER_S} events/s to \
         {FOLLOWERS} followers of one session (hub subscribers), median of {FANOUT_ROUNDS} \
         rounds:"
    );
    println!(
        "  SQLite      p50 {:7.3} ms  p99 {:7.3} ms",
        sqlite_fanout.0, sqlite_fanout.1
    );
    println!(
        "  PostgreSQL  p50 {:7.3} ms  p99 {:7.3} ms",
        pg_fanout.0, pg_fanout.1
    );
    println!(
        "  ratio PostgreSQL/SQLite p50 {:.2}  p99 {:.2}",
        pg_fanout.0 / sqlite_fanout.0,
        pg_fanout.1 / sqlite_fanout.1
    );
}
