//! `[profiles.NAME]` tables of `skiff.toml`.

use crate::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};
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

/// A profile's answer to a box that dies mid-turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Failover {
    /// A fresh box takes the turn over from the last checkpoint.
    #[default]
    Auto,
    /// The turn ends failed; the next message places the session again.
    Manual,
}

/// How much of the session branch's history a box's repository gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum History {
    /// Only the base commit (a shallow repository): what the box needs to work and commit.
    #[default]
    Shallow,
    /// Every commit of the session branch (`git log` and `blame` on the box see it all).
    Full,
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
    /// How long a worker session keeps its box after a turn, so a follow-up starts at once;
    /// then the box goes back to the idle pool and the session is `parked` (default `10m`).
    #[serde(default)]
    pub keep_attached: Option<String>,
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
    /// local: what one box may use (`[profiles.NAME.limits]`).
    #[serde(default)]
    pub limits: Option<LimitsConfig>,
    /// `shallow` (default: the box's repository has the base commit only) or `full`.
    #[serde(default)]
    pub history: History,
    /// A command line run on the box before the worker starts, in the workspace, as the box
    /// user (`.skiff/setup.sh` in the repository is used when this is unset).
    #[serde(default)]
    pub setup: Option<String>,
    /// How long setup may run (default `20m`).
    #[serde(default)]
    pub setup_timeout: Option<String>,
    /// How long one turn of a session on this profile may run before it is ended `timed_out`
    /// (default: the gateway's `turn_timeout`).
    #[serde(default)]
    pub turn_timeout: Option<String>,
    /// Which tool calls of this profile's sessions wait for a person (`never`, `on-request`
    /// or rules; a session's own `--approval` wins) [default: never].
    #[serde(default)]
    pub approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    /// The agent spec (`NAME` or `NAME@DIGEST`) this profile's sessions run with when they
    /// name none.
    #[serde(default)]
    pub agent: Option<String>,
    /// How long a worker of this profile may go without progress during a turn (no event, no
    /// model call or output, no transcript write) before it is treated as dead and replaced
    /// (default `15m`).
    #[serde(default)]
    pub stall_timeout: Option<String>,
    /// What happens to a turn whose box dies: `auto` (default) goes on on a fresh box from the
    /// last checkpoint, `manual` ends it failed and waits for the next message.
    #[serde(default)]
    pub failover: Failover,
    /// How many times one turn may fail over to a fresh box (default 2).
    #[serde(default)]
    pub failover_attempts: Option<u32>,
    /// Secrets for setup only: `NAME = "env:GATEWAY_VAR"` (the gateway's environment) or
    /// `NAME = "vault:SECRET"` (the gateway's vault).
    #[serde(default)]
    pub setup_env: std::collections::BTreeMap<String, String>,
    /// Files whose contents key a prepared-box snapshot (lockfiles), besides the script's own
    /// `# skiff: key-files = …` line.
    #[serde(default)]
    pub setup_key_files: Vec<String>,
    /// local: host directories every box sees read-only at the same path (toolchains).
    #[serde(default)]
    pub share: Vec<PathBuf>,
    /// Hosts the box may reach through the gateway's egress proxy (`[profiles.NAME.egress]`).
    #[serde(default)]
    pub egress: EgressConfig,
    /// command: the lease CLI implements the optional snapshot verbs (`snapshot`, `warmup
    /// --from-snapshot`, `snapshot-rm`, `snapshot-list`). Default false. (Local boxes always
    /// take snapshots.)
    #[serde(default)]
    pub snapshots: Option<bool>,
    /// How much disk this profile's snapshots may take together (`"10GiB"`, the default); past
    /// it the least recently used ones are deleted.
    #[serde(default)]
    pub snapshot_budget: Option<String>,
    /// Token and cost limits for sessions on this profile, each key over `[budgets]`'s own
    /// (`[profiles.NAME.budgets]`). Enforced by the gateway; nothing here reads them.
    #[serde(default)]
    pub budgets: BudgetsConfig,
}

