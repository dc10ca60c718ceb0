//! Integration tests of the store against a real SQLite file, and the conformance suite both
//! backends (SQLite and PostgreSQL) pass (`conformance.rs`).

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
        .finish_attempt(
            &alice(),
            &first,
            AttemptStatus::Failed,
            Some("its box stopped"),
        )
        .unwrap();
    let second = store
        .resume_attempt(
            &alice(),
            &run,
            "env_b",
            2,
            skiff_store::Resume {
                after: Some(&first),
                checkpoint_artifact_id: Some("art_1"),
            },
        )
        .unwrap();
    // Both are listed, oldest first, with how the first ended and where the second began.
    let attempts = store.attempts(&alice(), &s).unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].status, AttemptStatus::Failed);
    assert_eq!(attempts[0].error.as_deref(), Some("its box stopped"));
    assert_eq!(attempts[1].id, second);
    assert_eq!(attempts[1].resume_from.as_ref(), Some(&first));
    assert_eq!(attempts[1].checkpoint_artifact_id.as_deref(), Some("art_1"));
    assert_eq!(attempts[1].owner_epoch, 2);
    assert!(
        store
            .attempts(&Scope::new("usr_bob", "ten_b"), &s)
            .unwrap()
            .is_empty(),
        "another owner's attempts"
    );
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
            .finish_attempt(&alice(), &done_attempt, AttemptStatus::Succeeded, None)
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

mod conformance;
mod conformance_artifacts;
mod conformance_gateway;
mod conformance_leases;
mod conformance_people;
mod migrate;
mod pg_reconnect;
mod snapshots;
/// A worker session of profile `local`, placed on `env` with its worker admitted (`active`).
fn active_worker_session(store: &Store, env: &skiff_protocol::EnvironmentId) -> SessionId {
    use skiff_protocol::environment::PlacementState as P;
    let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
    store
        .create_session_placed(
            &alice(),
            &NewSession {
                id: id.clone(),
                title: "on a box".into(),
                workspace: WorkspaceView::Plain {
                    source: "/src".into(),
                    path: "/state/ws".into(),
                },
                model_ref: "scripted/demo".into(),
            },
            Some(("local", 16)),
        )
        .unwrap();
    for to in [P::Provisioning, P::Syncing, P::Starting, P::Active] {
        let change = skiff_store::PlacementChange {
            environment_id: (to == P::Syncing).then_some(env),
            advance_epoch: to == P::Starting,
            worker_pid: (to == P::Starting).then_some(42),
            box_in_step: (to == P::Starting).then_some(true),
            ..Default::default()
        };
        store
            .transition_placement(&alice(), &id, to, &change)
            .unwrap();
    }
    id
}

fn finish_run(store: &Store, run: &skiff_protocol::RunId) {
    for status in [
        RunStatus::Starting,
        RunStatus::Running,
        RunStatus::Succeeded,
    ] {
        store.transition_run(&alice(), run, status, None).unwrap();
    }
}

#[test]
fn a_session_with_a_turn_open_or_work_on_its_box_is_never_parked_and_a_parked_one_frees_its_slot() {
    use skiff_protocol::environment::PlacementState as P;
    let store = Store::open_in_memory().unwrap();
    let env = skiff_protocol::EnvironmentId::from_suffix("box1");
    let s = active_worker_session(&store, &env);
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    assert_eq!(
        store.worker_slots().unwrap(),
        skiff_store::WorkerSlots {
            live: 1,
            running_turns: 1
        }
    );
    assert!(store.idle_placements().unwrap().is_empty());
    assert_eq!(store.park_placement(&alice(), &s).unwrap(), None);
    assert_eq!(
        store.placement(&alice(), &s).unwrap().unwrap().state,
        P::Active
    );

    finish_run(&store, &run.id);
    // The turn's work was not brought back (its box is ahead): the box is not given back.
    store.mark_box_ahead(&alice(), &s).unwrap();
    assert!(store.idle_placements().unwrap().is_empty());
    assert_eq!(store.park_placement(&alice(), &s).unwrap(), None);
    // Its reconciliation succeeded: in step again.
    for to in [P::Reconciling, P::Active] {
        let change = skiff_store::PlacementChange {
            box_in_step: (to == P::Active).then_some(true),
            ..Default::default()
        };
        store
            .transition_placement(&alice(), &s, to, &change)
            .unwrap();
    }
    let idle = store.idle_placements().unwrap();
    assert_eq!(idle.len(), 1);
    assert_eq!(idle[0].session_id, s);
    let before = store.park_placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(before.environment_id.as_ref(), Some(&env));
    assert_eq!(before.worker_pid, Some(42));
    let parked = store.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(parked.state, P::Parked);
    assert_eq!(parked.environment_id, None, "a parked session names no box");
    assert_eq!(
        parked.owner_epoch,
        before.owner_epoch + 1,
        "its old worker is fenced"
    );
    assert_eq!(store.session(&alice(), &s).unwrap().placement, "parked");
    // Parked holds no slot, is not reconciled at start and names no environment.
    assert_eq!(store.worker_slots().unwrap().live, 0);
    assert!(store.live_placements().unwrap().is_empty());
    assert!(store.sessions_on_environment(&env).unwrap().is_empty());
    // Parking twice is not a second park.
    assert_eq!(store.park_placement(&alice(), &s).unwrap(), None);

    // A turn admitted after the park finds the session parked; it claims a slot again.
    store.create_run(&alice(), &s, "scripted/demo").unwrap();
    let again = store.request_placement(&alice(), &s, "local", 1).unwrap();
    assert_eq!(again.state, P::Requested);
    assert_eq!(store.worker_slots().unwrap().live, 1);
}

