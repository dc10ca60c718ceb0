//! A fake Slack Web API: `chat.postMessage` as Slack speaks it (a bearer bot token, a JSON
//! body with `channel`, `thread_ts` and `text`; `{"ok":true,"channel":…,"ts":…}` back, or
//! `{"ok":false,"error":"invalid_auth"}` for a wrong token) and `users.info` (a form body
//! with `user`; the user with their profile's email, or `user_not_found`), each call
//! recorded. And the
//! signing side of Slack's Events API for tests that play Slack: [`sign`] makes the
//! `X-Slack-Signature` of a body.

use crate::fake_provider::{FakeProvider, FakeResponse, RecordedRequest};
use sha2::{Digest, Sha256};

/// One `chat.postMessage` the fake received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostedMessage {
    pub channel: String,
    pub thread_ts: Option<String>,
    pub text: String,
}

/// The running fake; its API base is [`FakeSlack::api_base`] (`…/api`).
pub struct FakeSlack {
    server: FakeProvider,
}

impl FakeSlack {
    /// A fake that accepts `bot_token` only, and knows no user.
    pub async fn start(bot_token: &str) -> FakeSlack {
        FakeSlack::with_users(bot_token, &[]).await
    }

    /// A fake whose workspace has `users`: Slack user id and profile email.
    pub async fn with_users(bot_token: &str, users: &[(&str, &str)]) -> FakeSlack {
        let expected = format!("Bearer {bot_token}");
        let users: Vec<(String, String)> = users
            .iter()
            .map(|(id, email)| ((*id).to_owned(), (*email).to_owned()))
            .collect();
        let server = FakeProvider::start_with(move |requests: &[RecordedRequest]| {
            let request = requests.last().unwrap();
            let json = |body: serde_json::Value| {
                FakeResponse::status(
                    200,
                    &[("content-type", "application/json; charset=utf-8")],
                    &body.to_string(),
                )
            };
            if request.path != "/api/chat.postMessage" && request.path != "/api/users.info" {
                return json(serde_json::json!({"ok": false, "error": "unknown_method"}));
            }
            if request.header("authorization") != Some(expected.as_str()) {
                return json(serde_json::json!({"ok": false, "error": "invalid_auth"}));
            }
            if request.path == "/api/users.info" {
                let asked = String::from_utf8_lossy(&request.body)
                    .split('&')
                    .find_map(|pair| pair.strip_prefix("user=").map(str::to_owned))
                    .unwrap_or_default();
                return json(match users.iter().find(|(id, _)| *id == asked) {
                    Some((id, email)) => serde_json::json!({
                        "ok": true,
                        "user": {"id": id, "name": id.to_lowercase(), "profile": {"email": email}},
                    }),
                    None => serde_json::json!({"ok": false, "error": "user_not_found"}),
                });
            }
            let Ok(body) = serde_json::from_slice::<serde_json::Value>(&request.body) else {
                return json(serde_json::json!({"ok": false, "error": "invalid_json"}));
            };
            let n = requests.len();
            json(serde_json::json!({
                "ok": true,
                "channel": body["channel"],
                "ts": format!("1700000000.{n:06}"),
                "message": {"text": body["text"], "thread_ts": body["thread_ts"]},
            }))
        })
        .await;
        FakeSlack { server }
    }

    /// What `[ingress.slack] api_base` is set to.
    pub fn api_base(&self) -> String {
        format!("{}/api", self.server.base_url())
    }

    /// Every `chat.postMessage` accepted (right token, JSON body), in order.
    pub fn posted(&self) -> Vec<PostedMessage> {
        self.server
            .requests()
            .iter()
            .filter(|r| r.path == "/api/chat.postMessage")
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .map(|body| PostedMessage {
                channel: body["channel"].as_str().unwrap_or_default().to_owned(),
                thread_ts: body["thread_ts"].as_str().map(str::to_owned),
                text: body["text"].as_str().unwrap_or_default().to_owned(),
            })
            .collect()
    }

    /// Every request, recorded as it came (headers included).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.server.requests()
    }

    /// Waits until `count` requests arrived.
    pub async fn wait_for_requests(&self, count: usize) {
        self.server.wait_for_requests(count).await;
    }
}

/// `v0=` and the hex HMAC-SHA256 of `v0:{timestamp}:{body}` under `secret`: Slack's
/// `X-Slack-Signature`.
pub fn sign(secret: &str, timestamp: &str, body: &[u8]) -> String {
    let mut message = format!("v0:{timestamp}:").into_bytes();
    message.extend_from_slice(body);
    let mac = hmac_sha256(secret.as_bytes(), &message);
    format!(
        "v0={}",
        mac.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_signature_matches_slacks_documented_example() {
        // From Slack's "Verifying requests from Slack" page.
        let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        assert_eq!(
            super::sign("8f742231b10e8888abcd99yyyzzz85a5", "1531420618", body),
            "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
        );
    }
}
