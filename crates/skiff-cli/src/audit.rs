//! `skiff audit tail [--follow]` and `skiff audit export --since DATE [--until DATE] --format
//! jsonl`: the gateway's audit trail (metadata only), for its admin. Export writes one JSON
//! object per line to stdout, a page at a time, so a large range never sits in memory.

use crate::client::Client;
use crate::render::now_ms;
use anyhow::{Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use skiff_protocol::audit::{AUDIT_PAGE_MAX, AuditPage, AuditRecord};
use std::path::Path;
use std::process::ExitCode;

/// How long one follow request waits on the gateway for a new row.
const FOLLOW_WAIT_S: u64 = 30;

#[derive(Subcommand)]
pub enum AuditCommand {
    /// The newest audit rows; with --follow, then each new one as it is written
    Tail(TailArgs),
    /// Every audit row in a time range, as JSON lines
    Export(ExportArgs),
}

#[derive(Args)]
pub struct TailArgs {
    /// How many of the newest rows to show first
    #[arg(short = 'n', long, default_value_t = 20)]
    lines: usize,
    /// Keep printing rows as they are written, until interrupted
    #[arg(short, long)]
    follow: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    Jsonl,
}

#[derive(Args)]
pub struct ExportArgs {
    /// From this moment: `2026-12-01` (UTC midnight), an RFC 3339 time, or an age like `7d`
    #[arg(long, value_name = "DATE")]
    since: String,
    /// Up to (not including) this moment, in the same forms [default: now]
    #[arg(long, value_name = "DATE")]
    until: Option<String>,
    #[arg(long, value_enum, default_value = "jsonl")]
    format: Format,
}

/// Milliseconds since the epoch for `2026-12-01`, `2026-12-01T10:00:00Z` or `7d` (ago).
pub fn parse_moment(text: &str, now_ms: i64) -> Result<i64> {
    let text = text.trim();
    let rfc = if text.len() == 10 {
        format!("{text}T00:00:00Z")
    } else {
        text.to_owned()
    };
    if let Ok(at) = humantime::parse_rfc3339_weak(&rfc)
        && let Ok(since) = at.duration_since(std::time::UNIX_EPOCH)
    {
        return Ok(i64::try_from(since.as_millis()).unwrap_or(i64::MAX));
    }
    if let Ok(age) = humantime::parse_duration(text) {
        return Ok(now_ms - i64::try_from(age.as_millis()).unwrap_or(i64::MAX));
    }
    bail!(
        "{text:?} is not a date: give 2026-12-01, an RFC 3339 time like 2026-12-01T10:00:00Z, or an age like 7d"
    )
}

fn print(row: &AuditRecord, json: bool) -> Result<()> {
    if json {
        outln!("{}", serde_json::to_string(row)?)?;
        return Ok(());
    }
    let at = std::time::UNIX_EPOCH
        + std::time::Duration::from_millis(u64::try_from(row.at_ms).unwrap_or(0));
    let detail = match &row.detail {
        serde_json::Value::Object(map) if map.is_empty() => String::new(),
        other => format!("  {other}"),
    };
    outln!(
        "{}  {}/{}  {}  {}  {}  {}{detail}",
        humantime::format_rfc3339_seconds(at),
        row.tenant_id,
        row.owner_id,
        row.actor,
        row.action,
        row.target,
        row.decision
    )?;
    Ok(())
}

pub async fn run(cmd: AuditCommand, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    match cmd {
        AuditCommand::Tail(args) => {
            // One row more than shown when none is asked for: where following starts.
            let page: AuditPage = client
                .send(client.get(&format!("/v1/audit/tail?last={}", args.lines.max(1))))
                .await?;
            // With no row yet, everything from the first one on is new.
            let mut after = page.rows.last().map_or(0, |r| r.id);
            let skip = page.rows.len().saturating_sub(args.lines);
            for row in &page.rows[skip..] {
                print(row, json)?;
            }
            if !args.follow {
                return Ok(ExitCode::SUCCESS);
            }
            loop {
                let page: AuditPage = client
                    .send(client.get(&format!(
                        "/v1/audit/tail?after={after}&wait_s={FOLLOW_WAIT_S}"
                    )))
                    .await?;
                for row in &page.rows {
                    print(row, json)?;
                    after = row.id;
                }
            }
        }
        AuditCommand::Export(args) => {
            let Format::Jsonl = args.format;
            let now = now_ms();
            let since = parse_moment(&args.since, now)?;
            let until = match &args.until {
                Some(text) => parse_moment(text, now)?,
                None => now.saturating_add(1),
            };
            if until <= since {
                bail!("--until is not after --since: nothing lies between");
            }
            let mut after = i64::MIN;
            loop {
                let page: AuditPage = client
                    .send(client.get(&format!(
                        "/v1/audit/export?since_ms={since}&until_ms={until}&after={after}&limit={AUDIT_PAGE_MAX}"
                    )))
                    .await?;
                let Some(last) = page.rows.last() else {
                    break;
                };
                after = last.id;
                for row in &page.rows {
                    // JSON lines whatever `--json` says: that is the format asked for.
                    outln!("{}", serde_json::to_string(row)?)?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_moment;

    #[test]
    fn moments_are_dates_times_or_ages() {
        assert_eq!(parse_moment("1970-01-02", 0).unwrap(), 86_400_000);
        assert_eq!(parse_moment("1970-01-01T00:00:01Z", 0).unwrap(), 1000);
        assert_eq!(parse_moment("1d", 86_400_000).unwrap(), 0);
        let err = parse_moment("yesterday", 0).unwrap_err().to_string();
        assert!(err.contains("\"yesterday\" is not a date"), "{err}");
    }
}
