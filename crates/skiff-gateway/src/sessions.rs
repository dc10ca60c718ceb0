//! Sessions and their runs: creating a session (workspace first, then rows), admitting a turn,
//! executing it with the agent loop in this process (placement `local`), and cancelling it.

use crate::backend::{CatalogClient, StoreBackend};
use crate::error::{Error, Result};
use crate::{Core, workspace};
use serde_json::json;
use skiff_agent::tools::Tools;
use skiff_agent::{AgentConfig, TurnOutcome, run_turn};
use skiff_llm::Catalog;
use skiff_protocol::api::{
    AttemptView, CreateSessionRequest, RunStarted, RunStatus, RunView, SessionDetail, SessionList,
    SessionView, UsageTotals, WorkspaceView,
};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{ModelRef, ReasoningEffort};
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::{RunId, SessionId};
use skiff_store::{AttemptStatus, NewSession, RunRow, Scope, SessionRow};
use std::path::Path;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) const MAX_STEPS: usize = 50;
pub(crate) const MAX_OUTPUT_TOKENS: u32 = 8192;
const MAX_PROMPT_BYTES: usize = 256 * 1024;

/// The longest a turn may run, and the setting that says so.
struct TurnDeadline {
    limit: std::time::Duration,
    key: String,
}

impl TurnDeadline {
    fn reason(&self) -> String {
        format!(
            "the turn ran longer than its time limit ({}, set by `{}` in skiff.toml) and was stopped; what it did until then is kept",
            humantime::format_duration(self.limit),
            self.key
        )
    }
}

pub(crate) fn title_of(prompt: &str) -> String {
    let line = prompt
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    if line.chars().count() > 72 {
        format!("{}…", line.chars().take(71).collect::<String>())
    } else {
        line.to_owned()
    }
}

fn user_message(prompt: &str) -> EntryBody {
    EntryBody::UserMessage {
        text: prompt.to_owned(),
    }
}

pub(crate) fn check_prompt(prompt: &str) -> Result<()> {
    if prompt.trim().is_empty() {
        return Err(Error::BadRequest(
            "the prompt is empty; say what the agent should do".into(),
        ));
    }
    if prompt.len() > MAX_PROMPT_BYTES {
        return Err(Error::BadRequest(format!(
            "the prompt is {} bytes; the limit is {MAX_PROMPT_BYTES}",
            prompt.len()
        )));
    }
    Ok(())
}

/// `run` for the API, its cost at the prices `catalog` has for its model today.
pub(crate) fn run_view(run: &RunRow, catalog: &Catalog) -> RunView {
    let cost_usd = ModelRef::parse(&run.model_ref)
        .and_then(|model| catalog.prices(&model))
        .map(|prices| prices.cost_usd(&run.usage));
    RunView {
        id: run.id.clone(),
        session_id: run.session_id.clone(),
        status: run.status,
        model: run.model_ref.clone(),
        error: run.error.clone(),
        created_at_ms: run.created_at_ms,
        finished_at_ms: run.finished_at_ms,
        input_tokens: run.usage.input_tokens,
        output_tokens: run.usage.output_tokens,
        cache_read_tokens: run.usage.cache_read_tokens,
        cache_write_tokens: run.usage.cache_write_tokens,
        cost_usd,
    }
}

/// The runs added up; a cost only when every run has one (a partial sum would read as the
/// whole).
fn totals(runs: &[RunView]) -> UsageTotals {
    let mut totals = UsageTotals {
        cost_usd: Some(0.0),
        ..UsageTotals::default()
    };
    for run in runs {
        totals.input_tokens += run.input_tokens;
        totals.output_tokens += run.output_tokens;
        totals.cache_read_tokens += run.cache_read_tokens;
        totals.cache_write_tokens += run.cache_write_tokens;
        totals.cost_usd = totals.cost_usd.zip(run.cost_usd).map(|(a, b)| a + b);
    }
    totals
}

/// A spec switch refused because turn `run` is still running.
fn switch_while_running(id: &SessionId, run: &RunId) -> Error {
    Error::Conflict(format!(
        "session {id} is running turn {run}: its agent spec changes only between turns; send again when the turn ends, or cancel it first"
    ))
}

/// What a message to an existing session carries (`POST /v1/sessions/{id}/messages`).
#[derive(Default)]
pub(crate) struct Message<'a> {
    pub(crate) prompt: &'a str,
    /// Dispatch to (or stay on) this worker profile.
    pub(crate) profile: Option<&'a str>,
    pub(crate) reasoning: Option<ReasoningEffort>,
    pub(crate) approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    /// `NAME` or `NAME@DIGEST`: the spec the session switches to at this turn boundary.
    pub(crate) agent: Option<&'a str>,
}

/// What an admitted turn makes the session's from then on.
#[derive(Default)]
struct TurnChoices {
    reasoning: Option<ReasoningEffort>,
    approval: Option<skiff_protocol::approval::ApprovalPolicy>,
    switch: Option<AgentSwitch>,
    /// The worker slot the turn claims with its run.
    claim: Option<SlotClaim>,
}

/// A worker slot an admitted turn claims (`→ requested`), in the transaction that admits it.
enum SlotClaim {
    /// Dispatch to this profile at the turn boundary: a session never placed, or pulled back.
    Dispatch(String),
    /// Placed again on its profile: its placement (`from`) holds no box (parked, reclaimed,
    /// failed over, failed).
    Again {
        profile: String,
        from: PlacementState,
    },
}

impl SlotClaim {
    fn profile(&self) -> &str {
        match self {
            SlotClaim::Dispatch(profile) => profile,
            SlotClaim::Again { profile, .. } => profile,
        }
    }

    /// What followers are told the claim is.
    fn detail(&self) -> String {
        match self {
            SlotClaim::Dispatch(profile) => {
                format!("dispatching to profile {profile} with this message")
            }
            SlotClaim::Again { profile, from } => {
                format!("claimed a worker slot on profile {profile} (the placement was {from})")
            }
        }
    }
}

