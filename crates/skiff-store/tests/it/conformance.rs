//! The store conformance suite: every test here runs against both backends — SQLite (a file in
//! a temporary directory) and PostgreSQL (a throwaway cluster, a fresh database per test) —
//! through the aggregate traits only (`skiff_store::Backend`). A test that needs two
//! connections, as two gateways would have, opens the same database twice. The people and
//! governance aggregates' tests are in `conformance_people.rs`.

use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::{EntryId, SessionId};
use skiff_store::{AttemptStatus, Backend, Error, NewSession, PgStore, Resume, Scope, Store};
use skiff_test_support::postgres::PgCluster;
use std::sync::Barrier;

/// One database of one backend.
pub(crate) enum Db {
    Sqlite(tempfile::TempDir),
    Postgres { url: String, cluster: PgCluster },
}

impl Db {
    pub(crate) fn sqlite() -> Self {
        Db::Sqlite(tempfile::tempdir().unwrap())
    }

    pub(crate) fn postgres() -> Self {
        let cluster = PgCluster::start();
        let url = cluster.fresh_database();
        Db::Postgres { url, cluster }
    }

    /// A new connection to the database (a new `Store`, as another gateway would open).
    pub(crate) fn open(&self) -> Box<dyn Backend> {
        match self {
            Db::Sqlite(dir) => Box::new(Store::open(&dir.path().join("skiff.db")).unwrap()),
            Db::Postgres { url, cluster } => Box::new(
                PgStore::connect(url)
                    .unwrap_or_else(|e| panic!("{e}\nserver log:\n{}", cluster.log())),
            ),
        }
    }
}

/// Each named test, once per backend: `conformance::sqlite::NAME` and
/// `conformance::postgres::NAME`.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $( #[test] fn $name() { super::$name(&super::Db::sqlite()); } )*
        }
        mod postgres {
            $( #[test] fn $name() { super::$name(&super::Db::postgres()); } )*
        }
    };
}
pub(crate) use on_both_backends;

on_both_backends!(
    events_read_back_in_order_with_cursors_the_database_assigns,
    concurrent_appends_from_two_connections_never_share_or_reorder_a_cursor,
    transcript_appends_chain_and_refuse_a_stale_leaf,
    racing_transcript_appends_on_one_leaf_have_one_winner,
    a_second_open_run_for_a_session_is_refused,
    racing_admissions_admit_one_turn,
    run_transitions_follow_the_state_machine,
    a_second_active_attempt_is_refused,
    another_tenants_rows_are_not_found,
    callable_from_inside_a_tokio_runtime,
);

pub(crate) fn alice() -> Scope {
    Scope::new("usr_alice", "ten_a")
}

pub(crate) fn new_session(store: &dyn Backend, scope: &Scope) -> SessionId {
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    let row = store
        .create_session(
            scope,
            &NewSession {
                id: id.clone(),
                title: "fix the test".into(),
                workspace: WorkspaceView::Plain {
                    source: "/src".into(),
                    path: "/state/ws".into(),
                },
                model_ref: "scripted/demo".into(),
            },
        )
        .unwrap();
    assert_eq!(row.id, id);
    assert_eq!(row.owner, *scope);
    assert_eq!(row.leaf_entry_id, None);
    id
}

fn text(text: &str) -> EventKind {
    EventKind::TextDelta { text: text.into() }
}

fn text_of(kind: &EventKind) -> &str {
    match kind {
        EventKind::TextDelta { text } => text,
        other => panic!("not a text delta: {other:?}"),
    }
}

fn user(text: &str) -> EntryBody {
    EntryBody::UserMessage { text: text.into() }
}

fn texts(store: &dyn Backend, scope: &Scope, session: &SessionId) -> Vec<String> {
    store
        .transcript(scope, session)
        .unwrap()
        .into_iter()
        .map(|e| match e.body {
            EntryBody::UserMessage { text } => text,
            other => panic!("unexpected entry {other:?}"),
        })
        .collect()
}

