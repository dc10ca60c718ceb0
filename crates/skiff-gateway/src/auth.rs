//! API tokens. Tokens are random, shown once (in `gateway.json`), and stored only as blake3
//! hashes. Verification hashes the presented token and compares it with every known hash using
//! blake3's constant-time equality, without an early exit, so timing reveals nothing about
//! which bytes matched.

use skiff_store::{Scope, Store};
use std::sync::RwLock;

/// The label of the admin token minted at first start.
pub const ADMIN_LABEL: &str = "admin";

/// The owner and tenant of the first-start admin token.
pub fn admin_scope() -> Scope {
    Scope::new("usr_admin", "ten_default")
}

/// A fresh token: `skf_` and 32 random base32 characters.
pub fn mint() -> Result<String, skiff_store::Error> {
    Ok(format!(
        "skf_{}{}",
        skiff_store::mint()?,
        skiff_store::mint()?
    ))
}

/// The known token hashes, loaded from the store at start.
pub struct Tokens {
    known: RwLock<Vec<(blake3::Hash, Scope, String)>>,
}

impl Tokens {
    pub fn load(store: &Store) -> Result<Self, skiff_store::Error> {
        let known = store
            .tokens()?
            .into_iter()
            .filter_map(|(hex, scope, label)| {
                Some((blake3::Hash::from_hex(hex).ok()?, scope, label))
            })
            .collect();
        Ok(Self {
            known: RwLock::new(known),
        })
    }

    /// Replaces every token labelled `label` with `token`: its hash is stored (the plaintext
    /// never is) and from now on only it is accepted under that label.
    pub fn replace(
        &self,
        store: &Store,
        label: &str,
        token: &str,
        scope: Scope,
    ) -> Result<(), skiff_store::Error> {
        let hash = blake3::hash(token.as_bytes());
        store.replace_token(label, &hash.to_hex(), &scope)?;
        let mut known = self.known.write().unwrap_or_else(|p| p.into_inner());
        known.retain(|(_, _, l)| l != label);
        known.push((hash, scope, label.to_owned()));
        Ok(())
    }

    /// The scope a presented token grants, if any.
    pub fn verify(&self, presented: &str) -> Option<Scope> {
        let presented = blake3::hash(presented.as_bytes());
        let known = self.known.read().unwrap_or_else(|p| p.into_inner());
        let mut found = None;
        for (hash, scope, _) in known.iter() {
            if *hash == presented {
                found = Some(scope.clone());
            }
        }
        found
    }
}
