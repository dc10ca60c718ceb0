//! What `skiff admin migrate --to postgres://…` reports (`--json`): each table copied from the
//! SQLite state into PostgreSQL, with its row count and checksum read on both sides.

use serde::{Deserialize, Serialize};

/// The outcome of a migration, printed whether it committed or was rolled back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationReport {
    /// The SQLite database copied (`<state-dir>/skiff.db`).
    pub source: String,
    /// The PostgreSQL url with its password replaced by `***`.
    pub target: String,
    /// In the order they were copied (parents before the tables that refer to them).
    pub tables: Vec<TableCheck>,
    /// Whether the copy was committed: every table's counts and checksums agree.
    pub committed: bool,
    pub elapsed_ms: u64,
}

impl MigrationReport {
    /// Rows copied, all tables together.
    pub fn rows(&self) -> u64 {
        self.tables.iter().map(|t| t.sqlite_rows).sum()
    }
}

/// One table: its rows and checksum as read from SQLite and as read back from PostgreSQL in
/// the migration's own transaction. The checksum is the blake3 (hex) of the table's rows in
/// primary-key order, each value in a canonical form both databases give the same (see
/// `skiff_store::copy`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableCheck {
    pub table: String,
    pub sqlite_rows: u64,
    pub postgres_rows: u64,
    pub sqlite_checksum: String,
    pub postgres_checksum: String,
}

impl TableCheck {
    pub fn matches(&self) -> bool {
        self.sqlite_rows == self.postgres_rows && self.sqlite_checksum == self.postgres_checksum
    }
}
