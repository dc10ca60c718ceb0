//! The placement of worker sessions (DESIGN §4), the durable side of the worker protocol
//! (cached terminal results of worker operations, ACK cursors) and the one-use record of
//! admitted worker credentials.
//!
//! A placement row exists only for sessions that were ever placed on a worker; its state is
//! mirrored into `sessions.placement` in the same transaction, so listings need no join.

use crate::transition::placement_allowed;
use crate::{Error, Result, Scope, Store, id_col, now_ms};
use rusqlite::{OptionalExtension, Row, TransactionBehavior, params};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::worker::StreamKind;
use skiff_protocol::{EnvironmentId, SessionId};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq)]
pub struct PlacementRow {
    pub session_id: SessionId,
    pub scope: Scope,
    pub state: PlacementState,
    pub profile: String,
    /// Bumped by every transition (a placement generation).
    pub generation: u64,
    pub environment_id: Option<EnvironmentId>,
    /// The epoch of the worker that owns the session now; a new worker advances it.
    pub owner_epoch: u64,
    /// The base manifest recorded when the workspace was laid onto the box (JSON).
    pub base_manifest: Option<String>,
    pub bundle_hash: Option<String>,
    pub worker_pid: Option<i64>,
    pub error: Option<String>,
    pub updated_at_ms: i64,
    /// What sync left behind at the last lay-down ("left out: target/ by …").
    pub left_out: Option<String>,
    /// The box holds nothing the gateway lacks: its workspace was just laid down, or the last
    /// turn's work was brought back. False from the moment a turn is handed to the worker.
    pub box_in_step: bool,
}

pub(crate) const COLUMNS: &str = "session_id, owner_id, tenant_id, state, profile, generation, environment_id, \
    owner_epoch, base_manifest, bundle_hash, worker_pid, error, updated_at_ms, left_out, box_in_step";

fn parse_state(s: &str) -> rusqlite::Result<PlacementState> {
    PlacementState::parse(s).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            3,
            rusqlite::types::Type::Text,
            format!("unknown placement state {s:?}").into(),
        )
    })
}

fn from_row(row: &Row<'_>) -> rusqlite::Result<PlacementRow> {
    from_row_at(row, 0)
}

pub(crate) fn from_row_at(row: &Row<'_>, o: usize) -> rusqlite::Result<PlacementRow> {
    let env: Option<String> = row.get(o + 6)?;
    Ok(PlacementRow {
        session_id: id_col(row, o, SessionId::parse)?,
        scope: Scope::new(row.get::<_, String>(o + 1)?, row.get::<_, String>(o + 2)?),
        state: parse_state(&row.get::<_, String>(o + 3)?)?,
        profile: row.get(o + 4)?,
        generation: row.get(o + 5)?,
        environment_id: env.as_deref().and_then(EnvironmentId::parse),
        owner_epoch: row.get(o + 7)?,
        base_manifest: row.get(o + 8)?,
        bundle_hash: row.get(o + 9)?,
        worker_pid: row.get(o + 10)?,
        error: row.get(o + 11)?,
        updated_at_ms: row.get(o + 12)?,
        left_out: row.get(o + 13)?,
        box_in_step: row.get(o + 14)?,
    })
}

/// Reads the current placement state with `sql` (inside the transaction that will change it)
/// and checks that the state machine allows `to`.
fn checked_move(
    tx: &rusqlite::Transaction<'_>,
    sql: &str,
    what: &'static str,
    scope: &Scope,
    session: &SessionId,
    to: PlacementState,
) -> Result<()> {
    let from: String = tx
        .query_row(
            sql,
            params![session.as_str(), scope.owner_id, scope.tenant_id],
            |r| r.get(0),
        )
        .optional()?
        .ok_or_else(|| Error::NotFound {
            what,
            id: session.to_string(),
        })?;
    let from = parse_state(&from)?;
    if !placement_allowed(from, to) {
        return Err(Error::IllegalPlacementTransition {
            session: session.to_string(),
            from,
            to,
        });
    }
    Ok(())
}

