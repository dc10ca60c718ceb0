//! A real OpenID provider on loopback: node-oidc-provider (OpenID-certified, from npm, pinned
//! by `tests/oidc/package-lock.json`) run by `tests/oidc/provider.mjs`. Each start makes fresh
//! signing keys, so two providers are two different signers.
//!
//! `scripts/test` runs `npm ci` in `tests/oidc` before the tests; without it, starting fails
//! saying so.
//!
//! [`Browser`] is a person's browser for the sign-in flows: it follows redirects, keeps
//! cookies, signs an account in (or refuses) on the provider's sign-in page and confirms a
//! device code on the provider's own pages. It speaks plain HTTP/1.0 over a blocking socket
//! (loopback only), so a test calls it from `spawn_blocking` when the gateway runs in-process.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Stdio;
use tokio::io::AsyncBufReadExt;

/// A client that may take the client-credentials grant; its tokens carry `email` (a string,
/// or a list for a multi-valued claim) and are signed with `alg` (`RS256` or `ES256`).
pub struct OidcClient {
    pub client_id: String,
    pub client_secret: String,
    pub email: serde_json::Value,
    pub alg: &'static str,
}

/// A relying party like a Skiff gateway: the authorization-code grant with PKCE and the
/// device-code grant, redirect URI `http://127.0.0.1/auth/callback` on any port.
pub struct OidcApp {
    pub client_id: String,
    pub client_secret: String,
}

/// A person who can sign in at the provider, by `id` on its sign-in page.
pub struct OidcAccount {
    pub id: String,
    pub email: String,
    pub email_verified: bool,
    pub groups: Vec<String>,
}

impl OidcAccount {
    /// An account whose id is its verified email, in no groups.
    pub fn verified(email: &str) -> OidcAccount {
        OidcAccount {
            id: email.to_owned(),
            email: email.to_owned(),
            email_verified: true,
            groups: Vec::new(),
        }
    }
}

/// Everything the provider is started with.
#[derive(Default)]
pub struct OidcSetup {
    pub clients: Vec<OidcClient>,
    pub apps: Vec<OidcApp>,
    pub accounts: Vec<OidcAccount>,
    /// How long a device code lives [default: the provider's 600 s].
    pub device_code_ttl_s: Option<u64>,
    /// The polling interval the provider states for device codes [default: none stated].
    pub device_interval_s: Option<u64>,
}

/// The running provider; it stops when dropped.
pub struct OidcProvider {
    pub issuer: String,
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

fn provider_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/oidc")
}

impl OidcProvider {
    pub async fn start(clients: &[OidcClient]) -> OidcProvider {
        let clients = clients
            .iter()
            .map(|c| OidcClient {
                client_id: c.client_id.clone(),
                client_secret: c.client_secret.clone(),
                email: c.email.clone(),
                alg: c.alg,
            })
            .collect();
        Self::start_with(&OidcSetup {
            clients,
            ..OidcSetup::default()
        })
        .await
    }

