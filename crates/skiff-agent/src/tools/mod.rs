//! The tools the model can call. Each tool parses its JSON arguments into a typed struct
//! (unknown or mistyped arguments are a tool error the model sees), and every file tool is
//! contained to the workspace by [`paths::Workspace`].
//!
//! No call can hold a turn for ever: file tools refuse FIFOs, sockets and devices without
//! blocking and read within bounds (`fsio`), run on the blocking pool, and are abandoned at once
//! when the run is cancelled or after [`FILE_TOOL_TIMEOUT`]; `exec` kills everything its
//! command started at its timeout, on cancel and when it ends.

mod apply_patch;
mod exec;
mod files;
pub(crate) mod fsio;
pub(crate) mod image;
pub use image::MAX_CONTEXT_IMAGE_BYTES;
mod patch;
mod paths;
mod process;
pub mod sandbox;
mod search;

pub use image::label as image_label;
pub use paths::Workspace;
pub use process::Processes;

use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use skiff_process::Ledger;
use skiff_protocol::model::{Image, ToolCall, ToolSpec};
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The most text a single tool result may carry into the model context.
pub const MAX_RESULT_BYTES: usize = 64 * 1024;

/// How long a file tool may take before its call is given up on (its bounded work then ends
/// on its own, its result unused).
pub const FILE_TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// A tool's answer. Errors are answers too: the model reads them and can recover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolOutput {
    pub content: String,
    pub is_error: bool,
    /// Images for the model (a `read` of an image file); `content` describes them for models
    /// that take none.
    pub images: Vec<Image>,
}

impl ToolOutput {
    pub fn ok(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: false,
            images: Vec::new(),
        }
    }

    pub fn error(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: true,
            images: Vec::new(),
        }
    }
}

/// The tool set of one workspace.
#[derive(Clone, Debug)]
pub struct Tools {
    workspace: Workspace,
    exec_env: Vec<(String, String)>,
    ledger: Option<Ledger>,
    /// The sandbox `exec` and `process` commands run in, when the workspace is on the
    /// gateway's host.
    sandbox: Option<skiff_process::Sandbox>,
    processes: Processes,
    /// Whether the model is offered the dispatch tools ([`DISPATCH_TOOLS`]).
    dispatch: bool,
    /// Specs of tools the gateway runs for this session beyond the built-in ones (governed
    /// actions, [`GOVERNED_TOOLS`], and MCP servers' tools, [`MCP_PREFIX`]), in the gateway's
    /// order.
    gateway_specs: Vec<ToolSpec>,
    /// The repository root above the workspace root, when the workspace is a subfolder of one.
    repository_root: Option<PathBuf>,
    /// Which calls wait for a person (the session's approval policy).
    approvals: crate::approval::Approvals,
    /// The agent spec's tool allowlist: the only tools offered and run (`None`: all).
    allowlist: Option<std::collections::BTreeSet<String>>,
}

impl Tools {
    /// Tools working in `root`; `exec_env` is added to the clean environment of `exec`.
    pub fn new(root: PathBuf, exec_env: Vec<(String, String)>) -> std::io::Result<Self> {
        Ok(Self {
            workspace: Workspace::new(root)?,
            exec_env,
            ledger: None,
            sandbox: None,
            processes: Processes::for_turn(),
            dispatch: false,
            gateway_specs: Vec::new(),
            repository_root: None,
            approvals: crate::approval::Approvals::default(),
            allowlist: None,
        })
    }

