//! `skiff_store::copy`: a SQLite state copied into an empty PostgreSQL database reads the same
//! through the store traits, new writes continue after the copied ones, and every refusal or
//! failure leaves the target empty. (The CLI's `admin migrate`, on a gateway's real state, is
//! in skiff-cli's `tests/it/migrate.rs`.)

use skiff_protocol::SessionId;
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::event::EventKind;
use skiff_protocol::model::Usage;
use skiff_protocol::people::{Role, TokenScope};
use skiff_protocol::transcript::EntryBody;
use skiff_store::copy::{CopyError, Progress, copy_to_postgres};
use skiff_store::{
    AttemptStatus, AuditLog, Backend, EventLog, NewSession, People, PgStore, Resealed, RunStore,
    Scope, SessionStore, Store, UsageLedger,
};
use skiff_test_support::postgres::PgCluster;

fn alice() -> Scope {
    Scope::new("usr_alice", "ten_a")
}

/// `sessions` sessions of `entries` transcript entries each, every one with a finished run
/// (an attempt, usage at a cost), events and audit rows; a child session, a user with a
/// token, and a vault secret (a blob column).
fn populate(store: &Store, sessions: usize, entries: usize) -> Vec<SessionId> {
    let scope = alice();
    let mut ids = Vec::new();
    for n in 0..sessions {
        let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
        store
            .create_session(
                &scope,
                &NewSession {
                    id: id.clone(),
                    title: format!("session {n} — naïve ünïcode"),
                    workspace: WorkspaceView::Plain {
                        source: "/src".into(),
                        path: format!("/state/ws/{n}"),
                    },
                    model_ref: "scripted/demo".into(),
                },
            )
            .unwrap();
        let run = store.create_run(&scope, &id, "scripted/demo").unwrap();
        let attempt = store.start_attempt(&scope, &run, "gateway", 1).unwrap();
        let bodies: Vec<EntryBody> = (0..entries)
            .map(|i| EntryBody::UserMessage {
                text: format!("message {i} of session {n}: {}", "x".repeat(i % 7 * 40)),
            })
            .collect();
        store
            .append_entries(&scope, &id, None, Some(&run.id), &bodies)
            .unwrap();
        for status in [
            RunStatus::Starting,
            RunStatus::Running,
            RunStatus::Succeeded,
        ] {
            store.transition_run(&scope, &run.id, status, None).unwrap();
        }
        store
            .finish_attempt(&scope, &attempt, AttemptStatus::Succeeded, None)
            .unwrap();
        let usage = Usage {
            input_tokens: 100 + n as u64,
            output_tokens: 7,
            cache_read_tokens: 0,
            cache_write_tokens: 0,
        };
        store
            .add_run_usage(&scope, &run.id, usage, 0.1 + n as f64 / 3.0)
            .unwrap();
        for text in ["a", "b", "c"] {
            store
                .append_event(
                    &scope,
                    &id,
                    Some(&run.id),
                    EventKind::TextDelta { text: text.into() },
                )
                .unwrap();
        }
        store
            .audit(
                &scope,
                "usr_alice",
                "session.create",
                id.as_str(),
                "allowed",
                &serde_json::json!({"n": n}),
            )
            .unwrap();
        ids.push(id);
    }
    let child = SessionId::from_suffix(&skiff_store::mint().unwrap());
    store
        .create_child_session(
            &scope,
            &NewSession {
                id: child.clone(),
                title: "a child".into(),
                workspace: WorkspaceView::Plain {
                    source: "/src".into(),
                    path: "/state/ws/child".into(),
                },
                model_ref: "scripted/demo".into(),
            },
            &ids[0],
            ("local", 16),
            4,
        )
        .unwrap();
    ids.push(child);
    let ada = store
        .add_user("ada@example.com", Role::Member, "ten_a")
        .unwrap();
    store
        .add_token(
            &ada.scope(),
            "hash-of-a-token",
            "laptop",
            TokenScope::Write,
            Some(4_102_444_800_000),
        )
        .unwrap();
    store
        .put_secret(
            "openai",
            &Resealed {
                ciphertext: vec![0, 159, 146, 150, 255, 0],
                nonce: vec![1; 12],
                key_id: "key-1".into(),
            },
        )
        .unwrap();
    ids
}

