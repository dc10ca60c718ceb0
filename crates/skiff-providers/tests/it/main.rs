//! The providers against the real system: local boxes (each with its own user and sshd, as
//! root), reached with the real ssh client and pinned keys.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

mod command;
mod snapshots;
