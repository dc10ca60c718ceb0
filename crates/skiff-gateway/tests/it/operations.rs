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
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    // Every line is a comment or `name{labels} value`, as scrapers parse it.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<u64>().is_ok(), "{line}");
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
