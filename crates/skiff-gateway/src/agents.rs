//! Agent specs you can pin: `[agents.NAME]` in skiff.toml or `agents/NAME.toml` beside it,
//! stored content-addressed (sha256 of [`AgentSpec::canonical`]) at start and whenever a
//! spec is read again and has changed (`sync`, before a session is created and when specs
//! are listed). A session is pinned to one version when it is created and runs every turn
//! with that version, whatever the configuration says later. A stored version is checked
//! against its digest each time it is read: one that does not match is refused, by name.

use sha2::{Digest, Sha256};
use skiff_protocol::agent::{AgentPin, AgentSpec, AgentVersion, short_ref};
use skiff_store::{AgentSpecRow, Backend};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The tools an allowlist may name besides `mcp__…` ones.
const KNOWN_TOOLS: &[&str] = &[
    "read",
    "write",
    "edit",
    "apply_patch",
    "ls",
    "find",
    "grep",
    "exec",
    "process",
    skiff_agent::tools::WEB_FETCH,
    skiff_agent::tools::DISPATCH,
    skiff_agent::tools::DISPATCH_STATUS,
    skiff_agent::tools::DISPATCH_WAIT,
];

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent spec {name}: {message}")]
    Invalid { name: String, message: String },
    #[error("cannot read agent spec {path}: {message}")]
    Read { path: String, message: String },
    #[error("no agent spec named {name}; `skiff agent list` shows the configured ones")]
    Unknown { name: String },
    #[error(
        "agent spec {name} has no version with digest {digest}; `skiff agent show {name}` lists its versions"
    )]
    NoSuchVersion { name: String, digest: String },
    #[error(
        "agent spec {name}: digest prefix {digest} matches more than one version; give more of it"
    )]
    Ambiguous { name: String, digest: String },
    #[error(
        "agent spec {spec} is refused: its stored content does not match its digest (the database row was changed); run the session with another version"
    )]
    Corrupt { spec: String },
}

/// The sha256 of a spec's canonical content, lowercase hex.
pub(crate) fn digest_of(content: &str) -> String {
    let hash = Sha256::digest(content.as_bytes());
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where specs are configured.
pub(crate) struct Agents {
    config_path: PathBuf,
}

impl Agents {
    pub(crate) fn new(config_path: &Path) -> Self {
        Self {
            config_path: config_path.to_path_buf(),
        }
    }

    fn agents_dir(&self) -> PathBuf {
        self.config_path
            .parent()
            .map(|p| p.join("agents"))
            .unwrap_or_else(|| PathBuf::from("agents"))
    }

    /// `[agents.*]` of skiff.toml as it is now. Only that table is read: the gateway checked the
    /// rest when it started, and an edit in progress elsewhere must not stop sessions from
    /// pinning a spec.
    fn specs_in_config_file(&self) -> Result<BTreeMap<String, AgentSpec>, AgentError> {
        #[derive(serde::Deserialize)]
        struct AgentsOnly {
            #[serde(default)]
            agents: BTreeMap<String, AgentSpec>,
        }
        let read = |message: String| AgentError::Read {
            path: self.config_path.display().to_string(),
            message,
        };
        let text = match std::fs::read_to_string(&self.config_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(read(e.to_string())),
        };
        let de = toml::Deserializer::parse(&text).map_err(|e| read(e.message().to_owned()))?;
        serde_path_to_error::deserialize::<_, AgentsOnly>(de)
            .map(|only| only.agents)
            .map_err(|e| read(format!("at `{}`: {}", e.path(), e.inner().message())))
    }

    /// Every spec the configuration names now: `[agents.NAME]`, then `agents/NAME.toml`
    /// (a name in both is refused).
    pub(crate) fn configured(&self) -> Result<BTreeMap<String, AgentSpec>, AgentError> {
        let mut specs = self.specs_in_config_file()?;
        let dir = self.agents_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| e.path()).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(AgentError::Read {
                    path: dir.display().to_string(),
                    message: e.to_string(),
                });
            }
        };
        let mut files: Vec<PathBuf> = entries;
        files.sort();
        for path in files {
            if path.extension().and_then(|e| e.to_str()) != Some("toml") {
                continue;
            }
            let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else {
                continue;
            };
            let read = |message: String| AgentError::Read {
                path: path.display().to_string(),
                message,
            };
            let text = std::fs::read_to_string(&path).map_err(|e| read(e.to_string()))?;
            let spec: AgentSpec =
                toml::from_str(&text).map_err(|e| read(e.message().to_owned()))?;
            if specs.contains_key(&name) {
                return Err(AgentError::Invalid {
                    name,
                    message: format!(
                        "defined both as [agents.{}] in skiff.toml and in {}",
                        path.file_stem()
                            .and_then(|s| s.to_str())
                            .unwrap_or_default(),
                        path.display()
                    ),
                });
            }
            specs.insert(name, spec);
        }
        for (name, spec) in &specs {
            check(name, spec)?;
        }
        Ok(specs)
    }

    /// Reads the configured specs and stores each version not stored yet; the version the
    /// configuration names becomes its name's current one.
    pub(crate) fn sync(&self, store: &dyn Backend) -> crate::Result<()> {
        for (name, spec) in self.configured()? {
            let content = spec.canonical(&name);
            let digest = digest_of(&content);
            if store.put_agent_spec(&name, &digest, &content)? {
                tracing::info!(agent = %name, digest = %digest, "stored a new agent spec version");
            }
        }
        Ok(())
    }
}

