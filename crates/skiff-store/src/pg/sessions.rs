//! Sessions and the transcript tree on PostgreSQL.

use super::{PgStore, id, json, optional_id};
use crate::aggregates::SessionStore;
use crate::sessions::COLUMNS;
use crate::{Error, NewSession, Result, Scope, SessionRow, mint, now_ms, to_json};
use postgres::Row;
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{EntryId, GroupId, RunId, SessionId};

fn session_from(row: &Row) -> Result<SessionRow> {
    session_at(row, 0)
}

/// [`session_from`] for a row whose columns start at `o` (a join's).
pub(super) fn session_at(row: &Row, o: usize) -> Result<SessionRow> {
    Ok(SessionRow {
        id: id("session", row.try_get(o)?, SessionId::parse)?,
        title: row.try_get(o + 1)?,
        workspace: json("session workspace", row.try_get(o + 2)?)?,
        model_ref: row.try_get(o + 3)?,
        placement: row.try_get(o + 4)?,
        lifecycle_revision: row.try_get(o + 5)?,
        leaf_entry_id: row.try_get(o + 6)?,
        created_at_ms: row.try_get(o + 7)?,
        updated_at_ms: row.try_get(o + 8)?,
        parent_id: optional_id("session parent", row.try_get(o + 9)?, SessionId::parse)?,
        reasoning: row.try_get(o + 10)?,
        group_id: optional_id("session group", row.try_get(o + 11)?, GroupId::parse)?,
        approval: row
            .try_get::<_, Option<&str>>(o + 12)?
            .map(|text| json("approval policy", text))
            .transpose()?,
        owner: Scope::new(
            row.try_get::<_, String>(o + 13)?,
            row.try_get::<_, String>(o + 14)?,
        ),
    })
}

/// `SELECT {COLUMNS} … WHERE id …` spelled out: a cached statement's text is `&'static str`.
const BY_ID: &str = "SELECT id, title, workspace, model_ref, placement, lifecycle_revision, \
     leaf_entry_id, created_at_ms, updated_at_ms, parent_id, reasoning, group_id, approval, \
     owner_id, tenant_id FROM sessions WHERE id = $1 AND owner_id = $2 AND tenant_id = $3";

fn session_in(conn: &mut super::conn::PgConn, scope: &Scope, session: &str) -> Result<SessionRow> {
    let by_id = conn.statement(BY_ID)?;
    let row = conn
        .client
        .query_opt(&by_id, &[&session, &scope.owner_id, &scope.tenant_id])?
        .ok_or_else(|| Error::NotFound {
            what: "session",
            id: session.to_string(),
        })?;
    session_from(&row)
}

/// The transcript append in one statement (one round trip, atomic without a transaction):
/// the compare-and-swap of the leaf — the update locks the session's row, and an append that
/// committed first makes it match nothing — and, only if it swapped, the chain's rows, which
/// `UNNEST` turns back from columns. It answers one row when it appended, none when not.
const APPEND: &str = "WITH swapped AS (
        UPDATE sessions SET leaf_entry_id = $1, updated_at_ms = $2
         WHERE id = $3 AND owner_id = $4 AND tenant_id = $5
           AND leaf_entry_id IS NOT DISTINCT FROM $6
        RETURNING id
    ), chain AS (
        INSERT INTO entries (id, session_id, owner_id, tenant_id, parent_id, run_id, kind, body,
                             created_at_ms)
        SELECT c.id, $3, $4, $5, c.parent_id, $7, c.kind, c.body, $2
          FROM swapped, UNNEST($8::text[], $9::text[], $10::text[], $11::text[])
               AS c(id, parent_id, kind, body)
    )
    SELECT 1 FROM swapped";

