//! Gateways and leases on PostgreSQL (the rules are in `aggregates/leases.rs`). Every time is
//! `skiff_now_ms()` — `clock_timestamp()` in milliseconds, the database's clock — and every
//! change is one conditional statement, so racing gateways get one winner from the row lock
//! alone. A fenced write reads the lease row `FOR SHARE` in its own transaction: a take-over
//! (an `UPDATE` of that row) waits for the write's commit, or the write sees the new epoch
//! and is refused. Lock order: lease row, then session row.

use super::PgStore;
use super::conn::PgConn;
use crate::aggregates::EventWakeups;
use crate::aggregates::leases::{
    Claim, Fence, GatewayRow, Lease, LeaseKey, Leases, gateway_id, lease_lost, ttl_ms,
};
use crate::{AttemptStatus, Error, Result, Resume, RunRow, Scope};
use postgres::{GenericClient, Row};
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{AttemptId, EntryId, GatewayId, RunId, SessionId};
use std::time::Duration;

const GATEWAY_COLUMNS: &str = "id, address, started_at_ms, heartbeat_at_ms";

const CLAIM: &str = "INSERT INTO leases AS l (kind, name, holder, epoch, acquired_at_ms, expires_at_ms)
     VALUES ($1, $2, $3, 1, skiff_now_ms(), skiff_now_ms() + $4)
     ON CONFLICT (kind, name) DO UPDATE SET
         epoch = l.epoch + CASE WHEN l.holder IS NOT DISTINCT FROM EXCLUDED.holder THEN 0 ELSE 1 END,
         acquired_at_ms = CASE WHEN l.holder IS NOT DISTINCT FROM EXCLUDED.holder
                               THEN l.acquired_at_ms ELSE EXCLUDED.acquired_at_ms END,
         holder = EXCLUDED.holder,
         expires_at_ms = EXCLUDED.expires_at_ms
      WHERE l.holder IS NULL OR l.holder = EXCLUDED.holder OR l.expires_at_ms <= skiff_now_ms()
     RETURNING kind, name, holder, epoch, expires_at_ms, expires_at_ms <= skiff_now_ms()";

const READ: &str =
    "SELECT kind, name, holder, epoch, expires_at_ms, expires_at_ms <= skiff_now_ms()
       FROM leases WHERE kind = $1 AND name = $2";

const RENEW: &str = "UPDATE leases SET expires_at_ms = skiff_now_ms() + $5
      WHERE kind = $1 AND name = $2 AND holder = $3 AND epoch = $4
     RETURNING kind, name, holder, epoch, expires_at_ms, expires_at_ms <= skiff_now_ms()";

const RELEASE: &str = "UPDATE leases SET holder = NULL, expires_at_ms = skiff_now_ms()
      WHERE kind = $1 AND name = $2 AND holder = $3 AND epoch = $4";

const TAKE_OVER: &str = "UPDATE leases
        SET holder = $3, epoch = epoch + 1, acquired_at_ms = skiff_now_ms(),
            expires_at_ms = skiff_now_ms() + $5
      WHERE kind = $1 AND name = $2 AND epoch = $4
        AND (holder IS NULL OR expires_at_ms <= skiff_now_ms())
     RETURNING kind, name, holder, epoch, expires_at_ms, expires_at_ms <= skiff_now_ms()";

const EXPIRED: &str = "SELECT kind, name, holder, epoch, expires_at_ms, true FROM leases
      WHERE holder IS NOT NULL AND expires_at_ms <= skiff_now_ms()
      ORDER BY expires_at_ms, name";

const RELEASED_OPEN: &str = "SELECT l.name FROM leases l JOIN runs r ON r.session_id = l.name
      WHERE l.kind = 'session' AND l.holder IS NULL
        AND r.status IN ('queued','starting','running','waiting_input','waiting_approval','cancelling')
      ORDER BY l.expires_at_ms, l.name";

const OF_DEAD_GATEWAYS: &str = "SELECT l.kind, l.name, l.holder, l.epoch, l.expires_at_ms,
            l.expires_at_ms <= skiff_now_ms()
       FROM leases l LEFT JOIN gateways g ON g.id = l.holder
      WHERE l.holder IS NOT NULL AND (g.id IS NULL OR g.heartbeat_at_ms < skiff_now_ms() - $1)
      ORDER BY l.expires_at_ms, l.name";

/// A held lease from its row (`None` once released).
fn lease(row: &Row) -> Result<Option<Lease>> {
    let Some(holder) = row.try_get::<_, Option<&str>>(2)? else {
        return Ok(None);
    };
    Ok(Some(Lease {
        key: LeaseKey::from_columns(row.try_get(0)?, row.try_get(1)?)?,
        holder: gateway_id(holder)?,
        epoch: row.try_get(3)?,
        expires_at_ms: row.try_get(4)?,
        expired: row.try_get(5)?,
    }))
}

