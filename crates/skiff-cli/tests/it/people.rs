//! People and roles over the real gateway: users and tokens through the CLI, and every route of
//! the router tried by another tenant's admin, another user of the same tenant and a viewer,
//! each refused (or shown nothing) with the victim's rows unchanged.

use crate::harness::{Gateway, stderr, stdout};
use reqwest::blocking::Client;
use serde_json::{Value, json};
use skiff_gateway::{Kind, Need};
use skiff_test_support::TempGitRepo;
use std::io::{BufRead, BufReader};

const ONE_TURN: &str = r#"
[[turns]]
text = "Done."
"#;

/// Adds a user with the first admin's token and returns a token of theirs.
fn person(gw: &Gateway, email: &str, role: &str, tenant: &str, scope: &str) -> String {
    let out = gw.run(&[
        "admin", "user", "add", email, "--role", role, "--tenant", tenant,
    ]);
    assert!(out.status.success(), "user add {email}: {}", stderr(&out));
    token(gw, email, scope)
}

fn token(gw: &Gateway, email: &str, scope: &str) -> String {
    let out = gw.run(&[
        "admin",
        "token",
        "create",
        "--user",
        email,
        "--scope",
        scope,
        "--expires",
        "1d",
    ]);
    assert!(
        out.status.success(),
        "token create {email}: {}",
        stderr(&out)
    );
    let secret = stdout(&out).trim().to_owned();
    assert!(
        secret.starts_with("skf_"),
        "the secret is printed: {secret}"
    );
    assert!(!stderr(&out).contains(&secret), "printed once, on stdout");
    secret
}

/// The CLI as someone holding `token`.
fn as_user(gw: &Gateway, token: &str, args: &[&str]) -> std::process::Output {
    gw.cli()
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", token)
        .args(args)
        .output()
        .unwrap()
}

fn get_json(gw: &Gateway, token: &str, path: &str) -> Value {
    let resp = Client::new()
        .get(format!("{}{path}", gw.url))
        .bearer_auth(token)
        .send()
        .unwrap();
    assert!(resp.status().is_success(), "GET {path}: {}", resp.status());
    resp.json().unwrap()
}

/// What the victim and the first admin can see: it must be the same after every attempt.
fn world(gw: &Gateway, victim: &str, session: &str) -> Value {
    json!({
        "session": get_json(gw, victim, &format!("/v1/sessions/{session}")),
        "sessions": get_json(gw, victim, "/v1/sessions"),
        "approvals": get_json(gw, victim, "/v1/approvals"),
        "users": get_json(gw, &gw.token, "/v1/admin/users"),
        "tokens": get_json(gw, &gw.token, "/v1/admin/tokens"),
    })
}

/// A body each writing route accepts, so a refusal is the scope's and not the body's.
fn body_for(path: &str) -> Value {
    match path.rsplit('/').next().unwrap_or("") {
        "messages" => json!({ "prompt": "take over" }),
        "dispatch" => json!({ "profile": "local" }),
        "pull-back" => json!({ "cancel": true }),
        "restore" => json!({ "checkpoint": 0 }),
        "fork" => json!({ "at": 0 }),
        "export" => json!({ "to": "/tmp/skiff-people-export" }),
        "deny" => json!({ "reason": "not yours" }),
        "exec" => json!({ "command": "true" }),
        "accept" => json!({ "paths": ["a.txt"] }),
        _ => json!({}),
    }
}

