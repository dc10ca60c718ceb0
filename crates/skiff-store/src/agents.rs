//! Agent spec versions (content-addressed: the gateway computes and checks digests; this
//! module stores what it is given), the version each session is pinned to, and the chat
//! ingress's replay fence and thread → session map.

use crate::{Result, Scope, Store, now_ms};
use rusqlite::{OptionalExtension, params};
use skiff_protocol::SessionId;

/// One stored version of an agent spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentSpecRow {
    pub name: String,
    pub digest: String,
    /// The canonical JSON the digest was computed over, as stored.
    pub content: String,
    pub created_at_ms: i64,
    /// When configuration last named this version; the newest is the current one.
    pub seen_at_ms: i64,
}

const COLUMNS: &str = "name, digest, content, created_at_ms, seen_at_ms";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<AgentSpecRow> {
    Ok(AgentSpecRow {
        name: r.get(0)?,
        digest: r.get(1)?,
        content: r.get(2)?,
        created_at_ms: r.get(3)?,
        seen_at_ms: r.get(4)?,
    })
}

impl Store {
    /// Records that configuration names this version now: a new row, or the existing one
    /// marked seen (its content is never rewritten). Returns whether the version is new.
    pub fn put_agent_spec(&self, name: &str, digest: &str, content: &str) -> Result<bool> {
        let now = now_ms();
        let conn = self.conn();
        // Strictly after every other version of the name: the newest seen is current.
        let last: Option<i64> = conn.query_row(
            "SELECT MAX(seen_at_ms) FROM agent_specs WHERE name = ?1",
            params![name],
            |r| r.get(0),
        )?;
        let current: Option<String> = conn
            .query_row(
                "SELECT digest FROM agent_specs WHERE name = ?1 ORDER BY seen_at_ms DESC LIMIT 1",
                params![name],
                |r| r.get(0),
            )
            .optional()?;
        if current.as_deref() == Some(digest) {
            return Ok(false);
        }
        let seen = last.map_or(now, |last| now.max(last + 1));
        let inserted = conn.execute(
            "INSERT INTO agent_specs (name, digest, content, created_at_ms, seen_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?4)
             ON CONFLICT(name, digest) DO NOTHING",
            params![name, digest, content, seen],
        )?;
        if inserted == 0 {
            conn.execute(
                "UPDATE agent_specs SET seen_at_ms = ?3 WHERE name = ?1 AND digest = ?2",
                params![name, digest, seen],
            )?;
        }
        Ok(inserted > 0)
    }

    /// Every version of `name`, newest seen first (the first is current).
    pub fn agent_spec_versions(&self, name: &str) -> Result<Vec<AgentSpecRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM agent_specs WHERE name = ?1 ORDER BY seen_at_ms DESC"
        ))?;
        let rows = stmt
            .query_map(params![name], row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// The current version of every named spec, by name.
    pub fn agent_specs(&self) -> Result<Vec<AgentSpecRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM agent_specs a WHERE seen_at_ms =
                 (SELECT MAX(seen_at_ms) FROM agent_specs b WHERE b.name = a.name)
             ORDER BY name"
        ))?;
        let rows = stmt
            .query_map([], row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Pins a session to a spec version: at creation, or again at a turn boundary (the
    /// version it had is replaced).
    pub fn pin_session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
        name: &str,
        digest: &str,
    ) -> Result<()> {
        pin_in(&self.conn(), scope, session, name, digest)
    }

    /// The spec version a session runs with: `(name, digest)`, or `None` for none.
    pub fn session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<Option<(String, String)>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT name, digest FROM session_agents
                 WHERE session_id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                params![session.as_str(), scope.owner_id, scope.tenant_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// Records a chat event id; `false` when it was seen before (a replay). Ids older than
    /// `forget_before_ms` are dropped first: a stale request is refused by its timestamp.
    pub fn ingress_event_first_seen(&self, event_id: &str, forget_before_ms: i64) -> Result<bool> {
        let conn = self.conn();
        conn.execute(
            "DELETE FROM ingress_events WHERE seen_at_ms < ?1",
            params![forget_before_ms],
        )?;
        let inserted = conn.execute(
            "INSERT INTO ingress_events (event_id, seen_at_ms) VALUES (?1, ?2)
             ON CONFLICT(event_id) DO NOTHING",
            params![event_id, now_ms()],
        )?;
        Ok(inserted > 0)
    }

    /// The session a chat thread started, with the scope it belongs to.
    pub fn ingress_thread(
        &self,
        channel: &str,
        thread_ts: &str,
    ) -> Result<Option<(Scope, SessionId)>> {
        let found: Option<(String, String, String)> = self
            .conn()
            .query_row(
                "SELECT owner_id, tenant_id, session_id FROM ingress_threads
                 WHERE channel = ?1 AND thread_ts = ?2",
                params![channel, thread_ts],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        match found {
            None => Ok(None),
            Some((owner, tenant, session)) => {
                let id = SessionId::parse(&session).ok_or_else(|| crate::Error::Corrupt {
                    what: "ingress_threads.session_id",
                    detail: session.clone(),
                })?;
                Ok(Some((Scope::new(owner, tenant), id)))
            }
        }
    }

    /// Records the session a chat thread started.
    pub fn put_ingress_thread(
        &self,
        scope: &Scope,
        channel: &str,
        thread_ts: &str,
        session: &SessionId,
    ) -> Result<()> {
        self.conn().execute(
            "INSERT INTO ingress_threads (channel, thread_ts, owner_id, tenant_id, session_id)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                channel,
                thread_ts,
                scope.owner_id,
                scope.tenant_id,
                session.as_str()
            ],
        )?;
        Ok(())
    }
}

/// Pins `session` to a spec version on `conn` (inside the caller's transaction, if any).
pub(crate) fn pin_in(
    conn: &rusqlite::Connection,
    scope: &Scope,
    session: &SessionId,
    name: &str,
    digest: &str,
) -> Result<()> {
    conn.execute(
        "INSERT INTO session_agents (session_id, owner_id, tenant_id, name, digest)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (session_id) DO UPDATE SET name = excluded.name, digest = excluded.digest
         WHERE session_agents.owner_id = excluded.owner_id
           AND session_agents.tenant_id = excluded.tenant_id",
        params![
            session.as_str(),
            scope.owner_id,
            scope.tenant_id,
            name,
            digest
        ],
    )?;
    Ok(())
}
