//! Snapshot rows: finding one for a key, the way out, and least-recently-used eviction.

use crate::alice;
use skiff_protocol::environment::SnapshotState;
use skiff_protocol::{EnvironmentId, SnapshotId};
use skiff_store::{Error, NewSnapshot, Scope, SnapshotRow, Store};

const KEY: &str = "00aa11bb22cc33dd44ee55ff66778899";

fn snapshot_id(n: u8) -> SnapshotId {
    SnapshotId::from_random([n, 0, 0, 0, 0, 0, 0, n])
}

/// A snapshot captured (ready) with `size` bytes.
fn captured(
    store: &Store,
    scope: &Scope,
    n: u8,
    profile: &str,
    key: &str,
    size: u64,
) -> SnapshotId {
    let id = snapshot_id(n);
    let env = EnvironmentId::from_suffix(&format!("box{n}"));
    let row = store
        .record_snapshot(
            scope,
            &NewSnapshot {
                id: &id,
                profile,
                key,
                environment_id: &env,
                lease_id: "lbx_000000000000",
            },
        )
        .unwrap();
    assert_eq!(row.state, SnapshotState::Capturing);
    let row = store.snapshot_captured(scope, &id, size).unwrap();
    assert_eq!((row.state, row.size_bytes), (SnapshotState::Ready, size));
    id
}

fn ids(rows: &[SnapshotRow]) -> Vec<SnapshotId> {
    rows.iter().map(|r| r.id.clone()).collect()
}

#[test]
fn eviction_deletes_the_least_recently_used_snapshots_until_the_rest_fit() {
    let store = Store::open_in_memory().unwrap();
    let a = captured(&store, &alice(), 1, "local", KEY, 100);
    let b = captured(&store, &alice(), 2, "local", "bb", 100);
    let c = captured(&store, &alice(), 3, "local", "cc", 100);
    // Another tenant's snapshot of the profile shares the provider's disk; another profile's
    // does not count.
    let bob = Scope::new("usr_bob", "ten_b");
    let d = captured(&store, &bob, 4, "local", "dd", 100);
    captured(&store, &alice(), 5, "cloud", "ee", 1_000_000);
    // A box started from `a`: now it is the most recently used.
    assert_eq!(
        store
            .find_ready_snapshot(&alice(), "local", KEY)
            .unwrap()
            .map(|r| r.id),
        Some(a.clone())
    );

    assert!(store.evict_plan("local", 400).unwrap().is_empty());
    assert_eq!(
        ids(&store.evict_plan("local", 399).unwrap()),
        std::slice::from_ref(&b)
    );
    assert_eq!(
        ids(&store.evict_plan("local", 250).unwrap()),
        [b.clone(), c.clone()],
        "oldest first"
    );
    assert_eq!(
        ids(&store.evict_plan("local", 0).unwrap()),
        [b.clone(), c.clone(), d.clone(), a.clone()]
    );
    // One already on its way out counts for nothing and is not planned twice.
    store.mark_snapshot_deleting(&alice(), &b).unwrap();
    assert!(store.evict_plan("local", 300).unwrap().is_empty());
    assert_eq!(
        ids(&store.evict_plan("local", 299).unwrap()),
        std::slice::from_ref(&c)
    );

    // A new snapshot larger than the whole budget goes alone: it never fits, and the ones
    // that do are kept.
    let huge = captured(&store, &alice(), 6, "local", "ff", 301);
    assert_eq!(ids(&store.evict_plan("local", 300).unwrap()), [huge]);
}

#[test]
fn only_a_ready_snapshot_of_the_same_scope_profile_and_key_is_found() {
    let store = Store::open_in_memory().unwrap();
    assert_eq!(
        store.find_ready_snapshot(&alice(), "local", KEY).unwrap(),
        None
    );
    let id = captured(&store, &alice(), 1, "local", KEY, 10);
    let before = store.snapshot(&alice(), &id).unwrap().last_used_at_ms;
    let found = store
        .find_ready_snapshot(&alice(), "local", KEY)
        .unwrap()
        .unwrap();
    assert_eq!(found.id, id);
    assert!(found.last_used_at_ms > before, "finding it is a use");

    let mallory = Scope::new("usr_alice", "ten_b");
    assert_eq!(
        store.find_ready_snapshot(&mallory, "local", KEY).unwrap(),
        None
    );
    assert!(matches!(
        store.snapshot(&mallory, &id),
        Err(Error::NotFound { .. })
    ));
    assert!(
        store
            .snapshots(&skiff_store::Sight::own(mallory.clone()))
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.find_ready_snapshot(&alice(), "cloud", KEY).unwrap(),
        None
    );
    assert_eq!(
        store.find_ready_snapshot(&alice(), "local", "ff").unwrap(),
        None
    );

    // A capture in flight is not usable; neither is one being deleted.
    let env = EnvironmentId::from_suffix("other");
    let pending = snapshot_id(2);
    store
        .record_snapshot(
            &alice(),
            &NewSnapshot {
                id: &pending,
                profile: "local",
                key: "ab",
                environment_id: &env,
                lease_id: "lbx_000000000001",
            },
        )
        .unwrap();
    assert_eq!(
        store.find_ready_snapshot(&alice(), "local", "ab").unwrap(),
        None
    );
    store.mark_snapshot_deleting(&alice(), &id).unwrap();
    assert_eq!(
        store.find_ready_snapshot(&alice(), "local", KEY).unwrap(),
        None
    );
    assert!(store.touch_snapshot(&alice(), &id).is_err());
    assert_eq!(
        ids(&store.unsettled_snapshots().unwrap()),
        [id.clone(), pending]
    );
}

#[test]
fn a_snapshot_row_goes_only_after_it_was_marked_deleting() {
    let store = Store::open_in_memory().unwrap();
    let id = captured(&store, &alice(), 1, "local", KEY, 10);
    let err = store.delete_snapshot_row(&alice(), &id).unwrap_err();
    assert!(
        matches!(err, Error::IllegalSnapshotTransition { .. }),
        "{err}"
    );
    store.mark_snapshot_deleting(&alice(), &id).unwrap();
    // A retry of a deletion the provider did not finish.
    store.mark_snapshot_deleting(&alice(), &id).unwrap();
    let err = store.snapshot_captured(&alice(), &id, 10).unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot move from deleting to ready"),
        "{err}"
    );
    assert!(store.snapshot_known(&id).unwrap());
    store.delete_snapshot_row(&alice(), &id).unwrap();
    assert!(matches!(
        store.snapshot(&alice(), &id),
        Err(Error::NotFound { .. })
    ));
    assert!(!store.snapshot_known(&id).unwrap());
    assert!(
        store
            .snapshots(&skiff_store::Sight::own(alice()))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn an_environment_remembers_the_snapshot_it_starts_from() {
    let store = Store::open_in_memory().unwrap();
    let snapshot = snapshot_id(9);
    let env = EnvironmentId::from_suffix("fromsnap");
    let row = store
        .create_environment_from(
            &alice(),
            &env,
            "local",
            "local",
            "op_fromsnap",
            Some(&snapshot),
        )
        .unwrap();
    assert_eq!(row.snapshot_id, Some(snapshot));
    let plain = EnvironmentId::from_suffix("plain");
    let row = store
        .create_environment(&alice(), &plain, "local", "local", "op_plain")
        .unwrap();
    assert_eq!(row.snapshot_id, None);
}
