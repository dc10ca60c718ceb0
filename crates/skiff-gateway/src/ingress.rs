//! Chat ingress, Slack-compatible (`[ingress.slack]`; off unless configured, and then no
//! route exists): `POST /v1/ingress/slack/events` takes Slack's Events API. The signature
//! (`X-Slack-Signature`, `v0=` HMAC-SHA256 of `v0:{timestamp}:{raw body}` under the signing
//! secret from the vault) and the timestamp (at most five minutes off) are checked before
//! the body is parsed; an event id already accepted is refused as a replay. A message is
//! acted on only in a channel an operator bound (`[[ingress.slack.bindings]]`) and only from
//! a Skiff user: the requester is the user whose email the binding's `users` maps their Slack
//! id to, else the user whose email their Slack profile shows (`users.info`), compared without
//! case; someone who is neither is told in the thread how an admin adds them. Their session
//! is theirs (their role, budgets and sight): the first message of a thread starts it on the
//! binding's repository (its profile, model and agent), later ones continue it, and the
//! gateway answers in the thread with `chat.postMessage` (an acknowledgement, then the turn's
//! final message). The bot token never leaves the gateway. A refusal before anyone is known
//! is audited as nobody's (`auth::unattributed_scope`), one of a known user as theirs.

use crate::Core;
use crate::error::Error;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use skiff_protocol::SessionId;
use skiff_protocol::transcript::EntryBody;
use skiff_store::{Scope, UserRow};
use std::collections::BTreeMap;
use std::sync::Arc;

/// How far a request's timestamp may be from now.
const MAX_SKEW_S: i64 = 5 * 60;
const DEFAULT_API_BASE: &str = "https://slack.com/api";

/// `[ingress]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngressConfig {
    pub slack: Option<SlackConfig>,
}

/// `[ingress.slack]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlackConfig {
    /// `vault:NAME`: the app's signing secret.
    pub signing_secret: String,
    /// `vault:NAME`: the bot token replies are posted with.
    pub bot_token: String,
    /// The Web API's base URL [default: https://slack.com/api].
    #[serde(default)]
    pub api_base: Option<String>,
    /// The channels an operator approved; a message anywhere else is refused.
    #[serde(default)]
    pub bindings: Vec<SlackBinding>,
}

/// `[[ingress.slack.bindings]]`: one approved channel and where its threads run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlackBinding {
    pub channel: String,
    /// The repository (or plain directory) on the gateway host sessions start from.
    pub repository: String,
    #[serde(default)]
    pub profile: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    /// `NAME` or `NAME@DIGEST`.
    #[serde(default)]
    pub agent: Option<String>,
    /// Slack user id → the email of the Skiff user they are. Anyone else is the user their
    /// Slack profile's email names (`users.info`, which needs the `users:read.email` scope).
    #[serde(default)]
    pub users: BTreeMap<String, String>,
    /// Only users of this tenant may use the channel [default: users of any tenant].
    #[serde(default)]
    pub tenant: Option<String>,
}

/// The configured Slack ingress, checked at start. Its secrets are opened from the vault
/// when used, so one set (or rotated) after start is used at once.
pub(crate) struct Slack {
    signing_secret: String,
    bot_token: String,
    api_base: String,
    bindings: Vec<SlackBinding>,
    http: reqwest::Client,
    vault: Arc<crate::vault::Vault>,
}

/// Checks `[ingress.slack]` at start: both secrets must be `vault:NAME` references.
pub(crate) fn validate(
    config: &IngressConfig,
) -> std::result::Result<Option<(SlackConfig, String, String)>, String> {
    let Some(slack) = &config.slack else {
        return Ok(None);
    };
    let vault_name = |key: &str, value: &str| {
        value
            .strip_prefix("vault:")
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| {
                format!(
                    "at `ingress.slack.{key}`: must be a vault reference (`vault:NAME`; store it with `skiff secret set NAME`)"
                )
            })
    };
    let secret = vault_name("signing_secret", &slack.signing_secret)?;
    let token = vault_name("bot_token", &slack.bot_token)?;
    for (i, b) in slack.bindings.iter().enumerate() {
        if !std::path::Path::new(&b.repository).is_absolute() {
            return Err(format!(
                "at `ingress.slack.bindings[{i}].repository`: {} must be an absolute path on the gateway host",
                b.repository
            ));
        }
    }
    Ok(Some((slack.clone(), secret, token)))
}

