//! What the gateway admits and what it refuses, and that a refusal changes nothing.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::EventKind;
use skiff_test_support::{FakeResponse, TempGitRepo, openai_sse};

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

fn answer(text: &str) -> FakeResponse {
    FakeResponse::sse(
        [
            openai_sse::text_chunks(&[text]),
            openai_sse::finish("stop"),
            openai_sse::done(),
        ]
        .concat(),
    )
}

#[tokio::test]
async fn a_message_while_a_turn_runs_is_refused_as_busy_and_changes_nothing() {
    let gw = TestGateway::with_provider(DONE, vec![FakeResponse::stall(), answer("second")]).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "first"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    // The stalled answer is being given: the turn is inside its model call, so the cancel
    // below ends this turn and not the next one's request.
    gw.provider.as_ref().unwrap().wait_for_requests(1).await;
    let before = gw.client.session(&id).await.unwrap();

    let refused = gw.client.send_message(&id, "second").await.unwrap_err();
    assert_eq!(refused.status, 409);
    assert_eq!(refused.error.code, "session_busy");
    assert!(
        refused.error.message.contains(started.run.id.as_str()),
        "the refusal names the run that holds the session: {}",
        refused.error.message
    );
    let after = gw.client.session(&id).await.unwrap();
    assert_eq!(
        after.transcript, before.transcript,
        "a refused message left an entry"
    );
    assert_eq!(after.runs, before.runs, "a refused message made a run");

    gw.client.cancel(&id).await.unwrap();
    let ended = gw.client.follow_until_run_end(&id, 0).await;
    assert!(matches!(
        ended.last().unwrap().kind,
        EventKind::RunStatus {
            status: RunStatus::Cancelled,
            ..
        }
    ));
    let next = gw.client.send_message(&id, "second").await.unwrap();
    let cursor = ended.last().unwrap().cursor;
    let events = gw.client.follow_until_run_end(&id, cursor).await;
    assert!(matches!(
        events.last().unwrap().kind,
        EventKind::RunStatus {
            status: RunStatus::Succeeded,
            ..
        }
    ));
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.runs.len(), 2);
    assert_eq!(detail.runs[1].id, next.run.id);
    let asked = gw.provider.as_ref().unwrap().requests().len();
    assert_eq!(asked, 2, "the refused message reached the model");
    gw.shutdown().await;
}