    pub async fn start_with(setup: &OidcSetup) -> OidcProvider {
        let clients = &setup.clients;
        let dir = provider_dir();
        assert!(
            dir.join("node_modules/oidc-provider").is_dir(),
            "the OpenID provider is not installed: run `npm ci` in {} (scripts/test does)",
            dir.display()
        );
        let config = serde_json::json!({
            "clients": clients.iter().map(|c| serde_json::json!({
                "client_id": c.client_id,
                "client_secret": c.client_secret,
                "email": c.email,
                "alg": c.alg,
            })).collect::<Vec<_>>(),
            "apps": setup.apps.iter().map(|a| serde_json::json!({
                "client_id": a.client_id,
                "client_secret": a.client_secret,
            })).collect::<Vec<_>>(),
            "accounts": setup.accounts.iter().map(|a| serde_json::json!({
                "id": a.id,
                "email": a.email,
                "email_verified": a.email_verified,
                "groups": a.groups,
            })).collect::<Vec<_>>(),
            "device_code_ttl": setup.device_code_ttl_s,
            "device_interval": setup.device_interval_s,
        });
        let tmp = tempfile::tempdir().unwrap();
        let config_path = tmp.path().join("clients.json");
        std::fs::write(&config_path, config.to_string()).unwrap();
        let mut child = tokio::process::Command::new("node")
            .arg(dir.join("provider.mjs"))
            .arg(&config_path)
            .current_dir(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // Shown with a failing test's output.
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start node (scripts/test installs nodejs)");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        let mut reader = tokio::io::BufReader::new(stdout);
        reader.read_line(&mut line).await.unwrap();
        // The provider may print more (its notices); a closed pipe would kill it.
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await;
        });
        let started: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|_| panic!("the OpenID provider did not start: {line:?}"));
        OidcProvider {
            issuer: started["issuer"].as_str().unwrap().to_owned(),
            _child: child,
            _dir: tmp,
        }
    }

    pub fn jwks_url(&self) -> String {
        format!("{}/jwks", self.issuer)
    }

    pub fn token_url(&self) -> String {
        format!("{}/token", self.issuer)
    }
}

/// What the person does on the provider's sign-in page.
#[derive(Clone, Debug)]
pub enum Choice {
    /// Signs in as the account of this id.
    Account(String),
    /// Refuses the sign-in.
    Refuse,
}

/// One answer the browser got.
#[derive(Debug)]
pub struct Page {
    pub url: String,
    pub status: u16,
    pub location: Option<String>,
    pub body: String,
}

/// Where following redirects stopped.
#[derive(Debug)]
pub enum Stop {
    /// At a URL the caller asked to stop before (not requested).
    At(String),
    /// At an answer that is not a redirect.
    Page(Page),
}

/// A person's browser: a cookie jar and a loop of redirects.
#[derive(Default)]
pub struct Browser {
    cookies: Vec<(String, String)>,
}

impl Browser {
    pub fn new() -> Browser {
        Browser::default()
    }

    /// The value of a cookie the browser holds.
    pub fn cookie(&self, name: &str) -> Option<String> {
        self.cookies
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }

    /// Sets (or replaces) a cookie, as another site's script never could but a test may.
    pub fn set_cookie(&mut self, name: &str, value: &str) {
        self.cookies.retain(|(n, _)| n != name);
        self.cookies.push((name.to_owned(), value.to_owned()));
    }

    pub fn get(&mut self, url: &str) -> Page {
        self.request("GET", url, None)
    }

    pub fn post_form(&mut self, url: &str, form: &[(&str, &str)]) -> Page {
        let body = form
            .iter()
            .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        self.request("POST", url, Some(body))
    }

    /// Follows redirects from `url`, choosing `who` on the provider's sign-in page, until an
    /// answer is not a redirect or the next URL satisfies `until`.
    pub fn follow(&mut self, url: &str, who: &Choice, until: impl Fn(&str) -> bool) -> Stop {
        let mut url = url.to_owned();
        for _ in 0..20 {
            if until(&url) {
                return Stop::At(url);
            }
            if url.contains("/interaction/") && !url.contains('?') {
                url = match who {
                    Choice::Account(id) => format!("{url}?account={}", encode(id)),
                    Choice::Refuse => format!("{url}?deny=1"),
                };
            }
            let page = self.get(&url);
            match (&page.location, page.status) {
                (Some(next), 300..=399) => url = resolve(&url, next),
                _ => return Stop::Page(page),
            }
        }
        panic!("more than 20 redirects from {url}");
    }

    /// Follows redirects from `url` to the end.
    pub fn follow_all(&mut self, url: &str, who: &Choice) -> Page {
        match self.follow(url, who, |_| false) {
            Stop::Page(page) => page,
            Stop::At(url) => panic!("stopped at {url}"),
        }
    }

