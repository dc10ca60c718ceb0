//! Users, tokens and revoked UI cookies on PostgreSQL.

use super::PgStore;
use super::conn::PgConn;
use crate::aggregates::People;
use crate::{Error, Result, Scope, TokenRow, UserRow, mint, now_ms};
use postgres::Row;
use skiff_protocol::people::{Role, TokenScope};

/// An email folded as SQLite's `lower()` folds it (ASCII letters only); the expression of
/// the unique index `users_by_folded_email`, so lookups use it.
const FOLDED: &str = r#"lower(email COLLATE "C")"#;

const USER_COLUMNS: &str = "id, tenant_id, email, role, created_at_ms";

fn user_from(row: &Row) -> Result<UserRow> {
    let role: &str = row.try_get(3)?;
    Ok(UserRow {
        id: row.try_get(0)?,
        tenant_id: row.try_get(1)?,
        email: row.try_get(2)?,
        role: Role::parse(role).ok_or_else(|| Error::Corrupt {
            what: "user",
            detail: format!("unknown role {role:?}"),
        })?,
        created_at_ms: row.try_get(4)?,
    })
}

const TOKEN_COLUMNS: &str =
    "id, hash, owner_id, tenant_id, label, scope, created_at_ms, expires_at_ms";

fn token_from(row: &Row) -> Result<TokenRow> {
    let cap: &str = row.try_get(5)?;
    Ok(TokenRow {
        id: row.try_get(0)?,
        hash: row.try_get(1)?,
        scope: Scope::new(row.try_get::<_, String>(2)?, row.try_get::<_, String>(3)?),
        label: row.try_get(4)?,
        cap: TokenScope::parse(cap).ok_or_else(|| Error::Corrupt {
            what: "token",
            detail: format!("unknown token scope {cap:?}"),
        })?,
        created_at_ms: row.try_get(6)?,
        expires_at_ms: row.try_get(7)?,
    })
}

fn user_by_email_in(conn: &mut PgConn, email: &str, tenant: Option<&str>) -> Result<UserRow> {
    let row = conn
        .client
        .query_opt(
            &format!(
                "SELECT {USER_COLUMNS} FROM users WHERE {FOLDED} = lower($1 COLLATE \"C\") \
                 AND ($2::text IS NULL OR tenant_id = $2)"
            ),
            &[&email, &tenant],
        )?
        .ok_or_else(|| Error::NotFound {
            what: "user",
            id: email.to_owned(),
        })?;
    user_from(&row)
}

impl People for PgStore {
    fn add_user(&self, email: &str, role: Role, tenant: &str) -> Result<UserRow> {
        let id = format!("usr_{}", mint()?);
        let now = now_ms();
        let (email, tenant) = (email.to_owned(), tenant.to_owned());
        self.conn.run(move |conn| {
            // The unique index decides, whichever gateway adds the same person at once.
            let inserted = conn.client.query_opt(
                &format!(
                    "INSERT INTO users (id, owner_id, tenant_id, email, role, created_at_ms) \
                     VALUES ($1, $1, $2, $3, $4, $5) ON CONFLICT (({FOLDED})) DO NOTHING \
                     RETURNING {USER_COLUMNS}"
                ),
                &[&id, &tenant, &email, &role.as_str(), &now],
            )?;
            match inserted {
                Some(row) => user_from(&row),
                None => {
                    let existing = user_by_email_in(conn, &email, None)?;
                    Err(Error::UserExists {
                        email,
                        existing: existing.email,
                    })
                }
            }
        })
    }

    fn users(&self, tenant: Option<&str>) -> Result<Vec<UserRow>> {
        let tenant = tenant.map(str::to_owned);
        self.conn.run(move |conn| {
            conn.client
                .query(
                    &format!(
                        "SELECT {USER_COLUMNS} FROM users \
                         WHERE $1::text IS NULL OR tenant_id = $1 \
                         ORDER BY created_at_ms, email COLLATE \"C\""
                    ),
                    &[&tenant],
                )?
                .iter()
                .map(user_from)
                .collect()
        })
    }

    fn user_by_email(&self, email: &str, tenant: Option<&str>) -> Result<UserRow> {
        let (email, tenant) = (email.to_owned(), tenant.map(str::to_owned));
        self.conn
            .run(move |conn| user_by_email_in(conn, &email, tenant.as_deref()))
    }

