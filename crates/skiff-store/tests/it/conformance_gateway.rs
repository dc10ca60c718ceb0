//! Conformance of the rest of what the gateway calls — sessions placed at creation, children,
//! forks, fan-out groups (`Lineage`); turn admission, session choices, a worker's acknowledged
//! events, the restart's reconciliation (`Turns`); the session list page, `owner_of`, gauges,
//! readiness and the audit listener (`Overview`) — each test on SQLite and on PostgreSQL
//! (`conformance_gateway::{sqlite,postgres}::*`).

use crate::conformance::{Db, alice, new_session, on_both_backends};
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::approval::ApprovalPolicy;
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::StreamKind;
use skiff_protocol::{GroupId, SessionId};
use skiff_store::{
    Admission, ArtifactRole, AttemptStatus, Error, NewArtifact, NewSession, Owned, Retention,
    Scope, SessionChoices, Sight,
};
use std::sync::{Arc, Barrier, Mutex};

on_both_backends!(
    a_session_placed_at_creation_claims_a_slot_or_is_not_written,
    racing_dispatches_never_pass_the_childrens_cap,
    a_fork_copies_the_transcript_and_numbers_its_checkpoints_afresh,
    a_group_fits_whole_or_is_not_written_and_one_pick_wins,
    an_admission_writes_its_run_claim_and_choices_together_or_nothing,
    session_choices_are_written_whole_and_each_setting_alone,
    a_workers_event_moves_its_ack_cursor_and_never_back,
    the_restart_orphans_every_open_run_and_active_attempt,
    the_session_page_is_one_query_scoped_ordered_and_paged,
    owner_of_finds_a_row_within_the_sight_only,
    gauges_count_across_scopes_and_the_audit_listener_hears_each_row,
);

fn new(title: &str) -> NewSession {
    NewSession {
        id: SessionId::from_suffix(&skiff_store::mint().unwrap()),
        title: title.into(),
        workspace: WorkspaceView::Plain {
            source: "/src".into(),
            path: "/state/ws".into(),
        },
        model_ref: "scripted/demo".into(),
    }
}

fn user(text: &str) -> EntryBody {
    EntryBody::UserMessage { text: text.into() }
}

fn a_session_placed_at_creation_claims_a_slot_or_is_not_written(db: &Db) {
    let store = db.open();
    let scope = alice();
    let first = new("first");
    let row = store
        .create_session_placed(&scope, &first, Some(("local", 1)))
        .unwrap();
    assert_eq!(row.placement, "requested", "placed as it is created");
    let placement = store.placement(&scope, &first.id).unwrap().unwrap();
    assert_eq!(placement.profile, "local");

    let second = new("second");
    let err = store
        .create_session_placed(&scope, &second, Some(("local", 1)))
        .unwrap_err();
    assert!(matches!(err, Error::WorkersAtCapacity { .. }), "{err}");
    assert!(
        matches!(
            store.session(&scope, &second.id),
            Err(Error::NotFound { .. })
        ),
        "a session refused a slot leaves no row"
    );
    let local = store
        .create_session_placed(&scope, &new("at home"), None)
        .unwrap();
    assert_eq!(local.placement, "local");
}

