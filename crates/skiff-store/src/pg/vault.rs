//! The vault's sealed rows on PostgreSQL.

use super::PgStore;
use crate::aggregates::Vault;
use crate::{Error, Resealed, Result, SecretRow, now_ms};
use postgres::Row;

const COLUMNS: &str = "name, ciphertext, nonce, key_id, created_at_ms, updated_at_ms";

fn secret_from(row: &Row) -> Result<SecretRow> {
    Ok(SecretRow {
        name: row.try_get(0)?,
        ciphertext: row.try_get(1)?,
        nonce: row.try_get(2)?,
        key_id: row.try_get(3)?,
        created_at_ms: row.try_get(4)?,
        updated_at_ms: row.try_get(5)?,
    })
}

impl Vault for PgStore {
    fn put_secret(&self, name: &str, sealed: &Resealed) -> Result<SecretRow> {
        let (name, sealed) = (name.to_owned(), sealed.clone());
        let now = now_ms();
        self.conn.run(move |conn| {
            let row = conn.client.query_one(
                &format!(
                    "INSERT INTO secrets (name, ciphertext, nonce, key_id, created_at_ms, \
                     updated_at_ms) VALUES ($1, $2, $3, $4, $5, $5) \
                     ON CONFLICT (name) DO UPDATE SET ciphertext = excluded.ciphertext, \
                     nonce = excluded.nonce, key_id = excluded.key_id, \
                     updated_at_ms = excluded.updated_at_ms RETURNING {COLUMNS}"
                ),
                &[
                    &name,
                    &sealed.ciphertext,
                    &sealed.nonce,
                    &sealed.key_id,
                    &now,
                ],
            )?;
            secret_from(&row)
        })
    }

    fn secret(&self, name: &str) -> Result<Option<SecretRow>> {
        let name = name.to_owned();
        self.conn.run(move |conn| {
            conn.client
                .query_opt(
                    &format!("SELECT {COLUMNS} FROM secrets WHERE name = $1"),
                    &[&name],
                )?
                .as_ref()
                .map(secret_from)
                .transpose()
        })
    }

    fn secrets(&self) -> Result<Vec<SecretRow>> {
        self.conn.run(|conn| {
            conn.client
                .query(
                    &format!("SELECT {COLUMNS} FROM secrets ORDER BY name COLLATE \"C\""),
                    &[],
                )?
                .iter()
                .map(secret_from)
                .collect()
        })
    }

    fn delete_secret(&self, name: &str) -> Result<bool> {
        let name = name.to_owned();
        self.conn.run(move |conn| {
            Ok(conn
                .client
                .execute("DELETE FROM secrets WHERE name = $1", &[&name])?
                > 0)
        })
    }

    /// The sealing runs here, not on the connection's thread and never inside a transaction:
    /// the rows are read, resealed, then written in one transaction that first locks the
    /// table against writers and checks that no secret changed since it was read. If one did
    /// (another gateway wrote it), nothing is written and the rotation is to be run again.
    fn reseal_secrets(
        &self,
        reseal: &mut dyn FnMut(&SecretRow) -> Result<Resealed>,
    ) -> Result<usize> {
        let rows = self.secrets()?;
        let resealed = rows.iter().map(&mut *reseal).collect::<Result<Vec<_>>>()?;
        let count = rows.len();
        self.conn.run(move |conn| {
            let mut tx = conn.client.transaction()?;
            tx.batch_execute("LOCK TABLE secrets IN SHARE ROW EXCLUSIVE MODE")?;
            let now = tx
                .query(
                    &format!("SELECT {COLUMNS} FROM secrets ORDER BY name COLLATE \"C\""),
                    &[],
                )?
                .iter()
                .map(secret_from)
                .collect::<Result<Vec<_>>>()?;
            if now != rows {
                return Err(Error::VaultChanged);
            }
            for (secret, sealed) in rows.iter().zip(&resealed) {
                tx.execute(
                    "UPDATE secrets SET ciphertext = $2, nonce = $3, key_id = $4 WHERE name = $1",
                    &[
                        &secret.name,
                        &sealed.ciphertext,
                        &sealed.nonce,
                        &sealed.key_id,
                    ],
                )?;
            }
            tx.commit()?;
            Ok(count)
        })
    }
}
