//! The session list: each session with its placement and its newest run, in one query and a
//! page at a time, most recently active first.

use crate::error::{Error, Result};
use crate::{PlacementRow, RunRow, Scope, SessionRow, Store, placements, runs, sessions};
use rusqlite::params;
use skiff_protocol::SessionId;

/// One line of the session list.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionListRow {
    pub session: SessionRow,
    pub placement: Option<PlacementRow>,
    pub last_run: Option<RunRow>,
}

/// `a, b, c` as `t.a, t.b, t.c`, for a join whose tables share column names.
fn qualified(table: &str, columns: &str) -> String {
    columns
        .split(',')
        .map(|c| format!("{table}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn count(columns: &str) -> usize {
    columns.split(',').count()
}

impl Store {
    /// At most `limit` sessions of `scope`, most recently active first (ties by id), starting
    /// after session `after` — the last one of the previous page — when given.
    ///
    /// A session that becomes active while someone pages moves to the top: pages are a view
    /// of the moment each is read, and the live change stream tells about the rest.
    pub fn session_page(
        &self,
        scope: &Scope,
        limit: usize,
        after: Option<&SessionId>,
    ) -> Result<Vec<SessionListRow>> {
        let conn = self.conn();
        let mark = match after {
            None => None,
            Some(id) => Some(
                conn.query_row(
                    "SELECT updated_at_ms FROM sessions WHERE id = ?1 AND owner_id = ?2 AND tenant_id = ?3",
                    params![id.as_str(), scope.owner_id, scope.tenant_id],
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
        let sql = format!(
            "SELECT {s}, {p}, {r} FROM sessions s \
             LEFT JOIN placements p ON p.session_id = s.id \
             LEFT JOIN runs r ON r.rowid = (SELECT rowid FROM runs WHERE session_id = s.id \
                                            ORDER BY created_at_ms DESC, rowid DESC LIMIT 1) \
             WHERE s.owner_id = ?1 AND s.tenant_id = ?2 \
               AND (?3 IS NULL OR s.updated_at_ms < ?3 OR (s.updated_at_ms = ?3 AND s.id > ?4)) \
             ORDER BY s.updated_at_ms DESC, s.id LIMIT ?5",
            s = qualified("s", sessions::COLUMNS),
            p = qualified("p", placements::COLUMNS),
            r = qualified("r", runs::COLUMNS),
        );
        let at_placement = count(sessions::COLUMNS);
        let at_run = at_placement + count(placements::COLUMNS);
        let mut stmt = conn.prepare_cached(&sql)?;
        let rows = stmt
            .query_map(
                params![
                    scope.owner_id,
                    scope.tenant_id,
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
                    Ok(SessionListRow {
                        session: sessions::from_row_at(row, 0)?,
                        placement,
                        last_run,
                    })
                },
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }
}
