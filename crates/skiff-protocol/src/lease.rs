//! The lease-CLI contract (the "Crabbox shape"): what `COMMAND status --id ID --json` and
//! `COMMAND list --json` print, and what the optional snapshot verbs (`snapshot`,
//! `snapshot-list`) print. `skiff box` speaks it for local boxes; the `command` provider
//! consumes it from any conforming CLI.

use serde::{Deserialize, Serialize};

/// One lease as a lease CLI reports it. Field names are the contract's (camelCase). A lease the
/// CLI does not know is reported with state `gone` and empty SSH fields.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseCliStatus {
    /// `cbx_` followed by 12 lowercase hex characters.
    pub id: String,
    /// `running` when the box accepts SSH; `starting`, `stopped`, `failed` otherwise.
    pub state: String,
    #[serde(default)]
    pub ssh_host: String,
    #[serde(default)]
    pub ssh_port: u16,
    #[serde(default)]
    pub ssh_user: String,
    /// Path of the private key to log in with (or the key itself, PEM/OpenSSH armored).
    #[serde(default)]
    pub ssh_key: String,
    /// The box's public host key, `ssh-ed25519 AAAA…`.
    #[serde(default)]
    pub ssh_host_key: String,
    /// Unix milliseconds.
    #[serde(default)]
    pub expires_at: Option<i64>,
    /// A command OpenSSH must use to reach the box (as argv), when TCP cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_command: Option<Vec<String>>,
}

impl LeaseCliStatus {
    /// A lease with no SSH endpoint: one that is `gone`, or broken before it got one.
    pub fn without_endpoint(id: &str, state: &str) -> Self {
        Self {
            id: id.to_owned(),
            state: state.to_owned(),
            ssh_host: String::new(),
            ssh_port: 0,
            ssh_user: String::new(),
            ssh_key: String::new(),
            ssh_host_key: String::new(),
            expires_at: None,
            proxy_command: None,
        }
    }
}

/// One snapshot as a lease CLI reports it: what `COMMAND snapshot --id LEASE --snapshot-id
/// SNAP --json` prints (`{"id","sizeBytes"}`), and each element of `COMMAND snapshot-list
/// --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseCliSnapshot {
    /// `snap_` followed by 16 lowercase hex characters (the id the gateway asked for).
    pub id: String,
    /// What the snapshot takes on the provider's disk.
    pub size_bytes: u64,
}

/// Whether `id` is a well-formed lease-CLI id.
pub fn is_lease_cli_id(id: &str) -> bool {
    id.strip_prefix("cbx_").is_some_and(|hex| {
        hex.len() == 12
            && hex
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn lease_ids_are_cbx_and_twelve_hex() {
        assert!(super::is_lease_cli_id("cbx_0123456789ab"));
        assert!(!super::is_lease_cli_id("cbx_0123456789AB"));
        assert!(!super::is_lease_cli_id("cbx_0123456789a"));
        assert!(!super::is_lease_cli_id("box_0123456789ab"));
    }
}
