//! `skiff session diff|apply|export`: a session's result, shown and brought home.

use crate::client::Client;
use anyhow::{Context, Result};
use clap::Args;
use skiff_protocol::sync::{
    ApplyRequest, ApplyResult, ExportRequest, ExportResult, FileChange, SessionDiff,
};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct DiffArgs {
    /// Session id (ses_…)
    id: String,
    /// Per-file counts instead of the patch
    #[arg(long)]
    stat: bool,
    /// One turn's changes (its checkpoint against the one before) instead of the session's
    #[arg(long, value_name = "RUN")]
    run: Option<String>,
}

#[derive(Args)]
pub struct ApplyArgs {
    /// Session id (ses_…)
    id: String,
    /// Write into this directory instead of the one the session was created from
    #[arg(long, value_name = "DIR")]
    to: Option<PathBuf>,
}

#[derive(Args)]
pub struct ExportArgs {
    /// Session id (ses_…)
    id: String,
    /// A directory that does not exist yet, or is empty
    #[arg(long, value_name = "DIR")]
    to: PathBuf,
}

fn absolute(dir: &std::path::Path) -> Result<String> {
    Ok(std::path::absolute(dir)
        .with_context(|| format!("cannot resolve {}", dir.display()))?
        .display()
        .to_string())
}

pub async fn diff(client: &Client, args: DiffArgs, json: bool) -> Result<ExitCode> {
    let query = if args.stat { "?stat=true" } else { "" };
    let path = match &args.run {
        Some(run) => format!("/v1/sessions/{}/runs/{run}/changes{query}", args.id),
        None => format!("/v1/sessions/{}/diff{query}", args.id),
    };
    let diff: SessionDiff = client.send(client.get(&path)).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&diff)?)?;
    } else if args.stat {
        out!("{}", stat(&diff))?;
    } else {
        if diff.files.is_empty() {
            eprintln!("no changes");
        }
        for file in &diff.files {
            match (&file.patch, &file.omitted) {
                (Some(patch), _) => out!("{patch}")?,
                (None, Some(why)) => eprintln!("{}: not shown: {why}", file.path),
                (None, None) => {}
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `git diff --stat`, with each path's status letter and the commits first.
pub fn stat(diff: &SessionDiff) -> String {
    let mut s = String::new();
    if !diff.commits.is_empty() {
        let n = diff.commits.len();
        let base = &diff.base[..diff.base.len().min(12)];
        let _ = writeln!(
            s,
            "{n} commit{} since {base}:",
            if n == 1 { "" } else { "s" }
        );
        for c in &diff.commits {
            let _ = writeln!(s, "  {} {}", &c.commit[..c.commit.len().min(12)], c.summary);
        }
    }
    let width = diff
        .files
        .iter()
        .map(|f| f.path.chars().count())
        .max()
        .unwrap_or(0);
    let most = diff
        .files
        .iter()
        .map(|f| f.insertions + f.deletions)
        .max()
        .unwrap_or(0);
    let digits = most.to_string().len();
    for f in &diff.files {
        let _ = writeln!(
            s,
            " {} {:<width$} | {}",
            f.status.letter(),
            f.path,
            counts(f, most, digits)
        );
    }
    let n = diff.files.len();
    let _ = writeln!(
        s,
        " {n} file{} changed, {} insertion{}(+), {} deletion{}(-)",
        if n == 1 { "" } else { "s" },
        diff.insertions,
        if diff.insertions == 1 { "" } else { "s" },
        diff.deletions,
        if diff.deletions == 1 { "" } else { "s" },
    );
    s
}

/// `12 +++++-`, scaled to at most 40 marks; `Bin` for binary files.
fn counts(f: &FileChange, most: u64, digits: usize) -> String {
    if f.binary {
        return "Bin".into();
    }
    if f.omitted.is_some() && f.insertions + f.deletions == 0 {
        return "not diffed".into();
    }
    let total = f.insertions + f.deletions;
    let scale = |n: u64| {
        if most <= 40 {
            n
        } else {
            (n * 40).div_ceil(most)
        }
    };
    format!(
        "{total:>digits$} {}{}",
        "+".repeat(scale(f.insertions) as usize),
        "-".repeat(scale(f.deletions) as usize)
    )
    .trim_end()
    .to_owned()
}

pub async fn apply(client: &Client, args: ApplyArgs, json: bool) -> Result<ExitCode> {
    let to = args.to.as_deref().map(absolute).transpose()?;
    let path = format!("/v1/sessions/{}/apply", args.id);
    let done: ApplyResult = client
        .send(client.post(&path, &ApplyRequest { to }))
        .await?;
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
    eprintln!(
        "applied session {} to {}: {} written, {} deleted{}",
        done.session_id,
        done.to,
        done.written.len(),
        done.deleted.len(),
        if done.unchanged.is_empty() {
            String::new()
        } else {
            format!(", {} already as the session has them", done.unchanged.len())
        }
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn export(client: &Client, args: ExportArgs, json: bool) -> Result<ExitCode> {
    let to = absolute(&args.to)?;
    let path = format!("/v1/sessions/{}/export", args.id);
    let done: ExportResult = client
        .send(client.post(&path, &ExportRequest { to }))
        .await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&done)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{}", done.to)?;
    eprintln!(
        "exported session {}: {} files, {} bytes",
        done.session_id, done.files, done.bytes
    );
    Ok(ExitCode::SUCCESS)
}
