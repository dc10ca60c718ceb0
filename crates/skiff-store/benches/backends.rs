//! Transcript append throughput, SQLite against PostgreSQL in the same run (figures printed,
//! never asserted): one session's transcript grows by one entry per call, each a
//! compare-and-swap on the leaf, as a turn commits its entries. SQLite is a file in WAL mode
//! with `synchronous = NORMAL`; PostgreSQL a local cluster on a Unix socket with
//! `synchronous_commit = off` and `fsync = on`, the same promise (an OS crash may lose the last
//! commits, never corrupt). Also printed: how long the throwaway cluster took to start.
//!
//! `cargo bench -p skiff-store --bench backends`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_store::{Backend, NewSession, PgStore, Scope, Store};
use skiff_test_support::postgres::{Durability, PgCluster};
use std::time::Instant;

const APPENDS: usize = 2_000;
const ROUNDS: usize = 5;

/// Entries per second of one round: `APPENDS` single-entry appends on a fresh session.
fn round(store: &dyn Backend, scope: &Scope) -> f64 {
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
    let body = EntryBody::UserMessage {
        text: "a line of about the length a short model message has, give or take".into(),
    };
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
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
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

    let cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
    let startup = cluster.startup();
    let url = cluster.fresh_database();
    let postgres = PgStore::connect(&url).unwrap();
    let postgres_rate = median(&postgres, round);
    let postgres_events = median(&postgres, events_round);
    let direct = direct_events(&url);

    let initdb = skiff_test_support::postgres::time_initdb();
    println!(
        "throwaway PostgreSQL: initdb {:.0} ms; a cluster from the template (copy and start) {:.0} ms",
        initdb.as_secs_f64() * 1000.0,
        startup.copy_and_start.as_secs_f64() * 1000.0
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
}
