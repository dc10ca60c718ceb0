//! Turn admission, the session's choices, a worker's acknowledged events and the restart's
//! reconciliation on PostgreSQL.
//!
//! Admission is one transaction: the session's row is locked by touching it (the lock every
//! placement change takes first), the run is inserted unless the partial unique index finds
//! an open one, and the admission's claim and choices are written with it — or nothing is.
//! An admission that claims a worker slot takes the slots' advisory lock before the row lock,
//! like every claim, so the two never wait on each other in opposite orders.

use super::placements::{Claim, claim_in, lock_worker_slots};
use super::runs::{OPEN, run_at};
use super::sessions::session_at;
use super::{PgStore, bigint, count};
use crate::aggregates::Turns;
use crate::{
    Admission, Error, Result, RunRow, Scope, SessionChoices, SessionRow, mint, now_ms, to_json,
};
use postgres::Transaction;
use skiff_protocol::approval::ApprovalPolicy;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};

/// [`SessionChoices`], owned (it crosses to the connection's thread).
#[derive(Default)]
struct Choices {
    reasoning: Option<String>,
    /// The policy as its JSON column.
    approval: Option<String>,
    agent: Option<(String, String)>,
}

impl Choices {
    fn of(choices: &SessionChoices<'_>) -> Result<Self> {
        Ok(Self {
            reasoning: choices.reasoning.map(str::to_owned),
            approval: choices
                .approval
                .map(|policy| to_json("approval policy", policy))
                .transpose()?,
            agent: choices
                .agent
                .map(|(name, digest)| (name.to_owned(), digest.to_owned())),
        })
    }
}

fn session_not_found(session: &str) -> Error {
    Error::NotFound {
        what: "session",
        id: session.to_owned(),
    }
}

/// Writes `choices` inside the caller's transaction.
fn choose_in(
    tx: &mut Transaction<'_>,
    scope: &Scope,
    session: &str,
    choices: &Choices,
) -> Result<()> {
    for (column, value) in [
        ("reasoning", &choices.reasoning),
        ("approval", &choices.approval),
    ] {
        let Some(value) = value else { continue };
        let changed = tx.execute(
            &format!(
                "UPDATE sessions SET {column} = $1 \
                 WHERE id = $2 AND owner_id = $3 AND tenant_id = $4"
            ),
            &[value, &session, &scope.owner_id, &scope.tenant_id],
        )?;
        if changed == 0 {
            return Err(session_not_found(session));
        }
    }
    if let Some((name, digest)) = &choices.agent {
        tx.execute(
            "INSERT INTO session_agents (session_id, owner_id, tenant_id, name, digest) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (session_id) DO UPDATE SET name = excluded.name, \
             digest = excluded.digest \
             WHERE session_agents.owner_id = excluded.owner_id \
               AND session_agents.tenant_id = excluded.tenant_id",
            &[&session, &scope.owner_id, &scope.tenant_id, name, digest],
        )?;
    }
    Ok(())
}

/// Sets one column of the session's row and answers the row, in one statement.
fn set_column(
    store: &PgStore,
    scope: &Scope,
    session: &SessionId,
    column: &'static str,
    value: Option<String>,
) -> Result<SessionRow> {
    let (scope, session) = (scope.clone(), session.to_string());
    store.conn.run(move |conn| {
        let row = conn
            .client
            .query_opt(
                &format!(
                    "UPDATE sessions SET {column} = $1 \
                     WHERE id = $2 AND owner_id = $3 AND tenant_id = $4 \
                     RETURNING {}",
                    crate::sessions::COLUMNS
                ),
                &[&value, &session, &scope.owner_id, &scope.tenant_id],
            )?
            .ok_or_else(|| session_not_found(&session))?;
        session_at(&row, 0)
    })
}

