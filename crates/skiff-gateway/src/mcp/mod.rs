//! MCP servers on the gateway (`[mcp.NAME]` in skiff.toml): the gateway starts each server once,
//! at startup, lists its tools, keeps those on the server's `tools` allowlist and offers them to
//! every session, local or on a worker, as `mcp__<server>__<tool>` — sorted, after the built-in
//! tools, the same bytes in both placements. A call runs here (a worker sends it over the
//! worker link, `tool.gateway`): a box never sees a server, its command, URL or credentials.
//! Every call is audited (`mcp.call`: server, tool, status, duration; never arguments or
//! content) and, for a worker session, counted as controlled egress of its environment.
//!
//! A stdio server (`command`) is the gateway's child; an HTTP server (`url`) is reached with
//! the streamable-HTTP transport (`http.rs`).
//!
//! A server that cannot start does not stop the gateway: its tools are absent and the log says
//! why. A stdio server that exits is started again at the next call; the tool list stays the
//! one read at startup, so prompts stay cache-stable.
//!
//! Deliberately absent: resources, prompts, sampling and notifications (only tools), images in
//! results (text parts only), OAuth for HTTP servers (a `bearer` or `headers` only), and
//! re-reading a server's tool list while the gateway runs.

mod client;
mod config;
mod http;

pub(crate) use config::{ServerDef, Source, source, validate};

use crate::Core;
use serde_json::{Value, json};
use skiff_agent::tools::{MCP_PREFIX, ToolOutput};
use skiff_protocol::SessionId;
use skiff_protocol::environment::EgressAccounting;
use skiff_protocol::model::ToolSpec;
use skiff_store::Scope;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// The most text one MCP result may carry back (the agent caps tool results anyway).
const MAX_RESULT_BYTES: usize = 256 * 1024;

/// The gateway's MCP servers and the tools they offer.
#[derive(Default)]
pub(crate) struct Mcp {
    /// `mcp__<server>__<tool>` → the server and the tool's own name.
    routes: HashMap<String, (Arc<client::Server>, String)>,
    /// What every session is offered, sorted by name.
    specs: Vec<ToolSpec>,
}

/// Why a server's tools are absent, or why a call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum McpError {
    #[error("`{key}` refers to {what}, which could not be read: {reason}")]
    Reference {
        key: String,
        what: String,
        reason: String,
    },
    #[error("could not start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the server did not complete the MCP handshake: {reason}")]
    Handshake { reason: String },
    #[error("the server did not answer within {seconds} s (mcp.{server}.timeout_s)")]
    Timeout { server: String, seconds: u64 },
    #[error("the server failed the request: {reason}")]
    Service { reason: String },
    #[error("`{key}` is not a valid HTTP header name and value")]
    Header { key: String },
}

impl Mcp {
    /// Starts every server (all at once, each bounded by its timeout) and collects the tools
    /// on its allowlist. A server that fails is logged and left out.
    pub(crate) async fn start(defs: Vec<ServerDef>, vault: Arc<crate::vault::Vault>) -> Mcp {
        let started = futures_util::future::join_all(defs.into_iter().map(|def| {
            let vault = vault.clone();
            async move {
                let server = Arc::new(client::Server::new(def, vault));
                let listed = server.list_tools().await;
                (server, listed)
            }
        }))
        .await;
        let mut mcp = Mcp::default();
        for (server, listed) in started {
            let name = server.def.name.clone();
            let tools = match listed {
                Ok(tools) => tools,
                Err(e) => {
                    tracing::warn!(server = %name, error = %e,
                        "MCP server mcp.{name} is unavailable; its tools are not offered");
                    continue;
                }
            };
            let mut offered = Vec::new();
            for tool in tools {
                if !server.def.allow.contains(&tool.name) {
                    continue;
                }
                let full = format!("{MCP_PREFIX}{name}__{}", tool.name);
                offered.push(tool.name.clone());
                mcp.specs.push(ToolSpec {
                    name: full.clone(),
                    description: tool.description,
                    parameters: tool.input_schema,
                });
                mcp.routes.insert(full, (server.clone(), tool.name));
            }
            for missing in server.def.allow.iter().filter(|t| !offered.contains(t)) {
                tracing::warn!(server = %name, tool = %missing,
                    "mcp.{name}.tools names `{missing}`, which the server does not offer");
            }
            tracing::info!(server = %name, tools = ?offered, "MCP server ready");
        }
        mcp.specs.sort_by(|a, b| a.name.cmp(&b.name));
        mcp
    }