    /// Confirms a device code on the provider's own pages (its user-code form, its
    /// confirmation), then signs in as `who`; the last page.
    pub fn confirm_device(&mut self, verification_uri_complete: &str, who: &Choice) -> Page {
        let form = self.get(verification_uri_complete);
        assert_eq!(form.status, 200, "the device page: {form:?}");
        let xsrf = hidden(&form.body, "xsrf");
        let user_code = hidden(&form.body, "user_code");
        let action = verification_uri_complete
            .split('?')
            .next()
            .unwrap_or_default()
            .to_owned();
        let confirm = self.post_form(&action, &[("xsrf", &xsrf), ("user_code", &user_code)]);
        assert_eq!(confirm.status, 200, "the confirmation page: {confirm:?}");
        let xsrf = hidden(&confirm.body, "xsrf");
        let started = self.post_form(
            &action,
            &[
                ("xsrf", &xsrf),
                ("user_code", &user_code),
                ("confirm", "yes"),
            ],
        );
        let next = started
            .location
            .clone()
            .unwrap_or_else(|| panic!("the confirmation did not redirect: {started:?}"));
        self.follow_all(&resolve(&action, &next), who)
    }

    fn request(&mut self, method: &str, url: &str, body: Option<String>) -> Page {
        let rest = url
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("the test browser speaks plain http only: {url}"));
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let mut stream = std::net::TcpStream::connect(authority)
            .unwrap_or_else(|e| panic!("cannot connect to {authority}: {e}"));
        let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {authority}\r\n");
        if !self.cookies.is_empty() {
            let jar = self
                .cookies
                .iter()
                .map(|(n, v)| format!("{n}={v}"))
                .collect::<Vec<_>>()
                .join("; ");
            head.push_str(&format!("Cookie: {jar}\r\n"));
        }
        if let Some(body) = &body {
            head.push_str(&format!(
                "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).unwrap();
        if let Some(body) = &body {
            stream.write_all(body.as_bytes()).unwrap();
        }
        let mut raw = Vec::new();
        // A server may reset the connection once it has answered and closed; what was read
        // is the answer.
        if let Err(e) = stream.read_to_end(&mut raw) {
            assert!(
                e.kind() == std::io::ErrorKind::ConnectionReset && !raw.is_empty(),
                "{method} {url}: {e}"
            );
        }
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no HTTP answer from {url}"));
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut body = raw[split + 4..].to_vec();
        let mut lines = head.lines();
        let status: u16 = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line from {url}: {head}"));
        let mut location = None;
        let mut chunked = false;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "location" => location = Some(value.to_owned()),
                "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                "set-cookie" => self.store_cookie(value),
                _ => {}
            }
        }
        if chunked {
            body = dechunk(&body);
        }
        Page {
            url: url.to_owned(),
            status,
            location,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    fn store_cookie(&mut self, header: &str) {
        let first = header.split(';').next().unwrap_or_default();
        let Some((name, value)) = first.split_once('=') else {
            return;
        };
        let (name, value) = (name.trim(), value.trim());
        self.cookies.retain(|(n, _)| n != name);
        let gone = value.is_empty()
            || header
                .split(';')
                .any(|a| a.trim().eq_ignore_ascii_case("max-age=0"));
        if !gone {
            self.cookies.push((name.to_owned(), value.to_owned()));
        }
    }
}

/// `next` (absolute, or a path) as seen from `from`.
fn resolve(from: &str, next: &str) -> String {
    if next.starts_with("http://") || next.starts_with("https://") {
        return next.to_owned();
    }
    let rest = from.strip_prefix("http://").unwrap_or(from);
    let authority = rest.split('/').next().unwrap_or_default();
    format!("http://{authority}{next}")
}

/// The value of the hidden form field `name`.
fn hidden(html: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let start = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no field {name} in {html}"))
        + marker.len();
    let end = html[start..].find('"').unwrap() + start;
    html[start..end].to_owned()
}

fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&raw[..eol])
                .split(';')
                .next()
                .unwrap_or("0")
                .trim(),
            16,
        )
        .unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&raw[start..(start + size).min(raw.len())]);
        raw = &raw[(start + size + 2).min(raw.len())..];
    }
}
