//! The live-work aggregates on both backends: placements and the worker slots they hold, the
//! worker protocol's rows, environments and snapshots. Races use two connections to one
//! database, as two gateways would.

use super::{Db, alice, new_session};
use skiff_protocol::api::RunStatus;
use skiff_protocol::environment::{
    EgressAccounting, EnvironmentState, PlacementState as P, SnapshotState,
};
use skiff_protocol::worker::StreamKind;
use skiff_protocol::{EnvironmentId, SessionId, SnapshotId};
use skiff_store::{Backend, CachedOp, Error, NewSnapshot, PlacementChange, Scope, Sight};
use std::sync::Barrier;

on_both_backends!(
    a_placement_moves_by_the_state_machine_and_the_session_mirrors_it,
    racing_slot_claims_never_exceed_the_cap,
    racing_claims_of_one_session_have_one_winner,
    a_session_with_a_turn_open_is_neither_parked_nor_pulled_back,
    a_failover_keeps_its_slot_and_a_live_dispatch_needs_its_run_open,
    worker_ops_keep_the_first_reply_and_cursors_never_go_back,
    racing_admissions_of_one_worker_credential_admit_it_once,
    environments_move_by_the_state_machine_and_keep_their_lease_and_egress,
    snapshots_are_found_used_evicted_and_deleted,
    another_tenants_live_rows_are_not_found,
);

fn env_id(name: &str) -> EnvironmentId {
    EnvironmentId::from_suffix(name)
}

fn step(store: &dyn Backend, s: &SessionId, to: P) -> skiff_store::PlacementRow {
    store
        .transition_placement(&alice(), s, to, &PlacementChange::default())
        .unwrap_or_else(|e| panic!("→ {to}: {e}"))
}

/// A session placed and active on `env` with its box in step.
fn active_on(store: &dyn Backend, s: &SessionId, env: &EnvironmentId) {
    store.request_placement(&alice(), s, "cloud", 100).unwrap();
    store
        .transition_placement(
            &alice(),
            s,
            P::Provisioning,
            &PlacementChange {
                environment_id: Some(env),
                ..PlacementChange::default()
            },
        )
        .unwrap();
    step(store, s, P::Syncing);
    step(store, s, P::Starting);
    store
        .transition_placement(
            &alice(),
            s,
            P::Active,
            &PlacementChange {
                advance_epoch: true,
                box_in_step: Some(true),
                ..PlacementChange::default()
            },
        )
        .unwrap();
}

