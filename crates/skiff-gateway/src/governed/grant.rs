//! One-time invocation grants: minted (signed, registered) before a governed action runs and
//! redeemed by the governed wrapper, which verifies the signature and expiry, checks the
//! grant is this session's, consumes its id once in the store, and recomputes the digest of
//! the arguments it is about to execute.
//!
//! A grant is `grant1.<base64url claims JSON>.<base64url HMAC-SHA256>` under the grant key:
//! `SKIFF_GRANT_KEY` (base64 of 32 bytes) or `<state>/grant.key` (created 0600 at the first
//! start, refused when group or others may read it), kept like the vault key. The claims
//! carry no credential.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD as BASE64, URL_SAFE_NO_PAD as B64URL};
use serde::Serialize;
use sha2::{Digest as _, Sha256};
use skiff_protocol::grant::{Capability, GrantClaims};
use skiff_protocol::{GrantId, SessionId};
use skiff_store::{Backend, Consumed, NewGrant, Scope};
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// How long a grant may wait between minting and redemption.
pub(crate) const GRANT_TTL_MS: i64 = 5 * 60 * 1000;
/// The environment variable that holds the grant key instead of `<state>/grant.key`.
pub(crate) const KEY_ENV: &str = "SKIFF_GRANT_KEY";
const KEY_FILE: &str = "grant.key";
const PREFIX: &str = "grant1";
const KEY_LEN: usize = 32;

/// Why the grant key cannot be used, written for the operator.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GrantKeyError {
    #[error(
        "both {KEY_ENV} and {} hold a grant key; unset {KEY_ENV} or remove the file",
        path.display()
    )]
    TwoKeys { path: PathBuf },
    #[error(
        "{} can be read by other users (mode {mode:04o}); the grant key must be private: chmod 600 {}",
        path.display(),
        path.display()
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error(
        "the grant key from {source_name} is not usable: {problem} (it must be 32 random bytes in base64, as `head -c 32 /dev/urandom | base64`)"
    )]
    Bad {
        source_name: String,
        problem: String,
    },
    #[error("cannot {action} the grant key file {}: {source}", path.display())]
    File {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Why a grant was refused. The message is what the agent reads; [`Refusal::code`] is what
/// the audit row says.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum Refusal {
    #[error("the grant is malformed")]
    Malformed,
    #[error("the grant's signature does not verify (forged or altered)")]
    Forged,
    #[error("grant {id} expired {ago_s} s ago; propose the action again")]
    Expired { id: GrantId, ago_s: i64 },
    #[error("grant {id} belongs to another session, requester or tenant")]
    Foreign { id: GrantId },
    #[error("grant {id} is for {granted}, not {asked}")]
    WrongCapability {
        id: GrantId,
        granted: &'static str,
        asked: &'static str,
    },
    #[error("grant {id} was already used; a grant runs one action once")]
    Replayed { id: GrantId },
    #[error("the arguments about to run are not the ones grant {id} was minted for")]
    DigestMismatch { id: GrantId },
    #[error("the grant could not be checked: {0}")]
    Store(String),
}

impl Refusal {
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::Forged => "forged",
            Refusal::Expired { .. } => "expired",
            Refusal::Foreign { .. } => "foreign",
            Refusal::WrongCapability { .. } => "wrong_capability",
            Refusal::Replayed { .. } => "replayed",
            Refusal::DigestMismatch { .. } => "digest_mismatch",
            Refusal::Store(_) => "store_error",
        }
    }

    /// The grant's id, when the refusal got far enough to read it from signed claims.
    pub(crate) fn grant(&self) -> Option<&GrantId> {
        match self {
            Refusal::Expired { id, .. }
            | Refusal::Foreign { id }
            | Refusal::WrongCapability { id, .. }
            | Refusal::Replayed { id }
            | Refusal::DigestMismatch { id } => Some(id),
            _ => None,
        }
    }
}

/// The key grants are signed with. Its bytes never leave this process.
pub(crate) struct GrantKey([u8; KEY_LEN]);

