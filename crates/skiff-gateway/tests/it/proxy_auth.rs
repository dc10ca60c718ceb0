//! Access-proxy mode (`[auth.proxy]`): the gateway believes only the proxy's signed assertion.
//! Real RS256 and ES256 signatures (keys made by openssl and ring for the test), a JWKS file
//! as an operator would write it, and a gateway whose users were added, as an operator would,
//! before the mode was turned on. Good assertions of both kinds sign the user in with their
//! role; a missing, expired, wrong-audience, wrongly signed, two-email or unknown-email one is
//! refused, naming why; the admin token does not go around it; the audit never holds an
//! assertion. Then the same against a real OpenID provider (node-oidc-provider on loopback):
//! its keys fetched from its JWKS URL, its JWTs good, for another audience, from another
//! provider (another signer), with two emails, and for a person Skiff does not know.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ring::rand::SystemRandom;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair, RsaKeyPair};
use serde_json::{Value, json};
use skiff_protocol::people::Role;
use skiff_test_support::oidc_provider::{OidcClient, OidcProvider};
use std::path::{Path, PathBuf};

const ISSUER: &str = "https://proxy.example.test";
const AUDIENCE: &str = "skiff-gateway-7";
const HEADER: &str = "X-Proxy-Assertion";

/// A signing key and its public half as a JWK.
struct Key {
    alg: Algorithm,
    kid: String,
    encoding: EncodingKey,
    jwk: Value,
}

fn ec_key(kid: &str) -> Key {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let pair =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    // An uncompressed point: 0x04, x, y.
    let point = pair.public_key().as_ref();
    Key {
        alg: Algorithm::ES256,
        kid: kid.to_owned(),
        encoding: EncodingKey::from_ec_der(pkcs8.as_ref()),
        jwk: json!({
            "kty": "EC", "crv": "P-256", "kid": kid, "use": "sig", "alg": "ES256",
            "x": B64.encode(&point[1..33]), "y": B64.encode(&point[33..65]),
        }),
    }
}

/// ring makes no RSA keys, so openssl does (a PKCS#1 DER private key).
fn rsa_key(dir: &Path, kid: &str) -> Key {
    let pem = dir.join(format!("{kid}.pem"));
    let der = dir.join(format!("{kid}.der"));
    let ok = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&pem)
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl genpkey failed");
    let ok = std::process::Command::new("openssl")
        .args(["rsa", "-traditional", "-outform", "DER", "-in"])
        .arg(&pem)
        .arg("-out")
        .arg(&der)
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl rsa failed");
    let der = std::fs::read(der).unwrap();
    let pair = RsaKeyPair::from_der(&der).unwrap();
    let public = ring::rsa::PublicKeyComponents::<Vec<u8>>::from(pair.public());
    Key {
        alg: Algorithm::RS256,
        kid: kid.to_owned(),
        encoding: EncodingKey::from_rsa_der(&der),
        jwk: json!({
            "kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
            "n": B64.encode(&public.n), "e": B64.encode(&public.e),
        }),
    }
}

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Claims a proxy would sign for `email`, valid for an hour.
fn claims(email: Value) -> Value {
    json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": "person-1",
        "iat": now_s(), "exp": now_s() + 3600, "email": email, "email_verified": true,
    })
}

fn sign(key: &Key, claims: &Value) -> String {
    let mut header = Header::new(key.alg);
    header.kid = Some(key.kid.clone());
    jsonwebtoken::encode(&header, claims, &key.encoding).unwrap()
}

