//! The conformance suite for artifact rows (`aggregates::Artifacts`), on SQLite and on
//! PostgreSQL, through the trait only.

use super::conformance::{Db, alice, new_session};
use skiff_protocol::SessionId;
use skiff_protocol::api::RunStatus;
use skiff_store::{ArtifactRole, Backend, Error, NewArtifact, Retention, Scope};
use std::sync::Barrier;

super::conformance::on_both_backends!(
    racing_checkpoints_of_one_session_are_numbered_once_each,
    a_checkpoint_lives_while_a_retryable_run_depends_on_it,
    logs_expire_and_a_blob_another_row_names_stays_referenced,
);

fn new(session: &SessionId, role: ArtifactRole, retention: Retention, hash: &str) -> NewArtifact {
    NewArtifact {
        session_id: Some(session.clone()),
        run_id: None,
        role,
        retention,
        hash: hash.into(),
        size: 3,
        meta: serde_json::json!({ "mode": "plain" }),
        expires_at_ms: (retention == Retention::Transient).then_some(1_000),
    }
}

fn checkpoint(
    store: &dyn Backend,
    scope: &Scope,
    s: &SessionId,
    hash: &str,
) -> skiff_store::ArtifactRow {
    store
        .create_artifact(
            scope,
            &new(s, ArtifactRole::Checkpoint, Retention::WhileRetryable, hash),
        )
        .unwrap()
}

fn racing_checkpoints_of_one_session_are_numbered_once_each(db: &Db) {
    const EACH: usize = 15;
    let (a, b) = (db.open(), db.open());
    let s = new_session(&*a, &alice());
    let start = Barrier::new(2);
    std::thread::scope(|threads| {
        for (name, store) in [("a", &a), ("b", &b)] {
            let (s, start) = (&s, &start);
            threads.spawn(move || {
                start.wait();
                for i in 0..EACH {
                    checkpoint(&**store, &alice(), s, &format!("{name}{i}"));
                }
            });
        }
    });
    let seqs: Vec<Option<u64>> = b
        .artifacts(&alice(), &s, ArtifactRole::Checkpoint)
        .unwrap()
        .into_iter()
        .map(|row| row.seq)
        .collect();
    let expected: Vec<Option<u64>> = (1..=2 * EACH as u64).map(Some).collect();
    assert_eq!(seqs, expected, "1, 2, 3… with no number twice or missing");
    // Another session's checkpoints start at 1.
    let other = new_session(&*a, &alice());
    assert_eq!(checkpoint(&*b, &alice(), &other, "x").seq, Some(1));
}

fn a_checkpoint_lives_while_a_retryable_run_depends_on_it(db: &Db) {
    let store = db.open();
    let scope = alice();
    let s = new_session(&*store, &scope);
    let old = checkpoint(&*store, &scope, &s, "h1");
    let newest = checkpoint(&*store, &scope, &s, "h2");
    assert_eq!((old.seq, newest.seq), (Some(1), Some(2)));
    assert!(old.id.as_str().starts_with("art_"));
    assert_eq!(
        store.retained_by(&scope, &newest).unwrap(),
        None,
        "no run yet"
    );

    // The newest checkpoint of a session whose last run failed is what a retry resumes from.
    let run = store.create_run(&scope, &s, "scripted/demo").unwrap();
    for status in [RunStatus::Starting, RunStatus::Running, RunStatus::Failed] {
        store.transition_run(&scope, &run.id, status, None).unwrap();
    }
    let err = store.delete_artifact(&scope, &newest.id).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "it is the newest checkpoint of session {s}, whose run {} is failed and may be retried",
            run.id
        )),
        "{err}"
    );
    assert_eq!(store.retained_by(&scope, &old).unwrap(), None);

    // An attempt resuming from an older checkpoint keeps that one too.
    let run2 = store.create_run(&scope, &s, "scripted/demo").unwrap();
    store
        .transition_run(&scope, &run2.id, RunStatus::Starting, None)
        .unwrap();
    let attempt = store.start_attempt(&scope, &run2, "gateway", 1).unwrap();
    store
        .set_attempt_checkpoint(&scope, &attempt, &old.id)
        .unwrap();
    match store.delete_artifact(&scope, &old.id) {
        Err(Error::Retained { reason, .. }) => assert_eq!(
            reason,
            format!("run {} resumes from it and may be retried", run2.id)
        ),
        other => panic!("the checkpoint was not kept: {other:?}"),
    }
    let stranger = Scope::new("usr_mallory", "ten_b");
    assert!(matches!(
        store.set_attempt_checkpoint(&stranger, &attempt, &old.id),
        Err(Error::NotFound {
            what: "artifact",
            ..
        })
    ));
    // Once the run succeeds, nothing depends on either.
    for status in [RunStatus::Running, RunStatus::Succeeded] {
        store
            .transition_run(&scope, &run2.id, status, None)
            .unwrap();
    }
    store.delete_artifact(&scope, &old.id).unwrap();
    store.delete_artifact(&scope, &newest.id).unwrap();
    assert!(!store.blob_referenced("h1").unwrap());
    assert!(matches!(
        store.artifact(&scope, &old.id),
        Err(Error::NotFound {
            what: "artifact",
            ..
        })
    ));
}

fn logs_expire_and_a_blob_another_row_names_stays_referenced(db: &Db) {
    let store = db.open();
    let (ana, bob) = (alice(), Scope::new("usr_bob", "ten_b"));
    let (sa, sb) = (new_session(&*store, &ana), new_session(&*store, &bob));
    let log = store
        .create_artifact(
            &ana,
            &new(&sa, ArtifactRole::Log, Retention::Transient, "same"),
        )
        .unwrap();
    assert_eq!(log.seq, None, "only checkpoints are numbered");
    assert_eq!(log.scope, ana);
    assert_eq!(log.meta, serde_json::json!({ "mode": "plain" }));
    store
        .create_artifact(
            &bob,
            &new(&sb, ArtifactRole::Log, Retention::Transient, "same"),
        )
        .unwrap();
    // Another scope neither reads, lists, changes nor deletes it.
    assert!(matches!(
        store.artifact(&bob, &log.id),
        Err(Error::NotFound { .. })
    ));
    assert!(
        store
            .artifacts(&bob, &sa, ArtifactRole::Log)
            .unwrap()
            .is_empty()
    );
    assert!(matches!(
        store.set_artifact_meta(&bob, &log.id, &serde_json::json!({})),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        store.delete_artifact(&bob, &log.id),
        Err(Error::NotFound { .. })
    ));
    store
        .set_artifact_meta(&ana, &log.id, &serde_json::json!({ "accepted": ["a.rs"] }))
        .unwrap();
    let log = store.artifact(&ana, &log.id).unwrap();
    assert_eq!(log.meta, serde_json::json!({ "accepted": ["a.rs"] }));

    assert!(store.expire_artifacts(&ana, 999).unwrap().is_empty());
    assert_eq!(store.expire_artifacts(&ana, 1_000).unwrap(), vec![log]);
    assert!(
        store
            .artifacts(&ana, &sa, ArtifactRole::Log)
            .unwrap()
            .is_empty()
    );
    // Bob's row for the same content is untouched: the blob must stay.
    assert!(store.blob_referenced("same").unwrap());
    assert_eq!(
        store.artifacts(&bob, &sb, ArtifactRole::Log).unwrap().len(),
        1
    );
    assert!(!store.blob_referenced("never stored").unwrap());
}