    /// Says that the workspace is a subfolder of the repository whose root is `root`: each turn
    /// then gives the model the `AGENTS.md` files of the folders from `root` down to the
    /// workspace root, root first (see `instructions`). Skiff's own sessions never call it: their
    /// workspace is the repository root. Refused unless `root` is a folder above the workspace
    /// root.
    pub fn with_repository_root(mut self, root: &std::path::Path) -> std::io::Result<Self> {
        let root = root.canonicalize()?;
        if root == self.workspace.root() || !self.workspace.root().starts_with(&root) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "repository root {} is not a folder above the workspace root {}",
                    root.display(),
                    self.workspace.root().display()
                ),
            ));
        }
        self.repository_root = Some(root);
        Ok(self)
    }

    /// The repository root [`Tools::with_repository_root`] named, if any.
    pub fn repository_root(&self) -> Option<&std::path::Path> {
        self.repository_root.as_deref()
    }

    /// Records every running `exec` command in `ledger`, so that a process started after a
    /// crash of this one can kill what was left running ([`Ledger::kill_leftovers`]).
    pub fn with_ledger(mut self, ledger: Ledger) -> Self {
        self.ledger = Some(ledger);
        self
    }

    /// Runs every `exec` and `process` command in `sandbox` (see [`sandbox::for_workspace`]):
    /// a command that cannot be sandboxed on this host is refused, never run without it.
    pub fn with_sandbox(mut self, sandbox: skiff_process::Sandbox) -> Self {
        self.sandbox = Some(sandbox);
        self
    }

    /// Runs `process` commands in `processes` rather than in a registry of these tools' own:
    /// a session that keeps one registry across its turns lets `keep` processes live on
    /// between them, and stops them with [`Processes::stop_all`] when it ends.
    pub fn with_processes(mut self, processes: Processes) -> Self {
        self.processes = processes;
        self
    }

    /// Offers the model the dispatch tools. Only a gateway-placed session that is not itself a
    /// child gets them: a worker session or a child never sees them, so it cannot recurse.
    pub fn with_dispatch(mut self) -> Self {
        self.dispatch = true;
        self
    }

    /// Offers the model tools the gateway runs (MCP servers' tools, named
    /// `mcp__<server>__<tool>`): after the built-in tools and before the dispatch tools, so a
    /// worker session's list is the same bytes as a gateway session's up to dispatch.
    pub fn with_gateway_tools(mut self, specs: Vec<ToolSpec>) -> Self {
        self.gateway_specs = specs;
        self
    }

    /// Holds the calls `approvals` names for a person's decision, and offers the model
    /// `request_approval` under `on-request`.
    pub fn with_approvals(mut self, approvals: crate::approval::Approvals) -> Self {
        self.approvals = approvals;
        self
    }

    /// The compiled approval policy of these tools.
    pub fn approvals(&self) -> &crate::approval::Approvals {
        &self.approvals
    }

    /// Ends the turn for background processes: every one not started with `keep` is stopped.
    pub async fn end_turn(&self) {
        self.processes.end_turn().await;
    }

    pub fn workspace(&self) -> &Workspace {
        &self.workspace
    }

    /// Limits the tools to an agent spec's allowlist: any other tool is left out of the
    /// model's list and refused if called anyway. `request_approval` belongs to the
    /// approval policy, not the allowlist.
    pub fn with_allowlist(mut self, tools: impl IntoIterator<Item = String>) -> Self {
        self.allowlist = Some(tools.into_iter().collect());
        self
    }

    /// Whether a tool may run under the allowlist.
    pub fn allows(&self, name: &str) -> bool {
        name == crate::approval::REQUEST_APPROVAL
            || self
                .allowlist
                .as_ref()
                .is_none_or(|allowed| allowed.contains(name))
    }

    /// The JSON schemas the model sees, in a fixed order (request bodies must be stable).
    pub fn specs(&self) -> Vec<ToolSpec> {
        let mut specs = specs();
        specs.extend(self.gateway_specs.iter().cloned());
        if self.approvals.offers_request_tool() {
            specs.push(crate::approval::request_spec());
        }
        if self.dispatch {
            specs.extend(dispatch_specs());
        }
        specs.retain(|spec| self.allows(&spec.name));
        specs
    }

    /// Runs one call. Never panics and never fails the loop: every problem becomes an error
    /// result.
    pub async fn call(&self, call: &ToolCall, cancel: &CancellationToken) -> ToolOutput {
        let ws = self.workspace.clone();
        let args = &call.arguments;
        let name = call.name.as_str();
        let out = match name {
            "read" => {
                let read = blocking(name, parse(call, args), cancel, move |a, c| {
                    files::read(&ws, a, c)
                });
                return read.await.unwrap_or_else(ToolOutput::error);
            }
            "write" => {
                blocking(name, parse(call, args), cancel, move |a, _| {
                    files::write(&ws, a)
                })
                .await
            }
            "edit" => {
                blocking(name, parse(call, args), cancel, move |a, _| {
                    files::edit(&ws, a)
                })
                .await
            }
            "apply_patch" => {
                blocking(name, parse(call, args), cancel, move |a, c| {
                    apply_patch::apply_patch(&ws, a, c)
                })
                .await
            }
            "ls" => {
                blocking(name, parse(call, args), cancel, move |a, _| {
                    files::ls(&ws, a)
                })
                .await
            }
            "find" => {
                blocking(name, parse(call, args), cancel, move |a, c| {
                    search::find(&ws, a, c)
                })
                .await
            }
            "grep" => {
                blocking(name, parse(call, args), cancel, move |a, c| {
                    search::grep(&ws, a, c)
                })
                .await
            }
            "exec" => match parse(call, args) {
                Ok(a) => {
                    exec::exec(
                        &self.workspace,
                        &self.exec_env,
                        self.ledger.as_ref(),
                        self.sandbox.as_ref(),
                        a,
                        cancel,
                    )
                    .await
                }
                Err(e) => Err(e),
            },
            "process" => match parse(call, args) {
                Ok(a) => {
                    process::process(
                        &self.processes,
                        &self.workspace,
                        &self.exec_env,
                        self.ledger.as_ref(),
                        self.sandbox.as_ref(),
                        a,
                    )
                    .await
                }
                Err(e) => Err(e),
            },
            other => Err(format!(
                "unknown tool `{other}`; available tools: read, write, edit, apply_patch, ls, find, grep, exec, process"
            )),
        };
        match out {
            Ok(text) => ToolOutput::ok(text),
            Err(text) => ToolOutput::error(text),
        }
    }
}

