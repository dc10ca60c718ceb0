//! The event log on PostgreSQL.

use super::{PgStore, count, id, json};
use crate::aggregates::EventLog;
use crate::{Result, Scope, now_ms, to_json};
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};

/// One statement, so one round trip: the counter row's increment (locked until commit) gives
/// the cursor, and the event is written with it. Wake-up hook (issue 17, `pg/listen.rs`):
/// the last line notifies `"<session> <cursor>"` in the append's transaction, so other
/// processes hear of it when — and only if — it commits.
pub(super) const APPEND: &str = "WITH cursor AS (
        INSERT INTO event_cursors (session_id, last_seq) VALUES ($1, 1)
        ON CONFLICT (session_id) DO UPDATE SET last_seq = event_cursors.last_seq + 1
        RETURNING last_seq
    )
    , appended AS (
        INSERT INTO events (session_id, seq, owner_id, tenant_id, run_id, at_ms, body)
        SELECT $1, last_seq, $2, $3, $4, $5, $6 FROM cursor
        RETURNING seq
    )
    SELECT seq, pg_notify('skiff_events', $1 || ' ' || seq) FROM appended";

/// [`APPEND`] fenced (issue 17), still one statement: the counter moves, and so the event is
/// written, only while the session lease is held by `$7` at epoch `$8`, read under a share lock
/// on the lease row (a takeover waits for this append, or one that committed first leaves the
/// fence empty and nothing is written).
const APPEND_FENCED: &str = "WITH fence AS (
        SELECT 1 FROM leases
         WHERE kind = 'session' AND name = $1 AND holder = $7 AND epoch = $8
        FOR SHARE
    ), cursor AS (
        INSERT INTO event_cursors (session_id, last_seq) SELECT $1, 1 FROM fence
        ON CONFLICT (session_id) DO UPDATE SET last_seq = event_cursors.last_seq + 1
        RETURNING last_seq
    )
    , appended AS (
        INSERT INTO events (session_id, seq, owner_id, tenant_id, run_id, at_ms, body)
        SELECT $1, last_seq, $2, $3, $4, $5, $6 FROM cursor
        RETURNING seq
    )
    SELECT seq, pg_notify('skiff_events', $1 || ' ' || seq) FROM appended";

impl PgStore {
    /// The append, fenced when `fence` says so (`Leases::append_event_fenced`); hints this
    /// process's followers at once, other processes' through the notification.
    pub(super) fn append_event_with(
        &self,
        fence: Option<&crate::Fence>,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent> {
        let body = to_json("event", &kind)?;
        let at_ms = now_ms();
        let args = (
            session.to_string(),
            scope.clone(),
            run.map(ToString::to_string),
        );
        let fence = fence.cloned();
        let cursor: i64 = self.conn.run(move |conn| {
            let (session, scope, run) = args;
            let params: [&(dyn postgres::types::ToSql + Sync); 6] = [
                &session,
                &scope.owner_id,
                &scope.tenant_id,
                &run,
                &at_ms,
                &body,
            ];
            let Some(fence) = &fence else {
                let append = conn.statement(APPEND)?;
                return Ok(conn.client.query_one(&append, &params)?.try_get(0)?);
            };
            let append = conn.statement(APPEND_FENCED)?;
            let (gateway, epoch) = (fence.gateway.as_str(), fence.epoch);
            let mut fenced = params.to_vec();
            fenced.extend::<[&(dyn postgres::types::ToSql + Sync); 2]>([&gateway, &epoch]);
            match conn.client.query_opt(&append, &fenced)? {
                Some(row) => Ok(row.try_get(0)?),
                // Nothing was written: the fence did not hold (the check says how).
                None => {
                    super::leases::check_fence(&mut conn.client, fence)?;
                    Err(crate::aggregates::leases::lease_lost(
                        &crate::LeaseKey::Session(fence.session.clone()),
                        &fence.gateway,
                        fence.epoch,
                        None,
                    ))
                }
            }
        })?;
        let cursor = count("event cursor", cursor)?;
        self.wakeups.appended(session, cursor);
        Ok(SessionEvent {
            session_id: session.clone(),
            cursor,
            at_ms,
            run_id: run.cloned(),
            kind,
        })
    }
}

impl EventLog for PgStore {
    fn append_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent> {
        self.append_event_with(None, scope, session, run, kind)
    }

    fn last_event_cursor(&self, scope: &Scope, session: &SessionId) -> Result<u64> {
        let (session, scope) = (session.to_string(), scope.clone());
        let last: i64 = self.conn.retry(move |conn| {
            let last = conn.statement(
                "SELECT COALESCE(MAX(seq), 0) FROM events \
                 WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3",
            )?;
            Ok(conn
                .client
                .query_one(&last, &[&session, &scope.owner_id, &scope.tenant_id])?
                .try_get(0)?)
        })?;
        count("event cursor", last)
    }

    fn events_after(
        &self,
        scope: &Scope,
        session: &SessionId,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<SessionEvent>> {
        let (session, scope) = (session.to_string(), scope.clone());
        let cursor = super::bigint(cursor);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.conn.retry(move |conn| {
            let after = conn.statement(
                "SELECT session_id, seq, at_ms, run_id, body FROM events \
                 WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3 AND seq > $4 \
                 ORDER BY seq LIMIT $5",
            )?;
            conn.client
                .query(
                    &after,
                    &[&session, &scope.owner_id, &scope.tenant_id, &cursor, &limit],
                )?
                .iter()
                .map(|row| {
                    Ok(SessionEvent {
                        session_id: id("event", row.try_get(0)?, SessionId::parse)?,
                        cursor: count("event cursor", row.try_get(1)?)?,
                        at_ms: row.try_get(2)?,
                        run_id: row
                            .try_get::<_, Option<String>>(3)?
                            .and_then(|s| RunId::parse(&s)),
                        kind: json("event", row.try_get(4)?)?,
                    })
                })
                .collect()
        })
    }
}
