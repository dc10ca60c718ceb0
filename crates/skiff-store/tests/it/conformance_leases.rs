//! The conformance suite for several gateways on one database (issue 17): the gateway
//! registry, session and singleton leases, fenced writes, and event wake-ups — on SQLite and
//! on PostgreSQL, through the traits only. Expired leases are leases taken with a TTL of
//! zero (expired the moment the database wrote them), so no test waits for a clock.

use super::conformance::{Db, alice, new_session};
use skiff_protocol::GatewayId;
use skiff_protocol::api::{AttemptStatus, RunStatus};
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_store::{
    Claim, Error, EventLog, Fence, Follower, Lease, LeaseKey, Leases, PgStore, Resume,
};
use skiff_test_support::postgres::PgCluster;
use std::sync::Barrier;
use std::time::{Duration, Instant};

super::conformance::on_both_backends!(
    racing_claims_of_one_lease_have_one_winner,
    a_renewal_or_release_at_a_stale_epoch_is_refused,
    a_taken_over_session_refuses_the_old_holders_fenced_writes_and_keeps_nothing_of_them,
    a_stale_owner_cannot_move_its_run_or_its_attempts_and_the_new_owner_goes_on_as_a_new_attempt,
    a_restarting_gateway_spares_the_runs_of_a_session_another_gateway_holds,
    singleton_leases_follow_the_same_rules,
    gateways_register_beat_and_name_the_leases_of_dead_ones,
    a_released_lease_of_an_unfinished_run_is_listed_for_a_claim_at_once,
    a_deregistered_gateway_is_no_longer_listed,
    lease_expiry_is_reckoned_on_the_databases_clock,
    a_follower_is_woken_by_appends_through_its_own_store,
    a_follower_reads_appends_it_was_never_hinted_of_by_polling,
);

const LIVE: Duration = Duration::from_secs(60);
/// Expired as soon as written.
const EXPIRED: Duration = Duration::ZERO;

fn gw(name: &str) -> GatewayId {
    GatewayId::from_suffix(name)
}

fn won(claim: Claim) -> Lease {
    match claim {
        Claim::Won(lease) => lease,
        Claim::Held(lease) => panic!("the claim lost to {lease:?}"),
    }
}

fn held(claim: Claim) -> Lease {
    match claim {
        Claim::Held(lease) => lease,
        Claim::Won(lease) => panic!("the claim won {lease:?}"),
    }
}

fn text(text: &str) -> EventKind {
    EventKind::TextDelta { text: text.into() }
}

fn texts_of(events: &[skiff_protocol::event::SessionEvent]) -> Vec<String> {
    events
        .iter()
        .map(|e| match &e.kind {
            EventKind::TextDelta { text } => text.clone(),
            other => panic!("not a text delta: {other:?}"),
        })
        .collect()
}