impl TurnChoices {
    /// What the session is set to: the message's own choices, else the new spec's; the pin
    /// when it switches.
    fn written(&self) -> skiff_store::SessionChoices<'_> {
        let spec = self.switch.as_ref().map(|s| &s.spec);
        skiff_store::SessionChoices {
            reasoning: self
                .reasoning
                .or_else(|| spec.and_then(|s| s.reasoning))
                .map(ReasoningEffort::as_str),
            approval: self
                .approval
                .as_ref()
                .or_else(|| spec.and_then(|s| s.approval.as_ref())),
            agent: self
                .switch
                .as_ref()
                .map(|s| (s.pin.name.as_str(), s.pin.digest.as_str())),
        }
    }
}

/// A checked switch to another agent spec version.
struct AgentSwitch {
    pin: skiff_protocol::agent::AgentPin,
    spec: skiff_protocol::agent::AgentSpec,
}

impl Core {
    pub(crate) fn session_view(&self, scope: &Scope, row: SessionRow) -> Result<SessionView> {
        let last_run = self.store.runs(scope, &row.id)?.pop();
        let placement = self.store.placement(scope, &row.id)?;
        let agent = self.session_pin(scope, &row.id)?;
        let owner = self.owner_email(&row.owner)?;
        Ok(self.session_view_of(row, placement, last_run.as_ref(), agent, owner))
    }

    /// The email of the user a session belongs to, as lists mixing people show it.
    fn owner_email(&self, owner: &Scope) -> Result<Option<String>> {
        Ok(self.store.user_of(owner)?.map(|u| u.email))
    }

