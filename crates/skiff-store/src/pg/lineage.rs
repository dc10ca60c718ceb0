//! Sessions made from or with others on PostgreSQL: placed at creation, a parent's children,
//! forks and fan-out groups.
//!
//! Each is one transaction. Whatever claims a worker slot takes the slots' advisory lock
//! before any row lock (as every claim does), then counts: a group's sessions all fit or none
//! is written, and two dispatches of one parent's children are ordered by the parent's row
//! lock, so neither passes the children's cap on a count the other has not committed yet.

use super::PgStore;
use super::artifacts::insert_artifact;
use super::placements::{Claim, claim_in, lock_worker_slots, slots_in};
use super::sessions::session_at;
use crate::aggregates::Lineage;
use crate::sessions::COLUMNS;
use crate::{
    Error, GroupRow, NewArtifact, NewSession, Result, Scope, SessionRow, mint, now_ms, to_json,
};
use postgres::{Row, Transaction};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::transcript::TranscriptEntry;
use skiff_protocol::{EntryId, GroupId, SessionId};

/// Inserts `new`'s row, created at `at_ms`, a child of `parent` or an attempt of `group`.
fn insert_session(
    tx: &mut Transaction<'_>,
    scope: &Scope,
    new: &NewSession,
    at_ms: i64,
    parent: Option<&str>,
    group: Option<&str>,
) -> Result<()> {
    let workspace = to_json("session workspace", &new.workspace)?;
    tx.execute(
        "INSERT INTO sessions (id, owner_id, tenant_id, title, workspace, model_ref, \
         created_at_ms, updated_at_ms, parent_id, group_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8, $9)",
        &[
            &new.id.as_str(),
            &scope.owner_id,
            &scope.tenant_id,
            &new.title,
            &workspace,
            &new.model_ref,
            &at_ms,
            &parent,
            &group,
        ],
    )?;
    Ok(())
}

/// The session as the transaction sees it (its placement included).
fn session_in(tx: &mut Transaction<'_>, scope: &Scope, session: &SessionId) -> Result<SessionRow> {
    let row = tx
        .query_opt(
            &format!(
                "SELECT {COLUMNS} FROM sessions WHERE id = $1 AND owner_id = $2 AND tenant_id = $3"
            ),
            &[&session.as_str(), &scope.owner_id, &scope.tenant_id],
        )?
        .ok_or_else(|| Error::NotFound {
            what: "session",
            id: session.to_string(),
        })?;
    session_at(&row, 0)
}

fn sessions_where(
    client: &mut impl postgres::GenericClient,
    column: &'static str,
    scope: &Scope,
    value: &str,
) -> Result<Vec<SessionRow>> {
    client
        .query(
            &format!(
                "SELECT {COLUMNS} FROM sessions WHERE {column} = $1 AND owner_id = $2 \
                 AND tenant_id = $3 ORDER BY created_at_ms, ord"
            ),
            &[&value, &scope.owner_id, &scope.tenant_id],
        )?
        .iter()
        .map(|row| session_at(row, 0))
        .collect()
}

/// A worker slot for `session` on `profile`, of `max_live`.
fn request(scope: &Scope, session: &SessionId, profile: &str, max_live: u64) -> Claim {
    Claim {
        scope: scope.clone(),
        session: session.to_string(),
        profile: profile.to_owned(),
        max_live,
        to: PlacementState::Requested,
        open_run: None,
    }
}

fn group_from(row: &Row) -> Result<GroupRow> {
    Ok(GroupRow {
        id: super::id("group", row.try_get(0)?, GroupId::parse)?,
        title: row.try_get(1)?,
        picked: row
            .try_get::<_, Option<&str>>(2)?
            .and_then(SessionId::parse),
        picked_at_ms: row.try_get(3)?,
        created_at_ms: row.try_get(4)?,
    })
}

fn group_in(
    client: &mut impl postgres::GenericClient,
    scope: &Scope,
    group: &str,
) -> Result<GroupRow> {
    let row = client
        .query_opt(
            "SELECT id, title, picked_session_id, picked_at_ms, created_at_ms \
             FROM session_groups WHERE id = $1 AND owner_id = $2 AND tenant_id = $3",
            &[&group, &scope.owner_id, &scope.tenant_id],
        )?
        .ok_or_else(|| Error::NotFound {
            what: "group",
            id: group.to_owned(),
        })?;
    group_from(&row)
}

