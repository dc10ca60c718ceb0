//! Which tool calls wait for a person: a session's [`ApprovalPolicy`] compiled once per turn
//! ([`Approvals::compile`]) and applied to each call before it runs ([`Approvals::ask`]).
//!
//! Deliberately absent: the waiting itself and where the decision comes from. The loop hands
//! an [`Ask`] to its backend ([`crate::SessionBackend::request_approval`]): the gateway's
//! store and hub for a gateway-placed loop, an `approval.request` operation for a worker's.

use globset::{GlobBuilder, GlobMatcher, GlobSet, GlobSetBuilder};
use serde_json::{Value, json};
use skiff_protocol::approval::{ApprovalKind, ApprovalPolicy};
use skiff_protocol::model::{ToolCall, ToolSpec};

/// The tool the model asks with under `on-request`.
pub const REQUEST_APPROVAL: &str = "request_approval";

/// The longest subject (command or diff) an approval carries; the rest is cut, visibly.
pub const MAX_SUBJECT_BYTES: usize = 32 * 1024;

/// A call that waits: what a person is asked to decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ask {
    pub tool: String,
    pub kind: ApprovalKind,
    /// The command, a diff of the write, or what the model asked to do.
    pub subject: String,
    /// Why the model asked (`request_approval`'s `reason`).
    pub reason: Option<String>,
}

/// A policy that could not be compiled: `key` names the rule (`exec[1]`).
#[derive(Debug, thiserror::Error)]
#[error("at `{key}`: {message}")]
pub struct PolicyError {
    pub key: String,
    pub message: String,
}

#[derive(Clone, Debug)]
enum CommandMatcher {
    Glob(GlobMatcher),
    Regex(regex::Regex),
}

impl CommandMatcher {
    fn is_match(&self, command: &str) -> bool {
        match self {
            CommandMatcher::Glob(glob) => glob.is_match(command),
            CommandMatcher::Regex(re) => re.is_match(command),
        }
    }
}

/// A compiled policy.
#[derive(Clone, Debug, Default)]
pub struct Approvals {
    on_request: bool,
    all: bool,
    exec: Vec<CommandMatcher>,
    /// `Some` when `write_outside` was given: writes to other paths wait.
    write_allowed: Option<GlobSet>,
}

impl Approvals {
    /// Compiles `policy`; a pattern that is not a glob or regular expression is an error
    /// naming it.
    pub fn compile(policy: &ApprovalPolicy) -> Result<Self, PolicyError> {
        let rules = match policy {
            ApprovalPolicy::Never => return Ok(Self::default()),
            ApprovalPolicy::OnRequest => {
                return Ok(Self {
                    on_request: true,
                    ..Self::default()
                });
            }
            ApprovalPolicy::Rules(rules) => rules,
        };
        let mut exec = Vec::new();
        for (i, pattern) in rules.exec.iter().enumerate() {
            let key = format!("exec[{i}]");
            let matcher = match pattern
                .strip_prefix('/')
                .and_then(|p| p.strip_suffix('/'))
                .filter(|p| !p.is_empty())
            {
                Some(re) => {
                    CommandMatcher::Regex(regex::Regex::new(re).map_err(|e| PolicyError {
                        key,
                        message: format!("{pattern:?} is not a regular expression: {e}"),
                    })?)
                }
                None => CommandMatcher::Glob(
                    GlobBuilder::new(pattern)
                        .literal_separator(false)
                        .build()
                        .map_err(|e| PolicyError {
                            key,
                            message: format!("{pattern:?} is not a glob: {e}"),
                        })?
                        .compile_matcher(),
                ),
            };
            exec.push(matcher);
        }
        let write_allowed = if rules.write_outside.is_empty() {
            None
        } else {
            let mut set = GlobSetBuilder::new();
            for (i, pattern) in rules.write_outside.iter().enumerate() {
                let glob = GlobBuilder::new(pattern.trim_start_matches("./"))
                    .literal_separator(true)
                    .build()
                    .map_err(|e| PolicyError {
                        key: format!("write_outside[{i}]"),
                        message: format!("{pattern:?} is not a path glob: {e}"),
                    })?;
                set.add(glob);
            }
            Some(set.build().map_err(|e| PolicyError {
                key: "write_outside".into(),
                message: e.to_string(),
            })?)
        };
        Ok(Self {
            on_request: false,
            all: rules.all,
            exec,
            write_allowed,
        })
    }

