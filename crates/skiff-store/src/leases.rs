//! Gateways and leases on SQLite (the rules are in `aggregates/leases.rs`). SQLite is
//! embedded, so "the database's clock" is this machine's: what matters is that every
//! expiry is computed and compared by SQLite (`unixepoch('subsec')`), never passed in.
//! Each call is one immediate transaction: the write lock orders racing claims, and a fenced
//! write's check and write.

use crate::aggregates::leases::{
    Claim, Fence, GatewayRow, Lease, LeaseKey, Leases, gateway_id, lease_lost, ttl_ms,
};
use crate::{AttemptStatus, Error, Result, Resume, RunRow, Scope, Store};
use rusqlite::{OptionalExtension, Transaction, TransactionBehavior, params};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{AttemptId, EntryId, GatewayId, RunId, SessionId};
use std::time::Duration;

/// The database's now, in Unix milliseconds (spelled into each statement: `concat!` needs
/// literals).
macro_rules! now {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

const LEASE_COLUMNS: &str = concat!(
    "kind, name, holder, epoch, expires_at_ms, expires_at_ms <= ",
    now!()
);

/// A lease row as read: kind, name, holder, epoch, expiry, expired.
type RawLease = (String, String, Option<String>, i64, i64, bool);

fn raw(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawLease> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
    ))
}

/// A held lease from its row (`None` once released).
fn lease((kind, name, holder, epoch, expires_at_ms, expired): RawLease) -> Result<Option<Lease>> {
    let Some(holder) = holder else {
        return Ok(None);
    };
    Ok(Some(Lease {
        key: LeaseKey::from_columns(&kind, &name)?,
        holder: gateway_id(&holder)?,
        epoch,
        expires_at_ms,
        expired,
    }))
}

fn held(raw: RawLease) -> Result<Lease> {
    lease(raw)?.ok_or_else(|| Error::Corrupt {
        what: "lease",
        detail: "a claimed lease has no holder".into(),
    })
}

fn read(tx: &Transaction<'_>, key: &LeaseKey) -> Result<Option<Lease>> {
    let row = tx
        .prepare_cached(&format!(
            "SELECT {LEASE_COLUMNS} FROM leases WHERE kind = ?1 AND name = ?2"
        ))?
        .query_row(params![key.kind(), key.name()], raw)
        .optional()?;
    Ok(match row {
        Some(row) => lease(row)?,
        None => None,
    })
}

fn gateway(row: &rusqlite::Row<'_>) -> rusqlite::Result<(String, String, i64, i64, bool)> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
    ))
}

fn gateway_row(
    (id, address, started_at_ms, heartbeat_at_ms, alive): (String, String, i64, i64, bool),
) -> Result<GatewayRow> {
    Ok(GatewayRow {
        id: gateway_id(&id)?,
        address,
        started_at_ms,
        heartbeat_at_ms,
        alive,
    })
}

