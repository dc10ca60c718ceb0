//! This gateway among the gateways that share one database (issue 17): its id, its row in the
//! store's gateway registry (with the address other gateways reach it at) and the heartbeat
//! that tells the others it is alive.
//!
//! The id is kept in the state dir (`gateway-id`), so a gateway restarted on the same state dir
//! is the same gateway: the leases it held are still its own and it takes them back at once
//! instead of waiting out their expiry. Two gateways never share a state dir (its lock).
//!
//! Every lease time is the database's; this module only passes durations.

use crate::state_dir::StateDir;
use crate::{Error, Result};
use skiff_protocol::GatewayId;
use skiff_store::Backend;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The name of the file in the state dir that keeps this gateway's id.
const ID_FILE: &str = "gateway-id";

/// This gateway's place among the gateways on its database.
pub(crate) struct Cluster {
    id: GatewayId,
    store: Arc<dyn Backend>,
    /// `[gateway] lease_ttl`: how long a lease lives unless renewed; a dead gateway's sessions
    /// are taken over by another within it.
    lease_ttl: Duration,
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
        })
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

/// Starts the heartbeat: every [`Cluster::beat_every`] while the gateway lives. A beat that
/// fails is logged and tried again at the next tick (the store reconnects on its own).
pub(crate) fn spawn_heartbeat(cluster: &Arc<Cluster>) {
    // Weak: the heartbeat keeps no gateway alive.
    let weak = Arc::downgrade(cluster);
    let every = cluster.beat_every();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(cluster) = weak.upgrade() else {
                return;
            };
            let beat = tokio::task::spawn_blocking(move || cluster.beat()).await;
            match beat {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "the gateway's heartbeat failed"),
                Err(e) => tracing::warn!(error = %e, "the gateway's heartbeat task failed"),
            }
        }
    });
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