    /// The agent spec version a session is pinned to, if any.
    pub(crate) fn session_pin(
        &self,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<Option<skiff_protocol::agent::AgentPin>> {
        Ok(self
            .store
            .session_agent(scope, id)?
            .map(|(name, digest)| skiff_protocol::agent::AgentPin { name, digest }))
    }

    /// Writes what a switch between turns makes the session's, in one store transaction: the
    /// pin, the reasoning and the approval policy all change or none does.
    fn write_choices(&self, scope: &Scope, id: &SessionId, mut choices: TurnChoices) -> Result<()> {
        let old = self.pin_before_switch(scope, id, &mut choices)?;
        let written = choices.written();
        if written.reasoning.is_none() && written.approval.is_none() && written.agent.is_none() {
            return Ok(());
        }
        self.store.set_session_choices(scope, id, &written)?;
        self.audit_switch(scope, id, old, &choices);
        Ok(())
    }

    /// The pin a switch in `choices` replaces. A switch to the version the session already
    /// runs with is no switch: it is dropped (the spec's settings are not taken again). The
    /// new spec's reasoning and approval become the session's unless the message chose its
    /// own; the session keeps its model.
    fn pin_before_switch(
        &self,
        scope: &Scope,
        id: &SessionId,
        choices: &mut TurnChoices,
    ) -> Result<Option<skiff_protocol::agent::AgentPin>> {
        let Some(switch) = &choices.switch else {
            return Ok(None);
        };
        let old = self.session_pin(scope, id)?;
        if old.as_ref() == Some(&switch.pin) {
            choices.switch = None;
        }
        Ok(old)
    }

    /// A switch written: audited as `session.agent` with both digests.
    fn audit_switch(
        &self,
        scope: &Scope,
        id: &SessionId,
        old: Option<skiff_protocol::agent::AgentPin>,
        choices: &TurnChoices,
    ) {
        if let Some(AgentSwitch { pin, .. }) = &choices.switch {
            self.audit(
                scope,
                "session.agent",
                id.as_str(),
                "allowed",
                json!({
                    "from": old.as_ref().map(|p| p.short()),
                    "from_digest": old.map(|p| p.digest),
                    "agent": pin.short(),
                    "agent_digest": pin.digest,
                }),
            );
        }
    }

    /// The pinned spec a session's turn runs with, checked against its digest.
    pub(crate) fn session_spec(
        &self,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<Option<skiff_protocol::agent::AgentSpec>> {
        match self.session_pin(scope, id)? {
            Some(pin) => Ok(Some(crate::agents::pinned(&*self.store, &pin)?)),
            None => Ok(None),
        }
    }

    fn session_view_of(
        &self,
        row: SessionRow,
        placement: Option<skiff_store::PlacementRow>,
        last_run: Option<&RunRow>,
        agent: Option<skiff_protocol::agent::AgentPin>,
        owner: Option<String>,
    ) -> SessionView {
        let model = ModelRef::parse(&row.model_ref)
            .map(|m| self.catalog.describe(&m))
            .unwrap_or_else(|| skiff_protocol::api::ModelView {
                model_ref: row.model_ref.clone(),
                scripted: false,
                label: row.model_ref.clone(),
                prices: None,
            });
        let worker = placement.map(|p| skiff_protocol::api::WorkerPlacementView {
            profile: p.profile,
            environment_id: p.environment_id,
            owner_epoch: p.owner_epoch,
            error: p.error,
            left_out: p.left_out,
        });
        SessionView {
            id: row.id,
            title: row.title,
            workspace: row.workspace,
            model,
            worker,
            placement: row.placement,
            parent_id: row.parent_id,
            group_id: row.group_id,
            reasoning: row.reasoning.as_deref().and_then(ReasoningEffort::parse),
            approval: row.approval,
            agent,
            owner,
            created_at_ms: row.created_at_ms,
            updated_at_ms: row.updated_at_ms,
            last_run: last_run.map(|r| run_view(r, &self.catalog)),
        }
    }

    /// A page of the session list (one query), most recently active first, after session
    /// `after` when given; `next` names the page's last session when more may follow.
    pub(crate) fn list_page(
        &self,
        sight: &skiff_store::Sight,
        limit: usize,
        after: Option<&SessionId>,
    ) -> Result<SessionList> {
        // One more than asked says whether another page follows.
        let mut rows = self.store.session_page(sight, limit + 1, after)?;
        let mut emails = std::collections::HashMap::new();
        let more = rows.len() > limit;
        rows.truncate(limit);
        let sessions: Vec<SessionView> = rows
            .into_iter()
            .map(|r| {
                let owner = &r.session.owner;
                // In the page's own query: no lookup per session.
                let agent = r
                    .agent
                    .map(|(name, digest)| skiff_protocol::agent::AgentPin { name, digest });
                let email = match emails.get(&owner.owner_id) {
                    Some(email) => Option::clone(email),
                    None => {
                        let email = self.owner_email(owner)?;
                        emails.insert(owner.owner_id.clone(), email.clone());
                        email
                    }
                };
                Ok(self.session_view_of(r.session, r.placement, r.last_run.as_ref(), agent, email))
            })
            .collect::<Result<_>>()?;
        let next = more
            .then(|| sessions.last().map(|s| s.id.clone()))
            .flatten();
        Ok(SessionList { sessions, next })
    }

    pub(crate) fn detail(&self, scope: &Scope, id: &SessionId) -> Result<SessionDetail> {
        let row = self.store.session(scope, id)?;
        let runs: Vec<RunView> = self
            .store
            .runs(scope, id)?
            .iter()
            .map(|r| run_view(r, &self.catalog))
            .collect();
        let totals = totals(&runs);
        let transcript = self.store.transcript(scope, id)?;
        let attempts = self.attempt_views(scope, id)?;
        let group = match &row.group_id {
            Some(group) => Some(skiff_protocol::api::GroupPick {
                id: group.clone(),
                picked: self.store.group(scope, group)?.picked,
            }),
            None => None,
        };
        let usage = self.usage_lines(scope, id)?;
        Ok(SessionDetail {
            session: self.session_view(scope, row)?,
            runs,
            totals,
            transcript,
            attempts,
            group,
            usage,
        })
    }

    fn attempt_views(&self, scope: &Scope, id: &SessionId) -> Result<Vec<AttemptView>> {
        let checkpoints = self
            .store
            .artifacts(scope, id, skiff_store::ArtifactRole::Checkpoint)?;
        let seq_of = |artifact: &str| {
            checkpoints
                .iter()
                .find(|c| c.id.as_str() == artifact)
                .and_then(|c| c.seq)
        };
        Ok(self
            .store
            .attempts(scope, id)?
            .into_iter()
            .map(|a| AttemptView {
                from_checkpoint: a.checkpoint_artifact_id.as_deref().and_then(seq_of),
                id: a.id,
                run_id: a.run_id,
                node: a.runtime_node,
                owner_epoch: u64::try_from(a.owner_epoch).unwrap_or(0),
                status: a.status,
                resumed_from: a.resume_from,
                error: a.error,
                started_at_ms: a.started_at_ms,
                finished_at_ms: a.finished_at_ms,
            })
            .collect())
    }

    /// Creates a session with its own workspace and starts its first run.
    pub(crate) async fn create_session(
        self: &Arc<Self>,
        scope: &Scope,
        req: CreateSessionRequest,
    ) -> Result<RunStarted> {
        check_prompt(&req.prompt)?;
        if let Some(policy) = &req.approval {
            crate::approvals::compile(policy, "approval").map_err(Error::BadRequest)?;
        }
        if req.attempts.is_some() {
            return Err(Error::Internal(
                "a fan-out request reached the one-session path".into(),
            ));
        }
        if let Some(profile) = &req.profile {
            self.check_profile(profile)?;
            // The quick answer when every slot has a turn running (a session merely idle on
            // its box is parked to make room).
            self.workers.make_worker_room().await?;
        }
        // The agent spec next (the request's, else the profile's): it may choose the model.
        let agent_ref = match (&req.agent, &req.profile) {
            (Some(agent), _) => Some(agent.clone()),
            (None, Some(profile)) => self.envs.profile_config(profile)?.agent.clone(),
            (None, None) => None,
        };
        let agent = match &agent_ref {
            Some(reference) => {
                self.agents.sync(&*self.store)?;
                Some(crate::agents::resolve(&*self.store, reference)?)
            }
            None => None,
        };
        let spec = agent.as_ref().map(|(_, spec)| spec);
        let approval = req
            .approval
            .clone()
            .or_else(|| spec.and_then(|s| s.approval.clone()));
        let reasoning = req.reasoning.or_else(|| spec.and_then(|s| s.reasoning));
        // Resolve the model before touching the disk: a typo must not leave a worktree behind.
        let model = self.catalog.resolve(
            req.model
                .as_deref()
                .or_else(|| spec.and_then(|s| s.model.as_deref())),
        )?;
        let id = SessionId::from_suffix(&skiff_store::mint()?);
        let (workspace, fill) = match &req.repo {
            Some(_) if !req.workspace.is_empty() => {
                return Err(Error::BadRequest(
                    "give either a workspace on the gateway host or a repo URL, not both".into(),
                ));
            }
            Some(repo) => {
                let fetched = crate::remote::fetch(
                    &repo.url,
                    repo.git_ref.as_deref(),
                    &self.git_credentials,
                    &self.vault,
                    &self.state,
                    &scope.tenant_id,
                    id.as_str(),
                )
                .await?;
                let (mut view, fill) = workspace::remote_worktree_deferred(
                    &fetched.mirror,
                    &fetched.commit,
                    &id,
                    &self.state,
                )
                .await?;
                // People know the session by the URL they gave, not by the gateway's mirror.
                if let WorkspaceView::Git { remote, .. } = &mut view {
                    *remote = Some(repo.url.clone());
                }
                (view, Some(fill))
            }
            None => {
                let source = Path::new(&req.workspace);
                if !source.is_absolute() {
                    return Err(Error::BadRequest(format!(
                        "workspace {} must be an absolute path on the gateway host",
                        req.workspace
                    )));
                }
                workspace::prepare_deferred(source, &id, &self.state).await?
            }
        };
        // The worktree's files are written in the background: recorded first (a restart
        // writes them again), and waited for by everything that touches the workspace from
        // before anyone can see the session.
        let filling = match &fill {
            Some(fill) => {
                if let Err(e) = fill.record(&self.state, &scope.owner_id, &scope.tenant_id) {
                    workspace::discard(&workspace).await;
                    return Err(e.into());
                }
                Some(self.fills.begin(&id, &fill.tree))
            }
            None => None,
        };
        // The worker slot is claimed with the session row, after the slow workspace step:
        // the check above is only the quick answer when the gateway is plainly full.
        let new = NewSession {
            id: id.clone(),
            title: title_of(&req.prompt),
            workspace: workspace.clone(),
            model_ref: model.to_string(),
        };
        let created = match req.profile.as_deref() {
            Some(profile) => {
                self.workers
                    .claim_worker_slot(|max| {
                        self.store
                            .create_session_placed(scope, &new, Some((profile, max)))
                    })
                    .await
            }
            None => self.store.create_session(scope, &new).map_err(Into::into),
        };
        let created = match (created, &approval) {
            (Ok(_), Some(policy)) => self
                .store
                .set_session_approval(scope, &id, policy)
                .map_err(Into::into),
            (created, _) => created,
        };
        let created = match (created, &agent) {
            (Ok(row), Some((pin, _))) => self
                .store
                .pin_session_agent(scope, &id, &pin.name, &pin.digest)
                .map(|()| row)
                .map_err(Into::into),
            (created, _) => created,
        };
        let created = match (created, reasoning) {
            (Ok(_), Some(effort)) => self
                .store
                .set_session_reasoning(scope, &id, Some(effort.as_str()))
                .map_err(Into::into),
            (created, _) => created,
        };
        if let Err(e) = created {
            if filling.is_some() {
                self.fills.finished(&id);
                workspace::Fill::forget(&self.state, id.as_str());
            }
            workspace::discard(&workspace).await;
            return Err(e);
        }
        self.audit(scope, "session.create", id.as_str(), "allowed", json!({
            "workspace_kind": match workspace { WorkspaceView::Git { remote: Some(_), .. } => "remote", WorkspaceView::Git { .. } => "git", _ => "plain" },
            "model": model.as_str(),
            "profile": req.profile,
            "reasoning": reasoning,
            "agent": agent.as_ref().map(|(pin, _)| pin.short()),
            "agent_digest": agent.as_ref().map(|(pin, _)| pin.digest.clone()),
            "approval": approval.as_ref().map(|p| match p {
                skiff_protocol::approval::ApprovalPolicy::Rules(_) => "rules",
                skiff_protocol::approval::ApprovalPolicy::OnRequest => "on-request",
                skiff_protocol::approval::ApprovalPolicy::Never => "never",
            }),
        }));
        // The slot claimed with the session's rows is its first move, as followers see it.
        if let Some(profile) = &req.profile {
            self.workers.publish_claim(
                scope,
                &id,
                &format!("claimed a worker slot on profile {profile} for the new session"),
            );
        }
        // Before the first turn can change anything: what `diff` and `apply` compare with.
        match (fill, filling) {
            (Some(fill), Some(done)) => {
                let (core, scope) = (self.clone(), scope.clone());
                let (id, workspace) = (id.clone(), workspace.clone());
                tokio::spawn(async move {
                    core.complete_fill(&scope, &id, &workspace, &fill, done)
                        .await;
                });
            }
            _ => self.record_base(scope, &id, &workspace).await,
        }
        self.start_run(scope, &id, &req.prompt).await
    }

    /// Writes a new session's worktree, then records what it starts from, and only then lets
    /// whatever waits for the workspace go on.
    async fn complete_fill(
        &self,
        scope: &Scope,
        id: &SessionId,
        view: &skiff_protocol::api::WorkspaceView,
        fill: &workspace::Fill,
        done: tokio::sync::watch::Sender<Option<std::result::Result<(), String>>>,
    ) {
        let result = fill.run().await.map_err(|e| e.to_string());
        match &result {
            Ok(()) => {
                // A lay-down onto a box lists and hashes the files meanwhile: it only reads.
                self.fills.files_written(id);
                self.record_base(scope, id, view).await;
                workspace::Fill::forget(&self.state, id.as_str());
                self.fills.finished(id);
            }
            // Recorded still: the next start writes it again.
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "could not write a session's worktree")
            }
        }
        let _ = done.send(Some(result));
    }