fn events_read_back_in_order_with_cursors_the_database_assigns(db: &Db) {
    let store = db.open();
    let (s, other) = (
        new_session(&*store, &alice()),
        new_session(&*store, &alice()),
    );
    assert_eq!(store.last_event_cursor(&alice(), &s).unwrap(), 0);
    let cursors: Vec<u64> = ["a", "b", "c"]
        .iter()
        .map(|t| {
            store
                .append_event(&alice(), &s, None, text(t))
                .unwrap()
                .cursor
        })
        .collect();
    assert_eq!(cursors, [1, 2, 3]);
    // Cursors are per session: another session's log starts at 1.
    assert_eq!(
        store
            .append_event(&alice(), &other, None, text("x"))
            .unwrap()
            .cursor,
        1
    );
    let all = store.events_after(&alice(), &s, 0, 100).unwrap();
    assert_eq!(
        all.iter()
            .map(|e| (e.cursor, text_of(&e.kind)))
            .collect::<Vec<_>>(),
        [(1, "a"), (2, "b"), (3, "c")]
    );
    assert!(all.iter().all(|e| e.session_id == s));
    let after = store.events_after(&alice(), &s, 1, 1).unwrap();
    assert_eq!(after.len(), 1, "the limit holds");
    assert_eq!(text_of(&after[0].kind), "b");
    assert_eq!(store.last_event_cursor(&alice(), &s).unwrap(), 3);
    assert!(store.events_after(&alice(), &s, 3, 100).unwrap().is_empty());
}

fn concurrent_appends_from_two_connections_never_share_or_reorder_a_cursor(db: &Db) {
    const EACH: usize = 60;
    let (a, b, follower) = (db.open(), db.open(), db.open());
    let s = new_session(&*a, &alice());
    let start = Barrier::new(2);
    let seen = std::thread::scope(|threads| {
        for (name, store) in [("a", &a), ("b", &b)] {
            let (s, start) = (&s, &start);
            threads.spawn(move || {
                start.wait();
                let mut last = 0;
                for i in 0..EACH {
                    let event = store
                        .append_event(&alice(), s, None, text(&format!("{name}{i}")))
                        .unwrap();
                    assert!(event.cursor > last, "a writer's cursors only increase");
                    last = event.cursor;
                }
            });
        }
        // A follower reading by cursor while both write must never see a gap: an event that
        // commits late would be skipped for good.
        let reader = threads.spawn(|| {
            let mut seen = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while seen.len() < 2 * EACH {
                assert!(
                    std::time::Instant::now() < deadline,
                    "events stopped arriving"
                );
                let after = seen.last().map_or(0, |(cursor, _)| *cursor);
                for event in follower.events_after(&alice(), &s, after, 1000).unwrap() {
                    let expected = seen.len() as u64 + 1;
                    assert_eq!(event.cursor, expected, "the follower saw a gap");
                    seen.push((event.cursor, text_of(&event.kind).to_string()));
                }
            }
            seen
        });
        reader.join().unwrap()
    });
    // Every event once, cursors 1..=2·EACH, and each writer's events in the order it wrote.
    let all = a.events_after(&alice(), &s, 0, 10_000).unwrap();
    assert_eq!(all.len(), 2 * EACH);
    assert!(
        all.iter()
            .enumerate()
            .all(|(i, e)| e.cursor == i as u64 + 1)
    );
    for name in ["a", "b"] {
        let order: Vec<String> = all
            .iter()
            .map(|e| text_of(&e.kind))
            .filter(|t| t.starts_with(name))
            .map(str::to_string)
            .collect();
        let written: Vec<String> = (0..EACH).map(|i| format!("{name}{i}")).collect();
        assert_eq!(order, written);
    }
    assert_eq!(
        seen,
        all.iter()
            .map(|e| (e.cursor, text_of(&e.kind).to_string()))
            .collect::<Vec<_>>()
    );
}

