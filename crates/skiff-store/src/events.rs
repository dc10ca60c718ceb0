//! The per-session event log. Each event gets the next cursor of its session; readers resume
//! from the last cursor they saw.

use crate::{Error, Result, Scope, Store, id_col, json_col, now_ms, to_json};
use rusqlite::params;
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
        let body = to_json("event", &kind)?;
        let at_ms = now_ms();
        let cursor: i64 = self.conn().query_row(
            "INSERT INTO events (session_id, seq, owner_id, tenant_id, run_id, at_ms, body)
             SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3, ?4, ?5, ?6 FROM events WHERE session_id = ?1
             RETURNING seq",
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
        Ok(SessionEvent {
            session_id: session.clone(),
            cursor: u64::try_from(cursor).map_err(|e| Error::Corrupt {
                what: "event cursor",
                detail: e.to_string(),
            })?,
            at_ms,
            run_id: run.cloned(),
            kind,
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