/// A worker operation's terminal reply, with what identifies the call it answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedOp {
    pub method: String,
    /// blake3 of the call's JSON: a repeated sequence number must repeat the same call.
    pub call_hash: String,
    /// JSON: a `Reply`, or a model call's events.
    pub reply: String,
}

/// What a placement transition also records.
#[derive(Clone, Debug, Default)]
pub struct PlacementChange<'a> {
    pub environment_id: Option<&'a EnvironmentId>,
    /// Advance the owner epoch (a new worker takes over the session).
    pub advance_epoch: bool,
    pub base_manifest: Option<&'a str>,
    pub bundle_hash: Option<&'a str>,
    pub worker_pid: Option<i64>,
    /// Replaces the recorded error (`None` clears it).
    pub error: Option<&'a str>,
    pub left_out: Option<&'a str>,
    /// Records whether the box is in step with the gateway (`None` keeps what is recorded).
    pub box_in_step: Option<bool>,
}

/// `request_placement` inside the caller's immediate transaction.
pub(crate) fn request_in(
    tx: &rusqlite::Transaction<'_>,
    scope: &Scope,
    session: &SessionId,
    profile: &str,
    max_live: u64,
) -> Result<()> {
    claim_in(
        tx,
        scope,
        session,
        profile,
        max_live,
        PlacementState::Requested,
    )
}

/// Claims a worker slot for `session` on `profile`, moving it to `to` (`requested`, or
/// `handing_off` for a live dispatch).
fn claim_in(
    tx: &rusqlite::Transaction<'_>,
    scope: &Scope,
    session: &SessionId,
    profile: &str,
    max_live: u64,
    to: PlacementState,
) -> Result<()> {
    checked_move(
        tx,
        "SELECT placement FROM sessions WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
        "session",
        scope,
        session,
        to,
    )?;
    // A failover holds its slot while its new attempt is placed: no other session takes it
    // between the dead box and the fresh one.
    let from: Option<String> = tx
        .query_row(
            "SELECT state FROM placements WHERE session_id = ?1",
            [session.as_str()],
            |r| r.get(0),
        )
        .optional()?;
    if from.as_deref() != Some(PlacementState::FailedOver.as_str()) {
        let slots = slots_in(tx)?;
        if let Some(refusal) = slots.refusal(max_live) {
            return Err(refusal);
        }
    }
    let now = now_ms();
    tx.execute(
        "INSERT INTO placements (session_id, owner_id, tenant_id, state, profile, updated_at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT(session_id) DO UPDATE SET state = ?4, profile = ?5, error = NULL, \
         environment_id = NULL, worker_pid = NULL, box_in_step = 0, generation = generation + 1, \
         updated_at_ms = ?6",
        params![
            session.as_str(),
            scope.owner_id,
            scope.tenant_id,
            to.as_str(),
            profile,
            now
        ],
    )?;
    tx.execute(
        "UPDATE sessions SET placement = ?1, updated_at_ms = ?2 WHERE id = ?3",
        params![to.as_str(), now, session.as_str()],
    )?;
    Ok(())
}

/// Placement states that hold no box: not counted against `max_workers`, not reconciled at
/// start, not named on an environment.
pub(crate) const SETTLED: &str = "('local','parked','reclaimed','failed')";

/// Run states of an unfinished run (the `runs_one_open_per_session` index's).
pub(crate) const OPEN_RUN: &str =
    "('queued','starting','running','waiting_input','waiting_approval','cancelling')";

/// The worker slots in use: live placements (held or being placed), and how many of them have
/// a turn open (a run admitted and not finished, whether it runs or is still being placed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerSlots {
    pub live: u64,
    pub running_turns: u64,
}

