//! `skiff.toml`: one struct, unknown keys rejected, errors that name the key path.

use serde::Deserialize;
use skiff_llm::ProviderConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderConfig>,
    #[serde(default)]
    pub models: ModelsConfig,
    /// Worker profiles: where boxes come from. A `local` profile exists by default.
    #[serde(default)]
    pub profiles: BTreeMap<String, skiff_providers::ProfileConfig>,
    #[serde(default)]
    pub gateway: GatewayConfig,
    /// MCP servers whose allowlisted tools the gateway offers every session (`[mcp.NAME]`).
    #[serde(default)]
    pub mcp: BTreeMap<String, McpConfig>,
    /// Token and cost budgets per session, user and tenant (`[budgets]`; a profile's
    /// `[profiles.NAME.budgets]` overrides each key for its sessions).
    #[serde(default)]
    pub budgets: skiff_providers::BudgetsConfig,
    /// The audit trail's archive and retention (`[audit]`).
    #[serde(default)]
    pub audit: AuditConfig,
    /// Governed actions (`git_push`, `open_pull_request`): off unless `[forge]` is present.
    #[serde(default)]
    pub forge: Option<ForgeConfig>,
    /// Where the database and sessions' workspaces live (`[store]`).
    #[serde(default)]
    pub store: StoreConfig,
    /// The gateway's own git credentials for remote repositories (`[git]`).
    #[serde(default)]
    pub git: GitConfig,
    /// Optional OpenTelemetry traces (`[telemetry]`).
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// Agent specs (`[agents.NAME]`; `agents/NAME.toml` beside skiff.toml too).
    #[serde(default)]
    pub agents: BTreeMap<String, skiff_protocol::agent::AgentSpec>,
    /// Chat ingress (`[ingress.slack]`); off unless configured.
    #[serde(default)]
    pub ingress: crate::ingress::IngressConfig,
    /// Single sign-on (`[auth.proxy]`); off unless configured.
    #[serde(default)]
    pub auth: crate::sso::AuthConfig,
}

/// `[forge]`: where governed actions push and open pull requests, with the gateway's own
/// credential (never on a box).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForgeConfig {
    /// The GitHub-compatible REST API's base URL [default: "https://api.github.com"].
    pub api: Option<String>,
    /// The forge token: `"vault:NAME"` or `"env:VAR"`, never the token itself. Sent as
    /// `Authorization: Bearer` to the API and, for an `https` remote, to the push.
    pub token: Option<String>,
    /// `OWNER/REPO` pull requests are opened on [default: read from the remote's URL].
    pub repository: Option<String>,
    /// The remote of the session's repository `git_push` pushes to [default: "origin"].
    pub remote: Option<String>,
    /// Whether each governed action waits for a person's approval [default: true].
    pub confirm: Option<bool>,
}

/// `[store]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// The directory that holds sessions' worktrees, workspace copies, remote repositories'
    /// clones and checkpoint blobs, so that several gateways can share it [default: the state
    /// dir]. Created (mode 0700) when missing; it must be writable and not writable by every
    /// user.
    #[serde(default)]
    pub workspaces: Option<PathBuf>,
    /// The database: PostgreSQL, as a url (`"postgres://USER@HOST:PORT/DB"`) or a connection
    /// string (`"host=/run/postgresql user=skiff dbname=skiff"`) [default: the embedded SQLite
    /// database `skiff.db` in the state dir]. Keep the password out of it (`password`); one
    /// left in is never shown in a message or a log.
    #[serde(default)]
    pub url: Option<StoreUrl>,
    /// The database's password: `"env:VAR"` (the gateway's environment), never the password
    /// itself. Not `vault:` — the vault is kept in this database.
    #[serde(default)]
    pub password: Option<String>,
}

/// `[store] url`: its `Debug` never shows it (it may hold a password).
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct StoreUrl(pub String);

impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreUrl(…)")
    }
}

/// `[store] url` and its password, checked.
pub struct Postgres {
    pub url: String,
    pub password: Option<String>,
}

