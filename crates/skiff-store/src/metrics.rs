//! Counts for the gateway's `/metrics` and its readiness check: the whole gateway's, across
//! scopes (an operator's view), labelled only with values the store itself writes (states,
//! statuses, provider kinds) — never an id, a title or a path.

use crate::{Result, Store};

/// What `/metrics` reports of the database, read in one transaction.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gauges {
    /// Sessions by placement state (`local` for one never placed on a box).
    pub sessions: Vec<(String, u64)>,
    /// Runs by status.
    pub runs: Vec<(String, u64)>,
    /// Environments by (state, provider).
    pub environments: Vec<(String, String, u64)>,
    /// Everything that went through the gateway for boxes, over every environment.
    pub egress: EgressTotals,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct EgressTotals {
    pub model_requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub gateway_tool_calls: u64,
}

impl Store {
    /// The gauges, across every scope.
    pub fn gauges(&self) -> Result<Gauges> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let pairs = |sql: &str| -> Result<Vec<(String, u64)>> {
            let mut stmt = tx.prepare(sql)?;
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, u64>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        };
        let sessions = pairs(
            "SELECT COALESCE(p.state, 'local'), COUNT(*) FROM sessions s \
             LEFT JOIN placements p ON p.session_id = s.id GROUP BY 1 ORDER BY 1",
        )?;
        let runs = pairs("SELECT status, COUNT(*) FROM runs GROUP BY status ORDER BY status")?;
        let environments = {
            let mut stmt = tx.prepare(
                "SELECT state, provider, COUNT(*) FROM environments \
                 GROUP BY state, provider ORDER BY state, provider",
            )?;
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, u64>(2)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        let egress = tx.query_row(
            "SELECT COALESCE(SUM(model_requests), 0), COALESCE(SUM(input_tokens), 0), \
             COALESCE(SUM(output_tokens), 0), COALESCE(SUM(bytes_in), 0), \
             COALESCE(SUM(bytes_out), 0), COALESCE(SUM(gateway_tool_calls), 0) FROM environments",
            [],
            |r| {
                Ok(EgressTotals {
                    model_requests: r.get(0)?,
                    input_tokens: r.get(1)?,
                    output_tokens: r.get(2)?,
                    bytes_in: r.get(3)?,
                    bytes_out: r.get(4)?,
                    gateway_tool_calls: r.get(5)?,
                })
            },
        )?;
        Ok(Gauges {
            sessions,
            runs,
            environments,
            egress,
        })
    }

    /// Whether the database answers a read of the tables every request needs.
    pub fn ready(&self) -> Result<()> {
        self.conn().query_row(
            "SELECT (SELECT COUNT(*) FROM sessions WHERE 0) + (SELECT COUNT(*) FROM runs WHERE 0)",
            [],
            |_| Ok(()),
        )?;
        Ok(())
    }
}
