//! The people and governance aggregates: users and their tokens (and revoked UI cookies), the
//! audit trail, approvals, one-time grants, the vault's sealed rows, agent specs (with the chat
//! ingress's replay fence and thread map) and the usage ledger. Each is implemented by the
//! SQLite [`Store`] (delegating to its own methods) and by [`PgStore`](crate::PgStore)
//! (`pg/people.rs`, `pg/audit.rs`, `pg/approvals.rs`, `pg/vault.rs`, `pg/specs.rs`,
//! `pg/usage.rs`), held to the conformance suite.
//!
//! What must hold across gateways holds in the database on both backends: an email is one
//! person's whatever its case (a unique index on its folded form), an approval leaves
//! `pending` once and a grant is consumed once (conditional updates), a chat event id is
//! accepted once (an insert that does nothing on conflict).

use crate::{
    AgentSpecRow, AuditRow, Consumed, NewApproval, NewGrant, Resealed, Result, Scope, SecretRow,
    Sight, Store, TokenRow, Used, UsedBy, UserRow,
};
use skiff_protocol::approval::{ApprovalState, ApprovalView};
use skiff_protocol::audit::AuditRecord;
use skiff_protocol::model::Usage;
use skiff_protocol::people::{Role, TokenScope};
use skiff_protocol::{ApprovalId, GrantId, RunId, SessionId};