/// [`APPEND`] fenced (issue 17), still one statement: the swap happens only while the session
/// lease is held by `$12` at epoch `$13`, read under a share lock on the lease row, so a
/// takeover (which updates that row) waits for this append to commit — and a takeover that
/// committed first makes the fence match nothing, so nothing is written.
const APPEND_FENCED: &str = "WITH fence AS (
        SELECT 1 FROM leases
         WHERE kind = 'session' AND name = $3 AND holder = $12 AND epoch = $13
        FOR SHARE
    ), swapped AS (
        UPDATE sessions SET leaf_entry_id = $1, updated_at_ms = $2
          FROM fence
         WHERE id = $3 AND owner_id = $4 AND tenant_id = $5
           AND leaf_entry_id IS NOT DISTINCT FROM $6
        RETURNING id
    ), chain AS (
        INSERT INTO entries (id, session_id, owner_id, tenant_id, parent_id, run_id, kind, body,
                             created_at_ms)
        SELECT c.id, $3, $4, $5, c.parent_id, $7, c.kind, c.body, $2
          FROM swapped, UNNEST($8::text[], $9::text[], $10::text[], $11::text[])
               AS c(id, parent_id, kind, body)
    )
    SELECT 1 FROM swapped";

impl PgStore {
    /// The append, fenced when `fence` says so (`Leases::append_entries_fenced`).
    pub(super) fn append_entries_with(
        &self,
        fence: Option<&crate::Fence>,
        scope: &Scope,
        session: &SessionId,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>> {
        let now = now_ms();
        // The chain, ids minted here: each entry's parent is the one before, the first's the
        // base leaf.
        let mut parent = base_leaf.cloned();
        let mut committed = Vec::with_capacity(bodies.len());
        for body in bodies {
            let id = EntryId::from_suffix(&mint()?);
            committed.push(TranscriptEntry {
                id: id.clone(),
                parent_id: parent.replace(id),
                run_id: run.cloned(),
                created_at_ms: now,
                body: body.clone(),
            });
        }
        let rows = Chain {
            ids: committed.iter().map(|e| e.id.to_string()).collect(),
            parents: committed
                .iter()
                .map(|e| e.parent_id.as_ref().map(ToString::to_string))
                .collect(),
            kinds: bodies.iter().map(|b| b.kind().to_string()).collect(),
            bodies: bodies
                .iter()
                .map(|b| to_json("transcript entry", b))
                .collect::<Result<_>>()?,
        };
        let args = (
            scope.clone(),
            session.to_string(),
            base_leaf.map(ToString::to_string),
            parent.map(|leaf| leaf.to_string()),
            run.map(ToString::to_string),
        );
        let fence = fence.cloned();
        self.conn.run(move |conn| {
            let (scope, session, base, leaf, run) = args;
            let params: [&(dyn postgres::types::ToSql + Sync); 11] = [
                &leaf,
                &now,
                &session,
                &scope.owner_id,
                &scope.tenant_id,
                &base,
                &run,
                &rows.ids,
                &rows.parents,
                &rows.kinds,
                &rows.bodies,
            ];
            let appended = match &fence {
                None => {
                    let append = conn.statement(APPEND)?;
                    conn.client.query_opt(&append, &params)?
                }
                Some(fence) => {
                    let append = conn.statement(APPEND_FENCED)?;
                    let (gateway, epoch) = (fence.gateway.as_str(), fence.epoch);
                    let mut fenced = params.to_vec();
                    fenced.extend::<[&(dyn postgres::types::ToSql + Sync); 2]>([&gateway, &epoch]);
                    conn.client.query_opt(&append, &fenced)?
                }
            };
            if appended.is_some() {
                return Ok(());
            }
            // Nothing was written: say why — the fence first, as when it was checked first.
            if let Some(fence) = &fence {
                super::leases::check_fence(&mut conn.client, fence)?;
            }
            let actual = conn.client.query_opt(
                "SELECT leaf_entry_id FROM sessions \
                 WHERE id = $1 AND owner_id = $2 AND tenant_id = $3",
                &[&session, &scope.owner_id, &scope.tenant_id],
            )?;
            Err(match actual {
                None => Error::NotFound {
                    what: "session",
                    id: session,
                },
                Some(row) => Error::LeafConflict {
                    session,
                    expected: base.unwrap_or_else(|| "(empty)".into()),
                    actual: row
                        .try_get::<_, Option<String>>(0)?
                        .unwrap_or_else(|| "(empty)".into()),
                },
            })
        })?;
        Ok(committed)
    }
}

impl SessionStore for PgStore {
    fn create_session(&self, scope: &Scope, new: &NewSession) -> Result<SessionRow> {
        let workspace = to_json("session workspace", &new.workspace)?;
        let now = now_ms();
        let (scope, new) = (scope.clone(), new.clone());
        self.conn.run(move |conn| {
            let row = conn.client.query_one(
                &format!(
                    "INSERT INTO sessions (id, owner_id, tenant_id, title, workspace, model_ref, \
                     created_at_ms, updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
                     RETURNING {COLUMNS}"
                ),
                &[
                    &new.id.as_str(),
                    &scope.owner_id,
                    &scope.tenant_id,
                    &new.title,
                    &workspace,
                    &new.model_ref,
                    &now,
                ],
            )?;
            session_from(&row)
        })
    }