    /// Whether the model is offered [`REQUEST_APPROVAL`].
    pub fn offers_request_tool(&self) -> bool {
        self.on_request
    }

    /// What a person must decide before `call` runs, or `None` when it runs at once.
    pub fn ask(&self, call: &ToolCall, workspace: &crate::tools::Workspace) -> Option<Ask> {
        if crate::tools::GOVERNED_TOOLS.contains(&call.name.as_str()) {
            // The gateway asks for these itself, bound to the grant it mints.
            return None;
        }
        let arg = |key: &str| call.arguments.get(key).and_then(Value::as_str);
        if call.name == REQUEST_APPROVAL && self.on_request {
            return Some(Ask {
                tool: call.name.clone(),
                kind: ApprovalKind::Request,
                subject: cap(arg("action")
                    .unwrap_or("(the model named no action)")
                    .to_owned()),
                reason: arg("reason").map(str::to_owned),
            });
        }
        let command = match call.name.as_str() {
            "exec" => arg("command"),
            "process" if arg("action") == Some("start") => arg("command"),
            _ => None,
        };
        if let Some(command) = command
            && self.exec.iter().any(|m| m.is_match(command.trim()))
        {
            return Some(self.exec_ask(call, command));
        }
        if let Some(allowed) = &self.write_allowed {
            let paths = written_paths(call);
            if paths
                .iter()
                .any(|p| !allowed.is_match(p.trim_start_matches("./")))
            {
                return Some(Ask {
                    tool: call.name.clone(),
                    kind: ApprovalKind::Write,
                    subject: cap(write_diff(call, workspace)),
                    reason: None,
                });
            }
        }
        if self.all {
            if let Some(command) = command {
                return Some(self.exec_ask(call, command));
            }
            let kind = if written_paths(call).is_empty() {
                ApprovalKind::Call
            } else {
                ApprovalKind::Write
            };
            let subject = match kind {
                ApprovalKind::Write => write_diff(call, workspace),
                _ => format!("{} {}", call.name, crate::tools::summary(call))
                    .trim_end()
                    .to_owned(),
            };
            return Some(Ask {
                tool: call.name.clone(),
                kind,
                subject: cap(subject),
                reason: None,
            });
        }
        None
    }

    fn exec_ask(&self, call: &ToolCall, command: &str) -> Ask {
        Ask {
            tool: call.name.clone(),
            kind: ApprovalKind::Exec,
            subject: cap(command.to_owned()),
            reason: None,
        }
    }
}

/// The [`REQUEST_APPROVAL`] tool's spec.
pub fn request_spec() -> ToolSpec {
    ToolSpec {
        name: REQUEST_APPROVAL.to_owned(),
        description: "Ask the person supervising this session to approve something before you do it (a risky command, a change outside the task, anything you are unsure they want). The call waits for their decision and returns whether it was approved; a denial comes back as an error with their reason. Do not do the action if it is denied.".to_owned(),
        parameters: json!({"type": "object", "additionalProperties": false, "required": ["action"], "properties": {
            "action": {"type": "string", "description": "What you want to do, exactly (the command, or the change)"},
            "reason": {"type": "string", "description": "Why it is needed"}
        }}),
    }
}

/// The workspace paths a file tool call writes.
fn written_paths(call: &ToolCall) -> Vec<String> {
    let arg = |key: &str| call.arguments.get(key).and_then(Value::as_str);
    match call.name.as_str() {
        "write" | "edit" => arg("path").map(str::to_owned).into_iter().collect(),
        "apply_patch" => arg("patch")
            .unwrap_or("")
            .lines()
            .filter_map(|line| {
                [
                    "*** Add File: ",
                    "*** Delete File: ",
                    "*** Update File: ",
                    "*** Move to: ",
                ]
                .iter()
                .find_map(|header| line.strip_prefix(header))
            })
            .map(|p| p.trim().to_owned())
            .collect(),
        _ => Vec::new(),
    }
}

