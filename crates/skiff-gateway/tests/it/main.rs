//! The gateway's own tests: a gateway in the test process (`harness`), no binary, no root.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

mod admission;
mod agents;
mod approvals;
mod compaction;
mod deadlines;
mod governed;
mod harness;
mod ingress;
mod listing;
mod mcp;
mod oidc_login;
mod operations;
mod processes;
mod proxy_auth;
mod reasoning;
mod remote_repos;
mod restart;
mod sandbox;
mod traces;