fn parse<T: DeserializeOwned>(call: &ToolCall, args: &Value) -> Result<T, String> {
    if let Value::String(raw) = args {
        return Err(format!(
            "arguments for `{}` are not a JSON object: {raw}",
            call.name
        ));
    }
    serde_json::from_value(args.clone())
        .map_err(|e| format!("invalid arguments for `{}`: {e}", call.name))
}

/// Runs a file tool on the blocking pool, so that the run's cancellation (or the timeout)
/// ends the call at once even if the tool is still working; `f` gets the token too, so its
/// loops stop early.
async fn blocking<A: Send + 'static, T: Send + 'static>(
    name: &str,
    args: Result<A, String>,
    cancel: &CancellationToken,
    f: impl FnOnce(A, &CancellationToken) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let args = args?;
    let token = cancel.child_token();
    let for_tool = token.clone();
    // Whatever ends this call also tells the tool to stop.
    let _stop = token.drop_guard();
    let task = tokio::task::spawn_blocking(move || f(args, &for_tool));
    tokio::select! {
        done = task => done.map_err(|e| format!("the tool crashed: {e}"))?,
        () = cancel.cancelled() => Err(format!("{name} was cancelled")),
        () = tokio::time::sleep(FILE_TOOL_TIMEOUT) => Err(format!(
            "{name} did not finish within {} s and was abandoned",
            FILE_TOOL_TIMEOUT.as_secs()
        )),
    }
}

/// The tool that runs on the gateway rather than next to the workspace (controlled egress).
pub const WEB_FETCH: &str = "web_fetch";

/// The tools that start a child session on a worker and read how it went; the gateway runs
/// them (see [`Tools::with_dispatch`] for who is offered them).
pub const DISPATCH: &str = "dispatch";
pub const DISPATCH_STATUS: &str = "dispatch_status";
pub const DISPATCH_WAIT: &str = "dispatch_wait";
pub const DISPATCH_TOOLS: [&str; 3] = [DISPATCH, DISPATCH_STATUS, DISPATCH_WAIT];