fn racing_claims_of_one_lease_have_one_winner(db: &Db) {
    const ROUNDS: usize = 20;
    let (a, b) = (db.open(), db.open());
    for round in 0..ROUNDS {
        let key = LeaseKey::singleton(format!("race-{round}"));
        let start = Barrier::new(2);
        let claims: Vec<(GatewayId, Claim)> = std::thread::scope(|threads| {
            let racers: Vec<_> = [(gw("a"), &a), (gw("b"), &b)]
                .into_iter()
                .map(|(me, store)| {
                    let (key, start) = (&key, &start);
                    threads.spawn(move || {
                        start.wait();
                        let claim = store.acquire_lease(key, &me, LIVE).unwrap();
                        (me, claim)
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let winners: Vec<&Lease> = claims
            .iter()
            .filter_map(|(_, c)| match c {
                Claim::Won(lease) => Some(lease),
                Claim::Held(_) => None,
            })
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {claims:?}");
        let winner = winners[0];
        assert_eq!(winner.epoch, 1);
        assert!(!winner.expired);
        // The loser is told who won.
        for (me, claim) in &claims {
            if let Claim::Held(lease) = claim {
                assert_ne!(*me, lease.holder);
                assert_eq!(lease, winner, "round {round}");
            }
        }
        assert_eq!(a.lease(&key).unwrap().as_ref(), Some(winner));
    }
}

fn a_renewal_or_release_at_a_stale_epoch_is_refused(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let key = LeaseKey::Session(s.clone());
    let old = won(a.acquire_lease(&key, &gw("a"), EXPIRED).unwrap());
    assert!(old.expired);
    let taken = won(b.take_over_lease(&old, &gw("b"), LIVE).unwrap());
    assert_eq!(
        (taken.holder.clone(), taken.epoch),
        (gw("b"), old.epoch + 1)
    );

    let err = a.renew_lease(&old, LIVE).unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    let said = err.to_string();
    assert!(
        said.contains(&format!(
            "gateway gw_a no longer holds the lease on session {s} at epoch 1"
        )) && said.contains("held by gw_b at epoch 2"),
        "{said}"
    );
    let err = a.release_lease(&old).unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    // The holder renews; nothing of the refusals changed the lease.
    let renewed = b.renew_lease(&taken, LIVE).unwrap();
    assert_eq!((renewed.holder.clone(), renewed.epoch), (gw("b"), 2));
    assert!(renewed.expires_at_ms >= taken.expires_at_ms);
    assert_eq!(a.lease(&key).unwrap(), Some(renewed.clone()));
    // A holder whose lease expired, with nobody taking it over, may renew it.
    let lapsed = b.renew_lease(&renewed, EXPIRED).unwrap();
    assert!(lapsed.expired);
    let back = b.renew_lease(&lapsed, LIVE).unwrap();
    assert_eq!((back.epoch, back.expired), (2, false));
}

fn a_taken_over_session_refuses_the_old_holders_fenced_writes_and_keeps_nothing_of_them(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let key = LeaseKey::Session(s.clone());
    let mine = won(a.acquire_lease(&key, &gw("a"), EXPIRED).unwrap());
    let fence_a = mine.fence().unwrap();
    // Expired but not taken over: the holder's writes still go through (the epoch fences,
    // not the clock).
    let first = a
        .append_entries_fenced(&fence_a, &alice(), None, None, &[user("by a")])
        .unwrap();
    a.append_event_fenced(&fence_a, &alice(), None, text("by a"))
        .unwrap();

    let expired = b.expired_leases().unwrap();
    assert_eq!(
        expired,
        vec![Lease {
            expired: true,
            ..mine.clone()
        }]
    );
    let theirs = won(b.take_over_lease(&expired[0], &gw("b"), LIVE).unwrap());
    assert_eq!((theirs.holder.clone(), theirs.epoch), (gw("b"), 2));
    assert!(b.expired_leases().unwrap().is_empty());
    // A third gateway acting on the same stale listing finds it taken.
    let late = held(a.take_over_lease(&expired[0], &gw("c"), LIVE).unwrap());
    assert_eq!(late, theirs);

    // The old holder wakes up and writes: refused, and nothing of it is kept.
    let leaf = Some(&first[0].id);
    let err = a
        .append_entries_fenced(&fence_a, &alice(), leaf, None, &[user("late a")])
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    let err = a
        .append_event_fenced(&fence_a, &alice(), None, text("late a"))
        .unwrap_err();
    assert!(err.to_string().contains("held by gw_b at epoch 2"), "{err}");
    assert_eq!(a.leaf(&alice(), &s).unwrap().as_ref(), leaf);
    assert_eq!(a.last_event_cursor(&alice(), &s).unwrap(), 1);

    // The new holder's writes go on from where the old one's stopped.
    let fence_b = theirs.fence().unwrap();
    b.append_entries_fenced(&fence_b, &alice(), leaf, None, &[user("by b")])
        .unwrap();
    let event = b
        .append_event_fenced(&fence_b, &alice(), None, text("by b"))
        .unwrap();
    assert_eq!(event.cursor, 2);
    let transcript: Vec<String> = b
        .transcript(&alice(), &s)
        .unwrap()
        .into_iter()
        .map(|e| match e.body {
            EntryBody::UserMessage { text } => text,
            other => panic!("unexpected entry {other:?}"),
        })
        .collect();
    assert_eq!(transcript, ["by a", "by b"]);
    assert_eq!(
        texts_of(&b.events_after(&alice(), &s, 0, 10).unwrap()),
        ["by a", "by b"]
    );
    // A fence on a session nobody ever leased holds nothing.
    let other = new_session(&*a, &alice());
    let stray = skiff_store::Fence {
        session: other.clone(),
        gateway: gw("a"),
        epoch: 1,
    };
    let err = a
        .append_event_fenced(&stray, &alice(), None, text("x"))
        .unwrap_err();
    assert!(err.to_string().contains("held by nobody"), "{err}");
    assert_eq!(a.last_event_cursor(&alice(), &other).unwrap(), 0);
}

fn a_stale_owner_cannot_move_its_run_or_its_attempts_and_the_new_owner_goes_on_as_a_new_attempt(
    db: &Db,
) {
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let key = LeaseKey::Session(s.clone());
    let fence_a = won(a.acquire_lease(&key, &gw("a"), EXPIRED).unwrap())
        .fence()
        .unwrap();
    let run = a.create_run(&alice(), &s, "fake/m").unwrap();
    for status in [RunStatus::Starting, RunStatus::Running] {
        a.transition_run_fenced(&fence_a, &alice(), &run.id, status, None)
            .unwrap();
    }
    let first = a
        .resume_attempt_fenced(&fence_a, &alice(), &run, "gateway", Resume::default())
        .unwrap();

    let expired = b.expired_leases().unwrap();
    let fence_b = won(b.take_over_lease(&expired[0], &gw("b"), LIVE).unwrap())
        .fence()
        .unwrap();

    // The old owner wakes up: every write of its run is refused, naming the new holder.
    let err = a
        .transition_run_fenced(&fence_a, &alice(), &run.id, RunStatus::Succeeded, None)
        .unwrap_err();
    assert!(err.to_string().contains("held by gw_b at epoch 2"), "{err}");
    let err = a
        .finish_attempt_fenced(&fence_a, &alice(), &first, AttemptStatus::Succeeded, None)
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    let err = a
        .resume_attempt_fenced(&fence_a, &alice(), &run, "gateway", Resume::default())
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    // ... and nothing of them is kept.
    assert_eq!(a.run(&alice(), &run.id).unwrap().status, RunStatus::Running);
    let attempts = a.attempts(&alice(), &s).unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(
        (attempts[0].status, attempts[0].owner_epoch),
        (AttemptStatus::Running, 1)
    );

    // The new owner finds the run (unscoped, with its scope) and goes on as a new attempt.
    let (scope, open) = b.open_run_of(&s).unwrap().unwrap();
    assert_eq!((scope, open.id.clone()), (alice(), run.id.clone()));
    b.finish_attempt_fenced(
        &fence_b,
        &alice(),
        &first,
        AttemptStatus::Orphaned,
        Some("gateway gw_a stopped"),
    )
    .unwrap();
    let resume = Resume {
        after: Some(&first),
        checkpoint_artifact_id: None,
    };
    let second = b
        .resume_attempt_fenced(&fence_b, &alice(), &open, "gateway", resume)
        .unwrap();
    b.transition_run_fenced(&fence_b, &alice(), &run.id, RunStatus::Succeeded, None)
        .unwrap();
    let attempts = b.attempts(&alice(), &s).unwrap();
    let seen: Vec<_> = attempts
        .iter()
        .map(|a| (a.status, a.owner_epoch, a.resume_from.clone()))
        .collect();
    assert_eq!(
        seen,
        [
            (AttemptStatus::Orphaned, 1, None),
            (AttemptStatus::Running, 2, Some(first.clone())),
        ]
    );
    assert_eq!(attempts[1].id, second);
    assert!(b.open_run_of(&s).unwrap().is_none());
}

fn a_restarting_gateway_spares_the_runs_of_a_session_another_gateway_holds(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let theirs = new_session(&*a, &alice());
    let mine = new_session(&*a, &alice());
    let lapsed = new_session(&*a, &alice());
    let free = new_session(&*a, &alice());
    let lease = |s: &skiff_protocol::SessionId, holder: &str, ttl: Duration| {
        won(b
            .acquire_lease(&LeaseKey::Session(s.clone()), &gw(holder), ttl)
            .unwrap())
    };
    lease(&theirs, "b", LIVE);
    lease(&mine, "a", LIVE);
    lease(&lapsed, "b", EXPIRED);
    let mut runs = Vec::new();
    for s in [&theirs, &mine, &lapsed, &free] {
        let run = b.create_run(&alice(), s, "fake/m").unwrap();
        b.start_attempt(&alice(), &run, "gateway", 1).unwrap();
        runs.push(run.id);
    }
    // Gateway a restarts: its own run, the lapsed one and the free one are orphaned; the run
    // of the session gateway b holds goes on.
    let mut orphaned: Vec<_> = a
        .orphan_unleased_on_start(&gw("a"), "the gateway restarted")
        .unwrap()
        .into_iter()
        .map(|(_, run)| run.id)
        .collect();
    orphaned.sort_by(|x, y| x.as_str().cmp(y.as_str()));
    let mut expected = runs[1..].to_vec();
    expected.sort_by(|x, y| x.as_str().cmp(y.as_str()));
    assert_eq!(orphaned, expected);
    assert_eq!(a.run(&alice(), &runs[0]).unwrap().status, RunStatus::Queued);
    let attempts = a.attempts(&alice(), &theirs).unwrap();
    assert_eq!(attempts[0].status, AttemptStatus::Running);
    assert_eq!(
        a.attempts(&alice(), &free).unwrap()[0].status,
        AttemptStatus::Orphaned
    );
}

fn user(text: &str) -> EntryBody {
    EntryBody::UserMessage { text: text.into() }
}

fn singleton_leases_follow_the_same_rules(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let sweeper = LeaseKey::singleton("sweeper");
    let tick = LeaseKey::singleton("lifetime-tick");
    let mine = won(a.acquire_lease(&sweeper, &gw("a"), LIVE).unwrap());
    assert_eq!(mine.fence(), None, "nothing is written under a singleton");
    assert_eq!(
        held(b.acquire_lease(&sweeper, &gw("b"), LIVE).unwrap()),
        mine
    );
    // Another chore is another lease.
    assert_eq!(
        won(b.acquire_lease(&tick, &gw("b"), LIVE).unwrap()).epoch,
        1
    );
    // Claiming what one holds extends it, same epoch.
    let again = won(a.acquire_lease(&sweeper, &gw("a"), LIVE).unwrap());
    assert_eq!(again.epoch, mine.epoch);
    // Released, it goes to the next claimant with one more epoch; the old epoch is dead.
    a.release_lease(&again).unwrap();
    assert_eq!(a.lease(&sweeper).unwrap(), None);
    let theirs = won(b.acquire_lease(&sweeper, &gw("b"), LIVE).unwrap());
    assert_eq!((theirs.holder.clone(), theirs.epoch), (gw("b"), 2));
    assert!(matches!(
        a.renew_lease(&again, LIVE).unwrap_err(),
        Error::LeaseLost { .. }
    ));
    // Even the old holder claiming after its own release starts a new epoch.
    b.release_lease(&theirs).unwrap();
    assert_eq!(
        won(a.acquire_lease(&sweeper, &gw("a"), LIVE).unwrap()).epoch,
        3
    );
    // An expired one goes to whoever claims it.
    let lapsing = won(b.acquire_lease(&tick, &gw("b"), EXPIRED).unwrap());
    let took = won(a.acquire_lease(&tick, &gw("a"), LIVE).unwrap());
    assert_eq!((took.holder, took.epoch), (gw("a"), lapsing.epoch + 1));
}

fn gateways_register_beat_and_name_the_leases_of_dead_ones(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let one = a.register_gateway(&gw("one"), "10.0.0.1:7070").unwrap();
    assert!(one.alive && one.heartbeat_at_ms >= one.started_at_ms);
    b.register_gateway(&gw("two"), "10.0.0.2:7070").unwrap();
    let beat = a.heartbeat(&gw("one")).unwrap();
    assert!(beat.heartbeat_at_ms >= one.heartbeat_at_ms);
    let listed = b.gateways(LIVE).unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|g| (g.id.to_string(), g.address.as_str(), g.alive))
            .collect::<Vec<_>>(),
        [
            ("gw_one".to_string(), "10.0.0.1:7070", true),
            ("gw_two".to_string(), "10.0.0.2:7070", true)
        ]
    );
    let err = a.heartbeat(&gw("never")).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotFound {
                what: "gateway",
                ..
            }
        ),
        "{err:?}"
    );
    // A gateway that restarts registers again: a new start, the new address.
    let restarted = a.register_gateway(&gw("one"), "10.0.0.9:7070").unwrap();
    assert!(restarted.started_at_ms >= one.started_at_ms);
    assert_eq!(a.gateways(LIVE).unwrap().len(), 2);

    // Leases held by a gateway the registry does not know (or no longer hears) are listed
    // as a dead gateway's; a live one's are not.
    let ghost = won(a
        .acquire_lease(&LeaseKey::singleton("sweeper"), &gw("ghost"), LIVE)
        .unwrap());
    won(a
        .acquire_lease(&LeaseKey::singleton("tick"), &gw("one"), LIVE)
        .unwrap());
    assert_eq!(b.leases_of_dead_gateways(LIVE).unwrap(), vec![ghost]);
}

fn lease_expiry_is_reckoned_on_the_databases_clock(db: &Db) {
    let store = db.open();
    let before = store.database_now_ms().unwrap();
    let lease = won(store
        .acquire_lease(&LeaseKey::singleton("sweeper"), &gw("a"), LIVE)
        .unwrap());
    let after = store.database_now_ms().unwrap();
    let ttl = i64::try_from(LIVE.as_millis()).unwrap();
    assert!(
        (before + ttl..=after + ttl).contains(&lease.expires_at_ms),
        "{before} + {ttl} <= {} <= {after} + {ttl}",
        lease.expires_at_ms
    );
}

/// How long a test waits for events before it fails.
const PATIENCE: Duration = Duration::from_secs(20);
/// A poll interval no test lives to see: progress must come from hints.
const NEVER: Duration = Duration::from_secs(3600);

/// Reads until `want` events came, failing after `PATIENCE`.
fn read_until<S: skiff_store::EventLog + skiff_store::EventWakeups + ?Sized>(
    follower: &mut Follower<'_, S>,
    want: usize,
) -> Vec<String> {
    let deadline = Instant::now() + PATIENCE;
    let mut seen = Vec::new();
    while seen.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "only {} of {want} events came: {seen:?}",
            seen.len()
        );
        seen.extend(texts_of(&follower.next(left).unwrap()));
    }
    seen
}

