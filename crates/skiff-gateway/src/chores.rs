//! The gateway-wide chores, done by one gateway at a time when several share a database
//! (issue 17). Each runs under a singleton lease (`LeaseKey::Singleton`) that the gateway
//! doing it claims or renews every time it is about to do it; a gateway that finds it held
//! by another, live, skips that round. The lease outlives two rounds, so its holder keeps it
//! while alive, and another gateway takes the chore over within two rounds of its death.
//!
//! Gateway-wide (here): the orphan sweep of provider leases no environment owns (at start),
//! the lifetime tick's reclaim of idle or expired environments, the removal of half-written
//! blobs in a shared artifacts directory, and archiving the audit log. A session owner's
//! work stays with the owner and is not here: parking its idle worker sessions, its worker
//! connections and SSH masters, the leftovers in its own state dir.

use crate::Core;
use skiff_store::{Claim, LeaseKey};
use std::time::Duration;

/// Orphan sweeps and environment lifetimes: what could destroy a box.
pub(crate) const SWEEPER: &str = "sweeper";
/// The round a start-up sweep claims the sweeper for when the lifetime tick is not known.
pub(crate) const START_ROUND: Duration = Duration::from_secs(60);
/// Archiving the audit log past retention and deleting the archived rows.
pub(crate) const AUDIT_ARCHIVE: &str = "audit-archive";

impl Core {
    /// Whether this gateway does chore `name` now, which it does every `every`: it claims
    /// the chore's lease, or renews it when it is already this gateway's. A lease that
    /// cannot be read or claimed means no: a chore skipped is done at the next round.
    pub(crate) fn holds_chore(&self, name: &str, every: Duration) -> bool {
        let key = LeaseKey::singleton(name);
        let me = self.cluster.id();
        let ttl = self.cluster.lease_ttl() + every.saturating_mul(2);
        let before = self.store.lease(&key).ok().flatten();
        match self.store.acquire_lease(&key, me, ttl) {
            Ok(Claim::Won(lease)) => {
                let taken = before
                    .as_ref()
                    .is_none_or(|b| b.holder != *me || b.epoch != lease.epoch);
                if taken {
                    tracing::info!(chore = name, gateway = %me, epoch = lease.epoch,
                        "this gateway now does the gateway-wide chore");
                    self.audit(
                        &crate::auth::unattributed_scope(),
                        "chore.take",
                        name,
                        "taken",
                        serde_json::json!({ "gateway": me.as_str(), "epoch": lease.epoch }),
                    );
                }
                true
            }
            Ok(Claim::Held(lease)) => {
                tracing::debug!(chore = name, holder = %lease.holder, "another gateway does the chore");
                false
            }
            Err(e) => {
                tracing::warn!(chore = name, error = %e, "cannot claim the chore's lease; skipping it this round");
                false
            }
        }
    }

    /// Whether any gateway but this one beat within a lease's life.
    pub(crate) fn others_alive(&self) -> bool {
        match self.store.gateways(self.cluster.lease_ttl()) {
            Ok(gateways) => gateways
                .iter()
                .any(|g| g.alive && g.id != *self.cluster.id()),
            // Unknown: assume they are, and leave shared things alone.
            Err(_) => true,
        }
    }
}
