//! API tokens. Tokens are random, shown once (the first admin's in `gateway.json`, a user's by
//! `skiff admin token create`), and stored only as blake3 hashes. Verification hashes the
//! presented token and looks the hash up in the store (it is the key of the token's row): what
//! an index lookup's timing could reveal is how much of a hash matched, which says nothing
//! about the token that would produce it.

use skiff_store::{Backend, Scope, TokenRow};

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

/// Verifies presented tokens against the store on every request: the hash of the presented
/// token is the key of its row, so a lookup is one indexed read. Nothing is cached in this
/// process, so a token created, revoked or expired — or a user removed — through any gateway
/// on the same database counts on every gateway at its next request, revocation as fast as
/// creation.
pub struct Tokens {
    store: std::sync::Arc<dyn Backend>,
}

impl Tokens {
    pub fn new(store: std::sync::Arc<dyn Backend>) -> Self {
        Self { store }
    }

    /// What a presented token is. A store that cannot answer is an error, never a pass.
    pub fn verify(&self, presented: &str) -> Result<Verified, skiff_store::Error> {
        let hash = blake3::hash(presented.as_bytes()).to_hex();
        Ok(match self.store.token_by_hash(&hash)? {
            Some(row)
                if row
                    .expires_at_ms
                    .is_some_and(|at| at <= skiff_store::now_ms()) =>
            {
                Verified::Expired(row)
            }
            Some(row) => Verified::Valid(row),
            None => Verified::Unknown,
        })
    }
}
