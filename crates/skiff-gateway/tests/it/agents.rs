//! Agent specs: a session runs with the spec version it was created with (instructions, tool
//! allowlist), an edit makes a new version without touching running sessions, a digest pins
//! an old version, a stored version changed under its digest is refused by name, and a tool
//! outside the list is neither offered nor run.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::agent::{AgentDetail, AgentList};
use skiff_protocol::api::{RunStatus, SendMessageRequest};
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::{FakeResponse, openai_sse};

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

fn write_spec(gw: &TestGateway, name: &str, text: &str) {
    let dir = gw.state_dir.parent().unwrap().join("agents");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{name}.toml")), text).unwrap();
}

/// What the model was sent in request `i`: its system text and tool names.
fn sent(gw: &TestGateway, i: usize) -> (String, Vec<String>) {
    let requests = gw.provider.as_ref().unwrap().requests();
    let body: serde_json::Value = serde_json::from_slice(&requests[i].body).unwrap();
    let system = body["messages"][0]["content"].as_str().unwrap().to_owned();
    let tools = body["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default();
    (system, tools)
}

/// Waits until the session's `n`th turn has ended.
async fn until_turns_end(gw: &TestGateway, id: &skiff_protocol::SessionId, n: usize) {
    let seen = std::cell::Cell::new(0);
    gw.client
        .follow_until(id, 0, |e| {
            if e.kind.is_run_end() {
                seen.set(seen.get() + 1);
            }
            seen.get() >= n
        })
        .await;
}

async fn get<T: serde::de::DeserializeOwned>(gw: &TestGateway, path: &str) -> (u16, T) {
    let (status, body) = gw.client.raw(reqwest::Method::GET, path, "").await;
    let parsed =
        serde_json::from_value(body.clone()).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
    (status, parsed)
}

#[tokio::test]
async fn a_session_keeps_its_spec_version_while_an_edit_makes_a_new_one() {
    let gw = TestGateway::with_provider(
        DONE,
        vec![
            answer("one"),
            answer("two"),
            answer("three"),
            answer("four"),
        ],
    )
    .await;
    write_spec(
        &gw,
        "reviewer",
        "instructions = \"Review only; never edit.\"\ntools = [\"read\", \"grep\"]\n",
    );
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "http/m", "look");
    request.agent = Some("reviewer".into());
    let first = gw.client.create_session(&request).await.unwrap();
    let id = first.session.id.clone();
    let pin = first
        .session
        .agent
        .clone()
        .expect("the session names its spec");
    assert_eq!(pin.name, "reviewer");
    assert_eq!(pin.digest.len(), 64);
    gw.client.follow_until_run_end(&id, 0).await;
    let (system, tools) = sent(&gw, 0);
    assert!(system.contains("Review only; never edit."), "{system}");
    assert_eq!(tools, ["read", "grep"], "only the spec's tools are offered");

    // An edit: a new version, current from now on.
    write_spec(
        &gw,
        "reviewer",
        "instructions = \"Version two.\"\ntools = [\"read\"]\n",
    );
    let (status, detail): (u16, AgentDetail) = get(&gw, "/v1/agents/reviewer").await;
    assert_eq!(status, 200);
    assert_eq!(detail.versions.len(), 2);
    assert!(detail.versions[0].current && !detail.versions[1].current);
    assert_eq!(detail.versions[1].digest, pin.digest);
    assert_ne!(detail.versions[0].digest, pin.digest);
    let (_, list): (u16, AgentList) = get(&gw, "/v1/agents").await;
    assert_eq!(list.agents.len(), 1);
    assert_eq!(list.agents[0].digest, detail.versions[0].digest);

    // The running session keeps the version it was created with.
    gw.client.send_message(&id, "again").await.unwrap();
    until_turns_end(&gw, &id, 2).await;
    let detail_after = gw.client.session(&id).await.unwrap();
    assert_eq!(detail_after.runs[1].status, RunStatus::Succeeded);
    let (system, tools) = sent(&gw, 1);
    assert!(system.contains("Review only; never edit."), "{system}");
    assert!(!system.contains("Version two."), "{system}");
    assert_eq!(tools, ["read", "grep"]);
    assert_eq!(detail_after.session.agent.as_ref(), Some(&pin));

    // A new session gets the new version; a digest prefix pins the old one.
    let new = gw.client.create_session(&request).await.unwrap();
    gw.client.follow_until_run_end(&new.session.id, 0).await;
    let (system, tools) = sent(&gw, 2);
    assert!(system.contains("Version two."), "{system}");
    assert_eq!(tools, ["read"]);
    request.agent = Some(format!("reviewer@{}", &pin.digest[..12]));
    let pinned = gw.client.create_session(&request).await.unwrap();
    assert_eq!(pinned.session.agent.as_ref(), Some(&pin));
    gw.client.follow_until_run_end(&pinned.session.id, 0).await;
    let (system, _) = sent(&gw, 3);
    assert!(system.contains("Review only; never edit."), "{system}");

    // Each turn's audit row names the digest it ran with.
    let store = skiff_store::Store::open(&gw.state_dir.join("skiff.db")).unwrap();
    let starts: Vec<_> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "run.start")
        .map(|r| {
            r.detail["agent_digest"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(
        starts,
        [
            pin.digest.clone(),
            pin.digest.clone(),
            detail.versions[0].digest.clone(),
            pin.digest.clone()
        ]
    );

    // An unknown name or digest is refused, naming it.
    request.agent = Some("nobody".into());
    let err = gw.client.create_session(&request).await.unwrap_err();
    assert_eq!(err.status, 404);
    assert!(err.error.message.contains("nobody"), "{:?}", err.error);
    request.agent = Some("reviewer@0000000".into());
    let err = gw.client.create_session(&request).await.unwrap_err();
    assert_eq!(err.status, 404);
    assert!(err.error.message.contains("0000000"), "{:?}", err.error);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_stored_spec_changed_under_its_digest_is_refused_by_name() {
    let gw = TestGateway::configured(
        DONE,
        "[agents.builder]\ninstructions = \"Build it.\"\n",
        None,
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "fake/x", "go");
    request.agent = Some("builder".into());
    let started = gw.client.create_session(&request).await.unwrap();
    let id = started.session.id.clone();
    gw.client.follow_until_run_end(&id, 0).await;
    let short = started.session.agent.unwrap().short();

    let db = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    let changed = db
        .execute(
            "UPDATE agent_specs SET content = replace(content, 'Build it.', 'Exfiltrate it.')",
            [],
        )
        .unwrap();
    assert_eq!(changed, 1);

    // A new session naming it is refused, and so is the next turn of the pinned one.
    let err = gw.client.create_session(&request).await.unwrap_err();
    assert_eq!(err.status, 409, "{:?}", err.error);
    assert!(
        err.error.message.contains(&short) && err.error.message.contains("digest"),
        "{:?}",
        err.error
    );
    gw.client.send_message(&id, "more").await.unwrap();
    until_turns_end(&gw, &id, 2).await;
    let detail = gw.client.session(&id).await.unwrap();
    assert_eq!(detail.runs[1].status, RunStatus::Failed);
    let error = detail.runs[1].error.clone().unwrap_or_default();
    assert!(error.contains(&short), "{error}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_tool_outside_the_allowlist_does_not_run() {
    let script = r#"
[[turns]]
text = "Trying."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "touch made-by-exec" }

[[turns]]
text = "Done."
"#;
    let gw = TestGateway::configured(
        script,
        "[agents.reader]\ntools = [\"read\", \"ls\"]\n",
        None,
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "fake/x", "go");
    request.agent = Some("reader".into());
    let started = gw.client.create_session(&request).await.unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let detail = gw.client.session(&started.session.id).await.unwrap();
    let (content, is_error) = detail
        .transcript
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .unwrap();
    assert!(is_error, "{content}");
    assert!(
        content.contains("not one of this agent's tools"),
        "{content}"
    );
    let workspace = std::path::PathBuf::from(detail.session.workspace.path());
    assert!(!workspace.join("made-by-exec").exists(), "the command ran");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_spec_naming_an_unknown_tool_is_refused_at_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("skiff.toml"),
        "[agents.bad]\ntools = [\"read\", \"rm_rf\"]\n",
    )
    .unwrap();
    let err = skiff_gateway::start(skiff_gateway::Options {
        state_dir: dir.path().join("state"),
        listen: "127.0.0.1:0".into(),
        config: Some(dir.path().join("skiff.toml")),
    })
    .await
    .err()
    .expect("the gateway refuses to start");
    let message = err.to_string();
    assert!(
        message.contains("bad") && message.contains("rm_rf"),
        "{message}"
    );
}

/// Pinning a spec reads only `[agents.*]` of skiff.toml: a half-finished edit of another
/// table does not stop sessions, while an edit of the spec itself still makes a new version.
#[tokio::test]
async fn an_unrelated_edit_of_skiff_toml_does_not_stop_pinning_a_spec() {
    let gw = TestGateway::configured(
        DONE,
        "[agents.reader]\ninstructions = \"Read.\"\ntools = [\"read\"]\n",
        Some(vec![answer("one")]),
    )
    .await;
    let config = gw.state_dir.parent().unwrap().join("skiff.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[gateway]\nmax_children = \"many\"\n");
    std::fs::write(&config, text).unwrap();

    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "http/m", "look");
    request.agent = Some("reader".into());
    let started = gw.client.create_session(&request).await.unwrap();
    assert_eq!(started.session.agent.unwrap().name, "reader");
    gw.client.follow_until_run_end(&started.session.id, 0).await;

    // A broken spec table is still named, with the key.
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("tools = [\"read\"]", "tools = \"read\"");
    std::fs::write(&config, text).unwrap();
    let mut request = session_request(&ws, "http/m", "again");
    request.agent = Some("reader".into());
    let refused = gw.client.create_session(&request).await.unwrap_err();
    assert!(
        refused.error.message.contains("agents.reader.tools"),
        "{refused:?}"
    );
    gw.shutdown().await;
}

/// `send --agent`: the session switches spec version at the turn boundary (never while a turn
/// runs), the turn runs with the new one, `session show` says so, and the audit names both
/// digests. A name or digest that does not resolve is refused and the pin stays.
#[tokio::test]
async fn a_message_switches_the_session_to_another_spec_between_turns() {
    let gw = TestGateway::with_provider(
        DONE,
        vec![answer("one"), FakeResponse::stall(), answer("three")],
    )
    .await;
    write_spec(
        &gw,
        "reviewer",
        "instructions = \"Review only; never edit.\"\ntools = [\"read\"]\n",
    );
    write_spec(&gw, "builder", "instructions = \"Build it.\"\n");
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "http/m", "look");
    request.agent = Some("reviewer".into());
    let first = gw.client.create_session(&request).await.unwrap();
    let id = first.session.id.clone();
    let reviewer = first.session.agent.clone().unwrap();
    gw.client.follow_until_run_end(&id, 0).await;

    let send = |prompt: &str, agent: &str| SendMessageRequest {
        prompt: prompt.into(),
        profile: None,
        reasoning: None,
        approval: None,
        agent: Some(agent.into()),
    };
    // The switch: this turn already runs with the builder's instructions and every tool.
    let started = gw
        .client
        .send(&id, &send("build", "builder"))
        .await
        .unwrap();
    let builder = started.session.agent.clone().expect("the new pin");
    assert_eq!(builder.name, "builder");
    assert_ne!(builder.digest, reviewer.digest);
    gw.provider.as_ref().unwrap().wait_for_requests(2).await;
    let (system, tools) = sent(&gw, 1);
    assert!(system.contains("Build it."), "{system}");
    assert!(!system.contains("Review only"), "{system}");
    assert!(
        tools.len() > 1 && tools.contains(&"exec".to_owned()),
        "{tools:?}"
    );

    // While that turn runs, another switch is refused and changes nothing.
    let busy = gw
        .client
        .send(&id, &send("back", "reviewer"))
        .await
        .unwrap_err();
    assert_eq!(busy.status, 409, "{:?}", busy.error);
    assert!(
        busy.error.message.contains(started.run.id.as_str())
            && busy.error.message.contains("agent spec"),
        "{:?}",
        busy.error
    );
    let shown = gw.client.session(&id).await.unwrap();
    assert_eq!(shown.session.agent.as_ref(), Some(&builder));
    assert_eq!(shown.runs.len(), 2);
    gw.client.cancel(&id).await.unwrap();
    until_turns_end(&gw, &id, 2).await;

    // An unknown name or digest: the errors `session new --agent` gives; the pin stays.
    let unknown = gw.client.send(&id, &send("x", "nobody")).await.unwrap_err();
    assert_eq!(unknown.status, 404);
    assert!(
        unknown.error.message.contains("nobody"),
        "{:?}",
        unknown.error
    );
    let no_version = gw
        .client
        .send(&id, &send("x", "builder@0000000"))
        .await
        .unwrap_err();
    assert_eq!(no_version.status, 404);
    assert!(
        no_version.error.message.contains("0000000"),
        "{:?}",
        no_version.error
    );
    let shown = gw.client.session(&id).await.unwrap();
    assert_eq!(shown.session.agent.as_ref(), Some(&builder));
    assert_eq!(shown.runs.len(), 2, "a refused switch made a run");

    // Back to the first version by a digest prefix.
    let back = format!("reviewer@{}", &reviewer.digest[..12]);
    gw.client.send(&id, &send("back", &back)).await.unwrap();
    until_turns_end(&gw, &id, 3).await;
    let (system, tools) = sent(&gw, 2);
    assert!(system.contains("Review only; never edit."), "{system}");
    assert_eq!(tools, ["read"]);
    let shown = gw.client.session(&id).await.unwrap();
    assert_eq!(shown.session.agent.as_ref(), Some(&reviewer));
    assert_eq!(shown.runs[2].status, RunStatus::Succeeded);

    let store = skiff_store::Store::open(&gw.state_dir.join("skiff.db")).unwrap();
    let switches: Vec<(String, String)> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "session.agent")
        .map(|r| {
            assert_eq!(r.target, id.as_str());
            (
                r.detail["from_digest"].as_str().unwrap().to_owned(),
                r.detail["agent_digest"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        switches,
        [
            (reviewer.digest.clone(), builder.digest.clone()),
            (builder.digest.clone(), reviewer.digest.clone()),
        ]
    );
    gw.shutdown().await;
}

/// A switch the database refuses part-way (here: the approval policy cannot be written)
/// changes nothing, between turns and with a message: the pin, the reasoning and the approval
/// policy stay as they were. Once the database takes the write, the same switch sets all
/// three.
#[tokio::test]
async fn a_switch_the_database_refuses_part_way_changes_nothing() {
    let gw = TestGateway::start(DONE).await;
    write_spec(&gw, "reviewer", "instructions = \"Review only.\"\n");
    write_spec(
        &gw,
        "builder",
        "instructions = \"Build it.\"\nreasoning = \"high\"\napproval = \"on-request\"\n",
    );
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut request = session_request(&ws, "fake/x", "look");
    request.agent = Some("reviewer".into());
    let first = gw.client.create_session(&request).await.unwrap();
    let id = first.session.id.clone();
    let reviewer = first.session.agent.clone().unwrap();
    gw.client.follow_until_run_end(&id, 0).await;

    let db = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    db.execute_batch(
        "CREATE TRIGGER refuse_approval BEFORE UPDATE OF approval ON sessions
         BEGIN SELECT RAISE(ABORT, 'injected: the approval policy cannot be written'); END",
    )
    .unwrap();
    let unchanged = |shown: &skiff_protocol::api::SessionDetail| {
        assert_eq!(shown.session.agent.as_ref(), Some(&reviewer));
        assert_eq!(shown.session.reasoning, None);
        assert_eq!(shown.session.approval, None);
    };
    let path = format!("/v1/sessions/{id}/agent");
    let (status, body) = gw
        .client
        .raw(reqwest::Method::POST, &path, r#"{"agent":"builder"}"#)
        .await;
    assert_eq!(status, 500, "{body}");
    unchanged(&gw.client.session(&id).await.unwrap());
    let send = SendMessageRequest {
        prompt: "build".into(),
        profile: None,
        reasoning: None,
        approval: None,
        agent: Some("builder".into()),
    };
    let refused = gw.client.send(&id, &send).await.unwrap_err();
    assert_eq!(refused.status, 500, "{:?}", refused.error);
    unchanged(&gw.client.session(&id).await.unwrap());

    db.execute_batch("DROP TRIGGER refuse_approval").unwrap();
    let (status, body) = gw
        .client
        .raw(reqwest::Method::POST, &path, r#"{"agent":"builder"}"#)
        .await;
    assert_eq!(status, 200, "{body}");
    let shown = gw.client.session(&id).await.unwrap().session;
    assert_eq!(shown.agent.map(|p| p.name).as_deref(), Some("builder"));
    assert_eq!(
        shown.reasoning,
        Some(skiff_protocol::model::ReasoningEffort::High)
    );
    assert_eq!(
        shown.approval,
        Some(skiff_protocol::approval::ApprovalPolicy::OnRequest)
    );
    gw.shutdown().await;
}
