//! End-to-end: the real `skiff` binary, a real gateway process, real git repositories, and a
//! scripted model (the only stand-in).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

mod adopt;
mod agents;
mod api;
mod approvals;
mod audit;
mod bad_input;
mod barrier_faults;
mod box_isolation;
mod budgets;
mod deadlines;
mod dispatch;
mod drain;
mod egress;
mod env;
mod fanout;
mod gateway_trust;
mod gateways;
mod handoff;
mod harness;
mod homecoming;
mod leftovers;
mod login;
mod mcp;
mod migrate;
mod newcomer;
mod parking;
mod people;
mod postgres;
mod pull_back;
mod reasoning;
mod restore;
mod results;
mod rewind;
mod session;
mod setup;
mod snapshots;
mod snapshots_cli;
mod sync;
mod takeover;
mod ui;
mod usage;
mod vault;
mod worker;
mod worker_faults;
mod worker_hostile;
