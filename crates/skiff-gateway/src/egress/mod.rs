//! The egress proxy: the only way a box reaches the network. A box has no network of its own;
//! during its setup phase (and, if a profile says so, for the agent's `exec`) its HTTP and
//! HTTPS traffic comes through an SSH remote forward to a per-environment unix socket, where an
//! [`Egress`] serves HTTP/1.1 forward-proxy requests (`CONNECT host:port` tunnels and
//! absolute-form plain-HTTP requests) against the allowlist of the current phase.
//!
//! Owns: rule parsing and presets ([`policy`], [`presets`]), the public/non-public address
//! split ([`address`]), name resolution ([`resolve`]), the proxy itself ([`proxy`]), per-host
//! counters ([`counters`]) and the decisions handed to an audit hook.
//!
//! Deliberately not here: where the socket lives, the SSH forward, config keys and when a
//! phase changes (placements and config wire that in), TLS interception (HTTPS is a tunnel to
//! whatever the allowlist names; nothing inspects it), and caching.
//!
//! **Invariant:** never connects to a non-public address (loopback, private, link-local,
//! metadata, CGNAT, …) unless an exact rule names the host or the address; it connects only to
//! the addresses it checked (no second resolution).
//! **Invariant:** decisions and counters carry host, port, phase, verdict and reason only —
//! never a URL path, query or header, which can hold secrets.

mod address;
mod body;
mod counters;
mod http;
mod policy;
mod presets;
mod proxy;
mod resolve;
mod target;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

pub(crate) use counters::HostCounters;
pub(crate) use policy::{Policy, Refusal};
pub(crate) use proxy::{Egress, Options};

/// Which allowlist applies: the box's setup commands, or the agent's `exec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    Setup,
    Agent,
}

/// One decision, for the audit log: who was asked for, under which phase and config key, and
/// the verdict. No path, query or header is ever part of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Decision {
    pub phase: Phase,
    /// The config key of the policy that decided (`profiles.local.egress.setup`).
    pub key: String,
    pub host: String,
    pub port: u16,
    pub verdict: Verdict,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub(crate) enum Verdict {
    /// The proxy goes on to connect, to an address it checked (which may still fail: the
    /// client then gets a 502). `rule` as written (`preset:python`, `*.internal.example`).
    Allowed {
        rule: String,
    },
    Refused {
        reason: Refusal,
    },
}

impl Decision {
    pub(crate) fn allowed(&self) -> bool {
        matches!(self.verdict, Verdict::Allowed { .. })
    }
}
