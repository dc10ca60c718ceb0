//! One MCP server's connection: a stdio server is a child of the gateway in a process group of
//! its own, with a clean environment (Skiff's usual few variables plus its `env`, references
//! resolved only here, in memory), killed as a group when its connection is dropped.

use super::McpError;
use super::config::{ServerDef, Source, Transport};
use http::{HeaderName, HeaderValue};
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::{Peer, RoleClient, RunningService, ServiceExt};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use serde_json::Value;
use std::process::Stdio;
use std::sync::Arc;

/// A tool as the server lists it.
pub(crate) struct Listed {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

struct Connection {
    service: RunningService<RoleClient, ()>,
    /// The stdio server's process group, killed when the connection goes.
    _child: Option<ChildGroup>,
}

pub(crate) struct Server {
    pub def: ServerDef,
    vault: Arc<crate::vault::Vault>,
    conn: tokio::sync::Mutex<Option<Connection>>,
}

impl Server {
    pub(crate) fn new(def: ServerDef, vault: Arc<crate::vault::Vault>) -> Server {
        Server {
            def,
            vault,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    fn timeout_error(&self) -> McpError {
        McpError::Timeout {
            server: self.def.name.clone(),
            seconds: self.def.timeout.as_secs(),
        }
    }

    /// The connection's peer, connecting first when there is none or the server went away.
    async fn peer(&self) -> Result<Peer<RoleClient>, McpError> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref()
            && !c.service.peer().is_transport_closed()
        {
            return Ok(c.service.peer().clone());
        }
        *conn = None;
        let fresh = tokio::time::timeout(self.def.timeout, self.connect())
            .await
            .map_err(|_| self.timeout_error())??;
        let peer = fresh.service.peer().clone();
        *conn = Some(fresh);
        Ok(peer)
    }

    async fn connect(&self) -> Result<Connection, McpError> {
        match &self.def.transport {
            Transport::Stdio { command, args, env } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args)
                    .env_clear()
                    .envs(skiff_process::inherited_env())
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .process_group(0)
                    .kill_on_drop(true);
                for (var, source) in env {
                    let value =
                        self.resolve(&format!("mcp.{}.env.{var}", self.def.name), source)?;
                    cmd.env(var, value);
                }
                let mut child = cmd.spawn().map_err(|source| McpError::Spawn {
                    command: command.clone(),
                    source,
                })?;
                let pgid = ChildGroup::pgid(&child);
                let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
                    return Err(McpError::Handshake {
                        reason: "the server's stdin or stdout could not be piped".to_owned(),
                    });
                };
                let service =
                    ().serve((stdout, stdin))
                        .await
                        .map_err(|e| McpError::Handshake {
                            reason: e.to_string(),
                        })?;
                Ok(Connection {
                    service,
                    _child: Some(ChildGroup { child, pgid }),
                })
            }
            Transport::Http {
                url,
                headers,
                bearer,
            } => {
                let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                for (name, source) in headers {
                    let key = format!("mcp.{}.headers.{name}", self.def.name);
                    let value = self.resolve(&key, source)?;
                    let bad = || McpError::Header { key: key.clone() };
                    config.custom_headers.insert(
                        HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad())?,
                        HeaderValue::from_str(&value).map_err(|_| bad())?,
                    );
                }
                if let Some(source) = bearer {
                    let key = format!("mcp.{}.bearer", self.def.name);
                    config.auth_header = Some(self.resolve(&key, source)?);
                }
                let client = reqwest::Client::builder()
                    .redirect(reqwest::redirect::Policy::none())
                    .build()
                    .map_err(|e| McpError::Handshake {
                        reason: e.to_string(),
                    })?;
                let transport =
                    StreamableHttpClientTransport::with_client(super::http::Http(client), config);
                let service = ().serve(transport).await.map_err(|e| McpError::Handshake {
                    reason: e.to_string(),
                })?;
                Ok(Connection {
                    service,
                    _child: None,
                })
            }
        }
    }

    fn resolve(&self, key: &str, source: &Source) -> Result<String, McpError> {
        match source {
            Source::Literal(text) => Ok(text.clone()),
            Source::Env(var) => std::env::var(var).map_err(|_| McpError::Reference {
                key: key.to_owned(),
                what: format!("the gateway's environment variable {var}"),
                reason: "it is not set (or not UTF-8)".to_owned(),
            }),
            Source::Vault(name) => self.vault.open(name).map_err(|e| McpError::Reference {
                key: key.to_owned(),
                what: format!("the vault secret {name}"),
                reason: e.to_string(),
            }),
        }
    }

    /// Every tool the server offers (the allowlist is applied by the caller).
    pub(crate) async fn list_tools(&self) -> Result<Vec<Listed>, McpError> {
        let peer = self.peer().await?;
        let tools = tokio::time::timeout(self.def.timeout, peer.list_all_tools())
            .await
            .map_err(|_| self.timeout_error())?
            .map_err(|e| McpError::Service {
                reason: e.to_string(),
            })?;
        Ok(tools
            .into_iter()
            .map(|t| Listed {
                name: t.name.into_owned(),
                description: t.description.map(|d| d.into_owned()).unwrap_or_default(),
                input_schema: Value::Object((*t.input_schema).clone()),
            })
            .collect())
    }

    /// Calls `tool`, bounded by the server's timeout.
    pub(crate) async fn call(
        &self,
        tool: &str,
        arguments: JsonObject,
    ) -> Result<CallToolResult, McpError> {
        let peer = self.peer().await?;
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        tokio::time::timeout(self.def.timeout, peer.call_tool(params))
            .await
            .map_err(|_| self.timeout_error())?
            .map_err(|e| McpError::Service {
                reason: e.to_string(),
            })
    }

    pub(crate) async fn stop(&self) {
        *self.conn.lock().await = None;
    }
}

/// A stdio server's process and its group: dropping it kills everything the server started.
struct ChildGroup {
    child: tokio::process::Child,
    pgid: Option<rustix::process::Pid>,
}

impl ChildGroup {
    /// The group's id: the child leads a group of its own (`process_group(0)`).
    fn pgid(child: &tokio::process::Child) -> Option<rustix::process::Pid> {
        child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .and_then(rustix::process::Pid::from_raw)
    }
}

impl Drop for ChildGroup {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid {
            // The group may already be gone; nothing is left to kill then.
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
        let _ = self.child.start_kill();
    }
}
