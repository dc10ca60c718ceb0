//! Workspace sync against real boxes: local sshd boxes (each with its own user), the real ssh
//! client with pinned keys, rsync, tar and git.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

mod awkward;
mod checkpoints;
mod containment;
mod fill;
mod fixture;
mod git_mode;
mod plain_mode;