struct Setup {
    running: skiff_gateway::Running,
    state_dir: PathBuf,
    rsa: Key,
    ec: Key,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

const PROVIDERS: &str = "[providers.fake]\napi = \"scripted\"\nscript = \"script.toml\"\n";

/// A gateway behind `[auth.proxy]` = `auth_proxy`, whose store already has users ana (member)
/// and root@example.com (admin): with the mode on, no admin token could add them.
async fn gateway_behind(dir: &Path, auth_proxy: &str) -> (skiff_gateway::Running, PathBuf) {
    std::fs::write(dir.join("script.toml"), "").unwrap();
    let config_path = dir.join("skiff.toml");
    std::fs::write(
        &config_path,
        format!("{PROVIDERS}\n[auth.proxy]\n{auth_proxy}\nheader = \"{HEADER}\"\n"),
    )
    .unwrap();
    let state_dir = dir.join("state");
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&state_dir)
        .unwrap();
    {
        let store = skiff_store::Store::open(&state_dir.join("skiff.db")).unwrap();
        for (email, role) in [
            ("ana@example.com", Role::Member),
            ("root@example.com", Role::Admin),
        ] {
            store
                .add_user(email, role, skiff_store::DEFAULT_TENANT)
                .unwrap();
        }
    }
    let running = skiff_gateway::start(skiff_gateway::Options {
        state_dir: state_dir.clone(),
        listen: "127.0.0.1:0".into(),
        config: Some(config_path),
    })
    .await
    .unwrap();
    (running, state_dir)
}

/// Behind a proxy whose RSA and EC keys the test holds.
async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let rsa = rsa_key(dir.path(), "rsa-1");
    let ec = ec_key("ec-1");
    std::fs::write(
        dir.path().join("jwks.json"),
        json!({ "keys": [rsa.jwk, ec.jwk] }).to_string(),
    )
    .unwrap();
    let (running, state_dir) = gateway_behind(
        dir.path(),
        &format!("jwks = \"jwks.json\"\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\""),
    )
    .await;
    Setup {
        running,
        state_dir,
        rsa,
        ec,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

impl Setup {
    /// `GET path` with `assertion` (if any) and the admin token as a bearer.
    async fn get(&self, path: &str, assertion: Option<&str>) -> (u16, Value) {
        let mut req = self
            .http
            .get(format!("{}{path}", self.running.url))
            .bearer_auth(self.running.token.as_deref().unwrap());
        if let Some(a) = assertion {
            req = req.header(HEADER, a);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn refused(&self, assertion: Option<&str>) -> (u16, String) {
        let (status, body) = self.get("/v1/me", assertion).await;
        (
            status,
            body["message"].as_str().unwrap_or_default().to_owned(),
        )
    }
}

#[tokio::test]
async fn good_assertions_sign_the_user_in_with_their_role() {
    let s = setup().await;
    for key in [&s.rsa, &s.ec] {
        let assertion = sign(key, &claims(json!("ana@example.com")));
        let (status, me) = s.get("/v1/me", Some(&assertion)).await;
        assert_eq!(status, 200, "{:?}: {me}", key.alg);
        assert_eq!(me["email"], "ana@example.com");
        assert_eq!(me["role"], "member");
        // The role still decides: a member cannot reach the vault.
        let (status, body) = s.get("/v1/secrets", Some(&assertion)).await;
        assert_eq!(status, 403, "{body}");
    }
    let root = sign(&s.ec, &claims(json!("root@example.com")));
    let (status, me) = s.get("/v1/me", Some(&root)).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["role"], "admin");
    s.running.shutdown().await;
}

#[tokio::test]
async fn bad_assertions_are_refused_naming_why_and_no_token_goes_around_them() {
    let s = setup().await;
    let ana = || claims(json!("ana@example.com"));

    // The admin token alone (get always sends it) is not enough.
    let (status, message) = s.refused(None).await;
    assert_eq!(status, 401);
    assert!(message.contains("no identity assertion"), "{message}");
    assert!(message.contains(HEADER), "{message}");

    let mut expired = ana();
    expired["iat"] = json!(now_s() - 7200);
    expired["exp"] = json!(now_s() - 3600);
    let (status, message) = s.refused(Some(&sign(&s.rsa, &expired))).await;
    assert_eq!(status, 401);
    assert!(message.contains("it has expired"), "{message}");

    let mut other_audience = ana();
    other_audience["aud"] = json!("another-app");
    let (status, message) = s.refused(Some(&sign(&s.ec, &other_audience))).await;
    assert_eq!(status, 401);
    assert!(message.contains("not meant for this gateway"), "{message}");

    let mut other_issuer = ana();
    other_issuer["iss"] = json!("https://elsewhere.example.test");
    let (status, message) = s.refused(Some(&sign(&s.ec, &other_issuer))).await;
    assert_eq!(status, 401);
    assert!(
        message.contains("not issued by the configured issuer"),
        "{message}"
    );

    // Another key under the proxy's key id, and another key under an id of its own.
    let impostor = ec_key("ec-1");
    let (status, message) = s.refused(Some(&sign(&impostor, &ana()))).await;
    assert_eq!(status, 401);
    assert!(message.contains("signature does not verify"), "{message}");
    let stranger = ec_key("stranger");
    let (status, message) = s.refused(Some(&sign(&stranger, &ana()))).await;
    assert_eq!(status, 401);
    assert!(
        message.contains("signing key stranger is not one of"),
        "{message}"
    );

    let two = claims(json!(["ana@example.com", "root@example.com"]));
    let (status, message) = s.refused(Some(&sign(&s.rsa, &two))).await;
    assert_eq!(status, 401);
    assert!(message.contains("holds 2 values"), "{message}");

    let mut unverified = ana();
    unverified["email_verified"] = json!(false);
    let (status, message) = s.refused(Some(&sign(&s.rsa, &unverified))).await;
    assert_eq!(status, 401);
    assert!(message.contains("not verified"), "{message}");

    // A shared secret is no proxy's signature.
    let hs = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &ana(),
        &EncodingKey::from_secret(b"guessable"),
    )
    .unwrap();
    let (status, message) = s.refused(Some(&hs)).await;
    assert_eq!(status, 401);
    assert!(message.contains("only RS256 and ES256"), "{message}");

    let (status, message) = s.refused(Some("not-a-jwt")).await;
    assert_eq!(status, 401);
    assert!(message.contains("not a signed JWT"), "{message}");

    // Signed and valid, but nobody Skiff knows: the refusal says what to do.
    let bo = sign(&s.ec, &claims(json!("bo@example.com")));
    let (status, message) = s.refused(Some(&bo)).await;
    assert_eq!(status, 403);
    assert!(
        message.contains("skiff admin user add bo@example.com"),
        "{message}"
    );

    let state_dir = s.state_dir.clone();
    s.running.shutdown().await;
    // Every refusal is audited by its reason; no assertion is ever written down.
    let conn = rusqlite::Connection::open(state_dir.join("skiff.db")).unwrap();
    let details: Vec<String> = conn
        .prepare("SELECT detail FROM audit WHERE action = 'auth' AND decision = 'denied'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(details.len() >= 10, "{details:?}");
    for detail in &details {
        assert!(
            !detail.contains("eyJ"),
            "an assertion reached the audit: {detail}"
        );
    }
}

#[tokio::test]
async fn a_jwks_that_cannot_be_read_stops_the_start_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("script.toml"), "").unwrap();
    let config_path = dir.path().join("skiff.toml");
    std::fs::write(
        &config_path,
        format!(
            "{PROVIDERS}\n[auth.proxy]\njwks = \"missing.json\"\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\nheader = \"{HEADER}\"\n"
        ),
    )
    .unwrap();
    let err = skiff_gateway::start(skiff_gateway::Options {
        state_dir: dir.path().join("state"),
        listen: "127.0.0.1:0".into(),
        config: Some(config_path),
    })
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("auth.proxy.jwks"), "{err}");
    assert!(err.contains("missing.json"), "{err}");
}

