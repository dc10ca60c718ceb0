//! A turn that runs past its time limit is stopped and says why.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::EventKind;
use skiff_test_support::{FakeResponse, openai_sse};

#[tokio::test]
async fn a_turn_past_the_gateways_turn_timeout_ends_timed_out_and_the_session_goes_on() {
    let answer = FakeResponse::sse(
        [
            openai_sse::text_chunks(&["done"]),
            openai_sse::finish("stop"),
            openai_sse::done(),
        ]
        .concat(),
    );
    let gw = TestGateway::configured(
        "",
        "[gateway]\nturn_timeout = \"400ms\"\n",
        Some(vec![FakeResponse::stall(), answer]),
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "think forever"))
        .await
        .unwrap();
    let id = started.session.id;
    let events = gw.client.follow_until_run_end(&id, 0).await;
    let end = events.last().unwrap();
    let EventKind::RunStatus { status, error } = &end.kind else {
        panic!("the stream ended with {end:?}");
    };
    assert_eq!(*status, RunStatus::TimedOut);
    let error = error.as_deref().unwrap_or_default();
    assert!(
        error.contains("400ms") && error.contains("gateway.turn_timeout"),
        "the reason names the limit and the setting: {error}"
    );
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.runs[0].status, RunStatus::TimedOut);
    assert_eq!(detail.runs[0].error.as_deref(), Some(error));

    // The session is free again: the next turn runs (and finishes in time).
    gw.client.send_message(&id, "now answer").await.unwrap();
    let events = gw.client.follow_until_run_end(&id, end.cursor).await;
    assert!(matches!(
        events.last().unwrap().kind,
        EventKind::RunStatus {
            status: RunStatus::Succeeded,
            ..
        }
    ));
    gw.shutdown().await;
}

#[tokio::test]
async fn a_turn_timeout_that_is_not_a_duration_stops_the_gateway_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(&config, "[gateway]\nturn_timeout = \"soon\"\n").unwrap();
    let err = skiff_gateway::start(skiff_gateway::Options {
        state_dir: dir.path().join("state"),
        listen: "127.0.0.1:0".into(),
        config: Some(config),
    })
    .await
    .err()
    .expect("a bad duration must not start a gateway");
    let text = err.to_string();
    assert!(
        text.contains("gateway.turn_timeout") && text.contains("soon"),
        "{text}"
    );
}
