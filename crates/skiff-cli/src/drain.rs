//! `skiff gateway drain`: asks a gateway to hand its sessions to the other gateways on its
//! database, shows the hand-over as it goes, and waits until the gateway has exited.

use crate::client::{Client, Failure};
use anyhow::Result;
use clap::Args;
use futures_util::StreamExt;
use skiff_protocol::drain::{DrainLine, DrainReport};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How long the drained gateway gets to exit after its report.
const EXIT_PATIENCE: Duration = Duration::from_secs(60);

#[derive(Args)]
pub struct DrainArgs {
    /// The gateway to drain [default: the one the CLI talks to: SKIFF_URL, login.json or gateway.json]
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// Drain even when no other gateway is live: its running turns end orphaned, as at a restart
    #[arg(long)]
    force: bool,
}

/// With `--json`: the report, `{gateway, handed_over, turns, others, seconds}`.
pub async fn run(args: DrainArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let mut client = Client::discover(state_dir)?;
    if let Some(url) = &args.url {
        client = client.at(url);
    }
    let mut lines = std::pin::pin!(client.drain(args.force).await?);
    let mut report: Option<DrainReport> = None;
    while let Some(line) = lines.next().await {
        match line? {
            DrainLine::Progress { turns, left } => {
                if !json {
                    eprintln!("handing over {turns} turn{}… {left} left", plural(turns));
                }
            }
            DrainLine::Drained(done) => report = Some(done),
        }
    }
    let Some(report) = report else {
        return Err(Failure::Unreachable(format!(
            "the gateway at {} stopped answering before its drain was done; it may still be \
             handing over (see its log), and its sessions go to the others when their leases expire",
            client.url()
        ))
        .into());
    };
    // Its report is its last word; the exit follows.
    let waited = Instant::now();
    while client.alive().await {
        if waited.elapsed() > EXIT_PATIENCE {
            return Err(anyhow::anyhow!(
                "gateway {} handed its sessions over but still answers at {} after {} s; stop it \
                 (it holds no session now)",
                report.gateway,
                client.url(),
                EXIT_PATIENCE.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if json {
        outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        let whom = if report.others {
            "to the other gateways"
        } else {
            "to no one (forced: its running turns ended orphaned)"
        };
        outln!(
            "gateway {} drained: {} session{} handed over {whom} in {:.1} s; it has exited",
            report.gateway,
            report.handed_over,
            plural(report.handed_over),
            report.seconds
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}