impl Slack {
    /// The ingress of `[ingress.slack]`, with the vault names of its two secrets.
    pub(crate) fn new(
        config: SlackConfig,
        secret_name: String,
        token_name: String,
        vault: Arc<crate::vault::Vault>,
    ) -> crate::Result<Slack> {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(|e| Error::Internal(format!("cannot build the Slack client: {e}")))?;
        Ok(Slack {
            signing_secret: secret_name,
            bot_token: token_name,
            api_base: config
                .api_base
                .unwrap_or_else(|| DEFAULT_API_BASE.to_owned())
                .trim_end_matches('/')
                .to_owned(),
            bindings: config.bindings,
            http,
            vault,
        })
    }

    /// Posts `text` in a thread. A failure is logged, never retried into a loop.
    async fn post(&self, channel: &str, thread_ts: &str, text: &str) {
        let token = match self.vault.open(&self.bot_token) {
            Ok(token) => token,
            Err(e) => {
                tracing::warn!(%channel, error = %e, "could not post a reply to Slack: no bot token");
                return;
            }
        };
        let url = format!("{}/chat.postMessage", self.api_base);
        let sent = self
            .http
            .post(&url)
            .bearer_auth(&token)
            .json(&json!({ "channel": channel, "thread_ts": thread_ts, "text": text }))
            .send()
            .await;
        let ok = match sent {
            Ok(response) => match response.json::<serde_json::Value>().await {
                Ok(body) if body["ok"] == true => None,
                Ok(body) => Some(body["error"].as_str().unwrap_or("unknown").to_owned()),
                Err(e) => Some(format!("unreadable answer: {e}")),
            },
            // Without the URL: it is the operator's, but the error text could carry a token
            // in a misconfigured base.
            Err(e) => Some(format!("request failed: {}", e.without_url())),
        };
        if let Some(error) = ok {
            tracing::warn!(%channel, %error, "could not post a reply to Slack");
        }
    }

    /// The email on a Slack user's profile (`users.info`), or why there is none.
    async fn profile_email(&self, user: &str) -> std::result::Result<String, String> {
        let token = self
            .vault
            .open(&self.bot_token)
            .map_err(|_| "the gateway cannot read its Slack bot token".to_owned())?;
        let url = format!("{}/users.info", self.api_base);
        let response = self
            .http
            .post(&url)
            .bearer_auth(&token)
            .form(&[("user", user)])
            .send()
            .await
            // Without the URL, as in `post`.
            .map_err(|e| format!("Slack could not be asked: {}", e.without_url()))?;
        let body: serde_json::Value = response
            .json()
            .await
            .map_err(|e| format!("Slack's answer is unreadable: {e}"))?;
        if body["ok"] != true {
            return Err(format!(
                "Slack answered {}",
                body["error"].as_str().unwrap_or("an error")
            ));
        }
        body["user"]["profile"]["email"]
            .as_str()
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| {
                "Slack shows no email for them (the app needs the users:read.email scope)"
                    .to_owned()
            })
    }

    /// The Skiff user a Slack requester is in `binding`'s channel, or why they may not use it.
    async fn requester(
        &self,
        core: &Core,
        binding: &SlackBinding,
        slack_user: &str,
    ) -> std::result::Result<UserRow, Refusal> {
        let email = match binding.users.get(slack_user) {
            Some(email) => email.clone(),
            None => self
                .profile_email(slack_user)
                .await
                .map_err(|why| Refusal {
                    user: None,
                    reason: "requester not found in Slack",
                    tell: format!(
                        "I could not tell who you are: {why}. An operator can map you to your Skiff user under this channel's binding (`users`)."
                    ),
                })?,
        };
        let user = match core.store.user_by_email(&email, None) {
            Ok(user) => user,
            Err(skiff_store::Error::NotFound { .. }) => {
                return Err(Refusal {
                    user: None,
                    reason: "unknown requester",
                    tell: "You are not a Skiff user yet: an admin adds you with `skiff admin user add EMAIL --role member` (EMAIL as your Slack profile shows it), then ask again.".to_owned(),
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot look up the user a Slack requester is");
                return Err(Refusal {
                    user: None,
                    reason: "user lookup failed",
                    tell: "I could not look you up; try again in a moment.".to_owned(),
                });
            }
        };
        if let Some(tenant) = binding.tenant.as_deref().filter(|t| *t != user.tenant_id) {
            return Err(Refusal {
                user: Some(user),
                reason: "requester of another tenant",
                tell: format!("This channel is for users of tenant {tenant}, and you are not one."),
            });
        }
        let principal = crate::people::Principal {
            user,
            cap: skiff_protocol::people::TokenScope::Write,
        };
        if !principal.may(crate::people::Need::Write) {
            let tell = format!(
                "Not started: {}.",
                principal.refusal(crate::people::Need::Write)
            );
            return Err(Refusal {
                user: Some(principal.user),
                reason: "role cannot start sessions",
                tell,
            });
        }
        Ok(principal.user)
    }
}

/// Why a requester may not use a channel: what the audit records, and what they are told in
/// the thread. `user` when they are a Skiff user (the refusal is audited as theirs).
struct Refusal {
    user: Option<UserRow>,
    reason: &'static str,
    tell: String,
}

/// The route, only when `[ingress.slack]` is configured.
pub(crate) fn routes(configured: bool) -> Router<Arc<Core>> {
    if configured {
        Router::new().route("/v1/ingress/slack/events", post(events))
    } else {
        Router::new()
    }
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "ok": false, "error": message }))).into_response()
}

