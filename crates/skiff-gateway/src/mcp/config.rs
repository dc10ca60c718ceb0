//! `[mcp.NAME]` checked into what the gateway runs: a bad key is a startup error that names it
//! (`mcp.search.command`); a secret is only ever a reference (`env:VAR`, `vault:NAME`) until
//! the server is started.

use crate::config::{ConfigError, McpConfig};
use skiff_agent::tools::MCP_PREFIX;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The longest name a provider accepts for a tool.
const MAX_TOOL_NAME: usize = 64;
const DEFAULT_TIMEOUT_S: u64 = 60;

/// A value in configuration: itself, or where to read it when the server starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Literal(String),
    Env(String),
    Vault(String),
}

#[derive(Clone, Debug)]
pub(crate) enum Transport {
    Stdio {
        command: String,
        args: Vec<String>,
        env: Vec<(String, Source)>,
    },
    Http {
        url: String,
        headers: Vec<(String, Source)>,
        bearer: Option<Source>,
    },
}

/// One checked `[mcp.NAME]`.
#[derive(Clone, Debug)]
pub(crate) struct ServerDef {
    pub name: String,
    pub transport: Transport,
    /// The server's own tool names the agent may call.
    pub allow: Vec<String>,
    pub timeout: Duration,
}

fn named(text: &str) -> bool {
    !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

/// `"env:VAR"` / `"vault:NAME"` are references; anything else is the value itself, unless
/// `secret` (then a literal is refused: the value must not sit in skiff.toml).
pub(crate) fn source(key: &str, text: &str, secret: bool) -> Result<Source, String> {
    let reference = |rest: &str| {
        !rest.is_empty()
            && rest
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    match text.split_once(':') {
        Some(("env", var)) if reference(var) => Ok(Source::Env(var.to_owned())),
        Some(("vault", name)) if reference(name) => Ok(Source::Vault(name.to_owned())),
        Some(("env" | "vault", _)) => Err(format!(
            "at `{key}`: \"{text}\" is not a reference like \"env:VAR\" or \"vault:NAME\""
        )),
        _ if secret => Err(format!(
            "at `{key}`: must be \"env:VAR\" (the gateway's environment) or \"vault:NAME\" (a secret stored with `skiff secret set NAME`), never the token itself"
        )),
        _ => Ok(Source::Literal(text.to_owned())),
    }
}

/// Checks every `[mcp.NAME]`.
pub(crate) fn validate(
    config_path: &Path,
    servers: &BTreeMap<String, McpConfig>,
) -> Result<Vec<ServerDef>, ConfigError> {
    servers
        .iter()
        .map(|(name, c)| {
            check(name, c).map_err(|message| ConfigError::Invalid {
                path: config_path.display().to_string(),
                message,
            })
        })
        .collect()
}

fn check(name: &str, c: &McpConfig) -> Result<ServerDef, String> {
    let key = |field: &str| format!("mcp.{name}.{field}");
    if !named(name) {
        return Err(format!(
            "at `mcp.{name}`: a server name may hold only letters, digits, `_` and `-`"
        ));
    }
    let transport = match (&c.command, &c.url) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "at `{}`: give either `command` (a stdio server) or `url` (a streamable-HTTP server), not both",
                key("command")
            ));
        }
        (None, None) => {
            return Err(format!(
                "at `{}`: missing; give `command` (a stdio server the gateway starts) or `url` (a streamable-HTTP server)",
                key("command")
            ));
        }
        (Some(command), None) => {
            if command.trim().is_empty() {
                return Err(format!("at `{}`: must name a program", key("command")));
            }
            if !c.headers.is_empty() || c.bearer.is_some() {
                return Err(format!(
                    "at `{}`: `headers` and `bearer` are for `url` servers; a stdio server takes `env`",
                    key(if c.bearer.is_some() {
                        "bearer"
                    } else {
                        "headers"
                    })
                ));
            }
            let env = c
                .env
                .iter()
                .map(|(var, text)| {
                    source(&key(&format!("env.{var}")), text, false).map(|s| (var.clone(), s))
                })
                .collect::<Result<_, _>>()?;
            Transport::Stdio {
                command: command.clone(),
                args: c.args.clone(),
                env,
            }
        }
        (None, Some(url)) => {
            if !c.args.is_empty() || !c.env.is_empty() {
                return Err(format!(
                    "at `{}`: `args` and `env` are for `command` servers",
                    key(if c.args.is_empty() { "env" } else { "args" })
                ));
            }
            match reqwest::Url::parse(url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") => {}
                _ => {
                    return Err(format!(
                        "at `{}`: \"{url}\" is not an http(s) URL",
                        key("url")
                    ));
                }
            }
            let headers = c
                .headers
                .iter()
                .map(|(h, text)| {
                    source(&key(&format!("headers.{h}")), text, false).map(|s| (h.clone(), s))
                })
                .collect::<Result<_, _>>()?;
            let bearer = c
                .bearer
                .as_deref()
                .map(|t| source(&key("bearer"), t, true))
                .transpose()?;
            Transport::Http {
                url: url.clone(),
                headers,
                bearer,
            }
        }
    };
    let Some(tools) = &c.tools else {
        return Err(format!(
            "at `{}`: missing; list the tools of this server the agent may call (tools = [\"search\"]): none is offered unless named",
            key("tools")
        ));
    };
    if tools.is_empty() {
        return Err(format!(
            "at `{}`: empty; name at least one tool, or remove [mcp.{name}]",
            key("tools")
        ));
    }
    for tool in tools {
        let full = format!("{MCP_PREFIX}{name}__{tool}");
        if !named(tool) || full.len() > MAX_TOOL_NAME {
            return Err(format!(
                "at `{}`: `{tool}` cannot be offered: the agent sees it as `{full}`, which must be at most {MAX_TOOL_NAME} letters, digits, `_` or `-`",
                key("tools")
            ));
        }
    }
    let timeout_s = c.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
    if timeout_s == 0 {
        return Err(format!(
            "at `{}`: must be at least 1 (seconds)",
            key("timeout_s")
        ));
    }
    Ok(ServerDef {
        name: name.to_owned(),
        transport,
        allow: tools.clone(),
        timeout: Duration::from_secs(timeout_s),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn checked(text: &str) -> Result<Vec<ServerDef>, String> {
        let config = Config::parse(text)?;
        validate(Path::new("skiff.toml"), &config.mcp).map_err(|e| e.to_string())
    }

    #[test]
    fn a_stdio_server_with_references() {
        let defs = checked(
            "[mcp.search]\ncommand = \"search-mcp\"\nargs = [\"--stdio\"]\n\
             env = { TOKEN = \"vault:search-token\", HOME_URL = \"env:SEARCH_URL\", MODE = \"fast\" }\n\
             tools = [\"query\"]\ntimeout_s = 5\n",
        )
        .unwrap();
        let Transport::Stdio { command, env, .. } = &defs[0].transport else {
            panic!("{:?}", defs[0].transport)
        };
        assert_eq!(command, "search-mcp");
        assert!(env.contains(&("TOKEN".into(), Source::Vault("search-token".into()))));
        assert!(env.contains(&("HOME_URL".into(), Source::Env("SEARCH_URL".into()))));
        assert!(env.contains(&("MODE".into(), Source::Literal("fast".into()))));
        assert_eq!(defs[0].timeout, Duration::from_secs(5));
    }

    #[test]
    fn errors_name_the_key() {
        for (text, key) in [
            ("[mcp.a]\ntools = [\"x\"]\n", "mcp.a.command"),
            (
                "[mcp.a]\ncommand = \"x\"\nurl = \"http://h/\"\ntools = [\"x\"]\n",
                "mcp.a.command",
            ),
            ("[mcp.a]\ncommand = \"x\"\n", "mcp.a.tools"),
            ("[mcp.a]\ncommand = \"x\"\ntools = []\n", "mcp.a.tools"),
            (
                "[mcp.a]\ncommand = \"x\"\ntools = [\"a b\"]\n",
                "mcp.a.tools",
            ),
            (
                "[mcp.a]\nurl = \"ftp://h/\"\ntools = [\"x\"]\n",
                "mcp.a.url",
            ),
            (
                "[mcp.a]\nurl = \"https://h/\"\nbearer = \"sk-live\"\ntools = [\"x\"]\n",
                "mcp.a.bearer",
            ),
            (
                "[mcp.a]\ncommand = \"x\"\nenv = { T = \"vault:\" }\ntools = [\"x\"]\n",
                "mcp.a.env.T",
            ),
            (
                "[mcp.a]\ncommand = \"x\"\ntools = [\"x\"]\ntimeout_s = 0\n",
                "mcp.a.timeout_s",
            ),
            (
                "[mcp.a]\ncommand = \"x\"\ntools = [\"x\"]\ncmd = 1\n",
                "mcp.a",
            ),
        ] {
            let err = checked(text).unwrap_err();
            assert!(err.contains(key), "{text}: {err}");
        }
    }

    #[test]
    fn a_literal_bearer_is_never_echoed() {
        let err =
            checked("[mcp.a]\nurl = \"https://h/\"\nbearer = \"sk-live-123\"\ntools = [\"x\"]\n")
                .unwrap_err();
        assert!(!err.contains("sk-live-123"), "{err}");
    }
}
