//! Governed actions (`[forge]` in skiff.toml): `git_push` and `open_pull_request`, tools the
//! gateway runs with its own forge credential, never on a box, for local and worker sessions
//! alike (offered through `gateway_tools`, the same bytes in both placements).
//!
//! The chain, for each call: the agent proposes; the gateway resolves the exact plan (remote
//! and branch, or repository, head and base), mints a five-minute signed invocation grant over
//! its digest and registers the grant's id (`grant.rs`); when `[forge] confirm` (the default)
//! or the session's approval rules hold every call (`all`), it asks a person through the
//! session's approvals (the agent's own policy check leaves governed tools to this one); then the governed wrapper
//! ([`Core::governed_execute`]) verifies the grant, consumes it once, recomputes the digest of
//! what it is about to run, and runs it (`push.rs`, `forge.rs`), returning a bounded result.
//! Every mint, refusal and execution is audited (`governed.grant`, `governed.refused`,
//! `governed.execute`): ids, capability, target, outcome — never an argument body or token.
//!
//! Deliberately absent: pushing any ref but the session branch, force pushes, and any forge
//! call besides reading a repository's default branch and opening a pull request.

mod forge;
pub(crate) mod grant;
mod push;

use crate::Core;
use crate::config::{ConfigError, ForgeConfig};
use crate::mcp::Source;
use grant::{GrantKey, Proposal, Refusal};
use serde::{Deserialize, Serialize};
use serde_json::json;
use skiff_agent::tools::{GIT_PUSH, OPEN_PULL_REQUEST, ToolOutput};
use skiff_protocol::api::WorkspaceView;
use skiff_protocol::approval::ApprovalKind;
use skiff_protocol::grant::{Capability, GrantClaims};
use skiff_protocol::model::ToolSpec;
use skiff_protocol::{RunId, SessionId};
use skiff_store::Scope;
use std::path::Path;
use tokio_util::sync::CancellationToken;

const DEFAULT_API: &str = "https://api.github.com";
/// The most text a forge's error message carries back to the agent.
const MAX_MESSAGE_BYTES: usize = 1024;

/// A checked `[forge]`.
#[derive(Clone, Debug)]
pub(crate) struct ForgeDef {
    pub api: String,
    /// Absent when pushes need no token (ssh or path remotes, or a `[git.credentials]` entry
    /// for the remote); pull requests then are not offered.
    pub token: Option<Source>,
    pub repository: Option<String>,
    pub remote: String,
    pub confirm: bool,
    /// A digest of this policy: grants name the revision that minted them.
    pub revision: String,
}

/// Checks `[forge]`: off when absent.
pub(crate) fn validate(
    config_path: &Path,
    forge: Option<&ForgeConfig>,
) -> Result<Option<ForgeDef>, ConfigError> {
    let Some(c) = forge else {
        return Ok(None);
    };
    let invalid = |message: String| ConfigError::Invalid {
        path: config_path.display().to_string(),
        message,
    };
    let api = c
        .api
        .clone()
        .unwrap_or_else(|| DEFAULT_API.to_owned())
        .trim_end_matches('/')
        .to_owned();
    match reqwest::Url::parse(&api) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => {}
        _ => {
            return Err(invalid(format!(
                "at `forge.api`: \"{api}\" is not an http(s) URL like \"{DEFAULT_API}\""
            )));
        }
    }
    let token = match &c.token {
        Some(text) => Some(crate::mcp::source("forge.token", text, true).map_err(invalid)?),
        None => None,
    };
    if let Some(repo) = &c.repository
        && forge::split_repository(repo).is_none()
    {
        return Err(invalid(format!(
            "at `forge.repository`: \"{repo}\" is not OWNER/REPO"
        )));
    }
    let remote = c.remote.clone().unwrap_or_else(|| "origin".to_owned());
    if !crate::sync_api::plain_name(&remote) {
        return Err(invalid(format!(
            "at `forge.remote`: \"{remote}\" is not a remote name"
        )));
    }
    let confirm = c.confirm.unwrap_or(true);
    let revision = blake3::hash(
        json!({ "api": api, "repository": c.repository, "remote": remote, "confirm": confirm })
            .to_string()
            .as_bytes(),
    )
    .to_hex()[..16]
        .to_owned();
    Ok(Some(ForgeDef {
        api,
        token,
        repository: c.repository.clone(),
        remote,
        confirm,
        revision,
    }))
}

