//! This gateway among the gateways that share one database (issue 17): its id, its row in the
//! store's gateway registry (with the address other gateways reach it at) and the heartbeat
//! that tells the others it is alive.
//!
//! The id is kept in the state dir (`gateway-id`), so a gateway restarted on the same state dir
//! is the same gateway: the leases it held are still its own and it takes them back at once
//! instead of waiting out their expiry. Two gateways never share a state dir (its lock).
//!
//! Every lease time is the database's; this module only passes durations.
//!
//! **Session leases.** A session's live work (an open run) is this gateway's while it holds
//! the session's lease: acquired at a turn's admission, renewed with the heartbeat, released
//! when the turn ends. Every write of the run is fenced by it ([`SessionLeases::fence`], read
//! by the hub and the transcript writes). A renewal refused with `LeaseLost` marks the lease
//! lost: its token cancels the turn, and the stale fence stays in place until the turn is
//! gone, so whatever the turn still tries to write is refused by the database.

use crate::state_dir::StateDir;
use crate::{Error, Result};
use skiff_protocol::{GatewayId, SessionId};
use skiff_store::{Backend, Claim, Fence, Lease, LeaseKey};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The name of the file in the state dir that keeps this gateway's id.
const ID_FILE: &str = "gateway-id";

/// This gateway's place among the gateways on its database.
pub(crate) struct Cluster {
    id: GatewayId,
    store: Arc<dyn Backend>,
    /// `[gateway] lease_ttl`: how long a lease lives unless renewed; a dead gateway's sessions
    /// are taken over by another within it.
    lease_ttl: Duration,
    /// The session leases this gateway holds (shared with the hub, which fences by them).
    leases: Arc<SessionLeases>,
    /// When the lease loop last finished a round (heartbeat and renewals answered).
    last_round: Mutex<Instant>,
    /// Set by `skiff gateway drain`: this gateway admits and takes over nothing more.
    draining: AtomicBool,
}

/// A session lease this gateway holds, or held until a renewal found it lost.
struct Held {
    lease: Lease,
    /// Cancelled when the lease is lost: the session's work stops at once.
    lost: CancellationToken,
    /// Released for another gateway to take over (a drain): like a lost lease, its fence
    /// stays until the work is gone, and it is neither renewed nor released again.
    handed: bool,
}

impl Held {
    fn gone(&self) -> bool {
        self.handed || self.lost.is_cancelled()
    }
}

/// The session leases this gateway holds, by session.
#[derive(Default)]
pub(crate) struct SessionLeases {
    held: Mutex<HashMap<SessionId, Held>>,
}

impl SessionLeases {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fence on `session`'s writes while this gateway holds (or held, until its work
    /// ends) the session's lease; `None` for a session whose live work is not here.
    pub(crate) fn fence(&self, session: &SessionId) -> Option<Fence> {
        self.lock().get(session).and_then(|h| h.lease.fence())
    }

    /// Makes one of `session`'s writes: `write(Some(fence))` while this gateway holds the
    /// session's lease, `write(None)` when its live work is not here. A fenced write refused
    /// because this gateway let the lease go itself meanwhile (its turn ended between reading
    /// the fence and writing — a pull-back's placement step, say) is made again unfenced, as
    /// any write outside a turn is; a lease lost to another gateway keeps its stale fence
    /// until the work ends, so that refusal stands.
    pub(crate) fn write<T>(
        &self,
        session: &SessionId,
        mut write: impl FnMut(Option<&Fence>) -> std::result::Result<T, skiff_store::Error>,
    ) -> std::result::Result<T, skiff_store::Error> {
        let Some(fence) = self.fence(session) else {
            return write(None);
        };
        match write(Some(&fence)) {
            Err(skiff_store::Error::LeaseLost { .. }) if self.fence(session).is_none() => {
                write(None)
            }
            outcome => outcome,
        }
    }

    /// Whether this gateway lost `session`'s lease to another, or handed it over, while its
    /// work was running.
    pub(crate) fn is_lost(&self, session: &SessionId) -> bool {
        self.lock().get(session).is_some_and(Held::gone)
    }

    /// Keeps `lease` (just won): a new holder's token unless it is the same holding renewed.
    fn hold(&self, lease: Lease) -> CancellationToken {
        let LeaseKey::Session(session) = lease.key.clone() else {
            return CancellationToken::new();
        };
        let mut held = self.lock();
        match held.get_mut(&session) {
            Some(h) if h.lease.epoch == lease.epoch && !h.gone() => {
                h.lease = lease;
                h.lost.clone()
            }
            _ => {
                let lost = CancellationToken::new();
                held.insert(
                    session,
                    Held {
                        lease,
                        lost: lost.clone(),
                        handed: false,
                    },
                );
                lost
            }
        }
    }

    /// The sessions whose lease this gateway holds (lost ones included, until their work
    /// ends).
    pub(crate) fn sessions(&self) -> Vec<SessionId> {
        self.lock().keys().cloned().collect()
    }

    /// The held leases a renewal round renews.
    fn live(&self) -> Vec<Lease> {
        self.lock()
            .values()
            .filter(|h| !h.gone())
            .map(|h| h.lease.clone())
            .collect()
    }

