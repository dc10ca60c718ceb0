//! Integration tests of the store against a real SQLite file.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

use skiff_protocol::SessionId;
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_store::{AttemptStatus, Error, NewSession, Scope, Store};

pub(crate) fn alice() -> Scope {
    Scope::new("usr_alice", "ten_a")
}

fn new_session(store: &Store, scope: &Scope) -> SessionId {
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    store
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
    id
}

fn user(text: &str) -> EntryBody {
    EntryBody::UserMessage { text: text.into() }
}

#[test]
fn appends_chain_entries_and_walk_back_from_the_leaf() {
    let store = Store::open_in_memory().unwrap();
    let s = new_session(&store, &alice());
    let first = store
        .append_entries(&alice(), &s, None, None, &[user("a"), user("b")])
        .unwrap();
    assert_eq!(first[0].parent_id, None);
    assert_eq!(first[1].parent_id.as_ref(), Some(&first[0].id));
    let second = store
        .append_entries(&alice(), &s, Some(&first[1].id), None, &[user("c")])
        .unwrap();
    let transcript = store.transcript(&alice(), &s).unwrap();
    let texts: Vec<_> = transcript
        .iter()
        .map(|e| match &e.body {
            EntryBody::UserMessage { text } => text.as_str(),
            _ => "?",
        })
        .collect();
    assert_eq!(texts, ["a", "b", "c"]);
    assert_eq!(
        store.leaf(&alice(), &s).unwrap(),
        Some(second[0].id.clone())
    );
}

#[test]
fn a_stale_base_leaf_is_a_conflict_and_writes_nothing() {
    let store = Store::open_in_memory().unwrap();
    let s = new_session(&store, &alice());
    let first = store
        .append_entries(&alice(), &s, None, None, &[user("a")])
        .unwrap();
    store
        .append_entries(&alice(), &s, Some(&first[0].id), None, &[user("b")])
        .unwrap();
    let err = store
        .append_entries(&alice(), &s, Some(&first[0].id), None, &[user("stale")])
        .unwrap_err();
    assert!(matches!(err, Error::LeafConflict { .. }), "{err}");
    assert!(err.to_string().contains("moved"), "{err}");
    let err = store
        .append_entries(&alice(), &s, None, None, &[user("stale")])
        .unwrap_err();
    assert!(matches!(err, Error::LeafConflict { .. }));
    assert_eq!(store.transcript(&alice(), &s).unwrap().len(), 2);
}

#[test]
fn one_tenant_cannot_see_another_tenants_session() {
    let store = Store::open_in_memory().unwrap();
    let s = new_session(&store, &alice());
    let mallory = Scope::new("usr_alice", "ten_b");
    assert!(matches!(
        store.session(&mallory, &s),
        Err(Error::NotFound { .. })
    ));
    assert!(store.sessions(&mallory).unwrap().is_empty());
    assert!(store.transcript(&mallory, &s).unwrap().is_empty());
    assert!(matches!(
        store.append_entries(&mallory, &s, None, None, &[user("x")]),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        store.create_run(&mallory, &s, "m/x"),
        Err(Error::NotFound { .. })
    ));
    assert_eq!(store.sessions(&alice()).unwrap().len(), 1);
}

#[test]
fn a_session_admits_one_open_run_at_a_time() {
    let store = Store::open_in_memory().unwrap();
    let s = new_session(&store, &alice());
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    let err = store.create_run(&alice(), &s, "scripted/demo").unwrap_err();
    assert!(matches!(err, Error::SessionBusy { .. }), "{err}");
    assert!(err.to_string().contains(run.id.as_str()));
    store
        .transition_run(&alice(), &run.id, RunStatus::Starting, None)
        .unwrap();
    store
        .transition_run(&alice(), &run.id, RunStatus::Running, None)
        .unwrap();
    store
        .transition_run(&alice(), &run.id, RunStatus::Succeeded, None)
        .unwrap();
    store.create_run(&alice(), &s, "scripted/demo").unwrap();
}