const RESOURCE: &str = "https://skiff.example.test/";

fn client(id: &str, email: Value, alg: &'static str) -> OidcClient {
    OidcClient {
        client_id: id.to_owned(),
        client_secret: format!("{id}-secret-0123456789abcdef"),
        email,
        alg,
    }
}

/// A JWT the provider issues `client` for `resource` (the client-credentials grant).
async fn issued(idp: &OidcProvider, client: &OidcClient, resource: &str) -> String {
    let body = format!(
        "grant_type=client_credentials&scope=assert&resource={}",
        resource.replace(':', "%3A").replace('/', "%2F")
    );
    let resp = reqwest::Client::new()
        .post(idp.token_url())
        .basic_auth(&client.client_id, Some(&client.client_secret))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let token: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{token}");
    token["access_token"].as_str().unwrap().to_owned()
}

/// The proxy's keys fetched from a real OpenID provider's JWKS URL: its RS256 and ES256 tokens
/// sign ana in; its token for another audience, a second provider's token (another signer), a
/// two-email token and an unknown person's are refused.
#[tokio::test]
async fn a_real_openid_providers_assertions_are_checked_against_its_jwks_url() {
    let clients = [
        client("ana-ec", json!("ana@example.com"), "ES256"),
        client("ana-rsa", json!("ana@example.com"), "RS256"),
        client(
            "two",
            json!(["ana@example.com", "root@example.com"]),
            "RS256",
        ),
        client("bo", json!("bo@example.com"), "ES256"),
    ];
    let [ana_ec, ana_rsa, two, bo] = &clients;
    let idp = OidcProvider::start(&clients).await;
    let elsewhere =
        OidcProvider::start(&[client("ana-ec", json!("ana@example.com"), "ES256")]).await;

    let dir = tempfile::tempdir().unwrap();
    let (running, _) = gateway_behind(
        dir.path(),
        &format!(
            "jwks = \"{}\"\nissuer = \"{}\"\naudience = \"{RESOURCE}\"",
            idp.jwks_url(),
            idp.issuer
        ),
    )
    .await;
    let me = |assertion: String| {
        let url = format!("{}/v1/me", running.url);
        async move {
            let resp = reqwest::Client::new()
                .get(url)
                .header(HEADER, assertion)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap();
            (status, body)
        }
    };

    for c in [ana_ec, ana_rsa] {
        let (status, body) = me(issued(&idp, c, RESOURCE).await).await;
        assert_eq!(status, 200, "{}: {body}", c.alg);
        assert_eq!(body["email"], "ana@example.com");
        assert_eq!(body["role"], "member");
    }

    let (status, body) = me(issued(&idp, ana_ec, "https://another.example.test/").await).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("not meant for this gateway"),
        "{body}"
    );

    let (status, body) = me(issued(&elsewhere, ana_ec, RESOURCE).await).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("is not one of the issuer's keys"),
        "{body}"
    );

    let (status, body) = me(issued(&idp, two, RESOURCE).await).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("holds 2 values"),
        "{body}"
    );

    let (status, body) = me(issued(&idp, bo, RESOURCE).await).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("skiff admin user add bo@example.com"),
        "{body}"
    );

    running.shutdown().await;
}

