//! Slack-compatible chat ingress against a fake Slack Web API that speaks Slack's wire
//! format: signed events start and continue one session per thread and the answers come
//! back to the thread; a bad signature, a stale timestamp, a replayed event id, an unbound
//! channel and an unmapped user are refused; without `[ingress.slack]` the route does not
//! exist.

use crate::harness::TestGateway;
use skiff_test_support::fake_slack::{FakeSlack, sign};

const SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
const BOT_TOKEN: &str = "xoxb-test-token";

const SCRIPT: &str = r#"
[[turns]]
text = "First answer."

[[turns]]
text = "Second answer."
"#;

struct Setup {
    gw: TestGateway,
    slack: FakeSlack,
    http: reqwest::Client,
    _repo: tempfile::TempDir,
}

async fn setup() -> Setup {
    let slack = FakeSlack::start(BOT_TOKEN).await;
    let repo = tempfile::tempdir().unwrap();
    std::fs::write(repo.path().join("README.md"), "hello\n").unwrap();
    let config = format!(
        r#"
[ingress.slack]
signing_secret = "vault:slack-signing"
bot_token = "vault:slack-bot"
api_base = "{}"

[[ingress.slack.bindings]]
channel = "C0BOUND"
repository = "{}"
model = "fake/x"
users = {{ "U0ALICE" = "alice@example.com" }}
"#,
        slack.api_base(),
        repo.path().display()
    );
    let gw = TestGateway::configured(SCRIPT, &config, None).await;
    for (name, value) in [("slack-signing", SECRET), ("slack-bot", BOT_TOKEN)] {
        let (status, body) = gw
            .client
            .raw(
                reqwest::Method::PUT,
                &format!("/v1/secrets/{name}"),
                &serde_json::json!({ "value": value }).to_string(),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    Setup {
        gw,
        slack,
        http: reqwest::Client::new(),
        _repo: repo,
    }
}

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn message(
    event_id: &str,
    channel: &str,
    user: &str,
    ts: &str,
    thread_ts: Option<&str>,
    text: &str,
) -> String {
    let mut event = serde_json::json!({
        "type": "app_mention",
        "user": user,
        "text": text,
        "ts": ts,
        "channel": channel,
        "event_ts": ts,
    });
    if let Some(thread) = thread_ts {
        event["thread_ts"] = thread.into();
    }
    serde_json::json!({
        "token": "unused-verification-token",
        "team_id": "T0TEAM",
        "api_app_id": "A0APP",
        "event": event,
        "type": "event_callback",
        "event_id": event_id,
        "event_time": now_s(),
    })
    .to_string()
}

impl Setup {
    /// Posts `body` as Slack would, signed with `secret` at `timestamp`.
    async fn post(&self, body: &str, secret: &str, timestamp: i64) -> (u16, serde_json::Value) {
        let ts = timestamp.to_string();
        let resp = self
            .http
            .post(format!("{}/v1/ingress/slack/events", self.gw.client.url))
            .header("content-type", "application/json")
            .header("x-slack-request-timestamp", &ts)
            .header("x-slack-signature", sign(secret, &ts, body.as_bytes()))
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or_default())
    }

    fn store(&self) -> skiff_store::Store {
        skiff_store::Store::open(&self.gw.state_dir.join("skiff.db")).unwrap()
    }

    fn session_count(&self) -> i64 {
        let db = rusqlite::Connection::open(self.gw.state_dir.join("skiff.db")).unwrap();
        db.query_row("SELECT COUNT(*) FROM sessions", [], |r| r.get(0))
            .unwrap()
    }
}

#[tokio::test]
async fn a_thread_starts_a_session_continues_it_and_gets_the_answers() {
    let s = setup().await;
    // Slack's handshake when the events URL is set.
    let challenge = serde_json::json!({
        "token": "unused", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
        "type": "url_verification",
    })
    .to_string();
    let (status, body) = s.post(&challenge, SECRET, now_s()).await;
    assert_eq!(status, 200);
    assert_eq!(
        body["challenge"],
        "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"
    );

    let first = message(
        "Ev0001",
        "C0BOUND",
        "U0ALICE",
        "1700000001.000100",
        None,
        "<@U0BOT> what is here?",
    );
    let (status, body) = s.post(&first, SECRET, now_s()).await;
    assert_eq!(status, 200, "{body}");
    s.slack.wait_for_requests(2).await;
    let posted = s.slack.posted();
    assert_eq!(posted.len(), 2, "{posted:?}");
    assert!(
        posted
            .iter()
            .all(|p| p.channel == "C0BOUND" && p.thread_ts.as_deref() == Some("1700000001.000100"))
    );
    assert!(posted[0].text.contains("ses_"), "{:?}", posted[0]);
    assert_eq!(posted[1].text, "First answer.");

    // The session is Alice's, on the bound repository, and its first message is the
    // prompt without the mention.
    let store = s.store();
    let (scope, id) = store
        .ingress_thread("C0BOUND", "1700000001.000100")
        .unwrap()
        .expect("the thread has a session");
    assert_eq!(scope.owner_id, "alice@example.com");
    let transcript = store.transcript(&scope, &id).unwrap();
    assert!(transcript.iter().any(|e| matches!(&e.body,
        skiff_protocol::transcript::EntryBody::UserMessage { text } if text == "what is here?")));

    // A reply in the thread continues the same session.
    let reply = message(
        "Ev0002",
        "C0BOUND",
        "U0ALICE",
        "1700000002.000200",
        Some("1700000001.000100"),
        "and then?",
    );
    let (status, _) = s.post(&reply, SECRET, now_s()).await;
    assert_eq!(status, 200);
    s.slack.wait_for_requests(4).await;
    let posted = s.slack.posted();
    assert_eq!(posted[3].text, "Second answer.");
    assert_eq!(posted[3].thread_ts.as_deref(), Some("1700000001.000100"));
    assert_eq!(store.runs(&scope, &id).unwrap().len(), 2);
    assert_eq!(s.session_count(), 1, "a reply started a second session");
    // The bot token went only to Slack, as a bearer.
    assert!(
        s.slack
            .requests()
            .iter()
            .all(|r| r.header("authorization") == Some(&format!("Bearer {BOT_TOKEN}")))
    );
    s.gw.shutdown().await;
}

#[tokio::test]
async fn bad_stale_replayed_unbound_and_unmapped_requests_are_refused() {
    let s = setup().await;
    let body = message(
        "Ev1000",
        "C0BOUND",
        "U0ALICE",
        "1700000010.000100",
        None,
        "hello",
    );

    let (status, refused) = s.post(&body, "not-the-secret", now_s()).await;
    assert_eq!(status, 401, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("signature"));

    // A signature made for another body.
    let ts = now_s().to_string();
    let resp = s
        .http
        .post(format!("{}/v1/ingress/slack/events", s.gw.client.url))
        .header("x-slack-request-timestamp", &ts)
        .header("x-slack-signature", sign(SECRET, &ts, b"{}"))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);

    let (status, refused) = s.post(&body, SECRET, now_s() - 6 * 60).await;
    assert_eq!(status, 401, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("stale"));

    // Accepted once; the same event id again is a replay, even freshly signed.
    let (status, _) = s.post(&body, SECRET, now_s()).await;
    assert_eq!(status, 200);
    let (status, refused) = s.post(&body, SECRET, now_s()).await;
    assert_eq!(status, 409, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("replay"));
    s.slack.wait_for_requests(2).await;

    let unbound = message(
        "Ev1001",
        "C0OTHER",
        "U0ALICE",
        "1700000011.000100",
        None,
        "hello",
    );
    let (status, refused) = s.post(&unbound, SECRET, now_s()).await;
    assert_eq!(status, 403, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("not bound"));

    let stranger = message(
        "Ev1002",
        "C0BOUND",
        "U0MALLORY",
        "1700000012.000100",
        None,
        "hello",
    );
    let (status, refused) = s.post(&stranger, SECRET, now_s()).await;
    assert_eq!(status, 403, "{refused}");
    // The stranger is told in the thread; nothing else is posted and nothing else started.
    s.slack.wait_for_requests(3).await;
    let posted = s.slack.posted();
    assert_eq!(posted.len(), 3, "{posted:?}");
    assert_eq!(posted[2].thread_ts.as_deref(), Some("1700000012.000100"));
    assert!(posted[2].text.contains("not mapped"), "{:?}", posted[2]);
    assert!(posted.iter().all(|p| p.channel == "C0BOUND"));
    assert_eq!(s.session_count(), 1);

    let audit = s.store().audit_rows().unwrap();
    let refused: Vec<_> = audit
        .iter()
        .filter(|r| r.action == "ingress.slack" && r.decision == "refused")
        .map(|r| r.detail["reason"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(refused.len(), 6, "{refused:?}");
    assert!(audit.iter().all(
        |r| !r.detail.to_string().contains(SECRET) && !r.detail.to_string().contains(BOT_TOKEN)
    ));
    s.gw.shutdown().await;
}

#[tokio::test]
async fn without_ingress_configured_the_route_does_not_exist() {
    let gw = TestGateway::start(SCRIPT).await;
    let (status, _) = gw
        .client
        .raw(reqwest::Method::POST, "/v1/ingress/slack/events", "{}")
        .await;
    assert_eq!(status, 404);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/ingress/slack/events", gw.client.url))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status().as_u16(),
        401,
        "an unconfigured ingress is just an unknown route"
    );
    gw.shutdown().await;
}
