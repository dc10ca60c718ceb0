//! Types that cross a process boundary: ids, API payloads (sessions, environments, sync),
//! approvals (policies and the rows of waiting calls), governed actions' one-time grants and results, the vault's secrets (names and dates; a value only as a request body), live events,
//! transcript entries, the normalized model conversation, the lease-CLI contract, a gateway's drain
//! and the worker protocol.
//!
//! This crate is serde types only. It deliberately has no tokio, no I/O and no behaviour beyond
//! small pure helpers, so that every process (gateway, CLI, worker) can share it without
//! pulling in each other's machinery.

pub mod agent;
pub mod api;
pub mod approval;
pub mod audit;
pub mod budget;
pub mod drain;
pub mod environment;
pub mod event;
pub mod grant;
pub mod ids;
pub mod lease;
pub mod login;
pub mod migration;
pub mod model;
pub mod people;
pub mod secrets;
pub mod sync;
pub mod transcript;
pub mod worker;

pub use ids::{
    ApprovalId, AttemptId, EntryId, EnvironmentId, GatewayId, GrantId, GroupId, RunId, SessionId,
    SnapshotId,
};
