//! A stdio MCP server for tests, speaking JSON-RPC 2.0 as newline-delimited JSON on
//! stdin/stdout exactly as the MCP stdio transport does (`initialize`, `tools/list`,
//! `tools/call`, `ping`; notifications are read and ignored; anything else is "method not
//! found"). Its tools:
//!
//! - `whoami`: answers with its pid, its parent's pid and `$FAKE_MCP_GREETING`, and writes a
//!   marker file `fake-mcp-marker-<pid>` into `$FAKE_MCP_MARKER_DIR` (when set), so a test can
//!   tell which machine ran it;
//! - `forbidden`: a tool a test leaves off the allowlist;
//! - `fail`: a result with `isError: true`;
//! - `hang`: never answers.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fake: failing loudly is the point"
)]

use serde_json::{Value, json};
use std::io::{BufRead, Write};

fn main() {
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let message: Value = match serde_json::from_str(&line) {
            Ok(m) => m,
            Err(e) => {
                reply(
                    &mut stdout,
                    json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": format!("parse error: {e}")}}),
                );
                continue;
            }
        };
        // A notification (no id) gets no answer.
        let Some(id) = message.get("id").cloned() else {
            continue;
        };
        let method = message["method"].as_str().unwrap_or("");
        let params = &message["params"];
        let answer = match method {
            "initialize" => Ok(json!({
                "protocolVersion": params["protocolVersion"].as_str().unwrap_or("2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake-mcp-server", "version": "1.0.0"},
            })),
            "ping" => Ok(json!({})),
            "tools/list" => Ok(json!({"tools": tools()})),
            "tools/call" => match call(params) {
                Some(result) => Ok(result),
                None if params["name"] == "hang" => continue,
                None => Err((-32602, format!("unknown tool {}", params["name"]))),
            },
            other => Err((-32601, format!("method not found: {other}"))),
        };
        let message = match answer {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err((code, text)) => {
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": text}})
            }
        };
        reply(&mut stdout, message);
    }
}

fn reply(out: &mut std::io::Stdout, message: Value) {
    let mut line = serde_json::to_string(&message).unwrap();
    line.push('\n');
    out.write_all(line.as_bytes()).unwrap();
    out.flush().unwrap();
}

fn tools() -> Value {
    let schema = json!({
        "type": "object",
        "properties": {"note": {"type": "string", "description": "Anything; echoed back."}},
    });
    json!([
        {"name": "whoami", "description": "Says which process answered.", "inputSchema": schema},
        {"name": "forbidden", "description": "Must never be offered.", "inputSchema": schema},
        {"name": "fail", "description": "Always fails.", "inputSchema": schema},
        {"name": "hang", "description": "Never answers.", "inputSchema": schema},
    ])
}

fn text(text: String, is_error: bool) -> Value {
    json!({"content": [{"type": "text", "text": text}], "isError": is_error})
}

fn call(params: &Value) -> Option<Value> {
    let note = params["arguments"]["note"].as_str().unwrap_or("");
    match params["name"].as_str()? {
        "whoami" => {
            let pid = std::process::id();
            if let Some(dir) = std::env::var_os("FAKE_MCP_MARKER_DIR") {
                let path = std::path::Path::new(&dir).join(format!("fake-mcp-marker-{pid}"));
                std::fs::write(path, note).unwrap();
            }
            let greeting = std::env::var("FAKE_MCP_GREETING").unwrap_or_else(|_| "none".into());
            Some(text(
                format!(
                    "pid {pid} parent {} greeting {greeting} note {note}",
                    std::os::unix::process::parent_id()
                ),
                false,
            ))
        }
        "forbidden" => Some(text("forbidden ran".into(), false)),
        "fail" => Some(text("it broke".into(), true)),
        _ => None,
    }
}
