//! OpenTelemetry traces of a turn: a fake OTLP/HTTP collector on loopback receives the
//! gateway's `POST /v1/traces` (JSON `ExportTraceServiceRequest`), and the test reads one
//! turn's span tree from it; a collector that is down holds no turn.

use crate::harness::{TestGateway, session_request};
use axum::Router;
use axum::extract::State;
use axum::routing::post;
use serde_json::Value;
use std::collections::HashMap;
use tokio::sync::mpsc;

const READ_THEN_DONE: &str = r#"
[[turns]]
text = "Reading."
[[turns.tool_calls]]
name = "read"
arguments = { path = "secret-plan.txt" }

[[turns]]
text = "Done."
"#;

/// A collector on loopback: every span of every request it gets, in arrival order.
async fn collector() -> (String, mpsc::UnboundedReceiver<Value>) {
    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    let app = Router::new()
        .route(
            "/v1/traces",
            post(
                |State(tx): State<mpsc::UnboundedSender<Value>>, body: axum::body::Bytes| async move {
                    let request: Value = serde_json::from_slice(&body).unwrap();
                    for rs in request["resourceSpans"].as_array().unwrap() {
                        let service = rs["resource"]["attributes"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .find(|a| a["key"] == "service.name")
                            .map(|a| a["value"]["stringValue"].clone())
                            .unwrap();
                        assert_eq!(service, "skiff-test");
                        for ss in rs["scopeSpans"].as_array().unwrap() {
                            for span in ss["spans"].as_array().unwrap() {
                                let _ = tx.send(span.clone());
                            }
                        }
                    }
                    axum::Json(serde_json::json!({}))
                },
            ),
        )
        .with_state(tx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), rx)
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

#[tokio::test]
async fn a_turn_is_one_trace_of_its_model_requests_and_tool_calls() {
    let (endpoint, mut spans) = collector().await;
    let config =
        format!("[telemetry]\notlp_endpoint = \"{endpoint}\"\nservice_name = \"skiff-test\"\n");
    let gw = TestGateway::configured(READ_THEN_DONE, &config, None).await;
    let ws = gw.plain_dir("ws", &[("secret-plan.txt", "the plan\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "read the plan"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;

    // The root is exported last (it ends with the run); everything before it is its children.
    let mut got: Vec<Value> = Vec::new();
    let root = loop {
        let span = tokio::time::timeout(std::time::Duration::from_secs(30), spans.recv())
            .await
            .expect("the collector gets the turn's root span")
            .unwrap();
        got.push(span.clone());
        if span["name"] == "skiff.turn" {
            break span;
        }
    };
    let trace = root["traceId"].as_str().unwrap();
    assert_eq!(trace.len(), 32);
    assert!(root.get("parentSpanId").is_none());
    assert_eq!(
        attr(&root, "skiff.run_id").unwrap()["stringValue"],
        started.run.id.as_str()
    );
    assert_eq!(
        attr(&root, "skiff.run.status").unwrap()["stringValue"],
        "succeeded"
    );
    assert_eq!(root["status"]["code"], 1);
    let start = |s: &Value| {
        s["startTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let end = |s: &Value| {
        s["endTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };

    let mut by_name: HashMap<String, Vec<&Value>> = HashMap::new();
    for span in &got {
        assert_eq!(span["traceId"], trace, "one trace: {span}");
        if span["name"] != "skiff.turn" {
            assert_eq!(
                span["parentSpanId"], root["spanId"],
                "a child of the turn: {span}"
            );
            assert!(
                start(span) >= start(&root) && end(span) <= end(&root),
                "{span}"
            );
        }
        by_name
            .entry(span["name"].as_str().unwrap().to_owned())
            .or_default()
            .push(span);
    }
    let models = &by_name["skiff.model_request"];
    assert_eq!(models.len(), 2, "two model steps: {got:#?}");
    for m in models {
        assert_eq!(attr(m, "gen_ai.system").unwrap()["stringValue"], "fake");
        assert_eq!(attr(m, "gen_ai.request.model").unwrap()["stringValue"], "x");
        assert_eq!(
            attr(m, "skiff.placement").unwrap()["stringValue"],
            "gateway"
        );
        assert!(attr(m, "gen_ai.usage.input_tokens").is_some());
    }
    let tools = &by_name["skiff.tool_call"];
    assert_eq!(tools.len(), 1);
    assert_eq!(attr(tools[0], "tool.name").unwrap()["stringValue"], "read");
    // The tool's name only: neither its arguments nor its output.
    let all = serde_json::to_string(&got).unwrap();
    assert!(
        !all.contains("secret-plan") && !all.contains("the plan"),
        "{all}"
    );

    let (status, text) = {
        let resp = reqwest::Client::new()
            .get(format!("{}/metrics", gw.client.url))
            .bearer_auth(gw.client.token())
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    };
    assert_eq!(status, 200);
    assert!(
        text.lines()
            .any(|l| l == "skiff_trace_spans_dropped_total 0"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE skiff_trace_spans_exported_total counter"),
        "{text}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_collector_that_is_down_holds_no_turn() {
    // A port nobody listens on: bound, then closed.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = format!("[telemetry]\notlp_endpoint = \"http://127.0.0.1:{port}\"\n");
    let gw = TestGateway::configured(READ_THEN_DONE, &config, None).await;
    let ws = gw.plain_dir("ws", &[("secret-plan.txt", "the plan\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "read the plan"))
        .await
        .unwrap();
    let events = gw.client.follow_until_run_end(&started.session.id, 0).await;
    assert!(events.last().unwrap().kind.is_run_end());
    let detail = gw.client.session(&started.session.id).await.unwrap();
    assert_eq!(detail.runs.last().unwrap().status.as_str(), "succeeded");
    gw.shutdown().await;
}

#[tokio::test]
async fn an_endpoint_that_is_no_url_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(&config, "[telemetry]\notlp_endpoint = \"127.0.0.1:4318\"\n").unwrap();
    let err = skiff_gateway::start(skiff_gateway::Options {
        state_dir: dir.path().join("state"),
        listen: "127.0.0.1:0".into(),
        config: Some(config),
    })
    .await
    .err()
    .expect("refused");
    assert!(err.to_string().contains("telemetry.otlp_endpoint"), "{err}");
}
