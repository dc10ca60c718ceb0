//! Runs (one user turn and everything it causes) and attempts (one execution of a run on one
//! runtime node). Turn admission and "one active attempt per run" are unique indexes, so they
//! hold even if two callers race.

use crate::transition::run_allowed;
use crate::{Error, Fence, Result, Scope, Store, id_col, mint, now_ms};
use rusqlite::{ErrorCode, OptionalExtension, Row, TransactionBehavior, params};
use skiff_protocol::api::RunStatus;
use skiff_protocol::model::Usage;
use skiff_protocol::{AttemptId, RunId, SessionId};

#[derive(Clone, Debug, PartialEq)]
pub struct RunRow {
    pub id: RunId,
    pub session_id: SessionId,
    pub status: RunStatus,
    pub model_ref: String,
    pub error: Option<String>,
    pub usage: Usage,
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
}

/// Status of an attempt. `Starting` and `Running` are active.
pub use skiff_protocol::api::AttemptStatus;

/// What admitting a turn writes with its run ([`Store::admit_run`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Admission<'a> {
    /// What the session runs with from this turn on.
    pub choices: crate::SessionChoices<'a>,
    /// A worker slot claimed on this profile, of `max_live` (`→ requested`): the turn
    /// dispatches the session, or places it again.
    pub claim: Option<(&'a str, u64)>,
}

/// One attempt at a run, as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct AttemptRow {
    pub id: AttemptId,
    pub run_id: RunId,
    pub runtime_node: String,
    pub owner_epoch: i64,
    pub status: AttemptStatus,
    pub resume_from: Option<AttemptId>,
    pub checkpoint_artifact_id: Option<String>,
    pub error: Option<String>,
    pub started_at_ms: i64,
    pub finished_at_ms: Option<i64>,
}

/// Where an attempt that takes a run over starts from.
#[derive(Clone, Copy, Debug, Default)]
pub struct Resume<'a> {
    pub after: Option<&'a AttemptId>,
    pub checkpoint_artifact_id: Option<&'a str>,
}

pub(crate) const COLUMNS: &str = "id, session_id, status, model_ref, error, input_tokens, output_tokens, \
                       created_at_ms, finished_at_ms, cache_read_tokens, cache_write_tokens";
pub(crate) const OPEN_STATUSES: &str =
    "'queued','starting','running','waiting_input','waiting_approval','cancelling'";

fn from_row(row: &Row<'_>) -> rusqlite::Result<RunRow> {
    from_row_at(row, 0)
}

pub(crate) fn from_row_at(row: &Row<'_>, o: usize) -> rusqlite::Result<RunRow> {
    let status: String = row.get(o + 2)?;
    Ok(RunRow {
        id: id_col(row, o, RunId::parse)?,
        session_id: id_col(row, o + 1, SessionId::parse)?,
        status: RunStatus::parse(&status).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                o + 2,
                rusqlite::types::Type::Text,
                format!("unknown run status {status:?}").into(),
            )
        })?,
        model_ref: row.get(o + 3)?,
        error: row.get(o + 4)?,
        usage: Usage {
            input_tokens: row.get(o + 5)?,
            output_tokens: row.get(o + 6)?,
            cache_read_tokens: row.get(o + 9)?,
            cache_write_tokens: row.get(o + 10)?,
        },
        created_at_ms: row.get(o + 7)?,
        finished_at_ms: row.get(o + 8)?,
    })
}

fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == ErrorCode::ConstraintViolation)
}

impl Store {
    /// Admits a new turn: creates a queued run unless the session already has an unfinished one.
    pub fn create_run(
        &self,
        scope: &Scope,
        session: &SessionId,
        model_ref: &str,
    ) -> Result<RunRow> {
        self.admit_run(scope, session, model_ref, &Admission::default())
    }

