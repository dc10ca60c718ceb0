//! Agent spec versions, session pins and the chat ingress's rows on PostgreSQL.

use super::{PgStore, id};
use crate::aggregates::AgentSpecs;
use crate::{AgentSpecRow, Result, Scope, now_ms};
use postgres::Row;
use skiff_protocol::SessionId;

const COLUMNS: &str = "name, digest, content, created_at_ms, seen_at_ms";

fn spec_from(row: &Row) -> Result<AgentSpecRow> {
    Ok(AgentSpecRow {
        name: row.try_get(0)?,
        digest: row.try_get(1)?,
        content: row.try_get(2)?,
        created_at_ms: row.try_get(3)?,
        seen_at_ms: row.try_get(4)?,
    })
}

impl AgentSpecs for PgStore {
    fn put_agent_spec(&self, name: &str, digest: &str, content: &str) -> Result<bool> {
        let (name, digest, content) = (name.to_owned(), digest.to_owned(), content.to_owned());
        let now = now_ms();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            // Gateways starting at once with the same configuration: one name's versions are
            // marked one gateway at a time, so "seen strictly after every other" holds.
            tx.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('skiff agent spec ' || $1, 0))",
                &[&name],
            )?;
            let newest = tx.query_opt(
                "SELECT digest, seen_at_ms FROM agent_specs WHERE name = $1 \
                 ORDER BY seen_at_ms DESC LIMIT 1",
                &[&name],
            )?;
            let last = match &newest {
                Some(row) if row.try_get::<_, &str>(0)? == digest => return Ok(false),
                Some(row) => Some(row.try_get::<_, i64>(1)?),
                None => None,
            };
            let seen = last.map_or(now, |last| now.max(last + 1));
            let inserted = tx.execute(
                "INSERT INTO agent_specs (name, digest, content, created_at_ms, seen_at_ms) \
                 VALUES ($1, $2, $3, $4, $4) ON CONFLICT (name, digest) DO NOTHING",
                &[&name, &digest, &content, &seen],
            )?;
            if inserted == 0 {
                tx.execute(
                    "UPDATE agent_specs SET seen_at_ms = $3 WHERE name = $1 AND digest = $2",
                    &[&name, &digest, &seen],
                )?;
            }
            tx.commit()?;
            Ok(inserted > 0)
        })
    }

    fn agent_spec_versions(&self, name: &str) -> Result<Vec<AgentSpecRow>> {
        let name = name.to_owned();
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM agent_specs WHERE name = $1 \
                         ORDER BY seen_at_ms DESC"
                    ),
                    &[&name],
                )?
                .iter()
                .map(spec_from)
                .collect()
        })
    }

    fn agent_specs(&self) -> Result<Vec<AgentSpecRow>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM agent_specs a WHERE seen_at_ms = \
                         (SELECT MAX(seen_at_ms) FROM agent_specs b WHERE b.name = a.name) \
                         ORDER BY name COLLATE \"C\""
                    ),
                    &[],
                )?
                .iter()
                .map(spec_from)
                .collect()
        })
    }

    fn pin_session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
        name: &str,
        digest: &str,
    ) -> Result<()> {
        let args = (
            scope.clone(),
            session.to_string(),
            name.to_owned(),
            digest.to_owned(),
        );
        self.conn.run(move |conn| {
            let (scope, session, name, digest) = args;
            conn.client.execute(
                "INSERT INTO session_agents (session_id, owner_id, tenant_id, name, digest) \
                 VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (session_id) DO UPDATE SET name = excluded.name, \
                 digest = excluded.digest \
                 WHERE session_agents.owner_id = excluded.owner_id \
                   AND session_agents.tenant_id = excluded.tenant_id",
                &[&session, &scope.owner_id, &scope.tenant_id, &name, &digest],
            )?;
            Ok(())
        })
    }

    fn session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<Option<(String, String)>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    "SELECT name, digest FROM session_agents \
                     WHERE session_id = $1 AND owner_id = $2 AND tenant_id = $3",
                    &[&session, &scope.owner_id, &scope.tenant_id],
                )?
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .transpose()
        })
    }

    fn ingress_event_first_seen(&self, event_id: &str, forget_before_ms: i64) -> Result<bool> {
        let event_id = event_id.to_owned();
        let now = now_ms();
        self.conn.run(move |conn| {
            conn.client.execute(
                "DELETE FROM ingress_events WHERE seen_at_ms < $1",
                &[&forget_before_ms],
            )?;
            let inserted = conn.client.execute(
                "INSERT INTO ingress_events (event_id, seen_at_ms) VALUES ($1, $2) \
                 ON CONFLICT (event_id) DO NOTHING",
                &[&event_id, &now],
            )?;
            Ok(inserted > 0)
        })
    }

    fn ingress_thread(&self, channel: &str, thread_ts: &str) -> Result<Option<(Scope, SessionId)>> {
        let (channel, thread_ts) = (channel.to_owned(), thread_ts.to_owned());
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    "SELECT owner_id, tenant_id, session_id FROM ingress_threads \
                     WHERE channel = $1 AND thread_ts = $2",
                    &[&channel, &thread_ts],
                )?
                .map(|row| {
                    Ok((
                        Scope::new(row.try_get::<_, String>(0)?, row.try_get::<_, String>(1)?),
                        id(
                            "ingress_threads.session_id",
                            row.try_get(2)?,
                            SessionId::parse,
                        )?,
                    ))
                })
                .transpose()
        })
    }

    fn put_ingress_thread(
        &self,
        scope: &Scope,
        channel: &str,
        thread_ts: &str,
        session: &SessionId,
    ) -> Result<()> {
        let args = (
            scope.clone(),
            channel.to_owned(),
            thread_ts.to_owned(),
            session.to_string(),
        );
        self.conn.run(move |conn| {
            let (scope, channel, thread_ts, session) = args;
            conn.client.execute(
                "INSERT INTO ingress_threads (channel, thread_ts, owner_id, tenant_id, session_id) \
                 VALUES ($1, $2, $3, $4, $5)",
                &[
                    &channel,
                    &thread_ts,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &session,
                ],
            )?;
            Ok(())
        })
    }
}
