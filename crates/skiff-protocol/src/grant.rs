//! Governed actions (`git_push`, `open_pull_request`): the claims of the one-time invocation
//! grant the gateway mints before one runs, and the typed results the agent reads.
//!
//! A grant carries no credential: it says who asked, for which session, which capability on
//! which target, the digest of the exact arguments, and whether a person must confirm it.

use crate::{GrantId, SessionId};
use serde::{Deserialize, Serialize};

/// What a governed action may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// Push the session branch to the session repository's remote.
    GitPush,
    /// Open a pull request on the forge.
    OpenPullRequest,
}

impl Capability {
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::GitPush => "git_push",
            Capability::OpenPullRequest => "open_pull_request",
        }
    }

    /// The capability a tool of this name exercises.
    pub fn of_tool(name: &str) -> Option<Capability> {
        match name {
            "git_push" => Some(Capability::GitPush),
            "open_pull_request" => Some(Capability::OpenPullRequest),
            _ => None,
        }
    }
}

/// The signed part of a grant (the gateway's MAC covers its canonical JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantClaims {
    pub id: GrantId,
    /// Who proposed the action (the session's owner) and their tenant.
    pub requester: String,
    pub tenant: String,
    pub session: SessionId,
    pub capability: Capability,
    /// What the action touches: `REMOTE refs/heads/BRANCH` or `OWNER/REPO`.
    pub target: String,
    /// BLAKE3 (hex) of the canonical JSON of the exact arguments.
    pub digest: String,
    /// Which revision of the governed-actions policy minted it.
    pub policy_revision: String,
    /// Whether a person had to confirm it before it could run.
    pub confirm: bool,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
}

/// What `git_push` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GitPushResult {
    pub remote: String,
    /// The branch pushed (its own name on the remote).
    pub branch: String,
    pub commit: String,
    pub grant: GrantId,
}

/// What `open_pull_request` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequestResult {
    pub number: u64,
    pub url: String,
    pub repository: String,
    pub head: String,
    pub base: String,
    pub grant: GrantId,
}
