//! Users (a role in a tenant) and the tokens they sign in with. Token verification and the
//! lookups behind it are the gateway's own work across scopes; the rest is an admin's, within
//! the tenant the gateway passes (or every tenant for the gateway's first admin).

use crate::{Error, Result, Scope, Store, now_ms};
use rusqlite::{OptionalExtension, params};
use skiff_protocol::people::{Role, TokenScope};

/// The first admin: the user behind the token in `gateway.json`.
pub const FIRST_ADMIN: &str = "usr_admin";
/// The first admin's tenant, and every user's unless `--tenant` names another.
pub const DEFAULT_TENANT: &str = "ten_default";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserRow {
    pub id: String,
    pub tenant_id: String,
    pub email: String,
    pub role: Role,
    pub created_at_ms: i64,
}

impl UserRow {
    /// The scope every row this user makes is written under.
    pub fn scope(&self) -> Scope {
        Scope::new(self.id.clone(), self.tenant_id.clone())
    }
}

/// A stored token: its hash, never its plaintext.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRow {
    pub id: String,
    pub hash: String,
    pub scope: Scope,
    pub label: String,
    pub cap: TokenScope,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
}

const USER_COLUMNS: &str = "id, tenant_id, email, role, created_at_ms";

fn user_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<UserRow> {
    let role: String = r.get(3)?;
    Ok(UserRow {
        id: r.get(0)?,
        tenant_id: r.get(1)?,
        email: r.get(2)?,
        role: Role::parse(&role).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                3,
                rusqlite::types::Type::Text,
                format!("unknown role {role:?}").into(),
            )
        })?,
        created_at_ms: r.get(4)?,
    })
}

const TOKEN_COLUMNS: &str =
    "id, hash, owner_id, tenant_id, label, scope, created_at_ms, expires_at_ms";

fn token_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<TokenRow> {
    let cap: String = r.get(5)?;
    Ok(TokenRow {
        id: r.get(0)?,
        hash: r.get(1)?,
        scope: Scope::new(r.get::<_, String>(2)?, r.get::<_, String>(3)?),
        label: r.get(4)?,
        cap: TokenScope::parse(&cap).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                5,
                rusqlite::types::Type::Text,
                format!("unknown token scope {cap:?}").into(),
            )
        })?,
        created_at_ms: r.get(6)?,
        expires_at_ms: r.get(7)?,
    })
}

