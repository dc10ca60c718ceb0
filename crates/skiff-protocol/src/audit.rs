//! The audit trail as clients read and take it away (`skiff audit tail|export`, the daily
//! archive files): metadata only — who, what, when, on which target, with what outcome.
//! Never a prompt, a completion, tool output or a secret.

use serde::{Deserialize, Serialize};

/// One audit row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditRecord {
    /// Increasing with time: `tail --follow` resumes after the last id it saw.
    pub id: i64,
    pub at_ms: i64,
    pub owner_id: String,
    pub tenant_id: String,
    /// Which part of the gateway wrote it (`api`, `worker`, `gateway`).
    pub actor: String,
    pub action: String,
    /// A session, environment, secret name or route.
    pub target: String,
    /// `applied`, `denied`, `refused`, `failed`…
    pub decision: String,
    /// Further metadata (ids, counts, reasons).
    pub detail: serde_json::Value,
}

/// A page of audit rows, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditPage {
    pub rows: Vec<AuditRecord>,
}

/// The most rows one page holds.
pub const AUDIT_PAGE_MAX: usize = 1000;