    /// Admits a turn: creates its run (refused while another is open) and writes what the
    /// admission carries — the session's new choices, the worker slot it claims — in one
    /// immediate transaction. A refusal (the session busy, every slot taken, a write that
    /// fails) leaves the session, its placement and the slots as they were.
    pub fn admit_run(
        &self,
        scope: &Scope,
        session: &SessionId,
        model_ref: &str,
        admission: &Admission<'_>,
    ) -> Result<RunRow> {
        let id = RunId::from_suffix(&mint()?);
        let now = now_ms();
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let touched = tx.execute(
                "UPDATE sessions SET updated_at_ms = ?1 WHERE id = ?2 AND owner_id = ?3 AND tenant_id = ?4",
                params![now, session.as_str(), scope.owner_id, scope.tenant_id],
            )?;
            if touched == 0 {
                return Err(Error::NotFound {
                    what: "session",
                    id: session.to_string(),
                });
            }
            let inserted = tx.execute(
                "INSERT INTO runs (id, session_id, owner_id, tenant_id, status, model_ref, created_at_ms) \
                 VALUES (?1, ?2, ?3, ?4, 'queued', ?5, ?6)",
                params![id.as_str(), session.as_str(), scope.owner_id, scope.tenant_id, model_ref, now],
            );
            match inserted {
                Ok(_) => {
                    if let Some((profile, max_live)) = admission.claim {
                        crate::placements::request_in(&tx, scope, session, profile, max_live)?;
                    }
                    crate::sessions::choose_in(&tx, scope, session, &admission.choices)?;
                    tx.commit()?;
                }
                Err(e) if is_unique_violation(&e) => {
                    let open: String = tx.query_row(
                        &format!(
                            "SELECT id FROM runs WHERE session_id = ?1 AND status IN ({OPEN_STATUSES})"
                        ),
                        params![session.as_str()],
                        |r| r.get(0),
                    )?;
                    return Err(Error::SessionBusy {
                        session: session.to_string(),
                        run: open,
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.run(scope, &id)
    }

    pub fn run(&self, scope: &Scope, id: &RunId) -> Result<RunRow> {
        self.conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM runs WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
                ),
                params![id.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "run",
                id: id.to_string(),
            })
    }

    /// Runs of a session, oldest first.
    pub fn runs(&self, scope: &Scope, session: &SessionId) -> Result<Vec<RunRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM runs WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3 \
             ORDER BY created_at_ms, rowid"
        ))?;
        let rows = stmt
            .query_map(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// The session's unfinished run with its scope, whoever owns it: what a gateway that
    /// took the session's lease over goes on with.
    pub(crate) fn open_run_of(&self, session: &SessionId) -> Result<Option<(Scope, RunRow)>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT owner_id, tenant_id FROM runs WHERE session_id = ?1 \
             AND status IN ({OPEN_STATUSES})"
        ))?;
        let scope = stmt
            .query_row(params![session.as_str()], |row| {
                Ok(Scope::new(
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                ))
            })
            .optional()?;
        drop(stmt);
        drop(conn);
        let Some(scope) = scope else {
            return Ok(None);
        };
        Ok(self.open_run(&scope, session)?.map(|run| (scope, run)))
    }

    /// The session's unfinished run, if any.
    pub fn open_run(&self, scope: &Scope, session: &SessionId) -> Result<Option<RunRow>> {
        // The partial unique index `runs_one_open_per_session` answers this directly.
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM runs WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3 \
             AND status IN ('queued','starting','running','waiting_input','waiting_approval','cancelling')"
        ))?;
        Ok(stmt
            .query_row(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?)
    }

    /// Moves a run to `to` if the state machine allows it.
    pub fn transition_run(
        &self,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        self.transition_run_with(None, scope, id, to, error)
    }

    /// [`Store::transition_run`], first checking `fence` in the same transaction when given.
    pub(crate) fn transition_run_with(
        &self,
        fence: Option<&Fence>,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            if let Some(fence) = fence {
                crate::leases::check_fence(&tx, fence)?;
            }
            let from: Option<String> = tx
                .query_row(
                    "SELECT status FROM runs WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                    params![id.as_str(), scope.owner_id, scope.tenant_id],
                    |r| r.get(0),
                )
                .optional()?;
            let from =
                from.as_deref()
                    .and_then(RunStatus::parse)
                    .ok_or_else(|| Error::NotFound {
                        what: "run",
                        id: id.to_string(),
                    })?;
            if !run_allowed(from, to) {
                return Err(Error::IllegalRunTransition {
                    run: id.to_string(),
                    from,
                    to,
                });
            }
            let finished = to.is_terminal().then(now_ms);
            tx.execute(
                "UPDATE runs SET status = ?1, error = COALESCE(?2, error), \
                 finished_at_ms = COALESCE(?3, finished_at_ms) WHERE id = ?4",
                params![to.as_str(), error, finished, id.as_str()],
            )?;
            tx.commit()?;
        }
        self.run(scope, id)
    }

    /// Adds a model response's token usage (cache reads and writes too) to the run's totals,
    /// and records it with its cost in the usage ledger that budgets count, in one transaction.
    pub fn add_run_usage(
        &self,
        scope: &Scope,
        id: &RunId,
        usage: Usage,
        cost_usd: f64,
    ) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute(
            "UPDATE runs SET input_tokens = input_tokens + ?1, output_tokens = output_tokens + ?2, \
             cache_read_tokens = cache_read_tokens + ?6, cache_write_tokens = cache_write_tokens + ?7 \
             WHERE id = ?3 AND owner_id = ?4 AND tenant_id = ?5",
            params![
                usage.input_tokens,
                usage.output_tokens,
                id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                usage.cache_read_tokens,
                usage.cache_write_tokens,
            ],
        )?;
        let tokens = usage.input_tokens.saturating_add(usage.output_tokens);
        if tokens > 0 || cost_usd > 0.0 {
            tx.execute(
                "INSERT INTO usage (at_ms, owner_id, tenant_id, session_id, run_id, tokens, cost_usd) \
                 SELECT ?1, owner_id, tenant_id, session_id, id, ?2, ?3 FROM runs \
                 WHERE id = ?4 AND owner_id = ?5 AND tenant_id = ?6",
                params![
                    now_ms(),
                    i64::try_from(tokens).unwrap_or(i64::MAX),
                    cost_usd,
                    id.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                ],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Starts an attempt of `run` on `runtime_node`. Refused while another attempt is active.
    pub fn start_attempt(
        &self,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
    ) -> Result<AttemptId> {
        self.resume_attempt(scope, run, runtime_node, owner_epoch, Resume::default())
    }

    /// Starts an attempt of `run` that takes it over from an earlier one (`resume`). Refused
    /// while another attempt is active.
    pub fn resume_attempt(
        &self,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
        resume: Resume<'_>,
    ) -> Result<AttemptId> {
        self.resume_attempt_with(None, scope, run, runtime_node, owner_epoch, resume)
    }

    /// [`Store::resume_attempt`], first checking `fence` in the same transaction when given.
    pub(crate) fn resume_attempt_with(
        &self,
        fence: Option<&Fence>,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
        resume: Resume<'_>,
    ) -> Result<AttemptId> {
        let id = AttemptId::from_suffix(&mint()?);
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(fence) = fence {
            crate::leases::check_fence(&tx, fence)?;
        }
        let inserted = tx.execute(
            "INSERT INTO attempts (id, run_id, session_id, owner_id, tenant_id, runtime_node, \
             owner_epoch, status, started_at_ms, resume_from_attempt_id, checkpoint_artifact_id) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'running', ?8, ?9, ?10)",
            params![
                id.as_str(),
                run.id.as_str(),
                run.session_id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                runtime_node,
                owner_epoch,
                now_ms(),
                resume.after.map(AttemptId::as_str),
                resume.checkpoint_artifact_id,
            ],
        );
        match inserted {
            Ok(_) => {
                tx.commit()?;
                Ok(id)
            }
            Err(e) if is_unique_violation(&e) => Err(Error::AttemptActive {
                run: run.id.to_string(),
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Ends an active attempt; `error` says why one that did not succeed ended.
    pub fn finish_attempt(
        &self,
        scope: &Scope,
        id: &AttemptId,
        status: AttemptStatus,
        error: Option<&str>,
    ) -> Result<()> {
        self.finish_attempt_with(None, scope, id, status, error)
    }

    /// [`Store::finish_attempt`], first checking `fence` in the same transaction when given.
    pub(crate) fn finish_attempt_with(
        &self,
        fence: Option<&Fence>,
        scope: &Scope,
        id: &AttemptId,
        status: AttemptStatus,
        error: Option<&str>,
    ) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(fence) = fence {
            crate::leases::check_fence(&tx, fence)?;
        }
        tx.execute(
            "UPDATE attempts SET status = ?1, finished_at_ms = ?2, error = ?6 \
             WHERE id = ?3 AND owner_id = ?4 AND tenant_id = ?5 AND status IN ('starting','running')",
            params![
                status.as_str(),
                now_ms(),
                id.as_str(),
                scope.owner_id,
                scope.tenant_id,
                error
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Every attempt of the session's runs, oldest first.
    pub fn attempts(&self, scope: &Scope, session: &SessionId) -> Result<Vec<AttemptRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, run_id, runtime_node, owner_epoch, status, resume_from_attempt_id, \
             checkpoint_artifact_id, error, started_at_ms, finished_at_ms FROM attempts \
             WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3 \
             ORDER BY started_at_ms, rowid",
        )?;
        let rows = stmt
            .query_map(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                |row| {
                    let status: String = row.get(4)?;
                    Ok(AttemptRow {
                        id: id_col(row, 0, AttemptId::parse)?,
                        run_id: id_col(row, 1, RunId::parse)?,
                        runtime_node: row.get(2)?,
                        owner_epoch: row.get(3)?,
                        status: AttemptStatus::parse(&status).ok_or_else(|| {
                            rusqlite::Error::FromSqlConversionFailure(
                                4,
                                rusqlite::types::Type::Text,
                                format!("unknown attempt status {status:?}").into(),
                            )
                        })?,
                        resume_from: match row.get::<_, Option<String>>(5)? {
                            Some(s) => Some(AttemptId::parse(&s).ok_or_else(|| {
                                rusqlite::Error::FromSqlConversionFailure(
                                    5,
                                    rusqlite::types::Type::Text,
                                    format!("malformed attempt id {s:?}").into(),
                                )
                            })?),
                            None => None,
                        },
                        checkpoint_artifact_id: row.get(6)?,
                        error: row.get(7)?,
                        started_at_ms: row.get(8)?,
                        finished_at_ms: row.get(9)?,
                    })
                },
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Status of an attempt, for tests and diagnostics.
    pub fn attempt_status(&self, id: &AttemptId) -> Result<String> {
        self.conn()
            .query_row(
                "SELECT status FROM attempts WHERE id = ?1",
                params![id.as_str()],
                |r| r.get(0),
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "attempt",
                id: id.to_string(),
            })
    }

    /// Called once at gateway start, before anything runs: an attempt still marked active
    /// belonged to a process that is gone, so it and its run become `orphaned` (never
    /// `succeeded`). Returns the orphaned runs so the caller can tell their sessions.
    pub fn orphan_active_on_start(&self, reason: &str) -> Result<Vec<(Scope, RunRow)>> {
        self.orphan_with(None, reason)
    }

    /// [`Store::orphan_active_on_start`], sparing (with `Some(gateway)`) the runs of sessions
    /// whose lease another gateway holds and has not let expire: that gateway is running them.
    pub(crate) fn orphan_with(
        &self,
        gateway: Option<&skiff_protocol::GatewayId>,
        reason: &str,
    ) -> Result<Vec<(Scope, RunRow)>> {
        let gateway = gateway.map(skiff_protocol::GatewayId::as_str);
        let now = now_ms();
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            &format!(
                "UPDATE attempts SET status = 'orphaned', finished_at_ms = ?1 \
                 WHERE status IN ('starting','running') AND {}",
                unleased("attempts", 2)
            ),
            params![now, gateway],
        )?;
        let orphaned = {
            let mut stmt = tx.prepare(&format!(
                "SELECT owner_id, tenant_id, {COLUMNS} FROM runs WHERE status IN ({OPEN_STATUSES}) \
                 AND {}",
                unleased("runs", 1)
            ))?;
            stmt.query_map(params![gateway], |row| {
                let scope = Scope::new(row.get::<_, String>(0)?, row.get::<_, String>(1)?);
                // Columns of the run follow the two scope columns.
                let run = RunRow {
                    id: id_col(row, 2, RunId::parse)?,
                    session_id: id_col(row, 3, SessionId::parse)?,
                    status: RunStatus::Orphaned,
                    model_ref: row.get(5)?,
                    error: Some(reason.to_owned()),
                    usage: Usage {
                        input_tokens: row.get(7)?,
                        output_tokens: row.get(8)?,
                        cache_read_tokens: row.get(11)?,
                        cache_write_tokens: row.get(12)?,
                    },
                    created_at_ms: row.get(9)?,
                    finished_at_ms: Some(now),
                };
                Ok((scope, run))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?
        };
        tx.execute(
            &format!(
                "UPDATE runs SET status = 'orphaned', error = ?1, finished_at_ms = ?2 \
                 WHERE status IN ({OPEN_STATUSES}) AND {}",
                unleased("runs", 3)
            ),
            params![reason, now, gateway],
        )?;
        tx.commit()?;
        Ok(orphaned)
    }
}

/// "No gateway other than `?{param}` holds `{table}`'s session lease unexpired" (always true
/// when `?{param}` is NULL), by the database's clock.
pub(crate) fn unleased(table: &str, param: usize) -> String {
    format!(
        "(?{param} IS NULL OR NOT EXISTS (SELECT 1 FROM leases l WHERE l.kind = 'session' \
         AND l.name = {table}.session_id AND l.holder IS NOT NULL AND l.holder <> ?{param} \
         AND l.expires_at_ms > CAST(unixepoch('subsec') * 1000 AS INTEGER)))"
    )
}
