//! Slack-compatible chat ingress against a fake Slack Web API that speaks Slack's wire
//! format: signed events start and continue one session per thread and the answers come
//! back to the thread; the requester is a Skiff user (mapped by the binding, or by their
//! Slack profile's email) who owns the session; a bad signature, a stale timestamp, a
//! replayed event id, an unbound channel, someone Slack does not know, someone who is not a
//! Skiff user and a viewer are refused; without `[ingress.slack]` the route does not exist.

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

/// The Slack workspace: everyone's profile email. Alice is mapped by the binding (in another
/// case than Skiff has her); the others are found by their profile email.
const SLACK_USERS: &[(&str, &str)] = &[
    ("U0ALICE", "alice@slack.example"),
    ("U0BOB", "Bob@Example.com"),
    ("U0VERA", "vera@example.com"),
    ("U0NEWBIE", "newbie@example.com"),
];

async fn setup() -> Setup {
    let slack = FakeSlack::with_users(BOT_TOKEN, SLACK_USERS).await;
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
users = {{ "U0ALICE" = "Alice@Example.com" }}
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
    for (email, role) in [
        ("alice@example.com", "member"),
        ("bob@example.com", "member"),
        ("vera@example.com", "viewer"),
    ] {
        let (status, body) = gw
            .client
            .raw(
                reqwest::Method::POST,
                "/v1/admin/users",
                &serde_json::json!({ "email": email, "role": role }).to_string(),
            )
            .await;
        assert_eq!(status, 201, "{body}");
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

    fn user(&self, email: &str) -> skiff_store::UserRow {
        self.store().user_by_email(email, None).unwrap()
    }

    /// A client holding a fresh write token of `email`'s.
    async fn as_user(&self, email: &str) -> crate::harness::Client {
        let (status, body) = self
            .gw
            .client
            .raw(
                reqwest::Method::POST,
                "/v1/admin/tokens",
                &serde_json::json!({ "email": email, "scope": "write", "expires_in_s": 3600 })
                    .to_string(),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        self.gw.client.with_token(body["secret"].as_str().unwrap())
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

    // The session is Alice's (the user the binding maps her to), on the bound repository,
    // and its first message is the prompt without the mention.
    let store = s.store();
    let (scope, id) = store
        .ingress_thread("C0BOUND", "1700000001.000100")
        .unwrap()
        .expect("the thread has a session");
    assert_eq!(scope, s.user("alice@example.com").scope());
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
async fn a_requester_found_by_their_slack_email_owns_the_session_they_start() {
    let s = setup().await;
    let first = message(
        "Ev0100",
        "C0BOUND",
        "U0BOB",
        "1700000100.000100",
        None,
        "<@U0BOT> what is here?",
    );
    let (status, body) = s.post(&first, SECRET, now_s()).await;
    assert_eq!(status, 200, "{body}");
    // users.info, then the acknowledgement and the answer.
    s.slack.wait_for_requests(3).await;
    let asked = &s.slack.requests()[0];
    assert_eq!(asked.path, "/api/users.info");
    assert_eq!(String::from_utf8_lossy(&asked.body), "user=U0BOB");
    assert_eq!(s.slack.posted()[1].text, "First answer.");

    // Bob's Slack email is Bob@Example.com; Skiff has him as bob@example.com: the same user,
    // and the session is his, within his sight and nobody else's of his role.
    let bob = s.user("bob@example.com");
    let (scope, id) = s
        .store()
        .ingress_thread("C0BOUND", "1700000100.000100")
        .unwrap()
        .expect("the thread has a session");
    assert_eq!(scope, bob.scope());
    let his = s.as_user("bob@example.com").await;
    let listed = his.sessions().await.unwrap();
    assert_eq!(listed.sessions.len(), 1);
    assert_eq!(listed.sessions[0].id, id);
    let alices = s.as_user("alice@example.com").await;
    assert_eq!(alices.session(&id).await.unwrap_err().status, 404);
    assert!(alices.sessions().await.unwrap().sessions.is_empty());
    // The audit says who asked, as theirs.
    let allowed: Vec<_> = s
        .store()
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "ingress.slack" && r.decision == "allowed")
        .collect();
    assert_eq!(allowed.len(), 1);
    assert_eq!(allowed[0].owner_id, bob.id);
    assert_eq!(allowed[0].detail["slack_user"], "U0BOB");
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

    // Someone Slack does not know (asked with users.info), told so in the thread.
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
    s.slack.wait_for_requests(4).await;
    let posted = s.slack.posted();
    assert_eq!(posted.len(), 3, "{posted:?}");
    assert_eq!(posted[2].thread_ts.as_deref(), Some("1700000012.000100"));
    assert!(
        posted[2].text.contains("could not tell who you are")
            && posted[2].text.contains("user_not_found"),
        "{:?}",
        posted[2]
    );
    // Someone Slack knows but Skiff does not: told how an admin adds them.
    let newbie = message(
        "Ev1003",
        "C0BOUND",
        "U0NEWBIE",
        "1700000013.000100",
        None,
        "hello",
    );
    let (status, refused) = s.post(&newbie, SECRET, now_s()).await;
    assert_eq!(status, 403, "{refused}");
    s.slack.wait_for_requests(6).await;
    let posted = s.slack.posted();
    assert_eq!(posted[3].thread_ts.as_deref(), Some("1700000013.000100"));
    assert!(
        posted[3].text.contains("skiff admin user add"),
        "{:?}",
        posted[3]
    );
    // A viewer is a user, but may not start sessions.
    let viewer = message(
        "Ev1004",
        "C0BOUND",
        "U0VERA",
        "1700000014.000100",
        None,
        "hello",
    );
    let (status, refused) = s.post(&viewer, SECRET, now_s()).await;
    assert_eq!(status, 403, "{refused}");
    s.slack.wait_for_requests(8).await;
    let posted = s.slack.posted();
    assert_eq!(posted.len(), 5, "{posted:?}");
    assert!(
        posted[4].text.contains("your role (viewer)"),
        "{:?}",
        posted[4]
    );
    assert!(posted.iter().all(|p| p.channel == "C0BOUND"));
    assert_eq!(s.session_count(), 1);

    // Each refusal is audited: as the viewer's, who is known; as nobody's before anyone is.
    let audit = s.store().audit_rows().unwrap();
    let refused: Vec<_> = audit
        .iter()
        .filter(|r| r.action == "ingress.slack" && r.decision == "refused")
        .map(|r| {
            (
                r.detail["reason"].as_str().unwrap_or_default().to_owned(),
                r.owner_id.clone(),
            )
        })
        .collect();
    let vera = s.user("vera@example.com").id;
    // `auth::unattributed_scope`: never a user's.
    let nobody = "-".to_owned();
    let expected: Vec<(String, String)> = [
        ("bad signature", &nobody),
        ("bad signature", &nobody),
        (
            "stale request: the timestamp is more than five minutes off",
            &nobody,
        ),
        ("replay", &nobody),
        ("unbound channel", &nobody),
        ("requester not found in Slack", &nobody),
        ("unknown requester", &nobody),
        ("role cannot start sessions", &vera),
    ]
    .into_iter()
    .map(|(reason, owner)| (reason.to_owned(), owner.clone()))
    .collect();
    assert_eq!(refused, expected);
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