/// The prefix of an MCP server's tool as the model sees it: `mcp__<server>__<tool>`.
pub const MCP_PREFIX: &str = "mcp__";

/// Governed actions: the gateway runs them with its own credential after minting a one-time
/// grant and, when its policy says so, asking a person (so the session's own approval policy
/// does not hold them a second time). Offered only when the gateway configures them.
pub const GIT_PUSH: &str = "git_push";
pub const OPEN_PULL_REQUEST: &str = "open_pull_request";
pub const GOVERNED_TOOLS: [&str; 2] = [GIT_PUSH, OPEN_PULL_REQUEST];

/// Whether the gateway, not the workspace's machine, runs this tool.
pub fn runs_on_gateway(name: &str) -> bool {
    name == WEB_FETCH
        || DISPATCH_TOOLS.contains(&name)
        || GOVERNED_TOOLS.contains(&name)
        || name.starts_with(MCP_PREFIX)
}

/// The main argument of a call, for one-line display (`read src/lib.rs`).
pub fn summary(call: &ToolCall) -> String {
    if call.name == "apply_patch" {
        return patch_summary(call);
    }
    if call.name == "process" {
        let field = |key: &str| match call.arguments.get(key) {
            Some(Value::String(s)) => s.lines().next().unwrap_or("").to_owned(),
            Some(Value::Number(n)) => n.to_string(),
            _ => String::new(),
        };
        let action = field("action");
        let target = match action.as_str() {
            "start" => field("command"),
            _ => field("id"),
        };
        let text = format!("{action} {target}");
        let text = text.trim_end();
        return if text.chars().count() > 120 {
            format!("{}…", text.chars().take(119).collect::<String>())
        } else {
            text.to_owned()
        };
    }
    let key = match call.name.as_str() {
        "find" | "grep" => "pattern",
        "exec" => "command",
        WEB_FETCH => "url",
        DISPATCH => "prompt",
        crate::approval::REQUEST_APPROVAL => "action",
        DISPATCH_STATUS | DISPATCH_WAIT => "id",
        GIT_PUSH => "branch",
        OPEN_PULL_REQUEST => "title",
        _ => "path",
    };
    let text = call
        .arguments
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or("");
    let line = text.lines().next().unwrap_or("");
    if line.is_empty() && call.name == "ls" {
        return ".".to_owned();
    }
    if line.chars().count() > 120 {
        format!("{}…", line.chars().take(119).collect::<String>())
    } else {
        line.to_owned()
    }
}

/// The files a patch names (`src/a.rs, src/b.rs`), read from its section headers.
fn patch_summary(call: &ToolCall) -> String {
    let patch = call
        .arguments
        .get("patch")
        .and_then(Value::as_str)
        .unwrap_or("");
    let files: Vec<&str> = patch
        .lines()
        .filter_map(|line| {
            ["*** Add File: ", "*** Delete File: ", "*** Update File: "]
                .iter()
                .find_map(|header| line.strip_prefix(header))
        })
        .map(str::trim)
        .collect();
    let text = files.join(", ");
    if text.chars().count() > 120 {
        format!("{}…", text.chars().take(119).collect::<String>())
    } else {
        text
    }
}

/// Cuts `text` to [`MAX_RESULT_BYTES`] on a character boundary, saying so visibly.
pub(crate) fn cap(mut text: String, hint: &str) -> String {
    if text.len() <= MAX_RESULT_BYTES {
        return text;
    }
    let mut end = MAX_RESULT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let dropped = text.len() - end;
    text.truncate(end);
    text.push_str(&format!("\n[… {dropped} more bytes not shown; {hint} …]"));
    text
}

