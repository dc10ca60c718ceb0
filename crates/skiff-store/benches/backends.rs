//! Transcript append throughput, SQLite against PostgreSQL in the same run (figures printed,
//! never asserted): one session's transcript grows by one entry per call, each a
//! compare-and-swap on the leaf, as a turn commits its entries; event appends likewise; and
//! both again from 8 threads at once, each appending to its own session, as a gateway serving
//! many sessions does. SQLite is a file in WAL mode with `synchronous = NORMAL`; PostgreSQL a
//! local cluster on a Unix socket configured as in production (`fsync = on`, the default
//! `synchronous_commit = on`), where `PgStore` sets `synchronous_commit = off` on its own
//! sessions — the same promise as SQLite's (an OS crash may lose the last commits, never
//! corrupt), so the two compare like with like. Also printed: how long the throwaway cluster
//! took to start, and where a serial PostgreSQL call's time goes — the transcript and event
//! statements from a plain client without the connection thread (the hop), a bare round trip,
//! and the server's own execution and planning time per statement (`pg_stat_statements`).
//!
//! The appends a turn makes in a gateway are fenced (issue 17: the session's lease must still
//! be this gateway's), so those are measured too, on both backends. A store call is made from
//! a plain thread here; the gateway makes most of its calls from inside its tokio runtime,
//! where `PgStore` hands the work to a connection thread and waits (the hop), so the fenced
//! transcript append is also measured from inside a runtime.
//!
//! `cargo bench -p skiff-store --bench backends`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use skiff_protocol::api::WorkspaceView;
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::{GatewayId, SessionId};
use skiff_store::{Backend, Fence, LeaseKey, NewSession, PgStore, Scope, Store};
use skiff_test_support::postgres::{Durability, PgCluster};
use std::sync::{Arc, Barrier};
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

/// A fresh session whose lease `usr_bench`'s gateway holds: the fence a turn's writes carry.
fn leased_session(store: &dyn Backend, scope: &Scope) -> Fence {
    let id = new_session(store, scope);
    let gateway = GatewayId::from_suffix("bench");
    store.register_gateway(&gateway, "127.0.0.1:1").unwrap();
    store
        .acquire_lease(
            &LeaseKey::Session(id),
            &gateway,
            std::time::Duration::from_secs(600),
        )
        .unwrap()
        .won()
        .and_then(|lease| lease.fence())
        .expect("a fresh session's lease is free")
}

/// [`round`] with each append fenced, as a turn's are.
fn fenced_round(store: &dyn Backend, scope: &Scope) -> f64 {
    let fence = leased_session(store, scope);
    let body = entry();
    let started = Instant::now();
    let mut leaf = None;
    for _ in 0..APPENDS {
        let entries = store
            .append_entries_fenced(
                &fence,
                scope,
                leaf.as_ref(),
                None,
                std::slice::from_ref(&body),
            )
            .unwrap();
        leaf = entries.last().map(|e| e.id.clone());
    }
    APPENDS as f64 / started.elapsed().as_secs_f64()
}

/// [`events_round`] with each append fenced, as the hub's are during a turn.
fn fenced_events_round(store: &dyn Backend, scope: &Scope) -> f64 {
    let fence = leased_session(store, scope);
    let started = Instant::now();
    for _ in 0..APPENDS {
        store
            .append_event_fenced(
                &fence,
                scope,
                None,
                EventKind::TextDelta {
                    text: "a few streamed words".into(),
                },
            )
            .unwrap();
    }
    APPENDS as f64 / started.elapsed().as_secs_f64()
}