/// `[budgets]` and `[profiles.NAME.budgets]`: token and cost limits, each optional (no limit
/// when absent). Sessions count over their life; users (a scope's owner) and tenants per UTC
/// day. Tokens are input (cache reads included) plus output; costs are US dollars at the
/// catalog's prices.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetsConfig {
    #[serde(default)]
    pub session_tokens: Option<u64>,
    #[serde(default)]
    pub session_cost_usd: Option<f64>,
    #[serde(default)]
    pub user_tokens_per_day: Option<u64>,
    #[serde(default)]
    pub user_cost_usd_per_day: Option<f64>,
    #[serde(default)]
    pub tenant_tokens_per_day: Option<u64>,
    #[serde(default)]
    pub tenant_cost_usd_per_day: Option<f64>,
}

/// `[profiles.NAME.egress]`: allowlists of the gateway's egress proxy, per phase.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    /// What setup may reach: `"preset:python"`, `"pypi.example.com"`, `"*.internal.example"`.
    #[serde(default)]
    pub setup: Vec<String>,
    /// What the agent's `exec` may reach (default: nothing).
    #[serde(default)]
    pub agent: Vec<String>,
}

/// The default of `snapshot_budget`.
pub const DEFAULT_SNAPSHOT_BUDGET: u64 = 10 * GIB;

/// `[profiles.NAME.limits]`: resource limits of a local box's sandbox. Every key is optional;
/// a missing one takes the default of [`Limits`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Processes and threads of the box user (`RLIMIT_NPROC`, cgroup v2 `pids.max`).
    #[serde(default)]
    pub processes: Option<u64>,
    /// Open files per process (`RLIMIT_NOFILE`).
    #[serde(default)]
    pub open_files: Option<u64>,
    /// The largest file a box process may write (`RLIMIT_FSIZE`), `"4GiB"`.
    #[serde(default)]
    pub file_size: Option<String>,
    /// Address space per process (`RLIMIT_AS`; cgroup v2 `memory.max` for the whole box).
    #[serde(default)]
    pub memory: Option<String>,
    /// Size of the box's private `/tmp` (a tmpfs, so it is memory too).
    #[serde(default)]
    pub tmp_size: Option<String>,
}

/// What one local box may use. Written into the box's record, applied by its sandbox init.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct Limits {
    pub processes: u64,
    pub open_files: u64,
    pub file_size_bytes: u64,
    pub memory_bytes: u64,
    pub tmp_bytes: u64,
}

const GIB: u64 = 1 << 30;

impl Default for Limits {
    /// Room for a worker, git, rsync, a compiler and a test suite; not for a fork bomb or a
    /// runaway allocation that would take the host down with it.
    fn default() -> Self {
        Self {
            processes: 1024,
            open_files: 4096,
            file_size_bytes: 4 * GIB,
            memory_bytes: 8 * GIB,
            tmp_bytes: GIB,
        }
    }
}

/// `"8GiB"`, `"512MiB"`, `"64K"`, `"1048576"` (bytes): binary multiples.
fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        _ => return None,
    };
    number.checked_mul(1 << shift)
}