fn specs() -> Vec<ToolSpec> {
    let spec = |name: &str, description: &str, parameters: Value| ToolSpec {
        name: name.to_owned(),
        description: description.to_owned(),
        parameters,
    };
    vec![
        spec(
            "read",
            "Read a file of the workspace. A text file comes back as numbered lines, at most about 60 KiB per call; use offset (1-based line) and limit (number of lines) for large files. A PNG, JPEG, GIF or WebP image (up to 2.25 MiB) comes back as the image itself, for you to look at.",
            json!({"type": "object", "additionalProperties": false, "required": ["path"], "properties": {
                "path": {"type": "string", "description": "Path relative to the workspace root"},
                "offset": {"type": "integer", "minimum": 1, "description": "First line to read (1-based)"},
                "limit": {"type": "integer", "minimum": 1, "description": "Maximum number of lines"}
            }}),
        ),
        spec(
            "write",
            "Create or overwrite a file with the given content. Parent directories are created.",
            json!({"type": "object", "additionalProperties": false, "required": ["path", "content"], "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"}
            }}),
        ),
        spec(
            "edit",
            "Replace exact text in a file. Each old_text must occur exactly once in the file and edits must not overlap; all edits apply together or none do.",
            json!({"type": "object", "additionalProperties": false, "required": ["path", "edits"], "properties": {
                "path": {"type": "string"},
                "edits": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": false, "required": ["old_text", "new_text"],
                    "properties": {"old_text": {"type": "string"}, "new_text": {"type": "string"}}
                }}
            }}),
        ),
        spec(
            "apply_patch",
            "Change files with a patch: add, delete, update and move several files in one call, all or nothing (if any hunk does not match, no file is changed and the error shows the hunk). Format:\n*** Begin Patch\n*** Add File: path\n+line of the new file\n*** Delete File: path\n*** Update File: path\n*** Move to: new/path (optional)\n@@ a line just above the change, to locate it (optional)\n context line\n-removed line\n+added line\n*** End of File (optional: the hunk is at the end of the file)\n*** End Patch\nGive about three lines of context around each change; paths are relative to the workspace root.",
            json!({"type": "object", "additionalProperties": false, "required": ["patch"], "properties": {
                "patch": {"type": "string", "description": "The whole patch, from *** Begin Patch to *** End Patch"}
            }}),
        ),
        spec(
            "ls",
            "List a directory of the workspace (the root when path is omitted). Directories end with /.",
            json!({"type": "object", "additionalProperties": false, "properties": {
                "path": {"type": "string"}
            }}),
        ),
        spec(
            "find",
            "Find files whose workspace-relative path matches a glob (for example **/*.rs). Respects .gitignore.",
            json!({"type": "object", "additionalProperties": false, "required": ["pattern"], "properties": {
                "pattern": {"type": "string"},
                "path": {"type": "string", "description": "Directory to search in"}
            }}),
        ),
        spec(
            "grep",
            "Search file contents with a regular expression. Respects .gitignore. Returns path:line: text.",
            json!({"type": "object", "additionalProperties": false, "required": ["pattern"], "properties": {
                "pattern": {"type": "string"},
                "path": {"type": "string", "description": "File or directory to search in"},
                "glob": {"type": "string", "description": "Only search files matching this glob"},
                "ignore_case": {"type": "boolean"}
            }}),
        ),
        spec(
            WEB_FETCH,
            "Fetch a web page or file over HTTP(S). Runs on the gateway, only for hosts the operator allows; the result is size-bounded text.",
            json!({"type": "object", "additionalProperties": false, "required": ["url"], "properties": {
                "url": {"type": "string", "description": "An http:// or https:// URL"}
            }}),
        ),
        spec(
            "exec",
            "Run a shell command with bash -lc in the workspace root (or workdir). Returns the exit code and the combined output (long output is truncated in the middle). Everything the command starts, background processes included, is killed when it ends, times out or is cancelled; use the process tool for a server or watcher that must keep running.",
            json!({"type": "object", "additionalProperties": false, "required": ["command"], "properties": {
                "command": {"type": "string"},
                "workdir": {"type": "string", "description": "Directory to run in, relative to the workspace root"},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": exec::MAX_TIMEOUT_S, "description": format!("Seconds before the command is killed; default {}", exec::DEFAULT_TIMEOUT_S)}
            }}),
        ),
        spec(
            "process",
            "Run a command in the background (a dev server, a watcher) and check on it while you work. start {command, workdir?, keep?} returns an id; status {id?} lists processes or shows one; output {id} returns the output since the last read (the last ~60 KiB are kept); stop {id} kills it and everything it started. Background processes are stopped when the turn ends unless started with keep: true, and always when the session ends.",
            json!({"type": "object", "additionalProperties": false, "required": ["action"], "properties": {
                "action": {"type": "string", "enum": ["start", "status", "output", "stop"]},
                "id": {"type": "string", "description": "The id start returned (for status, output, stop)"},
                "command": {"type": "string", "description": "For start: run with bash -lc"},
                "workdir": {"type": "string", "description": "For start: directory relative to the workspace root"},
                "keep": {"type": "boolean", "description": "For start: keep it running after this turn ends"}
            }}),
        ),
    ]
}

