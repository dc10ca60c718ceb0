//! `skiff login --gateway URL` against a real gateway process and a real OpenID provider
//! (node-oidc-provider on loopback): the device-code flow the gateway brokers. The person
//! confirms the code on the provider's own pages (a browser of the test's); the CLI ends signed
//! in with a token in a 0600 file that later commands use, and `skiff logout` revokes it. A
//! refusal at the provider, an expired code, a person Skiff does not know and a disallowed
//! domain each end the command with a clear message and no file. The audit holds the sign-ins
//! and refusals, never a token or the client secret.

use crate::harness::{Gateway, SKIFF, stderr, stdout};
use serde_json::Value;
use skiff_test_support::oidc_provider::{
    Browser, Choice, OidcAccount, OidcApp, OidcProvider, OidcSetup,
};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

const CLIENT_ID: &str = "skiff-cli-gateway";
const CLIENT_SECRET: &str = "device-flow-client-secret-8d41c0";

/// A provider whose device codes live `ttl_s` and who says to poll every second.
fn provider(rt: &tokio::runtime::Runtime, ttl_s: Option<u64>) -> OidcProvider {
    rt.block_on(OidcProvider::start_with(&OidcSetup {
        apps: vec![OidcApp {
            client_id: CLIENT_ID.to_owned(),
            client_secret: CLIENT_SECRET.to_owned(),
        }],
        accounts: vec![
            OidcAccount::verified("ana@example.com"),
            OidcAccount::verified("bo@example.com"),
            OidcAccount::verified("eve@elsewhere.test"),
        ],
        device_code_ttl_s: ttl_s,
        device_interval_s: Some(1),
        ..OidcSetup::default()
    }))
}

