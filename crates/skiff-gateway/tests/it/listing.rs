//! The session list a page at a time: most recently active first, every session exactly once
//! across the pages, and a clear refusal for a page that cannot be read.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::SessionId;
use skiff_protocol::api::SessionList;

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

async fn page(gw: &TestGateway, query: &str) -> SessionList {
    let (status, body) = gw
        .client
        .raw(reqwest::Method::GET, &format!("/v1/sessions{query}"), "")
        .await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_value(body).unwrap()
}

#[tokio::test]
async fn pages_of_the_session_list_hold_every_session_once_newest_activity_first() {
    let gw = TestGateway::start(DONE).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let mut made: Vec<SessionId> = Vec::new();
    for n in 0..5 {
        let started = gw
            .client
            .create_session(&session_request(&ws, "fake/x", format!("task {n}")))
            .await
            .unwrap();
        gw.client.follow_until_run_end(&started.session.id, 0).await;
        made.push(started.session.id);
    }
    let everything = gw.client.sessions().await.unwrap();
    assert_eq!(everything.sessions.len(), 5);
    assert!(everything.next.is_none(), "one page holds five sessions");

    let mut seen: Vec<SessionId> = Vec::new();
    let mut query = "?limit=2".to_owned();
    let mut pages = 0;
    loop {
        let list = page(&gw, &query).await;
        pages += 1;
        assert!(list.sessions.len() <= 2);
        seen.extend(list.sessions.iter().map(|s| s.id.clone()));
        match list.next {
            Some(next) => {
                assert_eq!(
                    Some(&next),
                    seen.last(),
                    "next names the page's last session"
                );
                query = format!("?limit=2&before={next}");
            }
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let listed: Vec<SessionId> = everything.sessions.iter().map(|s| s.id.clone()).collect();
    assert_eq!(
        seen, listed,
        "the pages together are the whole list, in order"
    );
    // The newest activity first: the last session made finished last.
    made.reverse();
    assert_eq!(seen, made);
    // Each line carries its session's newest run, from the same query.
    assert!(
        everything.sessions.iter().all(|s| s
            .last_run
            .as_ref()
            .is_some_and(|r| r.status.as_str() == "succeeded")),
        "{:?}",
        everything.sessions
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_page_that_cannot_be_read_is_refused_saying_why() {
    let gw = TestGateway::start(DONE).await;
    for (query, status, words) in [
        ("?limit=0", 400, "limit=0 is out of range"),
        ("?limit=5000", 400, "1 to 1000"),
        ("?limit=many", 400, "?limit=N"),
        ("?before=nonsense", 400, "not a session id"),
        ("?colour=blue", 400, "?before=SESSION_ID"),
    ] {
        let (got, body) = gw
            .client
            .raw(reqwest::Method::GET, &format!("/v1/sessions{query}"), "")
            .await;
        assert_eq!(got, status, "{query}: {body}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.contains(words), "{query}: {message}");
    }
    let unknown = SessionId::from_suffix("01jz0000000000000000000000");
    let (got, body) = gw
        .client
        .raw(
            reqwest::Method::GET,
            &format!("/v1/sessions?before={unknown}"),
            "",
        )
        .await;
    assert_eq!(got, 404, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains(unknown.as_str()),
        "{body}"
    );
    gw.shutdown().await;
}