/// A diff of what a file tool call would write, for the person deciding.
fn write_diff(call: &ToolCall, workspace: &crate::tools::Workspace) -> String {
    let arg = |key: &str| call.arguments.get(key).and_then(Value::as_str);
    let path = arg("path").unwrap_or("");
    match call.name.as_str() {
        "write" => {
            let new = arg("content").unwrap_or("");
            // Only for display: a file that cannot be read shows as new.
            let old = workspace
                .resolve(path)
                .ok()
                .and_then(|p| std::fs::read(p).ok())
                .filter(|b| b.len() <= MAX_SUBJECT_BYTES * 4)
                .and_then(|b| String::from_utf8(b).ok());
            let (from, old) = match &old {
                Some(old) => (format!("a/{path}"), old.as_str()),
                None => ("/dev/null".to_owned(), ""),
            };
            similar::TextDiff::from_lines(old, new)
                .unified_diff()
                .header(&from, &format!("b/{path}"))
                .to_string()
        }
        "edit" => {
            let mut out = format!("--- a/{path}\n+++ b/{path}\n");
            let edits = call
                .arguments
                .get("edits")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for edit in edits {
                let text = |k: &str| edit.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                out.push_str("@@\n");
                for line in text("old_text").lines() {
                    out.push_str(&format!("-{line}\n"));
                }
                for line in text("new_text").lines() {
                    out.push_str(&format!("+{line}\n"));
                }
            }
            out
        }
        "apply_patch" => arg("patch").unwrap_or("").to_owned(),
        _ => String::new(),
    }
}

fn cap(mut text: String) -> String {
    if text.len() <= MAX_SUBJECT_BYTES {
        return text;
    }
    let mut end = MAX_SUBJECT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let dropped = text.len() - end;
    text.truncate(end);
    text.push_str(&format!("\n[… {dropped} more bytes not shown …]"));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            id: "c1".into(),
            name: name.into(),
            arguments,
        }
    }

    fn rules(text: &str) -> Approvals {
        Approvals::compile(&serde_json::from_str(text).unwrap()).unwrap()
    }

    #[test]
    fn exec_rules_match_globs_and_regexes_over_the_whole_command() {
        let dir = tempfile::tempdir().unwrap();
        let ws = crate::tools::Workspace::new(dir.path().into()).unwrap();
        let policy = rules(r#"{"exec":["rm *", "/^git push/"]}"#);
        let asks = |cmd: &str| policy.ask(&call("exec", json!({"command": cmd})), &ws);
        assert_eq!(asks("rm -rf build").unwrap().subject, "rm -rf build");
        assert!(asks("git push origin main").is_some());
        assert!(asks("cargo test").is_none());
        assert!(asks("echo rm -rf").is_none());
    }

    #[test]
    fn writes_outside_the_allowed_paths_wait_with_a_diff() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README.md"), "old\n").unwrap();
        let ws = crate::tools::Workspace::new(dir.path().into()).unwrap();
        let policy = rules(r#"{"write_outside":["src/**"]}"#);
        let inside = call("write", json!({"path": "src/a.rs", "content": "x"}));
        assert!(policy.ask(&inside, &ws).is_none());
        let outside = call("write", json!({"path": "README.md", "content": "new\n"}));
        let ask = policy.ask(&outside, &ws).unwrap();
        assert_eq!(ask.kind, ApprovalKind::Write);
        assert!(
            ask.subject.contains("-old") && ask.subject.contains("+new"),
            "{}",
            ask.subject
        );
    }

    #[test]
    fn a_bad_pattern_names_its_rule() {
        let policy = serde_json::from_str(r#"{"exec":["ok", "/(/"]}"#).unwrap();
        let err = Approvals::compile(&policy).unwrap_err();
        assert_eq!(err.key, "exec[1]");
    }
}