fn numbered(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("e{i}")).collect()
}

fn a_follower_is_woken_by_appends_through_its_own_store(db: &Db) {
    let store = db.open();
    let s = new_session(&*store, &alice());
    let mut follower = Follower::new(&*store, &alice(), &s, 0, NEVER).unwrap();
    assert!(follower.next(Duration::ZERO).unwrap().is_empty());
    std::thread::scope(|threads| {
        threads.spawn(|| {
            for text_ in numbered(0..30) {
                store
                    .append_event(&alice(), &s, None, text(&text_))
                    .unwrap();
            }
        });
        assert_eq!(read_until(&mut follower, 30), numbered(0..30));
    });
    assert_eq!(follower.cursor(), 30);
}

fn a_follower_reads_appends_it_was_never_hinted_of_by_polling(db: &Db) {
    // On SQLite another connection's appends hint nobody in this store: the poll finds them.
    let (writer, reader) = (db.open(), db.open());
    let s = new_session(&*writer, &alice());
    let mut follower = Follower::new(&*reader, &alice(), &s, 0, Duration::from_millis(20)).unwrap();
    for text_ in numbered(0..5) {
        writer
            .append_event(&alice(), &s, None, text(&text_))
            .unwrap();
    }
    assert_eq!(read_until(&mut follower, 5), numbered(0..5));
}