/// Checks `fence` first thing in a write's (immediate) transaction.
pub(crate) fn check_fence(tx: &Transaction<'_>, fence: &Fence) -> Result<()> {
    let row = tx
        .prepare_cached("SELECT holder, epoch FROM leases WHERE kind = 'session' AND name = ?1")?
        .query_row(params![fence.session.as_str()], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    fence.check(row)
}

impl Store {
    fn immediate<T>(&self, work: impl FnOnce(&Transaction<'_>) -> Result<T>) -> Result<T> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let answer = work(&tx)?;
        tx.commit()?;
        Ok(answer)
    }
}

impl Leases for Store {
    fn register_gateway(&self, id: &GatewayId, address: &str) -> Result<GatewayRow> {
        self.immediate(|tx| {
            let row = tx
                .prepare_cached(concat!(
                    "INSERT INTO gateways (id, address, started_at_ms, heartbeat_at_ms) \
                     VALUES (?1, ?2, ",
                    now!(),
                    ", ",
                    now!(),
                    ") ON CONFLICT (id) DO UPDATE SET address = excluded.address, \
                     started_at_ms = excluded.started_at_ms, \
                     heartbeat_at_ms = excluded.heartbeat_at_ms \
                     RETURNING id, address, started_at_ms, heartbeat_at_ms, 1"
                ))?
                .query_row(params![id.as_str(), address], gateway)?;
            gateway_row(row)
        })
    }

    fn heartbeat(&self, id: &GatewayId) -> Result<GatewayRow> {
        self.immediate(|tx| {
            let row = tx
                .prepare_cached(concat!(
                    "UPDATE gateways SET heartbeat_at_ms = ",
                    now!(),
                    " WHERE id = ?1 RETURNING id, address, started_at_ms, heartbeat_at_ms, 1"
                ))?
                .query_row(params![id.as_str()], gateway)
                .optional()?
                .ok_or_else(|| Error::NotFound {
                    what: "gateway",
                    id: id.to_string(),
                })?;
            gateway_row(row)
        })
    }

    fn gateways(&self, alive_within: Duration) -> Result<Vec<GatewayRow>> {
        let conn = self.conn();
        let rows = conn
            .prepare_cached(concat!(
                "SELECT id, address, started_at_ms, heartbeat_at_ms, heartbeat_at_ms >= ",
                now!(),
                " - ?1 FROM gateways ORDER BY started_at_ms, id"
            ))?
            .query_map(params![ttl_ms(alive_within)], gateway)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(gateway_row).collect()
    }

    fn database_now_ms(&self) -> Result<i64> {
        Ok(self
            .conn()
            .query_row(concat!("SELECT ", now!()), [], |r| r.get(0))?)
    }

    fn deregister_gateway(&self, id: &GatewayId) -> Result<()> {
        self.immediate(|tx| {
            tx.prepare_cached("DELETE FROM gateways WHERE id = ?1")?
                .execute(params![id.as_str()])?;
            Ok(())
        })
    }

    fn acquire_lease(&self, key: &LeaseKey, gateway: &GatewayId, ttl: Duration) -> Result<Claim> {
        self.immediate(|tx| claim(tx, key, gateway, ttl))
    }

    fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.immediate(|tx| {
            let renewed = tx
                .prepare_cached(&format!(
                    "UPDATE leases SET expires_at_ms = {} + ?5 \
                     WHERE kind = ?1 AND name = ?2 AND holder = ?3 AND epoch = ?4 \
                     RETURNING {LEASE_COLUMNS}",
                    now!()
                ))?
                .query_row(
                    params![
                        lease.key.kind(),
                        lease.key.name(),
                        lease.holder.as_str(),
                        lease.epoch,
                        ttl_ms(ttl)
                    ],
                    raw,
                )
                .optional()?;
            match renewed {
                Some(row) => held(row),
                None => Err(lost(tx, lease)?),
            }
        })
    }

    fn release_lease(&self, lease: &Lease) -> Result<()> {
        self.immediate(|tx| {
            let released = tx
                .prepare_cached(concat!(
                    "UPDATE leases SET holder = NULL, expires_at_ms = ",
                    now!(),
                    " WHERE kind = ?1 AND name = ?2 AND holder = ?3 AND epoch = ?4"
                ))?
                .execute(params![
                    lease.key.kind(),
                    lease.key.name(),
                    lease.holder.as_str(),
                    lease.epoch
                ])?;
            match released {
                0 => Err(lost(tx, lease)?),
                _ => Ok(()),
            }
        })
    }

    fn lease(&self, key: &LeaseKey) -> Result<Option<Lease>> {
        self.immediate(|tx| read(tx, key))
    }

    fn expired_leases(&self) -> Result<Vec<Lease>> {
        let conn = self.conn();
        let rows = conn
            .prepare_cached(&format!(
                "SELECT {LEASE_COLUMNS} FROM leases \
                 WHERE holder IS NOT NULL AND expires_at_ms <= {} ORDER BY expires_at_ms, name",
                now!()
            ))?
            .query_map([], raw)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(held).collect()
    }

    fn released_open_sessions(&self) -> Result<Vec<SessionId>> {
        let conn = self.conn();
        let names = conn
            .prepare_cached(&format!(
                "SELECT l.name FROM leases l JOIN runs r ON r.session_id = l.name \
                  WHERE l.kind = 'session' AND l.holder IS NULL \
                    AND r.status IN ({}) ORDER BY l.expires_at_ms, l.name",
                crate::runs::OPEN_STATUSES
            ))?
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        names.iter().map(|name| session_of(name)).collect()
    }

    fn leases_of_dead_gateways(&self, alive_within: Duration) -> Result<Vec<Lease>> {
        let conn = self.conn();
        let rows = conn
            .prepare_cached(&format!(
                "SELECT l.kind, l.name, l.holder, l.epoch, l.expires_at_ms, l.expires_at_ms <= {now} \
                   FROM leases l LEFT JOIN gateways g ON g.id = l.holder \
                  WHERE l.holder IS NOT NULL \
                    AND (g.id IS NULL OR g.heartbeat_at_ms < {now} - ?1) \
                  ORDER BY l.expires_at_ms, l.name",
                now = now!()
            ))?
            .query_map(params![ttl_ms(alive_within)], raw)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(held).collect()
    }

    fn take_over_lease(
        &self,
        expired: &Lease,
        gateway: &GatewayId,
        ttl: Duration,
    ) -> Result<Claim> {
        self.immediate(|tx| {
            let taken = tx
                .prepare_cached(&format!(
                    "UPDATE leases SET holder = ?3, epoch = epoch + 1, acquired_at_ms = {now}, \
                            expires_at_ms = {now} + ?5 \
                      WHERE kind = ?1 AND name = ?2 AND epoch = ?4 \
                        AND (holder IS NULL OR expires_at_ms <= {now}) \
                     RETURNING {LEASE_COLUMNS}",
                    now = now!()
                ))?
                .query_row(
                    params![
                        expired.key.kind(),
                        expired.key.name(),
                        gateway.as_str(),
                        expired.epoch,
                        ttl_ms(ttl)
                    ],
                    raw,
                )
                .optional()?;
            match taken {
                Some(row) => Ok(Claim::Won(held(row)?)),
                // It moved on: renewed or taken by another (held), or released since (free,
                // so claimed like any free lease).
                None => match read(tx, &expired.key)? {
                    Some(current) => Ok(Claim::Held(current)),
                    None => claim(tx, &expired.key, gateway, ttl),
                },
            }
        })
    }

    fn append_entries_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        base_leaf: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> Result<Vec<TranscriptEntry>> {
        self.append_entries_with(Some(fence), scope, &fence.session, base_leaf, run, bodies)
    }

    fn append_event_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<SessionEvent> {
        self.append_event_with(Some(fence), scope, &fence.session, run, kind, None)
    }

    fn transition_run_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        id: &RunId,
        to: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        self.transition_run_with(Some(fence), scope, id, to, error)
    }

    fn resume_attempt_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        run: &RunRow,
        runtime_node: &str,
        resume: Resume<'_>,
    ) -> Result<AttemptId> {
        self.resume_attempt_with(Some(fence), scope, run, runtime_node, fence.epoch, resume)
    }

    fn finish_attempt_fenced(
        &self,
        fence: &Fence,
        scope: &Scope,
        id: &AttemptId,
        status: AttemptStatus,
        error: Option<&str>,
    ) -> Result<()> {
        self.finish_attempt_with(Some(fence), scope, id, status, error)
    }

    fn open_run_of(&self, session: &SessionId) -> Result<Option<(Scope, RunRow)>> {
        Store::open_run_of(self, session)
    }

    fn orphan_unleased_on_start(
        &self,
        gateway: &GatewayId,
        reason: &str,
    ) -> Result<Vec<(Scope, RunRow)>> {
        self.orphan_with(Some(gateway), reason)
    }
}

