//! Transcript append throughput, SQLite against PostgreSQL in the same run (figures printed,
//! never asserted): one session's transcript grows by one entry per call, each a
//! compare-and-swap on the leaf, as a turn commits its entries; event appends likewise; and
//! both again from 8 threads at once, each appending to its own session, as a gateway serving
//! many sessions does. SQLite is a file in WAL mode with `synchronous = NORMAL`; PostgreSQL a
//! local cluster on a Unix socket configured as in production (`fsync = on`, the default
//! `synchronous_commit = on`), where `PgStore` sets `synchronous_commit = off` on its own
//! sessions — the same promise as SQLite's (an OS crash may lose the last commits, never
//! corrupt), so the two compare like with like. Also printed: how long the throwaway cluster
//! took to start, and the event append from a plain client without the connection thread.
//!
//! `cargo bench -p skiff-store --bench backends`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_store::{Backend, NewSession, PgStore, Scope, Store};
use skiff_test_support::postgres::{Durability, PgCluster};
use std::sync::Barrier;
use std::time::Instant;

const APPENDS: usize = 2_000;
const ROUNDS: usize = 5;
/// Threads appending at once in the concurrent rounds, each to its own session.
const THREADS: usize = 8;

fn new_session(store: &dyn Backend, scope: &Scope) -> SessionId {
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

fn entry() -> EntryBody {
    EntryBody::UserMessage {
        text: "a line of about the length a short model message has, give or take".into(),
    }
}

/// Appends per second, all threads together: `THREADS` threads each make `APPENDS / THREADS`
/// appends (`append(thread's session, i)`) on a session of their own, started together.
fn concurrent(
    store: &(dyn Backend + Sync),
    scope: &Scope,
    append: fn(&dyn Backend, &Scope, &SessionId, &mut Option<skiff_protocol::EntryId>),
) -> f64 {
    let sessions: Vec<SessionId> = (0..THREADS).map(|_| new_session(store, scope)).collect();
    let start = Barrier::new(THREADS + 1);
    let per_thread = APPENDS / THREADS;
    let started = std::thread::scope(|threads| {
        for id in &sessions {
            let start = &start;
            threads.spawn(move || {
                let mut leaf = None;
                start.wait();
                for _ in 0..per_thread {
                    append(store, scope, id, &mut leaf);
                }
            });
        }
        start.wait();
        Instant::now()
    });
    (per_thread * THREADS) as f64 / started.elapsed().as_secs_f64()
}

fn append_entry(
    store: &dyn Backend,
    scope: &Scope,
    id: &SessionId,
    leaf: &mut Option<skiff_protocol::EntryId>,
) {
    let entries = store
        .append_entries(scope, id, leaf.as_ref(), None, &[entry()])
        .unwrap();
    *leaf = entries.last().map(|e| e.id.clone());
}

fn append_event(
    store: &dyn Backend,
    scope: &Scope,
    id: &SessionId,
    _: &mut Option<skiff_protocol::EntryId>,
) {
    store
        .append_event(
            scope,
            id,
            None,
            EventKind::TextDelta {
                text: "a few streamed words".into(),
            },
        )
        .unwrap();
}

fn concurrent_median(
    store: &(dyn Backend + Sync),
    append: fn(&dyn Backend, &Scope, &SessionId, &mut Option<skiff_protocol::EntryId>),
) -> f64 {
    let scope = Scope::new("usr_bench", "ten_bench");
    concurrent(store, &scope, append); // warm-up
    let mut rates: Vec<f64> = (0..ROUNDS)
        .map(|_| concurrent(store, &scope, append))
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[ROUNDS / 2]
}

/// Entries per second of one round: `APPENDS` single-entry appends on a fresh session.
fn round(store: &dyn Backend, scope: &Scope) -> f64 {
    let id = new_session(store, scope);
    let body = entry();
    let started = Instant::now();
    let mut leaf = None;
    for _ in 0..APPENDS {
        let entries = store
            .append_entries(scope, &id, leaf.as_ref(), None, std::slice::from_ref(&body))
            .unwrap();
        leaf = entries.last().map(|e| e.id.clone());
    }
    APPENDS as f64 / started.elapsed().as_secs_f64()
}

/// Events per second of one round: `APPENDS` event appends on a fresh session.
fn events_round(store: &dyn Backend, scope: &Scope) -> f64 {
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    let started = Instant::now();
    for _ in 0..APPENDS {
        store
            .append_event(
                scope,
                &id,
                None,
                EventKind::TextDelta {
                    text: "a few streamed words".into(),
                },
            )
            .unwrap();
    }
    APPENDS as f64 / started.elapsed().as_secs_f64()
}

/// The same event append as `PgStore` sends, from a plain `postgres` client on this thread (no
/// connection thread, so no hand-off between threads): how much of the figure is the hop.
fn direct_events(url: &str) -> f64 {
    // The store's own session setting, so the two differ only by the hop.
    let url = format!("{url} options='-c synchronous_commit=off'");
    let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let append = client
        .prepare(
            "WITH cursor AS (
                INSERT INTO event_cursors (session_id, last_seq) VALUES ($1, 1)
                ON CONFLICT (session_id) DO UPDATE SET last_seq = event_cursors.last_seq + 1
                RETURNING last_seq
            )
            INSERT INTO events (session_id, seq, owner_id, tenant_id, run_id, at_ms, body)
            SELECT $1, last_seq, $2, $3, $4, $5, $6 FROM cursor
            RETURNING seq",
        )
        .unwrap();
    let body = r#"{"type":"text_delta","text":"a few streamed words"}"#;
    let mut rates: Vec<f64> = (0..=ROUNDS)
        .map(|_| {
            let id = SessionId::from_suffix(&skiff_store::mint().unwrap()).to_string();
            let started = Instant::now();
            for _ in 0..APPENDS {
                client
                    .query_one(
                        &append,
                        &[
                            &id,
                            &"usr_bench",
                            &"ten_bench",
                            &None::<String>,
                            &0i64,
                            &body,
                        ],
                    )
                    .unwrap();
            }
            APPENDS as f64 / started.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[ROUNDS / 2]
}

fn median(store: &dyn Backend, round: fn(&dyn Backend, &Scope) -> f64) -> f64 {
    let scope = Scope::new("usr_bench", "ten_bench");
    round(store, &scope); // warm-up: caches, prepared statements
    let mut rates: Vec<f64> = (0..ROUNDS).map(|_| round(store, &scope)).collect();
    rates.sort_by(f64::total_cmp);
    rates[ROUNDS / 2]
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = Store::open(&dir.path().join("bench.db")).unwrap();
    let sqlite_rate = median(&sqlite, round);
    let sqlite_events = median(&sqlite, events_round);
    let sqlite_concurrent = concurrent_median(&sqlite, append_entry);
    let sqlite_concurrent_events = concurrent_median(&sqlite, append_event);

    let cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
    let startup = cluster.startup();
    let url = cluster.fresh_database();
    let postgres = PgStore::connect(&url).unwrap();
    let postgres_rate = median(&postgres, round);
    let postgres_events = median(&postgres, events_round);
    let postgres_concurrent = concurrent_median(&postgres, append_entry);
    let postgres_concurrent_events = concurrent_median(&postgres, append_event);
    let direct = direct_events(&url);

    let initdb = skiff_test_support::postgres::time_initdb();
    println!(
        "throwaway PostgreSQL: initdb {:.0} ms; a cluster from the template (copy and start) {:.0} ms",
        initdb.as_secs_f64() * 1000.0,
        startup.copy_and_start.as_secs_f64() * 1000.0
    );
    println!(
        "durability: SQLite WAL, synchronous=NORMAL; PostgreSQL fsync=on, the store's sessions \
         synchronous_commit=off (both: an OS crash may lose the last commits, never corrupt)"
    );
    println!("transcript append, {APPENDS} single-entry appends, median of {ROUNDS} rounds:");
    println!("  SQLite      {sqlite_rate:>8.0} entries/s");
    println!("  PostgreSQL  {postgres_rate:>8.0} entries/s");
    println!(
        "  ratio PostgreSQL/SQLite {:.2} (goal ≥ 0.5)",
        postgres_rate / sqlite_rate
    );
    println!("event append, {APPENDS} appends, median of {ROUNDS} rounds:");
    println!("  SQLite      {sqlite_events:>8.0} events/s");
    println!("  PostgreSQL  {postgres_events:>8.0} events/s");
    println!(
        "  PostgreSQL, the same statement without the connection thread {direct:>8.0} events/s"
    );
    println!(
        "  ratio PostgreSQL/SQLite {:.2}",
        postgres_events / sqlite_events
    );
    println!(
        "{THREADS} threads at once, each appending to its own session ({APPENDS} in all), \
         median of {ROUNDS} rounds:"
    );
    println!(
        "  transcript  SQLite {sqlite_concurrent:>8.0} entries/s, PostgreSQL \
         {postgres_concurrent:>8.0} entries/s, ratio {:.2}",
        postgres_concurrent / sqlite_concurrent
    );
    println!(
        "  events      SQLite {sqlite_concurrent_events:>8.0} events/s,  PostgreSQL \
         {postgres_concurrent_events:>8.0} events/s,  ratio {:.2}",
        postgres_concurrent_events / sqlite_concurrent_events
    );
}
