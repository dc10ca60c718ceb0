//! Placements, worker slots and the worker protocol's rows on PostgreSQL.
//!
//! Every placement change runs in one transaction that locks the session's row first
//! (`SELECT … FOR UPDATE`), then reads the placement and checks the move against the state
//! machine: two gateways moving one session are ordered by that lock, and each sees the state
//! the other left. Turn admission (`create_run`) takes the same row lock, so a park or a
//! pull-back and a new turn cannot both win. Claims of a worker slot also take a
//! transaction-scoped advisory lock before counting, so concurrent claims from any number of
//! connections never hold more than the cap between them.

use super::conn::PgConn;
use super::{PgStore, bigint, count, id};
use crate::aggregates::{PlacementStore, WorkerOpStore};
use crate::placements::{COLUMNS, OPEN_RUN, SETTLED};
use crate::transition::placement_allowed;
use crate::{
    CachedOp, Error, IdlePlacement, PlacementChange, PlacementRow, Result, Scope, WorkerSlots,
    now_ms,
};
use postgres::{Row, Transaction};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::worker::StreamKind;
use skiff_protocol::{EnvironmentId, RunId, SessionId};
use std::collections::BTreeMap;

/// An arbitrary constant: the advisory lock every worker-slot claim takes, gateway-wide.
const WORKER_SLOTS_LOCK: i64 = 0x736b_6966_665f_736c;

fn state_from(text: &str) -> Result<PlacementState> {
    PlacementState::parse(text).ok_or_else(|| Error::Corrupt {
        what: "placement",
        detail: format!("unknown placement state {text:?}"),
    })
}

fn placement_from(row: &Row) -> Result<PlacementRow> {
    placement_at(row, 0)
}

/// [`placement_from`] for a row whose columns start at `o` (a join's).
pub(super) fn placement_at(row: &Row, o: usize) -> Result<PlacementRow> {
    Ok(PlacementRow {
        session_id: id("placement", row.try_get(o)?, SessionId::parse)?,
        scope: Scope::new(
            row.try_get::<_, String>(o + 1)?,
            row.try_get::<_, String>(o + 2)?,
        ),
        state: state_from(row.try_get(o + 3)?)?,
        profile: row.try_get(o + 4)?,
        generation: count("placement generation", row.try_get(o + 5)?)?,
        environment_id: row
            .try_get::<_, Option<&str>>(o + 6)?
            .and_then(EnvironmentId::parse),
        owner_epoch: count("placement epoch", row.try_get(o + 7)?)?,
        base_manifest: row.try_get(o + 8)?,
        bundle_hash: row.try_get(o + 9)?,
        worker_pid: row.try_get(o + 10)?,
        error: row.try_get(o + 11)?,
        updated_at_ms: row.try_get(o + 12)?,
        left_out: row.try_get(o + 13)?,
        box_in_step: row.try_get(o + 14)?,
    })
}

fn placement_not_found(session: &str) -> Error {
    Error::NotFound {
        what: "placement",
        id: session.to_string(),
    }
}

/// Locks the session's row (the lock every change of its placement or its turns takes first)
/// and answers its mirrored placement state; `None` outside `scope`.
fn lock_session(
    tx: &mut Transaction<'_>,
    scope: &Scope,
    session: &str,
) -> Result<Option<PlacementState>> {
    tx.query_opt(
        "SELECT placement FROM sessions WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 \
         FOR UPDATE",
        &[&session, &scope.owner_id, &scope.tenant_id],
    )?
    .map(|row| state_from(row.try_get(0)?))
    .transpose()
}

/// The session's placement under its session's row lock, as it is now; `None` when the
/// session is not in `scope` or was never placed.
fn locked_placement(
    tx: &mut Transaction<'_>,
    scope: &Scope,
    session: &str,
) -> Result<Option<PlacementRow>> {
    if lock_session(tx, scope, session)?.is_none() {
        return Ok(None);
    }
    tx.query_opt(
        &format!(
            "SELECT {COLUMNS} FROM placements \
             WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 FOR UPDATE"
        ),
        &[&session, &scope.owner_id, &scope.tenant_id],
    )?
    .as_ref()
    .map(placement_from)
    .transpose()
}

