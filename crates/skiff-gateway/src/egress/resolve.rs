//! Name resolution for the proxy, behind a trait so tests can answer with any address. The
//! proxy resolves once, checks those addresses and connects to them: the box's own resolver is
//! never asked, and nothing resolves the name a second time between check and connect.

use futures_util::future::BoxFuture;
use std::io;
use std::net::IpAddr;

pub(crate) trait Resolve: Send + Sync + 'static {
    /// Every address `host` (a DNS name, never an IP literal) resolves to.
    fn resolve<'a>(&'a self, host: &'a str) -> BoxFuture<'a, io::Result<Vec<IpAddr>>>;
}

/// The system resolver (`getaddrinfo` through tokio's blocking pool).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str) -> BoxFuture<'a, io::Result<Vec<IpAddr>>> {
        Box::pin(async move {
            let mut addrs: Vec<IpAddr> = tokio::net::lookup_host((host, 0))
                .await?
                .map(|a| a.ip())
                .collect();
            // getaddrinfo lists an address once per socket type; connect tries each once.
            let mut seen = std::collections::HashSet::new();
            addrs.retain(|ip| seen.insert(*ip));
            Ok(addrs)
        })
    }
}