fn held(row: &Row) -> Result<Lease> {
    lease(row)?.ok_or_else(|| Error::Corrupt {
        what: "lease",
        detail: "a claimed lease has no holder".into(),
    })
}

fn gateway(row: &Row, alive: bool) -> Result<GatewayRow> {
    Ok(GatewayRow {
        id: gateway_id(row.try_get(0)?)?,
        address: row.try_get(1)?,
        started_at_ms: row.try_get(2)?,
        heartbeat_at_ms: row.try_get(3)?,
        alive,
    })
}

fn read(conn: &mut PgConn, key: &LeaseKey) -> Result<Option<Lease>> {
    let read = conn.statement(READ)?;
    match conn.client.query_opt(&read, &[&key.kind(), &key.name()])? {
        Some(row) => lease(&row),
        None => Ok(None),
    }
}

/// How often a claim that found the lease released between its two statements tries again.
const CLAIM_TRIES: usize = 3;

/// The claim: free, expired or already the caller's → the caller's (a new holder: epoch + 1).
fn claim(conn: &mut PgConn, key: &LeaseKey, gateway: &GatewayId, ttl: i64) -> Result<Claim> {
    for _ in 0..CLAIM_TRIES {
        let claim = conn.statement(CLAIM)?;
        let won = conn
            .client
            .query_opt(&claim, &[&key.kind(), &key.name(), &gateway.as_str(), &ttl])?;
        if let Some(row) = won {
            return Ok(Claim::Won(held(&row)?));
        }
        // Held when the claim looked; a release since then makes it free: claim again.
        if let Some(current) = read(conn, key)? {
            return Ok(Claim::Held(current));
        }
    }
    Err(Error::Corrupt {
        what: "lease",
        detail: format!("{key} was released under {CLAIM_TRIES} claims in a row"),
    })
}

/// The refusal of a renewal or release of `lease`, naming who holds it now.
fn lost(conn: &mut PgConn, lease: &Lease) -> Result<Error> {
    let current = read(conn, &lease.key)?.map(|now| (now.holder.to_string(), now.epoch));
    Ok(lease_lost(&lease.key, &lease.holder, lease.epoch, current))
}

/// Checks `fence` in the caller's open transaction, locking the lease row (`FOR SHARE`)
/// until it ends.
pub(super) fn check_fence(client: &mut impl GenericClient, fence: &Fence) -> Result<()> {
    let row = client.query_opt(
        "SELECT holder, epoch FROM leases WHERE kind = 'session' AND name = $1 FOR SHARE",
        &[&fence.session.as_str()],
    )?;
    fence.check(
        row.map(|row| Ok::<_, Error>((row.try_get(0)?, row.try_get(1)?)))
            .transpose()?,
    )
}

impl Leases for PgStore {
    fn register_gateway(&self, id: &GatewayId, address: &str) -> Result<GatewayRow> {
        let (id, address) = (id.to_string(), address.to_string());
        self.conn.run(move |conn| {
            let row = conn.client.query_one(
                &format!(
                    "INSERT INTO gateways (id, address, started_at_ms, heartbeat_at_ms) \
                     VALUES ($1, $2, skiff_now_ms(), skiff_now_ms()) \
                     ON CONFLICT (id) DO UPDATE SET address = EXCLUDED.address, \
                         started_at_ms = EXCLUDED.started_at_ms, \
                         heartbeat_at_ms = EXCLUDED.heartbeat_at_ms \
                     RETURNING {GATEWAY_COLUMNS}"
                ),
                &[&id, &address],
            )?;
            gateway(&row, true)
        })
    }

    fn heartbeat(&self, id: &GatewayId) -> Result<GatewayRow> {
        let id = id.to_string();
        self.conn.run(move |conn| {
            let beat = conn.statement(
                "UPDATE gateways SET heartbeat_at_ms = skiff_now_ms() WHERE id = $1 \
                 RETURNING id, address, started_at_ms, heartbeat_at_ms",
            )?;
            match conn.client.query_opt(&beat, &[&id])? {
                Some(row) => gateway(&row, true),
                None => Err(Error::NotFound {
                    what: "gateway",
                    id,
                }),
            }
        })
    }

    fn gateways(&self, alive_within: Duration) -> Result<Vec<GatewayRow>> {
        let within = ttl_ms(alive_within);
        self.conn.run(move |conn| {
            conn.client
                .query(
                    "SELECT id, address, started_at_ms, heartbeat_at_ms, \
                            heartbeat_at_ms >= skiff_now_ms() - $1 \
                       FROM gateways ORDER BY started_at_ms, id",
                    &[&within],
                )?
                .iter()
                .map(|row| gateway(row, row.try_get(4)?))
                .collect()
        })
    }