impl Turns for PgStore {
    fn admit_run(
        &self,
        scope: &Scope,
        session: &SessionId,
        model_ref: &str,
        admission: &Admission<'_>,
    ) -> Result<RunRow> {
        let id = RunId::from_suffix(&mint()?).to_string();
        let now = now_ms();
        let choices = Choices::of(&admission.choices)?;
        let claim = admission.claim.map(|(profile, max_live)| Claim {
            scope: scope.clone(),
            session: session.to_string(),
            profile: profile.to_owned(),
            max_live,
            to: PlacementState::Requested,
            open_run: None,
        });
        let (scope, session, model_ref) =
            (scope.clone(), session.to_string(), model_ref.to_owned());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            if claim.is_some() {
                lock_worker_slots(&mut tx)?;
            }
            let touched = tx.execute(
                "UPDATE sessions SET updated_at_ms = $1 \
                 WHERE id = $2 AND owner_id = $3 AND tenant_id = $4",
                &[&now, &session, &scope.owner_id, &scope.tenant_id],
            )?;
            if touched == 0 {
                return Err(session_not_found(&session));
            }
            // The partial unique index decides: a second open run is not inserted (a racing
            // admission waits for the first to commit, then finds the conflict).
            let inserted = tx.query_opt(
                &format!(
                    "INSERT INTO runs (id, session_id, owner_id, tenant_id, status, model_ref, \
                     created_at_ms) VALUES ($1, $2, $3, $4, 'queued', $5, $6) \
                     ON CONFLICT (session_id) WHERE status IN {OPEN} DO NOTHING \
                     RETURNING {}",
                    crate::runs::COLUMNS
                ),
                &[
                    &id,
                    &session,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &model_ref,
                    &now,
                ],
            )?;
            let Some(row) = inserted else {
                let open = tx.query_opt(
                    &format!("SELECT id FROM runs WHERE session_id = $1 AND status IN {OPEN}"),
                    &[&session],
                )?;
                return Err(Error::SessionBusy {
                    session,
                    run: match open {
                        Some(row) => row.try_get(0)?,
                        None => "(one that has just finished; try again)".into(),
                    },
                });
            };
            let run = run_at(&row, 0)?;
            if let Some(claim) = claim {
                claim_in(&mut tx, claim)?;
            }
            choose_in(&mut tx, &scope, &session, &choices)?;
            tx.commit()?;
            Ok(run)
        })
    }

    fn set_session_choices(
        &self,
        scope: &Scope,
        id: &SessionId,
        choices: &SessionChoices<'_>,
    ) -> Result<SessionRow> {
        let choices = Choices::of(choices)?;
        let (scope, session) = (scope.clone(), id.to_string());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            choose_in(&mut tx, &scope, &session, &choices)?;
            let row = tx
                .query_opt(
                    &format!(
                        "SELECT {} FROM sessions WHERE id = $1 AND owner_id = $2 \
                         AND tenant_id = $3",
                        crate::sessions::COLUMNS
                    ),
                    &[&session, &scope.owner_id, &scope.tenant_id],
                )?
                .ok_or_else(|| session_not_found(&session))?;
            let row = session_at(&row, 0)?;
            tx.commit()?;
            Ok(row)
        })
    }

    fn set_session_reasoning(
        &self,
        scope: &Scope,
        id: &SessionId,
        reasoning: Option<&str>,
    ) -> Result<SessionRow> {
        set_column(self, scope, id, "reasoning", reasoning.map(str::to_owned))
    }

    fn set_session_approval(
        &self,
        scope: &Scope,
        id: &SessionId,
        approval: &ApprovalPolicy,
    ) -> Result<SessionRow> {
        let text = to_json("approval policy", approval)?;
        set_column(self, scope, id, "approval", Some(text))
    }

    fn append_worker_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
        epoch: u64,
        seq: u64,
    ) -> Result<SessionEvent> {
        let body = to_json("event", &kind)?;
        let at_ms = now_ms();
        let args = (
            session.to_string(),
            scope.clone(),
            run.map(ToString::to_string),
        );
        let cursor: i64 = self.conn.run(move |conn| {
            let (session, scope, run) = args;
            let mut tx = conn.client.transaction()?;
            // The ACK cursor never moves back: a duplicate of an older event leaves it.
            tx.execute(
                "INSERT INTO worker_cursors (session_id, owner_epoch, stream, seq) \
                 VALUES ($1, $2, 'events', $3) \
                 ON CONFLICT (session_id, owner_epoch, stream) \
                 DO UPDATE SET seq = GREATEST(worker_cursors.seq, EXCLUDED.seq)",
                &[&session, &bigint(epoch), &bigint(seq)],
            )?;
            let row = tx.query_one(
                super::events::APPEND,
                &[
                    &session,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &run,
                    &at_ms,
                    &body,
                ],
            )?;
            let cursor = row.try_get(0)?;
            tx.commit()?;
            Ok(cursor)
        })?;
        Ok(SessionEvent {
            session_id: session.clone(),
            cursor: count("event cursor", cursor)?,
            at_ms,
            run_id: run.cloned(),
            kind,
        })
    }

    fn orphan_active_on_start(&self, reason: &str) -> Result<Vec<(Scope, RunRow)>> {
        self.orphan_with(None, reason)
    }
}

/// Orphaning on start, and the filter that spares another live gateway's runs.
impl PgStore {
    /// `orphan_active_on_start`, sparing (with `Some(gateway)`) the runs of sessions whose
    /// lease another gateway holds unexpired (by the database's clock).
    pub(super) fn orphan_with(
        &self,
        gateway: Option<&skiff_protocol::GatewayId>,
        reason: &str,
    ) -> Result<Vec<(Scope, RunRow)>> {
        let reason = reason.to_owned();
        let gateway = gateway.map(ToString::to_string);
        let now = now_ms();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            tx.execute(
                &format!(
                    "UPDATE attempts SET status = 'orphaned', finished_at_ms = $1 \
                     WHERE status IN ('starting','running') AND {}",
                    unleased("attempts", 2)
                ),
                &[&now, &gateway],
            )?;
            let rows = tx.query(
                &format!(
                    "UPDATE runs SET status = 'orphaned', error = $1, finished_at_ms = $2 \
                     WHERE status IN {OPEN} AND {} RETURNING owner_id, tenant_id, {}",
                    unleased("runs", 3),
                    crate::runs::COLUMNS
                ),
                &[&reason, &now, &gateway],
            )?;
            let mut orphaned = rows
                .iter()
                .map(|row| {
                    let scope =
                        Scope::new(row.try_get::<_, String>(0)?, row.try_get::<_, String>(1)?);
                    Ok((scope, run_at(row, 2)?))
                })
                .collect::<Result<Vec<_>>>()?;
            tx.commit()?;
            orphaned.sort_by_key(|(_, run)| run.created_at_ms);
            Ok(orphaned)
        })
    }
}

/// "No gateway other than `${param}` holds `{table}`'s session lease unexpired" (always true
/// when `${param}` is NULL), by the database's clock.
pub(crate) fn unleased(table: &str, param: usize) -> String {
    format!(
        "(${param}::text IS NULL OR NOT EXISTS (SELECT 1 FROM leases l WHERE l.kind = 'session' \
         AND l.name = {table}.session_id AND l.holder IS NOT NULL AND l.holder <> ${param} \
         AND l.expires_at_ms > skiff_now_ms()))"
    )
}
