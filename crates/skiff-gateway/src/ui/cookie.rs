//! The `skiff_session` cookie: a signed, expiring statement "this browser acts for scope S".
//!
//! The value is `v1.<owner>.<tenant>.<expires_at_ms>.<nonce>.<mac>`, the MAC a keyed blake3 of
//! everything before it. The key is derived from the admin token, so cookies survive a gateway
//! restart (the UI reconnects instead of asking to log in again) and die when the admin token is
//! replaced. Logout revokes a cookie's nonce in memory until it expires; that list does not
//! survive a restart, so the browser is also told to drop the cookie.
//!
//! Deliberately absent: the admin token itself. A cookie never contains or reveals it.

use skiff_store::Scope;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

pub(crate) const COOKIE_NAME: &str = "skiff_session";
/// The operator keeps the UI open all day, every day; a week between logins.
pub(crate) const COOKIE_TTL_MS: i64 = 7 * 24 * 60 * 60 * 1000;
const KEY_CONTEXT: &str = "skiff-gateway 2025 ui session cookie v1";

#[derive(Debug, thiserror::Error)]
pub(crate) enum CookieError {
    #[error("the gateway has no cookie key yet (it is still starting)")]
    NoKey,
    #[error("scope {0:?} cannot be carried in a cookie")]
    Scope(String),
    #[error(transparent)]
    Random(#[from] skiff_store::Error),
}

#[derive(Default)]
pub(crate) struct Cookies {
    key: OnceLock<[u8; 32]>,
    /// Nonces of logged-out cookies, with their expiry (after which the MAC check refuses them
    /// anyway and the entry can go).
    revoked: Mutex<HashMap<String, i64>>,
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

    /// The scope a cookie value grants, if it is ours, unexpired and not logged out.
    pub(crate) fn verify(&self, value: &str, now_ms: i64) -> Option<Scope> {
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
        let expires: i64 = expires.parse().ok()?;
        if expires <= now_ms || self.lock_revoked().contains_key(nonce) {
            return None;
        }
        Some(Scope::new(owner, tenant))
    }

    /// Refuses this cookie from now on (logout). Unknown or forged values are ignored.
    pub(crate) fn revoke(&self, value: &str, now_ms: i64) {
        if self.verify(value, now_ms).is_none() {
            return;
        }
        let mut parts = value.split('.');
        let (Some(expires), Some(nonce)) = (parts.nth(3), parts.next()) else {
            return;
        };
        let expires = expires.parse().unwrap_or(now_ms + COOKIE_TTL_MS);
        let mut revoked = self.lock_revoked();
        revoked.retain(|_, until| *until > now_ms);
        revoked.insert(nonce.to_owned(), expires);
    }

    fn lock_revoked(&self) -> std::sync::MutexGuard<'_, HashMap<String, i64>> {
        self.revoked.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The `skiff_session` value among a request's `Cookie` headers.
pub(crate) fn from_headers(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE_NAME)
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
        assert_eq!(c.verify(&value, 1), Some(scope));
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
    fn logout_revokes() {
        let c = cookies();
        let value = c.mint(&Scope::new("usr_admin", "ten_default"), 0).unwrap();
        c.revoke(&value, 1);
        assert_eq!(c.verify(&value, 2), None);
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
