//! The gateway's views across sessions on PostgreSQL: the session list a page at a time (one
//! query: each session with its placement, newest run and agent pin by joins, never a lookup
//! per session), whose row an id names, the operator's gauges and readiness; and the audit
//! listener's registration (`pg/audit.rs` tells it).

use super::placements::placement_at;
use super::runs::run_at;
use super::sessions::session_at;
use super::{PgStore, count};
use crate::aggregates::Overview;
use crate::listing::{count as columns, qualified};
use crate::metrics::{EgressTotals, Gauges};
use crate::{Error, Owned, Result, Scope, SessionListRow, Sight, placements, runs, sessions};
use skiff_protocol::SessionId;

/// The page after the `$4`/`$5` mark (`updated_at_ms`, id; none for the first page). Ids
/// compare bytewise (`COLLATE "C"`), as on SQLite, whatever the database's collation. The
/// page's sessions are picked first (an index walk in list order from the mark:
/// `sessions_by_tenant`, or `sessions_by_scope`), then joined with their placement and newest
/// run, so only the page's rows are joined however many sessions the sight has; the `<=`
/// bound repeats the mark so the walk can start there.
fn page_sql() -> String {
    format!(
        "SELECT {s}, {p}, {r}, a.name, a.digest FROM \
           (SELECT * FROM sessions s WHERE s.tenant_id = $2 AND (s.owner_id = $1 OR $3) \
              AND s.updated_at_ms <= COALESCE($4::BIGINT, 9223372036854775807) \
              AND ($4::BIGINT IS NULL OR s.updated_at_ms < $4 \
                   OR (s.updated_at_ms = $4 AND s.id COLLATE \"C\" > $5::TEXT)) \
            ORDER BY s.updated_at_ms DESC, s.id COLLATE \"C\" LIMIT $6) s \
         LEFT JOIN placements p ON p.session_id = s.id \
         LEFT JOIN LATERAL (SELECT {runs} FROM runs WHERE runs.session_id = s.id \
                            ORDER BY created_at_ms DESC, ord DESC LIMIT 1) r ON TRUE \
         LEFT JOIN session_agents a ON a.session_id = s.id AND a.owner_id = s.owner_id \
                                   AND a.tenant_id = s.tenant_id \
         ORDER BY s.updated_at_ms DESC, s.id COLLATE \"C\"",
        s = qualified("s", sessions::COLUMNS),
        p = qualified("p", placements::COLUMNS),
        r = qualified("r", runs::COLUMNS),
        runs = runs::COLUMNS,
    )
}

fn total(what: &'static str, row: &postgres::Row, idx: usize) -> Result<u64> {
    count(what, row.try_get(idx)?)
}

impl Overview for PgStore {
    fn session_page(
        &self,
        sight: &Sight,
        limit: usize,
        after: Option<&SessionId>,
    ) -> Result<Vec<SessionListRow>> {
        let (scope, wide) = (sight.scope.clone(), sight.tenant_wide());
        let after = after.map(ToString::to_string);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.conn.run(move |conn| {
            let mark: Option<i64> = match &after {
                None => None,
                Some(id) => Some(
                    conn.client
                        .query_opt(
                            "SELECT updated_at_ms FROM sessions \
                             WHERE id = $1 AND tenant_id = $3 AND (owner_id = $2 OR $4)",
                            &[id, &scope.owner_id, &scope.tenant_id, &wide],
                        )?
                        .ok_or_else(|| Error::NotFound {
                            what: "session",
                            id: id.clone(),
                        })?
                        .try_get(0)?,
                ),
            };
            let at_placement = columns(sessions::COLUMNS);
            let at_run = at_placement + columns(placements::COLUMNS);
            let at_agent = at_run + columns(runs::COLUMNS);
            conn.client
                .query(
                    page_sql().as_str(),
                    &[
                        &scope.owner_id,
                        &scope.tenant_id,
                        &wide,
                        &mark,
                        &after,
                        &limit,
                    ],
                )?
                .iter()
                .map(|row| {
                    // A LEFT JOIN that found nothing gives NULL in the key column.
                    let placement = match row.try_get::<_, Option<&str>>(at_placement)? {
                        Some(_) => Some(placement_at(row, at_placement)?),
                        None => None,
                    };
                    let last_run = match row.try_get::<_, Option<&str>>(at_run)? {
                        Some(_) => Some(run_at(row, at_run)?),
                        None => None,
                    };
                    let agent = match row.try_get::<_, Option<String>>(at_agent)? {
                        Some(name) => Some((name, row.try_get(at_agent + 1)?)),
                        None => None,
                    };
                    Ok(SessionListRow {
                        session: session_at(row, 0)?,
                        placement,
                        last_run,
                        agent,
                    })
                })
                .collect()
        })
    }