#[test]
fn every_route_refuses_another_tenant_another_user_and_a_viewers_writes_and_changes_nothing() {
    let gw = Gateway::start(ONE_TURN);
    let victim = person(&gw, "ana@alpha.test", "member", "alpha", "write");
    let stranger = person(&gw, "bert@beta.test", "admin", "beta", "admin");
    let neighbour = person(&gw, "carl@alpha.test", "member", "alpha", "write");
    let viewer = person(&gw, "vera@alpha.test", "viewer", "alpha", "admin");

    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = as_user(
        &gw,
        &victim,
        &[
            "session",
            "new",
            "--json",
            "--workspace",
            repo.path().to_str().unwrap(),
            "--model",
            "fake/x",
            "hello",
        ],
    );
    assert!(out.status.success(), "session new: {}", stderr(&out));
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let session = first["session_id"].as_str().unwrap().to_owned();
    let shown = get_json(&gw, &victim, &format!("/v1/sessions/{session}"));
    let run = shown["runs"][0]["id"]
        .as_str()
        .or_else(|| shown["run"]["id"].as_str())
        .unwrap_or("run_missing")
        .to_owned();
    let tokens = get_json(&gw, &gw.token, "/v1/admin/tokens");
    let victim_token_id = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["email"] == "ana@alpha.test")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let secrets = ["ana@alpha.test", session.as_str(), victim_token_id.as_str()];
    let before = world(&gw, &victim, &session);

    let fill = |path: &str| -> String {
        let id = if path.starts_with("/v1/sessions/") {
            session.clone()
        } else if path.starts_with("/v1/admin/tokens/") {
            victim_token_id.clone()
        } else if path.starts_with("/v1/environments/") {
            "env_aaaaaaaaaaaaaaaa".to_owned()
        } else if path.starts_with("/v1/snapshots/") {
            "snap_0123456789abcdef".to_owned()
        } else if path.starts_with("/v1/groups/") {
            "grp_aaaaaaaaaaaaaaaa".to_owned()
        } else if path.starts_with("/v1/approvals/") {
            "apr_aaaaaaaaaaaaaaaa".to_owned()
        } else {
            "x_missing".to_owned()
        };
        path.replace("{id}", &id)
            .replace("{run}", &run)
            .replace("{email}", "ana@alpha.test")
            .replace("{name}", "openai")
    };

    // Every route the router has, with the methods it answers (a 405's `Allow`).
    let http = Client::new();
    let mut routes = Vec::new();
    for path in skiff_gateway::route_paths() {
        let resp = http
            .patch(format!("{}{}", gw.url, fill(path)))
            .bearer_auth(&viewer)
            .send()
            .unwrap();
        assert_eq!(
            resp.status(),
            405,
            "PATCH {path} is routed; add it to this test"
        );
        let allow = resp.headers()["allow"].to_str().unwrap().to_owned();
        for method in allow.split(',').map(str::trim).filter(|m| *m != "HEAD") {
            let rule = skiff_gateway::access(method, path)
                .unwrap_or_else(|| panic!("{method} {path} has no rule in skiff_gateway::ACCESS"));
            routes.push((method.to_owned(), path, *rule));
        }
    }
    assert!(
        routes.len() >= 50,
        "the router has every route: {}",
        routes.len()
    );

    let send = |token: &str, method: &str, path: &str| {
        let url = format!("{}{}", gw.url, fill(path));
        let req = match method {
            // A WebSocket route answers only an upgrade.
            "GET" if path.ends_with("/ws") => http
                .get(url)
                .header("connection", "upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13")
                .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            "GET" => http.get(url),
            "POST" => http.post(url).json(&body_for(path)),
            "PUT" => http.put(url).json(&json!({ "value": "sk-stolen" })),
            "DELETE" => http.delete(url),
            other => panic!("unexpected method {other}"),
        };
        req.bearer_auth(token).send().unwrap()
    };

    for (method, path, rule) in &routes {
        // A viewer never writes, whatever the route (a login ticket for the Control UI, its
        // own sign-in, is not a write).
        let writes = method != "GET" && rule.kind != Kind::Own;
        if writes {
            let resp = send(&viewer, method, path);
            assert_eq!(resp.status(), 403, "viewer {method} {path}");
            let text = resp.text().unwrap();
            assert!(
                text.contains("your role (viewer)"),
                "viewer {method} {path}: {text}"
            );
        }
        for (who, token, level) in [
            ("another tenant's admin", &stranger, Need::Admin),
            ("another member", &neighbour, Need::Write),
        ] {
            let expect_refused = rule.need > level;
            match rule.kind {
                Kind::Gateway => {
                    let status = send(token, method, path).status();
                    assert_eq!(status, 403, "{who} {method} {path}");
                }
                Kind::Row => {
                    let resp = send(token, method, path);
                    let status = resp.status().as_u16();
                    let want = if expect_refused { 403 } else { 404 };
                    assert_eq!(
                        status,
                        want,
                        "{who} {method} {path}: {}",
                        resp.text().unwrap()
                    );
                }
                Kind::Create => {
                    // Making one's own rows is allowed; making the victim's is not.
                    if expect_refused {
                        assert_eq!(
                            send(token, method, path).status(),
                            403,
                            "{who} {method} {path}"
                        );
                    } else if *path == "/v1/admin/users" {
                        let resp = http
                            .post(format!("{}{path}", gw.url))
                            .json(&json!({ "email": "mole@alpha.test", "role": "admin", "tenant": "alpha" }))
                            .bearer_auth(token)
                            .send()
                            .unwrap();
                        assert_eq!(resp.status(), 403, "{who} adds to alpha");
                    } else if *path == "/v1/admin/tokens" {
                        let resp = http
                            .post(format!("{}{path}", gw.url))
                            .json(&json!({ "email": "ana@alpha.test", "scope": "admin", "expires_in_s": 60 }))
                            .bearer_auth(token)
                            .send()
                            .unwrap();
                        assert_eq!(resp.status(), 404, "{who} mints a token for ana");
                    }
                }
                Kind::Collection | Kind::Own if expect_refused => {
                    assert_eq!(
                        send(token, method, path).status(),
                        403,
                        "{who} {method} {path}"
                    );
                }
                Kind::Collection | Kind::Own => {
                    let resp = send(token, method, path);
                    assert!(
                        resp.status().is_success(),
                        "{who} {method} {path}: {}",
                        resp.status()
                    );
                    let text = if *path == "/v1/events" {
                        // A stream: what it shows before it is ready is the caller's list.
                        let mut seen = String::new();
                        for line in BufReader::new(resp).lines() {
                            let line = line.unwrap();
                            if line == "event: ready" {
                                break;
                            }
                            seen.push_str(&line);
                        }
                        seen
                    } else {
                        resp.text().unwrap()
                    };
                    for secret in secrets {
                        assert!(
                            !text.contains(secret),
                            "{who} {method} {path} shows {secret}"
                        );
                    }
                }
            }
        }
    }
    assert_eq!(
        world(&gw, &victim, &session),
        before,
        "nothing of ana's changed"
    );

    // The refusals are audited under the acting user.
    let audit = gw.run(&["audit", "export", "--since", "1d"]);
    let text = stdout(&audit);
    assert!(
        text.lines()
            .any(|l| l.contains("\"bert@beta.test\"") && l.contains("denied")),
        "a refusal names bert: {}",
        stderr(&audit)
    );
}

