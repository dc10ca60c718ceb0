//! `skiff worker`: worker mode on a box. Started by the gateway over SSH with a scrubbed
//! environment; reads its credential from a file the gateway just wrote, deletes it at once,
//! and keeps it only in memory.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args)]
pub struct WorkerArgs {
    /// The box-local end of the gateway's tunnel
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// A file holding the credential the gateway minted (read, then deleted)
    #[arg(long, value_name = "PATH")]
    credential_file: PathBuf,
    /// Exit when the gateway has been unreachable this long
    #[arg(long, value_name = "DURATION", default_value = "10m")]
    give_up_after: humantime::Duration,
}

pub async fn run(args: WorkerArgs) -> Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let credential = std::fs::read_to_string(&args.credential_file).with_context(|| {
        format!(
            "cannot read the credential {}",
            args.credential_file.display()
        )
    })?;
    // The credential lives in memory only from here on.
    std::fs::remove_file(&args.credential_file).with_context(|| {
        format!(
            "cannot delete the credential file {}",
            args.credential_file.display()
        )
    })?;
    let exe = std::env::current_exe().context("cannot locate this executable")?;
    let build_hash =
        skiff_gateway::bundle::build_hash(&exe).context("cannot hash this executable")?;
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .context("HOME is not set")?;
    let options = skiff_worker::Options {
        socket: args.socket,
        credential: credential.trim().to_owned(),
        build_hash,
        home,
        give_up_after: Duration::from(args.give_up_after),
    };
    skiff_worker::run(options).await?;
    Ok(ExitCode::SUCCESS)
}
