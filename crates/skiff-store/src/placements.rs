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
}

const COLUMNS: &str = "session_id, owner_id, tenant_id, state, profile, generation, environment_id, \
    owner_epoch, base_manifest, bundle_hash, worker_pid, error, updated_at_ms, left_out";

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
    let env: Option<String> = row.get(6)?;
    Ok(PlacementRow {
        session_id: id_col(row, 0, SessionId::parse)?,
        scope: Scope::new(row.get::<_, String>(1)?, row.get::<_, String>(2)?),
        state: parse_state(&row.get::<_, String>(3)?)?,
        profile: row.get(4)?,
        generation: row.get(5)?,
        environment_id: env.as_deref().and_then(EnvironmentId::parse),
        owner_epoch: row.get(7)?,
        base_manifest: row.get(8)?,
        bundle_hash: row.get(9)?,
        worker_pid: row.get(10)?,
        error: row.get(11)?,
        updated_at_ms: row.get(12)?,
        left_out: row.get(13)?,
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
}

/// `request_placement` inside the caller's immediate transaction.
pub(crate) fn request_in(
    tx: &rusqlite::Transaction<'_>,
    scope: &Scope,
    session: &SessionId,
    profile: &str,
    max_live: u64,
) -> Result<()> {
    let to = PlacementState::Requested;
    checked_move(
        tx,
        "SELECT placement FROM sessions WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
        "session",
        scope,
        session,
        to,
    )?;
    let live: u64 = tx.query_row(LIVE_COUNT, [], |r| r.get(0))?;
    if live >= max_live {
        return Err(Error::WorkersAtCapacity {
            live,
            max: max_live,
        });
    }
    let now = now_ms();
    tx.execute(
        "INSERT INTO placements (session_id, owner_id, tenant_id, state, profile, updated_at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT(session_id) DO UPDATE SET state = ?4, profile = ?5, error = NULL, \
         environment_id = NULL, worker_pid = NULL, generation = generation + 1, updated_at_ms = ?6",
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

const LIVE_COUNT: &str =
    "SELECT COUNT(*) FROM placements WHERE state NOT IN ('local','reclaimed','failed')";

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

    /// Placements on worker boxes that are not settled (for reconciliation at start).
    pub fn live_placements(&self) -> Result<Vec<PlacementRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM placements WHERE state NOT IN ('local','reclaimed','failed')"
        ))?;
        let rows = stmt
            .query_map([], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Sessions placed on `env` and not settled.
    pub fn sessions_on_environment(&self, env: &EnvironmentId) -> Result<Vec<SessionId>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT session_id FROM placements WHERE environment_id = ?1 \
             AND state NOT IN ('local','reclaimed','failed') ORDER BY session_id",
        )?;
        let rows = stmt
            .query_map([env.as_str()], |r| id_col(r, 0, SessionId::parse))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// How many placements hold (or are getting) a worker right now.
    pub fn count_live_placements(&self) -> Result<u64> {
        Ok(self.conn().query_row(LIVE_COUNT, [], |r| r.get(0))?)
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
                 error = ?7, updated_at_ms = ?8, left_out = COALESCE(?10, left_out) \
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
                    change.left_out
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