    /// Marks every lease held as handed over and returns them with their tokens: from here
    /// their sessions' work counts as lost ([`SessionLeases::is_lost`]) and writes nothing
    /// more of its own accord.
    fn hand_over_all(&self) -> Vec<(Lease, CancellationToken)> {
        let mut held = self.lock();
        held.values_mut()
            .filter(|h| !h.gone())
            .map(|h| {
                h.handed = true;
                (h.lease.clone(), h.lost.clone())
            })
            .collect()
    }
}

/// What a renewal round did.
#[derive(Debug, Default)]
pub(crate) struct Round {
    pub renewed: u64,
    /// Sessions whose lease another gateway took over: their work was stopped.
    pub lost: Vec<SessionId>,
    /// Whether every call was answered (the database was reachable).
    pub complete: bool,
}

/// Whose a session's lease is, when it is not this gateway's.
#[derive(Debug)]
pub(crate) struct Owner {
    pub gateway: GatewayId,
    /// Where the owner is reached (`host:port`), empty before it bound its listener.
    pub address: String,
}

impl Cluster {
    /// Reads (or mints and keeps) this gateway's id and registers it; the address comes once
    /// the listener is bound ([`Cluster::advertise`]).
    pub(crate) fn join(
        store: Arc<dyn Backend>,
        state: &StateDir,
        lease_ttl: Duration,
    ) -> Result<Self> {
        let id = load_or_mint_id(&state.root().join(ID_FILE))?;
        store.register_gateway(&id, "")?;
        Ok(Cluster {
            id,
            store,
            lease_ttl,
            leases: Arc::default(),
            last_round: Mutex::new(Instant::now()),
            draining: AtomicBool::new(false),
        })
    }

    /// The leases this gateway holds, for the hub's fenced writes.
    pub(crate) fn leases(&self) -> &Arc<SessionLeases> {
        &self.leases
    }

    /// Claims `session`'s lease for a turn (free, expired or already this gateway's). On
    /// success, the token cancelled if the lease is later lost; otherwise who holds it.
    pub(crate) fn acquire(
        &self,
        session: &SessionId,
    ) -> Result<std::result::Result<CancellationToken, Owner>> {
        let key = LeaseKey::Session(session.clone());
        match self.store.acquire_lease(&key, &self.id, self.lease_ttl)? {
            Claim::Won(lease) => Ok(Ok(self.leases.hold(lease))),
            Claim::Held(lease) => Ok(Err(self.owner(lease.holder)?)),
        }
    }

    /// Takes over `expired` (as `expired_leases` listed it); `Some(token)` when won.
    pub(crate) fn take_over(&self, expired: &Lease) -> Result<Option<CancellationToken>> {
        match self
            .store
            .take_over_lease(expired, &self.id, self.lease_ttl)?
        {
            Claim::Won(lease) => Ok(Some(self.leases.hold(lease))),
            Claim::Held(_) => Ok(None),
        }
    }

    /// Held session leases past their expiry, held by others or by this gateway before a
    /// restart (the leases this process holds are renewed, not taken over).
    pub(crate) fn expired_sessions(&self) -> Result<Vec<Lease>> {
        let expired = self.store.expired_leases()?;
        // Read after the query: the hub reads this map on every publish.
        let mine = self.leases.lock();
        Ok(expired
            .into_iter()
            .filter(|l| match &l.key {
                LeaseKey::Session(s) => !mine.contains_key(s),
                LeaseKey::Singleton(_) => false,
            })
            .collect())
    }

    /// Lets `session`'s lease go (its work here ended); a lease already lost is only
    /// forgotten. A release the database refuses is logged: the lease then expires.
    pub(crate) fn release(&self, session: &SessionId) {
        let Some(held) = self.leases.lock().remove(session) else {
            return;
        };
        if held.gone() {
            return;
        }
        if let Err(e) = self.store.release_lease(&held.lease) {
            tracing::warn!(%session, error = %e, "could not release the session's lease; it expires on its own");
        }
    }

    /// Lets every session lease held go so that other gateways take the sessions over at
    /// their next round (a drain). Each is released in the database *before* its work is
    /// stopped: from the release on, the database refuses the work's fenced writes, so
    /// nothing it does while stopping lands beside the new owner's. The sessions handed over.
    pub(crate) fn hand_over_all(&self) -> Vec<SessionId> {
        let mut handed = Vec::new();
        for (lease, lost) in self.leases.hand_over_all() {
            let LeaseKey::Session(session) = lease.key.clone() else {
                continue;
            };
            match self.store.release_lease(&lease) {
                Ok(()) => {}
                // Taken over already: the work stops all the same.
                Err(skiff_store::Error::LeaseLost { .. }) => {}
                Err(e) => {
                    tracing::warn!(%session, error = %e, "could not release the session's lease for a hand-over; it expires on its own and is taken over then");
                }
            }
            lost.cancel();
            handed.push(session);
        }
        handed
    }