#[test]
fn tokens_are_capped_by_their_scope_and_stop_at_revocation_and_removal() {
    let gw = Gateway::start(ONE_TURN);
    let reader = person(&gw, "ada@example.test", "admin", "acme", "read");
    // A read token of an admin reads but cannot write.
    let users = as_user(&gw, &reader, &["admin", "user", "list", "--json"]);
    assert!(
        !users.status.success(),
        "listing users needs the admin scope"
    );
    let me = get_json(&gw, &reader, "/v1/me");
    assert_eq!(me["email"], "ada@example.test");
    assert_eq!(me["role"], "admin");
    assert_eq!(me["can"], json!(["read"]));
    // Nor can it become a Control UI cookie, which would carry the whole role.
    let ticket = Client::new()
        .post(format!("{}/v1/ui/tickets", gw.url))
        .bearer_auth(&reader)
        .json(&json!({}))
        .send()
        .unwrap();
    assert_eq!(
        ticket.status(),
        403,
        "a read token of an admin mints no UI login"
    );
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = as_user(
        &gw,
        &reader,
        &[
            "session",
            "new",
            "--workspace",
            repo.path().to_str().unwrap(),
            "--model",
            "fake/x",
            "hi",
        ],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("this token's scope is read"),
        "{}",
        stderr(&out)
    );

    // The tenant's admin with an admin token manages their tenant only.
    let admin = token(&gw, "ada@example.test", "admin");
    let out = as_user(
        &gw,
        &admin,
        &[
            "admin",
            "user",
            "add",
            "bo@example.test",
            "--role",
            "member",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let list = as_user(&gw, &admin, &["--json", "admin", "user", "list"]);
    let list: Value = serde_json::from_str(&stdout(&list)).unwrap();
    let emails: Vec<&str> = list["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["email"].as_str().unwrap())
        .collect();
    assert_eq!(
        emails,
        ["ada@example.test", "bo@example.test"],
        "not the first admin's tenant"
    );
    let out = as_user(
        &gw,
        &admin,
        &[
            "admin",
            "user",
            "add",
            "eve@x.test",
            "--role",
            "admin",
            "--tenant",
            "ten_default",
        ],
    );
    assert!(!out.status.success(), "no user in another tenant");

    let bo = token(&gw, "bo@example.test", "write");
    assert_eq!(get_json(&gw, &bo, "/v1/me")["tenant"], "acme");
    let listed = as_user(&gw, &admin, &["--json", "admin", "token", "list"]);
    let listed: Value = serde_json::from_str(&stdout(&listed)).unwrap();
    assert!(!stdout(&as_user(&gw, &admin, &["admin", "token", "list"])).contains(&bo));
    let bo_id = listed["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["email"] == "bo@example.test")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = as_user(&gw, &admin, &["admin", "token", "revoke", &bo_id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let refused = Client::new()
        .get(format!("{}/v1/me", gw.url))
        .bearer_auth(&bo)
        .send()
        .unwrap();
    assert_eq!(refused.status(), 401, "a revoked token stops at once");

    // Removing a user revokes their tokens.
    let out = gw.run(&["admin", "user", "remove", "ada@example.test"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let refused = Client::new()
        .get(format!("{}/v1/me", gw.url))
        .bearer_auth(&admin)
        .send()
        .unwrap();
    assert_eq!(refused.status(), 401);
    // The first admin keeps working, and cannot be removed.
    let out = gw.run(&["admin", "user", "remove", "admin"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cannot be removed"),
        "{}",
        stderr(&out)
    );
    assert_eq!(get_json(&gw, &gw.token, "/v1/me")["role"], "admin");
}

#[test]
fn an_expired_token_says_when_it_expired_and_what_to_do() {
    let gw = Gateway::start(ONE_TURN);
    let out = gw.run(&[
        "admin",
        "user",
        "add",
        "old@example.test",
        "--role",
        "member",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = gw.run(&[
        "admin",
        "token",
        "create",
        "--user",
        "old@example.test",
        "--scope",
        "read",
        "--expires",
        "1s",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let secret = stdout(&out).trim().to_owned();
    // The token's own lifetime is the clock here: there is no event to wait for.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let message = loop {
        let out = as_user(&gw, &secret, &["session", "list"]);
        if !out.status.success() {
            break stderr(&out);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the token never expired"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(message.contains("expired on 20"), "{message}");
    assert!(message.contains("ask an admin for a new one"), "{message}");
}