impl WorkerSlots {
    /// The refusal when no slot is free of `max`.
    pub fn refusal(&self, max: u64) -> Option<Error> {
        (self.live >= max).then(|| Error::WorkersAtCapacity {
            running_turns: self.running_turns,
            other: self.live.saturating_sub(self.running_turns),
            max,
        })
    }
}

pub(crate) fn slots_in(conn: &rusqlite::Connection) -> Result<WorkerSlots> {
    let (live, running_turns) = conn.query_row(
        &format!(
            "SELECT COUNT(*), COALESCE(SUM(EXISTS (SELECT 1 FROM runs r WHERE r.session_id = p.session_id \
             AND r.status IN {OPEN_RUN})), 0) FROM placements p WHERE p.state NOT IN {SETTLED}"
        ),
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    Ok(WorkerSlots {
        live,
        running_turns,
    })
}

/// A worker session that holds a box with no turn open: it may be parked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdlePlacement {
    pub session_id: SessionId,
    pub scope: Scope,
    pub profile: String,
    /// Since when it has had nothing to do: its last turn's end (or its last placement step).
    pub idle_since_ms: i64,
}

impl Store {
    /// Places a session on a worker profile: `local|reclaimed|failed → requested`, claiming
    /// one of `max_live` worker slots. Creates the row the first time.
    ///
    /// INVARIANT: the count and the claim are one immediate transaction, so concurrent
    /// requests can never together exceed `max_live` (a requested placement is a held slot;
    /// it is given back when the placement fails, is reclaimed or comes home).
    pub fn request_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            request_in(&tx, scope, session, profile, max_live)?;
            tx.commit()?;
        }
        self.placement(scope, session)?
            .ok_or_else(|| Error::NotFound {
                what: "placement",
                id: session.to_string(),
            })
    }

    /// Claims a live dispatch of a session whose turn runs on the gateway: `local →
    /// handing_off` on `profile`, holding one of `max_live` worker slots, in one immediate
    /// transaction that finds the run `run` still open (a turn that ended first is moved
    /// at the boundary instead). The turn's loop then stops before its next model call.
    pub fn claim_live_dispatch(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &skiff_protocol::RunId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let open: Option<String> = tx
                .query_row(
                    &format!(
                        "SELECT id FROM runs WHERE id = ?1 AND session_id = ?2 AND status IN {OPEN_RUN}"
                    ),
                    [run.as_str(), session.as_str()],
                    |r| r.get(0),
                )
                .optional()?;
            if open.is_none() {
                return Err(Error::RunEnded {
                    run: run.to_string(),
                });
            }
            claim_in(
                &tx,
                scope,
                session,
                profile,
                max_live,
                PlacementState::HandingOff,
            )?;
            tx.commit()?;
        }
        self.placement(scope, session)?
            .ok_or_else(|| Error::NotFound {
                what: "placement",
                id: session.to_string(),
            })
    }

    pub fn placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>> {
        Ok(self
            .conn()
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM placements WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
            ))?
            .query_row(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?)
    }

    /// Placements on worker boxes that are not settled (for reconciliation at start). Parked
    /// ones are settled: they hold no box.
    pub fn live_placements(&self) -> Result<Vec<PlacementRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM placements WHERE state NOT IN {SETTLED}"
        ))?;
        let rows = stmt
            .query_map([], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Sessions placed on `env` and not settled.
    pub fn sessions_on_environment(&self, env: &EnvironmentId) -> Result<Vec<SessionId>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT session_id FROM placements WHERE environment_id = ?1 \
             AND state NOT IN {SETTLED} ORDER BY session_id"
        ))?;
        let rows = stmt
            .query_map([env.as_str()], |r| id_col(r, 0, SessionId::parse))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// The worker slots held right now (by placements that hold or are getting a worker).
    pub fn worker_slots(&self) -> Result<WorkerSlots> {
        slots_in(&self.conn())
    }

    /// Worker sessions that hold a box with no turn open and nothing on it the gateway lacks,
    /// the longest idle first (the order in which they are parked to make room).
    pub fn idle_placements(&self) -> Result<Vec<IdlePlacement>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT p.session_id, p.owner_id, p.tenant_id, p.profile, \
             MAX(p.updated_at_ms, COALESCE((SELECT MAX(r.finished_at_ms) FROM runs r \
             WHERE r.session_id = p.session_id), 0)) AS idle_since \
             FROM placements p WHERE p.state = 'active' AND p.box_in_step = 1 \
             AND NOT EXISTS (SELECT 1 FROM runs r \
             WHERE r.session_id = p.session_id AND r.status IN {OPEN_RUN}) \
             ORDER BY idle_since, p.session_id"
        ))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(IdlePlacement {
                    session_id: id_col(r, 0, SessionId::parse)?,
                    scope: Scope::new(r.get::<_, String>(1)?, r.get::<_, String>(2)?),
                    profile: r.get(3)?,
                    idle_since_ms: r.get(4)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Parks a worker session that holds a box between turns: `active → parked`, advancing the
    /// owner epoch (whatever its old worker still sends is fenced) and forgetting the box,
    /// which the caller gives back. Returns the placement as it was (with its box and worker),
    /// or `None` when the session is not parkable any more — it is not `active`, a turn was
    /// admitted since the caller looked, or its box holds work not brought back.
    ///
    /// INVARIANT: the check for an open run and the move are one immediate transaction, and
    /// turn admission is an insert under the same database lock, so a turn and a park cannot
    /// both win: a session with an open run is never parked, and a turn admitted after the
    /// park finds the session parked and places it again.
    pub fn park_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<Option<PlacementRow>> {
        let before = {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let before = tx
                .prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM placements WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
                ))?
                .query_row(
                    params![session.as_str(), scope.owner_id, scope.tenant_id],
                    from_row,
                )
                .optional()?;
            let Some(before) = before else {
                return Ok(None);
            };
            let open: bool = tx.query_row(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM runs WHERE session_id = ?1 AND status IN {OPEN_RUN})"
                ),
                [session.as_str()],
                |r| r.get(0),
            )?;
            // INVARIANT: a box that may hold work the gateway lacks (a turn whose work was not
            // brought back) is never given back: the session keeps it until a turn's
            // reconciliation succeeds.
            if before.state != PlacementState::Active || open || !before.box_in_step {
                return Ok(None);
            }
            let to = PlacementState::Parked;
            if !placement_allowed(before.state, to) {
                return Err(Error::IllegalPlacementTransition {
                    session: session.to_string(),
                    from: before.state,
                    to,
                });
            }
            let now = now_ms();
            tx.execute(
                "UPDATE placements SET state = ?1, generation = generation + 1, \
                 owner_epoch = owner_epoch + 1, environment_id = NULL, worker_pid = NULL, \
                 box_in_step = 0, error = NULL, updated_at_ms = ?2 WHERE session_id = ?3",
                params![to.as_str(), now, session.as_str()],
            )?;
            tx.execute(
                "UPDATE sessions SET placement = ?1, updated_at_ms = ?2 WHERE id = ?3",
                params![to.as_str(), now, session.as_str()],
            )?;
            // The box is attached to no placement from here until it is given back: its use
            // is recorded now, so nothing takes it for an abandoned one meanwhile.
            if let Some(env) = &before.environment_id {
                tx.execute(
                    "UPDATE environments SET last_used_at_ms = ?1 WHERE id = ?2",
                    params![now, env.as_str()],
                )?;
            }
            tx.commit()?;
            before
        };
        Ok(Some(before))
    }

    /// Claims a worker session for a pull-back: `active → draining`, in one immediate
    /// transaction that finds no open run. Returns the placement as it was (its box, worker
    /// and epoch). Refused with `SessionBusy` when a turn is open, and as an illegal move
    /// when the session is not active on a box.
    ///
    /// INVARIANT: as with parking, the check for an open run and the move are one immediate
    /// transaction and turn admission is an insert under the same database lock: a turn
    /// admitted first makes the claim fail, and a turn admitted after it finds the session
    /// draining.
    pub fn claim_pull_back(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let before = tx
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM placements WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
            ))?
            .query_row(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "placement",
                id: session.to_string(),
            })?;
        let open: Option<String> = tx
            .query_row(
                &format!("SELECT id FROM runs WHERE session_id = ?1 AND status IN {OPEN_RUN}"),
                [session.as_str()],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(run) = open {
            return Err(Error::SessionBusy {
                session: session.to_string(),
                run,
            });
        }
        let to = PlacementState::Draining;
        if before.state != PlacementState::Active || !placement_allowed(before.state, to) {
            return Err(Error::IllegalPlacementTransition {
                session: session.to_string(),
                from: before.state,
                to,
            });
        }
        let now = now_ms();
        tx.execute(
            "UPDATE placements SET state = ?1, generation = generation + 1, updated_at_ms = ?2 \
             WHERE session_id = ?3",
            params![to.as_str(), now, session.as_str()],
        )?;
        tx.execute(
            "UPDATE sessions SET placement = ?1, updated_at_ms = ?2 WHERE id = ?3",
            params![to.as_str(), now, session.as_str()],
        )?;
        tx.commit()?;
        Ok(before)
    }

    /// Brings a session home: `→ local` from a pull-back's `draining` or `reconciling`, or
    /// from `parked`, `reclaimed` or `failed` (no box to drain), advancing the owner epoch
    /// (no worker ever held the new one) and forgetting the box, which the caller gives back.
    /// Returns the placement as it was.
    pub fn come_home(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let before = tx
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM placements WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3"
            ))?
            .query_row(
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                from_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "placement",
                id: session.to_string(),
            })?;
        let to = PlacementState::Local;
        if !placement_allowed(before.state, to) {
            return Err(Error::IllegalPlacementTransition {
                session: session.to_string(),
                from: before.state,
                to,
            });
        }
        let now = now_ms();
        tx.execute(
            "UPDATE placements SET state = ?1, generation = generation + 1, \
             owner_epoch = owner_epoch + 1, environment_id = NULL, worker_pid = NULL, \
             box_in_step = 0, error = NULL, updated_at_ms = ?2 WHERE session_id = ?3",
            params![to.as_str(), now, session.as_str()],
        )?;
        tx.execute(
            "UPDATE sessions SET placement = ?1, updated_at_ms = ?2 WHERE id = ?3",
            params![to.as_str(), now, session.as_str()],
        )?;
        // As with parking: the box is attached to no placement until it is given back, so
        // its use is recorded now and nothing takes it for an abandoned one meanwhile.
        if let Some(env) = &before.environment_id {
            tx.execute(
                "UPDATE environments SET last_used_at_ms = ?1 WHERE id = ?2",
                params![now, env.as_str()],
            )?;
        }
        tx.commit()?;
        Ok(before)
    }

    /// Starts a failover of a session whose box died under its running turn: `reclaimed →
    /// failed_over`, forgetting the dead box (the caller abandoned it) and recording `why`.
    /// The placement holds a worker slot again until the run's new attempt is placed
    /// (`failed_over → requested`) or the failover fails.
    pub fn begin_failover(
        &self,
        scope: &Scope,
        session: &SessionId,
        why: &str,
    ) -> Result<PlacementRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let to = PlacementState::FailedOver;
            checked_move(
                &tx,
                "SELECT state FROM placements WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                "placement",
                scope,
                session,
                to,
            )?;
            let now = now_ms();
            tx.execute(
                "UPDATE placements SET state = ?1, generation = generation + 1, \
                 environment_id = NULL, worker_pid = NULL, box_in_step = 0, error = ?2, \
                 updated_at_ms = ?3 WHERE session_id = ?4",
                params![to.as_str(), why, now, session.as_str()],
            )?;
            tx.execute(
                "UPDATE sessions SET placement = ?1, updated_at_ms = ?2 WHERE id = ?3",
                params![to.as_str(), now, session.as_str()],
            )?;
            tx.commit()?;
        }
        self.placement(scope, session)?
            .ok_or_else(|| Error::NotFound {
                what: "placement",
                id: session.to_string(),
            })
    }

    /// Moves a placement to `to` if the state machine allows it.
    pub fn transition_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        to: PlacementState,
        change: &PlacementChange<'_>,
    ) -> Result<PlacementRow> {
        {
            let mut conn = self.conn();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            checked_move(
                &tx,
                "SELECT state FROM placements WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                "placement",
                scope,
                session,
                to,
            )?;
            let now = now_ms();
            tx.execute(
                "UPDATE placements SET state = ?1, generation = generation + 1, \
                 environment_id = COALESCE(?2, environment_id), \
                 owner_epoch = owner_epoch + ?3, \
                 base_manifest = COALESCE(?4, base_manifest), \
                 bundle_hash = COALESCE(?5, bundle_hash), \
                 worker_pid = COALESCE(?6, worker_pid), \
                 error = ?7, updated_at_ms = ?8, left_out = COALESCE(?10, left_out), \
                 box_in_step = COALESCE(?11, box_in_step) \
                 WHERE session_id = ?9",
                params![
                    to.as_str(),
                    change.environment_id.map(EnvironmentId::as_str),
                    i64::from(change.advance_epoch),
                    change.base_manifest,
                    change.bundle_hash,
                    change.worker_pid,
                    change.error,
                    now,
                    session.as_str(),
                    change.left_out,
                    change.box_in_step
                ],
            )?;
            tx.execute(
                "UPDATE sessions SET placement = ?1, updated_at_ms = ?2 WHERE id = ?3",
                params![to.as_str(), now, session.as_str()],
            )?;
            tx.commit()?;
        }
        self.placement(scope, session)?
            .ok_or_else(|| Error::NotFound {
                what: "placement",
                id: session.to_string(),
            })
    }

    /// Records that the session's box is about to get work the gateway does not have yet (a
    /// turn is handed to its worker), without moving the placement. The turn's successful
    /// reconciliation records it in step again.
    pub fn mark_box_ahead(&self, scope: &Scope, session: &SessionId) -> Result<()> {
        self.conn().execute(
            "UPDATE placements SET box_in_step = 0 \
             WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
            params![session.as_str(), scope.owner_id, scope.tenant_id],
        )?;
        Ok(())
    }

    /// Records that the session's box is in step with the gateway again at `base_manifest`
    /// (the box's work was brought back outside a turn's end: a pull-back's barrier, or a box
    /// whose worker cannot start), without moving the placement. A session that then stays on
    /// its box (a barrier cut short) reconciles its next turn against what both sides have.
    pub fn mark_box_in_step(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()> {
        let changed = self.conn().execute(
            "UPDATE placements SET base_manifest = ?1, box_in_step = 1, updated_at_ms = ?2 \
             WHERE session_id = ?3 AND owner_id = ?4 AND tenant_id = ?5",
            params![
                base_manifest,
                now_ms(),
                session.as_str(),
                scope.owner_id,
                scope.tenant_id
            ],
        )?;
        if changed == 0 {
            return Err(Error::NotFound {
                what: "placement",
                id: session.to_string(),
            });
        }
        Ok(())
    }

    /// Replaces the base manifest of a live placement without moving it: the session's
    /// workspace changed on the gateway by an operator's decision (an accepted quarantined
    /// path), and the box was given the same change.
    pub fn set_placement_base_manifest(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()> {
        let changed = self.conn().execute(
            "UPDATE placements SET base_manifest = ?1, updated_at_ms = ?2 \
             WHERE session_id = ?3 AND owner_id = ?4 AND tenant_id = ?5",
            params![
                base_manifest,
                now_ms(),
                session.as_str(),
                scope.owner_id,
                scope.tenant_id
            ],
        )?;
        if changed == 0 {
            return Err(Error::NotFound {
                what: "placement",
                id: session.to_string(),
            });
        }
        Ok(())
    }

    /// The cached terminal reply of a worker operation, if it was applied.
    pub fn worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<Option<CachedOp>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT method, call_hash, reply FROM worker_ops \
                 WHERE session_id = ?1 AND owner_epoch = ?2 AND stream = ?3 AND seq = ?4",
                params![session.as_str(), epoch, stream.as_str(), seq],
                |r| {
                    Ok(CachedOp {
                        method: r.get(0)?,
                        call_hash: r.get(1)?,
                        reply: r.get(2)?,
                    })
                },
            )
            .optional()?)
    }

    /// Records the terminal reply of a worker operation. Recording the same operation twice
    /// keeps the first reply (the caller answers duplicates from it).
    pub fn record_worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
        op: &CachedOp,
    ) -> Result<()> {
        self.conn().execute(
            "INSERT OR IGNORE INTO worker_ops (session_id, owner_epoch, stream, seq, method, call_hash, reply, at_ms) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![session.as_str(), epoch, stream.as_str(), seq, op.method, op.call_hash, op.reply, now_ms()],
        )?;
        Ok(())
    }

    /// The last applied sequence number per stream for a session's epoch (ACK cursors).
    pub fn worker_cursors(
        &self,
        session: &SessionId,
        epoch: u64,
    ) -> Result<BTreeMap<StreamKind, u64>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT stream, seq FROM worker_cursors WHERE session_id = ?1 AND owner_epoch = ?2",
        )?;
        let rows = stmt
            .query_map(params![session.as_str(), epoch], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, u64>(1)?))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut out = BTreeMap::new();
        for (stream, seq) in rows {
            let kind = [
                StreamKind::Transcript,
                StreamKind::Events,
                StreamKind::Model,
                StreamKind::Tool,
                StreamKind::Control,
            ]
            .into_iter()
            .find(|k| k.as_str() == stream);
            if let Some(kind) = kind {
                out.insert(kind, seq);
            }
        }
        Ok(out)
    }

    /// Moves a stream's ACK cursor forward (never back).
    pub fn advance_worker_cursor(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<()> {
        self.conn()
            .prepare_cached(
                "INSERT INTO worker_cursors (session_id, owner_epoch, stream, seq) VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT(session_id, owner_epoch, stream) DO UPDATE SET seq = MAX(seq, ?4)",
            )?
            .execute(params![session.as_str(), epoch, stream.as_str(), seq])?;
        Ok(())
    }

    /// Records that a credential was admitted. `false` when it already was (a replay).
    pub fn use_worker_credential(
        &self,
        credential_id: &str,
        session: &SessionId,
        env: &EnvironmentId,
    ) -> Result<bool> {
        let changed = self.conn().execute(
            "INSERT OR IGNORE INTO worker_credentials (credential_id, session_id, environment_id, used_at_ms) \
             VALUES (?1, ?2, ?3, ?4)",
            params![credential_id, session.as_str(), env.as_str(), now_ms()],
        )?;
        Ok(changed == 1)
    }

    /// Adds controlled egress to an environment's accounting.
    pub fn add_environment_egress(
        &self,
        env: &EnvironmentId,
        add: skiff_protocol::environment::EgressAccounting,
    ) -> Result<()> {
        self.conn().execute(
            "UPDATE environments SET model_requests = model_requests + ?1, \
             input_tokens = input_tokens + ?2, output_tokens = output_tokens + ?3, \
             bytes_in = bytes_in + ?4, bytes_out = bytes_out + ?5, \
             gateway_tool_calls = gateway_tool_calls + ?6 WHERE id = ?7",
            params![
                add.model_requests,
                add.input_tokens,
                add.output_tokens,
                add.bytes_in,
                add.bytes_out,
                add.gateway_tool_calls,
                env.as_str()
            ],
        )?;
        Ok(())
    }
}
