//! A gateway stopped and started again inside one process, on the same state dir.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::EventKind;
use skiff_test_support::{FakeResponse, openai_sse};

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

fn ended_with(events: &[skiff_protocol::event::SessionEvent]) -> Option<RunStatus> {
    events.iter().rev().find_map(|e| match &e.kind {
        EventKind::RunStatus { status, .. } => Some(*status),
        _ => None,
    })
}

/// Shutdown returns only once nothing of the old gateway holds its state dir: a turn in
/// flight is cancelled and settled, and a new gateway starts on the same state dir at once
/// (no "another gateway is using the state dir") and carries on with the session.
#[tokio::test]
async fn a_gateway_shut_down_mid_turn_starts_again_on_its_state_dir_in_the_same_process() {
    let gw = TestGateway::with_provider(
        "[[turns]]\ntext = \"ok\"\n",
        vec![FakeResponse::stall(), answer("again")],
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "first"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    // The turn is inside its (stalled) model call when the gateway stops.
    gw.provider.as_ref().unwrap().wait_for_requests(1).await;

    let gw = gw.restart().await;

    let first = gw.client.follow_until_run_end(&id, 0).await;
    assert_eq!(
        ended_with(&first),
        Some(RunStatus::Cancelled),
        "the turn the shutdown stopped was settled by the gateway that ran it"
    );
    let next = gw.client.send_message(&id, "second").await.unwrap();
    let cursor = first.last().unwrap().cursor;
    let events = gw.client.follow_until_run_end(&id, cursor).await;
    assert_eq!(ended_with(&events), Some(RunStatus::Succeeded));
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.runs.len(), 2);
    assert_eq!(detail.runs[1].id, next.run.id);
    gw.shutdown().await;
}
