//! MCP servers on the gateway: a stdio server (`skiff-test-support`'s `fake-mcp-server`, which
//! speaks the MCP stdio wire format) started by an in-process gateway; its allowlisted tools
//! offered to the model and run here, audited.

use crate::harness::{TestGateway, session_request};
use serde_json::Value;
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::{FakeResponse, openai_sse};

fn tool_reply(id: &str, name: &str, args: &str) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&["On it."]);
    events.extend(openai_sse::tool_call(0, id, name, args, 2));
    events.extend(openai_sse::finish("tool_calls"));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

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

fn server_config(name: &str, tools: &str, marker_dir: &std::path::Path) -> String {
    format!(
        "[mcp.{name}]\ncommand = \"{}\"\ntools = {tools}\ntimeout_s = 5\n\
         env = {{ FAKE_MCP_MARKER_DIR = \"{}\", FAKE_MCP_GREETING = \"env:PATH\" }}\n",
        skiff_test_support::fake_mcp_server().display(),
        marker_dir.display(),
    )
}

/// The tool names of a chat-completions request body.
fn offered(body: &[u8]) -> Vec<String> {
    let body: Value = serde_json::from_slice(body).unwrap();
    body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn an_allowlisted_mcp_tool_is_offered_and_runs_on_the_gateway_audited() {
    let markers = tempfile::tempdir().unwrap();
    let responses = vec![
        tool_reply("call_1", "mcp__fake__whoami", r#"{"note":"hello"}"#),
        tool_reply("call_2", "mcp__fake__fail", "{}"),
        tool_reply("call_3", "mcp__fake__forbidden", "{}"),
        answer("done"),
    ];
    let gw = TestGateway::configured(
        "",
        &server_config("fake", r#"["whoami", "fail"]"#, markers.path()),
        Some(responses),
    )
    .await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "who are you"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    gw.client.follow_until_run_end(&id, 0).await;

    // Offered after the built-in tools, sorted; the tool off the allowlist is not.
    let requests = gw.provider.as_ref().unwrap().requests();
    let names = offered(&requests[0].body);
    let mcp: Vec<&str> = names
        .iter()
        .filter(|n| n.starts_with("mcp__"))
        .map(String::as_str)
        .collect();
    assert_eq!(mcp, ["mcp__fake__fail", "mcp__fake__whoami"], "{names:?}");
    let first_mcp = names.iter().position(|n| n.starts_with("mcp__")).unwrap();
    assert!(names[..first_mcp].contains(&"read".to_owned()), "{names:?}");
    let body: Value = serde_json::from_slice(&requests[0].body).unwrap();
    let spec = body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == "mcp__fake__whoami")
        .unwrap();
    assert_eq!(
        spec["function"]["description"],
        "Says which process answered."
    );
    assert_eq!(
        spec["function"]["parameters"]["properties"]["note"]["type"],
        "string"
    );

    // The calls ran on the gateway: the server is this process's child, with its `env`.
    let detail = gw.client.session(&id).await.unwrap();
    let results: Vec<(String, String, bool)> = detail
        .transcript
        .iter()
        .filter_map(|e| match &e.body {
            EntryBody::ToolResult {
                name,
                content,
                is_error,
                ..
            } => Some((name.clone(), content.clone(), *is_error)),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 3, "{results:?}");
    let (name, content, is_error) = &results[0];
    assert_eq!(name, "mcp__fake__whoami");
    assert!(!is_error, "{content}");
    let path = std::env::var("PATH").unwrap();
    assert!(
        content.contains(&format!("parent {} ", std::process::id())),
        "the server is not the gateway's child: {content}"
    );
    assert!(
        content.contains(&format!("greeting {path} note hello")),
        "{content}"
    );
    assert_eq!(std::fs::read_dir(markers.path()).unwrap().count(), 1);
    assert_eq!(
        results[1],
        ("mcp__fake__fail".into(), "it broke".into(), true)
    );
    let (name, content, is_error) = &results[2];
    assert_eq!(name, "mcp__fake__forbidden");
    assert!(
        *is_error && content.contains("not a tool this gateway offers"),
        "{content}"
    );

    // Audited: server, tool, status, duration; never the arguments or the content.
    let db = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    let mut rows = db
        .prepare("SELECT decision, detail FROM audit WHERE action = 'mcp.call' ORDER BY id")
        .unwrap();
    let rows: Vec<(String, Value)> = rows
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                serde_json::from_str(&r.get::<_, String>(1)?).unwrap(),
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(rows[0].0, "allowed");
    assert_eq!(rows[0].1["server"], "fake");
    assert_eq!(rows[0].1["tool"], "whoami");
    assert_eq!(rows[0].1["status"], "ok");
    assert!(rows[0].1["duration_ms"].is_u64(), "{rows:?}");
    assert_eq!(rows[1].1["status"], "tool_error");
    assert_eq!(rows[2].0, "refused");
    let text = format!("{rows:?}");
    assert!(!text.contains("hello") && !text.contains(&path), "{text}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_server_that_never_answers_is_a_tool_error_naming_the_timeout() {
    let markers = tempfile::tempdir().unwrap();
    let responses = vec![tool_reply("call_1", "mcp__slow__hang", "{}"), answer("ok")];
    let config = server_config("slow", r#"["hang"]"#, markers.path())
        .replace("timeout_s = 5", "timeout_s = 1");
    let gw = TestGateway::configured("", &config, Some(responses)).await;
    let ws = gw.plain_dir("ws", &[]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "wait"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let detail = gw.client.session(&started.session.id).await.unwrap();
    let result = detail
        .transcript
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .unwrap();
    assert!(result.1, "{result:?}");
    assert!(
        result.0.contains("within 1 s") && result.0.contains("mcp.slow.timeout_s"),
        "{result:?}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_server_that_cannot_start_leaves_its_tools_out_and_the_gateway_up() {
    let gw = TestGateway::configured(
        "",
        "[mcp.gone]\ncommand = \"/nonexistent/mcp-server\"\ntools = [\"x\"]\n",
        Some(vec![answer("hi")]),
    )
    .await;
    let ws = gw.plain_dir("ws", &[]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "hi"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let requests = gw.provider.as_ref().unwrap().requests();
    let names = offered(&requests[0].body);
    assert!(names.contains(&"read".to_owned()), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("mcp__")), "{names:?}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_bad_mcp_table_stops_the_gateway_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    for (text, key) in [
        ("[mcp.search]\ntools = [\"query\"]\n", "mcp.search.command"),
        (
            "[mcp.search]\ncommand = \"search-mcp\"\n",
            "mcp.search.tools",
        ),
    ] {
        std::fs::write(&config, text).unwrap();
        let err = skiff_gateway::start(skiff_gateway::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: Some(config.clone()),
        })
        .await
        .err()
        .expect("the gateway started with a bad [mcp] table");
        let text = err.to_string();
        assert!(text.contains(key), "{text}");
    }
}

/// A streamable-HTTP MCP server: JSON answers to POSTs, a session id, no server stream, and
/// every request refused without the bearer token and header the test configured.
async fn http_server(bearer: String) -> (String, tokio::task::JoinHandle<()>) {
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    let post = move |headers: HeaderMap, body: axum::body::Bytes| {
        let bearer = bearer.clone();
        async move {
            let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
            let key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
            if auth != Some(format!("Bearer {bearer}").as_str()) || key != Some("k-123") {
                return StatusCode::UNAUTHORIZED.into_response();
            }
            let message: Value = serde_json::from_slice(&body).unwrap();
            let Some(id) = message.get("id").cloned() else {
                return StatusCode::ACCEPTED.into_response();
            };
            let result = match message["method"].as_str().unwrap() {
                "initialize" => serde_json::json!({
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "http-fake", "version": "1"},
                }),
                "tools/list" => serde_json::json!({"tools": [
                    {"name": "lookup", "description": "Looks up.", "inputSchema": {"type": "object"}},
                ]}),
                "tools/call" => serde_json::json!({
                    "content": [{"type": "text", "text": "answered over HTTP"}],
                }),
                other => panic!("unexpected {other}"),
            };
            (
                [
                    ("content-type", "application/json"),
                    ("mcp-session-id", "s-1"),
                ],
                serde_json::json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string(),
            )
                .into_response()
        }
    };
    let app = axum::Router::new().route(
        "/mcp",
        axum::routing::post(post)
            .get(|| async { StatusCode::METHOD_NOT_ALLOWED })
            .delete(|| async { StatusCode::OK }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (url, task)
}

#[tokio::test]
async fn an_http_server_is_reached_with_its_bearer_and_headers() {
    let path = std::env::var("PATH").unwrap();
    let (url, server) = http_server(path).await;
    let responses = vec![
        tool_reply("call_1", "mcp__remote__lookup", r#"{}"#),
        answer("done"),
    ];
    let config = format!(
        "[mcp.remote]\nurl = \"{url}\"\nbearer = \"env:PATH\"\nheaders = {{ X-Api-Key = \"k-123\" }}\ntools = [\"lookup\"]\ntimeout_s = 5\n"
    );
    let gw = TestGateway::configured("", &config, Some(responses)).await;
    let ws = gw.plain_dir("ws", &[]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "look"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let requests = gw.provider.as_ref().unwrap().requests();
    assert!(offered(&requests[0].body).contains(&"mcp__remote__lookup".to_owned()));
    let detail = gw.client.session(&started.session.id).await.unwrap();
    let result = detail
        .transcript
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .unwrap();
    assert_eq!(result, ("answered over HTTP".to_owned(), false));
    gw.shutdown().await;
    server.abort();
}
