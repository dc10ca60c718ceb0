//! The conformance suite for the people and governance aggregates (`aggregates::people`):
//! every test runs on SQLite and on PostgreSQL, through the traits only.

use super::conformance::{Db, alice, new_session};
use skiff_protocol::approval::{ApprovalKind, ApprovalState};
use skiff_protocol::model::Usage;
use skiff_protocol::people::{Role, TokenScope};
use skiff_protocol::{ApprovalId, GrantId, RunId, SessionId};
use skiff_store::{
    Consumed, DAY_MS, Error, FIRST_ADMIN, NewApproval, NewGrant, Resealed, Scope, Sight,
};
use std::sync::Barrier;

super::conformance::on_both_backends!(
    an_email_is_one_persons_whatever_its_case,
    racing_adds_of_one_email_add_one_user,
    tokens_are_revoked_within_their_tenant_and_go_with_their_user,
    a_token_is_found_by_its_hash_from_any_connection_until_revoked,
    racing_first_starts_store_one_admin_token,
    a_revoked_ui_cookie_stays_revoked_until_it_expires,
    audit_rows_keep_their_order_and_leave_a_day_at_a_time,
    audit_ids_from_two_connections_are_gapless_and_visible_in_order,
    an_approval_is_settled_once_and_seen_only_within_its_sight,
    a_starting_gateway_spares_the_approvals_of_a_session_another_gateway_holds,
    racing_redemptions_consume_each_grant_once,
    a_replaced_secret_keeps_its_creation_date_and_a_failed_reseal_changes_nothing,
    a_rotation_racing_another_write_reseals_nothing_and_keeps_that_write,
    agent_specs_pin_sessions_and_chat_replays_are_refused,
    usage_is_summed_per_session_user_and_tenant,
);

fn an_email_is_one_persons_whatever_its_case(db: &Db) {
    let store = db.open();
    let first = store.users(None).unwrap();
    assert_eq!(first.len(), 1, "the first admin is there from the start");
    assert_eq!(first[0].id, FIRST_ADMIN);
    assert_eq!(first[0].role, Role::Admin);

    let bob = store.add_user("Bob@X.org", Role::Member, "ten_b").unwrap();
    assert!(bob.id.starts_with("usr_"));
    assert_eq!(bob.email, "Bob@X.org", "stored as given");
    match store.add_user("bob@x.ORG", Role::Viewer, "ten_default") {
        Err(e @ Error::UserExists { .. }) => assert_eq!(
            e.to_string(),
            "user bob@x.ORG already exists as Bob@X.org (emails are compared without case); remove them first or pick another email"
        ),
        other => panic!("a second Bob was added: {other:?}"),
    }
    assert_eq!(store.user_by_email("BOB@x.org", None).unwrap(), bob);
    assert_eq!(
        store.user_by_email("bob@x.org", Some("ten_b")).unwrap(),
        bob
    );
    assert!(matches!(
        store.user_by_email("bob@x.org", Some("ten_default")),
        Err(Error::NotFound { what: "user", .. })
    ));
    // Only ASCII letters fold, on both backends alike: these are two people.
    let u = store.add_user("ü@x", Role::Member, "ten_b").unwrap();
    let upper = store.add_user("Ü@x", Role::Member, "ten_b").unwrap();
    assert_ne!(u.id, upper.id);

    assert_eq!(
        store
            .users(Some("ten_b"))
            .unwrap()
            .iter()
            .map(|u| u.email.as_str())
            .collect::<Vec<_>>()
            .len(),
        3
    );
    assert_eq!(store.users(Some("ten_default")).unwrap(), first);
    assert_eq!(store.user_of(&bob.scope()).unwrap(), Some(bob.clone()));
    assert_eq!(
        store
            .user_of(&Scope::new(bob.id.clone(), "ten_default"))
            .unwrap(),
        None,
        "a user is theirs in their own tenant only"
    );
}