/// `v0=` and the hex HMAC-SHA256 of `v0:{timestamp}:{body}`.
fn signature(secret: &str, timestamp: &str, body: &[u8]) -> String {
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

/// Equal in time independent of where two strings differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks the timestamp and signature of a request; the reason when refused.
fn verify(
    secret: &str,
    headers: &HeaderMap,
    body: &[u8],
    now_s: i64,
) -> std::result::Result<(), &'static str> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let timestamp =
        header("x-slack-request-timestamp").ok_or("missing X-Slack-Request-Timestamp")?;
    let given = header("x-slack-signature").ok_or("missing X-Slack-Signature")?;
    let at: i64 = timestamp
        .parse()
        .map_err(|_| "malformed X-Slack-Request-Timestamp")?;
    if (now_s - at).abs() > MAX_SKEW_S {
        return Err("stale request: the timestamp is more than five minutes off");
    }
    if !same(
        signature(secret, timestamp, body).as_bytes(),
        given.as_bytes(),
    ) {
        return Err("bad signature");
    }
    Ok(())
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    challenge: Option<String>,
    #[serde(default)]
    event_id: Option<String>,
    #[serde(default)]
    event: Option<SlackEvent>,
}

#[derive(Deserialize)]
struct SlackEvent {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    subtype: Option<String>,
    #[serde(default)]
    bot_id: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    channel: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    ts: Option<String>,
    #[serde(default)]
    thread_ts: Option<String>,
}