/// Checks a spec as configured: its name, its tools, its approval policy.
fn check(name: &str, spec: &AgentSpec) -> Result<(), AgentError> {
    let invalid = |message: String| AgentError::Invalid {
        name: name.to_owned(),
        message,
    };
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(invalid(
            "a name is letters, digits, `-` and `_` only".to_owned(),
        ));
    }
    if let Some(tools) = &spec.tools {
        for tool in tools {
            let known = KNOWN_TOOLS.contains(&tool.as_str())
                || tool.starts_with(skiff_agent::tools::MCP_PREFIX);
            if !known {
                return Err(invalid(format!(
                    "`tools` names `{tool}`, which is no tool; the tools are {} and `mcp__SERVER__TOOL`",
                    KNOWN_TOOLS.join(", ")
                )));
            }
        }
    }
    if let Some(policy) = &spec.approval {
        crate::approvals::compile(policy, &format!("agents.{name}.approval")).map_err(invalid)?;
    }
    Ok(())
}

/// A stored version, checked: its content hashes to its digest and parses.
pub(crate) fn verified(row: &AgentSpecRow) -> Result<AgentSpec, AgentError> {
    let corrupt = || AgentError::Corrupt {
        spec: short_ref(&row.name, &row.digest),
    };
    if digest_of(&row.content) != row.digest {
        return Err(corrupt());
    }
    #[derive(serde::Deserialize)]
    struct Stored {
        name: String,
        #[serde(flatten)]
        spec: AgentSpec,
    }
    let stored: Stored = serde_json::from_str(&row.content).map_err(|_| corrupt())?;
    if stored.name != row.name {
        return Err(corrupt());
    }
    Ok(stored.spec)
}

/// A stored version as the API shows it (checked first).
pub(crate) fn version(row: &AgentSpecRow, current: bool) -> Result<AgentVersion, AgentError> {
    Ok(AgentVersion {
        name: row.name.clone(),
        digest: row.digest.clone(),
        current,
        created_at_ms: row.created_at_ms,
        spec: verified(row)?,
    })
}

