//! Per-phase, per-host counts of what went through the proxy: connections made, bytes each
//! way, refusals. Counted live (a long download shows up while it runs), read as a snapshot.
//!
//! The map is bounded: a box could ask for a million distinct names, so past
//! [`MAX_HOSTS_PER_PHASE`] hosts in a phase the rest are counted together under
//! [`OTHER_HOSTS`].

use super::Phase;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub(crate) const MAX_HOSTS_PER_PHASE: usize = 1024;
pub(crate) const OTHER_HOSTS: &str = "(other hosts)";

/// One host's counts in one phase.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HostCounters {
    pub phase: Phase,
    /// As the box named it (`pypi.org`, `10.0.0.1`, `[fd00::1]`), without the port.
    pub host: String,
    /// Upstream connections made (a refused request is not one).
    pub connections: u64,
    /// Bytes sent to the host (request heads and bodies, tunnelled bytes).
    pub bytes_out: u64,
    /// Bytes received from the host.
    pub bytes_in: u64,
    pub refused: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Tally {
    connections: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
    refused: AtomicU64,
}

impl Tally {
    pub(crate) fn connected(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    hosts: Mutex<HashMap<(Phase, String), Arc<Tally>>>,
}

impl Counters {
    /// The tally for `host` in `phase`, made on first use.
    pub(crate) fn tally(&self, phase: Phase, host: &str) -> Arc<Tally> {
        // A panic while holding this lock leaves only counts behind, never a broken invariant.
        let mut hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tally) = hosts.get(&(phase, host.to_owned())) {
            return tally.clone();
        }
        let in_phase = hosts.keys().filter(|(p, _)| *p == phase).count();
        let host = if in_phase >= MAX_HOSTS_PER_PHASE {
            OTHER_HOSTS
        } else {
            host
        };
        hosts.entry((phase, host.to_owned())).or_default().clone()
    }

    /// Every host's counts, by phase then host.
    pub(crate) fn snapshot(&self) -> Vec<HostCounters> {
        let hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<HostCounters> = hosts
            .iter()
            .map(|((phase, host), t)| HostCounters {
                phase: *phase,
                host: host.clone(),
                connections: t.connections.load(Ordering::Relaxed),
                bytes_out: t.bytes_out.load(Ordering::Relaxed),
                bytes_in: t.bytes_in.load(Ordering::Relaxed),
                refused: t.refused.load(Ordering::Relaxed),
            })
            .collect();
        out.sort_by(|a, b| (a.phase, &a.host).cmp(&(b.phase, &b.host)));
        out
    }
}

/// An upstream stream whose reads count as bytes in and writes as bytes out.
pub(crate) struct Counted<T> {
    inner: T,
    tally: Arc<Tally>,
}

impl<T> Counted<T> {
    pub(crate) fn new(inner: T, tally: Arc<Tally>) -> Self {
        Counted { inner, tally }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        let n = (buf.filled().len() - before) as u64;
        self.tally.bytes_in.fetch_add(n, Ordering::Relaxed);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut self.inner).poll_write(cx, buf))?;
        self.tally.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut self.inner).poll_write_vectored(cx, bufs))?;
        self.tally.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_names_is_folded_into_one_row() {
        let counters = Counters::default();
        for i in 0..MAX_HOSTS_PER_PHASE + 50 {
            counters
                .tally(Phase::Setup, &format!("h{i}.example"))
                .refused();
        }
        counters.tally(Phase::Agent, "a.example").refused();
        let snap = counters.snapshot();
        assert_eq!(snap.len(), MAX_HOSTS_PER_PHASE + 2);
        let other = snap.iter().find(|c| c.host == OTHER_HOSTS).unwrap();
        assert_eq!((other.phase, other.refused), (Phase::Setup, 50));
        assert_eq!(snap.iter().map(|c| c.refused).sum::<u64>(), 1075);
    }
}