fn has_open_run(tx: &mut Transaction<'_>, session: &str) -> Result<Option<String>> {
    Ok(tx
        .query_opt(
            &format!("SELECT id FROM runs WHERE session_id = $1 AND status IN {OPEN_RUN}"),
            &[&session],
        )?
        .map(|row| row.try_get(0))
        .transpose()?)
}

pub(super) fn slots_in(client: &mut impl postgres::GenericClient) -> Result<WorkerSlots> {
    let row = client.query_one(
        &format!(
            "SELECT COUNT(*)::BIGINT, COALESCE(SUM(CASE WHEN EXISTS (SELECT 1 FROM runs r \
             WHERE r.session_id = p.session_id AND r.status IN {OPEN_RUN}) THEN 1 ELSE 0 END), \
             0)::BIGINT FROM placements p WHERE p.state NOT IN {SETTLED}"
        ),
        &[],
    )?;
    Ok(WorkerSlots {
        live: count("worker slots", row.try_get(0)?)?,
        running_turns: count("worker slots", row.try_get(1)?)?,
    })
}

/// Mirrors a placement's new state into `sessions.placement`.
fn mirror(tx: &mut Transaction<'_>, session: &str, to: PlacementState, now: i64) -> Result<()> {
    tx.execute(
        "UPDATE sessions SET placement = $1, updated_at_ms = $2 WHERE id = $3",
        &[&to.as_str(), &now, &session],
    )?;
    Ok(())
}

fn illegal(session: &str, from: PlacementState, to: PlacementState) -> Error {
    Error::IllegalPlacementTransition {
        session: session.to_string(),
        from,
        to,
    }
}

/// What a claim needs, owned (it crosses to the connection's thread).
pub(super) struct Claim {
    pub(super) scope: Scope,
    pub(super) session: String,
    pub(super) profile: String,
    pub(super) max_live: u64,
    pub(super) to: PlacementState,
    /// A live dispatch: the run that must still be open.
    pub(super) open_run: Option<String>,
}

/// Claims a worker slot for the session, moving it to `claim.to`, in one transaction.
fn claim(conn: &mut PgConn, claim: Claim) -> Result<PlacementRow> {
    let mut tx = conn.client.transaction()?;
    let placed = claim_in(&mut tx, claim)?;
    tx.commit()?;
    Ok(placed)
}

/// Takes the worker slots' advisory lock: claims are counted one at a time, gateway-wide, so
/// a count sees every claim committed before it and none commits until its transaction has.
/// Taken before any row lock by everything that claims, so lock order stays one way.
pub(super) fn lock_worker_slots(tx: &mut Transaction<'_>) -> Result<()> {
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&WORKER_SLOTS_LOCK])?;
    Ok(())
}

/// [`claim`] inside the caller's transaction (which commits it with what else it writes).
pub(super) fn claim_in(tx: &mut Transaction<'_>, claim: Claim) -> Result<PlacementRow> {
    let Claim {
        scope,
        session,
        profile,
        max_live,
        to,
        open_run,
    } = claim;
    lock_worker_slots(tx)?;
    let from = lock_session(tx, &scope, &session)?.ok_or_else(|| Error::NotFound {
        what: "session",
        id: session.clone(),
    })?;
    if let Some(run) = open_run {
        let open = tx.query_opt(
            &format!(
                "SELECT id FROM runs WHERE id = $1 AND session_id = $2 AND status IN {OPEN_RUN}"
            ),
            &[&run, &session],
        )?;
        if open.is_none() {
            return Err(Error::RunEnded { run });
        }
    }
    if !placement_allowed(from, to) {
        return Err(illegal(&session, from, to));
    }
    // A failover holds its slot while its new attempt is placed.
    if from != PlacementState::FailedOver
        && let Some(refusal) = slots_in(tx)?.refusal(max_live)
    {
        return Err(refusal);
    }
    let now = now_ms();
    let row = tx.query_one(
        &format!(
            "INSERT INTO placements (session_id, owner_id, tenant_id, state, profile, \
             updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (session_id) DO UPDATE SET state = EXCLUDED.state, \
             profile = EXCLUDED.profile, error = NULL, environment_id = NULL, \
             worker_pid = NULL, box_in_step = FALSE, generation = placements.generation + 1, \
             updated_at_ms = EXCLUDED.updated_at_ms \
             RETURNING {COLUMNS}"
        ),
        &[
            &session,
            &scope.owner_id,
            &scope.tenant_id,
            &to.as_str(),
            &profile,
            &now,
        ],
    )?;
    let placed = placement_from(&row)?;
    mirror(tx, &session, to, now)?;
    Ok(placed)
}

