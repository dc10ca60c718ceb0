//! `[profiles.NAME]` tables of `skiff.toml`.

use crate::{Error, Result};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    Local,
    Ssh,
    Command,
}

/// How a local box is separated from the host's network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// sshd on a free loopback port of the host.
    None,
    /// sshd inside a network namespace that has only a loopback interface.
    Netns,
}

impl Isolation {
    /// `netns` when the gateway can make namespaces (root on Linux), else `none`.
    pub fn host_default() -> Self {
        if rustix::process::geteuid().is_root() && cfg!(target_os = "linux") {
            Isolation::Netns
        } else {
            Isolation::None
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileConfig {
    pub provider: ProviderKind,
    /// local: `none` or `netns` (default: netns as root on Linux, else none).
    #[serde(default)]
    pub isolation: Option<Isolation>,
    /// local: where boxes live.
    #[serde(default)]
    pub root: Option<PathBuf>,
    /// How long an unused environment is kept (default `30m`).
    #[serde(default)]
    pub idle_timeout: Option<String>,
    /// The longest an environment lives (default `8h`).
    #[serde(default)]
    pub ttl: Option<String>,
    /// ssh: the static host.
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default)]
    pub identity_file: Option<PathBuf>,
    /// ssh: the host's public key, `ssh-ed25519 AAAA…`.
    #[serde(default)]
    pub known_host_key: Option<String>,
    /// command: the lease CLI as argv (`["crabbox"]`).
    #[serde(default)]
    pub command: Option<Vec<String>>,
}

fn duration(profile: &str, key: &str, value: Option<&str>, default: &str) -> Result<Duration> {
    let text = value.unwrap_or(default);
    humantime::parse_duration(text).map_err(|e| Error::Config {
        profile: profile.to_owned(),
        problem: format!("`{key} = \"{text}\"` is not a duration like \"30m\" or \"8h\": {e}"),
    })
}

impl ProfileConfig {
    /// The built-in `local` profile.
    pub fn default_local() -> Self {
        Self {
            provider: ProviderKind::Local,
            isolation: None,
            root: None,
            idle_timeout: None,
            ttl: None,
            host: None,
            user: None,
            port: None,
            identity_file: None,
            known_host_key: None,
            command: None,
        }
    }

    pub fn isolation_or_default(&self) -> Isolation {
        self.isolation.unwrap_or_else(Isolation::host_default)
    }

    pub fn idle_timeout(&self) -> Result<Duration> {
        duration("", "idle_timeout", self.idle_timeout.as_deref(), "30m")
    }

    pub fn ttl(&self) -> Result<Duration> {
        duration("", "ttl", self.ttl.as_deref(), "8h")
    }

    pub fn idle_timeout_text(&self) -> String {
        self.idle_timeout.clone().unwrap_or_else(|| "30m".into())
    }

    pub fn ttl_text(&self) -> String {
        self.ttl.clone().unwrap_or_else(|| "8h".into())
    }

    /// Checks that the keys present fit the provider, naming the profile and key.
    pub fn validate(&self, name: &str) -> Result<()> {
        let bad = |problem: String| Error::Config {
            profile: name.to_owned(),
            problem,
        };
        duration(name, "idle_timeout", self.idle_timeout.as_deref(), "30m")?;
        duration(name, "ttl", self.ttl.as_deref(), "8h")?;
        let has = |present: bool, key: &str, allowed: &[ProviderKind]| {
            if present && !allowed.contains(&self.provider) {
                Err(bad(format!(
                    "`{key}` does not apply to provider {:?}",
                    self.provider
                )
                .to_lowercase()))
            } else {
                Ok(())
            }
        };
        use ProviderKind::*;
        has(self.isolation.is_some(), "isolation", &[Local])?;
        has(self.root.is_some(), "root", &[Local])?;
        has(self.host.is_some(), "host", &[Ssh])?;
        has(self.user.is_some(), "user", &[Ssh])?;
        has(self.port.is_some(), "port", &[Ssh])?;
        has(self.identity_file.is_some(), "identity_file", &[Ssh])?;
        has(self.known_host_key.is_some(), "known_host_key", &[Ssh])?;
        has(self.command.is_some(), "command", &[Command])?;
        match self.provider {
            Ssh => {
                for (key, present) in [
                    ("host", self.host.is_some()),
                    ("user", self.user.is_some()),
                    ("identity_file", self.identity_file.is_some()),
                    ("known_host_key", self.known_host_key.is_some()),
                ] {
                    if !present {
                        return Err(bad(format!("provider \"ssh\" needs `{key}`")));
                    }
                }
            }
            Command => {
                if self.command.as_ref().is_none_or(Vec::is_empty) {
                    return Err(bad(
                        "provider \"command\" needs `command = [\"your-lease-cli\"]`".into(),
                    ));
                }
            }
            Local => {
                if self.isolation == Some(Isolation::Netns) && !rustix::process::geteuid().is_root()
                {
                    return Err(bad(
                        "isolation = \"netns\" needs the gateway to run as root; use isolation = \"none\"".into(),
                    ));
                }
            }
        }
        Ok(())
    }
}
