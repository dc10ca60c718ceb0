//! `skiff`: parses the command line, calls the crates, prints (for people, or `--json`).

#[macro_use]
mod out;

mod admin;
mod agent;
mod approvals;
mod audit;
mod boxes;
mod client;
mod demo;
mod doctor;
mod drain;
mod env;
mod gateway;
mod groups;
mod login;
mod migrate;
mod render;
mod results;
mod secret;
mod session;
mod ui;
mod worker;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

const EXIT_CODES: &str = "Exit codes:
  0  success
  1  the thing failed (a run failed or was cancelled, an apply or export was refused)
  2  usage error, or a request the gateway refused as bad (input, token, model, profile)
  3  the gateway is unreachable, at capacity or unavailable: try again later
  4  not found
  5  conflict: the session is busy, or its state does not allow it now
  6  a box, its provider or a git remote failed
  7  the gateway's own fault (its log has the cause)

Environment:
  SKIFF_URL, SKIFF_TOKEN   the gateway to talk to (win over <state-dir>/login.json from `skiff login`,
                           which wins over <state-dir>/gateway.json)
  SKIFF_VAULT_KEY          the gateway's vault key (base64 of 32 bytes) instead of <state-dir>/vault.key
  SKIFF_GRANT_KEY          the gateway's governed-action grant key (base64 of 32 bytes) instead of <state-dir>/grant.key";

#[derive(Parser)]
#[command(
    name = "skiff",
    version,
    about = "Run AI coding-agent sessions on machines you own, with the conversation, keys and policy kept at home.",
    after_help = EXIT_CODES,
    arg_required_else_help = true
)]
struct Cli {
    /// State directory [default: $XDG_STATE_HOME/skiff, else ~/.local/state/skiff]
    #[arg(long, global = true, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    // Before or after the command; `without_json_form` lists the commands that refuse it. One
    // line: a longer doc would switch every `--help` to clap's long layout.
    /// Print JSON for scripts (one document, or JSON lines for streams)
    #[arg(long, global = true)]
    json: bool,
    /// Print the build hash of this executable (what a box's installed bundle is checked against)
    #[arg(long, exclusive = true)]
    build_hash: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Start the control plane (API, sessions, runs)
    Gateway(gateway::GatewayArgs),
    /// Create, follow and control sessions
    #[command(subcommand)]
    Session(session::SessionCommand),
    /// Lease, inspect and tear down worker boxes
    #[command(subcommand)]
    Env(env::EnvCommand),
    /// This machine's local boxes behind the lease-CLI contract (what `command` providers run)
    Box(boxes::BoxArgs),
    /// Run the whole flow offline: a gateway, a sample repository, a session that edits, tests and commits
    Demo(demo::DemoArgs),
    /// Keep provider keys and tokens sealed in the gateway's vault (`api_key = "vault:NAME"`)
    #[command(subcommand)]
    Secret(secret::SecretCommand),
    /// Agent specs and their versions (`[agents.NAME]` or `agents/NAME.toml`)
    #[command(subcommand)]
    Agent(agent::AgentCommand),
    /// Let a tool call that waits for approval run (`skiff approve apr_…`)
    Approve(approvals::DecideArgs),
    /// Refuse a tool call that waits for approval; the agent reads the reason
    Deny(approvals::DenyArgs),
    /// Tool calls that waited or wait for approval, newest first
    Approvals(approvals::ListArgs),
    /// Print a one-use login link for the Control UI in a browser
    Ui(ui::UiArgs),
    /// Sign in to a gateway with single sign-on (a code to confirm at its identity provider); later commands use the token
    Login(login::LoginArgs),
    /// Forget the `skiff login` sign-in and revoke its token
    Logout,
    /// The gateway's administration: users, tokens, usage against budgets, moving to PostgreSQL
    #[command(subcommand)]
    Admin(admin::AdminCommand),
    /// Read and take away the audit trail (metadata only)
    #[command(subcommand)]
    Audit(audit::AuditCommand),
    /// Check this machine for what worker boxes need (root, sshd, rsync, namespaces…)
    Doctor,
    /// Print a shell completion script: `skiff completions bash > /etc/bash_completion.d/skiff`
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Worker mode: run a session's agent loop on a box (the gateway starts this over SSH)
    Worker(worker::WorkerArgs),
}

