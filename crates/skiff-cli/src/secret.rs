//! `skiff secret set|list|rm|rotate-key`: the gateway's vault, through its API with the admin
//! token like every other command, so a running gateway sees a secret the moment it is set.
//!
//! A value travels only on stdin and in the request body: never an argument (visible in `ps`),
//! a URL or a line this command prints.

use crate::client::{Client, Failure};
use crate::render::{self, ago, now_ms};
use anyhow::{Context, Result};
use clap::Subcommand;
use skiff_protocol::secrets::{RotatedKey, SecretList, SecretView, SetSecretRequest};
use std::io::{IsTerminal, Read};
use std::path::Path;
use std::process::ExitCode;

/// A secret is a key or a token, not a file: anything larger is a mistake in the pipe.
const MAX_VALUE_BYTES: u64 = 64 * 1024;

#[derive(Subcommand)]
pub enum SecretCommand {
    /// Store a secret, its value read from stdin: `printf %s "$KEY" | skiff secret set openai`
    Set {
        /// Letters, digits, `_`, `-` and `.`; configuration names it as `vault:NAME`
        name: String,
    },
    /// The secrets' names and dates (never their values)
    List,
    /// Remove a secret
    Rm { name: String },
    /// Seal every secret under a new vault key and retire the old one
    RotateKey,
}

pub async fn run(cmd: SecretCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    if let SecretCommand::Set { name } | SecretCommand::Rm { name } = &cmd {
        check_name(name)?;
    }
    let client = Client::discover(state_dir)?;
    match cmd {
        SecretCommand::Set { name } => {
            let value = read_value()?;
            let body = SetSecretRequest { value };
            let view: SecretView = client
                .send(
                    client
                        .http()
                        .put(format!("{}/v1/secrets/{name}", client.url()))
                        .json(&body),
                )
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&view)?)?;
            } else {
                let how = if view.updated_at_ms == view.created_at_ms {
                    "stored"
                } else {
                    "replaced"
                };
                outln!(
                    "{how} secret {}; configuration names it as \"vault:{}\"",
                    view.name,
                    view.name
                )?;
            }
        }
        SecretCommand::List => {
            let list: SecretList = client.send(client.get("/v1/secrets")).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else {
                out!("{}", table(&list.secrets))?;
            }
        }
        SecretCommand::Rm { name } => {
            let removed: SecretView = client
                .send(client.delete(&format!("/v1/secrets/{name}")))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&removed)?)?;
            } else {
                outln!("removed secret {}", removed.name)?;
            }
        }
        SecretCommand::RotateKey => {
            let rotated: RotatedKey = client
                .send(client.post("/v1/secrets/rotate-key", &serde_json::json!({})))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&rotated)?)?;
            } else {
                outln!(
                    "sealed {} secret(s) under a new key in {}",
                    rotated.resealed,
                    rotated.key_source
                )?;
                if let Some(key) = &rotated.new_key {
                    // The only place the new key is ever shown: the gateway cannot set its own
                    // environment.
                    outln!("{key}")?;
                    eprintln!(
                        "set {} to the key above before the gateway next starts; the old key no longer opens anything, and this key is not shown again",
                        rotated.key_source
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A name goes into the URL's path: one that could change the route (`/`, `?`, `#`) or need
/// escaping is refused here; the gateway checks the rest of its rule.
fn check_name(name: &str) -> Result<()> {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Ok(());
    }
    Err(Failure::Usage(format!(
        "{name:?} is not a secret name: use letters, digits, `_`, `-` or `.`"
    ))
    .into())
}

/// The value from stdin, refused from a terminal (it would echo) and when empty; one trailing
/// newline (`echo`'s) is not part of it.
fn read_value() -> Result<String> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err(Failure::Usage(
            "pipe the value in, so it is neither echoed nor kept in your shell's history: `printf %s \"$TOKEN\" | skiff secret set NAME`".into(),
        )
        .into());
    }
    let mut bytes = Vec::new();
    stdin
        .lock()
        .take(MAX_VALUE_BYTES + 1)
        .read_to_end(&mut bytes)
        .context("cannot read the secret's value from stdin")?;
    if bytes.len() as u64 > MAX_VALUE_BYTES {
        return Err(Failure::Usage(format!(
            "the value on stdin is over {} KiB; a secret is a key or a token",
            MAX_VALUE_BYTES / 1024
        ))
        .into());
    }
    let mut value = String::from_utf8(bytes)
        .map_err(|_| Failure::Usage("the value on stdin is not UTF-8 text".into()))?;
    if value.ends_with('\n') {
        value.pop();
        if value.ends_with('\r') {
            value.pop();
        }
    }
    if value.is_empty() {
        return Err(Failure::Usage("the value on stdin is empty; pipe the value in".into()).into());
    }
    Ok(value)
}

fn table(secrets: &[SecretView]) -> String {
    if secrets.is_empty() {
        return "no secrets; store one with `printf %s \"$KEY\" | skiff secret set NAME`\n"
            .to_owned();
    }
    let now = now_ms();
    let rows: Vec<[String; 3]> = secrets
        .iter()
        .map(|s| {
            [
                s.name.clone(),
                ago(s.created_at_ms, now),
                ago(s.updated_at_ms, now),
            ]
        })
        .collect();
    render::table(&["NAME", "CREATED", "UPDATED"], &rows)
}
