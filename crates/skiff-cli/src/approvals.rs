//! `skiff approve ID`, `skiff deny ID [--reason]`, `skiff approvals [--session S]`: deciding
//! the tool calls a session's approval policy holds, and `--approval POLICY`'s parser.

use crate::client::Client;
use crate::render::{self, ago, now_ms};
use anyhow::Result;
use clap::Args;
use skiff_protocol::approval::{
    ApprovalKind, ApprovalList, ApprovalPolicy, ApprovalState, ApprovalView, DecideApprovalRequest,
};
use std::path::Path;
use std::process::ExitCode;

#[derive(Args)]
pub struct DecideArgs {
    /// Approval id (apr_…), as `session watch` and `skiff approvals` show it
    id: String,
}

#[derive(Args)]
pub struct DenyArgs {
    /// Approval id (apr_…)
    id: String,
    /// Why: the agent reads it as the call's error
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
}

#[derive(Args)]
pub struct ListArgs {
    /// Only this session's approvals (ses_…)
    #[arg(long, value_name = "SESSION")]
    session: Option<String>,
    /// Only those still waiting for a decision
    #[arg(long)]
    pending: bool,
}

/// `--approval`: `never`, `on-request`, or a table of rules in TOML or JSON
/// (`{ exec = ["rm *"] }`). A usage error names what is wrong.
pub fn parse_policy(text: &str) -> std::result::Result<ApprovalPolicy, String> {
    let text = text.trim();
    let bad = |e: String| format!("`{text}` is not an approval policy: {e}");
    match text {
        "never" => return Ok(ApprovalPolicy::Never),
        "on-request" => return Ok(ApprovalPolicy::OnRequest),
        _ => {}
    }
    if !text.starts_with('{') {
        return Err(bad(
            "use never, on-request, or rules like '{ exec = [\"rm *\"], write_outside = [\"src/**\"], all = true }'"
                .into(),
        ));
    }
    if let Ok(policy) = serde_json::from_str::<ApprovalPolicy>(text) {
        return Ok(policy);
    }
    #[derive(serde::Deserialize)]
    struct Wrapper {
        approval: ApprovalPolicy,
    }
    toml::from_str::<Wrapper>(&format!("approval = {text}"))
        .map(|w| w.approval)
        .map_err(|e| bad(e.message().to_owned()))
}

pub async fn approve(args: DecideArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    decide(&args.id, "approve", None, state_dir, json).await
}

pub async fn deny(args: DenyArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    decide(&args.id, "deny", args.reason, state_dir, json).await
}

async fn decide(
    id: &str,
    verb: &str,
    reason: Option<String>,
    state_dir: &Path,
    json: bool,
) -> Result<ExitCode> {
    check_id(id)?;
    let client = Client::discover(state_dir)?;
    let body = DecideApprovalRequest { reason };
    let view: ApprovalView = client
        .send(client.post(&format!("/v1/approvals/{id}/{verb}"), &body))
        .await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&view)?)?;
    } else {
        outln!(
            "{} {} {} in session {}",
            view.state,
            view.id,
            headline(&view),
            view.session_id
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn list(args: ListArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    let mut query = Vec::new();
    if let Some(session) = &args.session {
        query.push(format!("session={session}"));
    }
    if args.pending {
        query.push("pending=true".to_owned());
    }
    let path = if query.is_empty() {
        "/v1/approvals".to_owned()
    } else {
        format!("/v1/approvals?{}", query.join("&"))
    };
    let list: ApprovalList = client.send(client.get(&path)).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&list)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if list.approvals.is_empty() {
        eprintln!("no approvals");
        return Ok(ExitCode::SUCCESS);
    }
    let now = now_ms();
    let rows: Vec<[String; 6]> = list
        .approvals
        .iter()
        .map(|a| {
            [
                a.id.to_string(),
                a.session_id.to_string(),
                a.state.to_string(),
                headline(a),
                ago(a.created_at_ms, now),
                match a.state {
                    ApprovalState::Pending => format!(
                        "expires in {}",
                        render::format_duration(
                            u64::try_from(a.expires_at_ms.saturating_sub(now)).unwrap_or(0)
                        )
                    ),
                    _ => a
                        .decided_by
                        .as_deref()
                        .map(|by| format!("by {by}{}", reason_suffix(a)))
                        .unwrap_or_default(),
                },
            ]
        })
        .collect();
    out!(
        "{}",
        render::table(
            &["ID", "SESSION", "STATE", "CALL", "ASKED", "DECISION"],
            &rows
        )
    )?;
    Ok(ExitCode::SUCCESS)
}

fn reason_suffix(a: &ApprovalView) -> String {
    a.reason
        .as_deref()
        .map(|r| format!(": {r}"))
        .unwrap_or_default()
}

/// One line for a call: `exec "rm -rf build"`, `write README.md`.
pub fn headline(a: &ApprovalView) -> String {
    let first = |s: &str| {
        let line = s.lines().next().unwrap_or("");
        if line.chars().count() > 80 {
            format!("{}…", line.chars().take(79).collect::<String>())
        } else {
            line.to_owned()
        }
    };
    match a.kind {
        ApprovalKind::Exec => format!("{} {:?}", a.tool, first(&a.subject)),
        ApprovalKind::Write => {
            let paths: Vec<&str> = a
                .subject
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("+++ b/").or_else(|| {
                        ["*** Add File: ", "*** Delete File: ", "*** Update File: "]
                            .iter()
                            .find_map(|h| l.strip_prefix(h))
                    })
                })
                .collect();
            format!("{} {}", a.tool, paths.join(", "))
        }
        ApprovalKind::Call => first(&a.subject),
        ApprovalKind::Request => format!("asks: {:?}", first(&a.subject)),
    }
}

fn check_id(id: &str) -> Result<()> {
    if skiff_protocol::ApprovalId::parse(id).is_some() {
        return Ok(());
    }
    Err(crate::client::Failure::Usage(format!("{id:?} is not an approval id (apr_…)")).into())
}
