//! A context that outgrows its share of the model's window is compacted once, before the
//! request that would cross it, and the turn goes on from the summary; `POST .../compact`
//! does the same on request; `[gateway] compact_at` is checked at start.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::api::{CompactResult, RunStatus};
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::{FakeResponse, openai_sse};

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

/// A model whose window is small: the threshold is 0.8 × 8192 = 6553 tokens.
const SMALL_WINDOW: &str = "[providers.http.models.\"m\"]\ncontext_window = 8192\n";

fn answer(text: &str, prompt_tokens: u64) -> FakeResponse {
    FakeResponse::sse(
        [
            openai_sse::text_chunks(&[text]),
            openai_sse::finish("stop"),
            openai_sse::usage(prompt_tokens, 10),
            openai_sse::done(),
        ]
        .concat(),
    )
}

fn body(request: &skiff_test_support::RecordedRequest) -> serde_json::Value {
    serde_json::from_slice(&request.body).unwrap()
}

/// The text of every message of a chat-completions request after the system prompt.
fn texts(request: &serde_json::Value) -> Vec<String> {
    request["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] != "system")
        .map(|m| m["content"].to_string())
        .collect()
}

fn compactions(entries: &[skiff_protocol::transcript::TranscriptEntry]) -> Vec<&EntryBody> {
    entries
        .iter()
        .map(|e| &e.body)
        .filter(|b| matches!(b, EntryBody::Compaction { .. }))
        .collect()
}

#[tokio::test]
async fn a_context_past_its_window_share_is_compacted_once_and_the_turn_goes_on_from_the_summary() {
    let gw = TestGateway::configured(
        DONE,
        SMALL_WINDOW,
        Some(vec![
            // Turn 1: the provider says the prompt took 6600 tokens, past the threshold.
            answer("ANSWER-ONE", 6600),
            // Turn 2: the compaction call, then the real answer.
            answer("SUMMARY-TEXT: the user asked for FIRST-REQUEST", 0),
            answer("ANSWER-TWO", 900),
            // `skiff session compact`.
            answer("SECOND-SUMMARY", 0),
        ]),
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "FIRST-REQUEST"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    let first = gw.client.follow_until_run_end(&id, 0).await;
    assert!(matches!(
        first.last().map(|e| &e.kind),
        Some(EventKind::RunStatus {
            status: RunStatus::Succeeded,
            ..
        })
    ));
    let after_first = gw.client.session(&id).await.unwrap();
    assert!(
        compactions(&after_first.transcript).is_empty(),
        "a context under the threshold was compacted"
    );

    gw.client.send_message(&id, "SECOND-REQUEST").await.unwrap();
    let cursor = first.last().unwrap().cursor;
    let second = gw.client.follow_until_run_end(&id, cursor).await;
    assert!(
        matches!(
            second.last().map(|e| &e.kind),
            Some(EventKind::RunStatus {
                status: RunStatus::Succeeded,
                ..
            })
        ),
        "{second:?}"
    );

    let detail = gw.client.session(&id).await.unwrap();
    let found = compactions(&detail.transcript);
    assert_eq!(found.len(), 1, "{:#?}", detail.transcript);
    let EntryBody::Compaction {
        summary,
        request,
        tokens_before,
        ..
    } = found[0]
    else {
        unreachable!()
    };
    assert!(summary.contains("SUMMARY-TEXT"), "{summary}");
    assert_eq!(request.as_deref(), Some("SECOND-REQUEST"));
    assert!(*tokens_before > 6553, "{tokens_before}");
    // The earlier entries stay in the transcript.
    let all = serde_json::to_string(&detail.transcript).unwrap();
    assert!(all.contains("ANSWER-ONE") && all.contains("FIRST-REQUEST"));

    let requests = gw.provider.as_ref().unwrap().requests();
    assert_eq!(requests.len(), 3, "one answer, one compaction, one answer");
    let compaction = body(&requests[1]);
    assert!(
        compaction["tools"]
            .as_array()
            .is_none_or(|tools| tools.is_empty()),
        "the compaction call offers no tools: {compaction}"
    );
    let asked = texts(&compaction).join("\n");
    assert!(
        asked.contains("FIRST-REQUEST") && asked.contains("ANSWER-ONE"),
        "the compaction call reads the conversation: {asked}"
    );
    let next = texts(&body(&requests[2]));
    assert!(
        next[0].contains("SUMMARY-TEXT") && next[0].contains("SECOND-REQUEST"),
        "the next request starts with the summary and the current request: {next:?}"
    );
    assert!(
        next.iter()
            .all(|m| !m.contains("ANSWER-ONE") && !m.contains("FIRST-REQUEST\"")),
        "the old messages are gone from the context: {next:?}"
    );

    // Asked for: the same step between turns, at the leaf.
    let (status, json) = gw
        .client
        .raw(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/compact"),
            "{}",
        )
        .await;
    assert_eq!(status, 200, "{json}");
    let done: CompactResult = serde_json::from_value(json).unwrap();
    assert!(done.entries >= 2, "{done:?}");
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.transcript.last(), Some(&done.entry));
    assert_eq!(compactions(&detail.transcript).len(), 2);
    let requests = gw.provider.as_ref().unwrap().requests();
    let asked = texts(&body(&requests[3])).join("\n");
    assert!(
        asked.contains("SUMMARY-TEXT") && asked.contains("ANSWER-TWO"),
        "a second compaction summarises the first summary and what came after: {asked}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn compacting_a_session_while_a_turn_runs_is_refused_as_busy_and_writes_nothing() {
    let gw = TestGateway::configured(DONE, SMALL_WINDOW, Some(vec![FakeResponse::stall()])).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "go"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    // The stalled answer is being given: the turn is inside its model call.
    gw.provider.as_ref().unwrap().wait_for_requests(1).await;
    let before = gw.client.session(&id).await.unwrap();
    let (status, json) = gw
        .client
        .raw(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/compact"),
            "{}",
        )
        .await;
    assert_eq!(status, 409, "{json}");
    assert_eq!(json["code"], "session_busy");
    let after = gw.client.session(&id).await.unwrap();
    assert_eq!(after.transcript, before.transcript);
    gw.client.cancel(&id).await.unwrap();
    gw.client.follow_until_run_end(&id, 0).await;
    gw.shutdown().await;
}

#[tokio::test]
async fn a_compact_at_outside_its_range_stops_the_gateway_naming_the_key() {
    for bad in ["0.99", "0.05", "1"] {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("skiff.toml");
        std::fs::write(&config, format!("[gateway]\ncompact_at = {bad}\n")).unwrap();
        let err = skiff_gateway::start(skiff_gateway::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: Some(config),
        })
        .await
        .err()
        .expect("a compact_at out of range must not start a gateway");
        let text = err.to_string();
        assert!(
            text.contains("gateway.compact_at") && text.contains("0.1") && text.contains("0.95"),
            "{text}"
        );
    }
}