/// [`fenced_round`]s called from a task of a multi-threaded tokio runtime (as the gateway's
/// handlers call the store: `PgStore` leaves the runtime for the call), or from a
/// single-threaded runtime (tests' runtimes: the work hops to a connection thread and back);
/// median of `ROUNDS` after a warm-up.
fn runtime_median(store: &Arc<dyn Backend>, multi_threaded: bool) -> f64 {
    let rt = if multi_threaded {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    };
    let mut rates: Vec<f64> = (0..=ROUNDS)
        .map(|_| {
            let store = Arc::clone(store);
            rt.block_on(async move {
                tokio::spawn(
                    async move { fenced_round(&*store, &Scope::new("usr_bench", "ten_bench")) },
                )
                .await
                .unwrap()
            })
        })
        .skip(1)
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[ROUNDS / 2]
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

/// Calls per second on a plain client of `call` (given the client and the round's fresh
/// session), median of `ROUNDS` rounds of `APPENDS` after one warm-up round.
fn direct(client: &mut postgres::Client, mut call: impl FnMut(&mut postgres::Client, &str)) -> f64 {
    let mut rates: Vec<f64> = (0..=ROUNDS)
        .map(|_| {
            let id = SessionId::from_suffix(&skiff_store::mint().unwrap()).to_string();
            client
                .execute(
                    "INSERT INTO sessions (id, owner_id, tenant_id, title, workspace, model_ref, \
                     created_at_ms, updated_at_ms) VALUES ($1, 'usr_bench', 'ten_bench', 'bench', \
                     '{}', 'scripted/demo', 0, 0)",
                    &[&id],
                )
                .unwrap();
            let started = Instant::now();
            for _ in 0..APPENDS {
                call(client, &id);
            }
            APPENDS as f64 / started.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[ROUNDS / 2]
}

/// A plain client with the store's own session setting, so it differs from the store only by
/// the hop to the connection thread.
fn plain_client(url: &str) -> postgres::Client {
    let url = format!("{url} options='-c synchronous_commit=off'");
    postgres::Client::connect(&url, postgres::NoTls).unwrap()
}

/// The store's transcript append (exactly the text of `pg/sessions.rs`), one entry whose parent
/// is the leaf, from a plain client on the caller's thread; and a round trip alone.
fn direct_transcript(url: &str) -> (f64, f64) {
    let mut client = plain_client(url);
    let append = client.prepare(APPEND).unwrap();
    let body = r#"{"type":"user_message","text":"a line of about the length a short model message has, give or take"}"#;
    let mut leaf: Option<String> = None;
    let mut last_session = String::new();
    let appends = direct(&mut client, |client, session| {
        if session != last_session {
            (leaf, last_session) = (None, session.to_owned());
        }
        let id = format!("ent_{}", skiff_store::mint().unwrap());
        client
            .query_one(
                &append,
                &[
                    &id,
                    &0i64,
                    &session,
                    &"usr_bench",
                    &"ten_bench",
                    &leaf,
                    &None::<String>,
                    &vec![id.clone()],
                    &vec![leaf.clone()],
                    &vec!["user_message"],
                    &vec![body],
                ],
            )
            .unwrap();
        leaf = Some(id);
    });
    let select_one = client.prepare("SELECT 1").unwrap();
    let round_trips = direct(&mut client, |client, _| {
        client.query_one(&select_one, &[]).unwrap();
    });
    (appends, round_trips)
}

/// `pg/sessions.rs`'s transcript append, word for word.
const APPEND: &str = "WITH swapped AS (
        UPDATE sessions SET leaf_entry_id = $1, updated_at_ms = $2
         WHERE id = $3 AND owner_id = $4 AND tenant_id = $5
           AND leaf_entry_id IS NOT DISTINCT FROM $6
        RETURNING id
    ), chain AS (
        INSERT INTO entries (id, session_id, owner_id, tenant_id, parent_id, run_id, kind, body,
                             created_at_ms)
        SELECT c.id, $3, $4, $5, c.parent_id, $7, c.kind, c.body, $2
          FROM swapped, UNNEST($8::text[], $9::text[], $10::text[], $11::text[])
               AS c(id, parent_id, kind, body)
    )
    SELECT 1 FROM swapped";

/// Per statement run at least `APPENDS` times on the server, from `pg_stat_statements`: calls,
/// mean execution and planning time (µs) and how many times it was planned, busiest first.
fn server_time(url: &str) -> Vec<(i64, f64, f64, i64, String)> {
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
    client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .unwrap();
    client
        .query(
            "SELECT calls, mean_exec_time * 1000, mean_plan_time * 1000, plans, \
             left(regexp_replace(query, '\\s+', ' ', 'g'), 70) FROM pg_stat_statements \
             WHERE calls >= $1 AND dbid = (SELECT oid FROM pg_database \
                                           WHERE datname = current_database()) \
             ORDER BY total_exec_time DESC",
            &[&(APPENDS as i64)],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect()
}

/// `round` on SQLite and on PostgreSQL, one warm-up each, then `ROUNDS` pairs taken in turn
/// so that a busy spell of the machine weighs on both alike: (SQLite's median, PostgreSQL's
/// median, the median of the pairs' ratios PostgreSQL/SQLite).
fn paired(
    sqlite: &dyn Backend,
    postgres: &dyn Backend,
    round: fn(&dyn Backend, &Scope) -> f64,
) -> (f64, f64, f64) {
    let scope = Scope::new("usr_bench", "ten_bench");
    round(sqlite, &scope);
    round(postgres, &scope);
    let pairs: Vec<(f64, f64)> = (0..ROUNDS)
        .map(|_| (round(sqlite, &scope), round(postgres, &scope)))
        .collect();
    let mid = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[ROUNDS / 2]
    };
    (
        mid(pairs.iter().map(|p| p.0).collect()),
        mid(pairs.iter().map(|p| p.1).collect()),
        mid(pairs.iter().map(|p| p.1 / p.0).collect()),
    )
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = Store::open(&dir.path().join("bench.db")).unwrap();
    let sqlite_concurrent = concurrent_median(&sqlite, append_entry);
    let sqlite_concurrent_events = concurrent_median(&sqlite, append_event);

    let cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
    let startup = cluster.startup();
    let url = cluster.fresh_database();
    let postgres = PgStore::connect(&url).unwrap();
    let (sqlite_rate, postgres_rate, ratio) = paired(&sqlite, &postgres, round);
    let (sqlite_events, postgres_events, events_ratio) = paired(&sqlite, &postgres, events_round);
    let (sqlite_fenced, postgres_fenced, fenced_ratio) = paired(&sqlite, &postgres, fenced_round);
    let (sqlite_fenced_events, postgres_fenced_events, fenced_events_ratio) =
        paired(&sqlite, &postgres, fenced_events_round);
    let shared: Arc<dyn Backend> = Arc::new(PgStore::connect(&url).unwrap());
    let postgres_fenced_in_runtime = runtime_median(&shared, true);
    let postgres_fenced_hop = runtime_median(&shared, false);
    drop(shared);
    let postgres_concurrent = concurrent_median(&postgres, append_entry);
    let postgres_concurrent_events = concurrent_median(&postgres, append_event);
    let direct = direct_events(&url);
    let (direct_transcript, direct_round_trip) = direct_transcript(&url);
    let server = server_time(&url);

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
    println!(
        "transcript append, {APPENDS} single-entry appends, median of {ROUNDS} rounds taken in turn:"
    );
    println!("  SQLite      {sqlite_rate:>8.0} entries/s");
    println!("  PostgreSQL  {postgres_rate:>8.0} entries/s");
    println!("  ratio PostgreSQL/SQLite {ratio:.2} (goal ≥ 0.5; median of the rounds' ratios)");
    println!(
        "  PostgreSQL, the same statement without the connection thread {direct_transcript:>8.0} \
         entries/s"
    );
    println!("fenced transcript append (a turn's: the session lease checked in the write):");
    println!("  SQLite      {sqlite_fenced:>8.0} entries/s");
    println!("  PostgreSQL  {postgres_fenced:>8.0} entries/s");
    println!("  ratio PostgreSQL/SQLite {fenced_ratio:.2} (goal ≥ 0.5)");
    println!(
        "  PostgreSQL called from a multi-threaded tokio runtime (the gateway's case) \
         {postgres_fenced_in_runtime:>8.0} entries/s, ratio {:.2}",
        postgres_fenced_in_runtime / sqlite_fenced
    );
    println!(
        "  PostgreSQL called from a single-threaded runtime (the hop to a connection thread \
         and back) {postgres_fenced_hop:>8.0} entries/s, ratio {:.2}",
        postgres_fenced_hop / sqlite_fenced
    );
    println!("fenced event append (the hub's during a turn):");
    println!("  SQLite      {sqlite_fenced_events:>8.0} events/s");
    println!("  PostgreSQL  {postgres_fenced_events:>8.0} events/s");
    println!("  ratio PostgreSQL/SQLite {fenced_events_ratio:.2}");
    println!("event append, {APPENDS} appends, median of {ROUNDS} rounds:");
    println!("  SQLite      {sqlite_events:>8.0} events/s");
    println!("  PostgreSQL  {postgres_events:>8.0} events/s");
    println!(
        "  PostgreSQL, the same statement without the connection thread {direct:>8.0} events/s"
    );
    println!("  ratio PostgreSQL/SQLite {events_ratio:.2}");
    let us = |rate: f64| 1e6 / rate;
    println!("where a serial PostgreSQL call's time goes (µs per call):");
    println!(
        "  transcript append through the store {:6.0}; the statement from a plain client {:6.0}",
        us(postgres_rate),
        us(direct_transcript)
    );
    println!(
        "  event append through the store {:6.0}; the statement from a plain client {:6.0}",
        us(postgres_events),
        us(direct)
    );
    println!(
        "  a round trip (SELECT 1 from a plain client) {:6.0}",
        us(direct_round_trip)
    );
    println!("  in the server (pg_stat_statements: calls, mean execution, mean planning, plans):");
    for (calls, exec, plan, plans, query) in &server {
        println!("    {calls:>7} {exec:7.1} {plan:7.1} {plans:>6}  {query}");
    }
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