fn a_placement_moves_by_the_state_machine_and_the_session_mirrors_it(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    assert_eq!(store.placement(&alice(), &s).unwrap(), None);
    let not_placed = store
        .transition_placement(&alice(), &s, P::Provisioning, &PlacementChange::default())
        .unwrap_err();
    assert!(
        matches!(
            not_placed,
            Error::NotFound {
                what: "placement",
                ..
            }
        ),
        "{not_placed:?}"
    );

    let requested = store.request_placement(&alice(), &s, "cloud", 4).unwrap();
    assert_eq!(
        (requested.state, requested.profile.as_str()),
        (P::Requested, "cloud")
    );
    assert_eq!(requested.scope, alice());
    assert_eq!(store.session(&alice(), &s).unwrap().placement, "requested");
    let skipped = store
        .transition_placement(&alice(), &s, P::Active, &PlacementChange::default())
        .unwrap_err();
    assert!(
        matches!(
            skipped,
            Error::IllegalPlacementTransition {
                from: P::Requested,
                to: P::Active,
                ..
            }
        ),
        "{skipped:?}"
    );

    let env = env_id("box1");
    let provisioning = store
        .transition_placement(
            &alice(),
            &s,
            P::Provisioning,
            &PlacementChange {
                environment_id: Some(&env),
                bundle_hash: Some("b1"),
                worker_pid: Some(42),
                error: Some("slow provider"),
                ..PlacementChange::default()
            },
        )
        .unwrap();
    assert_eq!(provisioning.generation, requested.generation + 1);
    assert_eq!(provisioning.environment_id.as_ref(), Some(&env));
    assert_eq!(provisioning.bundle_hash.as_deref(), Some("b1"));
    assert_eq!(provisioning.worker_pid, Some(42));
    assert_eq!(provisioning.error.as_deref(), Some("slow provider"));
    assert_eq!(
        store.sessions_on_environment(&env).unwrap(),
        std::slice::from_ref(&s)
    );

    // What a change leaves out is kept; the error is replaced (here: cleared).
    let syncing = store
        .transition_placement(
            &alice(),
            &s,
            P::Syncing,
            &PlacementChange {
                base_manifest: Some("{\"files\":1}"),
                left_out: Some("target/"),
                ..PlacementChange::default()
            },
        )
        .unwrap();
    assert_eq!(syncing.environment_id.as_ref(), Some(&env));
    assert_eq!(syncing.error, None);
    assert_eq!(syncing.base_manifest.as_deref(), Some("{\"files\":1}"));
    assert_eq!(syncing.left_out.as_deref(), Some("target/"));
    step(&*store, &s, P::Starting);
    let active = store
        .transition_placement(
            &alice(),
            &s,
            P::Active,
            &PlacementChange {
                advance_epoch: true,
                box_in_step: Some(true),
                ..PlacementChange::default()
            },
        )
        .unwrap();
    assert_eq!(active.owner_epoch, requested.owner_epoch + 1);
    assert!(active.box_in_step);
    assert_eq!(store.session(&alice(), &s).unwrap().placement, "active");
    assert_eq!(
        store
            .live_placements()
            .unwrap()
            .iter()
            .map(|p| &p.session_id)
            .collect::<Vec<_>>(),
        [&s]
    );

    store.mark_box_ahead(&alice(), &s).unwrap();
    assert!(!store.placement(&alice(), &s).unwrap().unwrap().box_in_step);
    store
        .set_placement_base_manifest(&alice(), &s, "{\"files\":2}")
        .unwrap();
    let row = store.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(
        (row.base_manifest.as_deref(), row.box_in_step),
        (Some("{\"files\":2}"), false)
    );
    store
        .mark_box_in_step(&alice(), &s, "{\"files\":3}")
        .unwrap();
    let row = store.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(
        (row.base_manifest.as_deref(), row.box_in_step, row.state),
        (Some("{\"files\":3}"), true, P::Active),
        "marking the box in step does not move the placement"
    );

    // Home, from a box only through a drain.
    assert!(matches!(
        store.come_home(&alice(), &s).unwrap_err(),
        Error::IllegalPlacementTransition {
            from: P::Active,
            to: P::Local,
            ..
        }
    ));
    store.claim_pull_back(&alice(), &s).unwrap();
    // The row as it was comes back (its box, for the caller to give back); the placement
    // forgets the box and a new epoch fences the old worker.
    let before = store.come_home(&alice(), &s).unwrap();
    assert_eq!(
        (before.state, before.environment_id.as_ref()),
        (P::Draining, Some(&env))
    );
    let home = store.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(home.state, P::Local);
    assert_eq!(home.environment_id, None);
    assert_eq!(home.owner_epoch, active.owner_epoch + 1);
    assert_eq!(store.session(&alice(), &s).unwrap().placement, "local");
    assert!(store.live_placements().unwrap().is_empty());
    assert!(store.sessions_on_environment(&env).unwrap().is_empty());
    let again = store.come_home(&alice(), &s).unwrap_err();
    assert!(
        matches!(
            again,
            Error::IllegalPlacementTransition {
                from: P::Local,
                to: P::Local,
                ..
            }
        ),
        "{again:?}"
    );
}

