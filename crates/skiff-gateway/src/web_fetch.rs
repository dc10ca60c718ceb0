//! `web_fetch`, a gateway-resident tool (the dispatch tools are in `dispatch.rs`, MCP servers' in `mcp/`): it runs on the gateway for local and worker
//! sessions alike, only for hosts on `[gateway] web_fetch_allow` (default: none), follows no
//! redirects, and returns at most [`MAX_FETCH_BYTES`] of text. Every call is counted as
//! controlled egress of the session's environment and audited (host, bytes, decision — never
//! the content).

use crate::Core;
use serde::Deserialize;
use serde_json::json;
use skiff_agent::tools::ToolOutput;
use skiff_protocol::SessionId;
use skiff_protocol::environment::EgressAccounting;
use skiff_store::Scope;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub(crate) const MAX_FETCH_BYTES: usize = 256 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    url: String,
}

impl Core {
    /// The tools beyond the built-in ones every session is offered, local or on a worker:
    /// governed actions (when `[forge]` is set), then MCP servers' tools.
    pub(crate) fn gateway_specs(&self) -> Vec<skiff_protocol::model::ToolSpec> {
        let mut specs = self.governed.specs();
        specs.extend(self.mcp.specs());
        specs
    }

    /// Runs a gateway-resident tool for `session` (on `env`, for a worker session) in its
    /// run `run`.
    #[allow(
        clippy::too_many_arguments,
        reason = "a gateway tool's call context: who, where, which run, what"
    )]
    pub(crate) async fn gateway_tool(
        self: &std::sync::Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        env: Option<&skiff_protocol::EnvironmentId>,
        run: Option<&skiff_protocol::RunId>,
        name: &str,
        arguments: &serde_json::Value,
        cancel: &CancellationToken,
    ) -> ToolOutput {
        // The session's agent spec: a tool outside its list is refused here too, whoever
        // asks (a worker's loop offers only the list, but the gateway does not take its word).
        match self.session_spec(scope, session) {
            Ok(Some(spec)) => {
                if let Some(allowed) = &spec.tools
                    && !allowed.iter().any(|t| t == name)
                {
                    return ToolOutput::error(format!(
                        "not run: `{name}` is not one of this agent's tools"
                    ));
                }
            }
            Ok(None) => {}
            Err(e) => return ToolOutput::error(format!("not run: {e}")),
        }
        if skiff_agent::tools::GOVERNED_TOOLS.contains(&name) {
            return self
                .governed_tool(scope, session, env, run, name, arguments, cancel)
                .await;
        }
        if skiff_agent::tools::DISPATCH_TOOLS.contains(&name) {
            return self
                .dispatch_tool(scope, session, env, name, arguments, cancel)
                .await;
        }
        if name.starts_with(skiff_agent::tools::MCP_PREFIX) {
            return self
                .mcp_tool(scope, session, env, name, arguments, cancel)
                .await;
        }
        if name != skiff_agent::tools::WEB_FETCH {
            return ToolOutput::error(format!("{name} is not a gateway tool"));
        }
        let args = match serde_json::from_value::<Args>(arguments.clone()) {
            Ok(a) => a,
            Err(e) => return ToolOutput::error(format!("invalid arguments for web_fetch: {e}")),
        };
        let url = match reqwest::Url::parse(&args.url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => u,
            _ => return ToolOutput::error(format!("{} is not an http(s) URL", args.url)),
        };
        let host = url.host_str().unwrap_or("").to_owned();
        let allowed = self
            .workers
            .web_fetch_allow
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&host));
        let detail = |bytes: u64, status: &str| json!({ "tool": "web_fetch", "host": host, "bytes": bytes, "status": status, "env": env.map(|e| e.as_str()) });
        if !allowed {
            self.audit(
                scope,
                "egress.web_fetch",
                session.as_str(),
                "refused",
                detail(0, "host not allowed"),
            );
            return ToolOutput::error(format!(
                "web_fetch may not reach {host}: the gateway allows no such host (operators list hosts in [gateway] web_fetch_allow in skiff.toml)"
            ));
        }
        let fetched = tokio::select! {
            _ = cancel.cancelled() => Err("cancelled".to_owned()),
            r = fetch(url) => r,
        };
        let (output, bytes, status) = match fetched {
            Ok((code, body)) => {
                let n = body.len() as u64;
                let text = String::from_utf8_lossy(&body).into_owned();
                let output = if code < 400 {
                    ToolOutput::ok(format!("HTTP {code}\n\n{text}"))
                } else {
                    ToolOutput::error(format!("HTTP {code}\n\n{text}"))
                };
                (output, n, code.to_string())
            }
            Err(e) => (
                ToolOutput::error(format!("web_fetch failed: {e}")),
                0,
                "error".to_owned(),
            ),
        };
        self.audit(
            scope,
            "egress.web_fetch",
            session.as_str(),
            "allowed",
            detail(bytes, &status),
        );
        if let Some(env) = env {
            let add = EgressAccounting {
                gateway_tool_calls: 1,
                bytes_in: bytes,
                ..EgressAccounting::default()
            };
            if let Err(e) = self.store.add_environment_egress(env, add) {
                tracing::warn!(%env, error = %e, "could not account a gateway tool call");
            }
        }
        output
    }
}

async fn fetch(url: reqwest::Url) -> Result<(u16, Vec<u8>), String> {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(20))
        .build()
        .map_err(|e| e.to_string())?;
    let mut response = client
        .get(url)
        .send()
        .await
        .map_err(|e| e.without_url().to_string())?;
    let code = response.status().as_u16();
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| e.without_url().to_string())?
    {
        let room = MAX_FETCH_BYTES.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= MAX_FETCH_BYTES {
            body.extend_from_slice(format!("\n[… cut at {MAX_FETCH_BYTES} bytes …]").as_bytes());
            break;
        }
    }
    Ok((code, body))
}