/// The gateway's governed actions: the grant key and, when configured, the forge.
pub(crate) struct Governed {
    pub(crate) key: GrantKey,
    pub(crate) forge: Option<ForgeDef>,
    /// The clock grants are minted and checked against.
    pub(crate) clock: fn() -> i64,
    /// Added to the clock: the tests move time forward to expire a grant.
    pub(crate) skew_ms: std::sync::atomic::AtomicI64,
}

impl Governed {
    pub(crate) fn now(&self) -> i64 {
        (self.clock)().saturating_add(self.skew_ms.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The tools sessions are offered: none when `[forge]` is absent, and no pull requests
    /// without a forge token (the API needs one).
    pub(crate) fn specs(&self) -> Vec<ToolSpec> {
        let Some(forge) = &self.forge else {
            return Vec::new();
        };
        let mut specs = vec![
            ToolSpec {
                name: GIT_PUSH.to_owned(),
                description: "Push this session's branch to the repository's remote with the gateway's credential. Only the session branch can be pushed; a person may have to approve it first.".to_owned(),
                parameters: json!({"type": "object", "additionalProperties": false, "properties": {
                    "branch": {"type": "string", "description": "The session branch (the default); any other branch is refused"}
                }}),
            },
            ToolSpec {
                name: OPEN_PULL_REQUEST.to_owned(),
                description: "Open a pull request from this session's branch (push it first with git_push) on the forge. A person may have to approve it first.".to_owned(),
                parameters: json!({"type": "object", "additionalProperties": false, "required": ["title", "body"], "properties": {
                    "title": {"type": "string"},
                    "body": {"type": "string"},
                    "base": {"type": "string", "description": "The branch to merge into; default: the repository's default branch"}
                }}),
            },
        ];
        if forge.token.is_none() {
            specs.retain(|s| s.name != OPEN_PULL_REQUEST);
        }
        specs
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushArgs {
    branch: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PullArgs {
    title: String,
    body: String,
    base: Option<String>,
}

/// Exactly what a governed action runs with; its digest is what a grant covers.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "capability", rename_all = "snake_case")]
pub(crate) enum Plan {
    GitPush {
        repository_dir: String,
        remote: String,
        branch: String,
    },
    OpenPullRequest {
        repository: String,
        title: String,
        body: String,
        head: String,
        base: String,
    },
}

impl Plan {
    pub(crate) fn capability(&self) -> Capability {
        match self {
            Plan::GitPush { .. } => Capability::GitPush,
            Plan::OpenPullRequest { .. } => Capability::OpenPullRequest,
        }
    }

    fn target(&self) -> String {
        match self {
            Plan::GitPush { remote, branch, .. } => format!("{remote} refs/heads/{branch}"),
            Plan::OpenPullRequest { repository, .. } => repository.clone(),
        }
    }

    pub(crate) fn digest(&self) -> String {
        grant::digest(self.capability(), self)
    }

    /// What the person confirming reads.
    fn subject(&self) -> String {
        match self {
            Plan::GitPush { remote, branch, .. } => {
                format!("git push {remote} refs/heads/{branch}:refs/heads/{branch}")
            }
            Plan::OpenPullRequest {
                repository,
                title,
                body,
                head,
                base,
            } => {
                format!("open a pull request on {repository}: {head} → {base}\n\n{title}\n\n{body}")
            }
        }
    }
}

impl Core {
    /// `git_push` / `open_pull_request` for `session` (its run `run`): the whole chain.
    #[allow(
        clippy::too_many_arguments,
        reason = "a gateway tool's call context, as gateway_tool receives it"
    )]
    pub(crate) async fn governed_tool(
        &self,
        scope: &Scope,
        session: &SessionId,
        env: Option<&skiff_protocol::EnvironmentId>,
        run: Option<&RunId>,
        name: &str,
        arguments: &serde_json::Value,
        cancel: &CancellationToken,
    ) -> ToolOutput {
        let Some(forge) = &self.governed.forge else {
            return ToolOutput::error(format!(
                "{name} is not a tool this gateway offers (governed actions need [forge] in skiff.toml)"
            ));
        };
        let plan = match self
            .plan(scope, session, forge, name, arguments, cancel)
            .await
        {
            Ok(plan) => plan,
            Err(message) => {
                self.audit(
                    scope,
                    "governed.refused",
                    session.as_str(),
                    "refused",
                    json!({ "tool": name, "reason": "proposal", "env": env.map(|e| e.as_str()) }),
                );
                return ToolOutput::error(message);
            }
        };
        // `[forge] confirm`, or a session whose approval rules hold every call.
        let every_call = self.store.session(scope, session).is_ok_and(|row| {
            matches!(
                self.approval_policy(scope, &row),
                skiff_protocol::approval::ApprovalPolicy::Rules(rules) if rules.all
            )
        });
        let proposal = Proposal {
            session,
            capability: plan.capability(),
            target: plan.target(),
            digest: plan.digest(),
            policy_revision: forge.revision.clone(),
            confirm: forge.confirm || every_call,
        };
        let (token, claims) = match grant::mint(
            &*self.store,
            &self.governed.key,
            scope,
            proposal,
            self.governed.now(),
        ) {
            Ok(minted) => minted,
            Err(e) => return ToolOutput::error(format!("not run: no grant could be minted ({e})")),
        };
        self.audit(
            scope,
            "governed.grant",
            claims.id.as_str(),
            "minted",
            grant_detail(&claims, env),
        );
        if claims.confirm {
            let Some(run) = run else {
                return ToolOutput::error(
                    "not run: it needs a person's approval and there is no run to ask in",
                );
            };
            let ask = skiff_agent::approval::Ask {
                tool: name.to_owned(),
                kind: ApprovalKind::Call,
                subject: plan.subject(),
                reason: Some(format!("grant {}", claims.id)),
            };
            if let Err(message) = self
                .ask_approval(scope, session, run, &ask, "agent", cancel)
                .await
            {
                self.audit(
                    scope,
                    "governed.refused",
                    claims.id.as_str(),
                    "denied",
                    grant_detail(&claims, env),
                );
                return ToolOutput::error(message);
            }
        }
        self.governed_execute(scope, session, &token, &plan, cancel)
            .await
    }

    /// The governed wrapper: runs `plan` only under a grant that verifies, is this session's,
    /// has not been used and covers exactly `plan`. Refusals are audited.
    pub(crate) async fn governed_execute(
        &self,
        scope: &Scope,
        session: &SessionId,
        token: &str,
        plan: &Plan,
        cancel: &CancellationToken,
    ) -> ToolOutput {
        let capability = plan.capability();
        let redeemed = grant::redeem(
            &*self.store,
            &self.governed.key,
            scope,
            session,
            capability,
            token,
            &plan.digest(),
            self.governed.now(),
        );
        let claims = match redeemed {
            Ok(claims) => claims,
            Err(refusal) => {
                self.audit_refusal(scope, session, capability, &refusal);
                return ToolOutput::error(format!("not run: {refusal}"));
            }
        };
        let Some(forge) = &self.governed.forge else {
            return ToolOutput::error("not run: governed actions are off ([forge] is absent)");
        };
        let secret = match self.forge_token(forge) {
            Ok(s) => s,
            Err(message) => {
                self.audit_execution(scope, &claims, "failed", "credential");
                return ToolOutput::error(format!("not run: {message}"));
            }
        };
        let result = match plan {
            Plan::GitPush {
                repository_dir,
                remote,
                branch,
            } => {
                // A `[git.credentials]` entry for the remote's URL wins over the forge token:
                // it is the credential the operator gave for exactly that repository.
                let credential = match push::remote_url(repository_dir, remote, cancel).await {
                    Ok(url) => self.git_credentials.resolve(&url, &self.vault),
                    Err(_) => Ok(None),
                };
                match credential {
                    Ok(credential) => push::push(
                        repository_dir,
                        remote,
                        branch,
                        push::Credential::pick(credential.as_ref(), &secret),
                        &claims.id,
                        cancel,
                    )
                    .await
                    .map(|r| serde_json::to_string(&r).unwrap_or_default()),
                    Err(e) => Err(e.to_string()),
                }
            }
            Plan::OpenPullRequest {
                repository,
                title,
                body,
                head,
                base,
            } => forge::open_pull_request(
                &forge.api,
                &secret,
                repository,
                forge::PullRequest {
                    title,
                    body,
                    head,
                    base,
                },
                &claims.id,
            )
            .await
            .map(|r| serde_json::to_string(&r).unwrap_or_default()),
        };
        match result {
            Ok(text) => {
                self.audit_execution(scope, &claims, "applied", "ok");
                ToolOutput::ok(text)
            }
            Err(message) => {
                self.audit_execution(scope, &claims, "failed", "error");
                ToolOutput::error(bounded(&scrub(&message, &secret)))
            }
        }
    }

    /// The forge token, read now; empty when `[forge]` names none.
    fn forge_token(&self, forge: &ForgeDef) -> Result<String, String> {
        let Some(token) = &forge.token else {
            return Ok(String::new());
        };
        match token {
            Source::Literal(text) => Ok(text.clone()),
            Source::Env(var) => std::env::var(var).map_err(|_| {
                format!("`forge.token` names the environment variable {var}, which is not set")
            }),
            Source::Vault(name) => self
                .vault
                .open(name)
                .map_err(|e| format!("`forge.token` names the vault secret {name}: {e}")),
        }
    }

    fn audit_refusal(
        &self,
        scope: &Scope,
        session: &SessionId,
        capability: Capability,
        refusal: &Refusal,
    ) {
        let target = refusal
            .grant()
            .map_or_else(|| session.as_str().to_owned(), |g| g.as_str().to_owned());
        self.audit(
            scope,
            "governed.refused",
            &target,
            "refused",
            json!({
                "session": session.as_str(),
                "capability": capability.as_str(),
                "reason": refusal.code(),
            }),
        );
    }

    fn audit_execution(&self, scope: &Scope, claims: &GrantClaims, decision: &str, status: &str) {
        let mut detail = grant_detail(claims, None);
        detail["status"] = json!(status);
        self.audit(
            scope,
            "governed.execute",
            claims.id.as_str(),
            decision,
            detail,
        );
    }

    /// Resolves what a call would run, or says why it cannot.
    async fn plan(
        &self,
        scope: &Scope,
        session: &SessionId,
        forge: &ForgeDef,
        name: &str,
        arguments: &serde_json::Value,
        cancel: &CancellationToken,
    ) -> Result<Plan, String> {
        let row = self
            .store
            .session(scope, session)
            .map_err(|e| e.to_string())?;
        let WorkspaceView::Git { source, branch, .. } = &row.workspace else {
            return Err(format!(
                "{name} needs a session on a git repository; session {session} works on a plain directory"
            ));
        };
        let arguments = if arguments.is_null() {
            &json!({})
        } else {
            arguments
        };
        match name {
            GIT_PUSH => {
                let args: PushArgs = serde_json::from_value(arguments.clone())
                    .map_err(|e| format!("invalid arguments for {GIT_PUSH}: {e}"))?;
                if let Some(asked) = &args.branch
                    && asked.trim_start_matches("refs/heads/") != branch
                {
                    return Err(format!(
                        "{GIT_PUSH} pushes only the session branch {branch}, never {asked}"
                    ));
                }
                push::check_remote(source, &forge.remote, cancel).await?;
                Ok(Plan::GitPush {
                    repository_dir: source.clone(),
                    remote: forge.remote.clone(),
                    branch: branch.clone(),
                })
            }
            OPEN_PULL_REQUEST => {
                let args: PullArgs = serde_json::from_value(arguments.clone())
                    .map_err(|e| format!("invalid arguments for {OPEN_PULL_REQUEST}: {e}"))?;
                if args.title.trim().is_empty() {
                    return Err(format!("{OPEN_PULL_REQUEST} needs a title"));
                }
                if forge.token.is_none() {
                    return Err(format!(
                        "{OPEN_PULL_REQUEST} needs the forge's API token: set `[forge] token = \"vault:NAME\"` in skiff.toml"
                    ));
                }
                let repository = match &forge.repository {
                    Some(r) => r.clone(),
                    None => {
                        let url = push::remote_url(source, &forge.remote, cancel).await?;
                        forge::repository_of_url(&url).ok_or_else(|| {
                            format!(
                                "the remote {} ({url}) names no OWNER/REPO; set [forge] repository in skiff.toml",
                                forge.remote
                            )
                        })?
                    }
                };
                let base = match args.base {
                    Some(b) => b,
                    None => {
                        let secret = self.forge_token(forge)?;
                        forge::default_branch(&forge.api, &secret, &repository)
                            .await
                            .map_err(|e| bounded(&scrub(&e, &secret)))?
                    }
                };
                Ok(Plan::OpenPullRequest {
                    repository,
                    title: args.title,
                    body: args.body,
                    head: branch.clone(),
                    base,
                })
            }
            other => Err(format!("{other} is not a governed action")),
        }
    }
}

fn grant_detail(
    claims: &GrantClaims,
    env: Option<&skiff_protocol::EnvironmentId>,
) -> serde_json::Value {
    json!({
        "session": claims.session.as_str(),
        "capability": claims.capability.as_str(),
        "target": claims.target,
        "policy_revision": claims.policy_revision,
        "confirm": claims.confirm,
        "expires_at_ms": claims.expires_at_ms,
        "env": env.map(|e| e.as_str()),
    })
}

/// `text` without any occurrence of `secret`.
fn scrub(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        text.to_owned()
    } else {
        text.replace(secret, "[redacted]")
    }
}

fn bounded(text: &str) -> String {
    if text.len() <= MAX_MESSAGE_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}[… cut …]", &text[..end])
}

#[cfg(test)]
mod tests;