/// PostgreSQL only: what needs a database with a clock or a listener of its own.
mod postgres_only {
    use super::*;

    fn two_stores() -> (PgCluster, PgStore, PgStore, String) {
        let cluster = PgCluster::start();
        let url = cluster.fresh_database();
        let one = PgStore::connect(&url).unwrap();
        let two = PgStore::connect(&url).unwrap();
        (cluster, one, two, url)
    }

    /// The database's clock is an hour ahead of this process's (as if this gateway's clock
    /// were an hour behind): leases behave exactly as they do without skew, because nothing
    /// is reckoned on the caller's clock. A store that wrote `caller now + ttl` would find
    /// every lease expired here.
    #[test]
    fn a_gateway_whose_clock_is_an_hour_off_agrees_on_every_lease() {
        const HOUR_MS: i64 = 3_600_000;
        let (_cluster, a, b, url) = two_stores();
        let mut admin = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
        admin
            .batch_execute(
                "CREATE OR REPLACE FUNCTION skiff_now_ms() RETURNS BIGINT LANGUAGE sql VOLATILE \
                 AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint + 3600000 $$",
            )
            .unwrap();
        let process_now = skiff_store::now_ms();
        let sweeper = LeaseKey::singleton("sweeper");
        let mine = won(a.acquire_lease(&sweeper, &gw("a"), LIVE).unwrap());
        assert!(
            mine.expires_at_ms >= process_now + HOUR_MS + 59_000,
            "expiry {} is not on the database's clock (process {process_now})",
            mine.expires_at_ms
        );
        assert!(!mine.expired);
        assert_eq!(
            held(b.acquire_lease(&sweeper, &gw("b"), LIVE).unwrap()),
            mine
        );
        assert!(b.expired_leases().unwrap().is_empty());
        let renewed = a.renew_lease(&mine, LIVE).unwrap();
        assert_eq!(renewed.epoch, mine.epoch);
        // An expired lease is expired for everyone, and taken over once.
        let tick = won(a
            .acquire_lease(&LeaseKey::singleton("tick"), &gw("a"), EXPIRED)
            .unwrap());
        assert_eq!(b.expired_leases().unwrap(), vec![tick.clone()]);
        assert_eq!(
            won(b.take_over_lease(&tick, &gw("b"), LIVE).unwrap()).epoch,
            2
        );
    }

