//! The audit trail you can take away: `GET /v1/audit/tail` (the newest rows, or the rows after
//! an id, waiting for one when asked: `skiff audit tail --follow`), `GET /v1/audit/export`
//! (rows in a time range, a page at a time: `skiff audit export`), both for the admin only;
//! and the daily archive — once a UTC day is over, the gateway writes its rows to
//! `<state>/audit/YYYY-MM-DD.jsonl` (one `AuditRecord` per line, written aside and renamed into
//! place), removes from the database the rows older than `[audit] retention` whose day is
//! archived, and deletes archive files older than the retention.
//!
//! Rows are metadata only (who, what, when, on which target, the outcome): what is written
//! is decided where each row is written; nothing here adds to it. Deliberately absent:
//! shipping archives elsewhere (an operator's collector reads the directory).

use crate::Core;
use crate::error::Error;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json};
use serde::Deserialize;
use skiff_protocol::audit::{AUDIT_PAGE_MAX, AuditPage, AuditRecord};
use skiff_store::{Backend, DAY_MS, Scope};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How many rows `tail` shows unless asked.
const TAIL_DEFAULT: usize = 20;
/// The longest one `tail` request waits for a new row.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// How often the gateway looks for a finished day to archive.
const ARCHIVE_EVERY: Duration = Duration::from_secs(3600);

/// The admin's alone, like the vault: another scope is refused, and the refusal audited.
pub(crate) fn admin_only(core: &Core, scope: &Scope, action: &str) -> crate::Result<()> {
    if crate::people::gateway_admin(core, scope) {
        return Ok(());
    }
    core.audit(scope, action, "-", "denied", serde_json::json!({}));
    Err(Error::Forbidden(format!(
        "only the gateway's admin may use {action}"
    )))
}

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/audit/tail", get(tail))
        .route("/v1/audit/export", get(export))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TailQuery {
    /// The newest this many rows (without `after`).
    last: Option<usize>,
    /// The rows after this id instead.
    after: Option<i64>,
    /// With `after`: wait up to this many seconds for a row when there is none yet.
    wait_s: Option<u64>,
}

