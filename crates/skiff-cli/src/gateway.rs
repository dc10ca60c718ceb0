//! `skiff gateway`

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct GatewayArgs {
    #[command(subcommand)]
    action: Option<GatewayAction>,
    /// Address of the HTTP+WebSocket API
    #[arg(long, default_value = "127.0.0.1:7777", value_name = "ADDR")]
    listen: String,
    /// Configuration file [default: <state-dir>/skiff.toml; a missing file means defaults]
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log format on stderr
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum GatewayAction {
    /// Hand this gateway's sessions to the other gateways on its database and exit (rolling upgrades)
    Drain(crate::drain::DrainArgs),
}

impl GatewayArgs {
    /// Whether this is `skiff gateway drain` (which has a JSON form) rather than a gateway.
    pub fn is_drain(&self) -> bool {
        matches!(self.action, Some(GatewayAction::Drain(_)))
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // The MCP client library logs each server's whole handshake at info; the gateway says
        // what matters of it (ready, with which tools) itself.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rmcp=warn"));
    // Colour only for a person at a terminal: a redirected log (a file, journald) gets none.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

pub async fn run(args: GatewayArgs, state_dir: PathBuf, json: bool) -> Result<ExitCode> {
    if let Some(GatewayAction::Drain(drain)) = args.action {
        return crate::drain::run(drain, &state_dir, json).await;
    }
    init_logging(args.log_format);
    let mut running = skiff_gateway::start(skiff_gateway::Options {
        state_dir: state_dir.clone(),
        listen: args.listen,
        config: args.config,
    })
    .await?;
    if let Some(warning) = running.sandbox_warning() {
        eprintln!("{warning}");
    }
    if let Some(warning) = exposure_warning(running.addr) {
        tracing::warn!(addr = %running.addr, "listening on a non-loopback address over plain HTTP");
        eprintln!("{warning}");
    }
    // The one line on stdout: where the gateway is. Scripts and tests wait for it. A gateway
    // whose stdout nobody reads (a supervisor closed it) keeps serving: it is not the output.
    if let Err(e) = outln!("skiff gateway listening on {}", running.url) {
        tracing::warn!(error = %e, "could not print the listening line on stdout");
    }
    match running.token {
        Some(_) => eprintln!(
            "token and URL written to {} (mode 0600); the CLI finds them there",
            state_dir.join("gateway.json").display()
        ),
        None => eprintln!(
            "URL written to {} without a token: {}",
            state_dir.join("gateway.json").display(),
            skiff_gateway::JOINED_WITHOUT_TOKEN
        ),
    }
    let drained = running.drained();
    let stopped = tokio::select! {
        result = running.wait() => Some(result),
        () = shutdown_signal() => None,
        // `skiff gateway drain` handed everything over: stop as at a signal, and exit 0.
        () = drained => None,
    };
    match stopped {
        Some(result) => result?,
        None => {
            tracing::info!("shutting down");
            running.shutdown().await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What to tell the operator of a gateway reachable from other machines: it speaks plain HTTP.
fn exposure_warning(addr: std::net::SocketAddr) -> Option<String> {
    if addr.ip().is_loopback() {
        return None;
    }
    Some(format!(
        "warning: listening on {addr}, which is not a loopback address: the API and the Control UI \
         are served there over plain HTTP, so bearer tokens (the admin token included) and UI session \
         cookies cross that network in clear text.\n\
         To reach the gateway from elsewhere, put TLS in front: listen on loopback \
         (--listen 127.0.0.1:7777) and let a reverse proxy that terminates TLS (nginx, Caddy) forward \
         to it, keeping the Host header and sending X-Forwarded-Proto: https (the UI cookie is then \
         marked Secure)."
    ))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