    /// Two stores on one database, as two gateways: a follower on one sees every event
    /// appended through the other, in order, none lost — also across its listener's
    /// connection being killed (notifications sent meanwhile are lost; the resync after the
    /// reconnect reads them by cursor). The follower never polls on its own here.
    #[test]
    fn a_follower_on_another_store_sees_every_append_in_order_across_a_listener_reconnect() {
        let (cluster, writer, reader, url) = two_stores();
        let s = new_session(&writer, &alice());
        let mut follower = Follower::new(&reader, &alice(), &s, 0, NEVER).unwrap();
        // Listening: the listener's first connect says so.
        let deadline = Instant::now() + PATIENCE;
        while follower.resyncs() == 0 {
            assert!(
                Instant::now() < deadline,
                "the listener never connected:\n{}",
                cluster.log()
            );
            assert!(follower.next(Duration::from_millis(50)).unwrap().is_empty());
        }
        let mut seen = Vec::new();
        std::thread::scope(|threads| {
            threads.spawn(|| {
                for text_ in numbered(0..40) {
                    writer
                        .append_event(&alice(), &s, None, text(&text_))
                        .unwrap();
                }
            });
            seen.extend(read_until(&mut follower, 40));
        });
        assert_eq!(seen, numbered(0..40));

        // Keep the listener away while events are appended and the follower waits: no new
        // connection is let in (the writer's is open already), and the listener's is killed.
        // Nothing hints the follower of these; only the resync after the reconnect does.
        let db = url
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("dbname="))
            .unwrap()
            .to_string();
        // From another database: a database cannot close its doors on its own session.
        let elsewhere = url.replace(&format!("dbname={db}"), "dbname=postgres");
        let mut admin = ::postgres::Client::connect(&elsewhere, ::postgres::NoTls).unwrap();
        let start = Barrier::new(2);
        std::thread::scope(|threads| {
            threads.spawn(|| {
                start.wait();
                let doors = |open: bool| format!("ALTER DATABASE {db} ALLOW_CONNECTIONS {open}");
                admin.batch_execute(&doors(false)).unwrap();
                let listening = format!(
                    "SELECT pid FROM pg_stat_activity \
                      WHERE application_name = 'skiff-listen' AND datname = '{db}'"
                );
                let killed = admin
                    .query(
                        &format!("SELECT pg_terminate_backend(pid) FROM ({listening}) l"),
                        &[],
                    )
                    .unwrap();
                assert_eq!(killed.len(), 1, "one listener (the reader's) was connected");
                let deadline = Instant::now() + PATIENCE;
                while !admin.query(&listening, &[]).unwrap().is_empty() {
                    assert!(
                        Instant::now() < deadline,
                        "the listener outlived its termination"
                    );
                }
                for text_ in numbered(40..80) {
                    writer
                        .append_event(&alice(), &s, None, text(&text_))
                        .unwrap();
                }
                admin.batch_execute(&doors(true)).unwrap();
            });
            start.wait();
            seen.extend(read_until(&mut follower, 40));
        });
        assert_eq!(seen, numbered(0..80), "in order, none lost, none twice");
        assert!(follower.resyncs() >= 2, "the reconnect was announced");
        // And hints flow again after the reconnect.
        writer
            .append_event(&alice(), &s, None, text("e80"))
            .unwrap();
        assert_eq!(read_until(&mut follower, 1), ["e80"]);
        assert_eq!(follower.cursor(), 81);
    }
}