    /// Writes again every worktree a previous gateway was filling when it stopped, whole,
    /// and records what its session starts from; a worktree whose session was never created
    /// is removed.
    pub(crate) async fn recover_fills(&self) {
        for record in workspace::Fill::unfinished(&self.state) {
            let scope = Scope::new(record.owner_id.clone(), record.tenant_id.clone());
            let fill = &record.fill;
            let session =
                SessionId::parse(&fill.session).and_then(|id| self.store.session(&scope, &id).ok());
            let Some(session) = session else {
                tracing::warn!(session = %fill.session, "removing the worktree of a session that was never created");
                workspace::discard(&fill.view()).await;
                workspace::Fill::forget(&self.state, &fill.session);
                continue;
            };
            match fill.rerun().await {
                Ok(()) => {
                    tracing::warn!(session = %session.id, "wrote again the worktree a stopped gateway was filling");
                    if self.base_row(&scope, &session.id).ok().flatten().is_none() {
                        self.record_base(&scope, &session.id, &session.workspace)
                            .await;
                    }
                    workspace::Fill::forget(&self.state, &fill.session);
                }
                Err(e) => {
                    tracing::warn!(session = %session.id, error = %e, "could not write again a worktree a stopped gateway was filling");
                    let done = self.fills.begin(&session.id, &fill.tree);
                    let _ = done.send(Some(Err(e.to_string())));
                }
            }
        }
    }