/// A fork's transcript as the columns `UNNEST` turns back into rows: a chain with new ids,
/// each entry keeping its run, body and time.
struct Copied {
    ids: Vec<String>,
    parents: Vec<Option<String>>,
    runs: Vec<Option<String>>,
    kinds: Vec<String>,
    bodies: Vec<String>,
    times: Vec<i64>,
}

impl Copied {
    fn of(entries: &[TranscriptEntry]) -> Result<Self> {
        let mut copied = Copied {
            ids: Vec::with_capacity(entries.len()),
            parents: Vec::with_capacity(entries.len()),
            runs: Vec::with_capacity(entries.len()),
            kinds: Vec::with_capacity(entries.len()),
            bodies: Vec::with_capacity(entries.len()),
            times: Vec::with_capacity(entries.len()),
        };
        for entry in entries {
            let id = EntryId::from_suffix(&mint()?).to_string();
            copied.parents.push(copied.ids.last().cloned());
            copied.ids.push(id);
            copied
                .runs
                .push(entry.run_id.as_ref().map(ToString::to_string));
            copied.kinds.push(entry.body.kind().to_string());
            copied
                .bodies
                .push(to_json("transcript entry", &entry.body)?);
            copied.times.push(entry.created_at_ms);
        }
        Ok(copied)
    }
}

