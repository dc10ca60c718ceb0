//! People and roles over the real gateway: users and tokens through the CLI; every route of
//! the router tried, on rows the victim really owns (a session, a box, its snapshot, a fan-out
//! group, a pending approval), by another tenant's admin, another member of the same tenant
//! and a viewer, each refused (or shown nothing) with the victim's rows unchanged; what a
//! viewer, an operator and a member of one tenant see and may do with each other's sessions;
//! and per-user budgets charged to the member who drove the turn.

use crate::env::BoxRoot;
use crate::harness::{Gateway, stderr, stdout};
use reqwest::blocking::Client;
use serde_json::{Value, json};
use skiff_gateway::{Kind, Need};
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

const ONE_TURN: &str = r#"
[[turns]]
text = "Done."
"#;

/// A turn that runs `rm` (which an `--approval` policy can make wait), then ends.
const CLEAN_UP: &str = r#"
[[turns]]
text = "Cleaning up."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned-up" }

[[turns]]
text = "Done."
"#;

/// The policy that makes CLEAN_UP's call wait for a person.
const ASK_BEFORE_RM: &str = r#"{ exec = ["rm *"] }"#;

/// A gateway with CLEAN_UP as its model and a `local` worker profile on real boxes.
fn gateway_with_boxes(root: &BoxRoot) -> Gateway {
    Gateway::start_with(
        CLEAN_UP,
        &format!(
            "[gateway]\nmax_workers = 4\n[profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n",
            root.path().display()
        ),
    )
}

/// `session new` as `token` on a fresh repository, to the end of its turn; the session id.
fn new_session(gw: &Gateway, token: &str, extra: &[&str]) -> String {
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let mut args = vec![
        "session",
        "new",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
    ];
    args.extend_from_slice(extra);
    args.push("clean up");
    let out = as_user(gw, token, &args);
    assert!(out.status.success(), "session new: {}", stderr(&out));
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    first["session_id"].as_str().unwrap().to_owned()
}