    /// Waits until the session's worktree is filled (at once when it is). Everything that
    /// reads or writes a session's workspace calls it first.
    pub(crate) async fn workspace_ready(&self, id: &SessionId) -> Result<()> {
        workspace_ready(&self.fills, id).await
    }

    /// Admits a new turn on an existing session.
    pub(crate) async fn send(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        message: Message<'_>,
    ) -> Result<RunStarted> {
        let Message {
            prompt,
            profile,
            reasoning,
            approval,
            agent,
        } = message;
        check_prompt(prompt)?;
        if let Some(policy) = &approval {
            crate::approvals::compile(policy, "approval").map_err(Error::BadRequest)?;
        }
        // Not found is said about the session, before anything is claimed for it.
        self.store.session(scope, id)?;
        // A spec switch is checked whole before anything changes: an unknown name or digest
        // and a turn still running are refused with the session as it was.
        let switch = match agent {
            Some(reference) => {
                self.agents.sync(&*self.store)?;
                let (pin, spec) = crate::agents::resolve(&*self.store, reference)?;
                if let Some(run) = self.store.open_run(scope, id)? {
                    return Err(switch_while_running(id, &run.id));
                }
                Some(AgentSwitch { pin, spec })
            }
            None => None,
        };
        // Held until the turn is admitted: a pull-back or dispatch under way finishes first,
        // and the placement read here is the one the turn runs under.
        let admission = self.workers.live(id).admission.clone().lock_owned().await;
        let placement = self.store.placement(scope, id)?;
        // A worker slot the turn claims with its run (parking a session idle on its box if
        // that is what it takes): a gateway whose every slot runs a turn refuses at once
        // (503) rather than admitting a run that then fails, and a refused turn claims
        // nothing.
        let mut claim = None;
        if let Some(profile) = profile {
            self.check_profile(profile)?;
            match &placement {
                Some(p) if p.state != PlacementState::Local => {
                    if p.profile != profile {
                        return Err(crate::worker::moving_profiles(id, &p.profile, profile));
                    }
                }
                // Dispatch at the turn boundary (a session never placed, or pulled back).
                _ => claim = Some(SlotClaim::Dispatch(profile.to_owned())),
            }
        }
        if claim.is_none()
            && let Some(p) = placement.filter(|p| {
                matches!(
                    p.state,
                    PlacementState::Parked
                        | PlacementState::Reclaimed
                        | PlacementState::FailedOver
                        | PlacementState::Failed
                )
            })
        {
            // The next message places it again.
            claim = Some(SlotClaim::Again {
                profile: p.profile,
                from: p.state,
            });
        }
        let choices = TurnChoices {
            reasoning,
            approval,
            switch,
            claim,
        };
        self.admit_turn(scope, id, user_message(prompt), choices, admission)
            .await
    }

    /// Switches a session to another agent spec version between turns, with no turn (`session
    /// send --agent` without a prompt): checked whole first, then applied under the admission
    /// lock, so no turn is admitted halfway. Refused (409) while a turn runs.
    pub(crate) async fn switch_agent_between_turns(
        &self,
        scope: &Scope,
        id: &SessionId,
        reference: &str,
    ) -> Result<SessionView> {
        // Not found is said about the session first.
        self.store.session(scope, id)?;
        self.agents.sync(&*self.store)?;
        let (pin, spec) = crate::agents::resolve(&*self.store, reference)?;
        let admission = self.workers.live(id).admission.clone().lock_owned().await;
        if let Some(run) = self.store.open_run(scope, id)? {
            return Err(switch_while_running(id, &run.id));
        }
        let choices = TurnChoices {
            switch: Some(AgentSwitch { pin, spec }),
            ..TurnChoices::default()
        };
        self.write_choices(scope, id, choices)?;
        drop(admission);
        let row = self.store.session(scope, id)?;
        self.session_view(scope, row)
    }

    pub(crate) fn check_profile(&self, profile: &str) -> Result<()> {
        check_profile(&self.envs, profile)
    }

    async fn start_run(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        prompt: &str,
    ) -> Result<RunStarted> {
        self.start_run_with(scope, id, user_message(prompt)).await
    }

    /// Admits a turn that starts with `first` (the user's message; a notice for a retried
    /// turn) and runs it where the session is placed.
    pub(crate) async fn start_run_with(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        first: EntryBody,
    ) -> Result<RunStarted> {
        let admission = self.workers.live(id).admission.clone().lock_owned().await;
        self.admit_turn(scope, id, first, TurnChoices::default(), admission)
            .await
    }