async fn events(State(core): State<Arc<Core>>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(slack) = core.slack.clone() else {
        return refuse(StatusCode::NOT_FOUND, "chat ingress is not configured");
    };
    let now_s = skiff_store::now_ms() / 1000;
    let secret = match slack.vault.open(&slack.signing_secret) {
        Ok(secret) => secret,
        Err(e) => {
            tracing::warn!(error = %e, "refused a Slack request: the signing secret cannot be read");
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "the gateway cannot read its Slack signing secret (`ingress.slack.signing_secret`)",
            );
        }
    };
    // Before anything reads the body.
    if let Err(reason) = verify(&secret, &headers, &body, now_s) {
        core.audit(
            &crate::auth::unattributed_scope(),
            "ingress.slack",
            "events",
            "refused",
            json!({ "reason": reason }),
        );
        return refuse(StatusCode::UNAUTHORIZED, reason);
    }
    let Ok(envelope) = serde_json::from_slice::<Envelope>(&body) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "the body is not a Slack event envelope",
        );
    };
    match envelope.kind.as_str() {
        "url_verification" => {
            Json(json!({ "challenge": envelope.challenge.unwrap_or_default() })).into_response()
        }
        "event_callback" => {
            let Some(event_id) = envelope.event_id else {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    "an event_callback without event_id",
                );
            };
            let forget_before = (now_s - 2 * MAX_SKEW_S) * 1000;
            match core
                .store
                .ingress_event_first_seen(&event_id, forget_before)
            {
                Ok(true) => {}
                Ok(false) => {
                    core.audit(
                        &crate::auth::unattributed_scope(),
                        "ingress.slack",
                        &event_id,
                        "refused",
                        json!({ "reason": "replay" }),
                    );
                    return refuse(
                        StatusCode::CONFLICT,
                        "replayed event: this event id was seen before",
                    );
                }
                Err(e) => return Error::from(e).into_response(),
            }
            match envelope.event {
                Some(event) => on_event(&core, &slack, &event_id, event).await,
                None => refuse(StatusCode::BAD_REQUEST, "an event_callback without event"),
            }
        }
        _ => Json(json!({ "ok": true })).into_response(),
    }
}

/// The prompt in a message: its text without the bot's own mention.
fn prompt_of(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("<@") {
        out.push_str(&rest[..start]);
        match rest[start..].find('>') {
            Some(end) => rest = &rest[start + end + 1..],
            None => {
                rest = &rest[start..];
                break;
            }
        }
    }
    out.push_str(rest);
    out.trim().to_owned()
}

async fn on_event(
    core: &Arc<Core>,
    slack: &Arc<Slack>,
    event_id: &str,
    event: SlackEvent,
) -> Response {
    // Before the requester is known, a refusal is nobody's.
    let audit_refused = |scope: &Scope, reason: &str, slack_user: Option<&str>| {
        core.audit(
            scope,
            "ingress.slack",
            event_id,
            "refused",
            json!({ "reason": reason, "slack_user": slack_user }),
        );
    };
    // Only people's messages: not the bot's own replies, edits or joins.
    let relevant = matches!(event.kind.as_str(), "app_mention" | "message")
        && event.subtype.is_none()
        && event.bot_id.is_none();
    if !relevant {
        return Json(json!({ "ok": true })).into_response();
    }
    let (Some(channel), Some(ts)) = (event.channel.clone(), event.ts.clone()) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "a message event without channel or ts",
        );
    };
    let Some(binding) = slack.bindings.iter().find(|b| b.channel == channel) else {
        audit_refused(
            &crate::auth::unattributed_scope(),
            "unbound channel",
            event.user.as_deref(),
        );
        return refuse(
            StatusCode::FORBIDDEN,
            "this channel is not bound: an operator adds it under [[ingress.slack.bindings]]",
        );
    };
    let thread_ts = event.thread_ts.clone().unwrap_or(ts);
    let Some(slack_user) = event.user.clone() else {
        return refuse(StatusCode::BAD_REQUEST, "a message event without user");
    };
    let scope = match slack.requester(core, binding, &slack_user).await {
        Ok(user) => user.scope(),
        Err(refusal) => {
            let scope = refusal
                .user
                .as_ref()
                .map_or_else(crate::auth::unattributed_scope, UserRow::scope);
            audit_refused(&scope, refusal.reason, Some(&slack_user));
            let slack = slack.clone();
            let thread = thread_ts.clone();
            tokio::spawn(async move {
                slack.post(&channel, &thread, &refusal.tell).await;
            });
            return refuse(
                StatusCode::FORBIDDEN,
                &format!("the requester may not use this channel: {}", refusal.reason),
            );
        }
    };
    let prompt = prompt_of(event.text.as_deref().unwrap_or_default());
    if prompt.is_empty() {
        return Json(json!({ "ok": true })).into_response();
    }
    core.audit(
        &scope,
        "ingress.slack",
        event_id,
        "allowed",
        json!({ "channel": channel, "slack_user": slack_user }),
    );
    // Slack wants an answer within three seconds: the turn runs on, the reply comes later.
    let (core, slack, binding) = (core.clone(), slack.clone(), binding.clone());
    tokio::spawn(async move {
        let started =
            start_or_continue(&core, &scope, &binding, &channel, &thread_ts, &prompt).await;
        match started {
            Ok((session, run)) => {
                slack
                    .post(
                        &channel,
                        &thread_ts,
                        &format!("Working on it in session {session}."),
                    )
                    .await;
                let text = final_message(&core, &scope, &session, &run).await;
                slack.post(&channel, &thread_ts, &text).await;
            }
            Err(e) => {
                let (_, api) = e.to_api();
                slack
                    .post(
                        &channel,
                        &thread_ts,
                        &format!("Could not start: {}", api.message),
                    )
                    .await;
            }
        }
    });
    Json(json!({ "ok": true })).into_response()
}