/// A session of `token`'s on the gateway whose turn waits on an approval: the `session new`
/// still following it, the session id and the approval id.
fn waiting_session(gw: &Gateway, token: &str, ws: &std::path::Path) -> (Child, String, String) {
    let mut child = gw
        .cli()
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", token)
        .args([
            "session",
            "new",
            "--workspace",
            ws.to_str().unwrap(),
            "--model",
            "fake/x",
            "--approval",
            ASK_BEFORE_RM,
            "clean up",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let approval = loop {
        let mut line = String::new();
        let n = err.read_line(&mut line).unwrap();
        assert!(n > 0, "the turn ended without asking: {seen}");
        seen.push_str(&line);
        if let Some(rest) = line.strip_prefix("approval needed: ") {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    // Keep draining stderr so the follower never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let shown = get_json(gw, token, &format!("/v1/approvals/{approval}"));
    let session = shown["session_id"].as_str().unwrap().to_owned();
    (child, session, approval)
}

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

/// The victim's rows named by id.
struct Rows {
    session: String,
    environment: String,
    group: String,
    approval: String,
}

/// What the victim and the first admin can see: it must be the same after every attempt.
fn world(gw: &Gateway, victim: &str, rows: &Rows) -> Value {
    json!({
        "session": get_json(gw, victim, &format!("/v1/sessions/{}", rows.session)),
        "group": get_json(gw, victim, &format!("/v1/groups/{}", rows.group)),
        "environment": get_json(gw, victim, &format!("/v1/environments/{}", rows.environment)),
        "approval": get_json(gw, victim, &format!("/v1/approvals/{}", rows.approval)),
        "sessions": get_json(gw, victim, "/v1/sessions"),
        "approvals": get_json(gw, victim, "/v1/approvals"),
        "snapshots": get_json(gw, victim, "/v1/snapshots"),
        "users": get_json(gw, &gw.token, "/v1/admin/users"),
        "tokens": get_json(gw, &gw.token, "/v1/admin/tokens"),
    })
}

/// A body each writing route accepts, so a refusal is the scope's and not the body's.
fn body_for(path: &str) -> Value {
    match path.rsplit('/').next().unwrap_or("") {
        "messages" => json!({ "prompt": "take over" }),
        "agent" => json!({ "agent": "reviewer" }),
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
    let root = BoxRoot::new();
    let gw = gateway_with_boxes(&root);
    // An operator, so that a snapshot of theirs can exist.
    let victim = person(&gw, "ana@alpha.test", "operator", "alpha", "write");
    let stranger = person(&gw, "bert@beta.test", "admin", "beta", "admin");
    let neighbour = person(&gw, "carl@alpha.test", "member", "alpha", "write");
    let viewer = person(&gw, "vera@alpha.test", "viewer", "alpha", "admin");

    // The victim's rows, each made the way a user makes it.
    let session = new_session(&gw, &victim, &[]);
    let fan_repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = as_user(
        &gw,
        &victim,
        &[
            "session",
            "new",
            "--attempts",
            "2",
            "--profile",
            "local",
            "--workspace",
            fan_repo.path().to_str().unwrap(),
            "--model",
            "fake/x",
            "clean up",
        ],
    );
    assert!(out.status.success(), "fan-out: {}", stderr(&out));
    let listed = get_json(&gw, &victim, "/v1/sessions");
    let group = listed["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|s| s["group_id"].as_str())
        .unwrap_or_else(|| panic!("no fan-out group: {listed}"))
        .to_owned();
    let out = as_user(
        &gw,
        &victim,
        &["env", "create", "--profile", "local", "--json"],
    );
    assert!(out.status.success(), "env create: {}", stderr(&out));
    let env: Value = serde_json::from_slice(&out.stdout).unwrap();
    let environment = env["id"].as_str().unwrap().to_owned();
    let out = as_user(
        &gw,
        &victim,
        &["env", "snapshots", "take", &environment, "--json"],
    );
    assert!(out.status.success(), "snapshot: {}", stderr(&out));
    let snap: Value = serde_json::from_slice(&out.stdout).unwrap();
    let snapshot = snap["id"].as_str().unwrap().to_owned();
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("build")).unwrap();
    let (mut waiting, _, approval) = waiting_session(&gw, &victim, ws.path());
    let rows = Rows {
        session: session.clone(),
        environment: environment.clone(),
        group: group.clone(),
        approval: approval.clone(),
    };

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
    let secrets = [
        "ana@alpha.test",
        session.as_str(),
        victim_token_id.as_str(),
        environment.as_str(),
        snapshot.as_str(),
        group.as_str(),
        approval.as_str(),
    ];
    let before = world(&gw, &victim, &rows);

    let fill = |path: &str| -> String {
        let id = if path.starts_with("/v1/sessions/") {
            session.clone()
        } else if path.starts_with("/v1/admin/tokens/") {
            victim_token_id.clone()
        } else if path.starts_with("/v1/environments/") {
            environment.clone()
        } else if path.starts_with("/v1/snapshots/") {
            snapshot.clone()
        } else if path.starts_with("/v1/groups/") {
            group.clone()
        } else if path.starts_with("/v1/approvals/") {
            approval.clone()
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
        // own sign-in, is not a write); it reads every row of its tenant.
        let writes = method != "GET" && rule.kind != Kind::Own;
        let read_row = [
            "/v1/sessions/{id}",
            "/v1/sessions/{id}/checkpoints",
            "/v1/environments/{id}",
            "/v1/groups/{id}",
            "/v1/approvals/{id}",
        ];
        if method == "GET" && read_row.contains(path) {
            let resp = send(&viewer, method, path);
            assert_eq!(resp.status(), 200, "viewer reads {path}");
        }
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
        world(&gw, &victim, &rows),
        before,
        "nothing of ana's changed"
    );
    // The viewer's lists hold the tenant's rows.
    for (list, id) in [
        ("/v1/sessions", &session),
        ("/v1/approvals", &approval),
        ("/v1/environments", &environment),
        ("/v1/snapshots", &snapshot),
    ] {
        let seen = get_json(&gw, &viewer, list).to_string();
        assert!(
            seen.contains(id.as_str()),
            "the viewer's {list} lacks {id}: {seen}"
        );
    }
    let out = as_user(&gw, &victim, &["deny", &approval]);
    assert!(out.status.success(), "{}", stderr(&out));
    waiting.wait().unwrap();

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
fn an_email_is_one_person_whatever_its_case() {
    let gw = Gateway::start(ONE_TURN);
    let ana = person(&gw, "Ana@Alpha.test", "member", "alpha", "write");
    // A second spelling is the same person: refused as a duplicate, naming the stored one.
    let out = gw.run(&[
        "admin",
        "user",
        "add",
        "ana@alpha.test",
        "--role",
        "admin",
        "--tenant",
        "beta",
    ]);
    assert!(!out.status.success(), "a second Ana was added");
    assert!(
        stderr(&out).contains("already exists as Ana@Alpha.test"),
        "{}",
        stderr(&out)
    );
    // Stored as given; found in any case.
    let me = get_json(&gw, &ana, "/v1/me");
    assert_eq!(me["email"], "Ana@Alpha.test");
    let lower = token(&gw, "ana@alpha.test", "write");
    assert_eq!(get_json(&gw, &lower, "/v1/me")["email"], "Ana@Alpha.test");
    let users = gw.json(&["--json", "admin", "user", "list"]);
    let anas = users["users"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| {
            u["email"]
                .as_str()
                .unwrap()
                .eq_ignore_ascii_case("ana@alpha.test")
        })
        .count();
    assert_eq!(anas, 1, "{users}");
    // Removing her by another spelling removes her, and her tokens with her.
    let out = gw.run(&["admin", "user", "remove", "ANA@ALPHA.TEST"]);
    assert!(out.status.success(), "{}", stderr(&out));
    for token in [&ana, &lower] {
        let refused = Client::new()
            .get(format!("{}/v1/me", gw.url))
            .bearer_auth(token)
            .send()
            .unwrap();
        assert_eq!(refused.status(), 401);
    }
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

#[test]
fn a_viewer_reads_the_tenant_an_operator_cancels_anyones_turn_and_a_member_sees_only_their_own() {
    let root = BoxRoot::new();
    let gw = gateway_with_boxes(&root);
    let ana = person(&gw, "ana@alpha.test", "member", "alpha", "write");
    let carl = person(&gw, "carl@alpha.test", "member", "alpha", "write");
    let vera = person(&gw, "vera@alpha.test", "viewer", "alpha", "read");
    let otto = person(&gw, "otto@alpha.test", "operator", "alpha", "write");

    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("build")).unwrap();
    let (mut waiting, session, approval) = waiting_session(&gw, &ana, ws.path());
    // A member's session on a worker box: its credentials and placement are the member's.
    let placed = new_session(&gw, &carl, &["--profile", "local"]);
    let carls = get_json(&gw, &carl, &format!("/v1/sessions/{placed}"));
    assert_eq!(carls["runs"][0]["status"], "succeeded", "{carls}");
    assert!(
        carls["session"]["worker"]["environment_id"].is_string(),
        "{carls}"
    );

    // The viewer lists the whole tenant, each session with its owner.
    let listed = as_user(&gw, &vera, &["session", "list", "--json"]);
    assert!(listed.status.success(), "{}", stderr(&listed));
    let listed: Value = serde_json::from_str(&stdout(&listed)).unwrap();
    let owners: std::collections::BTreeMap<String, String> = listed["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_owned(),
                s["owner"].as_str().unwrap_or("-").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        owners,
        [
            (session.clone(), "ana@alpha.test".to_owned()),
            (placed.clone(), "carl@alpha.test".to_owned())
        ]
        .into_iter()
        .collect(),
        "{listed}"
    );
    let table = stdout(&as_user(&gw, &vera, &["session", "list"]));
    let header = table.lines().next().unwrap_or_default();
    assert!(header.contains("OWNER"), "{table}");
    let row = table.lines().find(|l| l.contains(&session)).unwrap();
    assert!(row.contains("ana@alpha.test"), "{table}");
    // A member's own list has nobody else's, and so no owner column.
    let own = stdout(&as_user(&gw, &carl, &["session", "list"]));
    assert!(!own.contains("OWNER") && !own.contains(&session), "{own}");
    assert!(own.contains(&placed), "{own}");
    let pending = as_user(&gw, &vera, &["approvals", "--pending", "--json"]);
    assert!(stdout(&pending).contains(&approval), "{}", stdout(&pending));
    let shown = as_user(&gw, &vera, &["session", "show", "--json", &session]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    // …and changes nothing.
    let refused = as_user(&gw, &vera, &["session", "cancel", &session]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("your role (viewer)"),
        "{}",
        stderr(&refused)
    );

    // Another member sees nothing of ana's.
    for path in [
        format!("/v1/sessions/{session}"),
        format!("/v1/approvals/{approval}"),
    ] {
        let resp = Client::new()
            .get(format!("{}{path}", gw.url))
            .bearer_auth(&carl)
            .send()
            .unwrap();
        assert_eq!(resp.status(), 404, "carl GET {path}");
    }
    let theirs = get_json(&gw, &carl, "/v1/approvals").to_string();
    assert!(!theirs.contains(&approval), "{theirs}");
    let cancel = as_user(&gw, &carl, &["session", "cancel", &session]);
    assert!(!cancel.status.success());
    assert!(stderr(&cancel).contains("not found"), "{}", stderr(&cancel));

    // The operator may not drive ana's session…
    let send = as_user(&gw, &otto, &["session", "send", &session, "take over"]);
    assert!(!send.status.success());
    assert!(
        stderr(&send).contains("is ana@alpha.test's: only its owner can change it"),
        "{}",
        stderr(&send)
    );
    // …but cancels her turn, and the audit says who did.
    let cancel = as_user(&gw, &otto, &["session", "cancel", &session]);
    assert!(cancel.status.success(), "{}", stderr(&cancel));
    waiting.wait().unwrap();
    let detail = get_json(&gw, &ana, &format!("/v1/sessions/{session}"));
    assert_eq!(detail["runs"][0]["status"], "cancelled", "{detail}");
    let audit = stdout(&gw.run(&["audit", "export", "--since", "1d"]));
    assert!(
        audit
            .lines()
            .any(|l| l.contains("\"otto@alpha.test\"") && l.contains(&session)),
        "{audit}"
    );
}

#[test]
fn a_users_budget_charges_the_member_who_drove_the_turn_and_refuses_only_them() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let reply = |prompt: u64, completion: u64| {
        let mut events = openai_sse::text_chunks(&["Done."]);
        events.extend(openai_sse::finish("stop"));
        events.extend(openai_sse::usage(prompt, completion));
        events.extend(openai_sse::done());
        FakeResponse::sse(events)
    };
    let fake = rt.block_on(FakeProvider::start(vec![reply(900, 200), reply(300, 50)]));
    let config = format!(
        "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\n\
         [budgets]\nuser_tokens_per_day = 1000\n",
        fake.base_url()
    );
    let gw = Gateway::start_full("", &config, &[]);
    let ana = person(&gw, "ana@alpha.test", "member", "alpha", "write");
    let carl = person(&gw, "carl@alpha.test", "member", "alpha", "write");
    let users = gw.json(&["--json", "admin", "user", "list"]);
    let id_of = |email: &str| {
        users["users"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["email"] == email)
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let start = |token: &str, prompt: &str| {
        as_user(
            &gw,
            token,
            &[
                "session",
                "new",
                "--workspace",
                repo.path().to_str().unwrap(),
                "--model",
                "openai/gpt-fake",
                prompt,
            ],
        )
    };
    let out = start(&ana, "one");
    assert!(out.status.success(), "{}", stderr(&out));
    // Ana is past her day's budget: her next call is refused before the provider is asked.
    let out = start(&ana, "two");
    assert!(!out.status.success());
    assert_eq!(fake.requests().len(), 1);
    let said = format!("{}{}", stdout(&out), stderr(&out));
    assert!(
        said.contains("`budgets.user_tokens_per_day`")
            && said.contains(&format!(
                "user {} used 1100 tokens",
                id_of("ana@alpha.test")
            )),
        "{said}"
    );
    // Carl, of the same tenant, is not charged for her turns.
    let out = start(&carl, "three");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(fake.requests().len(), 2);
    let report = gw.json(&["admin", "usage", "--json"]);
    let used = |id: &str| {
        report["lines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["subject"] == "user" && l["id"] == id)
            .unwrap_or_else(|| panic!("no line for {id}: {report}"))["tokens"]
            .clone()
    };
    assert_eq!(used(&id_of("ana@alpha.test")), json!(1100), "{report}");
    assert_eq!(used(&id_of("carl@alpha.test")), json!(350), "{report}");
}

#[test]
fn a_members_worker_session_runs_with_the_members_scope_their_budget_and_audit() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let reply = |prompt: u64, completion: u64| {
        let mut events = openai_sse::text_chunks(&["Done."]);
        events.extend(openai_sse::finish("stop"));
        events.extend(openai_sse::usage(prompt, completion));
        events.extend(openai_sse::done());
        FakeResponse::sse(events)
    };
    let fake = rt.block_on(FakeProvider::start(vec![reply(900, 200), reply(300, 50)]));
    let root = BoxRoot::new();
    let config = format!(
        "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\n\
         [budgets]\nuser_tokens_per_day = 1000\n\
         [gateway]\nmax_workers = 2\n\
         [profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n",
        fake.base_url(),
        root.path().display()
    );
    let gw = Gateway::start_full("", &config, &[]);
    let carl = person(&gw, "carl@alpha.test", "member", "alpha", "write");
    let users = gw.json(&["--json", "admin", "user", "list"]);
    let carl_id = users["users"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["email"] == "carl@alpha.test")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // Carl's session on a worker box: its model call goes through the gateway's proxy and
    // is charged to him.
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = as_user(
        &gw,
        &carl,
        &[
            "session",
            "new",
            "--json",
            "--profile",
            "local",
            "--workspace",
            repo.path().to_str().unwrap(),
            "--model",
            "openai/gpt-fake",
            "one",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let session = first["session_id"].as_str().unwrap().to_owned();
    let shown = get_json(&gw, &carl, &format!("/v1/sessions/{session}"));
    assert_eq!(shown["runs"][0]["status"], "succeeded", "{shown}");
    let env = shown["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap_or_else(|| panic!("not on a box: {shown}"))
        .to_owned();
    assert_eq!(fake.requests().len(), 1);
    let report = gw.json(&["admin", "usage", "--json"]);
    let line = report["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["subject"] == "user" && l["id"] == carl_id.as_str())
        .unwrap_or_else(|| panic!("carl is not charged: {report}"))
        .clone();
    assert_eq!(line["tokens"], json!(1100), "{report}");

    // Past his day's budget, his next turn on the box is refused at the proxy before the
    // provider is asked, naming his budget.
    let out = as_user(&gw, &carl, &["session", "send", &session, "two"]);
    let said = format!("{}{}", stdout(&out), stderr(&out));
    assert!(
        said.contains("`budgets.user_tokens_per_day`")
            && said.contains(&format!("user {carl_id} used 1100 tokens")),
        "{said}"
    );
    assert_eq!(
        fake.requests().len(),
        1,
        "the provider was asked past the budget"
    );
    let shown = get_json(&gw, &carl, &format!("/v1/sessions/{session}"));
    assert_eq!(shown["session"]["worker"]["environment_id"], json!(env));

    // The worker was admitted, and its calls audited, as Carl's: never the first admin's.
    let store = gw.store();
    let rows: Vec<_> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action.starts_with("worker.") && r.target == session)
        .collect();
    assert!(
        rows.iter()
            .any(|r| r.action == "worker.admit" && r.decision == "allowed"),
        "{rows:?}"
    );
    for row in &rows {
        assert_eq!(
            (row.owner_id.as_str(), row.tenant_id.as_str()),
            (carl_id.as_str(), "alpha"),
            "{row:?}"
        );
    }
    let environment = get_json(&gw, &carl, &format!("/v1/environments/{env}"));
    assert_eq!(environment["id"], json!(env), "the box is his to see");
}
