//! The `ssh` provider: a static host you already run. Development only: the box is not
//! disposable, a worker on a shared host can read unrelated data, and nothing is torn down.

use crate::{Error, Lease, LeaseStatus, ProfileConfig, Result, WorkerProvider, derive_lease_id};
use futures_util::future::BoxFuture;
use std::path::PathBuf;

pub struct StaticSsh {
    host: String,
    port: u16,
    user: String,
    identity_file: PathBuf,
    host_key: String,
    /// Leases given back. A static host has no lease state of its own; this is what lets
    /// `inspect` confirm a release.
    released: std::sync::Mutex<std::collections::HashSet<String>>,
}

fn expand_home(path: &std::path::Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

impl StaticSsh {
    pub fn new(name: &str, profile: &ProfileConfig) -> Result<Self> {
        let missing = |key: &str| Error::Config {
            profile: name.to_owned(),
            problem: format!("provider \"ssh\" needs `{key}`"),
        };
        Ok(Self {
            host: profile.host.clone().ok_or_else(|| missing("host"))?,
            port: profile.port.unwrap_or(22),
            user: profile.user.clone().ok_or_else(|| missing("user"))?,
            identity_file: expand_home(
                &profile
                    .identity_file
                    .clone()
                    .ok_or_else(|| missing("identity_file"))?,
            ),
            host_key: profile
                .known_host_key
                .clone()
                .ok_or_else(|| missing("known_host_key"))?,
            released: std::sync::Mutex::default(),
        })
    }
}

impl WorkerProvider for StaticSsh {
    fn kind(&self) -> &'static str {
        "ssh"
    }

    fn development_only(&self) -> bool {
        true
    }

    fn lease_id_for(&self, op_id: &str) -> String {
        derive_lease_id("ssh_", op_id)
    }

    fn provision<'a>(&'a self, op_id: &'a str) -> BoxFuture<'a, Result<Lease>> {
        Box::pin(async move {
            Ok(Lease {
                lease_id: self.lease_id_for(op_id),
                host: self.host.clone(),
                port: self.port,
                user: self.user.clone(),
                identity_file: self.identity_file.clone(),
                host_key: self.host_key.clone(),
                proxy_command: None,
                expires_at_ms: None,
            })
        })
    }

    /// Whether the host answers is the gateway's SSH check; a released lease is gone.
    fn inspect<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<LeaseStatus>> {
        Box::pin(async move {
            let released = self
                .released
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(lease_id);
            Ok(if released {
                LeaseStatus::Gone
            } else {
                LeaseStatus::Running
            })
        })
    }

    fn renew<'a>(&'a self, _lease_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { Ok(()) })
    }

    /// Nothing to tear down: the host is yours. The lease is released and forgotten.
    fn destroy<'a>(&'a self, lease_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.released
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(lease_id.to_owned());
            Ok(())
        })
    }

    fn list<'a>(&'a self) -> BoxFuture<'a, Result<Vec<String>>> {
        Box::pin(async move { Ok(Vec::new()) })
    }
}