#[test]
fn illegal_transitions_are_errors() {
    let store = Store::open_in_memory().unwrap();
    let s = new_session(&store, &alice());
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    let err = store
        .transition_run(&alice(), &run.id, RunStatus::Succeeded, None)
        .unwrap_err();
    assert!(matches!(err, Error::IllegalRunTransition { .. }), "{err}");
    assert_eq!(
        store.run(&alice(), &run.id).unwrap().status,
        RunStatus::Queued
    );
}

#[test]
fn a_second_active_attempt_is_refused() {
    let store = Store::open_in_memory().unwrap();
    let s = new_session(&store, &alice());
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    let first = store.start_attempt(&alice(), &run, "gateway", 1).unwrap();
    let err = store
        .start_attempt(&alice(), &run, "gateway", 1)
        .unwrap_err();
    assert!(matches!(err, Error::AttemptActive { .. }), "{err}");
    store
        .finish_attempt(&alice(), &first, AttemptStatus::Failed)
        .unwrap();
    store.start_attempt(&alice(), &run, "gateway", 2).unwrap();
}

#[test]
fn active_attempts_become_orphaned_when_the_gateway_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.db");
    let (session, run, attempt, done_attempt) = {
        let store = Store::open(&path).unwrap();
        let s = new_session(&store, &alice());
        let finished = store.create_run(&alice(), &s, "scripted/demo").unwrap();
        let done_attempt = store
            .start_attempt(&alice(), &finished, "gateway", 1)
            .unwrap();
        store
            .transition_run(&alice(), &finished.id, RunStatus::Starting, None)
            .unwrap();
        store
            .transition_run(&alice(), &finished.id, RunStatus::Running, None)
            .unwrap();
        store
            .transition_run(&alice(), &finished.id, RunStatus::Succeeded, None)
            .unwrap();
        store
            .finish_attempt(&alice(), &done_attempt, AttemptStatus::Succeeded)
            .unwrap();
        let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
        store
            .transition_run(&alice(), &run.id, RunStatus::Starting, None)
            .unwrap();
        store
            .transition_run(&alice(), &run.id, RunStatus::Running, None)
            .unwrap();
        let attempt = store.start_attempt(&alice(), &run, "gateway", 1).unwrap();
        (s, run.id, attempt, done_attempt)
    };
    let store = Store::open(&path).unwrap();
    let orphaned = store
        .orphan_active_on_start("the gateway restarted")
        .unwrap();
    assert_eq!(orphaned.len(), 1);
    assert_eq!(orphaned[0].0, alice());
    assert_eq!(orphaned[0].1.session_id, session);
    let row = store.run(&alice(), &run).unwrap();
    assert_eq!(row.status, RunStatus::Orphaned);
    assert_eq!(row.error.as_deref(), Some("the gateway restarted"));
    assert_eq!(store.attempt_status(&attempt).unwrap(), "orphaned");
    assert_eq!(store.attempt_status(&done_attempt).unwrap(), "succeeded");
    // The session accepts a new turn afterwards.
    store
        .create_run(&alice(), &session, "scripted/demo")
        .unwrap();
}

#[test]
fn events_get_monotonic_cursors_per_session() {
    let store = Store::open_in_memory().unwrap();
    let a = new_session(&store, &alice());
    let b = new_session(&store, &alice());
    for i in 0..5 {
        let e = store
            .append_event(
                &alice(),
                &a,
                None,
                EventKind::TextDelta {
                    text: i.to_string(),
                },
            )
            .unwrap();
        assert_eq!(e.cursor, i + 1);
    }
    let other = store
        .append_event(
            &alice(),
            &b,
            None,
            EventKind::TextDelta { text: "b".into() },
        )
        .unwrap();
    assert_eq!(other.cursor, 1);
    let after = store.events_after(&alice(), &a, 2, 100).unwrap();
    assert_eq!(
        after.iter().map(|e| e.cursor).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    assert!(
        store
            .events_after(&Scope::new("x", "y"), &a, 0, 100)
            .unwrap()
            .is_empty()
    );
}

mod snapshots;
