//! The per-session event log. Each event gets the next cursor of its session; readers resume
//! from the last cursor they saw.

use crate::aggregates::leases::Fence;
use crate::{Error, Result, Scope, Store, id_col, json_col, now_ms, to_json};
use rusqlite::{TransactionBehavior, params};
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};

impl Store {
    /// Appends an event and returns it with its cursor.
    pub fn append_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent> {
        self.append_event_with(None, scope, session, run, kind, None)
    }

    /// Appends a worker's live event and moves its ACK cursor (`epoch`, `seq`) in the same
    /// transaction: applied and acknowledged are one fact.
    pub fn append_worker_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
        epoch: u64,
        seq: u64,
    ) -> Result<SessionEvent> {
        self.append_event_with(None, scope, session, run, kind, Some((epoch, seq)))
    }

    /// The append, first checking `fence` (issue 17) in the same transaction when there is
    /// one, then hinting this process's followers (`wakeups`).
    pub(crate) fn append_event_with(
        &self,
        fence: Option<&Fence>,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
        cursor_of: Option<(u64, u64)>,
    ) -> Result<SessionEvent> {
        let body = to_json("event", &kind)?;
        let at_ms = now_ms();
        let mut conn = self.conn();
        let tx = match fence {
            // The write lock first: the check and the append see one state.
            Some(_) => conn.transaction_with_behavior(TransactionBehavior::Immediate)?,
            None => conn.transaction()?,
        };
        if let Some(fence) = fence {
            crate::leases::check_fence(&tx, fence)?;
        }
        if let Some((epoch, seq)) = cursor_of {
            tx.prepare_cached(
                "INSERT INTO worker_cursors (session_id, owner_epoch, stream, seq) VALUES (?1, ?2, 'events', ?3) \
                 ON CONFLICT(session_id, owner_epoch, stream) DO UPDATE SET seq = MAX(seq, ?3)",
            )?
            .execute(params![session.as_str(), epoch, seq])?;
        }
        let cursor: i64 = tx.prepare_cached(
            "INSERT INTO events (session_id, seq, owner_id, tenant_id, run_id, at_ms, body)
             SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3, ?4, ?5, ?6 FROM events WHERE session_id = ?1
             RETURNING seq",
        )?.query_row(
            params![
                session.as_str(),
                scope.owner_id,
                scope.tenant_id,
                run.map(RunId::as_str),
                at_ms,
                body
            ],
            |r| r.get(0),
        )?;
        tx.commit()?;
        drop(conn);
        let cursor = u64::try_from(cursor).map_err(|e| Error::Corrupt {
            what: "event cursor",
            detail: e.to_string(),
        })?;
        self.wakeups.appended(session, cursor);
        Ok(SessionEvent {
            session_id: session.clone(),
            cursor,
            at_ms,
            run_id: run.cloned(),
            kind,
        })
    }

    /// The cursor of the session's newest event (0 when it has none): where a follower that
    /// wants only what happens from now on starts.
    pub fn last_event_cursor(&self, scope: &Scope, session: &SessionId) -> Result<u64> {
        let last: i64 = self.conn().query_row(
            "SELECT COALESCE(MAX(seq), 0) FROM events \
             WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
            params![session.as_str(), scope.owner_id, scope.tenant_id],
            |r| r.get(0),
        )?;
        u64::try_from(last).map_err(|e| Error::Corrupt {
            what: "event cursor",
            detail: e.to_string(),
        })
    }

    /// Up to `limit` events after `cursor`, oldest first.
    pub fn events_after(
        &self,
        scope: &Scope,
        session: &SessionId,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<SessionEvent>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT session_id, seq, at_ms, run_id, body FROM events
              WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3 AND seq > ?4
              ORDER BY seq LIMIT ?5",
        )?;
        let rows = stmt
            .query_map(
                params![
                    session.as_str(),
                    scope.owner_id,
                    scope.tenant_id,
                    i64::try_from(cursor).unwrap_or(i64::MAX),
                    i64::try_from(limit).unwrap_or(i64::MAX)
                ],
                |row| {
                    Ok(SessionEvent {
                        session_id: id_col(row, 0, SessionId::parse)?,
                        cursor: row.get(1)?,
                        at_ms: row.get(2)?,
                        run_id: row
                            .get::<_, Option<String>>(3)?
                            .and_then(|s| RunId::parse(&s)),
                        kind: json_col(row, 4)?,
                    })
                },
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }
}