/// A [`PlacementChange`], owned.
struct Change {
    environment_id: Option<String>,
    advance_epoch: i64,
    base_manifest: Option<String>,
    bundle_hash: Option<String>,
    worker_pid: Option<i64>,
    error: Option<String>,
    left_out: Option<String>,
    box_in_step: Option<bool>,
}

impl From<&PlacementChange<'_>> for Change {
    fn from(change: &PlacementChange<'_>) -> Self {
        Self {
            environment_id: change.environment_id.map(ToString::to_string),
            advance_epoch: i64::from(change.advance_epoch),
            base_manifest: change.base_manifest.map(str::to_string),
            bundle_hash: change.bundle_hash.map(str::to_string),
            worker_pid: change.worker_pid,
            error: change.error.map(str::to_string),
            left_out: change.left_out.map(str::to_string),
            box_in_step: change.box_in_step,
        }
    }
}

/// The box a placement gave up is attached to nothing until it is given back: its use is
/// recorded now, so nothing takes it for an abandoned one meanwhile.
fn record_box_use(tx: &mut Transaction<'_>, before: &PlacementRow, now: i64) -> Result<()> {
    if let Some(env) = &before.environment_id {
        tx.execute(
            "UPDATE environments SET last_used_at_ms = $1 WHERE id = $2",
            &[&now, &env.as_str()],
        )?;
    }
    Ok(())
}

/// Settles a placement off its box: `to`, advancing the owner epoch and forgetting the box.
fn leave_box(
    tx: &mut Transaction<'_>,
    before: &PlacementRow,
    to: PlacementState,
    now: i64,
) -> Result<()> {
    let session = before.session_id.as_str();
    tx.execute(
        "UPDATE placements SET state = $1, generation = generation + 1, \
         owner_epoch = owner_epoch + 1, environment_id = NULL, worker_pid = NULL, \
         box_in_step = FALSE, error = NULL, updated_at_ms = $2 WHERE session_id = $3",
        &[&to.as_str(), &now, &session],
    )?;
    mirror(tx, session, to, now)?;
    record_box_use(tx, before, now)
}

impl PlacementStore for PgStore {
    fn request_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow> {
        let request = Claim {
            scope: scope.clone(),
            session: session.to_string(),
            profile: profile.to_string(),
            max_live,
            to: PlacementState::Requested,
            open_run: None,
        };
        self.conn.run(move |conn| claim(conn, request))
    }

    fn claim_live_dispatch(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        profile: &str,
        max_live: u64,
    ) -> Result<PlacementRow> {
        let request = Claim {
            scope: scope.clone(),
            session: session.to_string(),
            profile: profile.to_string(),
            max_live,
            to: PlacementState::HandingOff,
            open_run: Some(run.to_string()),
        };
        self.conn.run(move |conn| claim(conn, request))
    }