fn racing_adds_of_one_email_add_one_user(db: &Db) {
    let (a, b) = (db.open(), db.open());
    for round in 0..10 {
        let start = Barrier::new(2);
        let outcomes: Vec<_> = std::thread::scope(|threads| {
            let racers: Vec<_> = [(&a, "Ana"), (&b, "ANA")]
                .into_iter()
                .map(|(store, spelling)| {
                    let start = &start;
                    threads.spawn(move || {
                        start.wait();
                        store.add_user(&format!("{spelling}{round}@x"), Role::Member, "ten_a")
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let added: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().ok()).collect();
        assert_eq!(added.len(), 1, "one of the two is added: {outcomes:?}");
        assert!(
            outcomes.iter().any(|o| matches!(
                o,
                Err(Error::UserExists { existing, .. }) if *existing == added[0].email
            )),
            "the other is told who has the email: {outcomes:?}"
        );
    }
    assert_eq!(a.users(Some("ten_a")).unwrap().len(), 10);
}

fn tokens_are_revoked_within_their_tenant_and_go_with_their_user(db: &Db) {
    let store = db.open();
    let bob = store.add_user("bob@x", Role::Member, "ten_b").unwrap();
    let read = store
        .add_token(&bob.scope(), "hash-r", "laptop", TokenScope::Read, Some(5))
        .unwrap();
    let write = store
        .add_token(&bob.scope(), "hash-w", "ci", TokenScope::Write, None)
        .unwrap();
    assert!(read.id.starts_with("tok_"));
    let rows = store.token_rows().unwrap();
    assert!(rows.contains(&read) && rows.contains(&write), "{rows:?}");
    assert!(
        rows.iter().all(|t| t.hash != "the plaintext"),
        "only hashes are kept"
    );

    // Another tenant's admin cannot revoke it; the gateway's first admin (no tenant) can.
    assert!(matches!(
        store.revoke_token(&read.id, Some("ten_default")),
        Err(Error::NotFound { what: "token", .. })
    ));
    assert_eq!(store.revoke_token(&read.id, None).unwrap(), read);
    assert!(store.revoke_token(&read.id, None).is_err(), "once");

    // The gateway's own token is replaced, not added to.
    let admin = Scope::new(FIRST_ADMIN, "ten_default");
    store.replace_token("gateway", "hash-1", &admin).unwrap();
    store.replace_token("gateway", "hash-2", &admin).unwrap();
    let gateway: Vec<_> = store
        .token_rows()
        .unwrap()
        .into_iter()
        .filter(|t| t.label == "gateway")
        .collect();
    assert_eq!(gateway.len(), 1);
    assert_eq!(gateway[0].hash, "hash-2");
    assert_eq!(gateway[0].id, "tok_gateway");
    assert_eq!(gateway[0].cap, TokenScope::Admin);

    assert_eq!(store.remove_user(&bob).unwrap(), vec![write.id]);
    assert_eq!(store.user_of(&bob.scope()).unwrap(), None);
    assert!(
        store
            .token_rows()
            .unwrap()
            .iter()
            .all(|t| t.scope != bob.scope())
    );
}

fn a_token_is_found_by_its_hash_from_any_connection_until_revoked(db: &Db) {
    // Two connections stand for two gateways: what one writes, the other's next lookup sees.
    let (one, two) = (db.open(), db.open());
    let bob = one.add_user("bob@x", Role::Member, "ten_b").unwrap();
    assert_eq!(two.token_by_hash("hash-b").unwrap(), None);
    let row = one
        .add_token(&bob.scope(), "hash-b", "laptop", TokenScope::Write, Some(9))
        .unwrap();
    assert_eq!(two.token_by_hash("hash-b").unwrap(), Some(row.clone()));
    assert_eq!(two.token_by_hash("hash-other").unwrap(), None);
    one.revoke_token(&row.id, None).unwrap();
    assert_eq!(two.token_by_hash("hash-b").unwrap(), None, "revoked");
    let again = one
        .add_token(&bob.scope(), "hash-c", "ci", TokenScope::Read, None)
        .unwrap();
    one.remove_user(&bob).unwrap();
    assert_eq!(
        two.token_by_hash(&again.hash).unwrap(),
        None,
        "user removed"
    );
}

fn racing_first_starts_store_one_admin_token(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let admin = Scope::new(FIRST_ADMIN, "ten_default");
    for round in 0..10 {
        let label = format!("admin{round}");
        let start = Barrier::new(2);
        let won: Vec<bool> = std::thread::scope(|threads| {
            let racers: Vec<_> = [(&a, "hash-a"), (&b, "hash-b")]
                .into_iter()
                .map(|(store, hash)| {
                    let (start, label, admin) = (&start, &label, &admin);
                    threads.spawn(move || {
                        start.wait();
                        store
                            .add_token_if_absent(label, &format!("{hash}{round}"), admin)
                            .unwrap()
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
        let stored: Vec<_> = a
            .token_rows()
            .unwrap()
            .into_iter()
            .filter(|t| t.label == label)
            .collect();
        assert_eq!(stored.len(), 1, "{stored:?}");
        let winner = if won[0] { "hash-a" } else { "hash-b" };
        assert_eq!(stored[0].hash, format!("{winner}{round}"), "the winner's");
        assert_eq!(stored[0].id, format!("tok_{label}"));
    }
}

fn a_revoked_ui_cookie_stays_revoked_until_it_expires(db: &Db) {
    let store = db.open();
    let scope = alice();
    store.revoke_ui_cookie(&scope, "h1", 100, 10).unwrap();
    assert!(store.ui_cookie_revoked(&scope, "h1").unwrap());
    assert!(!store.ui_cookie_revoked(&scope, "h2").unwrap());
    assert!(
        !store
            .ui_cookie_revoked(&Scope::new("usr_mallory", "ten_a"), "h1")
            .unwrap(),
        "another scope's revocation is not ours"
    );
    // Revoking again (a second logout of the same cookie) is no error.
    store.revoke_ui_cookie(&scope, "h1", 100, 20).unwrap();
    // At 200, h1 (expired at 100) is pruned: its signature check refuses it anyway.
    store.revoke_ui_cookie(&scope, "h2", 300, 200).unwrap();
    assert!(!store.ui_cookie_revoked(&scope, "h1").unwrap());
    assert!(store.ui_cookie_revoked(&scope, "h2").unwrap());
}

fn audit_rows_keep_their_order_and_leave_a_day_at_a_time(db: &Db) {
    let store = db.open();
    let scope = alice();
    let day = 20_000;
    for (at, action) in [
        (day * DAY_MS + 5, "first"),
        (day * DAY_MS + 6, "second"),
        ((day + 1) * DAY_MS, "next day"),
    ] {
        store.audit_at(at, &scope, action, "ses_x").unwrap();
    }
    store
        .audit(
            &scope,
            "api",
            "session.create",
            "ses_y",
            "applied",
            &serde_json::json!({"model": "scripted/demo"}),
        )
        .unwrap();

    let rows = store.audit_rows().unwrap();
    assert_eq!(
        rows.iter().map(|r| r.action.as_str()).collect::<Vec<_>>(),
        ["first", "second", "next day", "session.create"]
    );
    assert_eq!(
        rows[3].detail,
        serde_json::json!({"model": "scripted/demo"})
    );
    assert_eq!(rows[3].owner_id, scope.owner_id);
    assert_eq!(rows[3].decision, "applied");

    let last = store.audit_last(2).unwrap();
    assert_eq!(
        last.iter().map(|r| r.action.as_str()).collect::<Vec<_>>(),
        ["next day", "session.create"]
    );
    assert!(last[0].id < last[1].id);

    let first_day = store
        .audit_range(day * DAY_MS, (day + 1) * DAY_MS, 0, 10)
        .unwrap();
    assert_eq!(first_day.len(), 2);
    let after = store
        .audit_range(day * DAY_MS, (day + 1) * DAY_MS, first_day[0].id, 10)
        .unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].action, "second");
    assert_eq!(
        store
            .audit_range(day * DAY_MS, (day + 2) * DAY_MS, 0, 1)
            .unwrap()
            .len(),
        1,
        "the limit holds"
    );

    assert_eq!(
        store.audit_days_before((day + 2) * DAY_MS).unwrap(),
        [day, day + 1]
    );
    assert_eq!(store.delete_audit_day(day, (day + 2) * DAY_MS).unwrap(), 2);
    assert_eq!(store.delete_audit_day(day, (day + 2) * DAY_MS).unwrap(), 0);
    assert_eq!(
        store.audit_days_before((day + 2) * DAY_MS).unwrap(),
        [day + 1]
    );
    assert_eq!(store.audit_rows().unwrap().len(), 2);
}

fn audit_ids_from_two_connections_are_gapless_and_visible_in_order(db: &Db) {
    const EACH: usize = 40;
    let (a, b, follower) = (db.open(), db.open(), db.open());
    let start = Barrier::new(2);
    let seen = std::thread::scope(|threads| {
        for (name, store) in [("a", &a), ("b", &b)] {
            let start = &start;
            threads.spawn(move || {
                start.wait();
                for i in 0..EACH {
                    store
                        .audit(
                            &alice(),
                            "api",
                            &format!("{name}{i}"),
                            "t",
                            "applied",
                            &serde_json::json!({}),
                        )
                        .unwrap();
                }
            });
        }
        // `audit tail --follow` resumes after the last id it saw: a row that became visible
        // after a higher id would be skipped for good.
        let reader = threads.spawn(|| {
            let mut seen: Vec<i64> = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while seen.len() < 2 * EACH {
                assert!(
                    std::time::Instant::now() < deadline,
                    "rows stopped arriving"
                );
                let after = seen.last().copied().unwrap_or(0);
                for row in follower.audit_range(0, i64::MAX, after, 1000).unwrap() {
                    assert_eq!(row.id, seen.len() as i64 + 1, "the follower saw a gap");
                    seen.push(row.id);
                }
            }
            seen
        });
        reader.join().unwrap()
    });
    assert_eq!(seen.len(), 2 * EACH);
    for name in ["a", "b"] {
        let order: Vec<String> = a
            .audit_rows()
            .unwrap()
            .into_iter()
            .map(|r| r.action)
            .filter(|action| action.starts_with(name))
            .collect();
        let written: Vec<String> = (0..EACH).map(|i| format!("{name}{i}")).collect();
        assert_eq!(order, written);
    }
}

fn approval(session: &SessionId, subject: &str) -> NewApproval {
    NewApproval {
        id: ApprovalId::from_suffix(&skiff_store::mint().unwrap()),
        session_id: session.clone(),
        run_id: RunId::from_suffix(&skiff_store::mint().unwrap()),
        tool: "exec".into(),
        kind: ApprovalKind::Exec,
        subject: subject.into(),
        requested_by: "agent".into(),
        request_reason: None,
        expires_at_ms: i64::MAX,
    }
}

fn an_approval_is_settled_once_and_seen_only_within_its_sight(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let carl = Scope::new("usr_carl", "ten_a");
    let s = new_session(&*a, &alice());
    let other = new_session(&*a, &alice());
    let first = a
        .create_approval(&alice(), &approval(&s, "rm -rf build"))
        .unwrap();
    assert_eq!(first.state, ApprovalState::Pending);
    assert_eq!(first.subject, "rm -rf build");
    assert_eq!(first.kind, ApprovalKind::Exec);
    let second = a
        .create_approval(
            &alice(),
            &NewApproval {
                kind: ApprovalKind::Request,
                request_reason: Some("to deploy".into()),
                ..approval(&other, "deploy")
            },
        )
        .unwrap();
    assert_eq!(b.approval(&alice(), &second.id).unwrap(), second);

    let ids = |list: Vec<skiff_protocol::approval::ApprovalView>| {
        list.into_iter().map(|v| v.id).collect::<Vec<_>>()
    };
    let mine = Sight::own(alice());
    assert_eq!(
        ids(a.approvals(&mine, None, false).unwrap()),
        [second.id.clone(), first.id.clone()],
        "newest first"
    );
    assert_eq!(
        ids(a.approvals(&mine, Some(&s), false).unwrap()),
        std::slice::from_ref(&first.id)
    );
    assert!(
        a.approvals(&Sight::own(carl.clone()), None, false)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        a.approvals(&Sight::tenant(carl.clone()), None, false)
            .unwrap()
            .len(),
        2
    );
    assert!(
        a.approvals(
            &Sight::tenant(Scope::new("usr_alice", "ten_b")),
            None,
            false
        )
        .unwrap()
        .is_empty(),
        "another tenant never sees them"
    );
    assert!(matches!(
        a.approval(&carl, &first.id),
        Err(Error::NotFound {
            what: "approval",
            ..
        })
    ));

    // A decision racing a timeout: one wins, the other reads the winner.
    let start = Barrier::new(2);
    let outcomes: Vec<_> = std::thread::scope(|threads| {
        let racers: Vec<_> = [(&a, ApprovalState::Approved), (&b, ApprovalState::Expired)]
            .into_iter()
            .map(|(store, to)| {
                let (start, id) = (&start, &first.id);
                threads.spawn(move || {
                    start.wait();
                    store
                        .settle_approval(&alice(), id, to, "someone", None)
                        .unwrap()
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let won: Vec<_> = outcomes.iter().flatten().collect();
    assert_eq!(won.len(), 1, "one settles it: {outcomes:?}");
    let now = b.approval(&alice(), &first.id).unwrap();
    assert_eq!(now.state, won[0].state);
    assert_eq!(now.decided_by.as_deref(), Some("someone"));
    assert!(now.decided_at_ms.is_some());

    assert!(matches!(
        a.settle_approval(&alice(), &second.id, ApprovalState::Pending, "x", None),
        Err(Error::Corrupt { .. })
    ));
    assert!(matches!(
        a.settle_approval(&carl, &second.id, ApprovalState::Denied, "carl", None),
        Err(Error::NotFound { .. })
    ));
    assert_eq!(
        ids(a.approvals(&mine, None, true).unwrap()),
        std::slice::from_ref(&second.id),
        "pending only"
    );
    assert_eq!(
        a.expire_orphaned_approvals(None, "the gateway restarted")
            .unwrap(),
        1
    );
    let revoked = a.approval(&alice(), &second.id).unwrap();
    assert_eq!(revoked.state, ApprovalState::Revoked);
    assert_eq!(revoked.reason.as_deref(), Some("the gateway restarted"));
    assert_eq!(revoked.request_reason.as_deref(), Some("to deploy"));
    assert_eq!(a.expire_orphaned_approvals(None, "again").unwrap(), 0);
}

fn a_starting_gateway_spares_the_approvals_of_a_session_another_gateway_holds(db: &Db) {
    use skiff_store::{Claim, LeaseKey};
    let (a, b) = (db.open(), db.open());
    let gw = skiff_protocol::GatewayId::from_suffix;
    let lease = |s: &SessionId, holder: &str, ttl: std::time::Duration| {
        let claim = b
            .acquire_lease(&LeaseKey::Session(s.clone()), &gw(holder), ttl)
            .unwrap();
        assert!(matches!(claim, Claim::Won(_)), "{claim:?}");
    };
    let live = std::time::Duration::from_secs(60);
    let (theirs, mine, lapsed, free) = (
        new_session(&*a, &alice()),
        new_session(&*a, &alice()),
        new_session(&*a, &alice()),
        new_session(&*a, &alice()),
    );
    lease(&theirs, "b", live);
    lease(&mine, "a", live);
    lease(&lapsed, "b", std::time::Duration::ZERO);
    let pending: Vec<_> = [&theirs, &mine, &lapsed, &free]
        .into_iter()
        .map(|s| a.create_approval(&alice(), &approval(s, "make")).unwrap())
        .collect();
    // Gateway a starts: what its own sessions, a lapsed lease's and a free session's turns
    // waited for is revoked; gateway b's live turn still waits for its person.
    assert_eq!(
        a.expire_orphaned_approvals(Some(&gw("a")), "the gateway restarted")
            .unwrap(),
        3
    );
    let states: Vec<_> = pending
        .iter()
        .map(|p| a.approval(&alice(), &p.id).unwrap().state)
        .collect();
    assert_eq!(
        states,
        [
            ApprovalState::Pending,
            ApprovalState::Revoked,
            ApprovalState::Revoked,
            ApprovalState::Revoked
        ]
    );
}

fn racing_redemptions_consume_each_grant_once(db: &Db) {
    const GRANTS: usize = 30;
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let ids: Vec<GrantId> = (0..GRANTS)
        .map(|_| {
            let id = GrantId::from_suffix(&skiff_store::mint().unwrap());
            a.register_grant(
                &alice(),
                &NewGrant {
                    id: id.clone(),
                    session_id: s.clone(),
                    capability: "git_push".into(),
                    target: "origin/main".into(),
                    policy_revision: "r1".into(),
                    issued_at_ms: 1,
                    expires_at_ms: i64::MAX,
                },
            )
            .unwrap();
            id
        })
        .collect();
    let start = Barrier::new(2);
    let outcomes: Vec<Vec<Consumed>> = std::thread::scope(|threads| {
        let racers: Vec<_> = [&a, &b]
            .into_iter()
            .map(|store| {
                let (start, ids, s) = (&start, &ids, &s);
                threads.spawn(move || {
                    start.wait();
                    ids.iter()
                        .map(|id| store.consume_grant(&alice(), s, id).unwrap())
                        .collect()
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for (i, (from_a, from_b)) in outcomes[0].iter().zip(&outcomes[1]).enumerate() {
        let pair = [*from_a, *from_b];
        assert!(
            pair == [Consumed::Now, Consumed::Already]
                || pair == [Consumed::Already, Consumed::Now],
            "grant {i} was consumed {pair:?}"
        );
    }
    assert_eq!(
        a.consume_grant(&alice(), &s, &ids[0]).unwrap(),
        Consumed::Already
    );
    // Another scope, another session, or an id never registered: unknown.
    let other = new_session(&*a, &alice());
    assert_eq!(
        a.consume_grant(&Scope::new("usr_mallory", "ten_a"), &s, &ids[0])
            .unwrap(),
        Consumed::Unknown
    );
    assert_eq!(
        a.consume_grant(&alice(), &other, &ids[0]).unwrap(),
        Consumed::Unknown
    );
    let never = GrantId::from_suffix(&skiff_store::mint().unwrap());
    assert_eq!(
        a.consume_grant(&alice(), &s, &never).unwrap(),
        Consumed::Unknown
    );
}

fn sealed(byte: u8, key: &str) -> Resealed {
    Resealed {
        ciphertext: vec![byte; 4],
        nonce: vec![byte; 12],
        key_id: key.to_owned(),
    }
}

fn a_replaced_secret_keeps_its_creation_date_and_a_failed_reseal_changes_nothing(db: &Db) {
    let store = db.open();
    let first = store.put_secret("K", &sealed(1, "a")).unwrap();
    let second = store.put_secret("K", &sealed(2, "a")).unwrap();
    assert_eq!(second.created_at_ms, first.created_at_ms);
    assert_eq!(second.ciphertext, vec![2; 4]);
    assert_eq!(second.nonce, vec![2; 12]);
    store.put_secret("L", &sealed(3, "a")).unwrap();
    assert_eq!(
        store
            .secrets()
            .unwrap()
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>(),
        ["K", "L"]
    );

    let failed = store.reseal_secrets(&mut |row| {
        if row.name == "L" {
            Err(Error::Corrupt {
                what: "secret",
                detail: "refused".into(),
            })
        } else {
            Ok(sealed(9, "b"))
        }
    });
    assert!(failed.is_err());
    assert!(store.secrets().unwrap().iter().all(|r| r.key_id == "a"));

    assert_eq!(
        store.reseal_secrets(&mut |_| Ok(sealed(9, "b"))).unwrap(),
        2
    );
    let rows = store.secrets().unwrap();
    assert!(
        rows.iter()
            .all(|r| r.key_id == "b" && r.ciphertext == vec![9; 4])
    );
    assert!(store.delete_secret("K").unwrap());
    assert!(!store.delete_secret("K").unwrap());
    assert_eq!(store.secret("K").unwrap(), None);
    assert_eq!(store.secret("L").unwrap().unwrap().key_id, "b");
}

fn a_rotation_racing_another_write_reseals_nothing_and_keeps_that_write(db: &Db) {
    let (a, b) = (db.open(), db.open());
    a.put_secret("K", &sealed(1, "a")).unwrap();
    a.put_secret("L", &sealed(2, "a")).unwrap();
    let mut wrote = false;
    let rotated = a.reseal_secrets(&mut |_| {
        if !wrote {
            // Another gateway stores a secret while this one is resealing.
            b.put_secret("K", &sealed(7, "a")).unwrap();
            wrote = true;
        }
        Ok(sealed(9, "b"))
    });
    // Refused as something to run again: PostgreSQL says the vault changed; SQLite's write
    // from a stale snapshot is refused as busy.
    match &rotated {
        Err(Error::VaultChanged) => {}
        Err(e) if e.is_retryable() => {}
        other => panic!("the rotation went ahead or failed for good: {other:?}"),
    }
    let rows = b.secrets().unwrap();
    assert!(rows.iter().all(|r| r.key_id == "a"), "{rows:?}");
    assert_eq!(b.secret("K").unwrap().unwrap().ciphertext, vec![7; 4]);
    // Run again, it reseals everything, the other write included.
    assert_eq!(a.reseal_secrets(&mut |_| Ok(sealed(9, "b"))).unwrap(), 2);
    assert!(b.secrets().unwrap().iter().all(|r| r.key_id == "b"));
}

fn agent_specs_pin_sessions_and_chat_replays_are_refused(db: &Db) {
    let (a, b) = (db.open(), db.open());
    assert!(a.put_agent_spec("reviewer", "d1", "{\"v\":1}").unwrap());
    assert!(
        !b.put_agent_spec("reviewer", "d1", "{\"v\":1}").unwrap(),
        "seen, not new"
    );
    assert!(b.put_agent_spec("reviewer", "d2", "{\"v\":2}").unwrap());
    assert!(a.put_agent_spec("author", "e1", "{}").unwrap());
    let versions = a.agent_spec_versions("reviewer").unwrap();
    assert_eq!(
        versions
            .iter()
            .map(|v| v.digest.as_str())
            .collect::<Vec<_>>(),
        ["d2", "d1"]
    );
    assert!(versions[0].seen_at_ms > versions[1].seen_at_ms);
    // Configuration names the old version again: it is current, and not new.
    assert!(!a.put_agent_spec("reviewer", "d1", "{\"v\":1}").unwrap());
    assert_eq!(a.agent_spec_versions("reviewer").unwrap()[0].digest, "d1");
    assert_eq!(
        b.agent_specs()
            .unwrap()
            .iter()
            .map(|v| (v.name.as_str(), v.digest.as_str(), v.content.as_str()))
            .collect::<Vec<_>>(),
        [("author", "e1", "{}"), ("reviewer", "d1", "{\"v\":1}")]
    );

    let s = new_session(&*a, &alice());
    assert_eq!(a.session_agent(&alice(), &s).unwrap(), None);
    a.pin_session_agent(&alice(), &s, "reviewer", "d1").unwrap();
    b.pin_session_agent(&alice(), &s, "reviewer", "d2").unwrap();
    assert_eq!(
        a.session_agent(&alice(), &s).unwrap(),
        Some(("reviewer".into(), "d2".into()))
    );
    let mallory = Scope::new("usr_mallory", "ten_a");
    assert_eq!(a.session_agent(&mallory, &s).unwrap(), None);
    a.pin_session_agent(&mallory, &s, "author", "e1").unwrap();
    assert_eq!(
        a.session_agent(&alice(), &s).unwrap(),
        Some(("reviewer".into(), "d2".into())),
        "another owner cannot repin alice's session"
    );

    assert!(a.ingress_event_first_seen("Ev1", 0).unwrap());
    assert!(!b.ingress_event_first_seen("Ev1", 0).unwrap(), "a replay");
    // Forgotten once older than the window, then accepted as new.
    assert!(b.ingress_event_first_seen("Ev1", i64::MAX).unwrap());

    assert_eq!(a.ingress_thread("C1", "171.1").unwrap(), None);
    a.put_ingress_thread(&alice(), "C1", "171.1", &s).unwrap();
    assert_eq!(
        b.ingress_thread("C1", "171.1").unwrap(),
        Some((alice(), s.clone()))
    );
    assert!(
        b.put_ingress_thread(&alice(), "C1", "171.1", &s).is_err(),
        "a thread starts one session"
    );
}

fn usage_is_summed_per_session_user_and_tenant(db: &Db) {
    let store = db.open();
    let carl = Scope::new("usr_carl", "ten_a");
    let bert = Scope::new("usr_bert", "ten_b");
    let tokens = |input: u64, output: u64| Usage {
        input_tokens: input,
        output_tokens: output,
        cache_read_tokens: input / 2,
        cache_write_tokens: 0,
    };
    let (s1, s2) = (
        new_session(&*store, &alice()),
        new_session(&*store, &alice()),
    );
    let (s3, s4) = (new_session(&*store, &carl), new_session(&*store, &bert));
    let mut runs = Vec::new();
    for (scope, s, usage, cost) in [
        (alice(), &s1, tokens(100, 10), 0.5),
        (alice(), &s1, tokens(200, 20), 0.25),
        (alice(), &s2, tokens(1, 1), 0.0),
        (carl.clone(), &s3, tokens(1000, 0), 2.0),
        (bert.clone(), &s4, tokens(7, 0), 0.125),
    ] {
        let run = store.create_run(&scope, s, "scripted/demo").unwrap();
        store.add_run_usage(&scope, &run.id, usage, cost).unwrap();
        store
            .transition_run(
                &scope,
                &run.id,
                skiff_protocol::api::RunStatus::Cancelled,
                None,
            )
            .unwrap();
        runs.push(run.id);
    }
    // A response that used nothing writes no ledger row but is no error.
    let run = store.create_run(&alice(), &s2, "scripted/demo").unwrap();
    store
        .add_run_usage(&alice(), &run.id, Usage::default(), 0.0)
        .unwrap();

    let used = store.session_usage(&alice(), &s1).unwrap();
    assert_eq!((used.tokens, used.cost_usd), (330, 0.75));
    let run_row = store.run(&alice(), &runs[0]).unwrap();
    assert_eq!(run_row.usage, tokens(100, 10), "the run keeps its totals");
    assert_eq!(store.session_usage(&carl, &s1).unwrap().tokens, 0, "scoped");
    let alice_used = store.user_usage(&alice(), 0).unwrap();
    assert_eq!((alice_used.tokens, alice_used.cost_usd), (332, 0.75));
    assert_eq!(store.user_usage(&alice(), i64::MAX).unwrap().tokens, 0);
    let tenant = store.tenant_usage(&alice(), 0).unwrap();
    assert_eq!((tenant.tokens, tenant.cost_usd), (1332, 2.75));

    let report: Vec<_> = store
        .usage_since(0)
        .unwrap()
        .into_iter()
        .map(|u| (u.tenant_id, u.owner_id, u.session_id, u.used.tokens))
        .collect();
    let mut sessions = vec![
        ("ten_a", "usr_alice", &s1, 330),
        ("ten_a", "usr_alice", &s2, 2),
        ("ten_a", "usr_carl", &s3, 1000),
        ("ten_b", "usr_bert", &s4, 7),
    ];
    sessions.sort_by(|x, y| (x.0, x.1, x.2.as_str()).cmp(&(y.0, y.1, y.2.as_str())));
    let mut expected: Vec<(String, String, Option<String>, u64)> = [
        ("ten_a", "usr_alice", 332),
        ("ten_a", "usr_carl", 1000),
        ("ten_b", "usr_bert", 7),
    ]
    .into_iter()
    .map(|(t, o, n)| (t.to_string(), o.to_string(), None, n))
    .collect();
    expected.extend(
        sessions
            .into_iter()
            .map(|(t, o, s, n)| (t.to_string(), o.to_string(), Some(s.to_string()), n)),
    );
    assert_eq!(report, expected);
    assert!(store.usage_since(i64::MAX).unwrap().is_empty());
}