    /// Admits the turn under the session's `admission` lock (released once the run exists and
    /// the placement it runs under is read) and starts it. What `choices` carries becomes the
    /// session's from this turn on.
    async fn admit_turn(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
        first: EntryBody,
        mut choices: TurnChoices,
        admission: tokio::sync::OwnedMutexGuard<()>,
    ) -> Result<RunStarted> {
        let model_ref = self.store.session(scope, id)?.model_ref;
        // The session's live work becomes this gateway's first: every write of the turn is
        // fenced by the lease, and a session another gateway is running is refused here.
        let lost = self.own_session(id)?;
        let old_pin = match self.pin_before_switch(scope, id, &mut choices) {
            Ok(pin) => pin,
            Err(e) => {
                self.disown_if_idle(scope, id);
                return Err(e);
            }
        };
        // Admission first: only the admitted turn may write the user's message. Its run, its
        // choices and the worker slot it claims are written together: a refused message
        // leaves the session, its placement and the slots as they were.
        let run = match self
            .admit_run(
                scope,
                id,
                &model_ref,
                choices.written(),
                choices.claim.as_ref().map(SlotClaim::profile),
            )
            .await
        {
            Ok(run) => run,
            Err(e) => {
                self.disown_if_idle(scope, id);
                return Err(e);
            }
        };
        self.audit_switch(scope, id, old_pin, &choices);
        if let Some(claim) = &choices.claim {
            if let SlotClaim::Dispatch(profile) = claim {
                self.workers.dispatched(scope, id, profile);
            }
            self.workers.publish_claim(scope, id, &claim.detail());
        }
        // Read after admission, so a move claimed before it is seen (one claimed after it
        // finds the run open and refuses or cancels it).
        let session = self.store.session(scope, id)?;
        drop(admission);
        // The status goes out first, as followers expect; the first entry follows at the
        // leaf (re-read if a notice landed in between). A turn that cannot begin ends failed:
        // left open, it would refuse every later message to the session.
        let begun = self
            .hub
            .publish(
                scope,
                id,
                Some(&run.id),
                EventKind::RunStatus {
                    status: RunStatus::Queued,
                    error: None,
                },
            )
            .and_then(|_| self.append_at_leaf(scope, id, Some(&run.id), &[first]));
        if let Err(e) = begun {
            self.finish(
                scope,
                id,
                &run.id,
                RunStatus::Failed,
                Some("the turn could not be started: its message could not be recorded"),
            );
            return Err(e.into());
        }
        self.audit(scope, "run.start", run.id.as_str(), "allowed", {
            // The turn is admitted: a pin that cannot be read fails its turn later, not
            // this audit row.
            let pin = self.session_pin(scope, id).ok().flatten();
            json!({
                "session": id.as_str(),
                "agent": pin.as_ref().map(|p| p.short()),
                "agent_digest": pin.map(|p| p.digest),
            })
        });

        self.spawn_turn(scope, session, run.clone(), &lost);
        let session = self.store.session(scope, id)?;
        Ok(RunStarted {
            session: self.session_view(scope, session)?,
            run: run_view(&run, &self.catalog),
        })
    }

    /// Runs the turn of `run` in a task of its own, stopped when the session's lease is
    /// `lost`; the lease is let go when the turn is over.
    pub(crate) fn spawn_turn(
        self: &Arc<Self>,
        scope: &Scope,
        session: SessionRow,
        run: RunRow,
        lost: &CancellationToken,
    ) {
        let cancel = lost.child_token();
        self.running_lock().insert(run.id.clone(), cancel.clone());
        // A cancel through another gateway reaches this turn as the run's status.
        let watch = self.watch_for_cancel(scope, &session.id, &run.id, &cancel);
        let core = self.clone();
        let (scope2, run2) = (scope.clone(), run);
        tokio::spawn(async move {
            let _watch = watch;
            let (run_id, session_id) = (run2.id.clone(), session.id.clone());
            let turn = tokio::spawn({
                let (core, scope) = (core.clone(), scope2.clone());
                async move { core.execute(scope, session, run2, cancel).await }
            });
            // A turn that panicked must not leave its session blocked on an open run.
            if let Err(e) = turn.await {
                let why = format!("the turn crashed inside the gateway: {e}");
                core.finish(&scope2, &session_id, &run_id, RunStatus::Failed, Some(&why));
            }
            core.running_lock().remove(&run_id);
            core.disown(&session_id);
        });
    }

    /// Asks the session's unfinished run to stop. The model call and any running tool stop
    /// within moments; the run then ends `cancelled`.
    pub(crate) fn cancel(&self, scope: &Scope, id: &SessionId) -> Result<RunView> {
        // Another scope's session is "not found", never "has no running turn".
        self.store.session(scope, id)?;
        let Some(run) = self.store.open_run(scope, id)? else {
            return Err(Error::Conflict(format!(
                "session {id} has no running turn to cancel"
            )));
        };
        let token = self.running_lock().get(&run.id).cloned();
        // Stop the work first: whatever state the run is recorded in, nothing more should run.
        if let Some(token) = &token {
            token.cancel();
        }
        let run = if run.status == RunStatus::Cancelling {
            run
        } else {
            self.set_run_status(scope, id, &run.id, RunStatus::Cancelling, None)?
        };
        self.audit(
            scope,
            "run.cancel",
            run.id.as_str(),
            "allowed",
            json!({ "session": id.as_str() }),
        );
        self.cancel_children(scope, id);
        self.revoke_approvals(scope, id, "the turn was cancelled");
        // No task owns it (it never started): finish it here. Otherwise the task ends it —
        // also when it runs on another gateway, which learns of the cancel from the status.
        if token.is_none() && !self.cluster.owns_elsewhere(id) {
            self.finish(scope, id, &run.id, RunStatus::Cancelled, None);
        }
        Ok(run_view(&self.store.run(scope, &run.id)?, &self.catalog))
    }