/// Users, their tokens (hashes only) and the Control UI cookies refused since a logout.
pub trait People: Send + Sync {
    /// A user with a fresh id; `UserExists` when an email equal but for case is anyone's.
    fn add_user(&self, email: &str, role: Role, tenant: &str) -> Result<UserRow>;
    /// The users of `tenant` (every tenant with `None`), oldest first.
    fn users(&self, tenant: Option<&str>) -> Result<Vec<UserRow>>;
    /// The user with this email compared without case, within `tenant` (any with `None`).
    fn user_by_email(&self, email: &str, tenant: Option<&str>) -> Result<UserRow>;
    /// The user a scope belongs to.
    fn user_of(&self, scope: &Scope) -> Result<Option<UserRow>>;
    /// Removes the user and their tokens at once; the ids of the tokens removed.
    fn remove_user(&self, user: &UserRow) -> Result<Vec<String>>;
    fn add_token(
        &self,
        scope: &Scope,
        hash: &str,
        label: &str,
        cap: TokenScope,
        expires_at_ms: Option<i64>,
    ) -> Result<TokenRow>;
    /// Every stored token, oldest first.
    fn token_rows(&self) -> Result<Vec<TokenRow>>;
    /// The token stored with this hash, if any.
    fn token_by_hash(&self, hash: &str) -> Result<Option<TokenRow>>;
    /// Stores admin token `tok_<label>` with this hash unless it exists; `true` when this
    /// call stored it.
    fn add_token_if_absent(&self, label: &str, hash: &str, scope: &Scope) -> Result<bool>;
    /// Removes token `id` within `tenant` (any with `None`).
    fn revoke_token(&self, id: &str, tenant: Option<&str>) -> Result<TokenRow>;
    /// Replaces every token labelled `label` by one admin token with this hash.
    fn replace_token(&self, label: &str, hash: &str, scope: &Scope) -> Result<()>;
    /// Refuses a UI cookie until it expires, pruning revocations expired by `now_ms`.
    fn revoke_ui_cookie(
        &self,
        scope: &Scope,
        nonce_hash: &str,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<()>;
    fn ui_cookie_revoked(&self, scope: &Scope, nonce_hash: &str) -> Result<bool>;
}

/// The append-only audit trail: ids increase in the order rows become visible, so a reader
/// resuming after the last id it saw misses none.
pub trait AuditLog: Send + Sync {
    fn audit(
        &self,
        scope: &Scope,
        actor: &str,
        action: &str,
        target: &str,
        decision: &str,
        detail: &serde_json::Value,
    ) -> Result<()>;
    /// Writes a row at a given time (archiving and retention tests).
    fn audit_at(&self, at_ms: i64, scope: &Scope, action: &str, target: &str) -> Result<()>;
    /// Every row, oldest first.
    fn audit_rows(&self) -> Result<Vec<AuditRow>>;
    /// The newest `n` rows, oldest first.
    fn audit_last(&self, n: usize) -> Result<Vec<AuditRecord>>;
    /// Up to `n` rows with `since_ms <= at_ms < until_ms` and an id above `after`.
    fn audit_range(
        &self,
        since_ms: i64,
        until_ms: i64,
        after: i64,
        n: usize,
    ) -> Result<Vec<AuditRecord>>;
    /// The UTC day numbers before `before_ms` that have rows.
    fn audit_days_before(&self, before_ms: i64) -> Result<Vec<i64>>;
    /// Removes a UTC day's rows older than `before_ms`; how many went.
    fn delete_audit_day(&self, day: i64, before_ms: i64) -> Result<usize>;
}

/// Tool calls waiting for a person.
pub trait Approvals: Send + Sync {
    fn create_approval(&self, scope: &Scope, new: &NewApproval) -> Result<ApprovalView>;
    fn approval(&self, scope: &Scope, id: &ApprovalId) -> Result<ApprovalView>;
    /// What the sight sees, newest first (one session's, or all; only pending ones).
    fn approvals(
        &self,
        sight: &Sight,
        session: Option<&SessionId>,
        pending_only: bool,
    ) -> Result<Vec<ApprovalView>>;
    /// Moves a pending approval to `to`; `Ok(None)` when it had already left `pending`.
    fn settle_approval(
        &self,
        scope: &Scope,
        id: &ApprovalId,
        to: ApprovalState,
        decided_by: &str,
        reason: Option<&str>,
    ) -> Result<Option<ApprovalView>>;
    /// Revokes the pending approvals of sessions no gateway but `gateway` holds the lease of
    /// unexpired (every pending one with `None`), across scopes; how many.
    fn expire_orphaned_approvals(
        &self,
        gateway: Option<&skiff_protocol::GatewayId>,
        reason: &str,
    ) -> Result<usize>;
}

/// One-time invocation grants.
pub trait Grants: Send + Sync {
    fn register_grant(&self, scope: &Scope, grant: &NewGrant) -> Result<()>;
    /// Consumes the grant once, whichever connection asks first.
    fn consume_grant(&self, scope: &Scope, session: &SessionId, id: &GrantId) -> Result<Consumed>;
}

/// The vault's sealed rows (this store never sees a key or a plaintext).
pub trait Vault: Send + Sync {
    /// A new row, or the existing one replaced keeping its creation date.
    fn put_secret(&self, name: &str, sealed: &Resealed) -> Result<SecretRow>;
    fn secret(&self, name: &str) -> Result<Option<SecretRow>>;
    /// Every secret, by name.
    fn secrets(&self) -> Result<Vec<SecretRow>>;
    /// Whether `name` existed.
    fn delete_secret(&self, name: &str) -> Result<bool>;
    /// Reseals every secret, all or none: an error from `reseal` (or, on PostgreSQL, a secret
    /// changed by another gateway meanwhile) leaves every row as it was. How many.
    fn reseal_secrets(
        &self,
        reseal: &mut dyn FnMut(&SecretRow) -> Result<Resealed>,
    ) -> Result<usize>;
}

/// Agent spec versions, the version each session is pinned to, and the chat ingress's rows.
pub trait AgentSpecs: Send + Sync {
    /// Marks this version as current; whether it is new.
    fn put_agent_spec(&self, name: &str, digest: &str, content: &str) -> Result<bool>;
    /// Every version of `name`, current first.
    fn agent_spec_versions(&self, name: &str) -> Result<Vec<AgentSpecRow>>;
    /// The current version of every spec, by name.
    fn agent_specs(&self) -> Result<Vec<AgentSpecRow>>;
    fn pin_session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
        name: &str,
        digest: &str,
    ) -> Result<()>;
    fn session_agent(&self, scope: &Scope, session: &SessionId)
    -> Result<Option<(String, String)>>;
    /// `false` when the event id was seen before (a replay).
    fn ingress_event_first_seen(&self, event_id: &str, forget_before_ms: i64) -> Result<bool>;
    fn ingress_thread(&self, channel: &str, thread_ts: &str) -> Result<Option<(Scope, SessionId)>>;
    fn put_ingress_thread(
        &self,
        scope: &Scope,
        channel: &str,
        thread_ts: &str,
        session: &SessionId,
    ) -> Result<()>;
}