impl LimitsConfig {
    /// The limits, each key checked; an error names the key (`limits.memory`).
    pub fn resolve(&self, profile: &str) -> Result<Limits> {
        let bad = |key: &str, value: String, what: &str| Error::Config {
            profile: profile.to_owned(),
            problem: format!("`limits.{key} = {value}` is not {what}"),
        };
        let d = Limits::default();
        let count = |key: &str, value: Option<u64>, default: u64| match value {
            Some(0) => Err(bad(key, "0".into(), "a count above zero")),
            Some(n) => Ok(n),
            None => Ok(default),
        };
        let size = |key: &str, value: &Option<String>, default: u64| match value {
            None => Ok(default),
            Some(text) => parse_size(text).filter(|n| *n > 0).ok_or_else(|| {
                bad(
                    key,
                    format!("{text:?}"),
                    "a size above zero like \"8GiB\", \"512MiB\" or \"64K\"",
                )
            }),
        };
        Ok(Limits {
            processes: count("processes", self.processes, d.processes)?,
            open_files: count("open_files", self.open_files, d.open_files)?,
            file_size_bytes: size("file_size", &self.file_size, d.file_size_bytes)?,
            memory_bytes: size("memory", &self.memory, d.memory_bytes)?,
            tmp_bytes: size("tmp_size", &self.tmp_size, d.tmp_bytes)?,
        })
    }
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
            keep_attached: None,
            host: None,
            user: None,
            port: None,
            identity_file: None,
            known_host_key: None,
            command: None,
            limits: None,
            history: History::Shallow,
            setup: None,
            setup_timeout: None,
            turn_timeout: None,
            approval: None,
            agent: None,
            stall_timeout: None,
            failover: Failover::Auto,
            failover_attempts: None,
            setup_env: Default::default(),
            setup_key_files: Vec::new(),
            egress: EgressConfig::default(),
            share: Vec::new(),
            snapshots: None,
            snapshot_budget: None,
            budgets: BudgetsConfig::default(),
        }
    }

    /// How many bytes this profile's snapshots may take together; the error names the key.
    pub fn snapshot_budget(&self, name: &str) -> Result<u64> {
        match &self.snapshot_budget {
            None => Ok(DEFAULT_SNAPSHOT_BUDGET),
            Some(text) => parse_size(text).ok_or_else(|| Error::Config {
                profile: name.to_owned(),
                problem: format!(
                    "`snapshot_budget = {text:?}` is not a size like \"10GiB\", \"512MiB\" or \"0\" (no snapshots kept)"
                ),
            }),
        }
    }

    /// The resource limits of this profile's local boxes.
    pub fn limits(&self, name: &str) -> Result<Limits> {
        self.limits.clone().unwrap_or_default().resolve(name)
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

    /// How long setup may run.
    pub fn setup_timeout(&self) -> Result<Duration> {
        duration("", "setup_timeout", self.setup_timeout.as_deref(), "20m")
    }

    /// How long a turn may run, when the profile says (else the gateway's default applies).
    pub fn turn_timeout(&self) -> Result<Option<Duration>> {
        self.turn_timeout
            .as_deref()
            .map(|text| duration("", "turn_timeout", Some(text), "30m"))
            .transpose()
    }

    /// How many times one turn may move to a fresh box after its box died (0: never).
    pub fn failovers_allowed(&self) -> u32 {
        match self.failover {
            Failover::Auto => self.failover_attempts.unwrap_or(2),
            Failover::Manual => 0,
        }
    }

    /// How long a worker may go without progress during a turn.
    pub fn stall_timeout(&self) -> Result<Duration> {
        duration("", "stall_timeout", self.stall_timeout.as_deref(), "15m")
    }

    /// Setup's secrets, each read now: `env:VAR` from the gateway's environment, `vault:NAME`
    /// through `vault` (the gateway's vault; its error says why a secret cannot be had). An
    /// error names the key and the variable or secret, never a value.
    pub fn setup_secrets(
        &self,
        name: &str,
        vault: &dyn Fn(&str) -> std::result::Result<String, String>,
    ) -> Result<Vec<(String, String)>> {
        let bad = |problem: String| Error::Config {
            profile: name.to_owned(),
            problem,
        };
        let mut secrets = Vec::new();
        for (key, source) in &self.setup_env {
            if !is_env_name(key) {
                return Err(bad(format!(
                    "`setup_env.{key}` is not an environment variable name (letters, digits, _)"
                )));
            }
            if let Some(secret) = source.strip_prefix("vault:").filter(|v| !v.is_empty()) {
                let value = vault(secret).map_err(|problem| {
                    bad(format!("`setup_env.{key} = \"vault:{secret}\"`: {problem}"))
                })?;
                secrets.push((key.clone(), value));
                continue;
            }
            let Some(var) = source.strip_prefix("env:").filter(|v| is_env_name(v)) else {
                return Err(bad(format!(
                    "`setup_env.{key} = {source:?}` must name a gateway environment variable or a vault secret, like \"env:NPM_TOKEN\" or \"vault:npm\""
                )));
            };
            let value = std::env::var(var).map_err(|_| {
                bad(format!(
                    "`setup_env.{key}` reads {var} from the gateway's environment, which does not set it"
                ))
            })?;
            secrets.push((key.clone(), value));
        }
        Ok(secrets)
    }

    pub fn keep_attached(&self) -> Result<Duration> {
        duration("", "keep_attached", self.keep_attached.as_deref(), "10m")
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
        duration(name, "setup_timeout", self.setup_timeout.as_deref(), "20m")?;
        if let Some(text) = self.turn_timeout.as_deref()
            && duration(name, "turn_timeout", Some(text), "30m")?.is_zero()
        {
            return Err(bad("`turn_timeout` must be longer than 0s".into()));
        }
        if duration(name, "stall_timeout", self.stall_timeout.as_deref(), "15m")?.is_zero() {
            return Err(bad("`stall_timeout` must be longer than 0s".into()));
        }
        if self.setup.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(bad(
                "`setup` is empty; remove it to use .skiff/setup.sh".into()
            ));
        }
        duration(name, "keep_attached", self.keep_attached.as_deref(), "10m")?;
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
        has(self.limits.is_some(), "limits", &[Local])?;
        has(!self.share.is_empty(), "share", &[Local])?;
        has(self.snapshots.is_some(), "snapshots", &[Command])?;
        has(
            self.snapshot_budget.is_some(),
            "snapshot_budget",
            &[Local, Command],
        )?;
        self.limits(name)?;
        self.snapshot_budget(name)?;
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

/// Checks a `share` directory: absolute, an existing directory, and neither it nor a parent
/// writable by anyone but its owner root (a box user could otherwise swap what others trust),
/// and not inside any of `private` (the gateway's state, the box root).
pub(crate) fn check_share(profile: &str, share: &Path, private: &[&Path]) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let bad = |problem: String| Error::Config {
        profile: profile.to_owned(),
        problem: format!("`share = [\"{}\"]`: {problem}", share.display()),
    };
    if !share.is_absolute() {
        return Err(bad("not an absolute path".into()));
    }
    let real = share
        .canonicalize()
        .map_err(|e| bad(format!("cannot be used: {e}")))?;
    if !real.is_dir() {
        return Err(bad("not a directory".into()));
    }
    for inside in private {
        let inside = inside
            .canonicalize()
            .unwrap_or_else(|_| inside.to_path_buf());
        if real.starts_with(&inside) || inside.starts_with(&real) {
            return Err(bad(format!(
                "overlaps {}, which boxes must never see",
                inside.display()
            )));
        }
    }
    for dir in real.ancestors() {
        let meta = std::fs::metadata(dir).map_err(|e| bad(format!("{}: {e}", dir.display())))?;
        let mode = meta.mode();
        let owner_ok = meta.uid() == 0 || meta.uid() == rustix::process::geteuid().as_raw();
        if mode & 0o002 != 0 || (mode & 0o020 != 0 && meta.gid() != 0) || !owner_ok {
            return Err(bad(format!(
                "{} is not root's alone (owner uid {}, mode {:o}); a shared directory and its \
                 parents must be owned by root (or the gateway's user) and writable by no one else",
                dir.display(),
                meta.uid(),
                mode & 0o7777
            )));
        }
    }
    Ok(())
}