impl Store {
    /// Adds a user with a fresh id in `tenant`; their email is stored as given. One that
    /// differs from a user's only in case is that user's (in any tenant), so it is refused.
    pub fn add_user(&self, email: &str, role: Role, tenant: &str) -> Result<UserRow> {
        let id = format!("usr_{}", crate::mint()?);
        let now = now_ms();
        let conn = self.conn();
        // The unique index on the folded email decides, even against another connection
        // adding the same person at the same moment.
        let inserted = conn.execute(
            "INSERT INTO users (id, owner_id, tenant_id, email, role, created_at_ms)
             VALUES (?1, ?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
            params![id, tenant, email, role.as_str(), now],
        )?;
        if inserted == 0 {
            let existing: String = conn.query_row(
                "SELECT email FROM users WHERE lower(email) = lower(?1)",
                params![email],
                |r| r.get(0),
            )?;
            return Err(Error::UserExists {
                email: email.to_owned(),
                existing,
            });
        }
        Ok(UserRow {
            id,
            tenant_id: tenant.to_owned(),
            email: email.to_owned(),
            role,
            created_at_ms: now,
        })
    }

    /// The users of `tenant`, or of every tenant with `None`, oldest first.
    pub fn users(&self, tenant: Option<&str>) -> Result<Vec<UserRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {USER_COLUMNS} FROM users WHERE ?1 IS NULL OR tenant_id = ?1 \
             ORDER BY created_at_ms, email"
        ))?;
        let rows = stmt
            .query_map(params![tenant], user_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// The user with this email, compared without case, within `tenant` (any tenant with
    /// `None`).
    pub fn user_by_email(&self, email: &str, tenant: Option<&str>) -> Result<UserRow> {
        self.conn()
            .query_row(
                &format!(
                    "SELECT {USER_COLUMNS} FROM users WHERE lower(email) = lower(?1) AND (?2 IS NULL OR tenant_id = ?2)"
                ),
                params![email, tenant],
                user_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "user",
                id: email.to_owned(),
            })
    }

    /// The user a scope belongs to (token verification: across tenants).
    pub fn user_of(&self, scope: &Scope) -> Result<Option<UserRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!("SELECT {USER_COLUMNS} FROM users WHERE id = ?1 AND tenant_id = ?2"),
                params![scope.owner_id, scope.tenant_id],
                user_row,
            )
            .optional()?)
    }

    /// Removes a user and every token of theirs, in one transaction; their sessions and other
    /// rows stay (and stay theirs). Returns the ids of the tokens removed.
    pub fn remove_user(&self, user: &UserRow) -> Result<Vec<String>> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let ids = {
            let mut stmt =
                tx.prepare("SELECT id FROM tokens WHERE owner_id = ?1 AND tenant_id = ?2")?;
            stmt.query_map(params![user.id, user.tenant_id], |r| r.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        tx.execute(
            "DELETE FROM tokens WHERE owner_id = ?1 AND tenant_id = ?2",
            params![user.id, user.tenant_id],
        )?;
        tx.execute(
            "DELETE FROM users WHERE id = ?1 AND tenant_id = ?2",
            params![user.id, user.tenant_id],
        )?;
        tx.commit()?;
        Ok(ids)
    }

    /// Stores a token for `scope` (its user) with its hash only.
    pub fn add_token(
        &self,
        scope: &Scope,
        hash: &str,
        label: &str,
        cap: TokenScope,
        expires_at_ms: Option<i64>,
    ) -> Result<TokenRow> {
        let id = format!("tok_{}", crate::mint()?);
        let now = now_ms();
        self.conn().execute(
            "INSERT INTO tokens (id, hash, owner_id, tenant_id, label, scope, created_at_ms, expires_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![id, hash, scope.owner_id, scope.tenant_id, label, cap.as_str(), now, expires_at_ms],
        )?;
        Ok(TokenRow {
            id,
            hash: hash.to_owned(),
            scope: scope.clone(),
            label: label.to_owned(),
            cap,
            created_at_ms: now,
            expires_at_ms,
        })
    }

    /// Every stored token (verification, and an admin's list filtered by the gateway).
    pub fn token_rows(&self) -> Result<Vec<TokenRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at_ms, id"
        ))?;
        let rows = stmt
            .query_map([], token_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// The token stored with this hash (the primary key), if any: what a presented token is,
    /// read from the database on every request so that a token created, revoked or removed
    /// through any gateway counts at once on every other.
    pub fn token_by_hash(&self, hash: &str) -> Result<Option<TokenRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE hash = ?1"),
                params![hash],
                token_row,
            )
            .optional()?)
    }

    /// Stores the admin token labelled `label` (id `tok_<label>`) with this hash unless one
    /// is stored already; `true` only for the caller whose insert made it. Two gateways
    /// starting on one empty database at once mint one admin token between them.
    pub fn add_token_if_absent(&self, label: &str, hash: &str, scope: &Scope) -> Result<bool> {
        let inserted = self.conn().execute(
            "INSERT INTO tokens (id, hash, owner_id, tenant_id, label, scope, created_at_ms)
             VALUES ('tok_' || ?4, ?1, ?2, ?3, ?4, 'admin', ?5) ON CONFLICT DO NOTHING",
            params![hash, scope.owner_id, scope.tenant_id, label, now_ms()],
        )?;
        Ok(inserted == 1)
    }

    /// Removes the token `id` within `tenant` (any tenant with `None`).
    pub fn revoke_token(&self, id: &str, tenant: Option<&str>) -> Result<TokenRow> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let row = tx
            .query_row(
                &format!(
                    "SELECT {TOKEN_COLUMNS} FROM tokens WHERE id = ?1 AND (?2 IS NULL OR tenant_id = ?2)"
                ),
                params![id, tenant],
                token_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound {
                what: "token",
                id: id.to_owned(),
            })?;
        tx.execute("DELETE FROM tokens WHERE id = ?1", params![id])?;
        tx.commit()?;
        Ok(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_tokens_round_trip_and_removal_takes_the_tokens() {
        let store = Store::open_in_memory().unwrap();
        let first = store.users(None).unwrap();
        assert_eq!(first.len(), 1, "the first admin is there from the start");
        assert_eq!(first[0].id, FIRST_ADMIN);
        let bob = store.add_user("bob@x", Role::Member, "ten_b").unwrap();
        assert!(matches!(
            store.add_user("bob@x", Role::Viewer, DEFAULT_TENANT),
            Err(Error::UserExists { .. })
        ));
        assert_eq!(store.users(Some("ten_b")).unwrap(), vec![bob.clone()]);
        assert!(store.user_by_email("bob@x", Some(DEFAULT_TENANT)).is_err());
        // The same person whatever the case: found, and not added twice.
        assert_eq!(store.user_by_email("Bob@X", None).unwrap(), bob);
        match store.add_user("BOB@x", Role::Member, "ten_b") {
            Err(e @ Error::UserExists { .. }) => assert_eq!(
                e.to_string(),
                "user BOB@x already exists as bob@x (emails are compared without case); remove them first or pick another email"
            ),
            other => panic!("a second Bob was added: {other:?}"),
        }
        let tok = store
            .add_token(&bob.scope(), "h", "bob", TokenScope::Read, Some(5))
            .unwrap();
        assert!(store.revoke_token(&tok.id, Some(DEFAULT_TENANT)).is_err());
        assert_eq!(store.remove_user(&bob).unwrap(), vec![tok.id]);
        assert!(store.user_of(&bob.scope()).unwrap().is_none());
        assert!(store.token_rows().unwrap().iter().all(|t| t.hash != "h"));
    }
}
