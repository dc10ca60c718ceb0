//! Several gateways on one PostgreSQL database share one trust state (issue 17): the
//! deployment has one admin token, which a gateway joining the database never replaces; a
//! token made, revoked or taken with its user through one gateway counts on every other at its
//! next request; and a gateway whose vault key would not open the database's secrets refuses
//! to start instead of sealing what the others cannot open.

use crate::harness::{Gateway, SKIFF, stderr, stdout};
use reqwest::blocking::Client;
use serde_json::Value;
use skiff_test_support::postgres::PgCluster;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a change made through one gateway may take to count on another before the test
/// fails (the promise is about a second; this bound only keeps a broken build from hanging).
const SEEN_WITHIN: Duration = Duration::from_secs(5);
/// How long a gateway may take to start or to refuse to.
const PATIENCE: Duration = Duration::from_secs(90);

fn shared_config(url: &str) -> String {
    format!("[gateway]\nlocal_sandbox = \"off\"\n[store]\nurl = \"{url}\"\n")
}

/// The HTTP status of `GET path` on `gw` with `token`.
fn status(gw: &Gateway, token: &str, path: &str) -> u16 {
    Client::new()
        .get(format!("{}{path}", gw.url))
        .bearer_auth(token)
        .send()
        .unwrap()
        .status()
        .as_u16()
}