fn dispatch_specs() -> Vec<ToolSpec> {
    let spec = |name: &str, description: &str, parameters: Value| ToolSpec {
        name: name.to_owned(),
        description: description.to_owned(),
        parameters,
    };
    vec![
        spec(
            DISPATCH,
            "Hand a task to a child session on a worker box: it starts from this workspace as it is now (uncommitted changes included), on its own branch skiff/<child-id>. With wait (the default) the result is the child's status, branch, diffstat and final message; with wait: false it is the child's id at once, for dispatch_status and dispatch_wait. The child cannot dispatch further children.",
            json!({"type": "object", "additionalProperties": false, "required": ["prompt"], "properties": {
                "prompt": {"type": "string", "description": "What the child should do; it sees nothing of this conversation"},
                "profile": {"type": "string", "description": "The worker profile to run on; default: the gateway's first"},
                "title": {"type": "string", "description": "The child session's title; default: the prompt's first line"},
                "wait": {"type": "boolean", "description": "Wait for the child to finish (default true)"}
            }}),
        ),
        spec(
            DISPATCH_STATUS,
            "How a child session started with dispatch is doing: its status, and once it has finished its branch, diffstat and final message.",
            json!({"type": "object", "additionalProperties": false, "required": ["id"], "properties": {
                "id": {"type": "string", "description": "The child's session id (ses_…)"}
            }}),
        ),
        spec(
            DISPATCH_WAIT,
            "Wait for a child session started with dispatch to finish, then return its status, branch, diffstat and final message (or its status so far when timeout_s passes first).",
            json!({"type": "object", "additionalProperties": false, "required": ["id"], "properties": {
                "id": {"type": "string", "description": "The child's session id (ses_…)"},
                "timeout_s": {"type": "integer", "minimum": 1, "description": "Seconds to wait at most; default 1800"}
            }}),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tools_made_with_dispatch_offer_the_dispatch_tools() {
        let dir = tempfile::tempdir().unwrap();
        let names =
            |tools: &Tools| -> Vec<String> { tools.specs().into_iter().map(|s| s.name).collect() };
        let plain = Tools::new(dir.path().into(), Vec::new()).unwrap();
        assert!(!names(&plain).iter().any(|n| n.starts_with("dispatch")));
        let with = plain.with_dispatch();
        let names = names(&with);
        assert_eq!(names[names.len() - 3..], DISPATCH_TOOLS.map(String::from));
        assert!(DISPATCH_TOOLS.iter().all(|t| runs_on_gateway(t)));
    }

    #[tokio::test]
    async fn a_file_tool_that_blocks_loses_to_cancel() {
        let cancel = CancellationToken::new();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (entered, on_entered) = tokio::sync::oneshot::channel();
        let call = blocking("read", Ok(()), &cancel, move |(), tool_cancel| {
            let _ = entered.send(());
            // Stuck, as an open of a FIFO would be, until the test lets go.
            let _ = wait.recv();
            assert!(tool_cancel.is_cancelled(), "the tool was not told to stop");
            Ok("finished".to_owned())
        });
        let canceller = async {
            on_entered.await.unwrap();
            cancel.cancel();
        };
        let (out, ()) = tokio::join!(call, canceller);
        assert_eq!(out, Err("read was cancelled".to_owned()));
        release.send(()).unwrap();
    }
}
