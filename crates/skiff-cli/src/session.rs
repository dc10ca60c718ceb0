//! `skiff session new|list|show|send|watch|cancel|compact|pull-back|dispatch|checkpoints|restore|
//! fork|publish|quarantine` (and `diff|apply|export`, in `results.rs`; `compare|pick` and
//! `new --attempts`, in `groups.rs`)

use crate::client::Client;
use crate::render::{self, Detail, Live};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use futures_util::StreamExt;
use skiff_protocol::api::{
    CreateSessionRequest, ErrorCode, PlacementMove, RunStarted, RunStatus, SendMessageRequest,
};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::ReasoningEffort;
use skiff_protocol::{RunId, SessionId};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum SessionCommand {
    /// Create a session and run its first turn, streaming it
    New(NewArgs),
    /// List sessions, newest activity first
    List(ListArgs),
    /// Show a session: workspace, branch, runs and transcript
    Show(ShowArgs),
    /// Send the next message and stream the turn
    Send(SendArgs),
    /// Follow a session's current turn (after replaying its history)
    Watch(ShowArgs),
    /// Cancel the running turn
    Cancel(IdArgs),
    /// Summarise the conversation so far with the session's model; the model reads the
    /// summary instead of the earlier messages from the next turn on (the transcript keeps
    /// them)
    Compact(IdArgs),
    /// Bring a worker session home: its worker stopped and fenced, the box's work brought
    /// back, the box given back to the pool; the next message runs on the gateway
    PullBack(PullBackArgs),
    /// Place a session on a worker box of a profile now, without a message; the next
    /// message runs there
    Dispatch(DispatchArgs),
    /// List the session's end-of-turn workspace checkpoints
    Checkpoints(IdArgs),
    /// Put the session's workspace back to checkpoint N (the transcript stays; later
    /// checkpoints are kept)
    Restore(RestoreArgs),
    /// A new session with this one's transcript up to turn N and its workspace at checkpoint N
    Fork(ForkArgs),
    /// Push the session branch from your repository, with the gateway's git credentials
    Publish(PublishArgs),
    /// The session's changes against what it started from: a patch in git's format, or
    /// --stat; --run RUN for one turn's
    Diff(crate::results::DiffArgs),
    /// Write a plain session's changes back to its directory (or --to DIR), only where that
    /// still matches what the session started from; a git session's result is its branch
    Apply(crate::results::ApplyArgs),
    /// Write the session's whole result (its files, no .git) into a new directory
    Export(crate::results::ExportArgs),
    /// What a box produced that was not adopted: `quarantine ID`, `quarantine accept ID
    /// PATH…`, `quarantine discard ID`
    Quarantine(QuarantineArgs),
    /// The whole output of the newest setup run for this worker session
    SetupLog(IdArgs),
    /// A fan-out group's attempts side by side: status, diffstat, the last exec's exit code
    /// (tests) and the final message's first line
    Compare(CompareArgs),
    /// Pick a fan-out attempt as its group's result (its branch); the other attempts are
    /// parked, their boxes given back (they stay readable)
    Pick(IdArgs),
}

