//! The vault's API payloads (`/v1/secrets`): names and dates go out; a value only ever comes in,
//! in a request body, and no `Debug` here prints one.

use serde::{Deserialize, Serialize};

/// One secret as listed: never its value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretView {
    pub name: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// `GET /v1/secrets`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretList {
    pub secrets: Vec<SecretView>,
}

/// `PUT /v1/secrets/{name}`: the value, in the body only (never a URL or a command line).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetSecretRequest {
    pub value: String,
}

impl std::fmt::Debug for SetSecretRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SetSecretRequest")
            .field("value", &"<redacted>")
            .finish()
    }
}

/// `POST /v1/secrets/rotate-key`: what a rotation did.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RotatedKey {
    /// How many secrets were sealed again under the new key.
    pub resealed: usize,
    /// Where the new key lives: `<state>/vault.key`, or `SKIFF_VAULT_KEY`.
    pub key_source: String,
    /// The new key (base64), only when it lives in `SKIFF_VAULT_KEY`: the gateway cannot set
    /// its own environment, so the operator must, before the gateway next starts. Shown once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_key: Option<String>,
}

impl std::fmt::Debug for RotatedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RotatedKey")
            .field("resealed", &self.resealed)
            .field("key_source", &self.key_source)
            .field("new_key", &self.new_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}
