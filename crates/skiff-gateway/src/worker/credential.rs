//! Worker credentials: claims signed with a key that never leaves the gateway's state dir.
//!
//! A credential is `skw1.<hex of the claims' JSON>.<hex of blake3 keyed hash>`. It is opaque to
//! the worker. Verification checks the signature; expiry, one-use admission and the bindings
//! (environment, worker key, bundle, session, epoch) are the endpoint's to check.

use skiff_protocol::worker::CredentialClaims;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

const PREFIX: &str = "skw1";

pub(crate) struct Signer {
    key: [u8; 32],
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum CredentialError {
    #[error("the credential is malformed")]
    Malformed,
    #[error("the credential's signature does not verify")]
    Signature,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

impl Signer {
    /// Loads the signing key from `path`, creating it (mode 0600) on first use.
    pub(crate) fn load_or_create(path: &Path) -> std::io::Result<Signer> {
        match std::fs::read(path) {
            Ok(bytes) => {
                return <[u8; 32]>::try_from(bytes.as_slice())
                    .map(|key| Signer { key })
                    .map_err(|_| {
                        std::io::Error::other(format!(
                            "{} is not a 32-byte key; remove it to mint a new one (workers then restart)",
                            path.display()
                        ))
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| std::io::Error::other(e.to_string()))?;
        let tmp = path.with_extension("tmp");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&key)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(Signer { key })
    }

    pub(crate) fn sign(&self, claims: &CredentialClaims) -> String {
        let json = serde_json::to_vec(claims).unwrap_or_default();
        let mac = blake3::keyed_hash(&self.key, &json);
        format!("{PREFIX}.{}.{}", hex(&json), mac.to_hex())
    }

    pub(crate) fn verify(&self, credential: &str) -> Result<CredentialClaims, CredentialError> {
        let mut parts = credential.split('.');
        let (Some(PREFIX), Some(body), Some(mac), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(CredentialError::Malformed);
        };
        let json = unhex(body).ok_or(CredentialError::Malformed)?;
        let mac = unhex(mac)
            .and_then(|m| <[u8; 32]>::try_from(m.as_slice()).ok())
            .ok_or(CredentialError::Malformed)?;
        // Constant-time comparison (blake3::Hash's PartialEq is).
        if blake3::keyed_hash(&self.key, &json) != blake3::Hash::from_bytes(mac) {
            return Err(CredentialError::Signature);
        }
        serde_json::from_slice(&json).map_err(|_| CredentialError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::worker::Method;
    use skiff_protocol::{EnvironmentId, SessionId};

    fn claims() -> CredentialClaims {
        CredentialClaims {
            credential_id: "c1".into(),
            environment_id: EnvironmentId::from_suffix("e"),
            worker_key: "ssh-ed25519 AAAA".into(),
            bundle_hash: "h".into(),
            session_id: SessionId::from_suffix("s"),
            owner_epoch: 2,
            methods: Method::ALL.to_vec(),
            issued_at_ms: 1,
            expires_at_ms: 2,
        }
    }

    #[test]
    fn a_signed_credential_verifies_and_a_tampered_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let signer = Signer::load_or_create(&dir.path().join("k")).unwrap();
        let token = signer.sign(&claims());
        assert_eq!(signer.verify(&token).unwrap(), claims());

        let mut forged = claims();
        forged.session_id = SessionId::from_suffix("other");
        let body = hex(&serde_json::to_vec(&forged).unwrap());
        let mac = token.rsplit('.').next().unwrap();
        assert!(matches!(
            signer.verify(&format!("skw1.{body}.{mac}")),
            Err(CredentialError::Signature)
        ));
        assert!(matches!(
            signer.verify("nope"),
            Err(CredentialError::Malformed)
        ));

        let other = Signer::load_or_create(&dir.path().join("k2")).unwrap();
        assert!(other.verify(&token).is_err());
        // The key survives a restart; a damaged key file is an error, never replaced.
        let again = Signer::load_or_create(&dir.path().join("k")).unwrap();
        assert!(again.verify(&token).is_ok());
        std::fs::write(dir.path().join("bad"), b"short").unwrap();
        let err = Signer::load_or_create(&dir.path().join("bad"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("not a 32-byte key"), "{err}");
        assert_eq!(std::fs::read(dir.path().join("bad")).unwrap(), b"short");
    }
}