impl GrantKey {
    #[cfg(test)]
    pub(crate) fn from_bytes(bytes: [u8; KEY_LEN]) -> GrantKey {
        GrantKey(bytes)
    }

    /// A random key that lives as long as this process (governed actions are off).
    pub(crate) fn ephemeral() -> Result<GrantKey, GrantKeyError> {
        let mut key = [0u8; KEY_LEN];
        getrandom::fill(&mut key).map_err(|e| GrantKeyError::Bad {
            source_name: "the random source".into(),
            problem: e.to_string(),
        })?;
        Ok(GrantKey(key))
    }

    /// `SKIFF_GRANT_KEY` or `<dir>/grant.key`, created (0600) when neither exists.
    pub(crate) fn load_or_create(
        dir: &Path,
        env_key: Option<String>,
    ) -> Result<GrantKey, GrantKeyError> {
        let path = dir.join(KEY_FILE);
        let exists = path.exists();
        if let Some(text) = env_key {
            if exists {
                return Err(GrantKeyError::TwoKeys { path });
            }
            return parse(&text, KEY_ENV);
        }
        if exists {
            let file = |action, source| GrantKeyError::File {
                action,
                path: path.clone(),
                source,
            };
            let meta = std::fs::metadata(&path).map_err(|e| file("read", e))?;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(GrantKeyError::Mode { path, mode });
            }
            let text = std::fs::read_to_string(&path).map_err(|e| file("read", e))?;
            return parse(&text, &path.display().to_string());
        }
        let mut key = [0u8; KEY_LEN];
        getrandom::fill(&mut key).map_err(|e| GrantKeyError::Bad {
            source_name: "the random source".into(),
            problem: e.to_string(),
        })?;
        let tmp = dir.join(format!("{KEY_FILE}.tmp"));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(BASE64.encode(key).as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|source| GrantKeyError::File {
            action: "write",
            path: path.clone(),
            source,
        })?;
        Ok(GrantKey(key))
    }

    /// HMAC-SHA256 (RFC 2104) of `message`.
    fn mac(&self, message: &[u8]) -> [u8; 32] {
        const BLOCK: usize = 64;
        let mut padded = [0u8; BLOCK];
        padded[..KEY_LEN].copy_from_slice(&self.0);
        let mut inner = Sha256::new();
        inner.update(padded.map(|b| b ^ 0x36));
        inner.update(message);
        let mut outer = Sha256::new();
        outer.update(padded.map(|b| b ^ 0x5c));
        outer.update(inner.finalize());
        outer.finalize().into()
    }

    #[cfg(test)]
    pub(crate) fn mac_for_test(&self, message: &[u8]) -> [u8; 32] {
        self.mac(message)
    }

    pub(crate) fn sign(&self, claims: &GrantClaims) -> String {
        let json = serde_json::to_vec(claims).unwrap_or_default();
        let mac = self.mac(&json);
        format!("{PREFIX}.{}.{}", B64URL.encode(&json), B64URL.encode(mac))
    }

    /// The claims of `token` when its signature verifies and it has not expired at `now_ms`.
    pub(crate) fn verify(&self, token: &str, now_ms: i64) -> Result<GrantClaims, Refusal> {
        let mut parts = token.split('.');
        let (Some(PREFIX), Some(body), Some(mac), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Refusal::Malformed);
        };
        let json = B64URL.decode(body).map_err(|_| Refusal::Malformed)?;
        let mac = B64URL.decode(mac).map_err(|_| Refusal::Malformed)?;
        let expected = self.mac(&json);
        // Constant time: every byte is compared whatever the first difference.
        let same = mac.len() == expected.len()
            && mac
                .iter()
                .zip(expected.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !same {
            return Err(Refusal::Forged);
        }
        let claims: GrantClaims = serde_json::from_slice(&json).map_err(|_| Refusal::Malformed)?;
        if claims.expires_at_ms <= now_ms {
            return Err(Refusal::Expired {
                ago_s: (now_ms - claims.expires_at_ms) / 1000,
                id: claims.id,
            });
        }
        Ok(claims)
    }
}