/// Polls `GET /v1/me` on `gw` until it answers `want`, within [`SEEN_WITHIN`].
fn await_status(gw: &Gateway, token: &str, want: u16, what: &str) {
    let deadline = Instant::now() + SEEN_WITHIN;
    loop {
        let got = status(gw, token, "/v1/me");
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {got} after {SEEN_WITHIN:?}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Adds `email` through `gw` and returns a fresh token of theirs.
fn person(gw: &Gateway, email: &str, scope: &str) -> String {
    let out = gw.run(&["admin", "user", "add", email, "--role", "member"]);
    assert!(out.status.success(), "user add {email}: {}", stderr(&out));
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
    assert!(out.status.success(), "token create: {}", stderr(&out));
    let secret = stdout(&out).trim().to_owned();
    assert!(secret.starts_with("skf_"), "{secret}");
    secret
}

/// The id of `email`'s token, as `admin token list` shows it through `gw`.
fn token_id(gw: &Gateway, email: &str) -> String {
    let listed = gw.json(&["--json", "admin", "token", "list"]);
    listed["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["email"] == email)
        .unwrap_or_else(|| panic!("no token of {email}: {listed}"))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn a_token_made_revoked_or_taken_with_its_user_on_one_gateway_counts_on_the_other() {
    let cluster = PgCluster::start();
    let config = shared_config(&cluster.fresh_database());
    let one = Gateway::start_with("", &config);
    let two = Gateway::join(&one, "", &config);

    // Made through gateway one after gateway two started: gateway two accepts it.
    let bob = person(&one, "bob@example.test", "write");
    await_status(&two, &bob, 200, "a token made on gateway one, used on two");
    let me: Value = Client::new()
        .get(format!("{}/v1/me", two.url))
        .bearer_auth(&bob)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(me["email"], "bob@example.test");

    // Revoked through gateway one: gateway two refuses it.
    let out = one.run(&[
        "admin",
        "token",
        "revoke",
        &token_id(&one, "bob@example.test"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    await_status(
        &two,
        &bob,
        401,
        "a token revoked on gateway one, used on two",
    );

    // Its user removed through gateway two: gateway one refuses their token.
    let cara = person(&one, "cara@example.test", "read");
    await_status(&two, &cara, 200, "cara's token on gateway two");
    let out = two.run(&["admin", "user", "remove", "cara@example.test"]);
    assert!(out.status.success(), "{}", stderr(&out));
    await_status(&one, &cara, 401, "a removed user's token on gateway one");
    // The deployment's admin token works on both throughout.
    assert_eq!(status(&one, &one.token, "/v1/me"), 200);
    assert_eq!(status(&two, &one.token, "/v1/me"), 200);
}

/// `skiff gateway` on `state_dir` with `config` and `env`, its stderr read line by line.
fn spawn_gateway(
    state_dir: &Path,
    config: &Path,
    env: &[(&str, &str)],
) -> (Child, Option<String>, mpsc::Receiver<String>) {
    let mut child = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(state_dir)
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .env_remove("SKIFF_VAULT_KEY")
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .env("HOME", state_dir.parent().unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, errors) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let url = first
        .trim()
        .strip_prefix("skiff gateway listening on ")
        .map(str::to_owned);
    (child, url, errors)
}

/// Stderr lines until one contains `needle`, within [`PATIENCE`]; all of them.
fn stderr_until(errors: &mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        match errors.recv_timeout(PATIENCE) {
            Ok(line) => {
                let found = line.contains(needle);
                seen.push(line);
                if found {
                    return seen;
                }
            }
            Err(e) => panic!("no {needle:?} on stderr ({e}): {seen:#?}"),
        }
    }
}

/// All of a stopped child's stderr.
fn rest(errors: &mpsc::Receiver<String>) -> String {
    let mut text = String::new();
    while let Ok(line) = errors.recv_timeout(PATIENCE) {
        text.push_str(&line);
        text.push('\n');
    }
    text
}

#[test]
fn a_gateway_joining_a_database_leaves_the_first_ones_admin_token_working() {
    let cluster = PgCluster::start();
    let config = shared_config(&cluster.fresh_database());
    let one = Gateway::start_with("", &config);
    assert!(one.token.starts_with("skf_"), "the first gateway mints it");

    // A second gateway on a fresh state dir: it writes its URL and no token, says once how
    // to get one, and gateway one's token keeps working on both.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config_path = dir.path().join("skiff.toml");
    std::fs::write(&config_path, &config).unwrap();
    let (mut two, url, errors) = spawn_gateway(&state, &config_path, &[]);
    let url = url.expect("the second gateway starts");
    let said = stderr_until(&errors, "gateway.json");
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("gateway.json")).unwrap())
            .unwrap();
    assert_eq!(file["url"], url.as_str());
    assert!(file.get("token").is_none(), "no token written: {file}");
    let told = said.last().unwrap();
    assert!(
        told.contains("copy the first gateway's gateway.json")
            && told.contains("skiff admin token create"),
        "{said:#?}"
    );
    assert_eq!(
        status(&one, &one.token, "/v1/me"),
        200,
        "gateway one's token"
    );
    let on_two = Client::new()
        .get(format!("{url}/v1/me"))
        .bearer_auth(&one.token)
        .send()
        .unwrap();
    assert_eq!(
        on_two.status().as_u16(),
        200,
        "the same token on gateway two"
    );

    // The CLI on the second state dir finds no token and says what to do.
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(&state)
        .args(["session", "list"])
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no token") && stderr(&out).contains("copy the first gateway's"),
        "{}",
        stderr(&out)
    );

    // Restarted with gateway one's gateway.json copied in, it keeps that token.
    two.kill().unwrap();
    two.wait().unwrap();
    let text = rest(&errors);
    assert_eq!(
        text.matches("copy the first gateway's").count(),
        0,
        "said once: {said:#?}\n{text}"
    );
    std::fs::copy(
        one.state_dir.join("gateway.json"),
        state.join("gateway.json"),
    )
    .unwrap();
    let (mut two, url, _errors) = spawn_gateway(&state, &config_path, &[]);
    assert!(url.is_some(), "restarts");
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("gateway.json")).unwrap())
            .unwrap();
    assert_eq!(file["token"], one.token.as_str());
    assert_eq!(status(&one, &one.token, "/v1/me"), 200);
    two.kill().unwrap();
    two.wait().unwrap();
}

#[test]
fn on_its_own_sqlite_database_a_gateway_without_gateway_json_mints_a_new_admin_token() {
    let mut gw = Gateway::start_sqlite("");
    let old = gw.token.clone();
    gw.stop();
    std::fs::remove_file(gw.state_dir.join("gateway.json")).unwrap();
    let config = gw.config_path().to_owned();
    let (mut again, url, _errors) = spawn_gateway(&gw.state_dir, &config, &[]);
    let url = url.expect("restarts");
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(gw.state_dir.join("gateway.json")).unwrap())
            .unwrap();
    let new = file["token"].as_str().unwrap().to_owned();
    assert!(new.starts_with("skf_") && new != old, "{file}");
    let get = |token: &str| {
        Client::new()
            .get(format!("{url}/v1/me"))
            .bearer_auth(token)
            .send()
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(get(&new), 200);
    assert_eq!(get(&old), 401, "the old admin token is replaced");
    again.kill().unwrap();
    again.wait().unwrap();
}

const KEY_A: &str = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";
const KEY_B: &str = "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkI=";

#[test]
fn a_gateway_whose_vault_key_does_not_open_the_databases_secrets_refuses_to_start() {
    let cluster = PgCluster::start();
    let config = shared_config(&cluster.fresh_database());
    let one = Gateway::start_full("", &config, &[("SKIFF_VAULT_KEY", KEY_A)]);
    let mut set = one
        .cli()
        .args(["secret", "set", "openai"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut set.stdin.take().unwrap(), b"sk-shared-secret").unwrap();
    let out = set.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    let attempt = |env: &[(&str, &str)]| {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let config_path = dir.path().join("skiff.toml");
        std::fs::write(&config_path, &config).unwrap();
        let (mut child, url, errors) = spawn_gateway(&state, &config_path, env);
        if url.is_some() {
            child.kill().unwrap();
        }
        let code = child.wait().unwrap().code();
        (
            url,
            code,
            rest(&errors),
            state.join("vault.key").exists(),
            dir,
        )
    };
    // Another key: refused, naming the variable to set, never a key.
    let (url, code, said, _, _dir) = attempt(&[("SKIFF_VAULT_KEY", KEY_B)]);
    assert!(url.is_none(), "started with another vault key: {said}");
    assert_ne!(code, Some(0));
    assert!(
        said.contains("same SKIFF_VAULT_KEY as the other gateways"),
        "{said}"
    );
    assert!(!said.contains(KEY_A) && !said.contains(KEY_B), "{said}");
    // No key at all: refused too, and no key file is made beside the sealed secrets.
    let (url, _, said, made_key, _dir) = attempt(&[]);
    assert!(url.is_none(), "started without a vault key: {said}");
    assert!(said.contains("same SKIFF_VAULT_KEY"), "{said}");
    assert!(!made_key, "a new vault.key was made");
    // The same key: it starts, and opens what gateway one sealed.
    let (url, _, said, _, _dir) = attempt(&[("SKIFF_VAULT_KEY", KEY_A)]);
    assert!(url.is_some(), "the same key is refused: {said}");
    let listed = one.json(&["--json", "secret", "list"]);
    assert!(listed.to_string().contains("openai"), "{listed}");
}

const APPROVAL_SCRIPT: &str = r#"
[[turns]]
text = "Cleaning up."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned-up" }

[[turns]]
text = "All done."
"#;

/// Lines of `out` as they come.
fn lines_of(out: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn a_gateway_starting_while_another_waits_on_an_approval_leaves_it_pending_and_answerable() {
    let cluster = PgCluster::start();
    let config = shared_config(&cluster.fresh_database());
    let one = Gateway::start_with(APPROVAL_SCRIPT, &config);
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("build")).unwrap();
    std::fs::write(ws.path().join("build/x.o"), "x").unwrap();
    let mut new = one
        .cli()
        .args(["session", "new", "--json", "--workspace"])
        .arg(ws.path())
        .args([
            "--model",
            "fake/e2e",
            "--approval",
            r#"{ exec = ["rm *"] }"#,
        ])
        .arg("go ahead")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = lines_of(new.stdout.take().unwrap());
    let approval_id = loop {
        let line = out
            .recv_timeout(PATIENCE)
            .expect("no pending approval from session new");
        if line.contains(r#""state":"pending""#) {
            let v: Value = serde_json::from_str(&line).unwrap();
            break v["approval"]["id"].as_str().unwrap().to_owned();
        }
    };

    // Gateway two starts while gateway one's turn waits for a person.
    let two = Gateway::join(&one, APPROVAL_SCRIPT, &config);
    let listed = two.json(&["--json", "approvals", "--pending"]);
    assert!(
        listed["approvals"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["id"] == approval_id.as_str()),
        "gateway two's start revoked gateway one's pending approval: {listed}"
    );
    let done = two.run(&["approve", &approval_id]);
    assert!(done.status.success(), "approve: {}", stderr(&done));
    let mut rest = Vec::new();
    while let Ok(line) = out.recv_timeout(PATIENCE) {
        rest.push(line);
    }
    assert!(new.wait().unwrap().success());
    let text = rest.join("\n");
    assert!(
        text.contains("cleaned-up") && text.contains("All done."),
        "the call on gateway one was not released: {text}"
    );
}