#[test]
fn a_full_gateway_says_how_many_slots_run_turns_and_idle_sessions_go_longest_idle_first() {
    let store = Store::open_in_memory().unwrap();
    let a = active_worker_session(&store, &skiff_protocol::EnvironmentId::from_suffix("a"));
    let b = active_worker_session(&store, &skiff_protocol::EnvironmentId::from_suffix("b"));
    let c = active_worker_session(&store, &skiff_protocol::EnvironmentId::from_suffix("c"));
    store.create_run(&alice(), &c, "scripted/demo").unwrap();
    // A finished turn makes a session the most recently used.
    let run = store.create_run(&alice(), &a, "scripted/demo").unwrap();
    finish_run(&store, &run.id);
    let idle = store.idle_placements().unwrap();
    let ids: Vec<&SessionId> = idle.iter().map(|p| &p.session_id).collect();
    assert_eq!(ids.len(), 2, "the session with a turn open is not idle");
    assert!(ids.contains(&&a) && ids.contains(&&b), "{idle:?}");
    assert!(
        idle.windows(2)
            .all(|w| w[0].idle_since_ms <= w[1].idle_since_ms),
        "the one idle longest comes first: {idle:?}"
    );
    let a_idle = idle.iter().find(|p| p.session_id == a).unwrap();
    assert_eq!(
        a_idle.idle_since_ms,
        store
            .run(&alice(), &run.id)
            .unwrap()
            .finished_at_ms
            .unwrap(),
        "idle since its last turn ended"
    );

    let d = new_session(&store, &alice());
    let err = store
        .request_placement(&alice(), &d, "local", 3)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkersAtCapacity {
                running_turns: 1,
                other: 2,
                max: 3
            }
        ),
        "{err}"
    );
    store.park_placement(&alice(), &a).unwrap().unwrap();
    store.request_placement(&alice(), &d, "local", 3).unwrap();
}

#[test]
fn a_pull_back_claim_loses_to_an_open_turn_and_coming_home_fences_the_worker_and_frees_the_box() {
    use skiff_protocol::environment::PlacementState as P;
    let store = Store::open_in_memory().unwrap();
    let env = skiff_protocol::EnvironmentId::from_suffix("box1");
    let s = active_worker_session(&store, &env);
    let run = store.create_run(&alice(), &s, "scripted/demo").unwrap();
    let err = store.claim_pull_back(&alice(), &s).unwrap_err();
    assert!(matches!(err, Error::SessionBusy { .. }), "{err}");
    assert_eq!(
        store.placement(&alice(), &s).unwrap().unwrap().state,
        P::Active
    );

    finish_run(&store, &run.id);
    let before = store.claim_pull_back(&alice(), &s).unwrap();
    assert_eq!(before.environment_id.as_ref(), Some(&env));
    assert_eq!(store.session(&alice(), &s).unwrap().placement, "draining");
    // A second claim finds it draining: not a second pull-back.
    let again = store.claim_pull_back(&alice(), &s).unwrap_err();
    assert!(
        matches!(again, Error::IllegalPlacementTransition { .. }),
        "{again}"
    );

    let was = store.come_home(&alice(), &s).unwrap();
    assert_eq!(was.environment_id.as_ref(), Some(&env));
    let home = store.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(home.state, P::Local);
    assert_eq!(home.environment_id, None, "a session at home names no box");
    assert!(
        home.owner_epoch > before.owner_epoch,
        "its old worker is fenced"
    );
    assert_eq!(store.session(&alice(), &s).unwrap().placement, "local");
    assert_eq!(store.worker_slots().unwrap().live, 0);
    assert!(store.sessions_on_environment(&env).unwrap().is_empty());
    // Home is home: coming home again is an illegal move, and it can be dispatched again.
    assert!(store.come_home(&alice(), &s).is_err());
    store.request_placement(&alice(), &s, "local", 3).unwrap();
}