#[derive(Args)]
pub struct CompareArgs {
    /// Group id (grp_…), as `session new --attempts` printed it
    group: String,
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct QuarantineArgs {
    #[command(subcommand)]
    action: Option<QuarantineAction>,
    /// Session id (ses_…): list its quarantine
    id: Option<String>,
}

#[derive(Subcommand)]
enum QuarantineAction {
    /// Write quarantined paths into the session's workspace (your decision; audited)
    Accept {
        /// Session id (ses_…)
        id: String,
        /// Paths as the quarantine lists them
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Drop everything the session's quarantine holds
    Discard {
        /// Session id (ses_…)
        id: String,
    },
}

#[derive(Args)]
pub struct PublishArgs {
    /// Session id (ses_…)
    id: String,
    /// A remote configured in your repository
    #[arg(long, default_value = "origin")]
    remote: String,
    /// The branch to create or update there [default: skiff/<session-id>]
    #[arg(long, value_name = "NAME")]
    branch: Option<String>,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// Session id (ses_…)
    id: String,
    /// The checkpoint's number, as `skiff session checkpoints` lists it
    #[arg(long, value_name = "N")]
    checkpoint: u64,
}

#[derive(Args)]
pub struct ForkArgs {
    /// Session id (ses_…)
    id: String,
    /// The checkpoint (and turn) to fork at, as `skiff session checkpoints` lists it
    #[arg(long, value_name = "N")]
    at: u64,
    /// The new session's title [default: "<title> (fork at N)"]
    #[arg(long, value_name = "TITLE")]
    title: Option<String>,
}

#[derive(Args)]
pub struct PullBackArgs {
    /// Session id (ses_…)
    id: String,
    /// Cancel a running turn first (without it, a session with a turn running is refused)
    #[arg(long, conflicts_with = "live")]
    cancel: bool,
    /// Move a running turn with the session: its current model step and tool calls finish on
    /// the box, then the same turn goes on on the gateway
    #[arg(long)]
    live: bool,
}

#[derive(Args)]
pub struct DispatchArgs {
    /// Session id (ses_…)
    id: String,
    /// The worker profile to place it on (see `skiff env`)
    #[arg(long, value_name = "PROFILE")]
    profile: String,
    /// Move a running turn with the session: its current model step and tool calls finish on
    /// the gateway, then the same turn goes on on the box
    #[arg(long)]
    live: bool,
}

#[derive(Args)]
pub struct ListArgs {
    /// Show the sessions an agent dispatched under the session that dispatched them
    #[arg(long)]
    tree: bool,
    /// Show only the N most recently active sessions (default: all of them)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    limit: Option<u32>,
}

#[derive(Args)]
pub struct IdArgs {
    /// Session id (ses_…)
    id: String,
}

/// `--full`: for commands that show tool output.
#[derive(Args)]
pub struct FullArg {
    /// Show all of each command's output and of each tool error [default: the last 10 lines]
    #[arg(long)]
    full: bool,
}

#[derive(Args)]
pub struct ShowArgs {
    /// Session id (ses_…)
    id: String,
    #[command(flatten)]
    detail: FullArg,
}

#[derive(Args)]
pub struct NewArgs {
    /// The first message
    prompt: String,
    /// Git repository or directory to work on [default: the current directory]
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// A remote git repository the gateway clones (with its own credentials) instead of a
    /// directory; `session publish` pushes back to it
    #[arg(long, value_name = "URL", conflicts_with = "workspace")]
    repo: Option<String>,
    /// The branch, tag or commit of --repo to start from [default: the remote's default branch]
    #[arg(long = "ref", value_name = "REF", requires = "repo")]
    git_ref: Option<String>,
    /// Model as provider/model-id [default: models.default, else scripted/demo]
    #[arg(long, value_name = "REF")]
    model: Option<String>,
    /// Run the session on a worker box of this profile (see `skiff env`) instead of the gateway
    #[arg(long, value_name = "PROFILE")]
    profile: Option<String>,
    /// How hard the model reasons: off, low, medium or high [default: the model's `reasoning`
    /// in skiff.toml]
    #[arg(long, value_name = "EFFORT", value_parser = reasoning_effort)]
    reasoning: Option<ReasoningEffort>,
    /// Run with an agent spec: NAME (its current version) or NAME@DIGEST (pinned; a prefix
    /// of 7 or more characters will do) [default: the profile's `agent`]
    #[arg(long, value_name = "NAME[@DIGEST]")]
    agent: Option<String>,
    /// Fan-out: start N sibling sessions (2 to 8) with this prompt on N boxes of --profile,
    /// as one group to compare (`session compare`) and pick from (`session pick`)
    #[arg(long, value_name = "N", requires = "profile",
          value_parser = clap::value_parser!(u32).range(2..=i64::from(skiff_protocol::api::MAX_ATTEMPTS)))]
    attempts: Option<u32>,
    /// Which tool calls wait for your approval: never, on-request, or rules like
    /// '{ exec = ["rm *"], write_outside = ["src/**"], all = true }' [default: the profile's or gateway's `approval`]
    #[arg(long, value_name = "POLICY", value_parser = crate::approvals::parse_policy)]
    approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    /// Start the turn and return without streaming it
    #[arg(long)]
    detach: bool,
    #[command(flatten)]
    detail: FullArg,
}

