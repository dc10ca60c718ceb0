//! Token and cost budgets as clients read them: what a session, a user (a scope's owner) or a
//! tenant used in a budget's window against its limit (`skiff session show`, `skiff admin
//! usage`, the Control UI's session header).

use serde::{Deserialize, Serialize};

/// Who a budget line counts for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSubject {
    /// One session, over its whole life.
    Session,
    /// One user (the owner of a scope), per UTC day.
    User,
    /// One tenant, per UTC day.
    Tenant,
}

impl BudgetSubject {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::User => "user",
            Self::Tenant => "tenant",
        }
    }
}

/// One subject's usage in one window, with the limits that apply to it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageLine {
    pub subject: BudgetSubject,
    /// The session id, the owner id or the tenant id.
    pub id: String,
    /// `session` (its whole life) or the UTC day counted, `2026-12-02`.
    pub window: String,
    /// Input (cache reads included) plus output tokens.
    pub tokens: u64,
    /// In US dollars at the prices the catalog had when each call was recorded; a model
    /// without prices adds nothing.
    pub cost_usd: f64,
    /// The token limit in force, absent when none is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_limit: Option<u64>,
    /// The cost limit in force, absent when none is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd_limit: Option<f64>,
    /// True when a limit is reached: the subject's next model call is refused.
    pub exhausted: bool,
}

/// `GET /v1/admin/usage` (admin only): every user, tenant and session that used a model
/// today (UTC), and the sessions' lifetime totals.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageReport {
    /// The UTC day the per-day lines count, `2026-12-02`.
    pub day: String,
    pub lines: Vec<UsageLine>,
}
