//! Approvals of gateway-placed sessions: a call the policy holds waits, visibly, for a
//! person; approve runs it, deny and a timeout refuse it with a reason the model reads, a
//! cancel revokes it; bad policies are refused naming their key.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::SessionId;
use skiff_protocol::api::RunStatus;
use skiff_protocol::approval::{ApprovalKind, ApprovalPolicy, ApprovalState, ApprovalView};
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::EntryBody;

const EXEC_SCRIPT: &str = r#"
[[turns]]
text = "Cleaning up."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned" }

[[turns]]
text = "Done."
"#;

fn rules(text: &str) -> ApprovalPolicy {
    serde_json::from_str(text).unwrap()
}

fn pending(event: &SessionEvent) -> Option<ApprovalView> {
    match &event.kind {
        EventKind::Approval { approval } if approval.state == ApprovalState::Pending => {
            Some(approval.clone())
        }
        _ => None,
    }
}

/// Starts a session under `policy` and waits until its first call asks for approval.
async fn until_asked(
    gw: &TestGateway,
    script_prompt: &str,
    policy: Option<ApprovalPolicy>,
) -> (SessionId, ApprovalView, u64) {
    let ws = gw.plain_dir("ws", &[("build/x.o", "x"), ("README.md", "old\n")]);
    let mut request = session_request(&ws, "fake/x", script_prompt);
    request.approval = policy;
    let started = gw.client.create_session(&request).await.unwrap();
    let id = started.session.id.clone();
    let events = gw
        .client
        .follow_until(&id, 0, |e| pending(e).is_some())
        .await;
    let last = events.last().unwrap();
    (id, pending(last).unwrap(), last.cursor)
}

fn tool_result(transcript: &[skiff_protocol::transcript::TranscriptEntry]) -> (String, bool) {
    transcript
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .expect("the call has a result")
}