/// A draining gateway lets go of a running turn's lease: the session is listed at once (no
/// expiry to wait out), claimed by one gateway at the next epoch, and the draining holder's
/// fence is refused from the release on.
fn a_released_lease_of_an_unfinished_run_is_listed_for_a_claim_at_once(db: &Db) {
    let (a, b) = (db.open(), db.open());
    let running = new_session(&*a, &alice());
    let ended = new_session(&*a, &alice());
    let held = new_session(&*a, &alice());
    for s in [&running, &ended, &held] {
        let lease = won(a
            .acquire_lease(&LeaseKey::Session(s.clone()), &gw("a"), LIVE)
            .unwrap());
        let run = a.create_run(&alice(), s, "fake/m").unwrap();
        if s == &ended {
            a.transition_run(&alice(), &run.id, RunStatus::Cancelled, None)
                .unwrap();
        }
        if s != &held {
            a.release_lease(&lease).unwrap();
        }
    }
    assert_eq!(b.released_open_sessions().unwrap(), vec![running.clone()]);
    let key = LeaseKey::Session(running.clone());
    let fence_a = Fence {
        session: running.clone(),
        gateway: gw("a"),
        epoch: 1,
    };
    let err = a
        .append_event_fenced(&fence_a, &alice(), None, text("late"))
        .unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    let taken = won(b.acquire_lease(&key, &gw("b"), LIVE).unwrap());
    assert_eq!((taken.holder.clone(), taken.epoch), (gw("b"), 2));
    assert!(b.released_open_sessions().unwrap().is_empty());
}

fn a_deregistered_gateway_is_no_longer_listed(db: &Db) {
    let a = db.open();
    a.register_gateway(&gw("one"), "10.0.0.1:7070").unwrap();
    a.register_gateway(&gw("two"), "10.0.0.2:7070").unwrap();
    a.deregister_gateway(&gw("one")).unwrap();
    let ids: Vec<String> = a
        .gateways(LIVE)
        .unwrap()
        .iter()
        .map(|g| g.id.to_string())
        .collect();
    assert_eq!(ids, ["gw_two"]);
    // Leaving twice is no error: a drain that was interrupted may run again.
    a.deregister_gateway(&gw("one")).unwrap();
}
