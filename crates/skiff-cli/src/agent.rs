//! `skiff agent list|show NAME`: agent specs and their stored versions, each named by the
//! sha256 of its content; `session new --agent NAME@DIGEST` pins one.

use crate::client::Client;
use crate::render::{ago, now_ms};
use anyhow::Result;
use clap::Subcommand;
use skiff_protocol::agent::{AgentDetail, AgentList, AgentVersion};
use std::path::Path;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum AgentCommand {
    /// Each configured agent spec with its current version
    List,
    /// Every stored version of one agent spec, current first, and what the current one says
    Show {
        /// The spec's name
        name: String,
    },
}

pub async fn run(cmd: AgentCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    match cmd {
        AgentCommand::List => {
            let list: AgentList = client.send(client.get("/v1/agents")).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&list)?)?;
            } else if list.agents.is_empty() {
                outln!("no agent specs; add an [agents.NAME] table to skiff.toml")?;
            } else {
                for agent in &list.agents {
                    outln!("{}", line(agent))?;
                }
            }
        }
        AgentCommand::Show { name } => {
            let detail: AgentDetail = client
                .send(client.get(&format!("/v1/agents/{name}")))
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&detail)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            if let Some(current) = detail.versions.first() {
                let spec = &current.spec;
                outln!("agent      {}", detail.name)?;
                outln!("digest     {}", current.digest)?;
                if let Some(model) = &spec.model {
                    outln!("model      {model}")?;
                }
                if let Some(effort) = spec.reasoning {
                    outln!("reasoning  {}", effort.as_str())?;
                }
                if let Some(tools) = &spec.tools {
                    outln!("tools      {}", tools.join(", "))?;
                }
                if let Some(policy) = &spec.approval {
                    outln!("approval   {}", policy.describe())?;
                }
                if let Some(text) = &spec.instructions {
                    outln!("instructions")?;
                    for l in text.lines() {
                        outln!("  {l}")?;
                    }
                }
            }
            outln!("versions")?;
            for version in &detail.versions {
                outln!("  {}", line(version))?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn line(v: &AgentVersion) -> String {
    format!(
        "{}  {}{}",
        v.short(),
        ago(v.created_at_ms, now_ms()),
        if v.current { "  (current)" } else { "" }
    )
}