#[tokio::test]
async fn an_assertions_email_finds_its_user_whatever_the_case() {
    let s = setup().await;
    let assertion = sign(&s.ec, &claims(json!("Ana@Example.COM")));
    let (status, me) = s.get("/v1/me", Some(&assertion)).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["email"], "ana@example.com", "the user as stored");
    assert_eq!(me["role"], "member");
    s.running.shutdown().await;
}

#[tokio::test]
async fn no_one_time_link_or_token_signs_a_browser_in_behind_the_proxy() {
    let s = setup().await;
    let said = |body: &Value| body["message"].as_str().unwrap_or_default().to_owned();
    // Even a signed-in admin gets no link to hand around.
    let root = sign(&s.ec, &claims(json!("root@example.com")));
    let resp = s
        .http
        .post(format!("{}/v1/ui/tickets", s.running.url))
        .header(HEADER, &root)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let body: Value = resp.json().await.unwrap();
    assert!(said(&body).contains("[auth.proxy]"), "{body}");

    let ui = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let resp = ui
        .get(format!("{}/ui/login?ticket=anything", s.running.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert!(resp.headers().get("set-cookie").is_none());
    let body: Value = resp.json().await.unwrap();
    assert!(said(&body).contains("the only way in"), "{body}");

    // Nor does the admin token, from the gateway's own page.
    let host = s.running.url.trim_start_matches("http://").to_owned();
    let resp = ui
        .post(format!("{}/ui/login", s.running.url))
        .header("origin", format!("http://{host}"))
        .header("content-type", "application/json")
        .body(json!({ "token": s.running.token }).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert!(resp.headers().get("set-cookie").is_none());
    let body: Value = resp.json().await.unwrap();
    assert!(
        said(&body).contains("open the Control UI through the proxy"),
        "{body}"
    );
    s.running.shutdown().await;
}