impl StoreConfig {
    /// The PostgreSQL database `url` names, with the password `password` reads; `None` for
    /// the embedded SQLite database. Messages never repeat the url or the password.
    pub fn postgres(&self, config_path: &Path) -> Result<Option<Postgres>, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: config_path.display().to_string(),
            message,
        };
        let Some(StoreUrl(url)) = &self.url else {
            if self.password.is_some() {
                return Err(invalid(
                    "at `store.password`: there is no `[store] url` for it (the embedded SQLite database has no password)".into(),
                ));
            }
            return Ok(None);
        };
        let url = url.trim();
        let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
        if !is_url && !url.contains('=') {
            return Err(invalid(
                "at `store.url`: not a PostgreSQL url (`postgres://USER@HOST/DB`) or connection string (`host=… dbname=…`); leave `[store] url` out for the embedded SQLite database".into(),
            ));
        }
        let password = match &self.password {
            None => None,
            Some(reference) => {
                let Some(var) = reference
                    .strip_prefix("env:")
                    .filter(|var| !var.is_empty() && !var.contains('='))
                else {
                    return Err(invalid(
                        "at `store.password`: must be \"env:VAR\" (a variable of the gateway's environment), never the password itself".into(),
                    ));
                };
                match std::env::var(var) {
                    Ok(password) => Some(password),
                    Err(_) => {
                        return Err(invalid(format!(
                            "at `store.password`: the environment variable {var} is not set"
                        )));
                    }
                }
            }
        };
        Ok(Some(Postgres {
            url: url.to_owned(),
            password,
        }))
    }
}

/// `[git]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitConfig {
    /// Credentials for remote repositories, keyed by a URL prefix (`"https://git.example.com/"`;
    /// the longest matching prefix wins). Used for `session new --repo` and `session publish`,
    /// only by the gateway, never handed to a box.
    #[serde(default)]
    pub credentials: BTreeMap<String, GitCredentialConfig>,
}

/// `[git.credentials."PREFIX"]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitCredentialConfig {
    /// The user name sent with the token [default: "x-access-token"].
    #[serde(default)]
    pub username: Option<String>,
    /// The token or password: `"vault:NAME"` or `"env:VAR"`, never the value itself.
    pub token: String,
}

/// `[telemetry]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// An OTLP/HTTP collector (`"http://127.0.0.1:4318"`); spans of every turn are exported to
    /// its `/v1/traces` as JSON [default: no traces].
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` the spans carry [default: "skiff-gateway"].
    #[serde(default)]
    pub service_name: Option<String>,
}

/// `[audit]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// How long audit rows stay in the database and archive files stay in `<state>/audit/`
    /// (`"90d"`, the default). A day's rows are archived once the day is over.
    #[serde(default)]
    pub retention: Option<String>,
}

impl AuditConfig {
    pub fn retention(&self, config_path: &Path) -> Result<std::time::Duration, ConfigError> {
        let text = self.retention.as_deref().unwrap_or("90d");
        humantime::parse_duration(text)
            .ok()
            .filter(|d| d.as_secs() >= 86_400)
            .ok_or_else(|| ConfigError::Invalid {
                path: config_path.display().to_string(),
                message: format!(
                    "at `audit.retention`: \"{text}\" is not a duration of at least a day like \"90d\""
                ),
            })
    }
}