/// A portable environment variable name.
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_binary_multiples() {
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        for bad in ["", "GiB", "8 gigs", "-1G", "1.5G", "99999999999999999999T"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn missing_limits_take_the_defaults_and_bad_ones_name_their_key() {
        let mut profile = ProfileConfig::default_local();
        assert_eq!(profile.limits("local").unwrap(), Limits::default());
        profile.limits = Some(LimitsConfig {
            processes: Some(64),
            memory: Some("2GiB".into()),
            ..LimitsConfig::default()
        });
        let limits = profile.limits("local").unwrap();
        assert_eq!(limits.processes, 64);
        assert_eq!(limits.memory_bytes, 2 << 30);
        assert_eq!(limits.open_files, Limits::default().open_files);

        profile.limits = Some(LimitsConfig {
            file_size: Some("lots".into()),
            ..LimitsConfig::default()
        });
        let err = profile.validate("local").unwrap_err().to_string();
        assert!(err.contains("profile `local`"), "{err}");
        assert!(err.contains("`limits.file_size = \"lots\"`"), "{err}");
        profile.limits = Some(LimitsConfig {
            processes: Some(0),
            ..LimitsConfig::default()
        });
        let err = profile.validate("local").unwrap_err().to_string();
        assert!(err.contains("`limits.processes = 0`"), "{err}");
    }

    #[test]
    fn limits_belong_to_local_profiles_only() {
        let mut profile = ProfileConfig::default_local();
        profile.provider = ProviderKind::Command;
        profile.command = Some(vec!["crabbox".into()]);
        profile.limits = Some(LimitsConfig::default());
        let err = profile.validate("cloud").unwrap_err().to_string();
        assert!(err.contains("`limits` does not apply"), "{err}");
    }

    #[test]
    fn the_snapshot_budget_is_ten_gib_unless_a_size_is_given() {
        let mut profile = ProfileConfig::default_local();
        assert_eq!(profile.snapshot_budget("local").unwrap(), 10 << 30);
        profile.snapshot_budget = Some("512MiB".into());
        assert_eq!(profile.snapshot_budget("local").unwrap(), 512 << 20);
        profile.snapshot_budget = Some("lots".into());
        let err = profile.validate("local").unwrap_err().to_string();
        assert!(err.contains("`snapshot_budget = \"lots\"`"), "{err}");

        // `snapshots = true` declares a lease CLI's verbs; it means nothing elsewhere.
        let mut profile = ProfileConfig::default_local();
        profile.snapshots = Some(true);
        let err = profile.validate("local").unwrap_err().to_string();
        assert!(err.contains("`snapshots` does not apply"), "{err}");
    }

    #[test]
    fn keep_attached_defaults_to_ten_minutes_and_a_bad_one_names_its_key() {
        let parse = |text: &str| serde_json::from_str::<ProfileConfig>(text).unwrap();
        let profile = parse(r#"{"provider": "local"}"#);
        assert_eq!(profile.keep_attached().unwrap(), Duration::from_secs(600));
        let profile = parse(r#"{"provider": "local", "keep_attached": "90s"}"#);
        assert_eq!(profile.keep_attached().unwrap(), Duration::from_secs(90));
        let profile = parse(r#"{"provider": "local", "keep_attached": "soon"}"#);
        let err = profile.validate("local").unwrap_err().to_string();
        assert!(err.contains("profile `local`"), "{err}");
        assert!(err.contains("`keep_attached = \"soon\"`"), "{err}");
    }

    #[test]
    fn history_is_shallow_unless_full_is_asked_for() {
        let parse = |text: &str| serde_json::from_str::<ProfileConfig>(text);
        let profile = parse(r#"{"provider": "local"}"#).unwrap();
        assert_eq!(profile.history, History::Shallow);
        let profile = parse(r#"{"provider": "local", "history": "full"}"#).unwrap();
        assert_eq!(profile.history, History::Full);
        assert!(parse(r#"{"provider": "local", "history": "deep"}"#).is_err());
    }
}