/// Commands whose output is not data have no JSON form. Refusing `--json` there (rather than
/// ignoring it) keeps a script from parsing a log or a shell script as a document.
fn without_json_form(command: &Command) -> Option<&'static str> {
    match command {
        Command::Gateway(args) if !args.is_drain() => {
            Some("gateway (its log has --log-format json)")
        }
        Command::Worker(_) => Some("worker"),
        Command::Completions { .. } => Some("completions"),
        Command::Env(env::EnvCommand::Exec(_)) => Some("env exec (it prints the box's own output)"),
        Command::Gateway(_)
        | Command::Session(_)
        | Command::Env(_)
        | Command::Box(_)
        | Command::Demo(_)
        | Command::Ui(_)
        | Command::Login(_)
        | Command::Logout
        | Command::Secret(_)
        | Command::Agent(_)
        | Command::Approve(_)
        | Command::Deny(_)
        | Command::Approvals(_)
        | Command::Admin(_)
        | Command::Audit(_)
        | Command::Doctor => None,
    }
}

fn default_state_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("skiff");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".local/state/skiff")
}

/// Writes the completion script for `shell` to stdout.
fn completions(shell: clap_complete::Shell) -> ExitCode {
    use clap::CommandFactory;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "skiff", &mut script);
    match out::write(format_args!("{}", String::from_utf8_lossy(&script))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if out::is_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.build_hash {
        return match std::env::current_exe().and_then(|exe| skiff_gateway::bundle::build_hash(&exe))
        {
            Ok(hash) => match outln!("{hash}") {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) if out::is_closed(&e) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::from(1)
                }
            },
            Err(e) => {
                eprintln!("error: cannot hash this executable: {e}");
                ExitCode::from(1)
            }
        };
    }
    let Some(command) = cli.command else {
        eprintln!("error: a command is required; see `skiff --help`");
        return ExitCode::from(2);
    };
    let json = cli.json;
    if json && let Some(name) = without_json_form(&command) {
        eprintln!("error: `skiff {name}` has no JSON form; run it without --json");
        return ExitCode::from(2);
    }
    if let Command::Completions { shell } = &command {
        return completions(*shell);
    }
    if let Command::Box(args) = &command
        && let Some(code) = boxes::sandbox_stage(args)
    {
        return code;
    }
    let state_dir = cli.state_dir.unwrap_or_else(default_state_dir);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async move {
        match command {
            Command::Gateway(args) => gateway::run(args, state_dir, json).await,
            Command::Session(cmd) => session::run(cmd, &state_dir, json).await,
            Command::Demo(args) => demo::run(args, &state_dir, json).await,
            Command::Env(cmd) => env::run(cmd, &state_dir, json).await,
            Command::Box(args) => boxes::run(args, &state_dir, json).await,
            Command::Ui(args) => ui::run(args, &state_dir, json).await,
            Command::Login(args) => login::login(args, &state_dir, json).await,
            Command::Logout => login::logout(&state_dir, json).await,
            Command::Secret(cmd) => secret::run(cmd, &state_dir, json).await,
            Command::Agent(cmd) => agent::run(cmd, &state_dir, json).await,
            Command::Approve(args) => approvals::approve(args, &state_dir, json).await,
            Command::Deny(args) => approvals::deny(args, &state_dir, json).await,
            Command::Approvals(args) => approvals::list(args, &state_dir, json).await,
            Command::Admin(cmd) => admin::run(cmd, &state_dir, json).await,
            Command::Audit(cmd) => audit::run(cmd, &state_dir, json).await,
            Command::Worker(args) => worker::run(args).await,
            Command::Doctor => doctor::run(json).await,
            // Answered above, before a runtime exists.
            Command::Completions { .. } => Ok(ExitCode::SUCCESS),
        }
    });
    match result {
        Ok(code) => code,
        // The reader of our output went away (`| head`): nothing more to say, and no one to
        // say it to.
        Err(e) if out::is_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(
                e.downcast_ref::<client::Failure>()
                    .map_or(1, client::Failure::exit_code),
            )
        }
    }
}