#[tokio::test]
async fn an_approved_command_waits_for_the_decision_and_then_runs() {
    let gw = TestGateway::start(EXEC_SCRIPT).await;
    let (id, asked, cursor) = until_asked(&gw, "clean", Some(rules(r#"{"exec":["rm *"]}"#))).await;
    assert_eq!(asked.kind, ApprovalKind::Exec);
    assert_eq!(asked.subject, "rm -rf build && echo cleaned");
    assert_eq!(asked.requested_by, "agent");
    assert!(asked.id.as_str().starts_with("apr_"));
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(
        detail.session.last_run.unwrap().status,
        RunStatus::WaitingApproval,
        "the run does not say it waits"
    );
    let listed = gw.client.approvals(Some(&id)).await.unwrap();
    assert_eq!(listed.approvals, vec![asked.clone()]);

    let decided = gw.client.decide(&asked.id, true, None).await.unwrap();
    assert_eq!(decided.state, ApprovalState::Approved);
    assert_eq!(decided.decided_by.as_deref(), Some("usr_admin"));
    let events = gw.client.follow_until_run_end(&id, cursor).await;
    assert!(matches!(
        events.last().unwrap().kind,
        EventKind::RunStatus {
            status: RunStatus::Succeeded,
            ..
        }
    ));
    let (content, is_error) = tool_result(&gw.client.session(&id).await.unwrap().transcript);
    assert!(!is_error && content.contains("cleaned"), "{content}");
    // A second decision finds nothing waiting.
    let again = gw.client.decide(&asked.id, false, None).await.unwrap_err();
    assert_eq!(again.status, 409, "{:?}", again.error);
    assert!(
        again.error.message.contains("already approved"),
        "{:?}",
        again.error
    );

    // Audit rows say who decided what, never the command.
    let store = skiff_store::Store::open(&gw.state_dir.join("skiff.db")).unwrap();
    let rows = store.audit_rows().unwrap();
    let decision = rows
        .iter()
        .find(|r| r.action == "approval.decide")
        .expect("the decision is audited");
    assert_eq!(decision.decision, "approved");
    assert!(
        rows.iter()
            .filter(|r| r.action.starts_with("approval."))
            .all(|r| !r.detail.to_string().contains("rm -rf")),
        "an audit row carries the command"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_denied_command_does_not_run_and_the_model_reads_the_reason() {
    let gw = TestGateway::start(EXEC_SCRIPT).await;
    let (id, asked, cursor) = until_asked(&gw, "clean", Some(rules(r#"{"exec":["rm *"]}"#))).await;
    let denied = gw
        .client
        .decide(&asked.id, false, Some("keep the build cache"))
        .await
        .unwrap();
    assert_eq!(denied.state, ApprovalState::Denied);
    gw.client.follow_until_run_end(&id, cursor).await;
    let detail = gw.client.session(&id).await.unwrap();
    let (content, is_error) = tool_result(&detail.transcript);
    assert!(is_error, "a denied call is an error result");
    assert!(
        content.contains("denied") && content.contains("keep the build cache"),
        "the model does not read the reason: {content}"
    );
    let build = std::path::Path::new(detail.session.workspace.path()).join("build/x.o");
    assert!(build.exists(), "the denied command ran");
    gw.shutdown().await;
}

#[tokio::test]
async fn nobody_deciding_within_the_timeout_denies_the_call() {
    // The gateway's own policy applies to a session that sets none.
    let gw = TestGateway::configured(
        EXEC_SCRIPT,
        "[gateway]\napproval = { exec = [\"/^rm /\"] }\napproval_timeout = \"300ms\"\n",
        None,
    )
    .await;
    let (id, asked, cursor) = until_asked(&gw, "clean", None).await;
    let events = gw.client.follow_until_run_end(&id, cursor).await;
    let expired = events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Approval { approval } if approval.id == asked.id => {
                (approval.state != ApprovalState::Pending).then(|| approval.clone())
            }
            _ => None,
        })
        .expect("the expiry is published");
    assert_eq!(expired.state, ApprovalState::Expired);
    let (content, is_error) = tool_result(&gw.client.session(&id).await.unwrap().transcript);
    assert!(
        is_error && content.contains("approval_timeout"),
        "the model is not told why: {content}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn cancelling_the_turn_revokes_its_pending_approval() {
    let gw = TestGateway::start(EXEC_SCRIPT).await;
    let (id, asked, cursor) = until_asked(&gw, "clean", Some(rules(r#"{"all":true}"#))).await;
    gw.client.cancel(&id).await.unwrap();
    let events = gw.client.follow_until_run_end(&id, cursor).await;
    assert!(matches!(
        events.last().unwrap().kind,
        EventKind::RunStatus {
            status: RunStatus::Cancelled,
            ..
        }
    ));
    let row = gw.client.approvals(Some(&id)).await.unwrap().approvals;
    assert_eq!(row[0].id, asked.id);
    assert_eq!(row[0].state, ApprovalState::Revoked);
    assert_eq!(row[0].reason.as_deref(), Some("the turn was cancelled"));
    let late = gw.client.decide(&asked.id, true, None).await.unwrap_err();
    assert_eq!(late.status, 409);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_write_outside_the_allowed_paths_shows_its_diff() {
    let script = r#"
[[turns]]
text = "Editing the readme."
[[turns.tool_calls]]
name = "write"
arguments = { path = "README.md", content = "new\n" }

[[turns]]
text = "Done."
"#;
    let gw = TestGateway::start(script).await;
    let (id, asked, cursor) =
        until_asked(&gw, "edit", Some(rules(r#"{"write_outside":["src/**"]}"#))).await;
    assert_eq!(asked.kind, ApprovalKind::Write);
    assert!(
        asked.subject.contains("-old") && asked.subject.contains("+new"),
        "{}",
        asked.subject
    );
    gw.client.decide(&asked.id, true, None).await.unwrap();
    gw.client.follow_until_run_end(&id, cursor).await;
    let detail = gw.client.session(&id).await.unwrap();
    let readme = std::path::Path::new(detail.session.workspace.path()).join("README.md");
    assert_eq!(std::fs::read_to_string(readme).unwrap(), "new\n");
    gw.shutdown().await;
}

#[tokio::test]
async fn on_request_the_model_asks_and_reads_the_answer() {
    let script = r#"
[[turns]]
text = "Asking first."
[[turns.tool_calls]]
name = "request_approval"
arguments = { action = "drop the staging database", reason = "the migration needs a clean slate" }

[[turns]]
text = "Done."
"#;
    let gw = TestGateway::start(script).await;
    let (id, asked, cursor) = until_asked(&gw, "migrate", Some(ApprovalPolicy::OnRequest)).await;
    assert_eq!(asked.kind, ApprovalKind::Request);
    assert_eq!(asked.subject, "drop the staging database");
    assert_eq!(
        asked.request_reason.as_deref(),
        Some("the migration needs a clean slate")
    );
    gw.client.decide(&asked.id, true, None).await.unwrap();
    gw.client.follow_until_run_end(&id, cursor).await;
    let detail = gw.client.session(&id).await.unwrap();
    let (content, is_error) = tool_result(&detail.transcript);
    assert!(!is_error && content.contains("approved"), "{content}");
    assert_eq!(detail.session.approval, Some(ApprovalPolicy::OnRequest));
    gw.shutdown().await;
}

#[tokio::test]
async fn a_bad_policy_is_refused_naming_its_key() {
    let gw = TestGateway::start(EXEC_SCRIPT).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "fake/x", "clean");
    request.approval = Some(rules(r#"{"exec":["ok", "/(/"]}"#));
    let refused = gw.client.create_session(&request).await.unwrap_err();
    assert_eq!(refused.status, 400);
    assert!(
        refused.error.message.contains("approval.exec[1]"),
        "{:?}",
        refused.error
    );
    let body = serde_json::json!({
        "prompt": "clean", "workspace": ws.display().to_string(), "approval": "sometimes",
    });
    let (status, json) = gw
        .client
        .raw(reqwest::Method::POST, "/v1/sessions", &body.to_string())
        .await;
    assert_eq!(status, 400);
    assert!(json.to_string().contains("sometimes"), "{json}");
    gw.shutdown().await;

    for (config, key) in [
        ("[gateway]\napproval = \"sometimes\"\n", "gateway.approval"),
        (
            "[gateway]\napproval = { exec = [\"[\"] }\n",
            "gateway.approval.exec[0]",
        ),
        (
            "[profiles.local]\nprovider = \"local\"\napproval = { write_outside = [\"a/[\"] }\n",
            "profiles.local.approval.write_outside[0]",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("skiff.toml");
        std::fs::write(&path, config).unwrap();
        let err = match skiff_gateway::start(skiff_gateway::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: Some(path),
        })
        .await
        {
            Ok(_) => panic!("a gateway started with {config}"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(key), "{config}: {err}");
    }
}

#[tokio::test]
async fn a_refused_message_leaves_the_sessions_policy_as_it_was() {
    let gw = TestGateway::start(EXEC_SCRIPT).await;
    let policy = rules(r#"{"exec":["rm *"]}"#);
    let (id, asked, cursor) = until_asked(&gw, "clean", Some(policy.clone())).await;
    // The session is busy: the message is refused, and its policy with it.
    let refused = gw
        .client
        .send(
            &id,
            &skiff_protocol::api::SendMessageRequest {
                prompt: "never mind asking".into(),
                profile: None,
                reasoning: None,
                approval: Some(ApprovalPolicy::Never),
                agent: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(refused.status, 409, "{:?}", refused.error);
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.session.approval, Some(policy));
    // The waiting call still waits under the policy it was asked under.
    let listed = gw.client.approvals(Some(&id)).await.unwrap().approvals;
    assert_eq!(listed[0].id, asked.id);
    assert_eq!(listed[0].state, ApprovalState::Pending);
    gw.client.decide(&asked.id, true, None).await.unwrap();
    gw.client.follow_until_run_end(&id, cursor).await;
    // Once admitted, the message's policy is the session's.
    let started = gw
        .client
        .send(
            &id,
            &skiff_protocol::api::SendMessageRequest {
                prompt: "again".into(),
                profile: None,
                reasoning: None,
                approval: Some(ApprovalPolicy::Never),
                agent: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(started.session.approval, Some(ApprovalPolicy::Never));
    gw.shutdown().await;
}
