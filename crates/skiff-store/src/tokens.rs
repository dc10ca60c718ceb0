//! API tokens (stored as hashes only), revoked Control UI cookies (by nonce hash), and the
//! append-only audit log.

use crate::{Result, Scope, Store, now_ms};
use rusqlite::params;

/// An audit row: metadata only, never prompts, completions or credentials.
#[derive(Clone, Debug, PartialEq)]
pub struct AuditRow {
    pub at_ms: i64,
    pub owner_id: String,
    pub tenant_id: String,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub decision: String,
    pub detail: serde_json::Value,
}

impl Store {
    /// Replaces every token labelled `label` by one with this hash, in one transaction. The
    /// plaintext never reaches the database.
    pub fn replace_token(&self, label: &str, hash: &str, scope: &Scope) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute("DELETE FROM tokens WHERE label = ?1", params![label])?;
        tx.execute(
            "INSERT INTO tokens (id, hash, owner_id, tenant_id, label, scope, created_at_ms)
             VALUES ('tok_' || ?4, ?1, ?2, ?3, ?4, 'admin', ?5)",
            params![hash, scope.owner_id, scope.tenant_id, label, now_ms()],
        )?;
        tx.commit()?;
        Ok(())
    }

    pub fn audit(
        &self,
        scope: &Scope,
        actor: &str,
        action: &str,
        target: &str,
        decision: &str,
        detail: &serde_json::Value,
    ) -> Result<()> {
        let id = {
            let conn = self.conn();
            conn.execute(
                "INSERT INTO audit (at_ms, owner_id, tenant_id, actor, action, target, decision, detail)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    now_ms(),
                    scope.owner_id,
                    scope.tenant_id,
                    actor,
                    action,
                    target,
                    decision,
                    detail.to_string()
                ],
            )?;
            conn.last_insert_rowid()
        };
        // After the lock is released: a listener may read the store.
        self.audit_written(id);
        Ok(())
    }

    /// Every audit row, oldest first.
    pub fn audit_rows(&self) -> Result<Vec<AuditRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT at_ms, owner_id, tenant_id, actor, action, target, decision, detail FROM audit ORDER BY id",
        )?;
        let rows = stmt
            .query_map([], |r| {
                Ok(AuditRow {
                    at_ms: r.get(0)?,
                    owner_id: r.get(1)?,
                    tenant_id: r.get(2)?,
                    actor: r.get(3)?,
                    action: r.get(4)?,
                    target: r.get(5)?,
                    decision: r.get(6)?,
                    detail: crate::json_col(r, 7)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }
}

impl Store {
    /// Refuses the UI cookie with this nonce hash from now until it expires, and drops rows of
    /// cookies that have expired by `now_ms` (their signature check refuses them anyway).
    pub fn revoke_ui_cookie(
        &self,
        scope: &Scope,
        nonce_hash: &str,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute(
            "DELETE FROM ui_revoked_cookies WHERE expires_at_ms <= ?1",
            params![now_ms],
        )?;
        tx.execute(
            "INSERT OR REPLACE INTO ui_revoked_cookies (nonce_hash, owner_id, tenant_id, expires_at_ms, revoked_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![nonce_hash, scope.owner_id, scope.tenant_id, expires_at_ms, now_ms],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Whether the UI cookie with this nonce hash was revoked (logged out).
    pub fn ui_cookie_revoked(&self, scope: &Scope, nonce_hash: &str) -> Result<bool> {
        let n: i64 = self.conn().query_row(
            "SELECT COUNT(*) FROM ui_revoked_cookies WHERE nonce_hash = ?1 AND owner_id = ?2 AND tenant_id = ?3",
            params![nonce_hash, scope.owner_id, scope.tenant_id],
            |r| r.get(0),
        )?;
        Ok(n > 0)
    }

    /// How many revocations are kept (expired ones are pruned at the next revocation).
    #[cfg(test)]
    fn ui_revoked_cookie_count(&self) -> Result<u64> {
        let n: i64 = self
            .conn()
            .query_row("SELECT COUNT(*) FROM ui_revoked_cookies", [], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revoked_cookie_stays_revoked_until_it_expires_then_is_pruned() {
        let store = Store::open_in_memory().unwrap();
        let scope = Scope::new("usr_admin", "ten_default");
        store.revoke_ui_cookie(&scope, "h1", 100, 10).unwrap();
        assert!(store.ui_cookie_revoked(&scope, "h1").unwrap());
        assert!(!store.ui_cookie_revoked(&scope, "h2").unwrap());
        assert!(
            !store
                .ui_cookie_revoked(&Scope::new("usr_other", "ten_default"), "h1")
                .unwrap(),
            "another scope's row is not ours"
        );
        store.revoke_ui_cookie(&scope, "h2", 300, 200).unwrap();
        assert_eq!(
            store.ui_revoked_cookie_count().unwrap(),
            1,
            "h1 expired at 100"
        );
    }
}