/// `NAME` (the current version) or `NAME@DIGEST` (a digest or a prefix of at least 7 of
/// its characters) to a checked stored version.
pub(crate) fn resolve(
    store: &dyn Backend,
    reference: &str,
) -> crate::Result<(AgentPin, AgentSpec)> {
    let (name, digest) = match reference.split_once('@') {
        Some((name, digest)) => (name, Some(digest.to_ascii_lowercase())),
        None => (reference, None),
    };
    let versions = store.agent_spec_versions(name)?;
    if versions.is_empty() {
        return Err(AgentError::Unknown {
            name: name.to_owned(),
        }
        .into());
    }
    let row = match digest {
        None => &versions[0],
        Some(digest) => {
            let matching: Vec<&AgentSpecRow> = versions
                .iter()
                .filter(|v| digest.len() >= 7 && v.digest.starts_with(&digest))
                .collect();
            match matching.as_slice() {
                [one] => *one,
                [] => {
                    return Err(AgentError::NoSuchVersion {
                        name: name.to_owned(),
                        digest,
                    }
                    .into());
                }
                _ => {
                    return Err(AgentError::Ambiguous {
                        name: name.to_owned(),
                        digest,
                    }
                    .into());
                }
            }
        }
    };
    let spec = verified(row)?;
    Ok((
        AgentPin {
            name: row.name.clone(),
            digest: row.digest.clone(),
        },
        spec,
    ))
}

/// The pinned version a session runs with, checked.
pub(crate) fn pinned(store: &dyn Backend, pin: &AgentPin) -> crate::Result<AgentSpec> {
    let versions = store.agent_spec_versions(&pin.name)?;
    let row = versions
        .iter()
        .find(|v| v.digest == pin.digest)
        .ok_or_else(|| AgentError::NoSuchVersion {
            name: pin.name.clone(),
            digest: pin.digest.clone(),
        })?;
    Ok(verified(row)?)
}

// ---- routes ----

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/agents", axum::routing::get(list))
        .route("/v1/agents/{name}", axum::routing::get(show))
}

/// `GET /v1/agents`: the current version of every spec (read again from configuration
/// first, so an edit shows at once). Specs are configuration, readable by every caller.
async fn list(
    axum::extract::State(core): axum::extract::State<std::sync::Arc<crate::Core>>,
) -> crate::Result<axum::Json<skiff_protocol::agent::AgentList>> {
    core.agents.sync(&*core.store)?;
    let agents = core
        .store
        .agent_specs()?
        .iter()
        .map(|row| version(row, true))
        .collect::<Result<_, _>>()?;
    Ok(axum::Json(skiff_protocol::agent::AgentList { agents }))
}

/// `GET /v1/agents/{name}`: every version of one spec, current first.
async fn show(
    axum::extract::State(core): axum::extract::State<std::sync::Arc<crate::Core>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> crate::Result<axum::Json<skiff_protocol::agent::AgentDetail>> {
    core.agents.sync(&*core.store)?;
    let rows = core.store.agent_spec_versions(&name)?;
    if rows.is_empty() {
        return Err(AgentError::Unknown { name }.into());
    }
    let versions = rows
        .iter()
        .enumerate()
        .map(|(i, row)| version(row, i == 0))
        .collect::<Result<_, _>>()?;
    Ok(axum::Json(skiff_protocol::agent::AgentDetail {
        name,
        versions,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canonical_form_ignores_tool_order_and_repeats() {
        let a = AgentSpec {
            tools: Some(vec!["read".into(), "exec".into(), "read".into()]),
            ..AgentSpec::default()
        };
        let b = AgentSpec {
            tools: Some(vec!["exec".into(), "read".into()]),
            ..AgentSpec::default()
        };
        assert_eq!(digest_of(&a.canonical("x")), digest_of(&b.canonical("x")));
        assert_ne!(digest_of(&a.canonical("x")), digest_of(&a.canonical("y")));
    }

    #[test]
    fn an_unknown_tool_is_named() {
        let spec = AgentSpec {
            tools: Some(vec!["rm_rf".into()]),
            ..AgentSpec::default()
        };
        let err = check("reviewer", &spec).unwrap_err().to_string();
        assert!(err.contains("reviewer") && err.contains("rm_rf"), "{err}");
    }
}
