//! Approvals: a session's policy for which tool calls wait for a person, and the approval
//! rows a waiting call leaves for the CLI and the Control UI.
//!
//! A policy is `"never"` (the default), `"on-request"` (the model may ask with the
//! `request_approval` tool) or a table of rules `{ exec = [...], write_outside = [...],
//! all = true }`. Patterns are only carried here; the agent crate compiles and applies them.

use crate::ids::{RunId, SessionId};
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Which tool calls wait for a person's decision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ApprovalPolicy {
    /// Nothing waits.
    #[default]
    Never,
    /// Only what the model itself asks about (its `request_approval` tool).
    OnRequest,
    /// Calls matching any rule wait.
    Rules(ApprovalRules),
}

/// The rules of a policy table. A call waits when any rule matches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRules {
    /// `exec` (and `process start`) commands matching one of these: a glob over the whole
    /// command (`rm *`, `git push*`), or a regular expression between slashes (`/^sudo /`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exec: Vec<String>,
    /// Workspace paths (globs, relative to the workspace root) the agent may write without
    /// asking; a `write`, `edit` or `apply_patch` touching any other path waits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub write_outside: Vec<String>,
    /// Every tool call waits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
}

impl ApprovalPolicy {
    pub fn is_never(&self) -> bool {
        *self == ApprovalPolicy::Never
    }

    /// The policy as people write it (`never`, `on-request`, `{ exec = ["rm *"] }`).
    pub fn describe(&self) -> String {
        match self {
            ApprovalPolicy::Never => "never".into(),
            ApprovalPolicy::OnRequest => "on-request".into(),
            ApprovalPolicy::Rules(rules) => {
                let list = |v: &[String]| {
                    v.iter()
                        .map(|s| format!("{s:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let mut parts = Vec::new();
                if !rules.exec.is_empty() {
                    parts.push(format!("exec = [{}]", list(&rules.exec)));
                }
                if !rules.write_outside.is_empty() {
                    parts.push(format!("write_outside = [{}]", list(&rules.write_outside)));
                }
                if rules.all {
                    parts.push("all = true".into());
                }
                format!("{{ {} }}", parts.join(", "))
            }
        }
    }
}

impl Serialize for ApprovalPolicy {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ApprovalPolicy::Never => serializer.serialize_str("never"),
            ApprovalPolicy::OnRequest => serializer.serialize_str("on-request"),
            ApprovalPolicy::Rules(rules) => rules.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for ApprovalPolicy {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PolicyVisitor;

        impl<'de> Visitor<'de> for PolicyVisitor {
            type Value = ApprovalPolicy;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "\"never\", \"on-request\" or a table of rules like { exec = [\"rm *\"], write_outside = [\"src/**\"], all = true }",
                )
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
                match value {
                    "never" => Ok(ApprovalPolicy::Never),
                    "on-request" => Ok(ApprovalPolicy::OnRequest),
                    other => Err(E::custom(format!(
                        "unknown approval policy `{other}`; expected \"never\", \"on-request\" or a table of rules like {{ exec = [\"rm *\"] }}"
                    ))),
                }
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let rules = ApprovalRules::deserialize(de::value::MapAccessDeserializer::new(map))?;
                if rules.exec.is_empty() && rules.write_outside.is_empty() && !rules.all {
                    return Err(de::Error::custom(
                        "an approval table with no rules asks for nothing; give `exec`, `write_outside` or `all = true`, or write \"never\"",
                    ));
                }
                Ok(ApprovalPolicy::Rules(rules))
            }
        }

        deserializer.deserialize_any(PolicyVisitor)
    }
}

/// What a waiting call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalKind {
    /// A command (`exec`, `process start`); the subject is the command.
    Exec,
    /// A write outside the allowed paths; the subject is a diff of the write.
    Write,
    /// Any other call under `all = true`; the subject is the call's main argument.
    Call,
    /// The model asked with `request_approval`; the subject is what it wants to do.
    Request,
}

impl ApprovalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalKind::Exec => "exec",
            ApprovalKind::Write => "write",
            ApprovalKind::Call => "call",
            ApprovalKind::Request => "request",
        }
    }
}

/// Where an approval is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalState {
    Pending,
    Approved,
    Denied,
    /// Nobody decided within `approval_timeout`: the call was denied.
    Expired,
    /// The turn was cancelled or the session moved (dispatch, pull-back, failover).
    Revoked,
}

impl ApprovalState {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalState::Pending => "pending",
            ApprovalState::Approved => "approved",
            ApprovalState::Denied => "denied",
            ApprovalState::Expired => "expired",
            ApprovalState::Revoked => "revoked",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => ApprovalState::Pending,
            "approved" => ApprovalState::Approved,
            "denied" => ApprovalState::Denied,
            "expired" => ApprovalState::Expired,
            "revoked" => ApprovalState::Revoked,
            _ => return None,
        })
    }
}

impl fmt::Display for ApprovalState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One approval, as `skiff approvals` and the approval card show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalView {
    pub id: crate::ids::ApprovalId,
    pub session_id: SessionId,
    pub run_id: RunId,
    /// The tool whose call waits (`exec`, `write`, `request_approval`, …).
    pub tool: String,
    pub kind: ApprovalKind,
    /// The command, a diff of the write, or what the model asked to do.
    pub subject: String,
    /// Who asked: `agent` for a gateway-placed loop, `worker env_…` for a worker's.
    pub requested_by: String,
    /// Why the model asked (`request_approval`'s reason), when it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_reason: Option<String>,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub state: ApprovalState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at_ms: Option<i64>,
    /// A denial's reason, or why it expired or was revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `GET /v1/approvals`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalList {
    pub approvals: Vec<ApprovalView>,
}

/// `POST /v1/approvals/{id}/approve` and `/deny`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecideApprovalRequest {
    /// Why (a denial's reason reaches the model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip_as_people_write_them() {
        for text in [
            r#""never""#,
            r#""on-request""#,
            r#"{"exec":["rm *"],"all":true}"#,
        ] {
            let policy: ApprovalPolicy = serde_json::from_str(text).unwrap();
            assert_eq!(serde_json::to_string(&policy).unwrap(), text);
        }
    }

    #[test]
    fn a_bad_policy_says_what_is_expected() {
        let err = serde_json::from_str::<ApprovalPolicy>(r#""sometimes""#).unwrap_err();
        assert!(err.to_string().contains("sometimes"), "{err}");
        let err = serde_json::from_str::<ApprovalPolicy>(r#"{"exce":["rm"]}"#).unwrap_err();
        assert!(err.to_string().contains("exce"), "{err}");
        let err = serde_json::from_str::<ApprovalPolicy>(r#"{}"#).unwrap_err();
        assert!(err.to_string().contains("asks for nothing"), "{err}");
    }
}
