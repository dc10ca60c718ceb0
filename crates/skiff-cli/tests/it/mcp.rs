//! MCP servers with real worker boxes: a worker session is offered the gateway's MCP tools
//! (the same bytes as a local session's), and its calls run on the gateway — the server is
//! the gateway's child, and nothing of it (binary, marker, credential) reaches the box.

use crate::harness::stderr;
use crate::worker::{Rig, files_containing, new_worker_session, text_reply, tool_reply};
use serde_json::Value;
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::TempGitRepo;

/// A value only the gateway's environment holds; the server gets it through `env:VAR`.
const GREETING: &str = "greeting-only-the-gateway-knows-5e1d";

fn tools_of(request: &skiff_test_support::RecordedRequest) -> Vec<Value> {
    let body: Value = serde_json::from_slice(&request.body).unwrap();
    body["tools"].as_array().unwrap().clone()
}

fn names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_worker_sessions_mcp_call_runs_on_the_gateway_and_never_on_the_box() {
    let markers = tempfile::tempdir().unwrap();
    let responses = vec![
        tool_reply("call_1", "mcp__fake__whoami", r#"{"note":"from-local"}"#),
        text_reply(&["done"]),
        tool_reply("call_1", "mcp__fake__whoami", r#"{"note":"from-box"}"#),
        text_reply(&["done"]),
    ];
    let config = format!(
        "[mcp.fake]\ncommand = \"{}\"\ntools = [\"whoami\"]\n\
         env = {{ FAKE_MCP_MARKER_DIR = \"{}\", FAKE_MCP_GREETING = \"env:SKIFF_TEST_MCP_GREETING\" }}\n",
        skiff_test_support::fake_mcp_server().display(),
        markers.path().display()
    );
    let rig = Rig::start_with_env(responses, &config, &[("SKIFF_TEST_MCP_GREETING", GREETING)]);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    rig.gw.new_session(repo.path(), "openai/gpt-fake", "who");
    let (out, remote) = new_worker_session(&rig, repo.path(), "who");
    assert!(out.status.success(), "worker session: {}", stderr(&out));

    // Both placements are offered the allowlisted tool (and not the others), with the same
    // bytes: the worker's list is the local one without the dispatch tools.
    let requests = rig.fake.requests();
    assert_eq!(requests.len(), 4);
    let local_tools = tools_of(&requests[0]);
    let worker_tools = tools_of(&requests[2]);
    let local_names = names(&local_tools);
    assert!(
        local_names.contains(&"mcp__fake__whoami".to_owned()),
        "{local_names:?}"
    );
    assert!(
        !local_names.iter().any(|n| n.contains("forbidden")),
        "{local_names:?}"
    );
    let without_dispatch: Vec<Value> = local_tools
        .into_iter()
        .filter(|t| {
            !t["function"]["name"]
                .as_str()
                .unwrap()
                .starts_with("dispatch")
        })
        .collect();
    assert_eq!(
        serde_json::to_string(&without_dispatch).unwrap(),
        serde_json::to_string(&worker_tools).unwrap(),
        "the tool lists differ between placements"
    );

    // The worker session's call was answered by the gateway's child, with the gateway's
    // secret, and wrote its marker on the gateway's side.
    let detail = rig.gw.json(&["session", "show", "--json", &remote]);
    let transcript: Vec<EntryBody> =
        serde_json::from_value(Value::Array(crate::worker::semantic(&detail["transcript"])))
            .unwrap();
    let content = transcript
        .iter()
        .find_map(|e| match e {
            EntryBody::ToolResult {
                name,
                content,
                is_error: false,
                ..
            } if name == "mcp__fake__whoami" => Some(content.clone()),
            _ => None,
        })
        .expect("no successful mcp__fake__whoami result");
    assert!(
        content.contains(&format!("parent {} ", rig.gw.pid())),
        "the server is not the gateway's child: {content}"
    );
    assert!(content.contains(GREETING), "{content}");
    let written: Vec<String> = std::fs::read_dir(markers.path())
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    assert_eq!(written, ["from-box"], "one server answered both sessions");

    // Nothing of the server is on the box: not its binary, its marker, or its secret.
    let hits = files_containing(
        rig.root.path(),
        &["fake-mcp-server", "fake-mcp-marker", GREETING],
    );
    assert!(hits.is_empty(), "the box holds MCP server traces: {hits:?}");

    // Counted as the environment's controlled egress, and audited without the content.
    let env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let shown = rig.gw.json(&["env", "show", "--json", &env]);
    assert_eq!(shown["accounting"]["gateway_tool_calls"], 1, "{shown}");
    let store = rig.gw.store();
    let calls: Vec<Value> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "mcp.call")
        .map(|r| r.detail)
        .collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0]["env"], Value::Null);
    assert_eq!(calls[1]["env"], env.as_str());
    assert_eq!(calls[1]["server"], "fake");
    assert_eq!(calls[1]["tool"], "whoami");
    assert_eq!(calls[1]["status"], "ok");
    let dump = format!("{calls:?}");
    assert!(
        !dump.contains("from-box") && !dump.contains(GREETING),
        "{dump}"
    );
}
