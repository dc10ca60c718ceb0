//! `--reasoning` through the API to an Anthropic model, and the model's thinking kept and sent
//! back, with a fake Anthropic server.

use crate::harness::TestGateway;
use serde_json::Value;
use skiff_protocol::api::{CreateSessionRequest, SendMessageRequest};
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{Reasoning, ReasoningEffort};
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::anthropic_sse::{
    message_delta, message_start, message_stop, redacted_thinking_block, text_block,
    thinking_block, tool_use_block,
};
use skiff_test_support::{FakeProvider, FakeResponse};

const THOUGHT: [&str; 2] = ["Read \"a.txt\" — ", "then answer.\n"];
const SIGNATURE: &str = "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+Ggx/Bdjrk=";
const REDACTED: &str = "EmwKAhgBEgy3va3pzix/LafPsn4a==";

fn thinks_then_reads() -> FakeResponse {
    FakeResponse::sse(
        [
            message_start(30),
            thinking_block(0, &THOUGHT, SIGNATURE),
            redacted_thinking_block(1, REDACTED),
            tool_use_block(2, "toolu_1", "read", r#"{"path":"a.txt"}"#, 2),
            message_delta("tool_use", 40),
            message_stop(),
        ]
        .concat(),
    )
}

fn answers(text: &str) -> FakeResponse {
    FakeResponse::sse(
        [
            message_start(30),
            text_block(0, &[text]),
            message_delta("end_turn", 5),
            message_stop(),
        ]
        .concat(),
    )
}

fn bodies(fake: &FakeProvider) -> Vec<String> {
    fake.requests()
        .iter()
        .map(|r| String::from_utf8(r.body.clone()).unwrap())
        .collect()
}

fn budget(body: &str) -> Value {
    let body: Value = serde_json::from_str(body).unwrap();
    body["thinking"]["budget_tokens"].clone()
}

#[tokio::test]
async fn reasoning_chosen_for_a_session_reaches_the_model_and_its_thinking_goes_back_verbatim() {
    let fake = FakeProvider::start(vec![
        thinks_then_reads(),
        answers("It says a."),
        answers("Still a."),
        answers("Yes."),
    ])
    .await;
    let config = format!(
        "[providers.claude]\napi = \"anthropic-messages\"\nbase_url = \"{}\"\n",
        fake.base_url()
    );
    let gw = TestGateway::configured("[[turns]]\ntext = \"ok\"\n", &config, None).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&CreateSessionRequest {
            prompt: "what is in a.txt?".into(),
            workspace: ws.display().to_string(),
            repo: None,
            model: Some("claude/claude-sonnet-4-5".into()),
            profile: None,
            reasoning: Some(ReasoningEffort::High),
            attempts: None,
            approval: None,
            agent: None,
        })
        .await
        .unwrap();
    let id = started.session.id.clone();
    assert_eq!(started.session.reasoning, Some(ReasoningEffort::High));
    let events = gw.client.follow_until_run_end(&id, 0).await;

    // Thinking streamed live, in the pieces the model sent.
    let deltas: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ReasoningDelta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(deltas, THOUGHT);

    // The first request asked for a high budget; the second sent the blocks back first in the
    // assistant message, as the stream carried them.
    let sent = bodies(&fake);
    assert_eq!(budget(&sent[0]), 24_576);
    let quoted = |s: &str| Value::from(s).to_string();
    let replayed = format!(
        r#"{{"content":[{{"signature":{},"thinking":{},"type":"thinking"}},{{"data":{},"type":"redacted_thinking"}},{{"id":"toolu_1""#,
        quoted(SIGNATURE),
        quoted(&THOUGHT.concat()),
        quoted(REDACTED)
    );
    assert!(sent[1].contains(&replayed), "{}", sent[1]);
    assert_eq!(budget(&sent[1]), 24_576);

    // The transcript keeps the blocks.
    let detail = gw.client.session(&id).await.unwrap();
    let kept = detail.transcript.iter().find_map(|e| match &e.body {
        EntryBody::AssistantMessage { reasoning, .. } if !reasoning.is_empty() => {
            Some(reasoning.clone())
        }
        _ => None,
    });
    assert_eq!(
        kept,
        Some(vec![
            Reasoning::Thinking {
                thinking: THOUGHT.concat(),
                signature: SIGNATURE.into(),
            },
            Reasoning::RedactedThinking {
                data: REDACTED.into()
            },
        ])
    );

    // `send --reasoning low` changes the session's choice from that turn on.
    let after = events.last().unwrap().cursor;
    let body = SendMessageRequest {
        prompt: "again".into(),
        profile: None,
        reasoning: Some(ReasoningEffort::Low),
        approval: None,
        agent: None,
    };
    let started = gw.client.send(&id, &body).await.unwrap();
    assert_eq!(started.session.reasoning, Some(ReasoningEffort::Low));
    let events = gw.client.follow_until_run_end(&id, after).await;
    let after = events.last().unwrap().cursor;
    gw.client.send_message(&id, "and again").await.unwrap();
    gw.client.follow_until_run_end(&id, after).await;
    let sent = bodies(&fake);
    assert_eq!(budget(&sent[2]), 2048);
    assert_eq!(
        budget(&sent[3]),
        2048,
        "a send without --reasoning keeps it"
    );
    // Thinking from the earlier turn still goes back unchanged.
    assert!(sent[3].contains(&replayed), "{}", sent[3]);
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.session.reasoning, Some(ReasoningEffort::Low));
    gw.shutdown().await;
}

#[tokio::test]
async fn an_unknown_reasoning_effort_is_refused_naming_the_choices() {
    let gw = TestGateway::start("[[turns]]\ntext = \"ok\"\n").await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let body = serde_json::json!({
        "prompt": "hi",
        "workspace": ws.display().to_string(),
        "reasoning": "extreme",
    });
    let (status, answer) = gw
        .client
        .raw(reqwest::Method::POST, "/v1/sessions", &body.to_string())
        .await;
    assert_eq!(status, 400, "{answer}");
    let message = answer.to_string();
    assert!(
        message.contains("extreme") && message.contains("medium"),
        "{message}"
    );
    gw.shutdown().await;
}