    fn owner_of(&self, sight: &Sight, kind: Owned, id: &str) -> Result<Option<Scope>> {
        let (scope, wide, id) = (sight.scope.clone(), sight.tenant_wide(), id.to_owned());
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!(
                        "SELECT owner_id, tenant_id FROM {} \
                         WHERE id = $1 AND tenant_id = $3 AND (owner_id = $2 OR $4)",
                        kind.table()
                    ),
                    &[&id, &scope.owner_id, &scope.tenant_id, &wide],
                )?
                .map(|row| {
                    Ok(Scope::new(
                        row.try_get::<_, String>(0)?,
                        row.try_get::<_, String>(1)?,
                    ))
                })
                .transpose()
        })
    }

    fn gauges(&self) -> Result<Gauges> {
        self.conn.run(|conn| {
            // One snapshot for every count: the figures add up as of one moment.
            let mut tx = conn
                .client
                .build_transaction()
                .isolation_level(postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()?;
            let mut pairs = |sql: &str| -> Result<Vec<(String, u64)>> {
                tx.query(sql, &[])?
                    .iter()
                    .map(|row| Ok((row.try_get(0)?, total("gauge", row, 1)?)))
                    .collect()
            };
            let sessions = pairs(
                "SELECT COALESCE(p.state, 'local'), COUNT(*) FROM sessions s \
                 LEFT JOIN placements p ON p.session_id = s.id GROUP BY 1 ORDER BY 1",
            )?;
            let runs = pairs("SELECT status, COUNT(*) FROM runs GROUP BY status ORDER BY status")?;
            let environments = tx
                .query(
                    "SELECT state, provider, COUNT(*) FROM environments \
                     GROUP BY state, provider ORDER BY state, provider",
                    &[],
                )?
                .iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, total("gauge", row, 2)?)))
                .collect::<Result<Vec<_>>>()?;
            let row = tx.query_one(
                "SELECT COALESCE(SUM(model_requests), 0)::BIGINT, \
                 COALESCE(SUM(input_tokens), 0)::BIGINT, COALESCE(SUM(output_tokens), 0)::BIGINT, \
                 COALESCE(SUM(bytes_in), 0)::BIGINT, COALESCE(SUM(bytes_out), 0)::BIGINT, \
                 COALESCE(SUM(gateway_tool_calls), 0)::BIGINT FROM environments",
                &[],
            )?;
            let egress = EgressTotals {
                model_requests: total("egress", &row, 0)?,
                input_tokens: total("egress", &row, 1)?,
                output_tokens: total("egress", &row, 2)?,
                bytes_in: total("egress", &row, 3)?,
                bytes_out: total("egress", &row, 4)?,
                gateway_tool_calls: total("egress", &row, 5)?,
            };
            tx.commit()?;
            Ok(Gauges {
                sessions,
                runs,
                environments,
                egress,
            })
        })
    }

    /// An error at once, not after a wait, while the server is down (`retry` reconnects).
    fn ready(&self) -> Result<()> {
        self.conn.retry(|conn| {
            conn.client.query_one(
                "SELECT (SELECT COUNT(*) FROM sessions WHERE FALSE) \
                 + (SELECT COUNT(*) FROM runs WHERE FALSE)",
                &[],
            )?;
            Ok(())
        })
    }

    fn on_audit(&self, listener: Box<dyn Fn(i64) + Send + Sync>) -> bool {
        self.audit_listener.set(listener).is_ok()
    }
}
