//! `skiff login --gateway URL` and `skiff logout`: single sign-on for the CLI.
//!
//! The device-code flow, brokered by the gateway (it holds the OpenID client secret; the CLI
//! never sees the provider's codes or tokens): the CLI asks the gateway to start, prints the
//! provider's verification URL and the code to type there, polls the gateway at the interval
//! it says, and receives a Skiff token for the person. The token and the gateway URL go to
//! `<state-dir>/login.json` (mode 0600, written whole: a temporary file renamed over it), which
//! later commands use for that gateway (`client::Client::discover`). `skiff logout` asks the
//! gateway to revoke the token and removes the file.

use crate::client::Failure;
use anyhow::{Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use skiff_protocol::api::ApiError;
use skiff_protocol::login::{DeviceLoginStarted, DevicePoll, DevicePollRequest};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// The file a sign-in is kept in, under the state dir.
pub const LOGIN_FILE: &str = "login.json";

#[derive(Args)]
pub struct LoginArgs {
    /// The gateway to sign in to (`https://skiff.example.com`)
    #[arg(long, value_name = "URL")]
    gateway: String,
}

/// `<state-dir>/login.json`.
#[derive(Clone, Serialize, Deserialize)]
pub struct LoginFile {
    pub gateway: String,
    pub token: String,
    pub email: String,
    pub expires_at_ms: i64,
}

impl LoginFile {
    /// The sign-in kept under `state_dir`, if any. A file that cannot be read as one is an
    /// error naming it (rather than silently talking to another gateway).
    pub fn read(state_dir: &Path) -> Result<Option<LoginFile>> {
        let path = state_dir.join(LOGIN_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map(Some).with_context(|| {
                format!(
                    "{} is not a sign-in file; remove it and run `skiff login --gateway URL` again",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }
}

fn http() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .context("cannot build an HTTP client")
}

/// A POST to the gateway and its JSON answer, or the refusal it gave.
async fn post<T: serde::de::DeserializeOwned>(
    req: reqwest::RequestBuilder,
    gateway: &str,
) -> Result<T> {
    let resp = req
        .send()
        .await
        .map_err(|e| Failure::Unreachable(format!("cannot reach the gateway at {gateway}: {e}")))?;
    let status = resp.status();
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| Failure::Unreachable(format!("the gateway at {gateway} broke off: {e}")))?;
    if status.is_success() {
        return serde_json::from_slice(&bytes)
            .with_context(|| format!("unexpected answer from the gateway at {gateway}"));
    }
    let err = serde_json::from_slice::<ApiError>(&bytes).unwrap_or_else(|_| ApiError {
        code: status.as_u16().to_string(),
        message: String::from_utf8_lossy(&bytes).into_owned(),
    });
    Err(Failure::Refused(err).into())
}

fn utc(ms: i64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}

/// `skiff login --gateway URL`. With `--json`, JSON lines: `{status: "waiting", …}` with
/// the URL and code, then `{status: "signed_in", …}` (never the token).
pub async fn login(args: LoginArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let gateway = args.gateway.trim().trim_end_matches('/').to_owned();
    if !(gateway.starts_with("http://") || gateway.starts_with("https://")) {
        return Err(Failure::Usage(format!(
            "--gateway {gateway:?} is not an http(s) URL (like https://skiff.example.com)"
        ))
        .into());
    }
    let http = http()?;
    let started: DeviceLoginStarted =
        post(http.post(format!("{gateway}/v1/auth/device")), &gateway).await?;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "status": "waiting",
                "gateway": gateway,
                "verification_uri": started.verification_uri,
                "verification_uri_complete": started.verification_uri_complete,
                "user_code": started.user_code,
                "expires_at_ms": started.expires_at_ms,
            })
        )?;
    } else {
        outln!(
            "To sign in, open {} and enter the code {}",
            started.verification_uri,
            started.user_code
        )?;
        if let Some(complete) = &started.verification_uri_complete {
            outln!("  (or open {complete})")?;
        }
        eprintln!(
            "waiting for you to confirm at the identity provider (the code works until {})…",
            utc(started.expires_at_ms)
        );
    }
    let mut interval = Duration::from_secs(started.interval_s.max(1));
    let poll = DevicePollRequest {
        login_id: started.login_id.clone(),
    };
    let (token, email, role, tenant, expires_at_ms) = loop {
        // RFC 8628 §3.5: the client waits the interval between polls.
        tokio::time::sleep(interval).await;
        let answer: DevicePoll = post(
            http.post(format!("{gateway}/v1/auth/device/poll"))
                .json(&poll),
            &gateway,
        )
        .await?;
        match answer {
            DevicePoll::Pending { interval_s } => {
                interval = Duration::from_secs(interval_s.max(1));
            }
            DevicePoll::SignedIn {
                token,
                email,
                role,
                tenant,
                expires_at_ms,
            } => break (token, email, role, tenant, expires_at_ms),
        }
    };
    let file = LoginFile {
        gateway: gateway.clone(),
        token,
        email: email.clone(),
        expires_at_ms,
    };
    let path = write_private(state_dir, &file)?;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "status": "signed_in",
                "gateway": gateway,
                "email": email,
                "role": role,
                "tenant": tenant,
                "expires_at_ms": expires_at_ms,
                "path": path.display().to_string(),
            })
        )?;
    } else {
        outln!(
            "Signed in to {gateway} as {email} ({role}) until {}; the token is in {}",
            utc(expires_at_ms),
            path.display()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `login.json` with mode 0600 through a temporary file, so a reader never sees half of
/// it and no other user ever could read it.
fn write_private(state_dir: &Path, file: &LoginFile) -> Result<PathBuf> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .with_context(|| format!("cannot create the state dir {}", state_dir.display()))?;
    let path = state_dir.join(LOGIN_FILE);
    let tmp = state_dir.join(format!("{LOGIN_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let text = serde_json::to_string_pretty(file).context("cannot encode the sign-in")?;
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    out.write_all(text.as_bytes())
        .and_then(|()| out.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// `skiff logout`: revokes the kept token at its gateway and removes the file. The file goes
/// even when the gateway cannot be reached (the token then lives until it expires, and the
/// message says so).
pub async fn logout(state_dir: &Path, json: bool) -> Result<ExitCode> {
    let Some(file) = LoginFile::read(state_dir)? else {
        if json {
            outln!("{}", serde_json::json!({ "status": "not_signed_in" }))?;
        } else {
            outln!(
                "Not signed in (no {}).",
                state_dir.join(LOGIN_FILE).display()
            )?;
        }
        return Ok(ExitCode::SUCCESS);
    };
    let revoked = http()?
        .post(format!("{}/v1/auth/logout", file.gateway))
        .bearer_auth(&file.token)
        .send()
        .await;
    let problem = match revoked {
        Ok(resp) if resp.status().is_success() => None,
        // Already revoked or expired: nothing is left to revoke.
        Ok(resp) if resp.status() == reqwest::StatusCode::UNAUTHORIZED => None,
        Ok(resp) => Some(format!("the gateway answered {}", resp.status())),
        Err(e) => Some(format!("cannot reach the gateway: {e}")),
    };
    let path = state_dir.join(LOGIN_FILE);
    std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "status": "signed_out",
                "gateway": file.gateway,
                "email": file.email,
                "revoked": problem.is_none(),
            })
        )?;
    } else {
        outln!("Signed out of {} ({}).", file.gateway, file.email)?;
        if let Some(problem) = problem {
            eprintln!(
                "warning: the token could not be revoked ({problem}); it stays valid until {}",
                utc(file.expires_at_ms)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
