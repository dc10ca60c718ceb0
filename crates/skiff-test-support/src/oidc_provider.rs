//! A real OpenID provider on loopback: node-oidc-provider (OpenID-certified, from npm, pinned
//! by `tests/oidc/package-lock.json`) run by `tests/oidc/provider.mjs`. Each start makes fresh
//! signing keys, so two providers are two different signers.
//!
//! `scripts/test` runs `npm ci` in `tests/oidc` before the tests; without it, starting fails
//! saying so.

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
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start node (scripts/test installs nodejs)");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        tokio::io::BufReader::new(stdout)
            .read_line(&mut line)
            .await
            .unwrap();
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
