//! The `skiff_session` cookie: a signed, expiring statement "this browser acts for scope S".
//!
//! The value is `v1.<owner>.<tenant>.<expires_at_ms>.<nonce>.<mac>`, the MAC a keyed blake3 of
//! everything before it. The key is derived from the admin token, so cookies survive a gateway
//! restart (the UI reconnects instead of asking to log in again) and die when the admin token is
//! replaced. Logout revokes a cookie: the blake3 of its nonce goes into the store until the
//! cookie would expire, so a logged-out cookie stays refused across restarts (the browser is
//! also told to drop it).
//!
//! Deliberately absent: the admin token itself. A cookie never contains or reveals it.

use skiff_store::Scope;
use std::sync::OnceLock;

pub(crate) const COOKIE_NAME: &str = "skiff_session";
/// The operator keeps the UI open all day, every day; a week between logins.
pub(crate) const COOKIE_TTL_MS: i64 = 7 * 24 * 60 * 60 * 1000;
const KEY_CONTEXT: &str = "skiff-gateway 2025 ui session cookie v1";

#[derive(Debug, thiserror::Error)]
pub(crate) enum CookieError {
    #[error(
        "this gateway has no Control UI cookie key: it is still starting, or it joined a shared database without the admin token the key is derived from (copy the first gateway's gateway.json into its state dir and restart it)"
    )]
    NoKey,
    #[error("scope {0:?} cannot be carried in a cookie")]
    Scope(String),
    #[error(transparent)]
    Random(#[from] skiff_store::Error),
}

#[derive(Default)]
pub(crate) struct Cookies {
    key: OnceLock<[u8; 32]>,
}

/// A cookie whose signature and expiry check out. Whether it was logged out is the store's
/// to say ([`Verified::nonce_hash`] names it there).
#[derive(Debug, PartialEq)]
pub(crate) struct Verified {
    pub scope: Scope,
    pub expires_at_ms: i64,
    nonce: String,
}

impl Verified {
    /// What a revocation is stored under: the nonce alone does not grant anything, but there is
    /// no reason to keep even that.
    pub(crate) fn nonce_hash(&self) -> String {
        blake3::hash(self.nonce.as_bytes()).to_hex().to_string()
    }
}

/// Owner and tenant ids go into the cookie verbatim; only characters that need no escaping
/// and cannot be confused with the separator are allowed.
fn plain(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Cookies {
    /// Sets the signing key, derived from the admin token. Only the first call counts.
    pub(crate) fn set_key(&self, admin_token: &str) {
        let _ = self
            .key
            .set(blake3::derive_key(KEY_CONTEXT, admin_token.as_bytes()));
    }

    fn mac(&self, body: &str) -> Result<blake3::Hash, CookieError> {
        let key = self.key.get().ok_or(CookieError::NoKey)?;
        Ok(blake3::keyed_hash(key, body.as_bytes()))
    }

    /// A fresh cookie value for `scope`.
    pub(crate) fn mint(&self, scope: &Scope, now_ms: i64) -> Result<String, CookieError> {
        for id in [&scope.owner_id, &scope.tenant_id] {
            if !plain(id) {
                return Err(CookieError::Scope(id.clone()));
            }
        }
        let body = format!(
            "v1.{}.{}.{}.{}",
            scope.owner_id,
            scope.tenant_id,
            now_ms + COOKIE_TTL_MS,
            skiff_store::mint()?
        );
        let mac = self.mac(&body)?;
        Ok(format!("{body}.{}", mac.to_hex()))
    }

    /// The scope a cookie value grants, if it is ours and unexpired (revocation is checked by
    /// the caller, against the store).
    pub(crate) fn verify(&self, value: &str, now_ms: i64) -> Option<Verified> {
        let (body, mac) = value.rsplit_once('.')?;
        let presented = blake3::Hash::from_hex(mac).ok()?;
        // blake3::Hash compares in constant time.
        if self.mac(body).ok()? != presented {
            return None;
        }
        let mut parts = body.split('.');
        let (Some("v1"), Some(owner), Some(tenant), Some(expires), Some(nonce), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return None;
        };
        let expires_at_ms: i64 = expires.parse().ok()?;
        if expires_at_ms <= now_ms {
            return None;
        }
        Some(Verified {
            scope: Scope::new(owner, tenant),
            expires_at_ms,
            nonce: nonce.to_owned(),
        })
    }
}

/// The `skiff_session` value among a request's `Cookie` headers.
pub(crate) fn from_headers(headers: &axum::http::HeaderMap) -> Option<String> {
    named(headers, COOKIE_NAME)
}

/// The value of the cookie `name` among a request's `Cookie` headers.
pub(crate) fn named(headers: &axum::http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, value)| value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cookies() -> Cookies {
        let c = Cookies::default();
        c.set_key("skf_admin");
        c
    }

    #[test]
    fn a_minted_cookie_verifies_until_it_expires() {
        let c = cookies();
        let scope = Scope::new("usr_admin", "ten_default");
        let value = c.mint(&scope, 0).unwrap();
        let verified = c.verify(&value, 1).unwrap();
        assert_eq!(verified.scope, scope);
        assert_eq!(verified.expires_at_ms, COOKIE_TTL_MS);
        assert_eq!(c.verify(&value, COOKIE_TTL_MS), None);
    }

    #[test]
    fn a_tampered_cookie_is_refused() {
        let c = cookies();
        let value = c.mint(&Scope::new("usr_admin", "ten_default"), 0).unwrap();
        let forged = value.replacen("usr_admin", "usr_other", 1);
        assert_eq!(c.verify(&forged, 1), None);
        assert_eq!(
            c.verify("v1.usr_admin.ten_default.9999999999999.x.00", 1),
            None
        );
    }

    #[test]
    fn another_key_refuses_the_cookie() {
        let value = cookies()
            .mint(&Scope::new("usr_admin", "ten_default"), 0)
            .unwrap();
        let other = Cookies::default();
        other.set_key("skf_rotated");
        assert_eq!(other.verify(&value, 1), None);
        assert_eq!(
            Cookies::default().verify(&value, 1),
            None,
            "no key, no scope"
        );
    }

    #[test]
    fn each_cookie_has_its_own_revocation_name() {
        let c = cookies();
        let scope = Scope::new("usr_admin", "ten_default");
        let a = c.verify(&c.mint(&scope, 0).unwrap(), 1).unwrap();
        let b = c.verify(&c.mint(&scope, 0).unwrap(), 1).unwrap();
        assert_ne!(a.nonce_hash(), b.nonce_hash());
        assert!(
            !a.nonce_hash().contains(&a.nonce),
            "the nonce is stored hashed"
        );
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(
            axum::http::header::COOKIE,
            "a=b; skiff_session=v1.x; c=d".parse().unwrap(),
        );
        assert_eq!(from_headers(&headers).as_deref(), Some("v1.x"));
    }
}
