//! `skiff-test-pg COMMAND [ARG…]`: runs COMMAND (a test run, e.g. `cargo nextest run -p
//! skiff-cli`) on PostgreSQL. It starts one throwaway cluster (`PgCluster::start_shared`),
//! runs COMMAND with `SKIFF_TEST_STORE=postgres` and `SKIFF_TEST_PG_HOST` naming the cluster's
//! socket directory — so every test process makes its database there instead of starting a
//! server of its own — stops the cluster when COMMAND ends, and exits with COMMAND's status.
//! Killed outright, it takes the server with it (the server's parent-death signal).
//! `SKIFF_TEST_PG_LOG=FILE` keeps the server's log there (every statement that failed, with
//! its error: what to read when a test passes on SQLite only).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test tool: failing loudly is the point"
)]

use skiff_test_support::postgres::{PgCluster, SHARED_HOST_ENV};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(program) = args.next() else {
        eprintln!(
            "usage: skiff-test-pg COMMAND [ARG…] — e.g. skiff-test-pg cargo nextest run -p skiff-cli"
        );
        return ExitCode::from(2);
    };
    let cluster = PgCluster::start_shared();
    let startup = cluster.startup();
    eprintln!(
        "› PostgreSQL for this run: socket in {} (initdb {}, copy and start {:.2?})",
        cluster.socket_dir().display(),
        startup
            .initdb
            .map_or_else(|| "reused".to_owned(), |d| format!("{d:.2?}")),
        startup.copy_and_start,
    );
    let status = Command::new(&program)
        .args(args)
        .env("SKIFF_TEST_STORE", "postgres")
        .env(SHARED_HOST_ENV, cluster.socket_dir())
        .status();
    if let Some(path) = std::env::var_os("SKIFF_TEST_PG_LOG")
        && let Err(e) = std::fs::write(&path, cluster.log())
    {
        eprintln!(
            "skiff-test-pg: could not keep the server's log in {}: {e}",
            path.to_string_lossy()
        );
    }
    drop(cluster);
    match status {
        Ok(status) => ExitCode::from(status.code().map_or(1, |c| u8::try_from(c).unwrap_or(1))),
        Err(e) => {
            eprintln!(
                "skiff-test-pg: could not run {}: {e}",
                program.to_string_lossy()
            );
            ExitCode::from(127)
        }
    }
}