#[derive(Args)]
pub struct SendArgs {
    /// Session id (ses_…)
    id: String,
    /// The message [optional with --agent: without it the spec is switched and no turn starts]
    #[arg(required_unless_present = "agent")]
    prompt: Option<String>,
    /// Run this turn, and the session from now on, on a worker box of this profile
    #[arg(long, value_name = "PROFILE", requires = "prompt")]
    profile: Option<String>,
    /// How hard the model reasons, from this turn on: off, low, medium or high
    #[arg(long, value_name = "EFFORT", value_parser = reasoning_effort, requires = "prompt")]
    reasoning: Option<ReasoningEffort>,
    /// Which tool calls wait for your approval: never, on-request, or rules like
    /// '{ exec = ["rm *"], write_outside = ["src/**"], all = true }' [default: the profile's or gateway's `approval`]
    #[arg(long, value_name = "POLICY", value_parser = crate::approvals::parse_policy, requires = "prompt")]
    approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    /// Switch the session to this agent spec from this turn on: NAME (its current version) or
    /// NAME@DIGEST (refused while a turn runs; the session keeps its model). Without a prompt
    /// only the spec changes, for the next turn
    #[arg(long, value_name = "NAME[@DIGEST]")]
    agent: Option<String>,
    /// Start the turn and return without streaming it
    #[arg(long, requires = "prompt")]
    detach: bool,
    #[command(flatten)]
    detail: FullArg,
}

/// `--reasoning`: a usage error (exit 2) names the allowed values.
fn reasoning_effort(value: &str) -> std::result::Result<ReasoningEffort, String> {
    ReasoningEffort::parse(value)
        .ok_or_else(|| format!("`{value}` is not a reasoning effort; use off, low, medium or high"))
}

