//! Control UI single sign-on (`[auth.oidc]`): the authorization-code flow with PKCE against a
//! real OpenID provider (node-oidc-provider on loopback), driven by a browser of the test's
//! (cookies, redirects, the provider's sign-in page). A user signs in and the cookie works on
//! an API route; a forged, replayed or other-browser answer, a code issued for another nonce,
//! a refusal at the provider, a disallowed domain, an unverified email and a person Skiff does
//! not know are each refused by a page naming the step; the mapping creates a new user only
//! when it says so; bad configuration stops the start naming the key. Nothing secret reaches
//! the audit.

use serde_json::{Value, json};
use skiff_protocol::people::Role;
use skiff_test_support::oidc_provider::{
    Browser, Choice, OidcAccount, OidcApp, OidcProvider, OidcSetup, Stop,
};
use std::path::{Path, PathBuf};

const CLIENT_ID: &str = "skiff-gateway";
const CLIENT_SECRET: &str = "oidc-client-secret-5f2a9c7e1b3d";

fn account(email: &str, verified: bool, groups: &[&str]) -> OidcAccount {
    OidcAccount {
        id: email.to_owned(),
        email: email.to_owned(),
        email_verified: verified,
        groups: groups.iter().map(|g| (*g).to_owned()).collect(),
    }
}

async fn provider() -> OidcProvider {
    OidcProvider::start_with(&OidcSetup {
        apps: vec![OidcApp {
            client_id: CLIENT_ID.to_owned(),
            client_secret: CLIENT_SECRET.to_owned(),
        }],
        accounts: vec![
            account("ana@example.com", true, &[]),
            account("bo@example.com", true, &[]),
            account("eve@elsewhere.test", true, &[]),
            account("una@example.com", false, &[]),
            account("carl@example.com", true, &["eng", "ops"]),
            account("dora@example.com", true, &["sales"]),
            account("Ana@Example.COM", true, &["ops"]),
        ],
        ..OidcSetup::default()
    })
    .await
}

struct Setup {
    running: skiff_gateway::Running,
    state_dir: PathBuf,
    _dir: tempfile::TempDir,
}

/// A gateway with `[auth.oidc]` (plus `extra` under it) whose store already has ana (member),
/// and the client secret in its vault.
async fn gateway(idp: &OidcProvider, extra: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("script.toml"), "").unwrap();
    let config_path = dir.path().join("skiff.toml");
    std::fs::write(
        &config_path,
        format!(
            "[providers.fake]\napi = \"scripted\"\nscript = \"script.toml\"\n\n[auth.oidc]\nissuer = \"{}\"\nclient_id = \"{CLIENT_ID}\"\nclient_secret = \"vault:oidc-client\"\nallowed_domains = [\"example.com\"]\n{extra}\n",
            idp.issuer
        ),
    )
    .unwrap();
    let state_dir = dir.path().join("state");
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&state_dir)
        .unwrap();
    {
        let store = skiff_store::Store::open(&state_dir.join("skiff.db")).unwrap();
        store
            .add_user("ana@example.com", Role::Member, skiff_store::DEFAULT_TENANT)
            .unwrap();
    }
    let running = skiff_gateway::start(skiff_gateway::Options {
        state_dir: state_dir.clone(),
        listen: "127.0.0.1:0".into(),
        config: Some(config_path),
    })
    .await
    .unwrap();
    let resp = reqwest::Client::new()
        .put(format!("{}/v1/secrets/oidc-client", running.url))
        .bearer_auth(running.token.as_deref().unwrap())
        .json(&json!({ "value": CLIENT_SECRET }))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "secret set: {}", resp.status());
    Setup {
        running,
        state_dir,
        _dir: dir,
    }
}

impl Setup {
    fn login_url(&self) -> String {
        format!("{}/auth/login", self.running.url)
    }