    async fn execute(
        self: &Arc<Self>,
        scope: Scope,
        session: SessionRow,
        run: RunRow,
        cancel: CancellationToken,
    ) {
        let deadline = self.turn_deadline(&scope, &session);
        let work = self.prepare_and_run(&scope, &session, &run, &cancel);
        tokio::pin!(work);
        // Past its deadline a turn is stopped the way a cancel stops it (model call and tools
        // end, a worker's work is reconciled), then recorded `timed_out` with the reason.
        let mut timed_out = None;
        let outcome = tokio::select! {
            outcome = &mut work => outcome,
            () = tokio::time::sleep(deadline.limit) => {
                timed_out = Some(deadline.reason());
                cancel.cancel();
                work.await
            }
        };
        // Where the turn's last attempt ran (a live move may have taken it elsewhere).
        let (outcome, ended_here) = match outcome {
            Ok((outcome, here)) => (Ok(outcome), here),
            Err(e) => (Err(e), session.placement == PlacementState::Local.as_str()),
        };
        let status = match outcome {
            _ if timed_out.is_some() => (RunStatus::TimedOut, timed_out),
            Ok(TurnOutcome::HandedOff) => (
                RunStatus::Failed,
                Some("the turn stopped for a live move that was not made".to_owned()),
            ),
            // A cancel wins over whatever the turn ended with, errors from racing it included.
            _ if cancel.is_cancelled() => (RunStatus::Cancelled, None),
            Ok(TurnOutcome::Completed) => (RunStatus::Succeeded, None),
            Ok(TurnOutcome::Cancelled) => (RunStatus::Cancelled, None),
            Ok(TurnOutcome::Failed(e)) => (RunStatus::Failed, Some(e)),
            Err(e) => (RunStatus::Failed, Some(e.to_string())),
        };
        // A turn stopped before its end stops the children it dispatched (a cancel through
        // the API has already; a deadline has not).
        if matches!(status.0, RunStatus::Cancelled | RunStatus::TimedOut) {
            self.cancel_children(&scope, &session.id);
        }
        // A gateway that lost the session to another writes nothing more: not the workspace's
        // checkpoint (the new owner's), not the run's end (the new owner's attempt goes on).
        if self.cluster.leases().is_lost(&session.id) {
            tracing::warn!(session = %session.id, run = %run.id, "the turn stopped here: another gateway took the session over");
            return;
        }
        // Worker sessions checkpoint after reconciling each turn (in `turn.finish`).
        if ended_here {
            self.checkpoint_turn(&scope, &session, &run.id, None).await;
        }
        self.finish(&scope, &session.id, &run.id, status.0, status.1.as_deref());
    }

    /// How long this turn may run: its worker profile's `turn_timeout`, else the gateway's.
    fn turn_deadline(&self, scope: &Scope, session: &SessionRow) -> TurnDeadline {
        let profile = match self.store.placement(scope, &session.id) {
            Ok(Some(p)) if session.placement != PlacementState::Local.as_str() => Some(p.profile),
            _ => None,
        };
        match profile.and_then(|name| Some((self.envs.turn_timeout(&name)?, name))) {
            Some((limit, profile)) => TurnDeadline {
                limit,
                key: format!("profiles.{profile}.turn_timeout"),
            },
            None => TurnDeadline {
                limit: self.turn_timeout,
                key: "gateway.turn_timeout".into(),
            },
        }
    }

    /// Runs the turn where the session is placed, and goes on running it wherever a live
    /// move (`--live`) takes it. Returns how it ended and whether its last attempt ran on
    /// the gateway.
    async fn prepare_and_run(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        cancel: &CancellationToken,
    ) -> Result<(TurnOutcome, bool)> {
        let live = self.workers.live(&session.id);
        live.attend();
        let mut here = session.placement == PlacementState::Local.as_str();
        let outcome = self
            .run_and_follow(scope, session, run, cancel, &mut here)
            .await;
        // A move asked for as the turn ended, before its next step, is made at the boundary.
        if let Some(to) = live.leave() {
            self.workers.move_at_boundary(scope, session, to).await;
        }
        outcome.map(|o| (o, here))
    }

    async fn run_and_follow(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        cancel: &CancellationToken,
        here: &mut bool,
    ) -> Result<TurnOutcome> {
        // A run taken over from a gateway that died is already past some of these.
        let passed = |status: RunStatus| match run.status {
            RunStatus::Queued => false,
            RunStatus::Starting => status == RunStatus::Starting,
            _ => true,
        };
        let statuses: &[RunStatus] = if *here {
            &[RunStatus::Starting, RunStatus::Running]
        } else {
            &[RunStatus::Starting]
        };
        for &status in statuses.iter().filter(|&&s| !passed(s)) {
            self.set_run_status(scope, &session.id, &run.id, status, None)?;
        }
        loop {
            let outcome = if *here {
                self.run_turn_here(scope, session, run, cancel).await?
            } else {
                self.workers
                    .run_turn_on_worker(scope, session, run, cancel)
                    .await?
            };
            if outcome != TurnOutcome::HandedOff {
                return Ok(outcome);
            }
            if !*here {
                // The worker was drained, stopped and fenced, and its work brought home.
                *here = true;
                continue;
            }
            // The gateway's loop stopped before its next model call for a live dispatch.
            let Some(crate::worker::Handoff::Profile(profile)) =
                self.workers.live(&session.id).asked()
            else {
                return Err(Error::Internal(
                    "the gateway's loop stopped for a live move nobody asked for".into(),
                ));
            };
            match self
                .workers
                .hand_off_to_box(scope, session, &run.id, &profile, cancel)
                .await
            {
                Ok(()) => *here = false,
                Err(e) => {
                    tracing::warn!(session = %session.id, error = %e, "a live dispatch failed; the turn goes on on the gateway");
                }
            }
        }
    }

