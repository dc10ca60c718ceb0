//! `skiff admin migrate --to postgres://…`: copies the state dir's SQLite database into an
//! empty PostgreSQL database and verifies it (`skiff_store::copy`), with the gateway stopped.
//!
//! Unlike the other `admin` commands it does not talk to a gateway: it takes the state dir's
//! lock, as a gateway does, so none can start on the state while it is read, and one already
//! running is reported ("stop the gateway first"). The url's password is never printed: every
//! line shows `skiff_store::copy::redact_url`'s form.

use crate::render;
use anyhow::Result;
use clap::Args;
use skiff_gateway::state_dir::{LockError, StateDir};
use skiff_protocol::migration::MigrationReport;
use skiff_store::copy::{CopyError, Progress, Stage};
use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

#[derive(Args)]
pub struct MigrateArgs {
    /// The empty PostgreSQL database: `postgres://USER@HOST[:PORT]/DB` (a Unix socket as
    /// `%2Frun%2Fpostgresql` for HOST). Give the password in `PGPASSWORD` rather than the url,
    /// where every user of the machine could read it in the process list; it is never printed
    #[arg(long, value_name = "URL")]
    pub to: String,
}

/// A refusal with its exit code (`EXIT_CODES` in main.rs).
struct Refusal {
    code: u8,
    message: String,
    report: Option<MigrationReport>,
}

impl Refusal {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            report: None,
        }
    }
}

pub fn run(args: MigrateArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let url = with_env_password(&args.to);
    match migrate(&url, state_dir, json) {
        Ok(report) => {
            print_report(&report, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Err(refusal) => {
            if let Some(report) = &refusal.report {
                print_report(report, json)?;
            }
            eprintln!("error: {}", refusal.message);
            Ok(ExitCode::from(refusal.code))
        }
    }
}

/// `url`, with `PGPASSWORD`'s password when the url holds none (as `psql` does).
fn with_env_password(url: &str) -> String {
    let has_password = skiff_store::copy::parse_url(url).is_ok_and(|c| c.get_password().is_some());
    match std::env::var("PGPASSWORD") {
        Ok(password) if !has_password && !password.is_empty() => {
            skiff_store::pg_url_with_password(url, &password)
        }
        _ => url.to_owned(),
    }
}

fn migrate(url: &str, state_dir: &Path, json: bool) -> Result<MigrationReport, Refusal> {
    if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
        return Err(Refusal::new(
            2,
            "--to takes a PostgreSQL url (postgres://USER@HOST/DB); what was given is not one (not repeated: it may hold a password)",
        ));
    }
    skiff_store::copy::parse_url(url).map_err(|e| Refusal::new(2, e.to_string()))?;
    let database = state_dir.join("skiff.db");
    if !database.exists() {
        return Err(Refusal::new(
            4,
            format!(
                "no Skiff state in {}: it has no skiff.db; name the gateway's state dir with --state-dir",
                state_dir.display()
            ),
        ));
    }
    let state = StateDir::open(state_dir).map_err(|e| Refusal::new(1, e.to_string()))?;
    // Held until the copy is done: no gateway starts on the state meanwhile.
    let _lock = state.lock().map_err(|e| match e {
        LockError::InUse { dir, pid } => Refusal::new(
            5,
            format!(
                "a gateway (pid {pid}) is running on the state dir {dir}; stop the gateway first, then migrate (its state must not change while it is copied)"
            ),
        ),
        other => Refusal::new(1, other.to_string()),
    })?;
    let target = skiff_store::copy::redact_url(url);
    if !json {
        eprintln!(
            "copying {} into {target} (database rows only: artifact blobs and key files are not copied)",
            database.display()
        );
    }
    let url = url.to_owned();
    // The `postgres` client runs a runtime of its own, which a thread of this one cannot.
    let copied = std::thread::spawn(move || {
        let mut show = Shown::new(json);
        let report =
            skiff_store::copy::copy_to_postgres(&database, &url, &mut |p| show.progress(p));
        show.finish();
        report
    })
    .join()
    .map_err(|_| Refusal::new(7, "the migration's thread failed; nothing was committed"))?;
    copied.map_err(|e| {
        let code = match &e {
            CopyError::Url { .. } => 2,
            CopyError::Store(skiff_store::Error::PgConnect { .. }) => 3,
            CopyError::SourceMissing { .. } => 4,
            CopyError::TargetNotEmpty { .. } => 5,
            _ => 1,
        };
        let message = e.to_string();
        let report = match e {
            CopyError::Mismatch { report, .. } => Some(*report),
            _ => None,
        };
        Refusal {
            code,
            message,
            report,
        }
    })
}

/// Progress on stderr: a bar per table on a terminal, else a line per table copied; nothing
/// with `--json`.
struct Shown {
    json: bool,
    bar: Option<indicatif::ProgressBar>,
    tty: bool,
    /// The last table a line was printed for (an empty one reports done twice).
    printed: Option<String>,
}

impl Shown {
    fn new(json: bool) -> Self {
        Self {
            json,
            bar: None,
            tty: std::io::stderr().is_terminal(),
            printed: None,
        }
    }

    fn progress(&mut self, p: Progress<'_>) {
        if self.json {
            return;
        }
        let verb = match p.stage {
            Stage::Copying => "copying",
            Stage::Verifying => "verifying",
        };
        if self.tty {
            if p.done == 0 {
                self.finish();
                let bar = indicatif::ProgressBar::new(p.total);
                bar.set_style(
                    indicatif::ProgressStyle::with_template("{msg:24} {bar:30} {pos}/{len} rows")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                bar.set_message(format!("{verb} {}", p.table));
                self.bar = Some(bar);
            } else if let Some(bar) = &self.bar {
                bar.set_position(p.done);
            }
        } else if p.stage == Stage::Copying
            && p.done == p.total
            && self.printed.as_deref() != Some(p.table)
        {
            eprintln!("copied {}: {} rows", p.table, p.done);
            self.printed = Some(p.table.to_owned());
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

fn print_report(report: &MigrationReport, json: bool) -> Result<()> {
    if json {
        outln!("{}", serde_json::to_string_pretty(report)?)?;
        return Ok(());
    }
    let rows: Vec<[String; 5]> = report
        .tables
        .iter()
        .map(|t| {
            [
                t.table.clone(),
                t.sqlite_rows.to_string(),
                t.postgres_rows.to_string(),
                t.postgres_checksum.chars().take(16).collect(),
                if t.matches() { "ok" } else { "MISMATCH" }.to_owned(),
            ]
        })
        .collect();
    out!(
        "{}",
        render::table(
            &[
                "TABLE",
                "SQLITE ROWS",
                "POSTGRES ROWS",
                "CHECKSUM",
                "VERIFIED"
            ],
            &rows
        )
    )?;
    if report.committed {
        outln!(
            "migrated {} rows in {} tables to {} in {:.1} s: counts and checksums match",
            report.rows(),
            report.tables.len(),
            report.target,
            report.elapsed_ms as f64 / 1000.0
        )?;
    }
    Ok(())
}