fn racing_dispatches_never_pass_the_childrens_cap(db: &Db) {
    let scope = alice();
    let parent = new_session(&*db.open(), &scope);
    let stores = [db.open(), db.open()];
    let barrier = Barrier::new(2);
    let outcomes: Vec<Result<_, Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = stores
            .iter()
            .map(|store| {
                let (scope, parent, barrier) = (&scope, &parent, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    store.create_child_session(scope, &new("child"), parent, ("local", 10), 1)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let made: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().ok()).collect();
    assert_eq!(made.len(), 1, "one dispatch passes the cap: {outcomes:?}");
    assert!(
        outcomes
            .iter()
            .any(|o| matches!(o, Err(Error::TooManyChildren { max: 1, .. }))),
        "{outcomes:?}"
    );
    let children = stores[0].children(&scope, &parent).unwrap();
    assert_eq!(children.len(), 1);
    assert_eq!(children[0].id, made[0].id);
    assert_eq!(children[0].parent_id.as_ref(), Some(&parent));
    assert_eq!(
        children[0].placement, "requested",
        "a child is placed on its box"
    );
    let other = Scope::new("usr_other", "ten_a");
    assert!(stores[0].children(&other, &parent).unwrap().is_empty());
}

fn a_fork_copies_the_transcript_and_numbers_its_checkpoints_afresh(db: &Db) {
    let store = db.open();
    let scope = alice();
    let original = new_session(&*store, &scope);
    let run = store
        .create_run(&scope, &original, "scripted/demo")
        .unwrap();
    let written = store
        .append_entries(
            &scope,
            &original,
            None,
            Some(&run.id),
            &[user("one"), user("two"), user("three")],
        )
        .unwrap();
    let checkpoint = |hash: &str| NewArtifact {
        session_id: Some(original.clone()),
        run_id: None,
        role: ArtifactRole::Checkpoint,
        retention: Retention::WhileRetryable,
        hash: hash.into(),
        size: 3,
        meta: serde_json::json!({ "mode": "plain" }),
        expires_at_ms: None,
    };
    let fork = new("fork");
    let row = store
        .create_fork(
            &scope,
            &fork,
            &written[..2],
            &[checkpoint("aaa"), checkpoint("bbb")],
        )
        .unwrap();
    assert_eq!(row.id, fork.id);
    let copied = store.transcript(&scope, &fork.id).unwrap();
    assert_eq!(
        copied.len(),
        2,
        "the transcript up to where the fork was taken"
    );
    for (copy, was) in copied.iter().zip(&written) {
        assert_ne!(copy.id, was.id, "copies get ids of their own");
        assert_eq!(copy.body, was.body);
        assert_eq!(copy.run_id, was.run_id, "each keeps the turn that wrote it");
        assert_eq!(copy.created_at_ms, was.created_at_ms);
    }
    assert_eq!(copied[1].parent_id.as_ref(), Some(&copied[0].id), "a chain");
    assert_eq!(
        store.leaf(&scope, &fork.id).unwrap().as_ref(),
        Some(&copied[1].id)
    );
    let records = store
        .artifacts(&scope, &fork.id, ArtifactRole::Checkpoint)
        .unwrap();
    let numbered: Vec<_> = records.iter().map(|r| (r.hash.as_str(), r.seq)).collect();
    assert_eq!(numbered, [("aaa", Some(1)), ("bbb", Some(2))]);
    assert!(
        store.runs(&scope, &fork.id).unwrap().is_empty(),
        "no runs yet"
    );
    assert_eq!(store.transcript(&scope, &original).unwrap().len(), 3);

    // A fork whose id is taken writes nothing of it.
    let again = store.create_fork(&scope, &fork, &written, &[checkpoint("ccc")]);
    assert!(again.is_err());
    assert_eq!(store.transcript(&scope, &fork.id).unwrap().len(), 2);
    assert_eq!(
        store
            .artifacts(&scope, &fork.id, ArtifactRole::Checkpoint)
            .unwrap()
            .len(),
        2
    );
}

fn a_group_fits_whole_or_is_not_written_and_one_pick_wins(db: &Db) {
    let store = db.open();
    let scope = alice();
    store
        .create_session_placed(&scope, &new("elsewhere"), Some(("local", 3)))
        .unwrap();
    let too_big = GroupId::from_suffix(&skiff_store::mint().unwrap());
    let three = [new("a"), new("b"), new("c")];
    let err = store
        .create_group(&scope, &too_big, "try it thrice", &three, ("local", 3))
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
    assert!(matches!(
        store.group(&scope, &too_big),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        store.session(&scope, &three[0].id),
        Err(Error::NotFound { .. })
    ));

    let group = GroupId::from_suffix(&skiff_store::mint().unwrap());
    let rows = store
        .create_group(&scope, &group, "try it twice", &three[..2], ("local", 3))
        .unwrap();
    let ids: Vec<_> = rows.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids, [three[0].id.clone(), three[1].id.clone()], "in order");
    assert!(rows.iter().all(|r| r.group_id.as_ref() == Some(&group)));
    assert!(rows.iter().all(|r| r.placement == "requested"));
    assert_eq!(
        store
            .group_sessions(&scope, &group)
            .unwrap()
            .iter()
            .map(|r| r.id.clone())
            .collect::<Vec<_>>(),
        ids
    );
    let read = store.group(&scope, &group).unwrap();
    assert_eq!(
        (read.title.as_str(), read.picked.as_ref()),
        ("try it twice", None)
    );
    let other = Scope::new("usr_other", "ten_a");
    assert!(matches!(
        store.group(&other, &group),
        Err(Error::NotFound { .. })
    ));

    let stores = [db.open(), db.open()];
    let barrier = Barrier::new(2);
    let picks: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = stores
            .iter()
            .zip(&ids)
            .map(|(store, id)| {
                let (scope, group, barrier) = (&scope, &group, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    store.pick(scope, group, id)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let won: Vec<_> = picks.iter().filter_map(|p| p.as_ref().ok()).collect();
    assert_eq!(won.len(), 1, "one pick wins: {picks:?}");
    assert!(
        picks
            .iter()
            .any(|p| matches!(p, Err(Error::AlreadyPicked { .. }))),
        "{picks:?}"
    );
    let winner = won[0].picked.clone().unwrap();
    assert_eq!(
        store.pick(&scope, &group, &winner).unwrap().picked,
        Some(winner.clone()),
        "picking the picked one again changes nothing"
    );
    let stranger = new_session(&*store, &scope);
    assert!(matches!(
        store.pick(&scope, &group, &stranger),
        Err(Error::AlreadyPicked { .. })
    ));
}

fn an_admission_writes_its_run_claim_and_choices_together_or_nothing(db: &Db) {
    let store = db.open();
    let scope = alice();
    store
        .create_session_placed(&scope, &new("holds the slot"), Some(("local", 1)))
        .unwrap();
    let session = new_session(&*store, &scope);
    let policy = ApprovalPolicy::OnRequest;
    let admission = Admission {
        choices: SessionChoices {
            reasoning: Some("high"),
            approval: Some(&policy),
            agent: Some(("reviewer", "abc123")),
        },
        claim: Some(("local", 1)),
    };
    let err = store
        .admit_run(&scope, &session, "scripted/demo", &admission)
        .unwrap_err();
    assert!(matches!(err, Error::WorkersAtCapacity { .. }), "{err}");
    assert!(
        store.open_run(&scope, &session).unwrap().is_none(),
        "no run"
    );
    let row = store.session(&scope, &session).unwrap();
    assert_eq!(
        (row.reasoning, row.approval, row.placement.as_str()),
        (None, None, "local")
    );
    assert_eq!(store.session_agent(&scope, &session).unwrap(), None);

    let admission = Admission {
        claim: Some(("local", 2)),
        ..admission
    };
    let run = store
        .admit_run(&scope, &session, "scripted/demo", &admission)
        .unwrap();
    assert_eq!(run.status, RunStatus::Queued);
    let row = store.session(&scope, &session).unwrap();
    assert_eq!(row.reasoning.as_deref(), Some("high"));
    assert_eq!(row.approval, Some(ApprovalPolicy::OnRequest));
    assert_eq!(
        row.placement, "requested",
        "the claim is written with the run"
    );
    assert_eq!(
        store.session_agent(&scope, &session).unwrap(),
        Some(("reviewer".into(), "abc123".into()))
    );

    let busy = store
        .admit_run(&scope, &session, "scripted/demo", &Admission::default())
        .unwrap_err();
    assert!(
        matches!(&busy, Error::SessionBusy { run: open, .. } if *open == run.id.to_string()),
        "{busy}"
    );
    let other = Scope::new("usr_other", "ten_a");
    assert!(matches!(
        store.admit_run(&other, &session, "scripted/demo", &Admission::default()),
        Err(Error::NotFound { .. })
    ));
}

fn session_choices_are_written_whole_and_each_setting_alone(db: &Db) {
    let store = db.open();
    let scope = alice();
    let session = new_session(&*store, &scope);
    let policy = ApprovalPolicy::OnRequest;
    let row = store
        .set_session_choices(
            &scope,
            &session,
            &SessionChoices {
                reasoning: Some("low"),
                approval: Some(&policy),
                agent: Some(("reviewer", "d1")),
            },
        )
        .unwrap();
    assert_eq!(row.reasoning.as_deref(), Some("low"));
    assert_eq!(row.approval, Some(ApprovalPolicy::OnRequest));
    assert_eq!(
        store.session_agent(&scope, &session).unwrap(),
        Some(("reviewer".into(), "d1".into()))
    );
    let row = store
        .set_session_choices(&scope, &session, &SessionChoices::default())
        .unwrap();
    assert_eq!(row.reasoning.as_deref(), Some("low"), "None leaves it");

    let row = store.set_session_reasoning(&scope, &session, None).unwrap();
    assert_eq!(row.reasoning, None, "back to the model's setting");
    let row = store
        .set_session_approval(&scope, &session, &ApprovalPolicy::Never)
        .unwrap();
    assert_eq!(row.approval, Some(ApprovalPolicy::Never));

    let other = Scope::new("usr_other", "ten_a");
    for outcome in [
        store.set_session_reasoning(&other, &session, Some("high")),
        store.set_session_approval(&other, &session, &policy),
        store.set_session_choices(
            &other,
            &session,
            &SessionChoices {
                reasoning: Some("high"),
                ..SessionChoices::default()
            },
        ),
    ] {
        assert!(
            matches!(outcome, Err(Error::NotFound { .. })),
            "{outcome:?}"
        );
    }
    assert_eq!(store.session(&scope, &session).unwrap().reasoning, None);
}

fn a_workers_event_moves_its_ack_cursor_and_never_back(db: &Db) {
    let store = db.open();
    let scope = alice();
    let session = new_session(&*store, &scope);
    let text = |t: &str| EventKind::TextDelta { text: t.into() };
    let first = store
        .append_worker_event(&scope, &session, None, text("a"), 2, 5)
        .unwrap();
    let second = store
        .append_worker_event(&scope, &session, None, text("b"), 2, 3)
        .unwrap();
    assert_eq!((first.cursor, second.cursor), (1, 2));
    let cursors = store.worker_cursors(&session, 2).unwrap();
    assert_eq!(
        cursors.get(&StreamKind::Events),
        Some(&5),
        "never moved back"
    );
    assert!(store.worker_cursors(&session, 1).unwrap().is_empty());
    let read = store.events_after(&scope, &session, 0, 10).unwrap();
    assert_eq!(read.len(), 2);
    assert_eq!(read[1].kind, text("b"));
    assert_eq!(
        store
            .append_event(&scope, &session, None, text("c"))
            .unwrap()
            .cursor,
        3,
        "one cursor sequence for both kinds of append"
    );
}

fn the_restart_orphans_every_open_run_and_active_attempt(db: &Db) {
    let store = db.open();
    let (alice, bob) = (alice(), Scope::new("usr_bob", "ten_b"));
    let running = new_session(&*store, &alice);
    let queued = new_session(&*store, &bob);
    let done = new_session(&*store, &alice);
    let run = store.create_run(&alice, &running, "scripted/demo").unwrap();
    for to in [RunStatus::Starting, RunStatus::Running] {
        store.transition_run(&alice, &run.id, to, None).unwrap();
    }
    store.start_attempt(&alice, &run, "gateway", 1).unwrap();
    let waiting = store.create_run(&bob, &queued, "scripted/demo").unwrap();
    let finished = store.create_run(&alice, &done, "scripted/demo").unwrap();
    for to in [
        RunStatus::Starting,
        RunStatus::Running,
        RunStatus::Succeeded,
    ] {
        store
            .transition_run(&alice, &finished.id, to, None)
            .unwrap();
    }

    let orphaned = store
        .orphan_active_on_start("the gateway restarted")
        .unwrap();
    let mut told: Vec<_> = orphaned
        .iter()
        .map(|(scope, run)| (scope.clone(), run.id.clone(), run.status, run.error.clone()))
        .collect();
    told.sort_by(|a, b| a.1.as_str().cmp(b.1.as_str()));
    let mut expected = vec![
        (
            alice.clone(),
            run.id.clone(),
            RunStatus::Orphaned,
            Some("the gateway restarted".to_owned()),
        ),
        (
            bob.clone(),
            waiting.id.clone(),
            RunStatus::Orphaned,
            Some("the gateway restarted".to_owned()),
        ),
    ];
    expected.sort_by(|a, b| a.1.as_str().cmp(b.1.as_str()));
    assert_eq!(told, expected, "every open run, with whose it is");
    assert!(orphaned.iter().all(|(_, run)| run.finished_at_ms.is_some()));
    assert_eq!(
        store.run(&alice, &run.id).unwrap().status,
        RunStatus::Orphaned
    );
    assert_eq!(
        store.run(&alice, &finished.id).unwrap().status,
        RunStatus::Succeeded,
        "a finished run stays as it was"
    );
    let attempts = store.attempts(&alice, &running).unwrap();
    assert_eq!(attempts[0].status, AttemptStatus::Orphaned);
    assert!(store.orphan_active_on_start("again").unwrap().is_empty());
}

fn the_session_page_is_one_query_scoped_ordered_and_paged(db: &Db) {
    let store = db.open();
    let (ana, carl, bert) = (
        Scope::new("usr_ana", "alpha"),
        Scope::new("usr_carl", "alpha"),
        Scope::new("usr_bert", "beta"),
    );
    let anas: Vec<SessionId> = (0..5).map(|_| new_session(&*store, &ana)).collect();
    new_session(&*store, &bert);
    let placed = new("placed");
    store
        .create_session_placed(&carl, &placed, Some(("local", 4)))
        .unwrap();
    let first_run = store.create_run(&ana, &anas[0], "scripted/demo").unwrap();
    store
        .transition_run(&ana, &first_run.id, RunStatus::Cancelled, None)
        .unwrap();
    let newest_run = store.create_run(&ana, &anas[0], "scripted/demo").unwrap();
    store
        .pin_session_agent(&ana, &anas[1], "reviewer", "blake3:abc")
        .unwrap();

    let page = |sight: &Sight, limit, after: Option<&SessionId>| {
        store
            .session_page(sight, limit, after)
            .unwrap()
            .into_iter()
            .map(|row| row.session.id)
            .collect::<Vec<_>>()
    };
    let own = Sight::own(ana.clone());
    // Most recently active first, ties by id (bytewise).
    let mut rows: Vec<_> = anas
        .iter()
        .map(|id| store.session(&ana, id).unwrap())
        .collect();
    rows.sort_by(|a, b| (b.updated_at_ms, a.id.as_str()).cmp(&(a.updated_at_ms, b.id.as_str())));
    let expected: Vec<SessionId> = rows.into_iter().map(|r| r.id).collect();
    let first = page(&own, 2, None);
    assert_eq!(first, [expected[0].clone(), expected[1].clone()]);
    let second = page(&own, 2, first.last());
    assert_eq!(second, [expected[2].clone(), expected[3].clone()]);
    let third = page(&own, 2, second.last());
    assert_eq!(third, [expected[4].clone()]);
    assert!(page(&own, 2, third.last()).is_empty());

    let rows = store.session_page(&own, 10, None).unwrap();
    let with_runs = rows.iter().find(|r| r.session.id == anas[0]).unwrap();
    assert_eq!(
        with_runs.last_run.as_ref().map(|r| &r.id),
        Some(&newest_run.id),
        "each row carries its newest run"
    );
    assert!(with_runs.placement.is_none());
    let pinned = rows.iter().find(|r| r.session.id == anas[1]).unwrap();
    assert_eq!(
        pinned.agent,
        Some(("reviewer".to_owned(), "blake3:abc".to_owned())),
        "each row carries its agent pin"
    );
    assert!(
        rows.iter()
            .filter(|r| r.session.id != anas[1])
            .all(|r| r.agent.is_none())
    );
    assert!(
        rows.iter()
            .filter(|r| r.session.id != anas[0])
            .all(|r| r.last_run.is_none())
    );

    let wide = Sight::tenant(carl.clone());
    let rows = store.session_page(&wide, 10, None).unwrap();
    assert_eq!(
        rows.len(),
        6,
        "a tenant-wide sight sees the tenant's sessions"
    );
    let carls = rows.iter().find(|r| r.session.id == placed.id).unwrap();
    assert_eq!(carls.session.owner, carl);
    assert_eq!(
        carls.placement.as_ref().map(|p| p.profile.as_str()),
        Some("local"),
        "each row carries its placement"
    );
    assert!(carls.last_run.is_none());
    assert_eq!(page(&Sight::own(carl.clone()), 10, None), vec![placed.id]);
    assert_eq!(page(&Sight::tenant(bert.clone()), 10, None).len(), 1);
    assert!(
        matches!(
            store.session_page(&Sight::own(bert), 10, Some(&anas[0])),
            Err(Error::NotFound { .. })
        ),
        "paging after a session the sight does not see is refused"
    );
}

fn owner_of_finds_a_row_within_the_sight_only(db: &Db) {
    let store = db.open();
    let (ana, carl, bert) = (
        Scope::new("usr_ana", "alpha"),
        Scope::new("usr_carl", "alpha"),
        Scope::new("usr_bert", "beta"),
    );
    let anas = new_session(&*store, &ana);
    let id = anas.as_str();
    assert_eq!(
        store
            .owner_of(&Sight::own(ana.clone()), Owned::Session, id)
            .unwrap(),
        Some(ana.clone())
    );
    assert_eq!(
        store
            .owner_of(&Sight::own(carl.clone()), Owned::Session, id)
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .owner_of(&Sight::tenant(carl.clone()), Owned::Session, id)
            .unwrap(),
        Some(ana.clone())
    );
    assert_eq!(
        store
            .owner_of(&Sight::tenant(bert), Owned::Session, id)
            .unwrap(),
        None,
        "another tenant never does"
    );
    assert_eq!(
        store
            .owner_of(&Sight::tenant(carl), Owned::Group, id)
            .unwrap(),
        None,
        "an id is looked up among its own kind only"
    );
}

fn gauges_count_across_scopes_and_the_audit_listener_hears_each_row(db: &Db) {
    let store = db.open();
    store.ready().unwrap();
    let heard = Arc::new(Mutex::new(Vec::new()));
    let ear = heard.clone();
    assert!(store.on_audit(Box::new(move |id| ear.lock().unwrap().push(id))));
    assert!(!store.on_audit(Box::new(|_| {})), "set once");

    let (ana, bert) = (alice(), Scope::new("usr_bert", "ten_b"));
    let session = new_session(&*store, &ana);
    new_session(&*store, &bert);
    store
        .create_session_placed(&bert, &new("placed"), Some(("local", 4)))
        .unwrap();
    store.create_run(&ana, &session, "scripted/demo").unwrap();
    let gauges = store.gauges().unwrap();
    assert_eq!(
        gauges.sessions,
        [("local".to_owned(), 2), ("requested".to_owned(), 1)]
    );
    assert_eq!(gauges.runs, [("queued".to_owned(), 1)]);
    assert!(gauges.environments.is_empty());
    assert_eq!(gauges.egress.model_requests, 0);

    for target in ["one", "two"] {
        store
            .audit(
                &ana,
                "usr_alice",
                "session.create",
                target,
                "applied",
                &serde_json::json!({}),
            )
            .unwrap();
    }
    let ids: Vec<i64> = store.audit_last(10).unwrap().iter().map(|r| r.id).collect();
    assert_eq!(*heard.lock().unwrap(), ids, "told each row's id, in order");
    assert_eq!(ids.len(), 2);
}