    fn deregister_gateway(&self, id: &GatewayId) -> Result<()> {
        let id = id.to_string();
        self.conn.run(move |conn| {
            conn.client
                .execute("DELETE FROM gateways WHERE id = $1", &[&id])?;
            Ok(())
        })
    }

    fn database_now_ms(&self) -> Result<i64> {
        self.conn.run(|conn| {
            Ok(conn
                .client
                .query_one("SELECT skiff_now_ms()", &[])?
                .try_get(0)?)
        })
    }

    fn acquire_lease(&self, key: &LeaseKey, gateway: &GatewayId, ttl: Duration) -> Result<Claim> {
        let (key, gateway, ttl) = (key.clone(), gateway.clone(), ttl_ms(ttl));
        self.conn.run(move |conn| claim(conn, &key, &gateway, ttl))
    }

    fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let (lease, ttl) = (lease.clone(), ttl_ms(ttl));
        self.conn.run(move |conn| {
            let renew = conn.statement(RENEW)?;
            let renewed = conn.client.query_opt(
                &renew,
                &[
                    &lease.key.kind(),
                    &lease.key.name(),
                    &lease.holder.as_str(),
                    &lease.epoch,
                    &ttl,
                ],
            )?;
            match renewed {
                Some(row) => held(&row),
                None => Err(lost(conn, &lease)?),
            }
        })
    }

    fn release_lease(&self, lease: &Lease) -> Result<()> {
        let lease = lease.clone();
        self.conn.run(move |conn| {
            let release = conn.statement(RELEASE)?;
            let released = conn.client.execute(
                &release,
                &[
                    &lease.key.kind(),
                    &lease.key.name(),
                    &lease.holder.as_str(),
                    &lease.epoch,
                ],
            )?;
            match released {
                0 => Err(lost(conn, &lease)?),
                _ => Ok(()),
            }
        })
    }

    fn lease(&self, key: &LeaseKey) -> Result<Option<Lease>> {
        let key = key.clone();
        self.conn.run(move |conn| read(conn, &key))
    }

    fn expired_leases(&self) -> Result<Vec<Lease>> {
        self.conn.run(|conn| {
            let expired = conn.statement(EXPIRED)?;
            conn.client.query(&expired, &[])?.iter().map(held).collect()
        })
    }

    fn released_open_sessions(&self) -> Result<Vec<SessionId>> {
        self.conn.run(|conn| {
            // The statuses of `runs::OPEN`, the partial unique index's.
            let released = conn.statement(RELEASED_OPEN)?;
            conn.client
                .query(&released, &[])?
                .iter()
                .map(|row| crate::leases::session_of(row.try_get(0)?))
                .collect()
        })
    }

    fn leases_of_dead_gateways(&self, alive_within: Duration) -> Result<Vec<Lease>> {
        let within = ttl_ms(alive_within);
        self.conn.run(move |conn| {
            let dead = conn.statement(OF_DEAD_GATEWAYS)?;
            conn.client
                .query(&dead, &[&within])?
                .iter()
                .map(held)
                .collect()
        })
    }

    fn take_over_lease(
        &self,
        expired: &Lease,
        gateway: &GatewayId,
        ttl: Duration,
    ) -> Result<Claim> {
        let (expired, gateway, ttl) = (expired.clone(), gateway.clone(), ttl_ms(ttl));
        self.conn.run(move |conn| {
            let take_over = conn.statement(TAKE_OVER)?;
            let taken = conn.client.query_opt(
                &take_over,
                &[
                    &expired.key.kind(),
                    &expired.key.name(),
                    &gateway.as_str(),
                    &expired.epoch,
                    &ttl,
                ],
            )?;
            if let Some(row) = taken {
                return Ok(Claim::Won(held(&row)?));
            }
            // It moved on: renewed or taken by another (held), or released since (free, so
            // claimed like any free lease).
            match read(conn, &expired.key)? {
                Some(current) => Ok(Claim::Held(current)),
                None => claim(conn, &expired.key, &gateway, ttl),
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
        self.append_event_with(Some(fence), scope, &fence.session, run, kind)
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
        PgStore::open_run_of(self, session)
    }

    fn orphan_unleased_on_start(
        &self,
        gateway: &GatewayId,
        reason: &str,
    ) -> Result<Vec<(Scope, RunRow)>> {
        self.orphan_with(Some(gateway), reason)
    }
}

impl EventWakeups for PgStore {
    fn subscribe_events(&self, session: Option<&SessionId>) -> Result<crate::EventHints> {
        // Subscribe first: a hint the listener passes on as it starts reaches this one.
        let hints = self.wakeups.subscribe(session);
        self.listen()?;
        Ok(hints)
    }
}
