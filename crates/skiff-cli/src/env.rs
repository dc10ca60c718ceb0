//! `skiff env create|list|show|check|exec|destroy|wait|sweep|snapshots`

use crate::client::Client;
use crate::render::{self, ago, human_bytes, now_ms};
use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use skiff_protocol::SnapshotId;
use skiff_protocol::environment::{
    CreateEnvironmentRequest, DeletedSnapshot, EnvironmentList, EnvironmentState, EnvironmentView,
    SnapshotList, SnapshotView, TakeSnapshotRequest,
};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Subcommand)]
pub enum EnvCommand {
    /// Lease a box for a worker profile and bring it up (provision, bootstrap, ready)
    Create(CreateArgs),
    /// List environments, newest first
    List,
    /// Show one environment
    Show(IdArgs),
    /// Inspect the lease and reconnect (verifies the pinned host key and the installed bundle)
    Check(IdArgs),
    /// Run a shell command on the box
    Exec(ExecArgs),
    /// Tear the box down (staged: drain, destroy, prove it is gone)
    Destroy(DestroyArgs),
    /// Wait until an environment reaches a state (for scripts)
    Wait(WaitArgs),
    /// Destroy leases (and delete snapshots) that providers hold but nothing here owns
    Sweep,
    /// List snapshots of prepared boxes, most recently used first; `rm` or `take` one
    Snapshots(SnapshotsArgs),
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SnapshotsArgs {
    #[command(subcommand)]
    action: Option<SnapshotAction>,
}

#[derive(Subcommand)]
enum SnapshotAction {
    /// Delete a snapshot (boxes already started from it keep their homes)
    Rm {
        /// Snapshot id (snap_…)
        id: String,
    },
    /// Snapshot the home of a box you prepared by hand (without its workspaces and ~/.skiff)
    Take {
        /// Environment id (env_…)
        env: String,
        /// The key (lowercase hex) of the sessions that should start from it; without one,
        /// only `env create --from-snapshot` starts boxes from it
        #[arg(long, value_name = "HEX")]
        key: Option<String>,
    },
}

#[derive(Args)]
pub struct IdArgs {
    /// Environment id (env_…)
    id: String,
}

#[derive(Args)]
pub struct CreateArgs {
    /// Worker profile from skiff.toml (`local` always exists)
    #[arg(long, default_value = "local")]
    profile: String,
    /// Hand out a warm idle environment of this profile when one has the gateway's build
    #[arg(long, conflicts_with = "from_snapshot")]
    reuse: bool,
    /// Start the box's home as a copy of this snapshot (of the same profile)
    #[arg(long, value_name = "snap_…")]
    from_snapshot: Option<String>,
}

#[derive(Args)]
pub struct ExecArgs {
    /// Environment id (env_…)
    id: String,
    /// The command to run on the box: one argument is a shell command line (`'ls | wc -l'`);
    /// several keep their boundaries (`bash -lc 'echo one; echo two'`)
    #[arg(trailing_var_arg = true, required = true)]
    command: Vec<String>,
}

/// The box's shell gets one command line: a single argument is one already, several are
/// quoted word by word so their boundaries survive it.
fn command_line(argv: &[String]) -> String {
    match argv {
        [line] => line.clone(),
        words => words
            .iter()
            .map(|w| {
                if !w.is_empty()
                    && w.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
                {
                    w.clone()
                } else {
                    format!("'{}'", w.replace('\'', "'\\''"))
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

#[derive(Args)]
pub struct WaitArgs {
    /// Environment id (env_…)
    id: String,
    /// The state to wait for, e.g. idle or destroyed
    #[arg(long = "for", value_name = "STATE")]
    state: String,
    /// Give up after this long
    #[arg(long, default_value = "5m")]
    timeout: String,
}

#[derive(Args)]
pub struct DestroyArgs {
    /// Environment id (env_…)
    id: String,
    /// Do not wait for active work to end
    #[arg(long)]
    force: bool,
}

pub async fn run(cmd: EnvCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    match cmd {
        EnvCommand::Create(args) => create(&client, args, json).await,
        EnvCommand::List => {
            let list: EnvironmentList = client.send(client.get("/v1/environments")).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else {
                out!("{}", table(&list.environments))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        EnvCommand::Show(args) => {
            let env: EnvironmentView = client
                .send(client.get(&format!("/v1/environments/{}", args.id)))
                .await?;
            print_env(&env, json)?;
            Ok(ExitCode::SUCCESS)
        }
        EnvCommand::Check(args) => {
            let env: EnvironmentView = client
                .send(client.post(
                    &format!("/v1/environments/{}/check", args.id),
                    &serde_json::json!({}),
                ))
                .await?;
            print_env(&env, json)?;
            Ok(if env.state == EnvironmentState::Failed {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        EnvCommand::Exec(args) => {
            let body = skiff_protocol::environment::ExecRequest {
                command: command_line(&args.command),
            };
            let out: skiff_protocol::environment::ExecResult = client
                .send(client.post(&format!("/v1/environments/{}/exec", args.id), &body))
                .await?;
            out!("{}", out.output)?;
            Ok(ExitCode::SUCCESS)
        }
        EnvCommand::Destroy(args) => {
            let path = format!("/v1/environments/{}?force={}", args.id, args.force);
            let env: EnvironmentView = client.send(client.delete(&path)).await?;
            print_env(&env, json)?;
            if env.state == EnvironmentState::Destroyed {
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!(
                    "environment {} is still {}; run `skiff env destroy {}` again",
                    env.id, env.state, env.id
                );
                Ok(ExitCode::from(1))
            }
        }
        EnvCommand::Wait(args) => wait(&client, args, json).await,
        EnvCommand::Snapshots(args) => snapshots(&client, args, json).await,
        EnvCommand::Sweep => {
            let swept: serde_json::Value = client
                .send(client.post("/v1/environments/sweep", &serde_json::json!({})))
                .await?;
            if json {
                outln!("{swept}")?;
            } else {
                let ids = swept["destroyed"].as_array().cloned().unwrap_or_default();
                let snapshots = swept["deleted_snapshots"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if ids.is_empty() && snapshots.is_empty() {
                    outln!("no orphaned leases or snapshots")?;
                }
                for id in ids {
                    outln!(
                        "destroyed orphaned lease {}",
                        id.as_str().unwrap_or_default()
                    )?;
                }
                for id in snapshots {
                    outln!(
                        "deleted orphaned snapshot {}",
                        id.as_str().unwrap_or_default()
                    )?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Creates the environment and follows it to ready (or failed), showing each step.
/// Follows an environment until `done` holds for its state or `timeout` passes, calling
/// `on_state` once per state it is seen in. Returns the last view and whether `done` held.
async fn follow(
    client: &Client,
    mut env: EnvironmentView,
    timeout: Duration,
    done: impl Fn(EnvironmentState) -> bool,
    mut on_state: impl FnMut(&EnvironmentView),
) -> Result<(EnvironmentView, bool)> {
    let started = Instant::now();
    let mut last = None;
    loop {
        if last != Some(env.state) {
            on_state(&env);
            last = Some(env.state);
        }
        if done(env.state) {
            return Ok((env, true));
        }
        if started.elapsed() >= timeout {
            return Ok((env, false));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        env = client
            .send(client.get(&format!("/v1/environments/{}", env.id)))
            .await?;
    }
}

/// Creates the environment and follows it to idle (or failed), showing each step.
async fn create(client: &Client, args: CreateArgs, json: bool) -> Result<ExitCode> {
    let started = Instant::now();
    let path = format!("/v1/environments?reuse={}", args.reuse);
    let from_snapshot = args
        .from_snapshot
        .as_deref()
        .map(parse_snapshot_id)
        .transpose()?;
    let env: EnvironmentView = client
        .send(client.post(
            &path,
            &CreateEnvironmentRequest {
                profile: args.profile.clone(),
                from_snapshot,
            },
        ))
        .await?;
    // `ready` is a step on the way to `idle`, not a place to stop. Provisioning is bounded by
    // the providers' own timeouts; the hour here only guards against a gateway that stalls.
    let settled = |state| {
        matches!(
            state,
            EnvironmentState::Idle
                | EnvironmentState::Attached
                | EnvironmentState::Failed
                | EnvironmentState::Destroyed
        )
    };
    let (env, _) = follow(client, env, Duration::from_secs(3600), settled, |env| {
        if !json {
            let secs = started.elapsed().as_secs_f64();
            eprintln!("{secs:>7.2}s  {}  {}", env.id, env.state);
        }
    })
    .await?;
    if env.development_only && !json {
        eprintln!(
            "note: profile `{}` is development-only: its boxes are not isolated from the host",
            env.profile
        );
    }
    print_env(&env, json)?;
    if env.state == EnvironmentState::Failed {
        bail!(
            "environment {} failed: {}",
            env.id,
            env.error.unwrap_or_default()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Polls the environment until it is in the wanted state (exit 0) or the timeout passes (1).
async fn wait(client: &Client, args: WaitArgs, json: bool) -> Result<ExitCode> {
    let Some(want) = EnvironmentState::parse(&args.state) else {
        bail!(
            "{:?} is not an environment state (requested, provisioning, bootstrapping, ready, attached, idle, draining, destroying, destroyed, failed, orphaned)",
            args.state
        );
    };
    let timeout = humantime::parse_duration(&args.timeout).map_err(|e| {
        anyhow::anyhow!(
            "--timeout {:?} is not a duration like 5m: {e}",
            args.timeout
        )
    })?;
    let env: EnvironmentView = client
        .send(client.get(&format!("/v1/environments/{}", args.id)))
        .await?;
    let (env, reached) = follow(client, env, timeout, |state| state == want, |_| {}).await?;
    print_env(&env, json)?;
    if reached {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "environment {} is still {} after {}",
            env.id, env.state, args.timeout
        );
        Ok(ExitCode::from(1))
    }
}

fn parse_snapshot_id(text: &str) -> Result<SnapshotId> {
    match SnapshotId::parse(text) {
        Some(id) => Ok(id),
        None => Err(crate::client::Failure::Usage(format!(
            "{text:?} is not a snapshot id (`snap_` and 16 lowercase hex characters); `skiff env snapshots` lists them"
        ))
        .into()),
    }
}

async fn snapshots(client: &Client, args: SnapshotsArgs, json: bool) -> Result<ExitCode> {
    match args.action {
        None => {
            let list: SnapshotList = client.send(client.get("/v1/snapshots")).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else {
                out!("{}", snapshot_table(&list.snapshots))?;
            }
        }
        Some(SnapshotAction::Rm { id }) => {
            let id = parse_snapshot_id(&id)?;
            let deleted: DeletedSnapshot = client
                .send(client.delete(&format!("/v1/snapshots/{id}")))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&deleted)?)?;
            } else {
                outln!(
                    "deleted snapshot {} ({} freed)",
                    deleted.id,
                    human_bytes(deleted.size_bytes)
                )?;
            }
        }
        Some(SnapshotAction::Take { env, key }) => {
            let snapshot: SnapshotView = client
                .send(client.post(
                    &format!("/v1/environments/{env}/snapshot"),
                    &TakeSnapshotRequest { key },
                ))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&snapshot)?)?;
            } else {
                outln!(
                    "snapshot {} of {} ({}); start a box from it with `skiff env create --profile {} --from-snapshot {}`",
                    snapshot.id,
                    snapshot.environment_id,
                    human_bytes(snapshot.size_bytes),
                    snapshot.profile,
                    snapshot.id
                )?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn snapshot_table(snapshots: &[SnapshotView]) -> String {
    if snapshots.is_empty() {
        return "no snapshots; a box's setup makes them, or `skiff env snapshots take ENV`\n"
            .to_owned();
    }
    let now = now_ms();
    let rows: Vec<[String; 7]> = snapshots
        .iter()
        .map(|s| {
            [
                s.id.to_string(),
                s.profile.clone(),
                s.key_prefix.clone(),
                human_bytes(s.size_bytes),
                ago(s.created_at_ms, now),
                ago(s.last_used_at_ms, now),
                s.state.to_string(),
            ]
        })
        .collect();
    render::table(
        &[
            "ID",
            "PROFILE",
            "KEY",
            "SIZE",
            "CREATED",
            "LAST USED",
            "STATE",
        ],
        &rows,
    )
}

fn print_env(env: &EnvironmentView, json: bool) -> Result<()> {
    if json {
        outln!("{}", serde_json::to_string_pretty(env)?)?;
        return Ok(());
    }
    let now = now_ms();
    let dev = if env.development_only {
        " (development only)"
    } else {
        ""
    };
    outln!("environment  {}", env.id)?;
    outln!("state        {}", env.state)?;
    outln!(
        "profile      {} · provider {}{dev}",
        env.profile,
        env.provider
    )?;
    outln!("lease        {}", env.lease_id.as_deref().unwrap_or("-"))?;
    outln!("ssh          {}", env.ssh_target.as_deref().unwrap_or("-"))?;
    outln!(
        "bundle       {}",
        env.bundle_hash
            .as_deref()
            .map(|h| &h[..h.len().min(16)])
            .unwrap_or("-")
    )?;
    outln!(
        "age          {} · idle since {}",
        ago(env.created_at_ms, now),
        ago(env.last_used_at_ms, now)
    )?;
    outln!(
        "sessions     {}",
        if env.attached_sessions.is_empty() {
            "-".to_owned()
        } else {
            env.attached_sessions
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        }
    )?;
    outln!("tunnel       {}", env.tunnel)?;
    if let Some(snapshot) = &env.from_snapshot {
        outln!("snapshot     {snapshot} (the home started from it)")?;
    }
    let a = env.accounting;
    outln!(
        "egress       {} model requests · tokens {} in / {} out · bytes {} in / {} out · {} gateway-tool calls",
        a.model_requests,
        a.input_tokens,
        a.output_tokens,
        a.bytes_in,
        a.bytes_out,
        a.gateway_tool_calls
    )?;
    if !env.egress_hosts.is_empty() {
        outln!("network      through the egress proxy:")?;
        outln!(
            "  {:<6}  {:<32}  {:>5}  {:>10}  {:>10}  {:>7}",
            "PHASE",
            "HOST",
            "CONNS",
            "SENT",
            "RECEIVED",
            "REFUSED"
        )?;
        for h in &env.egress_hosts {
            outln!(
                "  {:<6}  {:<32}  {:>5}  {:>10}  {:>10}  {:>7}",
                h.phase,
                h.host,
                h.connections,
                crate::render::bytes(h.bytes_out),
                crate::render::bytes(h.bytes_in),
                h.refused
            )?;
        }
    }
    if let Some(error) = &env.error {
        outln!("error        {error}")?;
    }
    Ok(())
}

fn table(envs: &[EnvironmentView]) -> String {
    if envs.is_empty() {
        return "no environments; lease one with `skiff env create --profile local`\n".to_owned();
    }
    let now = now_ms();
    let rows: Vec<[String; 7]> = envs
        .iter()
        .map(|e| {
            [
                e.id.to_string(),
                e.state.as_str().to_owned(),
                e.profile.clone(),
                e.provider.clone(),
                e.lease_id.clone().unwrap_or_else(|| "-".to_owned()),
                ago(e.created_at_ms, now),
                if e.development_only {
                    "development only".to_owned()
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    render::table(
        &["ID", "STATE", "PROFILE", "PROVIDER", "LEASE", "AGE", "NOTE"],
        &rows,
    )
}
