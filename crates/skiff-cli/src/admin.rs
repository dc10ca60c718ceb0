//! `skiff admin usage`: what each user, tenant and session used against its budgets (the
//! gateway's admin only).

use crate::client::Client;
use crate::render;
use anyhow::Result;
use clap::Subcommand;
use skiff_protocol::budget::UsageReport;
use std::path::Path;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum AdminCommand {
    /// Tokens and cost per user and tenant today (UTC) and per session, against `[budgets]`
    Usage,
}

pub async fn run(cmd: AdminCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    match cmd {
        AdminCommand::Usage => {
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
    }
}