/// The usage ledger behind budgets.
pub trait UsageLedger: Send + Sync {
    /// Adds a model response's usage to its run and a ledger row at its cost.
    fn add_run_usage(&self, scope: &Scope, id: &RunId, usage: Usage, cost_usd: f64) -> Result<()>;
    fn session_usage(&self, scope: &Scope, session: &SessionId) -> Result<Used>;
    fn user_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used>;
    fn tenant_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used>;
    /// Per user, then per session, from `since_ms` on (the admin's report).
    fn usage_since(&self, since_ms: i64) -> Result<Vec<UsedBy>>;
}

// The SQLite store: each line calls its inherent method (inherent methods win the lookup).

impl People for Store {
    fn add_user(&self, email: &str, role: Role, tenant: &str) -> Result<UserRow> {
        Store::add_user(self, email, role, tenant)
    }
    fn users(&self, tenant: Option<&str>) -> Result<Vec<UserRow>> {
        Store::users(self, tenant)
    }
    fn user_by_email(&self, email: &str, tenant: Option<&str>) -> Result<UserRow> {
        Store::user_by_email(self, email, tenant)
    }
    fn user_of(&self, scope: &Scope) -> Result<Option<UserRow>> {
        Store::user_of(self, scope)
    }
    fn remove_user(&self, user: &UserRow) -> Result<Vec<String>> {
        Store::remove_user(self, user)
    }
    fn add_token(
        &self,
        scope: &Scope,
        hash: &str,
        label: &str,
        cap: TokenScope,
        expires_at_ms: Option<i64>,
    ) -> Result<TokenRow> {
        Store::add_token(self, scope, hash, label, cap, expires_at_ms)
    }
    fn token_rows(&self) -> Result<Vec<TokenRow>> {
        Store::token_rows(self)
    }
    fn token_by_hash(&self, hash: &str) -> Result<Option<TokenRow>> {
        Store::token_by_hash(self, hash)
    }
    fn add_token_if_absent(&self, label: &str, hash: &str, scope: &Scope) -> Result<bool> {
        Store::add_token_if_absent(self, label, hash, scope)
    }
    fn revoke_token(&self, id: &str, tenant: Option<&str>) -> Result<TokenRow> {
        Store::revoke_token(self, id, tenant)
    }
    fn replace_token(&self, label: &str, hash: &str, scope: &Scope) -> Result<()> {
        Store::replace_token(self, label, hash, scope)
    }
    fn revoke_ui_cookie(
        &self,
        scope: &Scope,
        nonce_hash: &str,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<()> {
        Store::revoke_ui_cookie(self, scope, nonce_hash, expires_at_ms, now_ms)
    }
    fn ui_cookie_revoked(&self, scope: &Scope, nonce_hash: &str) -> Result<bool> {
        Store::ui_cookie_revoked(self, scope, nonce_hash)
    }
}

impl AuditLog for Store {
    fn audit(
        &self,
        scope: &Scope,
        actor: &str,
        action: &str,
        target: &str,
        decision: &str,
        detail: &serde_json::Value,
    ) -> Result<()> {
        Store::audit(self, scope, actor, action, target, decision, detail)
    }
    fn audit_at(&self, at_ms: i64, scope: &Scope, action: &str, target: &str) -> Result<()> {
        Store::audit_at(self, at_ms, scope, action, target)
    }
    fn audit_rows(&self) -> Result<Vec<AuditRow>> {
        Store::audit_rows(self)
    }
    fn audit_last(&self, n: usize) -> Result<Vec<AuditRecord>> {
        Store::audit_last(self, n)
    }
    fn audit_range(
        &self,
        since_ms: i64,
        until_ms: i64,
        after: i64,
        n: usize,
    ) -> Result<Vec<AuditRecord>> {
        Store::audit_range(self, since_ms, until_ms, after, n)
    }
    fn audit_days_before(&self, before_ms: i64) -> Result<Vec<i64>> {
        Store::audit_days_before(self, before_ms)
    }
    fn delete_audit_day(&self, day: i64, before_ms: i64) -> Result<usize> {
        Store::delete_audit_day(self, day, before_ms)
    }
}

impl Approvals for Store {
    fn create_approval(&self, scope: &Scope, new: &NewApproval) -> Result<ApprovalView> {
        Store::create_approval(self, scope, new)
    }
    fn approval(&self, scope: &Scope, id: &ApprovalId) -> Result<ApprovalView> {
        Store::approval(self, scope, id)
    }
    fn approvals(
        &self,
        sight: &Sight,
        session: Option<&SessionId>,
        pending_only: bool,
    ) -> Result<Vec<ApprovalView>> {
        Store::approvals(self, sight, session, pending_only)
    }
    fn settle_approval(
        &self,
        scope: &Scope,
        id: &ApprovalId,
        to: ApprovalState,
        decided_by: &str,
        reason: Option<&str>,
    ) -> Result<Option<ApprovalView>> {
        Store::settle_approval(self, scope, id, to, decided_by, reason)
    }
    fn expire_orphaned_approvals(
        &self,
        gateway: Option<&skiff_protocol::GatewayId>,
        reason: &str,
    ) -> Result<usize> {
        Store::expire_orphaned_approvals(self, gateway, reason)
    }
}

impl Grants for Store {
    fn register_grant(&self, scope: &Scope, grant: &NewGrant) -> Result<()> {
        Store::register_grant(self, scope, grant)
    }
    fn consume_grant(&self, scope: &Scope, session: &SessionId, id: &GrantId) -> Result<Consumed> {
        Store::consume_grant(self, scope, session, id)
    }
}

impl Vault for Store {
    fn put_secret(&self, name: &str, sealed: &Resealed) -> Result<SecretRow> {
        Store::put_secret(self, name, sealed)
    }
    fn secret(&self, name: &str) -> Result<Option<SecretRow>> {
        Store::secret(self, name)
    }
    fn secrets(&self) -> Result<Vec<SecretRow>> {
        Store::secrets(self)
    }
    fn delete_secret(&self, name: &str) -> Result<bool> {
        Store::delete_secret(self, name)
    }
    fn reseal_secrets(
        &self,
        reseal: &mut dyn FnMut(&SecretRow) -> Result<Resealed>,
    ) -> Result<usize> {
        Store::reseal_secrets(self, reseal)
    }
}

impl AgentSpecs for Store {
    fn put_agent_spec(&self, name: &str, digest: &str, content: &str) -> Result<bool> {
        Store::put_agent_spec(self, name, digest, content)
    }
    fn agent_spec_versions(&self, name: &str) -> Result<Vec<AgentSpecRow>> {
        Store::agent_spec_versions(self, name)
    }
    fn agent_specs(&self) -> Result<Vec<AgentSpecRow>> {
        Store::agent_specs(self)
    }
    fn pin_session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
        name: &str,
        digest: &str,
    ) -> Result<()> {
        Store::pin_session_agent(self, scope, session, name, digest)
    }
    fn session_agent(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<Option<(String, String)>> {
        Store::session_agent(self, scope, session)
    }
    fn ingress_event_first_seen(&self, event_id: &str, forget_before_ms: i64) -> Result<bool> {
        Store::ingress_event_first_seen(self, event_id, forget_before_ms)
    }
    fn ingress_thread(&self, channel: &str, thread_ts: &str) -> Result<Option<(Scope, SessionId)>> {
        Store::ingress_thread(self, channel, thread_ts)
    }
    fn put_ingress_thread(
        &self,
        scope: &Scope,
        channel: &str,
        thread_ts: &str,
        session: &SessionId,
    ) -> Result<()> {
        Store::put_ingress_thread(self, scope, channel, thread_ts, session)
    }
}

impl UsageLedger for Store {
    fn add_run_usage(&self, scope: &Scope, id: &RunId, usage: Usage, cost_usd: f64) -> Result<()> {
        Store::add_run_usage(self, scope, id, usage, cost_usd)
    }
    fn session_usage(&self, scope: &Scope, session: &SessionId) -> Result<Used> {
        Store::session_usage(self, scope, session)
    }
    fn user_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used> {
        Store::user_usage(self, scope, since_ms)
    }
    fn tenant_usage(&self, scope: &Scope, since_ms: i64) -> Result<Used> {
        Store::tenant_usage(self, scope, since_ms)
    }
    fn usage_since(&self, since_ms: i64) -> Result<Vec<UsedBy>> {
        Store::usage_since(self, since_ms)
    }
}