/// Claims race from two connections for more slots than there are: the cap holds.
fn racing_slot_claims_never_exceed_the_cap(db: &Db) {
    const MAX: u64 = 3;
    const EACH: usize = 4;
    let (a, b) = (db.open(), db.open());
    let sessions: Vec<SessionId> = (0..2 * EACH).map(|_| new_session(&*a, &alice())).collect();
    let start = Barrier::new(2);
    let outcomes: Vec<_> = std::thread::scope(|threads| {
        let racers: Vec<_> = [(&a, &sessions[..EACH]), (&b, &sessions[EACH..])]
            .into_iter()
            .map(|(store, mine)| {
                let start = &start;
                threads.spawn(move || {
                    start.wait();
                    mine.iter()
                        .map(|s| store.request_placement(&alice(), s, "cloud", MAX))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        racers.into_iter().flat_map(|r| r.join().unwrap()).collect()
    });
    let placed = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(
        placed as u64, MAX,
        "exactly the cap is placed: {outcomes:?}"
    );
    for refused in outcomes.iter().filter_map(|o| o.as_ref().err()) {
        assert!(
            matches!(refused, Error::WorkersAtCapacity { max: MAX, .. }),
            "{refused:?}"
        );
    }
    let slots = b.worker_slots().unwrap();
    assert_eq!((slots.live, slots.running_turns), (MAX, 0));
    // A refused session was left as it was.
    let refused: Vec<&SessionId> = sessions
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| o.is_err())
        .map(|(s, _)| s)
        .collect();
    for s in refused {
        assert_eq!(a.placement(&alice(), s).unwrap(), None);
        assert_eq!(a.session(&alice(), s).unwrap().placement, "local");
    }
}

fn racing_claims_of_one_session_have_one_winner(db: &Db) {
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
                    store.request_placement(&alice(), s, "cloud", 10)
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(
        outcomes.iter().filter(|o| o.is_ok()).count(),
        1,
        "one claim wins: {outcomes:?}"
    );
    assert!(outcomes.iter().any(|o| matches!(
        o,
        Err(Error::IllegalPlacementTransition {
            from: P::Requested,
            to: P::Requested,
            ..
        })
    )));
    assert_eq!(a.worker_slots().unwrap().live, 1);

    // Two connections moving it on from the same state: one move, checked against the
    // state the other left.
    let start = Barrier::new(2);
    let moves: Vec<_> = std::thread::scope(|threads| {
        let racers: Vec<_> = [&a, &b]
            .into_iter()
            .map(|store| {
                let (s, start) = (&s, &start);
                threads.spawn(move || {
                    start.wait();
                    store.transition_placement(
                        &alice(),
                        s,
                        P::Provisioning,
                        &PlacementChange::default(),
                    )
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(
        moves.iter().filter(|o| o.is_ok()).count(),
        1,
        "one move wins: {moves:?}"
    );
    let row = a.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(row.state, P::Provisioning);
}

fn a_session_with_a_turn_open_is_neither_parked_nor_pulled_back(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let env = env_id("box2");
    active_on(&*a, &s, &env);
    let run = b.create_run(&alice(), &s, "scripted/demo").unwrap();
    assert_eq!(a.worker_slots().unwrap().running_turns, 1);
    assert_eq!(a.park_placement(&alice(), &s).unwrap(), None);
    assert!(a.idle_placements().unwrap().is_empty());
    match a.claim_pull_back(&alice(), &s).unwrap_err() {
        Error::SessionBusy { run: open, .. } => assert_eq!(open, run.id.as_str()),
        other => panic!("expected the session to be busy, got {other:?}"),
    }
    assert_eq!(a.placement(&alice(), &s).unwrap().unwrap().state, P::Active);

    b.transition_run(&alice(), &run.id, RunStatus::Cancelled, None)
        .unwrap();
    // A box ahead of the gateway is never given back.
    a.mark_box_ahead(&alice(), &s).unwrap();
    assert_eq!(a.park_placement(&alice(), &s).unwrap(), None);
    a.mark_box_in_step(&alice(), &s, "{}").unwrap();
    let idle = b.idle_placements().unwrap();
    assert_eq!(idle.len(), 1);
    assert_eq!((&idle[0].session_id, &idle[0].scope), (&s, &alice()));
    let epoch = a.placement(&alice(), &s).unwrap().unwrap().owner_epoch;
    let parked = b.park_placement(&alice(), &s).unwrap().expect("parkable");
    assert_eq!(parked.environment_id.as_ref(), Some(&env));
    let row = a.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!(
        (row.state, row.owner_epoch, row.environment_id),
        (P::Parked, epoch + 1, None)
    );
    assert_eq!(
        a.worker_slots().unwrap().live,
        0,
        "a parked session holds no slot"
    );
    // Parked twice: nothing to do.
    assert_eq!(a.park_placement(&alice(), &s).unwrap(), None);

    // Pull-back of another active session: claimed once, as it was.
    let t = new_session(&*a, &alice());
    active_on(&*a, &t, &env_id("box3"));
    let before = a.claim_pull_back(&alice(), &t).unwrap();
    assert_eq!(before.state, P::Active);
    assert_eq!(
        b.placement(&alice(), &t).unwrap().unwrap().state,
        P::Draining
    );
    assert!(matches!(
        b.claim_pull_back(&alice(), &t).unwrap_err(),
        Error::IllegalPlacementTransition {
            from: P::Draining,
            to: P::Draining,
            ..
        }
    ));
}

fn a_failover_keeps_its_slot_and_a_live_dispatch_needs_its_run_open(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    active_on(&*store, &s, &env_id("dead"));
    step(&*store, &s, P::Reclaimed);
    assert_eq!(store.worker_slots().unwrap().live, 0);
    let failed_over = store
        .begin_failover(&alice(), &s, "the box stopped answering")
        .unwrap();
    assert_eq!(failed_over.state, P::FailedOver);
    assert_eq!(failed_over.environment_id, None);
    assert_eq!(
        failed_over.error.as_deref(),
        Some("the box stopped answering")
    );
    assert_eq!(store.worker_slots().unwrap().live, 1);
    // At the cap, the failover's new placement still goes ahead: it holds its slot.
    let replaced = store.request_placement(&alice(), &s, "cloud", 1).unwrap();
    assert_eq!(replaced.state, P::Requested);
    // Another session is refused at that cap.
    let other = new_session(&*store, &alice());
    assert!(matches!(
        store
            .request_placement(&alice(), &other, "cloud", 1)
            .unwrap_err(),
        Error::WorkersAtCapacity {
            max: 1,
            other: 1,
            running_turns: 0
        }
    ));

    // A live dispatch: only while its run is open.
    let run = store.create_run(&alice(), &other, "scripted/demo").unwrap();
    let handing = store
        .claim_live_dispatch(&alice(), &other, &run.id, "cloud", 5)
        .unwrap();
    assert_eq!(handing.state, P::HandingOff);
    let slots = store.worker_slots().unwrap();
    assert_eq!((slots.live, slots.running_turns), (2, 1));
    let third = new_session(&*store, &alice());
    let ended = store.create_run(&alice(), &third, "scripted/demo").unwrap();
    store
        .transition_run(&alice(), &ended.id, RunStatus::Cancelled, None)
        .unwrap();
    assert!(matches!(
        store
            .claim_live_dispatch(&alice(), &third, &ended.id, "cloud", 5)
            .unwrap_err(),
        Error::RunEnded { .. }
    ));
    assert_eq!(store.placement(&alice(), &third).unwrap(), None);
}

fn worker_ops_keep_the_first_reply_and_cursors_never_go_back(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let op = |reply: &str| CachedOp {
        method: "tool.call".into(),
        call_hash: "h1".into(),
        reply: reply.into(),
    };
    assert_eq!(a.worker_op(&s, 1, StreamKind::Tool, 7).unwrap(), None);
    a.record_worker_op(&s, 1, StreamKind::Tool, 7, &op("first"))
        .unwrap();
    b.record_worker_op(&s, 1, StreamKind::Tool, 7, &op("second"))
        .unwrap();
    assert_eq!(
        b.worker_op(&s, 1, StreamKind::Tool, 7).unwrap(),
        Some(op("first"))
    );
    // Another epoch or stream is another operation.
    assert_eq!(a.worker_op(&s, 2, StreamKind::Tool, 7).unwrap(), None);
    assert_eq!(a.worker_op(&s, 1, StreamKind::Model, 7).unwrap(), None);

    a.advance_worker_cursor(&s, 1, StreamKind::Transcript, 5)
        .unwrap();
    b.advance_worker_cursor(&s, 1, StreamKind::Transcript, 3)
        .unwrap();
    a.advance_worker_cursor(&s, 1, StreamKind::Events, 9)
        .unwrap();
    a.advance_worker_cursor(&s, 2, StreamKind::Events, 1)
        .unwrap();
    let cursors = b.worker_cursors(&s, 1).unwrap();
    assert_eq!(
        cursors.into_iter().collect::<Vec<_>>(),
        [(StreamKind::Transcript, 5), (StreamKind::Events, 9)]
    );
    assert_eq!(
        a.worker_cursors(&s, 2)
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
        [(StreamKind::Events, 1)]
    );
    assert!(a.worker_cursors(&s, 3).unwrap().is_empty());
}

fn racing_admissions_of_one_worker_credential_admit_it_once(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let env = env_id("box4");
    for round in 0..5 {
        let credential = format!("wcr_{round}");
        let start = Barrier::new(2);
        let admitted: Vec<bool> = std::thread::scope(|threads| {
            let racers: Vec<_> = [&a, &b]
                .into_iter()
                .map(|store| {
                    let (s, env, start, credential) = (&s, &env, &start, &credential);
                    threads.spawn(move || {
                        start.wait();
                        store.use_worker_credential(credential, s, env).unwrap()
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert_eq!(
            admitted.iter().filter(|x| **x).count(),
            1,
            "round {round}: {admitted:?}"
        );
        assert!(!a.use_worker_credential(&credential, &s, &env).unwrap());
    }
}

fn environments_move_by_the_state_machine_and_keep_their_lease_and_egress(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let carol = Scope::new("usr_carol", "ten_a");
    let e1 = env_id("env1");
    let snap = SnapshotId::from_random([9, 0, 0, 0, 0, 0, 0, 9]);
    let created = a
        .create_environment_from(&alice(), &e1, "cloud", "fake", "op_1", Some(&snap))
        .unwrap();
    assert_eq!(created.state, EnvironmentState::Requested);
    assert_eq!(created.snapshot_id.as_ref(), Some(&snap));
    assert_eq!(created.scope, alice());
    assert_eq!(created.accounting, EgressAccounting::default());
    let e2 = env_id("env2");
    b.create_environment(&carol, &e2, "cloud", "fake", "op_2")
        .unwrap();
    // The operation id is written once: a second intent with it is refused.
    assert!(
        a.create_environment(&alice(), &env_id("env3"), "cloud", "fake", "op_1")
            .is_err()
    );
    assert!(matches!(
        a.environment(&alice(), &env_id("env3")).unwrap_err(),
        Error::NotFound {
            what: "environment",
            ..
        }
    ));

    let refused = b
        .transition_environment(&alice(), &e1, EnvironmentState::Attached, None)
        .unwrap_err();
    assert!(
        matches!(
            refused,
            Error::IllegalEnvironmentTransition {
                from: EnvironmentState::Requested,
                to: EnvironmentState::Attached,
                ..
            }
        ),
        "{refused:?}"
    );
    let provisioning = b
        .transition_environment(
            &alice(),
            &e1,
            EnvironmentState::Provisioning,
            Some("queued at the provider"),
        )
        .unwrap();
    assert_eq!(
        provisioning.error.as_deref(),
        Some("queued at the provider")
    );
    a.set_environment_lease(&alice(), &e1, "lbx_1", "{\"host\":\"h\"}", Some(1_000))
        .unwrap();
    a.set_environment_bundle(&alice(), &e1, "bundle1").unwrap();
    a.set_environment_prepared(&alice(), &e1, Some("key1"))
        .unwrap();
    a.set_environment_expiry(&alice(), &e1, 2_000).unwrap();
    let before_touch = a.environment(&alice(), &e1).unwrap().last_used_at_ms;
    a.touch_environment(&alice(), &e1).unwrap();
    let add = EgressAccounting {
        model_requests: 1,
        input_tokens: 10,
        output_tokens: 20,
        bytes_in: 300,
        bytes_out: 400,
        gateway_tool_calls: 2,
    };
    a.add_environment_egress(&e1, add).unwrap();
    b.add_environment_egress(&e1, add).unwrap();
    let row = b.environment(&alice(), &e1).unwrap();
    assert_eq!(row.lease_id.as_deref(), Some("lbx_1"));
    assert_eq!(row.lease.as_deref(), Some("{\"host\":\"h\"}"));
    assert_eq!(row.expires_at_ms, Some(2_000));
    assert_eq!(row.bundle_hash.as_deref(), Some("bundle1"));
    assert_eq!(row.prepared_key.as_deref(), Some("key1"));
    assert!(row.last_used_at_ms >= before_touch);
    assert_eq!(
        row.accounting,
        EgressAccounting {
            model_requests: 2,
            input_tokens: 20,
            output_tokens: 40,
            bytes_in: 600,
            bytes_out: 800,
            gateway_tool_calls: 4,
        }
    );
    assert_eq!(a.environment_owner(&e1).unwrap(), Some(alice()));
    assert_eq!(a.environment_owner(&env_id("nowhere")).unwrap(), None);

    // A member sees their own; a tenant-wide sight sees the tenant's.
    let listed = |sight: Sight| -> Vec<EnvironmentId> {
        a.environments(&sight)
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect()
    };
    assert_eq!(listed(Sight::own(alice())), std::slice::from_ref(&e1));
    let mut wide = listed(Sight::tenant(alice()));
    wide.sort_by(|x, y| x.as_str().cmp(y.as_str()));
    assert_eq!(wide, [e1.clone(), e2.clone()]);
    assert!(listed(Sight::tenant(Scope::new("usr_alice", "ten_b"))).is_empty());

    for to in [EnvironmentState::Destroying, EnvironmentState::Destroyed] {
        b.transition_environment(&carol, &e2, to, None).unwrap();
    }
    let live: Vec<EnvironmentId> = a
        .live_environments()
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        live,
        std::slice::from_ref(&e1),
        "a destroyed box is not live"
    );
    assert!(matches!(
        a.transition_environment(&carol, &e2, EnvironmentState::Destroying, None)
            .unwrap_err(),
        Error::IllegalEnvironmentTransition { .. }
    ));
}

fn snapshots_are_found_used_evicted_and_deleted(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let env = env_id("snapbox");
    let record = |store: &dyn Backend, n: u8, key: &str| {
        let id = SnapshotId::from_random([n, 1, 2, 3, 4, 5, 6, n]);
        let row = store
            .record_snapshot(
                &alice(),
                &NewSnapshot {
                    id: &id,
                    profile: "cloud",
                    key,
                    environment_id: &env,
                    lease_id: "lbx_1",
                },
            )
            .unwrap();
        assert_eq!(row.state, SnapshotState::Capturing);
        id
    };
    let s1 = record(&*a, 1, "k1");
    let s2 = record(&*b, 2, "k2");
    let s3 = record(&*a, 3, "k3");
    assert_eq!(a.unsettled_snapshots().unwrap().len(), 3);
    assert_eq!(
        a.find_ready_snapshot(&alice(), "cloud", "k1").unwrap(),
        None
    );
    for (store, id, size) in [(&a, &s1, 100), (&b, &s2, 100), (&a, &s3, 100)] {
        let ready = store.snapshot_captured(&alice(), id, size).unwrap();
        assert_eq!(
            (ready.state, ready.size_bytes),
            (SnapshotState::Ready, size)
        );
    }
    assert!(a.unsettled_snapshots().unwrap().is_empty());
    // Uses from either connection are ordered: the least recently used goes first.
    let found = b
        .find_ready_snapshot(&alice(), "cloud", "k1")
        .unwrap()
        .expect("ready");
    assert_eq!(found.id, s1);
    let touched = a.touch_snapshot(&alice(), &s2).unwrap();
    assert!(touched.last_used_at_ms > found.last_used_at_ms);
    let plan: Vec<SnapshotId> = b
        .evict_plan("cloud", 200)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(plan, std::slice::from_ref(&s3));
    let listed: Vec<SnapshotId> = a
        .snapshots(&Sight::own(alice()))
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(listed, [s2.clone(), s1.clone(), s3.clone()]);

    // The way out: only a deleting row goes, and a deleting one is never used again.
    assert!(matches!(
        a.delete_snapshot_row(&alice(), &s3).unwrap_err(),
        Error::IllegalSnapshotTransition { .. }
    ));
    let deleting = b.mark_snapshot_deleting(&alice(), &s3).unwrap();
    assert_eq!(deleting.state, SnapshotState::Deleting);
    assert!(matches!(
        a.touch_snapshot(&alice(), &s3).unwrap_err(),
        Error::IllegalSnapshotTransition {
            from: SnapshotState::Deleting,
            ..
        }
    ));
    assert_eq!(a.unsettled_snapshots().unwrap().len(), 1);
    assert!(a.snapshot_known(&s3).unwrap());
    a.delete_snapshot_row(&alice(), &s3).unwrap();
    assert!(!b.snapshot_known(&s3).unwrap());
    assert!(matches!(
        b.snapshot(&alice(), &s3).unwrap_err(),
        Error::NotFound {
            what: "snapshot",
            ..
        }
    ));
}

fn another_tenants_live_rows_are_not_found(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    let env = env_id("mine");
    store
        .create_environment(&alice(), &env, "cloud", "fake", "op_mine")
        .unwrap();
    active_on(&*store, &s, &env);
    let snap = SnapshotId::from_random([7; 8]);
    store
        .record_snapshot(
            &alice(),
            &NewSnapshot {
                id: &snap,
                profile: "cloud",
                key: "k",
                environment_id: &env,
                lease_id: "lbx_1",
            },
        )
        .unwrap();
    store.snapshot_captured(&alice(), &snap, 10).unwrap();
    let not_found = |e: Error, what: &str| match e {
        Error::NotFound { what: w, .. } => assert_eq!(w, what),
        other => panic!("expected {what} not found, got {other:?}"),
    };
    for stranger in [
        Scope::new("usr_mallory", "ten_b"),
        Scope::new("usr_alice", "ten_b"),
    ] {
        assert_eq!(store.placement(&stranger, &s).unwrap(), None);
        not_found(
            store
                .transition_placement(&stranger, &s, P::Reclaimed, &PlacementChange::default())
                .unwrap_err(),
            "placement",
        );
        not_found(
            store
                .request_placement(&stranger, &s, "cloud", 10)
                .unwrap_err(),
            "session",
        );
        not_found(store.come_home(&stranger, &s).unwrap_err(), "placement");
        not_found(
            store.claim_pull_back(&stranger, &s).unwrap_err(),
            "placement",
        );
        assert_eq!(store.park_placement(&stranger, &s).unwrap(), None);
        not_found(
            store.mark_box_in_step(&stranger, &s, "{}").unwrap_err(),
            "placement",
        );
        not_found(
            store.environment(&stranger, &env).unwrap_err(),
            "environment",
        );
        not_found(
            store
                .transition_environment(&stranger, &env, EnvironmentState::Failed, None)
                .unwrap_err(),
            "environment",
        );
        store
            .set_environment_bundle(&stranger, &env, "theirs")
            .unwrap();
        store.mark_box_ahead(&stranger, &s).unwrap();
        assert!(
            store
                .environments(&Sight::tenant(stranger.clone()))
                .unwrap()
                .is_empty()
        );
        not_found(store.snapshot(&stranger, &snap).unwrap_err(), "snapshot");
        not_found(
            store.touch_snapshot(&stranger, &snap).unwrap_err(),
            "snapshot",
        );
        not_found(
            store.mark_snapshot_deleting(&stranger, &snap).unwrap_err(),
            "snapshot",
        );
        assert_eq!(
            store.find_ready_snapshot(&stranger, "cloud", "k").unwrap(),
            None
        );
        assert!(
            store
                .snapshots(&Sight::tenant(stranger.clone()))
                .unwrap()
                .is_empty()
        );
    }
    // Nothing the strangers tried changed Alice's rows.
    let row = store.placement(&alice(), &s).unwrap().unwrap();
    assert_eq!((row.state, row.box_in_step), (P::Active, true));
    assert_eq!(store.environment(&alice(), &env).unwrap().bundle_hash, None);
    assert_eq!(
        store.snapshot(&alice(), &snap).unwrap().state,
        SnapshotState::Ready
    );
}