/// `[mcp.NAME]`: one MCP server, run by the gateway (never on a box). Exactly one of
/// `command` (a stdio server the gateway starts) or `url` (a streamable-HTTP server).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// The program of a stdio server, started by the gateway with a clean environment.
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables for a stdio server: a literal, or `"env:VAR"` / `"vault:NAME"`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The endpoint of a streamable-HTTP server.
    pub url: Option<String>,
    /// Headers sent to an HTTP server: a literal, or `"env:VAR"` / `"vault:NAME"`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `Authorization: Bearer …` for an HTTP server: `"env:VAR"` or `"vault:NAME"` only.
    pub bearer: Option<String>,
    /// The tools of this server the agent is offered (required; none is offered otherwise).
    pub tools: Option<Vec<String>>,
    /// How long starting the server, listing its tools or one call may take [default: 60].
    pub timeout_s: Option<u64>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// How often worker sessions idle past their profile's `keep_attached` are parked, idle
    /// and expired environments reclaimed and leases in use renewed (default `30s`).
    #[serde(default)]
    pub lifetime_tick: Option<String>,
    /// How long a gateway's lease on a session's live work (or on a gateway-wide chore) lives
    /// unless renewed; with several gateways on one database, another takes a dead gateway's
    /// sessions over within it (default `5s`: a dead gateway's turns go on elsewhere within about 5–7 s).
    #[serde(default)]
    pub lease_ttl: Option<String>,
    /// How many worker sessions may hold a worker at once (a parked one holds none). Past it
    /// the session idle on its box the longest is parked to make room; only when every worker
    /// runs a turn (or is being placed) are new ones refused ("at capacity") [default: 16].
    #[serde(default)]
    pub max_workers: Option<u64>,
    /// How many child sessions one session's agent may start with its `dispatch` tool
    /// [default: 4].
    #[serde(default)]
    pub max_children: Option<u64>,
    /// Hosts the gateway-resident `web_fetch` tool may reach [default: none].
    #[serde(default)]
    pub web_fetch_allow: Vec<String>,
    /// How long a worker credential lives; workers rotate at two thirds of it [default: 10m].
    #[serde(default)]
    pub worker_credential_ttl: Option<String>,
    /// How long one turn may run before it is ended `timed_out`; a worker profile's own
    /// `turn_timeout` wins for its sessions [default: 2h].
    #[serde(default)]
    pub turn_timeout: Option<String>,
    /// The fraction of a model's context window past which a session's context is compacted
    /// (summarised) before the next model request, from 0.1 to 0.95 [default: 0.8].
    #[serde(default)]
    pub compact_at: Option<f64>,
    /// Which tool calls of gateway-placed sessions wait for a person (`never`, `on-request` or
    /// rules; a session's own `--approval` wins) [default: never].
    #[serde(default)]
    pub approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    /// How long a call waits for a decision before it is denied [default: 10m].
    #[serde(default)]
    pub approval_timeout: Option<String>,
    /// Debug only: injects a fault at one step of a pull-back's barrier, `"STEP:ACTION"`
    /// with STEP one of `drained`, `fenced`, `reconciled` and ACTION `kill-worker` or
    /// `cut-tunnel` [default: none]. It exists because no outside observer can time a fault
    /// to land between two steps of the barrier; the fault-injection tests set it.
    #[serde(default)]
    pub barrier_fault: Option<String>,
    /// Whether the `exec` and `process` commands of gateway-placed sessions run in a sandbox
    /// that hides the gateway's state dir, other workspaces and processes: `"on"` or `"off"`
    /// (they then run as the gateway's own user, with a warning at start) [default: "on"].
    #[serde(default)]
    pub local_sandbox: Option<String>,
    /// Directories of the host the sandbox of gateway-placed sessions shows read-write at
    /// their own paths besides the workspace (a shared build cache, a toolchain) [default:
    /// none]. Absolute, and neither inside the state dir nor holding it.
    #[serde(default)]
    pub local_sandbox_paths: Vec<PathBuf>,
}

impl GatewayConfig {
    /// `barrier_fault`, checked.
    pub(crate) fn barrier_fault(
        &self,
        config_path: &Path,
    ) -> Result<Option<crate::worker::BarrierFault>, ConfigError> {
        self.barrier_fault
            .as_deref()
            .map(|text| {
                crate::worker::BarrierFault::parse(text).map_err(|message| ConfigError::Invalid {
                    path: config_path.display().to_string(),
                    message: format!("[gateway] barrier_fault: {message}"),
                })
            })
            .transpose()
    }

    pub fn lifetime_tick(&self, config_path: &Path) -> Result<std::time::Duration, ConfigError> {
        duration(
            config_path,
            "lifetime_tick",
            self.lifetime_tick.as_deref(),
            "30s",
        )
    }

    pub fn lease_ttl(&self, config_path: &Path) -> Result<std::time::Duration, ConfigError> {
        duration(config_path, "lease_ttl", self.lease_ttl.as_deref(), "5s")
    }

    pub fn worker_credential_ttl(
        &self,
        config_path: &Path,
    ) -> Result<std::time::Duration, ConfigError> {
        duration(
            config_path,
            "worker_credential_ttl",
            self.worker_credential_ttl.as_deref(),
            "10m",
        )
    }

    /// `compact_at`, checked against its range.
    pub fn compact_at(&self, config_path: &Path) -> Result<f64, ConfigError> {
        let value = self
            .compact_at
            .unwrap_or(skiff_agent::compact::DEFAULT_COMPACT_AT);
        let range = skiff_agent::compact::COMPACT_AT_RANGE;
        if range.contains(&value) {
            return Ok(value);
        }
        Err(ConfigError::Invalid {
            path: config_path.display().to_string(),
            message: format!(
                "at `gateway.compact_at`: {value} is not a fraction of the context window from {} to {} (like 0.8)",
                range.start(),
                range.end()
            ),
        })
    }

    pub fn approval_timeout(&self, config_path: &Path) -> Result<std::time::Duration, ConfigError> {
        duration(
            config_path,
            "approval_timeout",
            self.approval_timeout.as_deref(),
            "10m",
        )
    }