/// A gateway with `[auth.oidc]`, the client secret in its vault and ana as a member.
fn gateway(idp: &OidcProvider) -> Gateway {
    let gw = Gateway::start_with(
        "",
        &format!(
            "[auth.oidc]\nissuer = \"{}\"\nclient_id = \"{CLIENT_ID}\"\nclient_secret = \"vault:oidc\"\nallowed_domains = [\"example.com\"]\ntoken_lifetime = \"7d\"\n",
            idp.issuer
        ),
    );
    let mut set = gw
        .cli()
        .args(["secret", "set", "oidc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    set.stdin
        .take()
        .unwrap()
        .write_all(CLIENT_SECRET.as_bytes())
        .unwrap();
    let out = set.wait_with_output().unwrap();
    assert!(out.status.success(), "secret set: {}", stderr(&out));
    let out = gw.run(&[
        "admin",
        "user",
        "add",
        "ana@example.com",
        "--role",
        "member",
    ]);
    assert!(out.status.success(), "user add: {}", stderr(&out));
    gw
}

/// `skiff login --json` with its own state dir; the process and its first line (the code).
fn start_login(
    gw: &Gateway,
    cli_state: &Path,
) -> (Child, BufReader<std::process::ChildStdout>, Value) {
    let mut child = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(cli_state)
        .args(["login", "--gateway", &gw.url, "--json"])
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let waiting: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("not the waiting line ({e}): {line:?}"));
    assert_eq!(waiting["status"], "waiting", "{waiting}");
    assert!(
        waiting.get("login_id").is_none(),
        "the poll id is the CLI's own: {waiting}"
    );
    (child, stdout, waiting)
}

/// Waits for `skiff login` to end: its exit code, the rest of its stdout and its stderr.
fn finish(
    mut child: Child,
    mut stdout: BufReader<std::process::ChildStdout>,
) -> (i32, String, String) {
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let status = child.wait().unwrap();
    (status.code().unwrap_or(-1), rest, err)
}

fn cli_as(cli_state: &Path, args: &[&str]) -> std::process::Output {
    Command::new(SKIFF)
        .arg("--state-dir")
        .arg(cli_state)
        .args(args)
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .output()
        .unwrap()
}

fn audit(gw: &Gateway) -> String {
    let out = gw.run(&["audit", "export", "--since", "1d", "--format", "jsonl"]);
    assert!(out.status.success(), "audit export: {}", stderr(&out));
    stdout(&out)
}

#[test]
fn skiff_login_signs_the_cli_in_with_a_device_code_and_logout_revokes_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let idp = provider(&rt, None);
    let gw = gateway(&idp);
    let cli_dir = tempfile::tempdir().unwrap();
    let cli_state = cli_dir.path().join("state");

    let (child, stdout, waiting) = start_login(&gw, &cli_state);
    let complete = waiting["verification_uri_complete"].as_str().unwrap();
    assert!(complete.starts_with(&idp.issuer), "{waiting}");
    assert!(
        complete.contains(waiting["user_code"].as_str().unwrap()),
        "{waiting}"
    );
    let page = Browser::new().confirm_device(complete, &Choice::Account("ana@example.com".into()));
    assert_eq!(page.status, 200, "{page:?}");
    assert!(page.body.contains("Sign-in Success"), "{}", page.body);

    let (code, rest, err) = finish(child, stdout);
    assert_eq!(code, 0, "{rest}\n{err}");
    let signed_in: Value = serde_json::from_str(rest.trim()).unwrap();
    assert_eq!(signed_in["status"], "signed_in");
    assert_eq!(signed_in["email"], "ana@example.com");
    assert_eq!(signed_in["role"], "member");
    assert!(!rest.contains("skf_"), "the token was printed: {rest}");

    // The file is the user's alone and holds a Skiff token for this gateway.
    let path = cli_state.join("login.json");
    assert_eq!(signed_in["path"], path.display().to_string());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "login.json is {mode:o}");
    let file: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(file["gateway"], gw.url);
    let token = file["token"].as_str().unwrap().to_owned();
    assert!(token.starts_with("skf_"), "{file}");
    let lifetime_ms = file["expires_at_ms"].as_i64().unwrap()
        - std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
    assert!(
        (6 * 86_400_000..=7 * 86_400_000).contains(&lifetime_ms),
        "token_lifetime = 7d: {lifetime_ms}"
    );

    // Later commands use it, with ana's role: she lists her sessions, she cannot add users.
    let out = cli_as(&cli_state, &["session", "list", "--json"]);
    assert!(out.status.success(), "session list: {}", stderr(&out));
    let out = cli_as(&cli_state, &["admin", "user", "list"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("your role (member)"),
        "{}",
        stderr(&out)
    );

    let trail = audit(&gw);
    assert!(trail.contains("cli.login"), "{trail}");
    for secret in [token.as_str(), CLIENT_SECRET, "eyJ"] {
        assert!(!trail.contains(secret), "{secret} reached the audit");
    }

    // Logout revokes the token and removes the file.
    let out = cli_as(&cli_state, &["logout", "--json"]);
    assert!(out.status.success(), "logout: {}", stderr(&out));
    let done: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(done["revoked"], true, "{done}");
    assert!(!path.exists());
    let out = gw
        .cli()
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", &token)
        .args(["session", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a revoked token still works");
    let out = cli_as(&cli_state, &["session", "list"]);
    assert!(
        !out.status.success(),
        "signed out, yet the CLI found a gateway"
    );
}

#[test]
fn a_refused_device_login_says_why_and_keeps_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let idp = provider(&rt, None);
    let gw = gateway(&idp);
    let cli_dir = tempfile::tempdir().unwrap();
    let cli_state = cli_dir.path().join("state");

    for (who, want) in [
        (Choice::Refuse, "denied at the identity provider"),
        (
            Choice::Account("bo@example.com".into()),
            "skiff admin user add bo@example.com",
        ),
        (
            Choice::Account("eve@elsewhere.test".into()),
            "not in a domain allowed",
        ),
    ] {
        let (child, stdout, waiting) = start_login(&gw, &cli_state);
        Browser::new().confirm_device(waiting["verification_uri_complete"].as_str().unwrap(), &who);
        let (code, rest, err) = finish(child, stdout);
        assert_eq!(code, 2, "{who:?}: {rest}\n{err}");
        assert!(err.contains(want), "{who:?}: {err}");
        assert!(
            !cli_state.join("login.json").exists(),
            "{who:?} left a sign-in"
        );
    }
    let trail = audit(&gw);
    let refusals = trail
        .lines()
        .filter(|l| l.contains("cli.login") && l.contains("denied"))
        .count();
    assert_eq!(refusals, 3, "{trail}");
    assert!(!trail.contains(CLIENT_SECRET));
}

#[test]
fn an_unconfirmed_device_code_expires_with_a_clear_message() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let idp = provider(&rt, Some(2));
    let gw = gateway(&idp);
    let cli_dir = tempfile::tempdir().unwrap();
    let cli_state = cli_dir.path().join("state");

    // Nobody confirms: the code runs out.
    let (child, stdout, _) = start_login(&gw, &cli_state);
    let (code, rest, err) = finish(child, stdout);
    assert_eq!(code, 2, "{rest}\n{err}");
    assert!(err.contains("expired before it was confirmed"), "{err}");
    assert!(err.contains("skiff login"), "{err}");
    assert!(!cli_state.join("login.json").exists());

    // A gateway without [auth.oidc] says single sign-on is off.
    let plain = Gateway::start("");
    let out = cli_as(&cli_state, &["login", "--gateway", &plain.url]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("single sign-on is not configured"),
        "{}",
        stderr(&out)
    );
}
