//! Agent specs: a named, versioned bundle of extra instructions, model and reasoning
//! settings, a tool allowlist and an approval policy (`[agents.NAME]` or `agents/NAME.toml`).
//! The gateway stores each version under the sha256 of [`AgentSpec::canonical`] and pins a
//! session to one; these are the spec and what `skiff agent list|show` reads.

use crate::approval::ApprovalPolicy;
use crate::model::ReasoningEffort;
use serde::{Deserialize, Serialize};

/// One agent spec as configured (and, canonicalized, as stored).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    /// Added to the system prompt under its own heading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// `provider/model-id`; a session naming no model takes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A session choosing no reasoning takes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningEffort>,
    /// The only tools the model is offered (built-in names, `web_fetch`, `dispatch…`,
    /// `mcp__server__tool`); absent means every tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// A session choosing no policy takes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalPolicy>,
}

impl AgentSpec {
    /// The bytes a version's digest is computed over: compact JSON with the fields in a
    /// fixed order, absent ones left out, the tool list sorted and without repeats, and the
    /// name first (so two names never share a version).
    pub fn canonical(&self, name: &str) -> String {
        #[derive(Serialize)]
        struct Canonical<'a> {
            name: &'a str,
            #[serde(flatten)]
            spec: &'a AgentSpec,
        }
        let mut spec = self.clone();
        if let Some(tools) = &mut spec.tools {
            tools.sort();
            tools.dedup();
        }
        serde_json::to_string(&Canonical { name, spec: &spec }).unwrap_or_default()
    }
}

/// One stored version of a spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentVersion {
    pub name: String,
    /// sha256 of the canonical content, lowercase hex.
    pub digest: String,
    /// Whether configuration names this version now.
    pub current: bool,
    pub created_at_ms: i64,
    pub spec: AgentSpec,
}

impl AgentVersion {
    /// `NAME@` and the digest's first 12 characters, as the CLI and the UI show it.
    pub fn short(&self) -> String {
        short_ref(&self.name, &self.digest)
    }
}

/// `NAME@` and a digest's first 12 characters.
pub fn short_ref(name: &str, digest: &str) -> String {
    format!("{name}@{}", digest.get(..12).unwrap_or(digest))
}

/// `GET /v1/agents`: the current version of each spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentList {
    pub agents: Vec<AgentVersion>,
}

/// `GET /v1/agents/{name}`: every version of one spec, current first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentDetail {
    pub name: String,
    pub versions: Vec<AgentVersion>,
}

/// The spec version a session runs with (`SessionView.agent`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentPin {
    pub name: String,
    pub digest: String,
}

impl AgentPin {
    pub fn short(&self) -> String {
        short_ref(&self.name, &self.digest)
    }
}
