//! The agent loop and its tools, against a real temporary workspace, a scripted in-memory
//! model client and an in-memory backend.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

mod compaction;
mod patch;
mod process;
mod procs;
mod special_files;
mod tools;
mod turn;