async fn tail(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    Query(q): Query<TailQuery>,
) -> crate::Result<Response> {
    admin_only(&core, &scope, "audit.tail")?;
    let Some(after) = q.after else {
        let n = q.last.unwrap_or(TAIL_DEFAULT).min(AUDIT_PAGE_MAX);
        let rows = core.store.audit_last(n)?;
        return Ok(Json(AuditPage { rows }).into_response());
    };
    let wait = Duration::from_secs(q.wait_s.unwrap_or(0)).min(WAIT_MAX);
    // Subscribed before the read, so a row written between the read and the wait wakes it.
    let mut newest = core.audit_feed.subscribe();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let rows = core
            .store
            .audit_range(i64::MIN, i64::MAX, after, AUDIT_PAGE_MAX)?;
        if !rows.is_empty() || wait.is_zero() {
            return Ok(Json(AuditPage { rows }).into_response());
        }
        match tokio::time::timeout_at(deadline, newest.changed()).await {
            Ok(Ok(())) => continue,
            // Timed out (or the gateway is stopping): nothing new.
            Ok(Err(_)) | Err(_) => return Ok(Json(AuditPage::default()).into_response()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportQuery {
    since_ms: i64,
    until_ms: Option<i64>,
    after: Option<i64>,
    limit: Option<usize>,
}

async fn export(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    Query(q): Query<ExportQuery>,
) -> crate::Result<Response> {
    admin_only(&core, &scope, "audit.export")?;
    let until = q.until_ms.unwrap_or(i64::MAX);
    if until <= q.since_ms {
        return Err(Error::BadRequest(format!(
            "until_ms {until} is not after since_ms {}: nothing lies between",
            q.since_ms
        )));
    }
    let rows = core.store.audit_range(
        q.since_ms,
        until,
        q.after.unwrap_or(i64::MIN),
        q.limit.unwrap_or(AUDIT_PAGE_MAX).clamp(1, AUDIT_PAGE_MAX),
    )?;
    Ok(Json(AuditPage { rows }).into_response())
}

/// What one archive pass did, for the log and tests.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Archived {
    /// Archive files written (days that had ended and had none).
    pub written: Vec<String>,
    /// Rows removed from the database (past retention, their day archived).
    pub rows_removed: usize,
    /// Archive files removed (past retention).
    pub files_removed: Vec<String>,
}

/// The archive error: the file it could not write or remove, or the store.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("audit archive {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("audit archive: {0}")]
    Store(#[from] skiff_store::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One archive pass at `now_ms` (see the module docs). A day is archived once, the first pass
/// after it ended; a day's rows leave the database only once its file exists.
pub fn archive(
    store: &dyn Backend,
    dir: &Path,
    now_ms: i64,
    retention: Duration,
) -> Result<Archived, ArchiveError> {
    let mut done = Archived::default();
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let today = now_ms - now_ms.rem_euclid(DAY_MS);
    let cutoff = now_ms.saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
    for day in store.audit_days_before(today)? {
        let name = format!("{}.jsonl", crate::budgets::utc_day(day * DAY_MS));
        let path = dir.join(&name);
        if !path.exists() {
            write_day(store, dir, &path, day)?;
            done.written.push(name);
        }
        if day * DAY_MS < cutoff {
            done.rows_removed += store.delete_audit_day(day, cutoff)?;
        }
    }
    let entries = std::fs::read_dir(dir).map_err(io(dir))?;
    for entry in entries {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(day_ms) = name.strip_suffix(".jsonl").and_then(day_of) else {
            continue;
        };
        // The whole day lies before the cutoff.
        if day_ms + DAY_MS <= cutoff {
            std::fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
            done.files_removed.push(name);
        }
    }
    Ok(done)
}

/// The start of the UTC day `2026-12-02` names.
fn day_of(text: &str) -> Option<i64> {
    if text.len() != 10 {
        return None;
    }
    let at = humantime::parse_rfc3339(&format!("{text}T00:00:00Z")).ok()?;
    let ms = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis();
    i64::try_from(ms).ok()
}

/// Writes a day's rows aside, syncs, and renames the file into place: a file under its final
/// name is always whole.
fn write_day(store: &dyn Backend, dir: &Path, path: &Path, day: i64) -> Result<(), ArchiveError> {
    let staging = dir.join(format!(
        ".tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&staging)
        .map_err(io(&staging))?;
    let mut out = std::io::BufWriter::new(file);
    let mut after = i64::MIN;
    loop {
        let rows: Vec<AuditRecord> =
            store.audit_range(day * DAY_MS, (day + 1) * DAY_MS, after, AUDIT_PAGE_MAX)?;
        let Some(last) = rows.last() else {
            break;
        };
        after = last.id;
        for row in &rows {
            let line = serde_json::to_string(row).map_err(|e| ArchiveError::Io {
                path: staging.clone(),
                source: e.into(),
            })?;
            writeln!(out, "{line}").map_err(io(&staging))?;
        }
    }
    let file = out.into_inner().map_err(|e| ArchiveError::Io {
        path: staging.clone(),
        source: e.into_error(),
    })?;
    file.sync_all().map_err(io(&staging))?;
    std::fs::rename(&staging, path).map_err(io(path))?;
    Ok(())
}

impl Core {
    /// `<state>/audit/`.
    fn audit_dir(&self) -> PathBuf {
        self.state.root().join("audit")
    }

    fn archive_audit_now(&self) {
        match archive(
            &*self.store,
            &self.audit_dir(),
            skiff_store::now_ms(),
            self.audit_retention,
        ) {
            Ok(done) => {
                if done != Archived::default() {
                    tracing::info!(written = ?done.written, rows_removed = done.rows_removed,
                        files_removed = ?done.files_removed, "archived the audit trail");
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not archive the audit trail"),
        }
    }
}

/// At start and then hourly: archive every finished day and apply the retention.
pub(crate) fn spawn_archiver(core: &Arc<Core>) {
    let core = Arc::downgrade(core);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ARCHIVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(core) = core.upgrade() else {
                return;
            };
            // Files and the database: off the async threads. One gateway at a time.
            let archive = move || {
                if core.holds_chore(crate::chores::AUDIT_ARCHIVE, ARCHIVE_EVERY) {
                    core.archive_audit_now();
                }
            };
            if let Err(e) = tokio::task::spawn_blocking(archive).await {
                tracing::warn!(error = %e, "the audit archiver stopped");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_store::Store;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn finished_days_are_archived_once_and_retention_removes_rows_then_files() {
        let store = Store::open_in_memory().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let scope = Scope::new("usr_a", "ten_a");
        let day = |d: i64| d * DAY_MS;
        // Day 100 (1970-04-11) twice, day 101 once, and a row of "today" (day 102).
        store
            .audit_at(day(100) + 5, &scope, "session.create", "ses_1")
            .unwrap();
        store
            .audit_at(day(100) + 9, &scope, "session.send", "ses_1")
            .unwrap();
        store
            .audit_at(day(101) + 50, &scope, "secret.set", "KEY")
            .unwrap();
        store
            .audit_at(day(102) + 1, &scope, "session.cancel", "ses_1")
            .unwrap();
        let retention = Duration::from_secs(86_400);

        // During day 102: days 100 and 101 are over and archived; day 100 is past retention
        // (the cutoff is one day back), so its rows leave the database; today's stay.
        let done = archive(&store, dir.path(), day(102) + 10, retention).unwrap();
        assert_eq!(done.written, ["1970-04-11.jsonl", "1970-04-12.jsonl"]);
        assert_eq!(done.rows_removed, 2);
        assert_eq!(done.files_removed, ["1970-04-11.jsonl"]);
        assert_eq!(names(dir.path()), ["1970-04-12.jsonl"]);
        let archived = std::fs::read_to_string(dir.path().join("1970-04-12.jsonl")).unwrap();
        let rows: Vec<AuditRecord> = archived
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (rows[0].action.as_str(), rows[0].target.as_str()),
            ("secret.set", "KEY")
        );
        let left = store
            .audit_range(i64::MIN, i64::MAX, i64::MIN, 100)
            .unwrap();
        assert_eq!(
            left.iter().map(|r| r.action.as_str()).collect::<Vec<_>>(),
            ["secret.set", "session.cancel"]
        );

        // Again the same day: nothing new to write, nothing to remove.
        let again = archive(&store, dir.path(), day(102) + 20, retention).unwrap();
        assert_eq!(again, Archived::default());

        // Two days on: day 101's rows and file go, day 102 is archived.
        let later = archive(&store, dir.path(), day(103) + 10, retention).unwrap();
        assert_eq!(later.written, ["1970-04-13.jsonl"]);
        assert_eq!(later.rows_removed, 2);
        assert_eq!(later.files_removed, ["1970-04-12.jsonl"]);
        assert_eq!(names(dir.path()), ["1970-04-13.jsonl"]);
    }
}
