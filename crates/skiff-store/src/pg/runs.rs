//! Runs and attempts on PostgreSQL.

use super::conn::PgConn;
use super::{PgStore, count, id, optional_id};
use crate::aggregates::{RunStore, Turns};
use crate::runs::COLUMNS;
use crate::transition::run_allowed;
use crate::{
    Admission, AttemptRow, AttemptStatus, Error, Result, Resume, RunRow, Scope, mint, now_ms,
};
use postgres::Row;
use skiff_protocol::api::RunStatus;
use skiff_protocol::model::Usage;
use skiff_protocol::{AttemptId, RunId, SessionId};

/// `SELECT {COLUMNS} FROM runs WHERE id … AND scope`, spelled out for the statement cache.
const BY_ID: &str = "SELECT id, session_id, status, model_ref, error, input_tokens, \
     output_tokens, created_at_ms, finished_at_ms, cache_read_tokens, cache_write_tokens \
     FROM runs WHERE id = $1 AND owner_id = $2 AND tenant_id = $3";

/// Unfinished: the statuses the partial unique index `runs_one_open_per_session` covers.
pub(super) const OPEN: &str =
    "('queued','starting','running','waiting_input','waiting_approval','cancelling')";

fn run_from(row: &Row) -> Result<RunRow> {
    run_at(row, 0)
}

/// [`run_from`] for a row whose columns start at `o` (a join's).
pub(super) fn run_at(row: &Row, o: usize) -> Result<RunRow> {
    let status: &str = row.try_get(o + 2)?;
    Ok(RunRow {
        id: id("run", row.try_get(o)?, RunId::parse)?,
        session_id: id("run", row.try_get(o + 1)?, SessionId::parse)?,
        status: RunStatus::parse(status).ok_or_else(|| Error::Corrupt {
            what: "run",
            detail: format!("unknown run status {status:?}"),
        })?,
        model_ref: row.try_get(o + 3)?,
        error: row.try_get(o + 4)?,
        usage: Usage {
            input_tokens: count("run usage", row.try_get(o + 5)?)?,
            output_tokens: count("run usage", row.try_get(o + 6)?)?,
            cache_read_tokens: count("run usage", row.try_get(o + 9)?)?,
            cache_write_tokens: count("run usage", row.try_get(o + 10)?)?,
        },
        created_at_ms: row.try_get(o + 7)?,
        finished_at_ms: row.try_get(o + 8)?,
    })
}

fn run_in(conn: &mut PgConn, scope: &Scope, run: &str) -> Result<RunRow> {
    let by_id = conn.statement(BY_ID)?;
    let row = conn
        .client
        .query_opt(&by_id, &[&run, &scope.owner_id, &scope.tenant_id])?
        .ok_or_else(|| Error::NotFound {
            what: "run",
            id: run.to_string(),
        })?;
    run_from(&row)
}

impl RunStore for PgStore {
    fn create_run(&self, scope: &Scope, session: &SessionId, model_ref: &str) -> Result<RunRow> {
        Turns::admit_run(self, scope, session, model_ref, &Admission::default())
    }

    fn run(&self, scope: &Scope, id: &RunId) -> Result<RunRow> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| run_in(conn, &scope, &id))
    }

    fn runs(&self, scope: &Scope, session: &SessionId) -> Result<Vec<RunRow>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM runs \
                         WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 \
                         ORDER BY created_at_ms, ord"
                    ),
                    &[&session, &scope.owner_id, &scope.tenant_id],
                )?
                .iter()
                .map(run_from)
                .collect()
        })
    }

    fn open_run(&self, scope: &Scope, session: &SessionId) -> Result<Option<RunRow>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!(
                        "SELECT {COLUMNS} FROM runs \
                         WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 \
                         AND status IN {OPEN}"
                    ),
                    &[&session, &scope.owner_id, &scope.tenant_id],
                )?
                .as_ref()
                .map(run_from)
                .transpose()
        })
    }

    fn transition_run(
        &self,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        self.transition_run_with(None, scope, id, to, error)
    }

    fn resume_attempt(
        &self,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
        resume: Resume<'_>,
    ) -> Result<AttemptId> {
        self.resume_attempt_with(None, scope, run, runtime_node, owner_epoch, resume)
    }

    fn finish_attempt(
        &self,
        scope: &Scope,
        id: &AttemptId,
        status: AttemptStatus,
        error: Option<&str>,
    ) -> Result<()> {
        self.finish_attempt_with(None, scope, id, status, error)
    }

    fn attempts(&self, scope: &Scope, session: &SessionId) -> Result<Vec<AttemptRow>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client
                .query(
                    "SELECT id, run_id, runtime_node, owner_epoch, status, \
                     resume_from_attempt_id, checkpoint_artifact_id, error, started_at_ms, \
                     finished_at_ms FROM attempts \
                     WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 \
                     ORDER BY started_at_ms, ord",
                    &[&session, &scope.owner_id, &scope.tenant_id],
                )?
                .iter()
                .map(|row| {
                    let status: &str = row.try_get(4)?;
                    Ok(AttemptRow {
                        id: id("attempt", row.try_get(0)?, AttemptId::parse)?,
                        run_id: id("attempt", row.try_get(1)?, RunId::parse)?,
                        runtime_node: row.try_get(2)?,
                        owner_epoch: row.try_get(3)?,
                        status: AttemptStatus::parse(status).ok_or_else(|| Error::Corrupt {
                            what: "attempt",
                            detail: format!("unknown attempt status {status:?}"),
                        })?,
                        resume_from: optional_id("attempt", row.try_get(5)?, AttemptId::parse)?,
                        checkpoint_artifact_id: row.try_get(6)?,
                        error: row.try_get(7)?,
                        started_at_ms: row.try_get(8)?,
                        finished_at_ms: row.try_get(9)?,
                    })
                })
                .collect()
        })
    }
}