    /// This gateway is draining: it admits no turn and takes no session over.
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// The other live gateways, with their addresses: where a draining gateway's sessions and
    /// requests go.
    pub(crate) fn others(&self) -> Result<Vec<skiff_store::GatewayRow>> {
        Ok(self
            .store
            .gateways(self.lease_ttl)?
            .into_iter()
            .filter(|g| g.alive && g.id != self.id && !g.address.is_empty())
            .collect())
    }

    /// Leaves the registry for good (the end of a drain).
    pub(crate) fn deregister(&self) -> Result<()> {
        self.store.deregister_gateway(&self.id)?;
        Ok(())
    }

    /// Renews every lease held; a renewal refused with `LeaseLost` cancels that session's
    /// token (its work stops) and keeps the stale fence until the work is gone.
    pub(crate) fn renew_all(&self) -> Round {
        let mut round = Round {
            complete: true,
            ..Round::default()
        };
        for lease in self.leases.live() {
            let LeaseKey::Session(session) = lease.key.clone() else {
                continue;
            };
            match self.store.renew_lease(&lease, self.lease_ttl) {
                Ok(renewed) => {
                    let mut held = self.leases.lock();
                    if let Some(h) = held.get_mut(&session)
                        && h.lease.epoch == renewed.epoch
                    {
                        h.lease = renewed;
                    }
                    round.renewed += 1;
                }
                Err(skiff_store::Error::LeaseLost { now, .. }) => {
                    tracing::warn!(%session, now = %now, "this gateway lost the session's lease; its work here stops");
                    if let Some(h) = self.leases.lock().get(&session) {
                        h.lost.cancel();
                    }
                    round.lost.push(session);
                }
                Err(e) => {
                    tracing::warn!(%session, error = %e, "could not renew the session's lease");
                    round.complete = false;
                }
            }
        }
        round
    }

    /// The lease loop finished a round now.
    pub(crate) fn round_done(&self) {
        *self.last_round.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Whether the lease loop finished a round within the lease's life: otherwise this
    /// gateway's leases may be lapsing (`/readyz` fails).
    pub(crate) fn lease_loop_healthy(&self) -> bool {
        self.last_round
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
            <= self.lease_ttl
    }

    /// The holder `gateway` with its registered address.
    fn owner(&self, gateway: GatewayId) -> Result<Owner> {
        let address = self
            .store
            .gateways(self.lease_ttl)?
            .into_iter()
            .find(|g| g.id == gateway)
            .map(|g| g.address)
            .unwrap_or_default();
        Ok(Owner { gateway, address })
    }

    /// Records where other gateways reach this one (`host:port`).
    pub(crate) fn advertise(&self, address: &str) -> Result<()> {
        self.store.register_gateway(&self.id, address)?;
        Ok(())
    }

    pub(crate) fn id(&self) -> &GatewayId {
        &self.id
    }

    pub(crate) fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// How often the heartbeat (and whatever renews leases) runs: three times per lease life,
    /// so one missed beat never lets a lease expire.
    pub(crate) fn beat_every(&self) -> Duration {
        self.lease_ttl / 3
    }

    /// Tells the other gateways this one is alive.
    pub(crate) fn beat(&self) -> Result<()> {
        self.store.heartbeat(&self.id)?;
        Ok(())
    }
}

/// The id kept in `path`, or a new one written there (mode 0600, through a temporary file so a
/// crash never leaves half an id).
fn load_or_mint_id(path: &Path) -> Result<GatewayId> {
    match std::fs::read_to_string(path) {
        Ok(text) => GatewayId::parse(text.trim()).ok_or_else(|| {
            Error::Internal(format!(
                "{} does not hold a gateway id ({:?}); remove the file and the gateway mints a new one",
                path.display(),
                text.trim()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = GatewayId::from_suffix(&skiff_store::mint()?);
            write_new(path, id.as_str()).map_err(|e| {
                Error::Internal(format!("cannot write {}: {e}", path.display()))
            })?;
            Ok(id)
        }
        Err(e) => Err(Error::Internal(format!(
            "cannot read {}: {e}",
            path.display()
        ))),
    }
}

fn write_new(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

impl Cluster {
    /// Whether another gateway holds `session`'s lease now: its running turn is that
    /// gateway's to end. A lease that cannot be read counts as this gateway's (as with one
    /// gateway), with a warning.
    pub(crate) fn owns_elsewhere(&self, session: &skiff_protocol::SessionId) -> bool {
        let key = skiff_store::LeaseKey::Session(session.clone());
        match self.store.lease(&key) {
            Ok(Some(lease)) => !lease.expired && lease.holder != self.id,
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(%session, error = %e, "cannot read the session's lease");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gateway_keeps_its_id_across_restarts_and_refuses_a_garbled_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(ID_FILE);
        let first = load_or_mint_id(&path).unwrap();
        assert!(first.as_str().starts_with("gw_"));
        assert_eq!(load_or_mint_id(&path).unwrap(), first);
        std::fs::write(&path, "not an id").unwrap();
        let err = load_or_mint_id(&path).unwrap_err().to_string();
        assert!(
            err.contains("gateway-id") && err.contains("remove the file"),
            "{err}"
        );
    }
}