    fn placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!(
                        "SELECT {COLUMNS} FROM placements \
                         WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3"
                    ),
                    &[&session, &scope.owner_id, &scope.tenant_id],
                )?
                .as_ref()
                .map(placement_from)
                .transpose()
        })
    }

    fn live_placements(&self) -> Result<Vec<PlacementRow>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM placements WHERE state NOT IN {SETTLED} \
                         ORDER BY session_id COLLATE \"C\""
                    ),
                    &[],
                )?
                .iter()
                .map(placement_from)
                .collect()
        })
    }

    fn sessions_on_environment(&self, env: &EnvironmentId) -> Result<Vec<SessionId>> {
        let env = env.to_string();
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT session_id FROM placements WHERE environment_id = $1 \
                         AND state NOT IN {SETTLED} ORDER BY session_id COLLATE \"C\""
                    ),
                    &[&env],
                )?
                .iter()
                .map(|row| id("placement", row.try_get(0)?, SessionId::parse))
                .collect()
        })
    }

    fn worker_slots(&self) -> Result<WorkerSlots> {
        self.conn.run(|conn| slots_in(&mut conn.client))
    }

    fn idle_placements(&self) -> Result<Vec<IdlePlacement>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT p.session_id, p.owner_id, p.tenant_id, p.profile, \
                         GREATEST(p.updated_at_ms, COALESCE((SELECT MAX(r.finished_at_ms) \
                         FROM runs r WHERE r.session_id = p.session_id), 0)) AS idle_since \
                         FROM placements p WHERE p.state = 'active' AND p.box_in_step \
                         AND NOT EXISTS (SELECT 1 FROM runs r \
                         WHERE r.session_id = p.session_id AND r.status IN {OPEN_RUN}) \
                         ORDER BY idle_since, p.session_id COLLATE \"C\""
                    ),
                    &[],
                )?
                .iter()
                .map(|row| {
                    Ok(IdlePlacement {
                        session_id: id("placement", row.try_get(0)?, SessionId::parse)?,
                        scope: Scope::new(
                            row.try_get::<_, String>(1)?,
                            row.try_get::<_, String>(2)?,
                        ),
                        profile: row.try_get(3)?,
                        idle_since_ms: row.try_get(4)?,
                    })
                })
                .collect()
        })
    }

    fn park_placement(&self, scope: &Scope, session: &SessionId) -> Result<Option<PlacementRow>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let Some(before) = locked_placement(&mut tx, &scope, &session)? else {
                return Ok(None);
            };
            let open = has_open_run(&mut tx, &session)?.is_some();
            // A box that may hold work the gateway lacks is never given back.
            if before.state != PlacementState::Active || open || !before.box_in_step {
                return Ok(None);
            }
            let to = PlacementState::Parked;
            if !placement_allowed(before.state, to) {
                return Err(illegal(&session, before.state, to));
            }
            leave_box(&mut tx, &before, to, now_ms())?;
            tx.commit()?;
            Ok(Some(before))
        })
    }

    fn claim_pull_back(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let before = locked_placement(&mut tx, &scope, &session)?
                .ok_or_else(|| placement_not_found(&session))?;
            if let Some(run) = has_open_run(&mut tx, &session)? {
                return Err(Error::SessionBusy { session, run });
            }
            let to = PlacementState::Draining;
            if before.state != PlacementState::Active || !placement_allowed(before.state, to) {
                return Err(illegal(&session, before.state, to));
            }
            let now = now_ms();
            tx.execute(
                "UPDATE placements SET state = $1, generation = generation + 1, \
                 updated_at_ms = $2 WHERE session_id = $3",
                &[&to.as_str(), &now, &session],
            )?;
            mirror(&mut tx, &session, to, now)?;
            tx.commit()?;
            Ok(before)
        })
    }

    fn come_home(&self, scope: &Scope, session: &SessionId) -> Result<PlacementRow> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let before = locked_placement(&mut tx, &scope, &session)?
                .ok_or_else(|| placement_not_found(&session))?;
            let to = PlacementState::Local;
            if !placement_allowed(before.state, to) {
                return Err(illegal(&session, before.state, to));
            }
            leave_box(&mut tx, &before, to, now_ms())?;
            tx.commit()?;
            Ok(before)
        })
    }

    fn begin_failover(
        &self,
        scope: &Scope,
        session: &SessionId,
        why: &str,
    ) -> Result<PlacementRow> {
        let (scope, session, why) = (scope.clone(), session.to_string(), why.to_string());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let before = locked_placement(&mut tx, &scope, &session)?
                .ok_or_else(|| placement_not_found(&session))?;
            let to = PlacementState::FailedOver;
            if !placement_allowed(before.state, to) {
                return Err(illegal(&session, before.state, to));
            }
            let now = now_ms();
            let row = tx.query_one(
                &format!(
                    "UPDATE placements SET state = $1, generation = generation + 1, \
                     environment_id = NULL, worker_pid = NULL, box_in_step = FALSE, error = $2, \
                     updated_at_ms = $3 WHERE session_id = $4 RETURNING {COLUMNS}"
                ),
                &[&to.as_str(), &why, &now, &session],
            )?;
            let after = placement_from(&row)?;
            mirror(&mut tx, &session, to, now)?;
            tx.commit()?;
            Ok(after)
        })
    }

    fn transition_placement(
        &self,
        scope: &Scope,
        session: &SessionId,
        to: PlacementState,
        change: &PlacementChange<'_>,
    ) -> Result<PlacementRow> {
        let (scope, session, change) = (scope.clone(), session.to_string(), Change::from(change));
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let before = locked_placement(&mut tx, &scope, &session)?
                .ok_or_else(|| placement_not_found(&session))?;
            if !placement_allowed(before.state, to) {
                return Err(illegal(&session, before.state, to));
            }
            let now = now_ms();
            let row = tx.query_one(
                &format!(
                    "UPDATE placements SET state = $1, generation = generation + 1, \
                     environment_id = COALESCE($2, environment_id), \
                     owner_epoch = owner_epoch + $3, \
                     base_manifest = COALESCE($4, base_manifest), \
                     bundle_hash = COALESCE($5, bundle_hash), \
                     worker_pid = COALESCE($6, worker_pid), \
                     error = $7, updated_at_ms = $8, left_out = COALESCE($10, left_out), \
                     box_in_step = COALESCE($11, box_in_step) \
                     WHERE session_id = $9 RETURNING {COLUMNS}"
                ),
                &[
                    &to.as_str(),
                    &change.environment_id,
                    &change.advance_epoch,
                    &change.base_manifest,
                    &change.bundle_hash,
                    &change.worker_pid,
                    &change.error,
                    &now,
                    &session,
                    &change.left_out,
                    &change.box_in_step,
                ],
            )?;
            let after = placement_from(&row)?;
            mirror(&mut tx, &session, to, now)?;
            tx.commit()?;
            Ok(after)
        })
    }

    fn mark_box_ahead(&self, scope: &Scope, session: &SessionId) -> Result<()> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client.execute(
                "UPDATE placements SET box_in_step = FALSE \
                 WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3",
                &[&session, &scope.owner_id, &scope.tenant_id],
            )?;
            Ok(())
        })
    }

    fn mark_box_in_step(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()> {
        set_manifest(self, scope, session, base_manifest, true)
    }

    fn set_placement_base_manifest(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_manifest: &str,
    ) -> Result<()> {
        set_manifest(self, scope, session, base_manifest, false)
    }
}

