//! The vault's rows: sealed secrets (ciphertext, nonce, the id of the key that sealed them) and
//! their dates. Sealing and opening are the gateway's (`vault.rs`); this module never sees a
//! key or a plaintext.

use crate::{Result, Store, now_ms};
use rusqlite::{OptionalExtension, params};

/// One sealed secret as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRow {
    pub name: String,
    pub ciphertext: Vec<u8>,
    pub nonce: Vec<u8>,
    pub key_id: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A secret sealed anew (by a rotation): what replaces its row's ciphertext.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resealed {
    pub ciphertext: Vec<u8>,
    pub nonce: Vec<u8>,
    pub key_id: String,
}

const COLUMNS: &str = "name, ciphertext, nonce, key_id, created_at_ms, updated_at_ms";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SecretRow> {
    Ok(SecretRow {
        name: r.get(0)?,
        ciphertext: r.get(1)?,
        nonce: r.get(2)?,
        key_id: r.get(3)?,
        created_at_ms: r.get(4)?,
        updated_at_ms: r.get(5)?,
    })
}

impl Store {
    /// Stores `name` sealed as given: a new row, or the existing one replaced (its creation
    /// date kept).
    pub fn put_secret(&self, name: &str, sealed: &Resealed) -> Result<SecretRow> {
        let now = now_ms();
        let conn = self.conn();
        conn.execute(
            "INSERT INTO secrets (name, ciphertext, nonce, key_id, created_at_ms, updated_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?5)
             ON CONFLICT(name) DO UPDATE SET ciphertext = excluded.ciphertext,
                 nonce = excluded.nonce, key_id = excluded.key_id,
                 updated_at_ms = excluded.updated_at_ms",
            params![name, sealed.ciphertext, sealed.nonce, sealed.key_id, now],
        )?;
        Ok(conn.query_row(
            &format!("SELECT {COLUMNS} FROM secrets WHERE name = ?1"),
            params![name],
            row,
        )?)
    }

    pub fn secret(&self, name: &str) -> Result<Option<SecretRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM secrets WHERE name = ?1"),
                params![name],
                row,
            )
            .optional()?)
    }

    /// Every secret, by name.
    pub fn secrets(&self) -> Result<Vec<SecretRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!("SELECT {COLUMNS} FROM secrets ORDER BY name"))?;
        let rows = stmt
            .query_map([], row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// Removes `name`; whether it existed.
    pub fn delete_secret(&self, name: &str) -> Result<bool> {
        Ok(self
            .conn()
            .execute("DELETE FROM secrets WHERE name = ?1", params![name])?
            > 0)
    }

    /// Reseals every secret in one transaction: `reseal` gets each row and returns its new
    /// sealing, or an error that rolls the whole back (no secret is left under a key that is
    /// about to be thrown away). Returns how many were resealed.
    pub fn reseal_secrets<E>(
        &self,
        mut reseal: impl FnMut(&SecretRow) -> std::result::Result<Resealed, E>,
    ) -> std::result::Result<usize, E>
    where
        E: From<crate::Error>,
    {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(crate::Error::from)?;
        let rows = {
            let mut stmt = tx
                .prepare(&format!("SELECT {COLUMNS} FROM secrets ORDER BY name"))
                .map_err(crate::Error::from)?;
            stmt.query_map([], row)
                .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
                .map_err(crate::Error::from)?
        };
        for secret in &rows {
            let sealed = reseal(secret)?;
            tx.execute(
                "UPDATE secrets SET ciphertext = ?2, nonce = ?3, key_id = ?4 WHERE name = ?1",
                params![secret.name, sealed.ciphertext, sealed.nonce, sealed.key_id],
            )
            .map_err(crate::Error::from)?;
        }
        tx.commit().map_err(crate::Error::from)?;
        Ok(rows.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(byte: u8, key: &str) -> Resealed {
        Resealed {
            ciphertext: vec![byte; 4],
            nonce: vec![byte; 12],
            key_id: key.to_owned(),
        }
    }

    #[test]
    fn a_replaced_secret_keeps_its_creation_date_and_a_failed_reseal_changes_nothing() {
        let store = Store::open_in_memory().unwrap();
        let first = store.put_secret("K", &sealed(1, "a")).unwrap();
        let second = store.put_secret("K", &sealed(2, "a")).unwrap();
        assert_eq!(second.created_at_ms, first.created_at_ms);
        assert_eq!(second.ciphertext, vec![2; 4]);
        store.put_secret("L", &sealed(3, "a")).unwrap();

        let failed: std::result::Result<usize, crate::Error> = store.reseal_secrets(|row| {
            if row.name == "L" {
                Err(crate::Error::Corrupt {
                    what: "secret",
                    detail: "refused".into(),
                })
            } else {
                Ok(sealed(9, "b"))
            }
        });
        assert!(failed.is_err());
        let rows = store.secrets().unwrap();
        assert!(rows.iter().all(|r| r.key_id == "a"), "{rows:?}");

        let n: std::result::Result<usize, crate::Error> =
            store.reseal_secrets(|_| Ok(sealed(9, "b")));
        assert_eq!(n.unwrap(), 2);
        assert!(store.secrets().unwrap().iter().all(|r| r.key_id == "b"));
        assert!(store.delete_secret("K").unwrap());
        assert!(!store.delete_secret("K").unwrap());
        assert_eq!(store.secret("K").unwrap(), None);
    }
}
