//! PostgreSQL restarting under a `PgStore`: the store is not left broken, and while the server
//! is down its calls fail at once with an error that says so.

use crate::conformance::{alice, new_session};
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_store::Overview as _;
use skiff_store::{Error, EventLog, PgStore, SessionStore};
use skiff_test_support::postgres::PgCluster;
use std::time::{Duration, Instant};

fn user(text: &str) -> EntryBody {
    EntryBody::UserMessage { text: text.into() }
}

fn delta(text: &str) -> EventKind {
    EventKind::TextDelta { text: text.into() }
}

#[test]
fn a_store_works_again_after_its_server_restarts_and_fails_fast_while_it_is_down() {
    let mut cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let store = PgStore::connect(&url).unwrap();
    let s = new_session(&store, &alice());
    let first = store
        .append_entries(&alice(), &s, None, None, &[user("before")])
        .unwrap();
    assert_eq!(
        store
            .append_event(&alice(), &s, None, delta("one"))
            .unwrap()
            .cursor,
        1
    );

    // A restart ends the store's open connection; the next read goes to a new one.
    cluster.restart();
    assert_eq!(store.session(&alice(), &s).unwrap().id, s);
    store.ready().unwrap();
    let second = store
        .append_entries(&alice(), &s, Some(&first[0].id), None, &[user("after")])
        .unwrap();
    assert_eq!(
        store
            .append_event(&alice(), &s, None, delta("two"))
            .unwrap()
            .cursor,
        2,
        "cursors continue gapless across the restart"
    );

    // Down: every call fails at once (no waiting on a server that is not there), and says
    // what is wrong.
    cluster.stop();
    for _ in 0..3 {
        let started = Instant::now();
        let err = store.session(&alice(), &s).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "a call waited {:?} on a stopped server",
            started.elapsed()
        );
        assert!(
            matches!(
                err,
                Error::PgConnect { .. }
                    | Error::PgUnavailable { .. }
                    | Error::PgConnectionLost { .. }
            ),
            "{err}"
        );
        let message = err.to_string();
        assert!(
            message.contains("PostgreSQL") && message.contains("database db"),
            "names the database: {message}"
        );
        assert!(store.ready().is_err(), "ready while the server is down");
    }
    let err = store
        .append_event(&alice(), &s, None, delta("lost"))
        .unwrap_err();
    assert!(err.to_string().contains("PostgreSQL"), "{err}");

    // Back: the store reconnects by itself once its backoff has passed.
    cluster.start_again();
    let deadline = Instant::now() + Duration::from_secs(15);
    while let Err(e) = store.ready() {
        assert!(
            Instant::now() < deadline,
            "never ready again: {e}\n{}",
            cluster.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let transcript: Vec<_> = store
        .transcript(&alice(), &s)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(transcript, [first[0].id.clone(), second[0].id.clone()]);
    assert_eq!(
        store
            .append_event(&alice(), &s, None, delta("three"))
            .unwrap()
            .cursor,
        3,
        "nothing written while the server was down"
    );
}

#[test]
fn an_error_from_the_server_says_what_the_server_said() {
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let store = PgStore::connect(&url).unwrap();
    let s = new_session(&store, &alice());
    // An operator's mistake outside Skiff: the transcript table is gone.
    let mut admin = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
    admin.batch_execute("DROP TABLE entries CASCADE").unwrap();

    let err = store
        .append_entries(&alice(), &s, None, None, &[user("lost?")])
        .unwrap_err();
    let said = err.to_string();
    assert!(
        said.contains("relation \"entries\" does not exist") && said.contains("42P01"),
        "{said}"
    );
    assert!(!said.contains("db error"), "{said}");
}
