//! What an operator's tooling reads: liveness and readiness without a token, and the
//! gauges in Prometheus' text format behind one.

use crate::harness::{TestGateway, session_request};

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

async fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

#[tokio::test]
async fn healthz_and_readyz_answer_without_a_token_and_readyz_follows_the_database() {
    let gw = TestGateway::start(DONE).await;
    let url = gw.client.url.clone();
    assert_eq!(
        get(&format!("{url}/healthz"), None).await,
        (200, "ok\n".into())
    );
    assert_eq!(
        get(&format!("{url}/readyz"), None).await,
        (200, "ready\n".into())
    );

    let db = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    db.execute_batch("ALTER TABLE runs RENAME TO runs_unreadable")
        .unwrap();
    let (status, body) = get(&format!("{url}/readyz"), None).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("database does not answer"), "{body}");
    assert!(
        !body.contains("runs"),
        "the database's own words reached an unauthenticated client: {body}"
    );
    assert_eq!(
        get(&format!("{url}/healthz"), None).await.0,
        200,
        "alive all the same"
    );
    db.execute_batch("ALTER TABLE runs_unreadable RENAME TO runs")
        .unwrap();
    assert_eq!(get(&format!("{url}/readyz"), None).await.0, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn metrics_count_sessions_and_runs_in_the_text_format_behind_the_token() {
    let gw = TestGateway::start(DONE).await;
    let url = format!("{}/metrics", gw.client.url);
    assert_eq!(get(&url, None).await.0, 401);

    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "fake/x", "hi"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;

    let (status, text) = get(&url, Some(gw.client.token())).await;
    assert_eq!(status, 200, "{text}");
    for line in [
        "skiff_sessions{placement=\"local\"} 1",
        "skiff_runs{status=\"succeeded\"} 1",
        "skiff_workers_connected 0",
        "skiff_workers_max 16",
        "skiff_box_model_requests_total 0",
        "# TYPE skiff_runs gauge",
        // What the gateway measured while the turn ran: its one model call and its tokens.
        "skiff_model_requests_total{placement=\"gateway\",outcome=\"ok\"} 1",
        "skiff_model_request_seconds_count{placement=\"gateway\",outcome=\"ok\"} 1",
        "# TYPE skiff_placement_step_seconds histogram",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    let appends = text
        .lines()
        .find_map(|l| l.strip_prefix("skiff_event_append_seconds_count "))
        .and_then(|n| n.parse::<u64>().ok());
    assert!(
        appends.is_some_and(|n| n > 0),
        "event writes are timed:\n{text}"
    );
    // Every line is a comment or `name{labels} value`, as scrapers parse it.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<f64>().is_ok(), "{line}");
        let name = series.split('{').next().unwrap();
        assert!(
            name.starts_with("skiff_") && name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "{line}"
        );
    }
    assert!(
        !text.contains(started.session.id.as_str()),
        "metrics name no session"
    );
    gw.shutdown().await;
}

/// The dashboard in the repository asks only for series the gateway exports: a renamed metric
/// fails here, not on an operator's empty panel.
#[tokio::test]
async fn the_grafana_dashboard_queries_only_metrics_the_gateway_exports() {
    let gw = TestGateway::start(DONE).await;
    let (status, text) = get(
        &format!("{}/metrics", gw.client.url),
        Some(gw.client.token()),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../ops/grafana/skiff.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.len() >= 10, "a dashboard of the main families");
    for panel in panels {
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{panel}");
        for target in targets {
            let expr = target["expr"].as_str().unwrap();
            let names: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("skiff_"))
                .collect();
            assert!(!names.is_empty(), "{expr}");
            for name in names {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(name);
                assert!(
                    exported.contains(&family),
                    "panel {:?} asks for {name}, which /metrics does not export",
                    panel["title"]
                );
            }
        }
    }
    gw.shutdown().await;
}