#[tokio::test]
async fn an_unknown_model_or_provider_is_refused_before_anything_is_created() {
    let gw = TestGateway::start(DONE).await;
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    for (model, says) in [
        ("nope/gpt-9", "unknown provider"),
        ("no-slash", "provider/model"),
    ] {
        let refused = gw
            .client
            .create_session(&session_request(repo.path(), model, "hi"))
            .await
            .unwrap_err();
        assert_eq!(refused.status, 422, "{model}: {refused:?}");
        assert!(
            refused.error.message.contains(model) && refused.error.message.contains(says),
            "{model}: {}",
            refused.error.message
        );
    }
    assert!(gw.client.sessions().await.unwrap().sessions.is_empty());
    assert_eq!(
        repo.git(&["branch", "--format=%(refname:short)"]),
        "main\n",
        "a refused session made a branch"
    );
    assert_eq!(
        std::fs::read_dir(gw.state_dir.join("worktrees"))
            .unwrap()
            .count(),
        0,
        "a refused session made a worktree"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn an_empty_prompt_or_a_missing_workspace_is_named_and_nothing_is_created() {
    let gw = TestGateway::start(DONE).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let empty = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "  \n"))
        .await
        .unwrap_err();
    assert_eq!(empty.status, 400);
    assert!(empty.error.message.contains("prompt is empty"), "{empty:?}");
    let missing = gw
        .client
        .create_session(&session_request(
            std::path::Path::new("/nonexistent/skiff-ws"),
            "fake/x",
            "hi",
        ))
        .await
        .unwrap_err();
    assert!(
        missing
            .error
            .message
            .contains("/nonexistent/skiff-ws does not exist"),
        "{missing:?}"
    );
    assert!(gw.client.sessions().await.unwrap().sessions.is_empty());

    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "hi"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let empty = gw
        .client
        .send_message(&started.session.id, "")
        .await
        .unwrap_err();
    assert_eq!(empty.status, 400);
    assert_eq!(
        gw.client
            .session(&started.session.id)
            .await
            .unwrap()
            .runs
            .len(),
        1
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_malformed_body_names_the_field_and_an_unknown_session_is_not_found() {
    let gw = TestGateway::start(DONE).await;
    let (status, body) = gw
        .client
        .raw(
            reqwest::Method::POST,
            "/v1/sessions",
            r#"{"prompt": "hi", "workspace": "/tmp", "modle": "fake/x"}"#,
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("modle"),
        "the unknown field is named: {body}"
    );
    let (status, body) = gw
        .client
        .raw(reqwest::Method::POST, "/v1/sessions", "{not json")
        .await;
    assert_eq!(status, 400, "{body}");

    let unknown = skiff_protocol::SessionId::from_suffix("doesnotexist");
    let refused = gw.client.session(&unknown).await.unwrap_err();
    assert_eq!(
        (refused.status, refused.error.code.as_str()),
        (404, "not_found")
    );
    let refused = gw.client.send_message(&unknown, "hi").await.unwrap_err();
    assert_eq!(
        (refused.status, refused.error.code.as_str()),
        (404, "not_found")
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn requests_without_a_valid_token_are_refused() {
    let gw = TestGateway::start(DONE).await;
    for token in ["", "skf_wrong"] {
        let refused = gw.client.with_token(token).sessions().await.unwrap_err();
        assert_eq!(
            (refused.status, refused.error.code.as_str()),
            (401, "unauthorized")
        );
    }
    assert!(
        gw.client.sessions().await.is_ok(),
        "the real token is accepted"
    );
    gw.shutdown().await;
}

/// A turn whose message cannot be recorded ends failed instead of staying open: left open, it
/// would refuse every later message to the session as "busy".
#[tokio::test]
async fn a_turn_whose_message_cannot_be_recorded_ends_failed_and_the_session_takes_the_next() {
    let gw = TestGateway::start(DONE).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "first"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    gw.client.follow_until_run_end(&id, 0).await;
    let db = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    db.execute_batch(
        "CREATE TRIGGER no_entries BEFORE INSERT ON entries \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END;",
    )
    .unwrap();
    let refused = gw.client.send_message(&id, "second").await.unwrap_err();
    assert_eq!(refused.status, 500, "{refused:?}");
    assert!(
        !refused.error.message.contains("injected"),
        "the database's own text reached the client: {refused:?}"
    );
    let runs = gw.client.session(&id).await.unwrap().runs;
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1].status, RunStatus::Failed, "{runs:?}");

    db.execute_batch("DROP TRIGGER no_entries").unwrap();
    gw.client
        .send_message(&id, "third")
        .await
        .expect("the session takes the next message");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_fan_out_with_a_bad_count_or_profile_is_refused_and_creates_nothing() {
    let gw = TestGateway::start(DONE).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let body = |attempts: u32, profile: Option<&str>| {
        let mut req = session_request(&ws, "fake/x", "try it");
        req.attempts = Some(attempts);
        req.profile = profile.map(str::to_owned);
        serde_json::to_string(&req).unwrap()
    };
    for (attempts, profile, says) in [
        (1, Some("local"), "2 to 8 attempts"),
        (9, Some("local"), "2 to 8 attempts"),
        (3, None, "name a worker profile"),
        (3, Some("nope"), "no worker profile `nope`"),
    ] {
        let (status, error) = gw
            .client
            .raw(
                reqwest::Method::POST,
                "/v1/sessions",
                &body(attempts, profile),
            )
            .await;
        assert_eq!(status, 400, "{error}");
        assert!(
            error["message"].as_str().unwrap().contains(says),
            "{attempts} {profile:?}: {error}"
        );
    }
    assert!(gw.client.sessions().await.unwrap().sessions.is_empty());

    // A session of no group has nothing to pick from; a group that does not exist is not found.
    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "alone"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let pick = format!("/v1/sessions/{}/pick", started.session.id);
    let (status, error) = gw.client.raw(reqwest::Method::POST, &pick, "{}").await;
    assert_eq!(status, 400, "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("is not an attempt of a fan-out group"),
        "{error}"
    );
    let (status, _) = gw
        .client
        .raw(reqwest::Method::GET, "/v1/groups/grp_missing", "")
        .await;
    assert_eq!(status, 404);
    let (status, _) = gw
        .client
        .raw(reqwest::Method::GET, "/v1/groups/ses_nope", "")
        .await;
    assert_eq!(status, 400);
    gw.shutdown().await;
}

/// A message that would dispatch the session (`send --profile`) but is refused — the session
/// busy, or the turn's choices not recorded — claims no worker slot: the session stays on the
/// gateway, the slots are as they were, no run is left behind and no dispatch is audited.
#[tokio::test]
async fn a_refused_dispatching_message_leaves_the_placement_and_the_slots_as_they_were() {
    let gw = TestGateway::configured(
        DONE,
        "[profiles.local]\nprovider = \"local\"\n",
        Some(vec![FakeResponse::stall()]),
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "first"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    gw.provider.as_ref().unwrap().wait_for_requests(1).await;
    let store = skiff_store::Store::open(&gw.state_dir.join("skiff.db")).unwrap();
    let slots = store.worker_slots().unwrap();
    let dispatch = |approval| skiff_protocol::api::SendMessageRequest {
        prompt: "on a box now".into(),
        profile: Some("local".into()),
        reasoning: None,
        approval,
        agent: None,
    };
    let as_it_was = |detail: &skiff_protocol::api::SessionDetail, runs: usize| {
        assert_eq!(detail.session.placement, "local", "{:?}", detail.session);
        assert!(detail.session.worker.is_none(), "{:?}", detail.session);
        assert_eq!(detail.runs.len(), runs, "{:?}", detail.runs);
        assert_eq!(store.worker_slots().unwrap(), slots);
        let dispatches = store
            .audit_rows()
            .unwrap()
            .into_iter()
            .filter(|r| r.action == "session.dispatch")
            .count();
        assert_eq!(dispatches, 0);
    };

    let busy = gw.client.send(&id, &dispatch(None)).await.unwrap_err();
    assert_eq!(busy.status, 409, "{busy:?}");
    assert_eq!(busy.error.code, "session_busy");
    as_it_was(&gw.client.session(&id).await.unwrap(), 1);
    gw.client.cancel(&id).await.unwrap();
    gw.client.follow_until_run_end(&id, 0).await;

    // The turn's approval policy cannot be recorded: the turn is refused whole.
    let db = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    db.execute_batch(
        "CREATE TRIGGER refuse_approval BEFORE UPDATE OF approval ON sessions
         BEGIN SELECT RAISE(ABORT, 'injected: the approval policy cannot be written'); END",
    )
    .unwrap();
    let policy = skiff_protocol::approval::ApprovalPolicy::OnRequest;
    let refused = gw
        .client
        .send(&id, &dispatch(Some(policy)))
        .await
        .unwrap_err();
    assert_eq!(refused.status, 500, "{refused:?}");
    let detail = gw.client.session(&id).await.unwrap();
    as_it_was(&detail, 1);
    assert_eq!(detail.session.approval, None);
    gw.shutdown().await;
}