/// A session lease's name as its session.
pub(crate) fn session_of(name: &str) -> Result<SessionId> {
    SessionId::parse(name).ok_or_else(|| Error::Corrupt {
        what: "lease",
        detail: format!("malformed session id {name:?}"),
    })
}

/// The claim: free, expired or already the caller's → the caller's (a new holder: epoch + 1).
fn claim(
    tx: &Transaction<'_>,
    key: &LeaseKey,
    gateway: &GatewayId,
    ttl: Duration,
) -> Result<Claim> {
    let won = tx
        .prepare_cached(&format!(
            "INSERT INTO leases (kind, name, holder, epoch, acquired_at_ms, expires_at_ms) \
             VALUES (?1, ?2, ?3, 1, {now}, {now} + ?4) \
             ON CONFLICT (kind, name) DO UPDATE SET \
                 epoch = epoch + (holder IS NOT excluded.holder), \
                 acquired_at_ms = CASE WHEN holder IS excluded.holder THEN acquired_at_ms \
                                       ELSE excluded.acquired_at_ms END, \
                 holder = excluded.holder, \
                 expires_at_ms = excluded.expires_at_ms \
              WHERE holder IS NULL OR holder = excluded.holder OR expires_at_ms <= {now} \
             RETURNING {LEASE_COLUMNS}",
            now = now!()
        ))?
        .query_row(
            params![key.kind(), key.name(), gateway.as_str(), ttl_ms(ttl)],
            raw,
        )
        .optional()?;
    match won {
        Some(row) => Ok(Claim::Won(held(row)?)),
        None => match read(tx, key)? {
            Some(current) => Ok(Claim::Held(current)),
            None => Err(Error::Corrupt {
                what: "lease",
                detail: format!("{key} was neither claimed nor held"),
            }),
        },
    }
}

/// The refusal of a renewal or release of `lease`, naming who holds it now.
fn lost(tx: &Transaction<'_>, lease: &Lease) -> Result<Error> {
    let current = read(tx, &lease.key)?.map(|now| (now.holder.to_string(), now.epoch));
    Ok(lease_lost(&lease.key, &lease.holder, lease.epoch, current))
}