/// The thread's session: started by its first message, continued by the next.
async fn start_or_continue(
    core: &Arc<Core>,
    scope: &Scope,
    binding: &SlackBinding,
    channel: &str,
    thread_ts: &str,
    prompt: &str,
) -> crate::Result<(SessionId, skiff_protocol::RunId)> {
    if let Some((owner, session)) = core.store.ingress_thread(channel, thread_ts)? {
        if owner != *scope {
            return Err(Error::Forbidden(
                "this thread's session belongs to another user".into(),
            ));
        }
        let started = core
            .send(
                scope,
                &session,
                crate::sessions::Message {
                    prompt,
                    ..Default::default()
                },
            )
            .await?;
        return Ok((session, started.run.id));
    }
    let request = skiff_protocol::api::CreateSessionRequest {
        prompt: prompt.to_owned(),
        workspace: binding.repository.clone(),
        model: binding.model.clone(),
        profile: binding.profile.clone(),
        reasoning: None,
        approval: None,
        agent: binding.agent.clone(),
        attempts: None,
        repo: None,
    };
    let started = core.create_session(scope, request).await?;
    core.store
        .put_ingress_thread(scope, channel, thread_ts, &started.session.id)?;
    Ok((started.session.id, started.run.id))
}

/// Waits for the run to end and says how it went: its final message, or why it failed.
async fn final_message(
    core: &Arc<Core>,
    scope: &Scope,
    session: &SessionId,
    run: &skiff_protocol::RunId,
) -> String {
    let mut changes = core.hub.session_changes();
    loop {
        match core.store.run(scope, run) {
            Ok(row) if row.status.is_terminal() => {
                let said = core
                    .store
                    .transcript(scope, session)
                    .ok()
                    .and_then(|entries| {
                        entries.into_iter().rev().find_map(|e| match e.body {
                            EntryBody::AssistantMessage { text, .. }
                                if e.run_id.as_ref() == Some(run) && !text.trim().is_empty() =>
                            {
                                Some(text)
                            }
                            _ => None,
                        })
                    });
                return match (said, row.error) {
                    (Some(text), None) => text,
                    (said, error) => format!(
                        "The turn ended {}{}{}",
                        row.status.as_str(),
                        error.map(|e| format!(": {e}")).unwrap_or_default(),
                        said.map(|t| format!("\n\n{t}")).unwrap_or_default()
                    ),
                };
            }
            Ok(_) => {}
            Err(e) => return format!("Could not read the turn: {e}"),
        }
        if let Err(tokio::sync::broadcast::error::RecvError::Closed) = changes.recv().await {
            return "The gateway stopped before the turn ended.".into();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mention_is_left_out_of_the_prompt() {
        assert_eq!(prompt_of("<@U0BOT> fix the tests"), "fix the tests");
        assert_eq!(prompt_of("hi <@U0BOT> there"), "hi  there");
    }

    #[test]
    fn the_signature_is_slacks() {
        let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        assert_eq!(
            signature("8f742231b10e8888abcd99yyyzzz85a5", "1531420618", body),
            "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
        );
    }
}