fn parse(text: &str, source_name: &str) -> Result<GrantKey, GrantKeyError> {
    let bad = |problem: String| GrantKeyError::Bad {
        source_name: source_name.to_owned(),
        problem,
    };
    let bytes = BASE64
        .decode(text.trim())
        .map_err(|e| bad(format!("it is not base64 ({e})")))?;
    let key = <[u8; KEY_LEN]>::try_from(bytes.as_slice())
        .map_err(|_| bad(format!("it is {} bytes long, not {KEY_LEN}", bytes.len())))?;
    Ok(GrantKey(key))
}

/// The digest of the exact arguments an action runs with (its resolved plan): BLAKE3 over
/// the capability and the plan's JSON, whose object keys serialize in a fixed order.
pub(crate) fn digest(capability: Capability, plan: &impl Serialize) -> String {
    let json = serde_json::to_vec(plan).unwrap_or_default();
    let mut hasher = blake3::Hasher::new();
    hasher.update(capability.as_str().as_bytes());
    hasher.update(b"\n");
    hasher.update(&json);
    hasher.finalize().to_hex().to_string()
}

/// What a grant is minted for.
pub(crate) struct Proposal<'a> {
    pub session: &'a SessionId,
    pub capability: Capability,
    pub target: String,
    pub digest: String,
    pub policy_revision: String,
    pub confirm: bool,
}

/// Mints a grant at `now_ms` and registers its id; returns the signed token and its claims.
pub(crate) fn mint(
    store: &dyn Backend,
    key: &GrantKey,
    scope: &Scope,
    proposal: Proposal<'_>,
    now_ms: i64,
) -> Result<(String, GrantClaims), skiff_store::Error> {
    let id = GrantId::from_suffix(&skiff_store::mint()?);
    let claims = GrantClaims {
        id: id.clone(),
        requester: scope.owner_id.clone(),
        tenant: scope.tenant_id.clone(),
        session: proposal.session.clone(),
        capability: proposal.capability,
        target: proposal.target,
        digest: proposal.digest,
        policy_revision: proposal.policy_revision,
        confirm: proposal.confirm,
        issued_at_ms: now_ms,
        expires_at_ms: now_ms.saturating_add(GRANT_TTL_MS),
    };
    store.register_grant(
        scope,
        &NewGrant {
            id,
            session_id: claims.session.clone(),
            capability: claims.capability.as_str().to_owned(),
            target: claims.target.clone(),
            policy_revision: claims.policy_revision.clone(),
            issued_at_ms: claims.issued_at_ms,
            expires_at_ms: claims.expires_at_ms,
        },
    )?;
    Ok((key.sign(&claims), claims))
}

/// The governed wrapper's check, before it executes: the grant verifies and is unexpired at
/// `now_ms`, is this requester's and session's grant for `capability`, is consumed now (once),
/// and `plan_digest` — recomputed from what is about to run — is the one it was minted for.
#[allow(
    clippy::too_many_arguments,
    reason = "each is one thing the wrapper checks the grant against"
)]
pub(crate) fn redeem(
    store: &dyn Backend,
    key: &GrantKey,
    scope: &Scope,
    session: &SessionId,
    capability: Capability,
    token: &str,
    plan_digest: &str,
    now_ms: i64,
) -> Result<GrantClaims, Refusal> {
    let claims = key.verify(token, now_ms)?;
    if claims.session != *session
        || claims.requester != scope.owner_id
        || claims.tenant != scope.tenant_id
    {
        return Err(Refusal::Foreign { id: claims.id });
    }
    if claims.capability != capability {
        return Err(Refusal::WrongCapability {
            id: claims.id,
            granted: claims.capability.as_str(),
            asked: capability.as_str(),
        });
    }
    match store
        .consume_grant(scope, session, &claims.id)
        .map_err(|e| Refusal::Store(e.to_string()))?
    {
        Consumed::Now => {}
        Consumed::Already => return Err(Refusal::Replayed { id: claims.id }),
        Consumed::Unknown => return Err(Refusal::Foreign { id: claims.id }),
    }
    if claims.digest != plan_digest {
        return Err(Refusal::DigestMismatch { id: claims.id });
    }
    Ok(claims)
}