/// Replaces a placement's base manifest without moving it; `in_step` also records the box in
/// step with the gateway.
fn set_manifest(
    store: &PgStore,
    scope: &Scope,
    session: &SessionId,
    base_manifest: &str,
    in_step: bool,
) -> Result<()> {
    let args = (
        scope.clone(),
        session.to_string(),
        base_manifest.to_string(),
    );
    store.conn.run(move |conn| {
        let (scope, session, base_manifest) = args;
        let changed = conn.client.execute(
            "UPDATE placements SET base_manifest = $1, updated_at_ms = $2, \
             box_in_step = box_in_step OR $3 \
             WHERE session_id = $4 AND owner_id = $5 AND tenant_id = $6",
            &[
                &base_manifest,
                &now_ms(),
                &in_step,
                &session,
                &scope.owner_id,
                &scope.tenant_id,
            ],
        )?;
        if changed == 0 {
            return Err(placement_not_found(&session));
        }
        Ok(())
    })
}

const STREAMS: [StreamKind; 5] = [
    StreamKind::Transcript,
    StreamKind::Events,
    StreamKind::Model,
    StreamKind::Tool,
    StreamKind::Control,
];

impl WorkerOpStore for PgStore {
    fn worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<Option<CachedOp>> {
        let session = session.to_string();
        self.conn.run(move |conn| {
            let select = conn.statement(
                "SELECT method, call_hash, reply FROM worker_ops \
                 WHERE session_id = $1 AND owner_epoch = $2 AND stream = $3 AND seq = $4",
            )?;
            conn.client
                .query_opt(
                    &select,
                    &[&session, &bigint(epoch), &stream.as_str(), &bigint(seq)],
                )?
                .map(|row| {
                    Ok(CachedOp {
                        method: row.try_get(0)?,
                        call_hash: row.try_get(1)?,
                        reply: row.try_get(2)?,
                    })
                })
                .transpose()
        })
    }