/// The fenced variants' bodies (the trait methods pass no fence), and the unscoped reads a
/// gateway taking a session over needs.
impl PgStore {
    /// `transition_run`, first checking `fence` in the same transaction when given.
    pub(super) fn transition_run_with(
        &self,
        fence: Option<&crate::Fence>,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        let (scope, id, error) = (scope.clone(), id.to_string(), error.map(str::to_string));
        let fence = fence.cloned();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            if let Some(fence) = &fence {
                super::leases::check_fence(&mut tx, fence)?;
            }
            // The row lock orders concurrent moves: each sees the status the one before left.
            let from = tx
                .query_opt(
                    "SELECT status FROM runs WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 \
                     FOR UPDATE",
                    &[&id, &scope.owner_id, &scope.tenant_id],
                )?
                .map(|row| row.try_get::<_, String>(0))
                .transpose()?;
            let from =
                from.as_deref()
                    .and_then(RunStatus::parse)
                    .ok_or_else(|| Error::NotFound {
                        what: "run",
                        id: id.clone(),
                    })?;
            if !run_allowed(from, to) {
                return Err(Error::IllegalRunTransition { run: id, from, to });
            }
            let finished = to.is_terminal().then(now_ms);
            let row = tx.query_one(
                &format!(
                    "UPDATE runs SET status = $1, error = COALESCE($2, error), \
                     finished_at_ms = COALESCE($3, finished_at_ms) WHERE id = $4 \
                     RETURNING {COLUMNS}"
                ),
                &[&to.as_str(), &error, &finished, &id],
            )?;
            let run = run_from(&row)?;
            tx.commit()?;
            Ok(run)
        })
    }

    /// `resume_attempt`, first checking `fence` in the same transaction when given.
    pub(super) fn resume_attempt_with(
        &self,
        fence: Option<&crate::Fence>,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        owner_epoch: i64,
        resume: Resume<'_>,
    ) -> Result<AttemptId> {
        let attempt = AttemptId::from_suffix(&mint()?);
        let args = (
            attempt.to_string(),
            run.id.to_string(),
            run.session_id.to_string(),
            scope.clone(),
            runtime_node.to_string(),
            resume.after.map(ToString::to_string),
            resume.checkpoint_artifact_id.map(str::to_string),
        );
        let started = now_ms();
        let inserted = self.conn.run_fenced(fence.cloned(), move |conn| {
            let (attempt, run, session, scope, node, after, checkpoint) = args;
            let insert = conn.statement(
                "INSERT INTO attempts (id, run_id, session_id, owner_id, tenant_id, runtime_node, \
                 owner_epoch, status, started_at_ms, resume_from_attempt_id, \
                 checkpoint_artifact_id) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 'running', $8, $9, $10) \
                 ON CONFLICT (run_id) WHERE status IN ('starting','running') DO NOTHING",
            )?;
            Ok(conn.client.execute(
                &insert,
                &[
                    &attempt,
                    &run,
                    &session,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &node,
                    &owner_epoch,
                    &started,
                    &after,
                    &checkpoint,
                ],
            )?)
        })?;
        if inserted == 0 {
            return Err(Error::AttemptActive {
                run: run.id.to_string(),
            });
        }
        Ok(attempt)
    }

    /// `finish_attempt`, first checking `fence` in the same transaction when given.
    pub(super) fn finish_attempt_with(
        &self,
        fence: Option<&crate::Fence>,
        scope: &Scope,
        id: &AttemptId,
        status: AttemptStatus,
        error: Option<&str>,
    ) -> Result<()> {
        let args = (
            scope.clone(),
            id.to_string(),
            status.as_str().to_string(),
            error.map(str::to_string),
        );
        let finished = now_ms();
        self.conn.run_fenced(fence.cloned(), move |conn| {
            let (scope, id, status, error) = args;
            conn.client.execute(
                "UPDATE attempts SET status = $1, finished_at_ms = $2, error = $3 \
                 WHERE id = $4 AND owner_id = $5 AND tenant_id = $6 \
                 AND status IN ('starting','running')",
                &[
                    &status,
                    &finished,
                    &error,
                    &id,
                    &scope.owner_id,
                    &scope.tenant_id,
                ],
            )?;
            Ok(())
        })
    }

    /// The session's unfinished run with its scope, whoever owns it.
    pub(super) fn open_run_of(&self, session: &SessionId) -> Result<Option<(Scope, RunRow)>> {
        let session = session.to_string();
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!(
                        "SELECT owner_id, tenant_id, {COLUMNS} FROM runs \
                         WHERE session_id = $1 AND status IN {OPEN}"
                    ),
                    &[&session],
                )?
                .map(|row| {
                    let scope =
                        Scope::new(row.try_get::<_, String>(0)?, row.try_get::<_, String>(1)?);
                    Ok((scope, run_at(&row, 2)?))
                })
                .transpose()
        })
    }
}
