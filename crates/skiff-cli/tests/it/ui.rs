//! The Control UI's security edges against a real gateway: one-use login tickets, the session
//! cookie, cross-site refusals, and the headers every response carries.

use crate::harness::{Gateway, gateway_once, stderr};
use reqwest::StatusCode;
use reqwest::blocking::{Client, Response};
use reqwest::header::{CONTENT_SECURITY_POLICY, COOKIE, LOCATION, ORIGIN, SET_COOKIE};

const SCRIPT: &str = "[[turns]]\ntext = \"hi\"\n";

fn client() -> Client {
    Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// `skiff ui --json`: the login link.
fn login_url(gw: &Gateway) -> String {
    gw.json(&["ui", "--json"])["url"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The `skiff_session=…` pair a login response sets, and the whole Set-Cookie header.
fn session_cookie(resp: &Response) -> (String, String) {
    let header = resp
        .headers()
        .get(SET_COOKIE)
        .expect("a Set-Cookie header")
        .to_str()
        .unwrap()
        .to_owned();
    let pair = header.split(';').next().unwrap().trim().to_owned();
    assert!(pair.starts_with("skiff_session="), "{header}");
    (pair, header)
}

fn logged_in(gw: &Gateway) -> String {
    let resp = client().get(login_url(gw)).send().unwrap();
    assert_eq!(resp.status(), StatusCode::SEE_OTHER);
    session_cookie(&resp).0
}

#[test]
fn a_login_ticket_works_once_and_sets_a_strict_http_only_cookie() {
    let gw = Gateway::start(SCRIPT);
    let url = login_url(&gw);
    assert!(
        url.starts_with(&format!("{}/ui/login?ticket=skt_", gw.url)),
        "{url}"
    );

    let first = client().get(&url).send().unwrap();
    assert_eq!(first.status(), StatusCode::SEE_OTHER);
    assert_eq!(first.headers()[LOCATION], "/", "the ticket leaves the URL");
    let (cookie, header) = session_cookie(&first);
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(header.contains(attr), "{attr} missing from {header}");
    }
    assert!(!header.contains(&gw.token), "the cookie is not the token");

    let again = client().get(&url).send().unwrap();
    assert_eq!(again.status(), StatusCode::SEE_OTHER);
    assert_eq!(again.headers()[LOCATION], "/#login-expired");
    assert!(
        again.headers().get(SET_COOKIE).is_none(),
        "a used ticket sets nothing"
    );

    let sessions = client()
        .get(format!("{}/v1/sessions", gw.url))
        .header(COOKIE, &cookie)
        .send()
        .unwrap();
    assert_eq!(sessions.status(), StatusCode::OK);
}

#[test]
fn a_made_up_ticket_is_refused() {
    let gw = Gateway::start(SCRIPT);
    let resp = client()
        .get(format!("{}/ui/login?ticket=skt_guess", gw.url))
        .send()
        .unwrap();
    assert_eq!(resp.headers()[LOCATION], "/#login-expired");
    assert!(resp.headers().get(SET_COOKIE).is_none());
}

#[test]
fn tickets_are_only_minted_for_a_bearer_token() {
    let gw = Gateway::start(SCRIPT);
    let resp = client()
        .post(format!("{}/v1/ui/tickets", gw.url))
        .send()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let out = gw
        .cli()
        .args(["ui"])
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", "skf_wrong")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn without_a_cookie_or_token_the_api_answers_401() {
    let gw = Gateway::start(SCRIPT);
    for path in ["/v1/sessions", "/v1/events", "/v1/health"] {
        let resp = client().get(format!("{}{path}", gw.url)).send().unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{path}");
    }
    let forged = client()
        .get(format!("{}/v1/sessions", gw.url))
        .header(
            COOKIE,
            "skiff_session=v1.usr_admin.ten_default.99999999999999.x.00",
        )
        .send()
        .unwrap();
    assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
}

#[test]
fn a_cookie_authenticated_change_needs_this_gateways_origin() {
    let gw = Gateway::start(SCRIPT);
    let cookie = logged_in(&gw);
    let host = gw.url.trim_start_matches("http://");
    let post = |origin: Option<&str>| {
        let mut req = client()
            .post(format!("{}/v1/sessions", gw.url))
            .header(COOKIE, &cookie)
            .json(&serde_json::json!({ "prompt": "x", "workspace": "relative" }));
        if let Some(origin) = origin {
            req = req.header(ORIGIN, origin);
        }
        req.send().unwrap().status()
    };
    assert_eq!(post(None), StatusCode::FORBIDDEN, "no Origin");
    assert_eq!(post(Some("http://evil.example")), StatusCode::FORBIDDEN);
    assert_eq!(
        post(Some(&format!("http://{host}.evil.example"))),
        StatusCode::FORBIDDEN
    );
    // Same origin: past the check, refused by the handler for its bad workspace.
    assert_eq!(post(Some(&gw.url)), StatusCode::BAD_REQUEST);

    // A cross-site page opening the event stream (a WebSocket, say) sends a foreign Origin.
    let read = client()
        .get(format!("{}/v1/sessions", gw.url))
        .header(COOKIE, &cookie)
        .header(ORIGIN, "http://evil.example")
        .send()
        .unwrap();
    assert_eq!(read.status(), StatusCode::FORBIDDEN);

    // The refusals are audited, with their reason.
    let store = gw.store();
    let refused = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "auth" && r.decision == "denied")
        .count();
    assert!(refused >= 4, "{refused} audited refusals");
}

#[test]
fn logging_in_with_the_token_needs_the_same_origin_and_logout_revokes() {
    let gw = Gateway::start(SCRIPT);
    let login = |origin: Option<&str>, token: &str| {
        let mut req = client()
            .post(format!("{}/ui/login", gw.url))
            .json(&serde_json::json!({ "token": token }));
        if let Some(origin) = origin {
            req = req.header(ORIGIN, origin);
        }
        req.send().unwrap()
    };
    assert_eq!(login(None, &gw.token).status(), StatusCode::FORBIDDEN);
    assert_eq!(
        login(Some("http://evil.example"), &gw.token).status(),
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        login(Some(&gw.url), "skf_wrong").status(),
        StatusCode::UNAUTHORIZED
    );
    let ok = login(Some(&gw.url), &gw.token);
    assert_eq!(ok.status(), StatusCode::NO_CONTENT);
    let (cookie, _) = session_cookie(&ok);

    let sessions = |cookie: &str| {
        client()
            .get(format!("{}/v1/sessions", gw.url))
            .header(COOKIE, cookie)
            .send()
            .unwrap()
            .status()
    };
    assert_eq!(sessions(&cookie), StatusCode::OK);
    let logout = client()
        .post(format!("{}/ui/logout", gw.url))
        .header(COOKIE, &cookie)
        .header(ORIGIN, &gw.url)
        .send()
        .unwrap();
    assert_eq!(logout.status(), StatusCode::NO_CONTENT);
    assert!(
        logout.headers()[SET_COOKIE]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    assert_eq!(
        sessions(&cookie),
        StatusCode::UNAUTHORIZED,
        "a logged-out cookie is dead"
    );
}

#[test]
fn the_cookie_survives_a_gateway_restart() {
    let mut gw = Gateway::start(SCRIPT);
    let cookie = logged_in(&gw);
    gw.crash_and_restart();
    let resp = client()
        .get(format!("{}/v1/sessions", gw.url))
        .header(COOKIE, &cookie)
        .send()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

#[test]
fn a_logged_out_cookie_stays_refused_after_a_gateway_restart() {
    let mut gw = Gateway::start(SCRIPT);
    let cookie = logged_in(&gw);
    let kept = logged_in(&gw);
    let logout = client()
        .post(format!("{}/ui/logout", gw.url))
        .header(COOKIE, &cookie)
        .header(ORIGIN, &gw.url)
        .send()
        .unwrap();
    assert_eq!(logout.status(), StatusCode::NO_CONTENT);
    gw.crash_and_restart();
    let sessions = |cookie: &str| {
        client()
            .get(format!("{}/v1/sessions", gw.url))
            .header(COOKIE, cookie)
            .send()
            .unwrap()
            .status()
    };
    assert_eq!(
        sessions(&cookie),
        StatusCode::UNAUTHORIZED,
        "the logout was forgotten"
    );
    assert_eq!(
        sessions(&kept),
        StatusCode::OK,
        "another login is untouched"
    );
}

#[test]
fn the_cookie_is_secure_whenever_the_gateway_is_reached_over_https() {
    let gw = Gateway::start(SCRIPT);
    let plain = client().get(login_url(&gw)).send().unwrap();
    let (_, header) = session_cookie(&plain);
    assert!(!header.contains("Secure"), "plain HTTP: {header}");

    // A TLS-terminating proxy in front says so.
    let proxied = client()
        .get(login_url(&gw))
        .header("x-forwarded-proto", "https")
        .send()
        .unwrap();
    let (cookie, header) = session_cookie(&proxied);
    assert!(header.contains("; Secure"), "behind a TLS proxy: {header}");

    // The page itself was loaded over https.
    let host = gw.url.trim_start_matches("http://");
    let login = client()
        .post(format!("{}/ui/login", gw.url))
        .header(ORIGIN, format!("https://{host}"))
        .json(&serde_json::json!({ "token": gw.token }))
        .send()
        .unwrap();
    assert_eq!(login.status(), StatusCode::NO_CONTENT);
    let (_, header) = session_cookie(&login);
    assert!(header.contains("; Secure"), "https Origin: {header}");

    let logout = client()
        .post(format!("{}/ui/logout", gw.url))
        .header(COOKIE, &cookie)
        .header(ORIGIN, format!("https://{host}"))
        .send()
        .unwrap();
    let cleared = logout.headers()[SET_COOKIE].to_str().unwrap();
    assert!(
        cleared.contains("Max-Age=0") && cleared.contains("Secure"),
        "{cleared}"
    );
}

#[test]
fn listening_beyond_loopback_warns_what_is_exposed_and_how_to_add_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (_, out, err) = gateway_once(&dir.path().join("open"), "0.0.0.0:0");
    assert!(out.starts_with("skiff gateway listening on "), "{out}{err}");
    for says in [
        "not a loopback address",
        "plain HTTP",
        "bearer tokens",
        "cookies",
        "clear text",
        "reverse proxy that terminates TLS",
        "127.0.0.1",
    ] {
        assert!(err.contains(says), "{says:?} missing from: {err}");
    }
    let (_, out, err) = gateway_once(&dir.path().join("loopback"), "127.0.0.1:0");
    assert!(out.starts_with("skiff gateway listening on "), "{out}{err}");
    assert!(!err.contains("warning"), "loopback needs no warning: {err}");
}

#[test]
fn every_response_carries_a_strict_content_security_policy() {
    let gw = Gateway::start(SCRIPT);
    for (path, status) in [
        ("/", StatusCode::OK),
        ("/assets/app.js", StatusCode::OK),
        ("/assets/nope.js", StatusCode::NOT_FOUND),
        ("/v1/sessions", StatusCode::UNAUTHORIZED),
    ] {
        let resp = client().get(format!("{}{path}", gw.url)).send().unwrap();
        assert_eq!(resp.status(), status, "{path}");
        let csp = resp.headers()[CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.contains("default-src 'self'"), "{path}: {csp}");
        assert!(!csp.contains("unsafe-inline"), "{path}: {csp}");
        assert_eq!(resp.headers()["x-content-type-options"], "nosniff");
        assert_eq!(resp.headers()["x-frame-options"], "DENY");
    }
    let page = client()
        .get(format!("{}/", gw.url))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(page.contains(r#"<script type="module" src="/assets/app.js">"#));
    assert!(!page.contains(&gw.token));
}

#[test]
fn the_session_list_stream_sends_every_session_then_changes() {
    let gw = Gateway::start(SCRIPT);
    let repo = skiff_test_support::TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "hello",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let resp = client()
        .get(format!("{}/v1/events", gw.url))
        .bearer_auth(&gw.token)
        .send()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(resp));
    let mut events = Vec::new();
    let mut name = String::new();
    while let Some(Ok(line)) = lines.next() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_owned();
        } else if let Some(data) = line.strip_prefix("data: ") {
            events.push((
                name.clone(),
                serde_json::from_str::<serde_json::Value>(data).unwrap(),
            ));
            if name == "ready" {
                break;
            }
        }
    }
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0].0, "session");
    assert_eq!(events[0].1["title"], "hello");
    assert_eq!(events[0].1["placement"], "local");
    assert_eq!(events[0].1["last_run"]["status"], "succeeded");
}
