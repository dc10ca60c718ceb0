//! The session list: each session with its placement, its newest run and its agent pin, in
//! one query and a page at a time, most recently active first.

use crate::error::{Error, Result};
use crate::sight::seen;
use crate::{PlacementRow, RunRow, SessionRow, Sight, Store, placements, runs, sessions};
use rusqlite::params;
use skiff_protocol::SessionId;

/// One line of the session list.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionListRow {
    pub session: SessionRow,
    pub placement: Option<PlacementRow>,
    pub last_run: Option<RunRow>,
    /// The agent spec version the session is pinned to (name, digest), if any.
    pub agent: Option<(String, String)>,
}

/// `a, b, c` as `t.a, t.b, t.c`, for a join whose tables share column names.
pub(crate) fn qualified(table: &str, columns: &str) -> String {
    columns
        .split(',')
        .map(|c| format!("{table}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn count(columns: &str) -> usize {
    columns.split(',').count()
}

impl Store {
    /// At most `limit` sessions the sight sees, most recently active first (ties by id), starting
    /// after session `after` — the last one of the previous page — when given.
    ///
    /// A session that becomes active while someone pages moves to the top: pages are a view
    /// of the moment each is read, and the live change stream tells about the rest.
    pub fn session_page(
        &self,
        sight: &Sight,
        limit: usize,
        after: Option<&SessionId>,
    ) -> Result<Vec<SessionListRow>> {
        let conn = self.conn();
        let mark = match after {
            None => None,
            Some(id) => Some(
                conn.query_row(
                    &format!(
                        "SELECT updated_at_ms FROM sessions WHERE id = ?1 AND {}",
                        seen("", 2)
                    ),
                    params![
                        id.as_str(),
                        sight.scope.owner_id,
                        sight.scope.tenant_id,
                        sight.tenant_wide()
                    ],
                    |r| r.get::<_, i64>(0),
                )
                .map_err(|e| match e {
                    rusqlite::Error::QueryReturnedNoRows => Error::NotFound {
                        what: "session",
                        id: id.to_string(),
                    },
                    other => other.into(),
                })?,
            ),
        };
        // The page's sessions first (an index walk in list order from the mark:
        // `sessions_by_tenant`, or `sessions_by_scope`), then each one's placement and newest
        // run: only the page's rows are joined, however many sessions the sight has. The
        // `<=` bound repeats the mark so the walk can start there.
        let sql = format!(
            "SELECT {s}, {p}, {r}, a.name, a.digest FROM \
               (SELECT * FROM sessions s WHERE {seen} \
                  AND s.updated_at_ms <= COALESCE(?4, 9223372036854775807) \
                  AND (?4 IS NULL OR s.updated_at_ms < ?4 \
                       OR (s.updated_at_ms = ?4 AND s.id > ?5)) \
                ORDER BY s.updated_at_ms DESC, s.id LIMIT ?6) s \
             LEFT JOIN placements p ON p.session_id = s.id \
             LEFT JOIN runs r ON r.rowid = (SELECT rowid FROM runs WHERE session_id = s.id \
                                            ORDER BY created_at_ms DESC, rowid DESC LIMIT 1) \
             LEFT JOIN session_agents a ON a.session_id = s.id AND a.owner_id = s.owner_id \
                                       AND a.tenant_id = s.tenant_id \
             ORDER BY s.updated_at_ms DESC, s.id",
            seen = seen("s", 1),
            s = qualified("s", sessions::COLUMNS),
            p = qualified("p", placements::COLUMNS),
            r = qualified("r", runs::COLUMNS),
        );
        let at_placement = count(sessions::COLUMNS);
        let at_run = at_placement + count(placements::COLUMNS);
        let at_agent = at_run + count(runs::COLUMNS);
        let mut stmt = conn.prepare_cached(&sql)?;
        let rows = stmt
            .query_map(
                params![
                    sight.scope.owner_id,
                    sight.scope.tenant_id,
                    sight.tenant_wide(),
                    mark,
                    after.map(SessionId::as_str),
                    i64::try_from(limit).unwrap_or(i64::MAX),
                ],
                |row| {
                    // A LEFT JOIN that found nothing gives NULL in the key column.
                    let placement = match row.get::<_, Option<String>>(at_placement)? {
                        Some(_) => Some(placements::from_row_at(row, at_placement)?),
                        None => None,
                    };
                    let last_run = match row.get::<_, Option<String>>(at_run)? {
                        Some(_) => Some(runs::from_row_at(row, at_run)?),
                        None => None,
                    };
                    let agent = match row.get::<_, Option<String>>(at_agent)? {
                        Some(name) => Some((name, row.get(at_agent + 1)?)),
                        None => None,
                    };
                    Ok(SessionListRow {
                        session: sessions::from_row_at(row, 0)?,
                        placement,
                        last_run,
                        agent,
                    })
                },
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }
}