    fn user_of(&self, scope: &Scope) -> Result<Option<UserRow>> {
        let scope = scope.clone();
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!("SELECT {USER_COLUMNS} FROM users WHERE id = $1 AND tenant_id = $2"),
                    &[&scope.owner_id, &scope.tenant_id],
                )?
                .as_ref()
                .map(user_from)
                .transpose()
        })
    }

    fn remove_user(&self, user: &UserRow) -> Result<Vec<String>> {
        let user = user.clone();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            let ids = tx
                .query(
                    "DELETE FROM tokens WHERE owner_id = $1 AND tenant_id = $2 RETURNING id",
                    &[&user.id, &user.tenant_id],
                )?
                .iter()
                .map(|row| row.try_get::<_, String>(0))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            tx.execute(
                "DELETE FROM users WHERE id = $1 AND tenant_id = $2",
                &[&user.id, &user.tenant_id],
            )?;
            tx.commit()?;
            Ok(ids)
        })
    }

    fn add_token(
        &self,
        scope: &Scope,
        hash: &str,
        label: &str,
        cap: TokenScope,
        expires_at_ms: Option<i64>,
    ) -> Result<TokenRow> {
        let row = TokenRow {
            id: format!("tok_{}", mint()?),
            hash: hash.to_owned(),
            scope: scope.clone(),
            label: label.to_owned(),
            cap,
            created_at_ms: now_ms(),
            expires_at_ms,
        };
        let written = row.clone();
        self.conn.run(move |conn| {
            conn.client.execute(
                "INSERT INTO tokens (id, hash, owner_id, tenant_id, label, scope, created_at_ms, \
                 expires_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                &[
                    &written.id,
                    &written.hash,
                    &written.scope.owner_id,
                    &written.scope.tenant_id,
                    &written.label,
                    &written.cap.as_str(),
                    &written.created_at_ms,
                    &written.expires_at_ms,
                ],
            )?;
            Ok(())
        })?;
        Ok(row)
    }

    fn token_rows(&self) -> Result<Vec<TokenRow>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!("SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at_ms, id"),
                    &[],
                )?
                .iter()
                .map(token_from)
                .collect()
        })
    }

    fn token_by_hash(&self, hash: &str) -> Result<Option<TokenRow>> {
        let hash = hash.to_owned();
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE hash = $1"),
                    &[&hash],
                )?
                .as_ref()
                .map(token_from)
                .transpose()
        })
    }

    fn add_token_if_absent(&self, label: &str, hash: &str, scope: &Scope) -> Result<bool> {
        let (label, hash, scope) = (label.to_owned(), hash.to_owned(), scope.clone());
        let now = now_ms();
        self.conn.run(move |conn| {
            let inserted = conn.client.execute(
                "INSERT INTO tokens (id, hash, owner_id, tenant_id, label, scope, created_at_ms) \
                 VALUES ('tok_' || $4, $1, $2, $3, $4, 'admin', $5) ON CONFLICT DO NOTHING",
                &[&hash, &scope.owner_id, &scope.tenant_id, &label, &now],
            )?;
            Ok(inserted == 1)
        })
    }

    fn revoke_token(&self, id: &str, tenant: Option<&str>) -> Result<TokenRow> {
        let (id, tenant) = (id.to_owned(), tenant.map(str::to_owned));
        self.conn.run(move |conn| {
            let row = conn
                .client
                .query_opt(
                    &format!(
                        "DELETE FROM tokens WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2) \
                         RETURNING {TOKEN_COLUMNS}"
                    ),
                    &[&id, &tenant],
                )?
                .ok_or_else(|| Error::NotFound {
                    what: "token",
                    id: id.clone(),
                })?;
            token_from(&row)
        })
    }

    fn replace_token(&self, label: &str, hash: &str, scope: &Scope) -> Result<()> {
        let (label, hash, scope) = (label.to_owned(), hash.to_owned(), scope.clone());
        let now = now_ms();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            tx.execute("DELETE FROM tokens WHERE label = $1", &[&label])?;
            tx.execute(
                "INSERT INTO tokens (id, hash, owner_id, tenant_id, label, scope, created_at_ms) \
                 VALUES ('tok_' || $4, $1, $2, $3, $4, 'admin', $5)",
                &[&hash, &scope.owner_id, &scope.tenant_id, &label, &now],
            )?;
            tx.commit()?;
            Ok(())
        })
    }

    fn revoke_ui_cookie(
        &self,
        scope: &Scope,
        nonce_hash: &str,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<()> {
        let (scope, nonce_hash) = (scope.clone(), nonce_hash.to_owned());
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            tx.execute(
                "DELETE FROM ui_revoked_cookies WHERE expires_at_ms <= $1",
                &[&now_ms],
            )?;
            tx.execute(
                "INSERT INTO ui_revoked_cookies (nonce_hash, owner_id, tenant_id, expires_at_ms, \
                 revoked_at_ms) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (nonce_hash) DO UPDATE SET owner_id = excluded.owner_id, \
                 tenant_id = excluded.tenant_id, expires_at_ms = excluded.expires_at_ms, \
                 revoked_at_ms = excluded.revoked_at_ms",
                &[
                    &nonce_hash,
                    &scope.owner_id,
                    &scope.tenant_id,
                    &expires_at_ms,
                    &now_ms,
                ],
            )?;
            tx.commit()?;
            Ok(())
        })
    }

    fn ui_cookie_revoked(&self, scope: &Scope, nonce_hash: &str) -> Result<bool> {
        let (scope, nonce_hash) = (scope.clone(), nonce_hash.to_owned());
        self.conn.run(move |conn| {
            Ok(conn
                .client
                .query_opt(
                    "SELECT 1 FROM ui_revoked_cookies \
                     WHERE nonce_hash = $1 AND owner_id = $2 AND tenant_id = $3",
                    &[&nonce_hash, &scope.owner_id, &scope.tenant_id],
                )?
                .is_some())
        })
    }
}