#[test]
fn a_session_starts_children_up_to_its_cap_and_knows_them() {
    let store = Store::open_in_memory().unwrap();
    let parent = new_session(&store, &alice());
    let child = |title: &str| NewSession {
        id: SessionId::from_suffix(&skiff_store::mint().unwrap()),
        title: title.into(),
        workspace: WorkspaceView::Plain {
            source: "/state/ws".into(),
            path: "/state/ws2".into(),
        },
        model_ref: "scripted/demo".into(),
    };
    let first = store
        .create_child_session(&alice(), &child("one"), &parent, ("local", 16), 2)
        .unwrap();
    assert_eq!(first.parent_id.as_ref(), Some(&parent));
    store
        .create_child_session(&alice(), &child("two"), &parent, ("local", 16), 2)
        .unwrap();
    let refused = child("three");
    let err = store
        .create_child_session(&alice(), &refused, &parent, ("local", 16), 2)
        .unwrap_err();
    assert!(
        matches!(err, Error::TooManyChildren { max: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("max_children"), "{err}");
    // Refused in the transaction: no row, and no worker slot claimed for it.
    assert!(store.session(&alice(), &refused.id).is_err());
    assert!(store.placement(&alice(), &refused.id).unwrap().is_none());
    let titles: Vec<String> = store
        .children(&alice(), &parent)
        .unwrap()
        .into_iter()
        .map(|c| c.title)
        .collect();
    assert_eq!(titles, ["one", "two"]);
    assert_eq!(store.session(&alice(), &parent).unwrap().parent_id, None);
    // Another tenant sees none of them.
    let bob = Scope::new("usr_bob", "ten_b");
    assert!(store.children(&bob, &parent).unwrap().is_empty());
}

#[test]
fn a_group_takes_all_its_worker_slots_at_once_or_none_and_has_one_pick() {
    let store = Store::open_in_memory().unwrap();
    let attempt = || NewSession {
        id: SessionId::from_suffix(&skiff_store::mint().unwrap()),
        title: "try it".into(),
        workspace: WorkspaceView::Plain {
            source: "/src".into(),
            path: "/state/ws".into(),
        },
        model_ref: "scripted/demo".into(),
    };
    // One slot of three is taken: a group of three is refused whole.
    let busy = NewSession { ..attempt() };
    store
        .create_session_placed(&alice(), &busy, Some(("local", 3)))
        .unwrap();
    let group = skiff_protocol::GroupId::from_suffix("g1");
    let three = [attempt(), attempt(), attempt()];
    let err = store
        .create_group(&alice(), &group, "try it", &three, ("local", 3))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::GroupAtCapacity {
                needs: 3,
                free: 2,
                max: 3
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("needs 3 workers, 2 free"), "{err}");
    assert!(store.group(&alice(), &group).is_err());
    for a in &three {
        assert!(store.session(&alice(), &a.id).is_err(), "no row written");
    }
    assert_eq!(store.worker_slots().unwrap().live, 1);

    // Two fit: both rows, both placements, in the order given.
    let two = [attempt(), attempt()];
    let rows = store
        .create_group(&alice(), &group, "try it", &two, ("local", 3))
        .unwrap();
    let ids: Vec<_> = rows.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids, [two[0].id.clone(), two[1].id.clone()]);
    assert!(rows.iter().all(|r| r.group_id.as_ref() == Some(&group)));
    assert!(
        rows[0].created_at_ms < rows[1].created_at_ms,
        "started in order"
    );
    assert_eq!(store.worker_slots().unwrap().live, 3);

    // One pick: again the same is fine, another is refused, a stranger is not in the group.
    let bob = Scope::new("usr_bob", "ten_b");
    assert!(
        store.pick(&bob, &group, &ids[0]).is_err(),
        "another tenant's group"
    );
    assert!(matches!(
        store.pick(&alice(), &group, &busy.id),
        Err(Error::NotFound { .. })
    ));
    assert_eq!(
        store
            .pick(&alice(), &group, &ids[0])
            .unwrap()
            .picked
            .as_ref(),
        Some(&ids[0])
    );
    assert_eq!(
        store
            .pick(&alice(), &group, &ids[0])
            .unwrap()
            .picked
            .as_ref(),
        Some(&ids[0])
    );
    let err = store.pick(&alice(), &group, &ids[1]).unwrap_err();
    assert!(matches!(err, Error::AlreadyPicked { .. }), "{err}");
}