impl Lineage for PgStore {
    fn create_session_placed(
        &self,
        scope: &Scope,
        new: &NewSession,
        placement: Option<(&str, u64)>,
    ) -> Result<SessionRow> {
        let (scope, new) = (scope.clone(), new.clone());
        let placement = placement.map(|(profile, max_live)| (profile.to_owned(), max_live));
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            if placement.is_some() {
                lock_worker_slots(&mut tx)?;
            }
            insert_session(&mut tx, &scope, &new, now_ms(), None, None)?;
            if let Some((profile, max_live)) = placement {
                claim_in(&mut tx, request(&scope, &new.id, &profile, max_live))?;
            }
            let row = session_in(&mut tx, &scope, &new.id)?;
            tx.commit()?;
            Ok(row)
        })
    }

    fn create_child_session(
        &self,
        scope: &Scope,
        new: &NewSession,
        parent: &SessionId,
        (profile, max_live): (&str, u64),
        max_children: u64,
    ) -> Result<SessionRow> {
        let (scope, new, parent, profile) = (
            scope.clone(),
            new.clone(),
            parent.to_string(),
            profile.to_owned(),
        );
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            lock_worker_slots(&mut tx)?;
            // Dispatches from one parent, one at a time: each counts what the one before
            // committed.
            tx.execute(
                "SELECT 1 FROM sessions WHERE id = $1 AND owner_id = $2 AND tenant_id = $3 \
                 FOR UPDATE",
                &[&parent, &scope.owner_id, &scope.tenant_id],
            )?;
            let started: i64 = tx
                .query_one(
                    "SELECT COUNT(*) FROM sessions WHERE parent_id = $1 AND owner_id = $2 \
                     AND tenant_id = $3",
                    &[&parent, &scope.owner_id, &scope.tenant_id],
                )?
                .try_get(0)?;
            if super::count("child sessions", started)? >= max_children {
                return Err(Error::TooManyChildren {
                    parent,
                    max: max_children,
                });
            }
            insert_session(&mut tx, &scope, &new, now_ms(), Some(&parent), None)?;
            claim_in(&mut tx, request(&scope, &new.id, &profile, max_live))?;
            let row = session_in(&mut tx, &scope, &new.id)?;
            tx.commit()?;
            Ok(row)
        })
    }

    fn children(&self, scope: &Scope, parent: &SessionId) -> Result<Vec<SessionRow>> {
        let (scope, parent) = (scope.clone(), parent.to_string());
        self.conn
            .run(move |conn| sessions_where(&mut conn.client, "parent_id", &scope, &parent))
    }

    fn create_fork(
        &self,
        scope: &Scope,
        new: &NewSession,
        entries: &[TranscriptEntry],
        artifacts: &[NewArtifact],
    ) -> Result<SessionRow> {
        let copied = Copied::of(entries)?;
        let (scope, new) = (scope.clone(), new.clone());
        let artifacts: Vec<NewArtifact> = artifacts
            .iter()
            .map(|artifact| NewArtifact {
                session_id: Some(new.id.clone()),
                ..artifact.clone()
            })
            .collect();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            insert_session(&mut tx, &scope, &new, now_ms(), None, None)?;
            tx.execute(
                "INSERT INTO entries (id, session_id, owner_id, tenant_id, parent_id, run_id, \
                 kind, body, created_at_ms) \
                 SELECT c.id, $1, $2, $3, c.parent_id, c.run_id, c.kind, c.body, c.at \
                   FROM UNNEST($4::text[], $5::text[], $6::text[], $7::text[], $8::text[], \
                               $9::bigint[]) AS c(id, parent_id, run_id, kind, body, at)",
                &[
                    &new.id.as_str(),
                    &scope.owner_id,
                    &scope.tenant_id,
                    &copied.ids,
                    &copied.parents,
                    &copied.runs,
                    &copied.kinds,
                    &copied.bodies,
                    &copied.times,
                ],
            )?;
            tx.execute(
                "UPDATE sessions SET leaf_entry_id = $1 WHERE id = $2",
                &[&copied.ids.last(), &new.id.as_str()],
            )?;
            for artifact in &artifacts {
                insert_artifact(&mut tx, &scope, artifact)?;
            }
            let row = session_in(&mut tx, &scope, &new.id)?;
            tx.commit()?;
            Ok(row)
        })
    }

    fn create_group(
        &self,
        scope: &Scope,
        id: &GroupId,
        title: &str,
        sessions: &[NewSession],
        (profile, max_live): (&str, u64),
    ) -> Result<Vec<SessionRow>> {
        let (scope, group, title, sessions, profile) = (
            scope.clone(),
            id.to_string(),
            title.to_owned(),
            sessions.to_vec(),
            profile.to_owned(),
        );
        let now = now_ms();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            lock_worker_slots(&mut tx)?;
            let needs = sessions.len() as u64;
            let free = max_live.saturating_sub(slots_in(&mut tx)?.live);
            if free < needs {
                return Err(Error::GroupAtCapacity {
                    needs,
                    free,
                    max: max_live,
                });
            }
            tx.execute(
                "INSERT INTO session_groups (id, owner_id, tenant_id, title, created_at_ms) \
                 VALUES ($1, $2, $3, $4, $5)",
                &[&group, &scope.owner_id, &scope.tenant_id, &title, &now],
            )?;
            // One millisecond apart, in the order given: every reader sees the order they
            // were started in.
            for (at, new) in (now..).zip(&sessions) {
                insert_session(&mut tx, &scope, new, at, None, Some(&group))?;
                claim_in(&mut tx, request(&scope, &new.id, &profile, max_live))?;
            }
            let rows = sessions_where(&mut tx, "group_id", &scope, &group)?;
            tx.commit()?;
            Ok(rows)
        })
    }

    fn group(&self, scope: &Scope, id: &GroupId) -> Result<GroupRow> {
        let (scope, group) = (scope.clone(), id.to_string());
        self.conn
            .run(move |conn| group_in(&mut conn.client, &scope, &group))
    }

    fn group_sessions(&self, scope: &Scope, id: &GroupId) -> Result<Vec<SessionRow>> {
        let (scope, group) = (scope.clone(), id.to_string());
        self.conn
            .run(move |conn| sessions_where(&mut conn.client, "group_id", &scope, &group))
    }

    fn pick(&self, scope: &Scope, group: &GroupId, session: &SessionId) -> Result<GroupRow> {
        let (scope, group, session) = (scope.clone(), group.clone(), session.clone());
        self.conn.run(move |conn| {
            // Conditional: of two picks at once, the second finds the group picked and
            // writes nothing.
            let changed = conn.client.execute(
                "UPDATE session_groups SET picked_session_id = $1, picked_at_ms = $2 \
                 WHERE id = $3 AND owner_id = $4 AND tenant_id = $5 \
                 AND picked_session_id IS NULL \
                 AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = $1 AND s.group_id = $3)",
                &[
                    &session.as_str(),
                    &now_ms(),
                    &group.as_str(),
                    &scope.owner_id,
                    &scope.tenant_id,
                ],
            )?;
            let row = group_in(&mut conn.client, &scope, group.as_str())?;
            crate::groups::picked(row, &group, &session, changed > 0)
        })
    }
}