    /// The tools every session is offered, in a stable order.
    pub(crate) fn specs(&self) -> Vec<ToolSpec> {
        self.specs.clone()
    }

    /// Stops every server (their process groups are killed).
    pub(crate) async fn shutdown(&self) {
        let mut seen = std::collections::HashSet::new();
        for (server, _) in self.routes.values() {
            if seen.insert(server.def.name.clone()) {
                server.stop().await;
            }
        }
    }
}

/// The text parts of a result, joined; anything else is named, not carried.
fn result_text(result: &rmcp::model::CallToolResult) -> String {
    let mut parts = Vec::new();
    for block in &result.content {
        match block.as_text() {
            Some(text) => parts.push(text.text.clone()),
            None => parts.push("[non-text content omitted]".to_owned()),
        }
    }
    if parts.is_empty()
        && let Some(structured) = &result.structured_content
    {
        parts.push(structured.to_string());
    }
    let mut text = parts.join("\n");
    if text.len() > MAX_RESULT_BYTES {
        let mut end = MAX_RESULT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("\n[… cut …]");
    }
    text
}

impl Core {
    /// Runs an MCP tool (`mcp__<server>__<tool>`) for `session` (on `env`, for a worker
    /// session): audited and, on a worker's environment, counted as controlled egress.
    pub(crate) async fn mcp_tool(
        &self,
        scope: &Scope,
        session: &SessionId,
        env: Option<&skiff_protocol::EnvironmentId>,
        name: &str,
        arguments: &Value,
        cancel: &CancellationToken,
    ) -> ToolOutput {
        let Some((server, tool)) = self.mcp.routes.get(name) else {
            self.audit(
                scope,
                "mcp.call",
                session.as_str(),
                "refused",
                json!({ "tool": name, "status": "unknown tool", "env": env.map(|e| e.as_str()) }),
            );
            return ToolOutput::error(format!(
                "{name} is not a tool this gateway offers (MCP tools are listed in [mcp.NAME] tools in skiff.toml)"
            ));
        };
        let arguments = match arguments {
            Value::Object(map) => map.clone(),
            Value::Null => serde_json::Map::new(),
            other => {
                return ToolOutput::error(format!(
                    "arguments for `{name}` must be a JSON object, not {other}"
                ));
            }
        };
        let started = Instant::now();
        let called = tokio::select! {
            () = cancel.cancelled() => Err("cancelled".to_owned()),
            r = server.call(tool, arguments) => r.map_err(|e| e.to_string()),
        };
        let (output, status) = match called {
            Ok(result) => {
                let text = result_text(&result);
                if result.is_error == Some(true) {
                    (ToolOutput::error(text), "tool_error")
                } else {
                    (ToolOutput::ok(text), "ok")
                }
            }
            Err(e) => (
                ToolOutput::error(format!("{name} failed: {e}")),
                if e == "cancelled" {
                    "cancelled"
                } else {
                    "failed"
                },
            ),
        };
        let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let bytes = output.content.len() as u64;
        self.audit(
            scope,
            "mcp.call",
            session.as_str(),
            "allowed",
            json!({
                "server": server.def.name, "tool": tool, "status": status,
                "duration_ms": duration_ms, "bytes": bytes, "env": env.map(|e| e.as_str()),
            }),
        );
        if let Some(env) = env {
            let add = EgressAccounting {
                gateway_tool_calls: 1,
                bytes_in: bytes,
                ..EgressAccounting::default()
            };
            if let Err(e) = self.store.add_environment_egress(env, add) {
                tracing::warn!(%env, error = %e, "could not account an MCP tool call");
            }
        }
        output
    }
}
