//! API tokens. Tokens are random, shown once (the first admin's in `gateway.json`, a user's by
//! `skiff admin token create`), and stored only as blake3 hashes. Verification hashes the
//! presented token and compares it with every known hash using blake3's constant-time equality,
//! without an early exit, so timing reveals nothing about which bytes matched.

use skiff_store::{Backend, Scope, TokenRow};
use std::sync::RwLock;

/// The label of the admin token minted at first start.
pub const ADMIN_LABEL: &str = "admin";

/// The owner and tenant of the first-start admin token.
pub fn admin_scope() -> Scope {
    Scope::new(skiff_store::FIRST_ADMIN, skiff_store::DEFAULT_TENANT)
}

/// The scope of an audit row no user owns: a refusal before anyone could be known. Never a
/// user's, so nothing is done or recorded with someone else's rights.
pub fn unattributed_scope() -> Scope {
    Scope::new("-", "-")
}

/// A fresh token: `skf_` and 32 random base32 characters.
pub fn mint() -> Result<String, skiff_store::Error> {
    Ok(format!(
        "skf_{}{}",
        skiff_store::mint()?,
        skiff_store::mint()?
    ))
}

/// What a presented token turned out to be.
pub enum Verified {
    Valid(TokenRow),
    /// Known, but past its expiry (the row says when).
    Expired(TokenRow),
    Unknown,
}

/// The known token hashes, loaded from the store at start and kept in step with it.
pub struct Tokens {
    known: RwLock<Vec<(blake3::Hash, TokenRow)>>,
}

impl Tokens {
    pub fn load(store: &dyn Backend) -> Result<Self, skiff_store::Error> {
        let known = store
            .token_rows()?
            .into_iter()
            .filter_map(|row| Some((blake3::Hash::from_hex(&row.hash).ok()?, row)))
            .collect();
        Ok(Self {
            known: RwLock::new(known),
        })
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<(blake3::Hash, TokenRow)>> {
        self.known.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces every token labelled `label` with `token`: its hash is stored (the plaintext
    /// never is) and from now on only it is accepted under that label.
    pub fn replace(
        &self,
        store: &dyn Backend,
        label: &str,
        token: &str,
        scope: Scope,
    ) -> Result<(), skiff_store::Error> {
        let hash = blake3::hash(token.as_bytes());
        store.replace_token(label, &hash.to_hex(), &scope)?;
        // Reload rather than rebuild the row by hand: the store assigns its id.
        let fresh = Tokens::load(store)?;
        let rows = std::mem::take(&mut *fresh.write());
        *self.write() = rows;
        Ok(())
    }

    /// Starts accepting a token just stored.
    pub fn add(&self, row: TokenRow) {
        if let Ok(hash) = blake3::Hash::from_hex(&row.hash) {
            self.write().push((hash, row));
        }
    }

    /// Stops accepting these tokens (revoked, or their user removed).
    pub fn remove(&self, ids: &[String]) {
        self.write().retain(|(_, row)| !ids.contains(&row.id));
    }

    /// What a presented token is.
    pub fn verify(&self, presented: &str) -> Verified {
        let presented = blake3::hash(presented.as_bytes());
        let known = self.known.read().unwrap_or_else(|p| p.into_inner());
        let mut found = None;
        for (hash, row) in known.iter() {
            if *hash == presented {
                found = Some(row.clone());
            }
        }
        match found {
            Some(row)
                if row
                    .expires_at_ms
                    .is_some_and(|at| at <= skiff_store::now_ms()) =>
            {
                Verified::Expired(row)
            }
            Some(row) => Verified::Valid(row),
            None => Verified::Unknown,
        }
    }
}