    fn session(&self, scope: &Scope, id: &SessionId) -> Result<SessionRow> {
        let (scope, id) = (scope.clone(), id.to_string());
        self.conn.retry(move |conn| session_in(conn, &scope, &id))
    }

    fn sessions(&self, scope: &Scope) -> Result<Vec<SessionRow>> {
        let scope = scope.clone();
        self.conn.retry(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM sessions WHERE owner_id = $1 AND tenant_id = $2 \
                         ORDER BY updated_at_ms DESC, id"
                    ),
                    &[&scope.owner_id, &scope.tenant_id],
                )?
                .iter()
                .map(session_from)
                .collect()
        })
    }

    fn append_entries(
        &self,
        scope: &Scope,
        session: &SessionId,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>> {
        self.append_entries_with(None, scope, session, base_leaf, run, bodies)
    }

    fn leaf(&self, scope: &Scope, session: &SessionId) -> Result<Option<EntryId>> {
        Ok(self
            .session(scope, session)?
            .leaf_entry_id
            .and_then(|id| EntryId::parse(&id)))
    }

    fn transcript(&self, scope: &Scope, session: &SessionId) -> Result<Vec<TranscriptEntry>> {
        let (scope, session) = (scope.clone(), session.to_string());
        self.conn.retry(move |conn| {
            let path = conn.statement(
                "WITH RECURSIVE path(id, depth) AS (
                     SELECT leaf_entry_id, 0 FROM sessions
                      WHERE id = $1 AND owner_id = $2 AND tenant_id = $3
                        AND leaf_entry_id IS NOT NULL
                     UNION ALL
                     SELECT e.parent_id, p.depth + 1 FROM entries e JOIN path p ON e.id = p.id
                      WHERE e.parent_id IS NOT NULL
                 )
                 SELECT e.id, e.parent_id, e.run_id, e.created_at_ms, e.body
                   FROM path p JOIN entries e ON e.id = p.id
                  ORDER BY p.depth DESC",
            )?;
            conn.client
                .query(&path, &[&session, &scope.owner_id, &scope.tenant_id])?
                .iter()
                .map(|row| {
                    Ok(TranscriptEntry {
                        id: id("transcript entry", row.try_get(0)?, EntryId::parse)?,
                        parent_id: row.try_get::<_, Option<&str>>(1)?.and_then(EntryId::parse),
                        run_id: row.try_get::<_, Option<&str>>(2)?.and_then(RunId::parse),
                        created_at_ms: row.try_get(3)?,
                        body: json("transcript entry", row.try_get(4)?)?,
                    })
                })
                .collect()
        })
    }
}

/// A chain of entries as the columns `UNNEST` turns back into rows (one round trip however
/// long the chain).
struct Chain {
    ids: Vec<String>,
    parents: Vec<Option<String>>,
    kinds: Vec<String>,
    bodies: Vec<String>,
}