fn quiet(_: Progress<'_>) {}

/// Every row count of the target's tables but the bookkeeping, with the seeded first admin.
fn rows_in(url: &str) -> Vec<(String, i64)> {
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
    let tables: Vec<String> = client
        .query(
            "SELECT table_name::text FROM information_schema.tables
             WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'
             AND table_name NOT IN ('skiff_schema', 'audit_next') ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    tables
        .into_iter()
        .map(|t| {
            let n: i64 = client
                .query_one(&format!("SELECT count(*) FROM \"{t}\""), &[])
                .unwrap()
                .get(0);
            (t, n)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Empty but for the first admin PostgreSQL's schema seeds.
fn assert_empty(url: &str) {
    assert_eq!(
        rows_in(url),
        [("users".to_owned(), 1)],
        "the target is not empty"
    );
}

fn compare(sqlite: &dyn Backend, pg: &dyn Backend, sessions: &[SessionId]) {
    let scope = alice();
    assert_eq!(
        sqlite.sessions(&scope).unwrap(),
        pg.sessions(&scope).unwrap()
    );
    for id in sessions {
        assert_eq!(
            sqlite.session(&scope, id).unwrap(),
            pg.session(&scope, id).unwrap()
        );
        assert_eq!(
            sqlite.transcript(&scope, id).unwrap(),
            pg.transcript(&scope, id).unwrap()
        );
        assert_eq!(
            sqlite.runs(&scope, id).unwrap(),
            pg.runs(&scope, id).unwrap()
        );
        assert_eq!(
            sqlite.attempts(&scope, id).unwrap(),
            pg.attempts(&scope, id).unwrap()
        );
        assert_eq!(
            sqlite.events_after(&scope, id, 1, 100).unwrap(),
            pg.events_after(&scope, id, 1, 100).unwrap()
        );
        assert_eq!(
            sqlite.session_usage(&scope, id).unwrap(),
            pg.session_usage(&scope, id).unwrap()
        );
    }
    assert_eq!(sqlite.audit_rows().unwrap(), pg.audit_rows().unwrap());
    assert_eq!(
        sqlite.audit_last(10_000).unwrap(),
        pg.audit_last(10_000).unwrap()
    );
    assert_eq!(sqlite.users(None).unwrap(), pg.users(None).unwrap());
    assert_eq!(sqlite.token_rows().unwrap(), pg.token_rows().unwrap());
    assert_eq!(sqlite.secrets().unwrap(), pg.secrets().unwrap());
}

#[test]
fn a_copied_state_reads_the_same_on_postgres_and_new_writes_continue_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.db");
    let sqlite = Store::open(&path).unwrap();
    let sessions = populate(&sqlite, 4, 6);
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();

    let mut seen = Vec::new();
    let report = copy_to_postgres(&path, &url, &mut |p: Progress<'_>| {
        seen.push(p.table.to_owned());
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log()));
    assert!(report.committed);
    assert!(report.tables.iter().all(|t| t.matches()), "{report:?}");
    let table = |name: &str| report.tables.iter().find(|t| t.table == name).unwrap();
    assert_eq!(table("sessions").postgres_rows, 5);
    assert_eq!(table("entries").postgres_rows, 24);
    assert_eq!(table("events").postgres_rows, 12);
    assert_eq!(table("secrets").postgres_rows, 1);
    // Parents first: sessions before the entries and runs that name them.
    let at = |name: &str| report.tables.iter().position(|t| t.table == name).unwrap();
    assert!(at("sessions") < at("entries") && at("runs") < at("attempts"));
    assert!(
        seen.contains(&"entries".to_owned()),
        "no progress: {seen:?}"
    );

    let pg = PgStore::connect(&url).unwrap();
    compare(&sqlite, &pg, &sessions);

    // New writes continue after the copied rows, on both.
    let s = &sessions[1];
    let next = pg
        .append_event(&alice(), s, None, EventKind::TextDelta { text: "d".into() })
        .unwrap();
    assert_eq!(next.cursor, 4);
    let last_audit = pg.audit_last(1).unwrap()[0].id;
    AuditLog::audit(
        &pg,
        &alice(),
        "usr_alice",
        "session.show",
        s.as_str(),
        "allowed",
        &serde_json::json!({}),
    )
    .unwrap();
    assert_eq!(pg.audit_last(1).unwrap()[0].id, last_audit + 1);
    let fresh = SessionId::from_suffix(&skiff_store::mint().unwrap());
    pg.create_session(
        &alice(),
        &NewSession {
            id: fresh.clone(),
            title: "after the move".into(),
            workspace: WorkspaceView::Plain {
                source: "/src".into(),
                path: "/state/ws/new".into(),
            },
            model_ref: "scripted/demo".into(),
        },
    )
    .unwrap();
    let run = pg.create_run(&alice(), &fresh, "scripted/demo").unwrap();
    pg.add_run_usage(
        &alice(),
        &run.id,
        Usage {
            input_tokens: 1,
            output_tokens: 1,
            cache_read_tokens: 0,
            cache_write_tokens: 0,
        },
        0.5,
    )
    .unwrap();
    assert_eq!(pg.session_usage(&alice(), &fresh).unwrap().tokens, 2);
}

#[test]
fn a_target_with_rows_is_refused_naming_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.db");
    populate(&Store::open(&path).unwrap(), 1, 2);
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    PgStore::connect(&url)
        .unwrap()
        .add_user("someone@example.com", Role::Viewer, "ten_b")
        .unwrap();
    let err = copy_to_postgres(&path, &url, &mut quiet).unwrap_err();
    assert!(
        matches!(&err, CopyError::TargetNotEmpty { table, rows: 1 } if table == "users"),
        "{err}"
    );
    assert!(err.to_string().contains("table users has 1 row"), "{err}");

    // A copy into a database already copied into is refused too, changing nothing.
    let again = cluster.fresh_database();
    copy_to_postgres(&path, &again, &mut quiet).unwrap();
    let before = rows_in(&again);
    let err = copy_to_postgres(&path, &again, &mut quiet).unwrap_err();
    assert!(matches!(err, CopyError::TargetNotEmpty { .. }), "{err}");
    assert_eq!(rows_in(&again), before);
}

#[test]
fn a_row_postgres_refuses_mid_copy_leaves_the_target_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.db");
    populate(&Store::open(&path).unwrap(), 2, 3);
    // A chat thread naming a session that does not exist (SQLite without its foreign-key
    // pragma lets it in): PostgreSQL's constraint refuses it, after the tables before it.
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.pragma_update(None, "foreign_keys", "OFF").unwrap();
    raw.execute(
        "INSERT INTO ingress_threads VALUES ('C1', '1.2', 'usr_alice', 'ten_a', 'ses_gone')",
        [],
    )
    .unwrap();
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let err = copy_to_postgres(&path, &url, &mut quiet).unwrap_err();
    assert!(
        matches!(&err, CopyError::Copy { table, .. } if table == "ingress_threads"),
        "{err}"
    );
    assert!(err.to_string().contains("foreign key"), "{err}");
    assert_empty(&url);

    // A value of the wrong type is named with its row and column; still nothing copied.
    raw.execute("DELETE FROM ingress_threads", []).unwrap();
    raw.execute("UPDATE audit SET at_ms = 'yesterday' WHERE id = 2", [])
        .unwrap();
    let err = copy_to_postgres(&path, &url, &mut quiet).unwrap_err();
    let said = err.to_string();
    assert!(
        said.contains("row id=2 of table audit: column at_ms holds text"),
        "{said}"
    );
    assert_empty(&url);

    // Corrected, the same target takes the copy.
    raw.execute("UPDATE audit SET at_ms = 5 WHERE id = 2", [])
        .unwrap();
    assert!(copy_to_postgres(&path, &url, &mut quiet).unwrap().committed);
}

#[test]
fn a_column_postgres_lacks_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.db");
    populate(&Store::open(&path).unwrap(), 1, 1);
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.execute("ALTER TABLE runs ADD COLUMN notes TEXT", [])
        .unwrap();
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let err = copy_to_postgres(&path, &url, &mut quiet).unwrap_err();
    assert!(
        err.to_string()
            .contains("PostgreSQL's table runs has no column notes"),
        "{err}"
    );
    raw.execute("CREATE TABLE scratch (id INTEGER PRIMARY KEY)", [])
        .unwrap();
    raw.execute("ALTER TABLE runs DROP COLUMN notes", [])
        .unwrap();
    let err = copy_to_postgres(&path, &url, &mut quiet).unwrap_err();
    assert!(
        err.to_string().contains("PostgreSQL has no table scratch"),
        "{err}"
    );
    assert_empty(&url);
}

/// Not a timed assertion: prints how long a state of 1,000 sessions × 50 entries takes.
#[test]
fn migrating_a_thousand_sessions_of_fifty_entries_prints_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.db");
    let store = Store::open(&path).unwrap();
    let sessions = populate(&store, 1000, 50);
    drop(store);
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let started = std::time::Instant::now();
    let report = copy_to_postgres(&path, &url, &mut quiet).unwrap();
    let took = started.elapsed();
    println!(
        "migrate: {} sessions, {} rows in {} tables copied and verified in {:.2} s ({:.0} rows/s)",
        sessions.len(),
        report.rows(),
        report.tables.len(),
        took.as_secs_f64(),
        report.rows() as f64 / took.as_secs_f64()
    );
    assert!(report.committed);
    assert_eq!(
        report
            .tables
            .iter()
            .find(|t| t.table == "entries")
            .unwrap()
            .postgres_rows,
        50_000
    );
}