    /// `local_sandbox`: whether gateway-placed sessions' commands are sandboxed.
    pub fn local_sandbox(&self, config_path: &Path) -> Result<bool, ConfigError> {
        match self.local_sandbox.as_deref() {
            None | Some("on") => Ok(true),
            Some("off") => Ok(false),
            Some(other) => Err(ConfigError::Invalid {
                path: config_path.display().to_string(),
                message: format!(
                    "at `gateway.local_sandbox`: \"{other}\" is neither \"on\" (the default) nor \"off\""
                ),
            }),
        }
    }

    /// `local_sandbox_paths`, checked: each an absolute path, canonicalized, that neither
    /// lies in the state dir nor holds it.
    pub fn local_sandbox_paths(
        &self,
        config_path: &Path,
        state_dir: &Path,
    ) -> Result<Vec<PathBuf>, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: config_path.display().to_string(),
            message: format!("at `gateway.local_sandbox_paths`: {message}"),
        };
        self.local_sandbox_paths
            .iter()
            .map(|path| {
                if !path.is_absolute() {
                    return Err(invalid(format!(
                        "{} is not an absolute path",
                        path.display()
                    )));
                }
                let real = path.canonicalize().map_err(|e| {
                    invalid(format!(
                        "{}: {e}; give a directory that exists",
                        path.display()
                    ))
                })?;
                if real.starts_with(state_dir) || state_dir.starts_with(&real) {
                    return Err(invalid(format!(
                        "{} overlaps the state dir {}, which the sandbox exists to hide",
                        path.display(),
                        state_dir.display()
                    )));
                }
                Ok(real)
            })
            .collect()
    }

    pub fn turn_timeout(&self, config_path: &Path) -> Result<std::time::Duration, ConfigError> {
        duration(
            config_path,
            "turn_timeout",
            self.turn_timeout.as_deref(),
            "2h",
        )
    }
}

fn duration(
    config_path: &Path,
    key: &str,
    text: Option<&str>,
    default: &str,
) -> Result<std::time::Duration, ConfigError> {
    let text = text.unwrap_or(default);
    humantime::parse_duration(text)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| ConfigError::Invalid {
            path: config_path.display().to_string(),
            message: format!("at `gateway.{key}`: \"{text}\" is not a duration like \"{default}\""),
        })
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsConfig {
    /// `provider/model-id` used when a session names no model.
    pub default: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Invalid { path: String, message: String },
}

impl Config {
    /// Reads `path`; a missing file means the defaults.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        Self::parse(&text).map_err(|message| ConfigError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parses TOML text; the error names the key path (`providers.openai.bse_url`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let de = toml::Deserializer::parse(text).map_err(|e| e.message().to_owned())?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path.is_empty() || path == "." {
                inner.message().to_owned()
            } else {
                format!("at `{path}`: {}", inner.message())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_the_default() {
        let c = Config::parse("").unwrap();
        assert!(c.providers.is_empty());
        assert!(c.models.default.is_none());
    }

    #[test]
    fn unknown_key_names_its_path() {
        let err = Config::parse(
            "[providers.openai]\napi = \"openai-completions\"\nbse_url = \"http://x\"\n",
        )
        .unwrap_err();
        assert!(err.contains("providers.openai"), "{err}");
        assert!(err.contains("bse_url"), "{err}");
    }

    #[test]
    fn a_misspelt_price_names_its_model() {
        let err = Config::parse(
            "[providers.openai]\napi = \"openai-completions\"\n\
             [providers.openai.prices.\"gpt-4o\"]\ninput = 2.5\noutput = 10.0\ncached = 1.25\n",
        )
        .unwrap_err();
        assert!(err.contains("providers.openai.prices.gpt-4o"), "{err}");
        assert!(
            err.contains("cached") && err.contains("cache_read"),
            "{err}"
        );
    }

    #[test]
    fn wrong_type_names_its_path() {
        let err = Config::parse("[models]\ndefault = 3\n").unwrap_err();
        assert!(err.contains("models.default"), "{err}");
    }

    #[test]
    fn an_unknown_box_limit_names_its_path() {
        let err = Config::parse(
            "[profiles.local]\nprovider = \"local\"\n[profiles.local.limits]\nmemroy = \"1GiB\"\n",
        )
        .unwrap_err();
        assert!(err.contains("profiles.local.limits"), "{err}");
        assert!(err.contains("memroy"), "{err}");
    }

    #[test]
    fn bad_api_names_its_path() {
        let err = Config::parse("[providers.x]\napi = \"grpc\"\n").unwrap_err();
        assert!(err.contains("providers.x.api"), "{err}");
    }
}