    /// `GET /v1/me` with the browser's session cookie.
    async fn me(&self, browser: &Browser) -> (u16, Value) {
        let cookie = browser.cookie("skiff_session").unwrap_or_default();
        let resp = reqwest::Client::new()
            .get(format!("{}/v1/me", self.running.url))
            .header("cookie", format!("skiff_session={cookie}"))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Signs in as `who` from the login page to the end; the last page.
    fn sign_in(
        &self,
        browser: &mut Browser,
        who: &Choice,
    ) -> skiff_test_support::oidc_provider::Page {
        browser.follow_all(&self.login_url(), who)
    }

    /// The provider's answer for a sign-in as `who`, before the browser takes it back.
    fn callback_for(&self, browser: &mut Browser, who: &Choice) -> String {
        match browser.follow(&self.login_url(), who, |u| u.contains("/auth/callback")) {
            Stop::At(url) => url,
            Stop::Page(page) => panic!("the sign-in never came back: {page:?}"),
        }
    }

    async fn stop(self) -> Vec<(String, String, String)> {
        let state_dir = self.state_dir.clone();
        self.running.shutdown().await;
        audit_rows(&state_dir)
    }
}

/// The audit's sign-in rows: decision, target, detail.
fn audit_rows(state_dir: &Path) -> Vec<(String, String, String)> {
    let conn = rusqlite::Connection::open(state_dir.join("skiff.db")).unwrap();
    conn.prepare(
        "SELECT decision, target, detail FROM audit WHERE action IN ('ui.login', 'user.add') ORDER BY id",
    )
    .unwrap()
    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

fn query_param(url: &str, name: &str) -> String {
    url.split(['?', '&'])
        .find_map(|pair| pair.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in {url}"))
        .to_owned()
}

fn refused_at(page: &skiff_test_support::oidc_provider::Page, status: u16, step: &str, why: &str) {
    assert_eq!(page.status, status, "{}", page.body);
    assert!(
        page.body.contains(step),
        "not the step {step:?}: {}",
        page.body
    );
    assert!(page.body.contains(why), "not {why:?}: {}", page.body);
    assert!(
        !page.body.contains("eyJ"),
        "a token on the page: {}",
        page.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_signs_in_with_sso_and_the_cookie_works_on_the_api() {
    let idp = provider().await;
    let gw = gateway(&idp, "").await;
    let methods: Value = reqwest::get(format!("{}/auth/methods", gw.running.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(methods["sso"], true);

    let mut browser = Browser::new();
    // The way out: state, nonce and an S256 challenge, bound to this browser by a cookie.
    let start = browser.get(&gw.login_url());
    assert_eq!(start.status, 303, "{start:?}");
    let to_provider = start.location.clone().unwrap();
    assert!(
        to_provider.starts_with(&format!("{}/auth?", idp.issuer)),
        "{to_provider}"
    );
    for param in ["state", "nonce", "code_challenge"] {
        assert!(
            query_param(&to_provider, param).len() >= 32,
            "{param}: {to_provider}"
        );
    }
    assert_eq!(query_param(&to_provider, "code_challenge_method"), "S256");
    assert!(browser.cookie("skiff_oidc").is_some());

    let back = match browser.follow(
        &to_provider,
        &Choice::Account("ana@example.com".into()),
        |u| u.contains("/auth/callback"),
    ) {
        Stop::At(url) => url,
        Stop::Page(page) => panic!("{page:?}"),
    };
    let code = query_param(&back, "code");
    let home = browser.follow_all(&back, &Choice::Refuse);
    assert_eq!(home.status, 200, "{home:?}");
    assert!(
        home.url.ends_with(&format!("{}/", gw.running.url)),
        "{}",
        home.url
    );
    assert!(
        browser.cookie("skiff_oidc").is_none(),
        "the binding cookie is cleared"
    );

    let (status, me) = gw.me(&browser).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["email"], "ana@example.com");
    assert_eq!(me["role"], "member");

    let rows = gw.stop().await;
    assert!(
        rows.iter()
            .any(|(d, t, detail)| d == "applied" && t == "sso" && detail.contains("oidc")),
        "{rows:?}"
    );
    for (_, _, detail) in &rows {
        assert!(
            !detail.contains(&code),
            "the code reached the audit: {detail}"
        );
        assert!(
            !detail.contains(CLIENT_SECRET) && !detail.contains("eyJ"),
            "{detail}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_replayed_or_foreign_answer_is_refused_naming_the_step() {
    let idp = provider().await;
    let gw = gateway(&idp, "").await;
    let ana = Choice::Account("ana@example.com".into());

    // A forged state is refused, and the real answer still signs in, once.
    let mut browser = Browser::new();
    let back = gw.callback_for(&mut browser, &ana);
    let state = query_param(&back, "state");
    let forged = back.replace(&state, "forged-state-0123456789abcdefghij");
    let page = browser.get(&forged);
    refused_at(
        &page,
        400,
        "matching the provider",
        "does not match a sign-in",
    );
    assert!(
        !page.body.contains(&query_param(&back, "code")),
        "{}",
        page.body
    );
    assert!(browser.cookie("skiff_session").is_none());
    let home = browser.follow_all(&back, &ana);
    assert_eq!(home.status, 200, "{home:?}");
    assert_eq!(gw.me(&browser).await.0, 200);
    let replayed = Browser::new().get(&back);
    refused_at(&replayed, 400, "matching the provider", "already used");

    // An answer carried to another browser (a login CSRF) is refused.
    let mut victim = Browser::new();
    let planted = gw.callback_for(&mut Browser::new(), &ana);
    let page = victim.get(&planted);
    refused_at(
        &page,
        400,
        "matching the provider",
        "started in another browser",
    );
    assert!(victim.cookie("skiff_session").is_none());

    // A code issued for another nonce: the ID token it buys is refused.
    let mut browser = Browser::new();
    let start = browser.get(&gw.login_url());
    let to_provider = start.location.unwrap();
    let nonce = query_param(&to_provider, "nonce");
    let tampered = to_provider.replace(&nonce, "a-nonce-of-the-attackers-choosing");
    let page = browser.follow_all(&tampered, &ana);
    refused_at(&page, 401, "checking the ID token", "nonce is not the one");
    assert!(browser.cookie("skiff_session").is_none());

    // The person refuses at the provider.
    let page = gw.sign_in(&mut Browser::new(), &Choice::Refuse);
    refused_at(
        &page,
        403,
        "signing in at the identity provider",
        "access_denied",
    );

    let rows = gw.stop().await;
    let denied = rows.iter().filter(|(d, _, _)| d == "denied").count();
    assert!(denied >= 5, "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_verified_people_of_allowed_domains_who_are_users_get_in() {
    let idp = provider().await;
    let gw = gateway(&idp, "").await;

    let mut browser = Browser::new();
    let page = gw.sign_in(&mut browser, &Choice::Account("eve@elsewhere.test".into()));
    refused_at(
        &page,
        403,
        "checking who you are",
        "not in a domain allowed",
    );
    assert!(page.body.contains("example.com"), "{}", page.body);
    assert!(browser.cookie("skiff_session").is_none());

    let page = gw.sign_in(
        &mut Browser::new(),
        &Choice::Account("una@example.com".into()),
    );
    refused_at(&page, 403, "checking who you are", "verified");

    // Without a mapping that creates users, a stranger is told how to get in.
    let page = gw.sign_in(
        &mut Browser::new(),
        &Choice::Account("bo@example.com".into()),
    );
    refused_at(
        &page,
        403,
        "checking who you are",
        "skiff admin user add bo@example.com",
    );

    let rows = gw.stop().await;
    assert!(!rows.iter().any(|(d, _, _)| d == "applied"), "{rows:?}");
    assert!(
        rows.iter()
            .any(|(_, _, detail)| detail.contains("not in a domain allowed"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_role_mapping_creates_new_users_and_leaves_existing_ones_alone() {
    let idp = provider().await;
    let gw = gateway(
        &idp,
        "[auth.oidc.roles]\nclaim = \"groups\"\nmap = { eng = \"member\", ops = \"operator\" }\ncreate_users = true\n",
    )
    .await;

    // carl is in eng and ops: created as an operator (the highest).
    let mut carl = Browser::new();
    let home = gw.sign_in(&mut carl, &Choice::Account("carl@example.com".into()));
    assert_eq!(home.status, 200, "{home:?}");
    let (status, me) = gw.me(&carl).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["role"], "operator");

    // dora's group maps to nothing: not created.
    let page = gw.sign_in(
        &mut Browser::new(),
        &Choice::Account("dora@example.com".into()),
    );
    refused_at(
        &page,
        403,
        "checking who you are",
        "skiff admin user add dora@example.com",
    );

    // ana keeps the role an admin gave her.
    let mut ana = Browser::new();
    gw.sign_in(&mut ana, &Choice::Account("ana@example.com".into()));
    assert_eq!(gw.me(&ana).await.1["role"], "member");

    // The provider keeps the case she typed: still ana, still a member, nobody created.
    let mut shouting = Browser::new();
    gw.sign_in(&mut shouting, &Choice::Account("Ana@Example.COM".into()));
    let (status, me) = gw.me(&shouting).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["email"], "ana@example.com");
    assert_eq!(me["role"], "member");

    let rows = gw.stop().await;
    let added: Vec<_> = rows
        .iter()
        .filter(|(_, _, d)| d.contains("\"by\":\"sso\""))
        .collect();
    assert_eq!(added.len(), 1, "{rows:?}");
}

#[tokio::test]
async fn bad_oidc_configuration_stops_the_start_naming_the_key() {
    let idp = provider().await;
    let cases = [
        (
            format!("issuer = \"{}\"\nclient_id = \"x\"\nclient_secret = \"plain-secret\"\nallowed_domains = [\"example.com\"]", idp.issuer),
            "auth.oidc.client_secret",
            "vault reference",
        ),
        (
            format!("issuer = \"{}\"\nclient_id = \"x\"\nclient_secret = \"vault:x\"\nallowed_domains = []", idp.issuer),
            "auth.oidc.allowed_domains",
            "nobody could sign in",
        ),
        (
            "issuer = \"http://127.0.0.1:9/\"\nclient_id = \"x\"\nclient_secret = \"vault:x\"\nallowed_domains = [\"example.com\"]".to_owned(),
            "auth.oidc.issuer",
            "discovery document",
        ),
        (
            format!("issuer = \"{}\"\nclient_id = \"x\"\nclient_secret = \"vault:x\"\nallowed_domains = [\"example.com\"]\ntoken_lifetime = \"forever\"", idp.issuer),
            "auth.oidc.token_lifetime",
            "forever",
        ),
        (
            format!("issuer = \"{}\"\nclient_id = \"x\"\nclient_secret = \"vault:x\"\nallowed_domains = [\"example.com\"]\n[auth.oidc.roles]\nclaim = \"groups\"\nmap = {{ eng = \"root\" }}", idp.issuer),
            "auth.oidc.roles.map",
            "root",
        ),
        (
            format!("issuer = \"{}\"\nclient_id = \"x\"\nclient_secret = \"vault:x\"\nallowed_domains = [\"example.com\"]\n[auth.proxy]\njwks = \"keys.json\"\nissuer = \"i\"\naudience = \"a\"\nheader = \"X-A\"", idp.issuer),
            "at `auth`",
            "both set",
        ),
    ];
    for (section, key, why) in cases {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("skiff.toml");
        std::fs::write(&config_path, format!("[auth.oidc]\n{section}\n")).unwrap();
        let err = skiff_gateway::start(skiff_gateway::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: Some(config_path),
        })
        .await
        .err()
        .unwrap_or_else(|| panic!("started with {section}"))
        .to_string();
        assert!(err.contains(key), "{key}: {err}");
        assert!(err.contains(why), "{why}: {err}");
        assert!(!err.contains("plain-secret"), "{err}");
    }
}