    fn record_worker_op(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
        op: &CachedOp,
    ) -> Result<()> {
        let (session, op) = (session.to_string(), op.clone());
        self.conn.run(move |conn| {
            let insert = conn.statement(
                "INSERT INTO worker_ops (session_id, owner_epoch, stream, seq, method, \
                 call_hash, reply, at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                 ON CONFLICT DO NOTHING",
            )?;
            conn.client.execute(
                &insert,
                &[
                    &session,
                    &bigint(epoch),
                    &stream.as_str(),
                    &bigint(seq),
                    &op.method,
                    &op.call_hash,
                    &op.reply,
                    &now_ms(),
                ],
            )?;
            Ok(())
        })
    }

    fn worker_cursors(&self, session: &SessionId, epoch: u64) -> Result<BTreeMap<StreamKind, u64>> {
        let session = session.to_string();
        self.conn.run(move |conn| {
            let select = conn.statement(
                "SELECT stream, seq FROM worker_cursors WHERE session_id = $1 AND owner_epoch = $2",
            )?;
            let mut out = BTreeMap::new();
            for row in conn.client.query(&select, &[&session, &bigint(epoch)])? {
                let stream: &str = row.try_get(0)?;
                if let Some(kind) = STREAMS.into_iter().find(|k| k.as_str() == stream) {
                    out.insert(kind, count("worker cursor", row.try_get(1)?)?);
                }
            }
            Ok(out)
        })
    }

    fn advance_worker_cursor(
        &self,
        session: &SessionId,
        epoch: u64,
        stream: StreamKind,
        seq: u64,
    ) -> Result<()> {
        let session = session.to_string();
        self.conn.run(move |conn| {
            let upsert = conn.statement(
                "INSERT INTO worker_cursors (session_id, owner_epoch, stream, seq) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (session_id, owner_epoch, stream) \
                 DO UPDATE SET seq = GREATEST(worker_cursors.seq, EXCLUDED.seq)",
            )?;
            conn.client.execute(
                &upsert,
                &[&session, &bigint(epoch), &stream.as_str(), &bigint(seq)],
            )?;
            Ok(())
        })
    }

    fn use_worker_credential(
        &self,
        credential_id: &str,
        session: &SessionId,
        env: &EnvironmentId,
    ) -> Result<bool> {
        let args = (
            credential_id.to_string(),
            session.to_string(),
            env.to_string(),
        );
        self.conn.run(move |conn| {
            let (credential, session, env) = args;
            let inserted = conn.client.execute(
                "INSERT INTO worker_credentials (credential_id, session_id, environment_id, \
                 used_at_ms) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                &[&credential, &session, &env, &now_ms()],
            )?;
            Ok(inserted == 1)
        })
    }
}