pub async fn run(cmd: SessionCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    match cmd {
        SessionCommand::New(args) => {
            let (workspace, repo) = match args.repo {
                Some(url) => (
                    String::new(),
                    Some(skiff_protocol::api::RepoSource {
                        url,
                        git_ref: args.git_ref,
                    }),
                ),
                None => {
                    let workspace = match args.workspace {
                        Some(dir) => dir,
                        None => {
                            std::env::current_dir().context("cannot read the current directory")?
                        }
                    };
                    let workspace = std::path::absolute(&workspace)
                        .with_context(|| format!("cannot resolve {}", workspace.display()))?;
                    (workspace.display().to_string(), None)
                }
            };
            let request = CreateSessionRequest {
                prompt: args.prompt,
                workspace,
                repo,
                model: args.model,
                profile: args.profile,
                reasoning: args.reasoning,
                attempts: args.attempts,
                approval: args.approval,
                agent: args.agent.clone(),
            };
            if args.attempts.is_some() {
                let started = client.send(client.post("/v1/sessions", &request)).await?;
                let live = Detail::with_full_flag(args.detail.full);
                return crate::groups::started(&client, started, args.detach, json, live).await;
            }
            let started = client.create_session(&request).await?;
            let live = Live::with_detail(json, Detail::with_full_flag(args.detail.full));
            started_turn(&client, started, args.detach, live).await
        }
        SessionCommand::Send(args) => {
            let Some(prompt) = args.prompt else {
                // `--agent` alone (clap requires one of the two): a switch between turns.
                let agent = args.agent.unwrap_or_default();
                let session = client.switch_agent(&args.id, &agent).await?;
                if json {
                    outln!("{}", serde_json::to_string_pretty(&session)?)?;
                } else {
                    let pin = session.agent.as_ref().map_or(agent, |p| p.short());
                    outln!("session {} runs agent {pin} from its next turn", session.id)?;
                }
                return Ok(ExitCode::SUCCESS);
            };
            let started = client
                .send_message(
                    &args.id,
                    &SendMessageRequest {
                        prompt,
                        profile: args.profile,
                        reasoning: args.reasoning,
                        approval: args.approval,
                        agent: args.agent,
                    },
                )
                .await?;
            let live = Live::with_detail(json, Detail::with_full_flag(args.detail.full));
            started_turn(&client, started, args.detach, live).await
        }
        SessionCommand::List(args) => {
            let limit = args.limit.map(|n| n as usize);
            let list = client.sessions(limit).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else {
                // A viewer's, operator's or admin's list holds the whole tenant's sessions:
                // those of others say whose they are.
                let me = client.me().await?.email;
                if args.tree {
                    out!("{}", render::session_tree(&list.sessions, &me))?;
                } else {
                    out!("{}", render::session_table(&list.sessions, &me))?;
                }
            }
            if !json && list.next.is_some() {
                eprintln!(
                    "(the {} most recently active; older ones with a larger --limit, or without it)",
                    list.sessions.len()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Show(args) => {
            let detail = client.session(&args.id).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&detail)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            let s = &detail.session;
            outln!("session    {}", s.id)?;
            outln!("title      {}", s.title)?;
            if let Some(parent) = &s.parent_id {
                outln!("parent     {parent} (its agent dispatched this session)")?;
            }
            if let Some(group) = &detail.group {
                outln!("group      {}", crate::groups::membership(group, &s.id))?;
            }
            outln!("state      {}", render::state(s))?;
            match &s.worker {
                Some(w) => outln!(
                    "placement  {} on {} (profile {}, epoch {}){}",
                    s.placement,
                    match &w.environment_id {
                        Some(e) => e.to_string(),
                        // Parked: its box went back to the pool between turns.
                        None if s.placement == "parked" => {
                            "no box (the next message places it again)".to_owned()
                        }
                        None => "no box yet".to_owned(),
                    },
                    w.profile,
                    w.owner_epoch,
                    w.error
                        .as_ref()
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default()
                )?,
                None => outln!("placement  {}", s.placement)?,
            }
            if let Some(left_out) = s.worker.as_ref().and_then(|w| w.left_out.as_ref()) {
                outln!("sync       {left_out}")?;
            }
            outln!("model      {}", s.model.label)?;
            if let Some(effort) = s.reasoning {
                outln!("reasoning  {}", effort.as_str())?;
            }
            if let Some(policy) = &s.approval {
                outln!("approval   {}", policy.describe())?;
            }
            if let Some(agent) = &s.agent {
                outln!("agent      {}", agent.short())?;
            }
            match &s.workspace {
                skiff_protocol::api::WorkspaceView::Git {
                    source,
                    path,
                    branch,
                    base_commit,
                    remote,
                } => {
                    match remote {
                        Some(url) => outln!("repo       {url}")?,
                        None => outln!("workspace  {path} (git worktree of {source})")?,
                    }
                    outln!(
                        "branch     {branch} (from {})",
                        &base_commit[..base_commit.len().min(12)]
                    )?;
                }
                skiff_protocol::api::WorkspaceView::Plain { source, path } => {
                    outln!("workspace  {path} (copy of {source})")?;
                }
            }
            outln!("runs       {}", detail.runs.len())?;
            for run in &detail.runs {
                let err = run
                    .error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default();
                let tokens = render::tokens(
                    run.input_tokens,
                    run.output_tokens,
                    run.cache_read_tokens,
                    run.cache_write_tokens,
                    run.cost_usd,
                );
                outln!("  {}  {}  {tokens}{err}", run.id, run.status)?;
                // A run that moved between boxes lists each try: where, under which epoch,
                // from which checkpoint, and how it ended.
                let attempts: Vec<_> = detail
                    .attempts
                    .iter()
                    .filter(|a| a.run_id == run.id)
                    .collect();
                if attempts.len() > 1 {
                    for (n, a) in attempts.iter().enumerate() {
                        let from = a
                            .from_checkpoint
                            .map(|c| format!("  from checkpoint {c}"))
                            .unwrap_or_default();
                        let why = a
                            .error
                            .as_deref()
                            .map(|e| format!(": {e}"))
                            .unwrap_or_default();
                        outln!(
                            "    attempt {}  {}  epoch {}{from}  {}{why}",
                            n + 1,
                            a.node,
                            a.owner_epoch,
                            a.status
                        )?;
                    }
                }
            }
            // With one run the total would repeat its line.
            if detail.runs.len() > 1 {
                let t = &detail.totals;
                let tokens = render::tokens(
                    t.input_tokens,
                    t.output_tokens,
                    t.cache_read_tokens,
                    t.cache_write_tokens,
                    t.cost_usd,
                );
                outln!("total      {tokens}")?;
            }
            // The budgets in force, one line for all of them (none when none is configured).
            let limited: Vec<String> = detail
                .usage
                .iter()
                .filter(|l| l.tokens_limit.is_some() || l.cost_usd_limit.is_some())
                .map(render::usage_line)
                .collect();
            if !limited.is_empty() {
                outln!("budgets    {}", limited.join(" · "))?;
            }
            outln!()?;
            let shown = Detail::with_full_flag(args.detail.full);
            out!("{}", render::transcript(&detail.transcript, shown))?;
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Watch(args) => {
            let detail = client.session(&args.id).await?;
            let Some(run) = detail.runs.last() else {
                eprintln!("session {} has no runs yet", args.id);
                return Ok(ExitCode::SUCCESS);
            };
            let live = Live::with_detail(json, Detail::with_full_flag(args.detail.full));
            follow(&client, &detail.session.id, &run.id, live).await
        }
        SessionCommand::Checkpoints(args) => {
            let path = format!("/v1/sessions/{}/checkpoints", args.id);
            let list: skiff_protocol::sync::CheckpointList = client.send(client.get(&path)).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            }
            for c in list.checkpoints.iter().filter(|_| !json) {
                let at = c.git_ref.as_deref().or(c.manifest.as_deref()).unwrap_or("");
                let (seq, id, mode, files) = (c.seq, &c.id, &c.mode, c.files);
                outln!("{seq:>3}  {id}  {mode:<5}  {files} files  {at}")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Restore(args) => {
            let path = format!("/v1/sessions/{}/restore", args.id);
            let body = skiff_protocol::sync::RestoreRequest {
                checkpoint: args.checkpoint,
            };
            let done: skiff_protocol::sync::RestoreResult =
                client.send(client.post(&path, &body)).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&done)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            for p in &done.written {
                outln!("wrote    {p}")?;
            }
            for p in &done.deleted {
                outln!("deleted  {p}")?;
            }
            let n = done.checkpoint;
            eprintln!(
                "restored session {}'s workspace to checkpoint {n}: {} written, {} deleted{}",
                done.session_id,
                done.written.len(),
                done.deleted.len(),
                match &done.commit {
                    Some(c) => format!(
                        "; recorded on the session branch as {}",
                        &c[..c.len().min(12)]
                    ),
                    None => String::new(),
                }
            );
            match done.later.last() {
                Some(last) => eprintln!(
                    "later checkpoints are kept ({}); go back with `skiff session restore {} --checkpoint {last}`",
                    done.later
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    done.session_id
                ),
                None => eprintln!("next: `skiff session send {} MESSAGE`", done.session_id),
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Fork(args) => {
            let path = format!("/v1/sessions/{}/fork", args.id);
            let body = skiff_protocol::sync::ForkRequest {
                at: args.at,
                title: args.title,
            };
            let view: skiff_protocol::api::SessionView =
                client.send(client.post(&path, &body)).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&view)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            outln!("{}", view.id)?;
            eprintln!(
                "forked {} at checkpoint {} as {} ({}), workspace {}",
                args.id,
                args.at,
                view.id,
                view.title,
                view.workspace.path()
            );
            eprintln!("next: `skiff session send {} MESSAGE`", view.id);
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Quarantine(args) => quarantine(&client, args, json).await,
        SessionCommand::SetupLog(args) => {
            let path = format!("/v1/sessions/{}/setup-log", args.id);
            let log: skiff_protocol::environment::SetupLog = client.send(client.get(&path)).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&log)?)?;
            } else {
                out!("{}", log.text)?;
                let how = match log.exit_code {
                    0 => "succeeded".to_owned(),
                    124 => "ran out of time".to_owned(),
                    code => format!("exited with status {code}"),
                };
                eprintln!(
                    "{} {how} after {:.1} s",
                    log.setup,
                    log.duration_ms as f64 / 1000.0
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Compare(args) => crate::groups::compare(&client, &args.group, json).await,
        SessionCommand::Pick(args) => crate::groups::pick(&client, &args.id, json).await,
        SessionCommand::Diff(args) => crate::results::diff(&client, args, json).await,
        SessionCommand::Apply(args) => crate::results::apply(&client, args, json).await,
        SessionCommand::Export(args) => crate::results::export(&client, args, json).await,
        SessionCommand::Publish(args) => {
            let body = skiff_protocol::sync::PublishRequest {
                remote: Some(args.remote),
                branch: args.branch,
            };
            let path = format!("/v1/sessions/{}/publish", args.id);
            let done: skiff_protocol::sync::PublishResult =
                client.send(client.post(&path, &body)).await?;
            if json {
                outln!("{}", serde_json::to_string(&done)?)?;
            } else {
                let short = &done.commit[..done.commit.len().min(12)];
                outln!("pushed {short} to {} as {}", done.remote, done.branch)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::PullBack(args) => {
            let path = format!("/v1/sessions/{}/pull-back", args.id);
            let body = skiff_protocol::api::PullBackRequest {
                cancel: args.cancel,
                live: args.live,
            };
            let answer = client.send(client.post(&path, &body)).await;
            let answer = match answer {
                Err(e) if !args.cancel && !args.live && busy(&e) => {
                    anyhow::bail!(crate::client::Failure::Refused(
                        skiff_protocol::api::ApiError {
                            code: ErrorCode::SessionBusy.as_str().into(),
                            message: format!(
                                "session {} has a turn running; wait for it, pass --live to move it with the session, or --cancel to stop it and pull back",
                                args.id
                            ),
                        }
                    ))
                }
                other => other?,
            };
            follow_move(&client, answer, PlacementState::Local, json).await
        }
        SessionCommand::Dispatch(args) => {
            let path = format!("/v1/sessions/{}/dispatch", args.id);
            let body = skiff_protocol::api::DispatchRequest {
                profile: args.profile,
                live: args.live,
            };
            let answer = client.send(client.post(&path, &body)).await?;
            follow_move(&client, answer, PlacementState::Active, json).await
        }
        SessionCommand::Compact(args) => {
            let path = format!("/v1/sessions/{}/compact", args.id);
            let done: skiff_protocol::api::CompactResult = client
                .send(client.post(&path, &serde_json::json!({})))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&done)?)?;
            } else {
                outln!(
                    "compacted {} entries (≈{} tokens) into a summary of {} tokens",
                    done.entries,
                    done.tokens_before,
                    done.summary_tokens
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        SessionCommand::Cancel(args) => {
            let run = client.cancel(&args.id).await?;
            if json {
                outln!("{}", serde_json::to_string(&run)?)?;
            } else {
                eprintln!("cancelling run {} of session {}", run.id, args.id);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn started_turn(
    client: &Client,
    started: RunStarted,
    detach: bool,
    live: Live,
) -> Result<ExitCode> {
    let json = live.json();
    if detach {
        if json {
            outln!("{}", serde_json::to_string(&started)?)?;
        } else {
            outln!("{}", started.session.id)?;
            eprintln!(
                "started run {} of session {}; follow it with `skiff session watch {}`",
                started.run.id, started.session.id, started.session.id
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !json {
        eprintln!(
            "session {} · {} · {}",
            started.session.id,
            started.session.model.label,
            started.session.workspace.path()
        );
    }
    follow(client, &started.session.id, &started.run.id, live).await
}

/// Streams a session's events until `run` ends; the exit code says how it ended.
pub async fn follow(
    client: &Client,
    session: &SessionId,
    run: &RunId,
    mut live: Live,
) -> Result<ExitCode> {
    let status = follow_until_end(client, session, run, &mut live).await?;
    Ok(if status == RunStatus::Succeeded {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub async fn follow_until_end(
    client: &Client,
    session: &SessionId,
    run: &RunId,
    live: &mut Live,
) -> Result<RunStatus> {
    let mut events = std::pin::pin!(client.events(session, 0).await?);
    while let Some(event) = events.next().await {
        let event = event?;
        if event.run_id.as_ref() != Some(run) {
            continue;
        }
        live.show(&event)?;
        if let EventKind::RunStatus { status, .. } = event.kind
            && status.is_terminal()
        {
            live.finish()?;
            return Ok(status);
        }
    }
    live.finish()?;
    anyhow::bail!(crate::client::Failure::Unreachable(format!(
        "the gateway at {} closed the event stream before run {run} ended",
        client.url()
    )))
}

fn busy(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<crate::client::Failure>(),
        Some(crate::client::Failure::Refused(api)) if api.kind() == Some(ErrorCode::SessionBusy)
    )
}

/// Shows a pull-back's or dispatch's steps (placement events) until the placement settles;
/// succeeds when it settled where the move was going (`target`).
async fn follow_move(
    client: &Client,
    answer: PlacementMove,
    target: PlacementState,
    json: bool,
) -> Result<ExitCode> {
    if json {
        outln!("{}", serde_json::to_string(&answer)?)?;
    } else {
        eprintln!("{}", answer.message);
    }
    if !answer.moved {
        return Ok(ExitCode::SUCCESS);
    }
    let mut live = Live::new(json);
    let session = &answer.session.id;
    let mut events = std::pin::pin!(client.events(session, answer.after_cursor).await?);
    while let Some(event) = events.next().await {
        let event = event?;
        let state = match &event.kind {
            EventKind::Placement { state, .. } => *state,
            EventKind::SetupOutput { .. } => {
                live.show(&event)?;
                continue;
            }
            _ => continue,
        };
        live.show(&event)?;
        if matches!(
            state,
            PlacementState::Local
                | PlacementState::Active
                | PlacementState::Failed
                | PlacementState::Reclaimed
                | PlacementState::Parked
        ) {
            live.finish()?;
            return Ok(if state == target {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            });
        }
    }
    live.finish()?;
    anyhow::bail!(crate::client::Failure::Unreachable(format!(
        "the gateway at {} closed the event stream before session {session} settled",
        client.url()
    )))
}

/// `skiff session quarantine …`.
async fn quarantine(client: &Client, args: QuarantineArgs, json: bool) -> Result<ExitCode> {
    use skiff_protocol::sync::{AcceptRequest, QuarantineList};
    let list: QuarantineList = match args.action {
        Some(QuarantineAction::Accept { id, paths }) => {
            let path = format!("/v1/sessions/{id}/quarantine/accept");
            let list = client
                .send(client.post(
                    &path,
                    &AcceptRequest {
                        paths: paths.clone(),
                    },
                ))
                .await?;
            if !json {
                for p in &paths {
                    eprintln!("accepted {p} into session {id}'s workspace");
                }
            }
            list
        }
        Some(QuarantineAction::Discard { id }) => {
            let path = format!("/v1/sessions/{id}/quarantine/discard");
            let list = client
                .send(client.post(&path, &serde_json::json!({})))
                .await?;
            if !json {
                eprintln!("discarded session {id}'s quarantine");
            }
            list
        }
        None => {
            let Some(id) = args.id else {
                anyhow::bail!(
                    "name a session: `skiff session quarantine ID`, `… accept ID PATH…` or `… discard ID`"
                );
            };
            let path = format!("/v1/sessions/{id}/quarantine");
            client.send(client.get(&path)).await?
        }
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&list)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if list.quarantines.is_empty() {
        outln!("nothing in quarantine")?;
    }
    for q in &list.quarantines {
        outln!("{}  ({} paths)", q.id, q.paths.len())?;
        for p in &q.paths {
            let kept = if p.kept { "" } else { "  [bytes not kept]" };
            let what = match &p.entry {
                Some(skiff_protocol::sync::ManifestEntry::Symlink { target }) => {
                    format!(" -> {target}")
                }
                _ => String::new(),
            };
            outln!("  {}{what}: {}{kept}", p.path, p.reason)?;
        }
        if let Some(bundle) = &q.bundle {
            outln!("  the box's commits: git fetch {bundle} (a bundle of its session branch)")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
