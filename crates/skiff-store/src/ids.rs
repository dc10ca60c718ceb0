//! Id minting. Ids are opaque: a prefix and 16 random base32 characters (80 bits).

use crate::{Error, Result};

const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

/// A fresh random suffix; wrap it with the id type's `from_suffix`.
pub fn mint() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| Error::Corrupt {
        what: "random source",
        detail: e.to_string(),
    })?;
    Ok(bytes
        .iter()
        .map(|b| char::from(ALPHABET[usize::from(b & 31)]))
        .collect())
}
