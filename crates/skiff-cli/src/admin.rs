//! `skiff admin usage|user|token|migrate`: what each user, tenant and session used against its
//! budgets (the gateway's admins only), the people who may use the gateway with the tokens
//! they sign in with (an admin of their tenant), and moving a stopped gateway's state to
//! PostgreSQL (`migrate.rs`, which works on the state dir, not through a gateway).

use crate::client::Client;
use crate::render::{self, ago, now_ms};
use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use skiff_protocol::budget::UsageReport;
use skiff_protocol::people::{
    AddUserRequest, CreateTokenRequest, CreatedToken, Role, TokenList, TokenScope, TokenView,
    UserList, UserView,
};
use std::path::Path;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum AdminCommand {
    /// Tokens and cost per user and tenant today (UTC) and per session, against `[budgets]`
    Usage,
    /// The people who may use the gateway, each with a role in a tenant
    #[command(subcommand)]
    User(UserCommand),
    /// The tokens people sign in with (shown once, stored as a hash)
    #[command(subcommand)]
    Token(TokenCommand),
    /// Copy this state's database into an empty PostgreSQL database and verify it, with the gateway stopped: `skiff admin migrate --to postgres://skiff@db.example/skiff`
    Migrate(crate::migrate::MigrateArgs),
}

#[derive(Subcommand)]
pub enum UserCommand {
    /// Add a user: `skiff admin user add ada@example.com --role member`
    Add(AddUserArgs),
    /// Every user of your tenant (of every tenant for the gateway's first admins)
    List,
    /// Remove a user and revoke their tokens (their sessions stay)
    Remove { email: String },
}

#[derive(Args)]
pub struct AddUserArgs {
    pub email: String,
    /// admin (everything in the tenant), operator (also environments), member (own sessions),
    /// viewer (reads only)
    #[arg(long, value_parser = parse_role)]
    pub role: Role,
    /// The tenant (default: yours)
    #[arg(long)]
    pub tenant: Option<String>,
}

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Create a token for a user; it is printed once: `skiff admin token create --user ada@example.com --scope write --expires 30d`
    Create(CreateTokenArgs),
    /// Every token of your tenant (never a secret)
    List,
    /// Revoke a token at once
    Revoke { id: String },
}

#[derive(Args)]
pub struct CreateTokenArgs {
    #[arg(long)]
    pub user: String,
    /// read, write or admin: the most the token may do, whatever the user's role
    #[arg(long, value_parser = parse_scope)]
    pub scope: TokenScope,
    /// How long it works: `30d`, `12h` (at most a year)
    #[arg(long, value_parser = parse_expiry)]
    pub expires: std::time::Duration,
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s)
        .ok_or_else(|| format!("{s:?} is not a role: use admin, operator, member or viewer"))
}

fn parse_scope(s: &str) -> Result<TokenScope, String> {
    TokenScope::parse(s)
        .ok_or_else(|| format!("{s:?} is not a token scope: use read, write or admin"))
}

fn parse_expiry(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 30d or 12h: {e}"))
}

pub async fn run(cmd: AdminCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    match cmd {
        AdminCommand::Usage => usage(&Client::discover(state_dir)?, json).await,
        AdminCommand::User(cmd) => user(&Client::discover(state_dir)?, cmd, json).await,
        AdminCommand::Token(cmd) => token(&Client::discover(state_dir)?, cmd, json).await,
        AdminCommand::Migrate(args) => crate::migrate::run(args, state_dir, json),
    }
}

async fn usage(client: &Client, json: bool) -> Result<ExitCode> {
    let report: UsageReport = client.send(client.get("/v1/admin/usage")).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if report.lines.is_empty() {
        outln!("no model was used on {} (UTC)", report.day)?;
        return Ok(ExitCode::SUCCESS);
    }
    for line in &report.lines {
        outln!("{}", render::usage_line(line))?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn user(client: &Client, cmd: UserCommand, json: bool) -> Result<ExitCode> {
    let (view, verb): (UserView, &str) = match cmd {
        UserCommand::Add(args) => {
            let body = AddUserRequest {
                email: args.email,
                role: args.role,
                tenant: args.tenant,
            };
            (
                client.send(client.post("/v1/admin/users", &body)).await?,
                "added",
            )
        }
        UserCommand::Remove { email } => (
            client
                .send(client.delete(&format!("/v1/admin/users/{email}")))
                .await?,
            "removed (their tokens are revoked)",
        ),
        UserCommand::List => {
            let list: UserList = client.send(client.get("/v1/admin/users")).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else {
                let now = now_ms();
                let rows: Vec<[String; 4]> = list
                    .users
                    .iter()
                    .map(|u| {
                        [
                            u.email.clone(),
                            u.role.to_string(),
                            u.tenant.clone(),
                            ago(u.created_at_ms, now),
                        ]
                    })
                    .collect();
                out!(
                    "{}",
                    render::table(&["EMAIL", "ROLE", "TENANT", "ADDED"], &rows)
                )?;
            }
            return Ok(ExitCode::SUCCESS);
        }
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&view)?)?;
    } else {
        outln!(
            "{} {verb}: {} in tenant {}",
            view.email,
            view.role,
            view.tenant
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

fn expiry(t: &TokenView) -> String {
    match t.expires_at_ms {
        None => "never".to_owned(),
        Some(at) => {
            let at = std::time::UNIX_EPOCH
                + std::time::Duration::from_millis(u64::try_from(at).unwrap_or(0));
            humantime::format_rfc3339_seconds(at).to_string()
        }
    }
}

async fn token(client: &Client, cmd: TokenCommand, json: bool) -> Result<ExitCode> {
    match cmd {
        TokenCommand::Create(args) => {
            let expires_in_s = args.expires.as_secs();
            if expires_in_s == 0 {
                bail!("--expires must be at least a second (like 30d)");
            }
            let body = CreateTokenRequest {
                email: args.user,
                scope: args.scope,
                expires_in_s,
            };
            let created: CreatedToken = client.send(client.post("/v1/admin/tokens", &body)).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&created)?)?;
            } else {
                outln!("{}", created.secret)?;
                eprintln!(
                    "token {} for {} ({} scope), expires {}. It is shown only now: hand it over as SKIFF_TOKEN",
                    created.token.id,
                    created.token.email,
                    created.token.scope,
                    expiry(&created.token)
                );
            }
        }
        TokenCommand::List => {
            let list: TokenList = client.send(client.get("/v1/admin/tokens")).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else {
                let now = now_ms();
                let rows: Vec<[String; 5]> = list
                    .tokens
                    .iter()
                    .map(|t| {
                        [
                            t.id.clone(),
                            t.email.clone(),
                            t.scope.to_string(),
                            ago(t.created_at_ms, now),
                            expiry(t),
                        ]
                    })
                    .collect();
                out!(
                    "{}",
                    render::table(&["ID", "USER", "SCOPE", "CREATED", "EXPIRES"], &rows)
                )?;
            }
        }
        TokenCommand::Revoke { id } => {
            let view: TokenView = client
                .send(client.delete(&format!("/v1/admin/tokens/{id}")))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&view)?)?;
            } else {
                outln!("token {} of {} revoked", view.id, view.email)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