fn transcript_appends_chain_and_refuse_a_stale_leaf(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    let first = store
        .append_entries(&alice(), &s, None, None, &[user("a"), user("b")])
        .unwrap();
    assert_eq!(first[0].parent_id, None);
    assert_eq!(first[1].parent_id.as_ref(), Some(&first[0].id));
    assert_eq!(store.leaf(&alice(), &s).unwrap(), Some(first[1].id.clone()));

    // Appending on the empty transcript again: the leaf moved, so it is refused, and nothing
    // of it is written.
    let stale = store
        .append_entries(&alice(), &s, None, None, &[user("lost")])
        .unwrap_err();
    match &stale {
        Error::LeafConflict {
            expected, actual, ..
        } => {
            assert_eq!(expected, "(empty)");
            assert_eq!(actual, first[1].id.as_str());
        }
        other => panic!("expected a leaf conflict, got {other:?}"),
    }
    let stale = store
        .append_entries(&alice(), &s, Some(&first[0].id), None, &[user("lost")])
        .unwrap_err();
    assert!(matches!(stale, Error::LeafConflict { .. }), "{stale:?}");
    assert_eq!(texts(&*store, &alice(), &s), ["a", "b"]);

    let second = store
        .append_entries(&alice(), &s, Some(&first[1].id), None, &[user("c")])
        .unwrap();
    assert_eq!(second[0].parent_id.as_ref(), Some(&first[1].id));
    assert_eq!(texts(&*store, &alice(), &s), ["a", "b", "c"]);
    assert_eq!(
        store
            .session(&alice(), &s)
            .unwrap()
            .leaf_entry_id
            .as_deref(),
        Some(second[0].id.as_str())
    );
}