    /// One attempt of the run on the gateway's own loop.
    async fn run_turn_here(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        cancel: &CancellationToken,
    ) -> Result<TurnOutcome> {
        let model = ModelRef::parse(&session.model_ref).ok_or_else(|| {
            Error::Internal(format!(
                "session model {} is not a model ref",
                session.model_ref
            ))
        })?;
        let config = AgentConfig {
            model_label: self.catalog.describe(&model).label,
            context_window: self.catalog.settings(&model).context_window,
            model,
            max_steps: MAX_STEPS,
            max_output_tokens: MAX_OUTPUT_TOKENS,
            reasoning: session
                .reasoning
                .as_deref()
                .and_then(ReasoningEffort::parse),
            compact_at: self.compact_at,
            agent_instructions: None,
        };
        // The pinned spec, checked against its digest before every turn.
        let spec = self.session_spec(scope, &session.id)?;
        let config = AgentConfig {
            agent_instructions: spec.as_ref().and_then(|s| s.instructions.clone()),
            ..config
        };
        self.workspace_ready(&session.id).await?;
        let mut tools = Tools::new(session.workspace.path().into(), Vec::new())
            .map_err(|e| {
                Error::Internal(format!(
                    "workspace {} is gone: {e}",
                    session.workspace.path()
                ))
            })?
            .with_ledger(self.procs.clone())
            .with_processes(self.session_processes(&session.id))
            .with_gateway_tools(self.gateway_specs())
            .with_approvals(self.compiled_approvals(scope, session)?);
        if self.local_sandbox {
            let shared = self
                .local_sandbox_paths
                .iter()
                .fold(skiff_process::Sandbox::new(), |sandbox, dir| {
                    sandbox.writable(dir)
                });
            let sandbox =
                skiff_agent::tools::sandbox::with_workspace(shared, tools.workspace().root())
                    .hint(crate::SANDBOX_HINT);
            tools = tools.with_sandbox(sandbox);
        }
        // A child never dispatches children of its own.
        if session.parent_id.is_none() {
            tools = tools.with_dispatch();
        }
        if let Some(allowed) = spec.and_then(|s| s.tools) {
            tools = tools.with_allowlist(allowed);
        }
        let backend = StoreBackend {
            core: self.clone(),
            scope: scope.clone(),
            session: session.id.clone(),
            run: run.id.clone(),
        };
        let attempt = self.start_gateway_attempt(scope, run)?;
        let outcome = run_turn(
            &CatalogClient::for_session(self.clone(), scope, &session.id),
            &backend,
            &tools,
            &config,
            cancel,
        )
        .await;
        let (attempt_status, error) = match (&outcome, cancel.is_cancelled()) {
            (_, true) | (TurnOutcome::Cancelled, _) => (AttemptStatus::Cancelled, None),
            (TurnOutcome::HandedOff, _) => (AttemptStatus::HandedOff, None),
            (TurnOutcome::Completed, _) => (AttemptStatus::Succeeded, None),
            (TurnOutcome::Failed(e), _) => (AttemptStatus::Failed, Some(e.as_str())),
        };
        match self.hub.fence(&session.id) {
            Some(fence) => {
                self.store
                    .finish_attempt_fenced(&fence, scope, &attempt, attempt_status, error)?;
            }
            None => {
                self.store
                    .finish_attempt(scope, &attempt, attempt_status, error)?;
            }
        }
        Ok(outcome)
    }

    /// The session's background-process registry, made at its first gateway turn.
    fn session_processes(&self, session: &SessionId) -> skiff_agent::tools::Processes {
        self.session_processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(session.clone())
            .or_insert_with(skiff_agent::tools::Processes::for_session)
            .clone()
    }

    /// Moves a run to its terminal status and tells subscribers. Cancellation wins over a
    /// late success: a cancelled run goes through `cancelling`.
    fn finish(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        status: RunStatus,
        error: Option<&str>,
    ) {
        let current = self.store.run(scope, run).map(|r| r.status);
        let status = match (current, status) {
            (Ok(RunStatus::Cancelling), RunStatus::Succeeded | RunStatus::TimedOut) => {
                RunStatus::Cancelled
            }
            (Ok(RunStatus::Starting | RunStatus::Running), RunStatus::Cancelled) => {
                if let Err(e) = self.transcript().transition_run(
                    scope,
                    session,
                    run,
                    RunStatus::Cancelling,
                    None,
                ) {
                    tracing::warn!(%run, error = %e, "could not mark the run cancelling");
                }
                RunStatus::Cancelled
            }
            _ => status,
        };
        // Late events of a worker's turn are fenced from here on (cleared before and after
        // the transition: an event checked in between may have cached the run as open).
        self.workers.run_ended(session, run);
        let transitioned = self.set_run_status(scope, session, run, status, error);
        self.workers.run_ended(session, run);
        match transitioned {
            Ok(_) => tracing::info!(%session, %run, %status, "run finished"),
            Err(e) => {
                tracing::warn!(%run, error = %e, "could not record or announce the end of the run");
            }
        }
    }

    /// The cancel token of a run this process is executing.
    pub(crate) fn run_cancel_token(&self, run: &RunId) -> Option<CancellationToken> {
        self.running_lock().get(run).cloned()
    }

    fn running_lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<RunId, CancellationToken>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn audit(
        &self,
        scope: &Scope,
        action: &str,
        target: &str,
        decision: &str,
        detail: serde_json::Value,
    ) {
        audit_row(&*self.store, scope, action, target, decision, detail);
    }
}

/// Waits until the session's worktree is filled (at once when it is), or says why it cannot
/// be.
pub(crate) async fn workspace_ready(fills: &workspace::Fills, id: &SessionId) -> Result<()> {
    fills.ready(id).await.map_err(|e| {
        Error::Unavailable(format!(
            "the workspace of session {id} could not be written: {e}; restarting the gateway writes it again"
        ))
    })
}

/// A profile a session may be placed on, or an error naming the configured ones.
pub(crate) fn check_profile(envs: &crate::environments::Environments, profile: &str) -> Result<()> {
    if envs.profile_views().iter().any(|p| p.name == profile) {
        return Ok(());
    }
    Err(Error::BadRequest(format!(
        "no worker profile `{profile}`; configured profiles: {}. Add a [profiles.{profile}] table to skiff.toml",
        envs.profile_views()
            .iter()
            .map(|p| p.name.clone())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// Writes an audit row as the current actor; a failure is logged, never the caller's.
pub(crate) fn audit_row(
    store: &dyn skiff_store::Backend,
    scope: &Scope,
    action: &str,
    target: &str,
    decision: &str,
    detail: serde_json::Value,
) {
    if let Err(e) = store.audit(
        scope,
        &crate::people::actor(),
        action,
        target,
        decision,
        &detail,
    ) {
        tracing::warn!(action, error = %e, "could not write an audit row");
    }
}