fn racing_transcript_appends_on_one_leaf_have_one_winner(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let base = a
        .append_entries(&alice(), &s, None, None, &[user("base")])
        .unwrap()[0]
        .id
        .clone();
    let start = Barrier::new(2);
    let outcomes: Vec<Result<Vec<EntryId>, Error>> = std::thread::scope(|threads| {
        let racers: Vec<_> = [("from a", &a), ("from b", &b)]
            .into_iter()
            .map(|(what, store)| {
                let (s, base, start) = (&s, &base, &start);
                threads.spawn(move || {
                    start.wait();
                    store
                        .append_entries(&alice(), s, Some(base), None, &[user(what), user(what)])
                        .map(|entries| entries.into_iter().map(|e| e.id).collect())
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let winners: Vec<&Vec<EntryId>> = outcomes.iter().filter_map(|o| o.as_ref().ok()).collect();
    assert_eq!(winners.len(), 1, "exactly one append wins: {outcomes:?}");
    assert!(
        outcomes
            .iter()
            .any(|o| matches!(o, Err(Error::LeafConflict { .. })))
    );
    let transcript = texts(&*a, &alice(), &s);
    assert_eq!(
        transcript.len(),
        3,
        "the loser wrote nothing: {transcript:?}"
    );
    assert_eq!(transcript[1], transcript[2]);
    assert_eq!(a.leaf(&alice(), &s).unwrap().as_ref(), winners[0].last());
}

fn a_second_open_run_for_a_session_is_refused(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let first = a.create_run(&alice(), &s, "scripted/demo").unwrap();
    assert_eq!(first.status, RunStatus::Queued);
    assert_eq!(first.session_id, s);
    // From the same connection and from another one alike.
    for store in [&a, &b] {
        match store.create_run(&alice(), &s, "scripted/demo").unwrap_err() {
            Error::SessionBusy { run, .. } => assert_eq!(run, first.id.as_str()),
            other => panic!("expected the session to be busy, got {other:?}"),
        }
    }
    assert_eq!(a.open_run(&alice(), &s).unwrap().unwrap().id, first.id);
    b.transition_run(&alice(), &first.id, RunStatus::Cancelled, None)
        .unwrap();
    assert_eq!(a.open_run(&alice(), &s).unwrap(), None);
    let second = b.create_run(&alice(), &s, "scripted/demo").unwrap();
    let runs: Vec<_> = a
        .runs(&alice(), &s)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(runs, [first.id, second.id]);
}

fn racing_admissions_admit_one_turn(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let start = Barrier::new(2);
    let outcomes: Vec<_> = std::thread::scope(|threads| {
        let racers: Vec<_> = [&a, &b]
            .into_iter()
            .map(|store| {
                let (s, start) = (&s, &start);
                threads.spawn(move || {
                    start.wait();
                    store.create_run(&alice(), s, "scripted/demo")
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Vec<_>>()
    });
    let admitted: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().ok()).collect();
    assert_eq!(admitted.len(), 1, "one turn is admitted: {outcomes:?}");
    assert!(outcomes.iter().any(
        |o| matches!(o, Err(Error::SessionBusy { run, .. }) if *run == admitted[0].id.as_str())
    ));
    assert_eq!(a.runs(&alice(), &s).unwrap().len(), 1);
}

fn run_transitions_follow_the_state_machine(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    let refused = store
        .transition_run(&alice(), &run.id, RunStatus::Succeeded, None)
        .unwrap_err();
    assert!(
        matches!(
            refused,
            Error::IllegalRunTransition {
                from: RunStatus::Queued,
                to: RunStatus::Succeeded,
                ..
            }
        ),
        "{refused:?}"
    );
    for to in [RunStatus::Starting, RunStatus::Running] {
        assert_eq!(
            store
                .transition_run(&alice(), &run.id, to, None)
                .unwrap()
                .status,
            to
        );
    }
    let failed = store
        .transition_run(
            &alice(),
            &run.id,
            RunStatus::Failed,
            Some("the box stopped"),
        )
        .unwrap();
    assert_eq!(failed.error.as_deref(), Some("the box stopped"));
    assert!(failed.finished_at_ms.is_some());
    assert!(matches!(
        store
            .transition_run(&alice(), &run.id, RunStatus::Running, None)
            .unwrap_err(),
        Error::IllegalRunTransition { .. }
    ));
    assert_eq!(
        store.run(&alice(), &run.id).unwrap().status,
        RunStatus::Failed
    );
}

fn a_second_active_attempt_is_refused(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let run = a.create_run(&alice(), &s, "scripted/demo").unwrap();
    let first = a.start_attempt(&alice(), &run, "gateway", 1).unwrap();
    for store in [&a, &b] {
        let refused = store.start_attempt(&alice(), &run, "box-2", 2).unwrap_err();
        assert!(
            matches!(&refused, Error::AttemptActive { run: r } if *r == run.id.as_str()),
            "{refused:?}"
        );
    }
    b.finish_attempt(&alice(), &first, AttemptStatus::Failed, Some("box lost"))
        .unwrap();
    let second = b
        .resume_attempt(
            &alice(),
            &run,
            "box-2",
            2,
            Resume {
                after: Some(&first),
                checkpoint_artifact_id: Some("art_1"),
            },
        )
        .unwrap();
    let attempts = a.attempts(&alice(), &s).unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].id, first);
    assert_eq!(attempts[0].status, AttemptStatus::Failed);
    assert_eq!(attempts[0].error.as_deref(), Some("box lost"));
    assert_eq!(attempts[1].id, second);
    assert_eq!(attempts[1].status, AttemptStatus::Running);
    assert_eq!(attempts[1].resume_from.as_ref(), Some(&first));
    assert_eq!(attempts[1].checkpoint_artifact_id.as_deref(), Some("art_1"));
    assert_eq!(attempts[1].owner_epoch, 2);
    // Finishing an attempt that already ended changes nothing.
    a.finish_attempt(&alice(), &first, AttemptStatus::Succeeded, None)
        .unwrap();
    assert_eq!(
        a.attempts(&alice(), &s).unwrap()[0].status,
        AttemptStatus::Failed
    );
}

fn another_tenants_rows_are_not_found(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    let entries = store
        .append_entries(&alice(), &s, None, None, &[user("secret plan")])
        .unwrap();
    store
        .append_event(&alice(), &s, None, text("secret"))
        .unwrap();
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    // Another tenant, and the same owner id in another tenant: neither sees anything.
    for stranger in [
        Scope::new("usr_mallory", "ten_b"),
        Scope::new("usr_alice", "ten_b"),
    ] {
        let not_found = |e: Error, what: &str| match e {
            Error::NotFound { what: w, .. } => assert_eq!(w, what),
            other => panic!("expected {what} not found, got {other:?}"),
        };
        not_found(store.session(&stranger, &s).unwrap_err(), "session");
        not_found(store.run(&stranger, &run.id).unwrap_err(), "run");
        not_found(
            store
                .append_entries(&stranger, &s, Some(&entries[0].id), None, &[user("x")])
                .unwrap_err(),
            "session",
        );
        not_found(
            store
                .create_run(&stranger, &s, "scripted/demo")
                .unwrap_err(),
            "session",
        );
        not_found(
            store
                .transition_run(&stranger, &run.id, RunStatus::Cancelled, None)
                .unwrap_err(),
            "run",
        );
        assert!(store.sessions(&stranger).unwrap().is_empty());
        assert!(store.transcript(&stranger, &s).unwrap().is_empty());
        assert!(
            store
                .events_after(&stranger, &s, 0, 100)
                .unwrap()
                .is_empty()
        );
        assert_eq!(store.last_event_cursor(&stranger, &s).unwrap(), 0);
        assert_eq!(store.open_run(&stranger, &s).unwrap(), None);
        assert!(store.runs(&stranger, &s).unwrap().is_empty());
        assert!(store.attempts(&stranger, &s).unwrap().is_empty());
    }
    // Nothing the strangers tried changed Alice's rows.
    assert_eq!(texts(&*store, &alice(), &s), ["secret plan"]);
    assert_eq!(
        store.run(&alice(), &run.id).unwrap().status,
        RunStatus::Queued
    );
    assert_eq!(store.sessions(&alice()).unwrap().len(), 1);
}

/// The gateway calls the store from its tokio runtime's threads; a backend that starts a
/// runtime of its own there (as the `postgres` client does) would panic.
fn callable_from_inside_a_tokio_runtime(db: &Db) {
    let store: std::sync::Arc<dyn Backend> = db.open().into();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let cursor = runtime.block_on(async {
        let s = new_session(&*store, &alice());
        store
            .append_entries(&alice(), &s, None, None, &[user("from async")])
            .unwrap();
        let task = tokio::spawn({
            let store = store.clone();
            async move {
                store
                    .append_event(&alice(), &s, None, text("from a task"))
                    .unwrap()
                    .cursor
            }
        });
        task.await.unwrap()
    });
    assert_eq!(cursor, 1);
    drop(runtime);
}

/// Placements and worker slots, the worker protocol's rows, environments and snapshots.
mod live;

/// PostgreSQL alone: several gateways start against one database.
mod postgres_only {
    use super::*;
    use skiff_store::SessionStore as _;

    #[test]
    fn gateways_starting_at_once_on_an_empty_database_migrate_it_once() {
        let cluster = PgCluster::start();
        let url = cluster.fresh_database();
        let start = Barrier::new(3);
        let stores: Vec<PgStore> = std::thread::scope(|threads| {
            let racers: Vec<_> = (0..3)
                .map(|_| {
                    threads.spawn(|| {
                        start.wait();
                        PgStore::connect(&url)
                    })
                })
                .collect();
            racers
                .into_iter()
                .map(|r| {
                    r.join()
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log()))
                })
                .collect()
        });
        // All three share one schema: a session created through one is seen by the others.
        let s = new_session(&stores[0], &alice());
        for store in &stores {
            assert_eq!(store.session(&alice(), &s).unwrap().id, s);
        }
    }

    #[test]
    fn a_bad_url_or_an_unreachable_server_is_a_clear_error_without_the_password() {
        let malformed = PgStore::connect("postgres://skiff:hunter2@/db?port=notanumber")
            .err()
            .expect("a malformed url is refused");
        let text = malformed.to_string();
        assert!(text.contains("PostgreSQL url is malformed"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");

        let nowhere = tempfile::tempdir().unwrap();
        let unreachable = PgStore::connect(&format!(
            "host={} user=skiff password=hunter2 dbname=app",
            nowhere.path().display()
        ))
        .err()
        .expect("no server listens there");
        let text = unreachable.to_string();
        assert!(
            text.starts_with("could not connect to PostgreSQL (user skiff, database app on "),
            "{text}"
        );
        assert!(
            text.contains(&nowhere.path().display().to_string()),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
    }
}
