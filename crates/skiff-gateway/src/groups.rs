//! Fan-out: one prompt started as N sibling sessions (a group, `grp_…`) on N boxes of one
//! worker profile, each from the same base on its own branch; `GET /v1/groups/{id}` compares
//! them (status, diffstat, the last `exec`'s exit code, the final message's first line) and
//! `POST /v1/sessions/{id}/pick` marks one as the group's result and parks the rest (their
//! boxes go back to the pool; the sessions stay readable and can be continued).
//!
//! Capacity is all or nothing: the N worker slots are claimed in the one transaction that
//! writes the group's sessions (`Store::create_group`), so a fan-out never starts with fewer
//! attempts than asked. Deliberately absent: merging attempts, and picking while an attempt
//! still runs a turn (the comparison would not be final).

use crate::error::{Error, Result};
use crate::sessions::{check_prompt, title_of};
use crate::{Core, workspace};
use axum::extract::{Path as AxumPath, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use serde_json::json;
use skiff_protocol::api::{
    CreateSessionRequest, DiffStat, FanOutStarted, GroupAttemptView, GroupView, MAX_ATTEMPTS,
    PickResult, WorkspaceView,
};
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::{GroupId, SessionId};
use skiff_store::{NewSession, Scope, SessionRow};
use std::path::Path;
use std::sync::Arc;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/groups/{id}", get(show_group))
        .route("/v1/sessions/{id}/pick", post(pick))
}

async fn show_group(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    AxumPath(id): AxumPath<String>,
) -> Result<Response> {
    let id = GroupId::parse(&id)
        .ok_or_else(|| Error::BadRequest(format!("{id:?} is not a group id (grp_…)")))?;
    Ok(Json(core.group_view(&scope, &id).await?).into_response())
}

async fn pick(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
    AxumPath(id): AxumPath<String>,
) -> Result<Response> {
    let id = SessionId::parse(&id)
        .ok_or_else(|| Error::BadRequest(format!("{id:?} is not a session id (ses_…)")))?;
    Ok(Json(core.pick(&scope, &id).await?).into_response())
}

/// `attempts` checked: 2 to [`MAX_ATTEMPTS`], with a worker profile.
fn check_attempts(req: &CreateSessionRequest) -> Result<(u32, &str)> {
    let n = req.attempts.unwrap_or(1);
    if !(2..=MAX_ATTEMPTS).contains(&n) {
        return Err(Error::BadRequest(format!(
            "attempts = {n}: a fan-out starts 2 to {MAX_ATTEMPTS} attempts (leave attempts out for one session)"
        )));
    }
    let Some(profile) = req.profile.as_deref() else {
        return Err(Error::BadRequest(format!(
            "a fan-out of {n} attempts runs each on a box of its own: name a worker profile (--profile)"
        )));
    };
    if req.agent.is_some() {
        return Err(Error::BadRequest(
            "a fan-out cannot run with an agent spec yet: leave --agent out, or start one session"
                .into(),
        ));
    }
    Ok((n, profile))
}

/// The first line of `text` that says something.
fn first_line(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
}

/// The exit code of the last `exec` in the transcript, and the first line of the last
/// assistant message with text.
fn last_exec_and_message(
    entries: &[skiff_protocol::transcript::TranscriptEntry],
) -> (Option<i64>, Option<String>) {
    let exit = entries.iter().rev().find_map(|e| match &e.body {
        EntryBody::ToolResult { name, content, .. } if name == "exec" => content
            .strip_prefix("exit code: ")
            .and_then(|rest| rest.lines().next())
            .and_then(|code| code.trim().parse().ok()),
        _ => None,
    });
    let message = entries.iter().rev().find_map(|e| match &e.body {
        EntryBody::AssistantMessage { text, .. } => first_line(text),
        _ => None,
    });
    (exit, message)
}

impl Core {
    /// Starts the fan-out `req` asks for: N sessions with the same prompt, each with a
    /// workspace of its own made from the same source, placed on N boxes of the profile
    /// (all slots claimed at once, or none), each running its first turn.
    pub(crate) async fn fan_out(
        self: &Arc<Self>,
        scope: &Scope,
        req: CreateSessionRequest,
    ) -> Result<FanOutStarted> {
        check_prompt(&req.prompt)?;
        let (n, profile) = check_attempts(&req)?;
        if let Some(policy) = &req.approval {
            crate::approvals::compile(policy, "approval").map_err(Error::BadRequest)?;
        }
        self.check_profile(profile)?;
        // The quick answer before N workspaces are made: enough slots are free, or were
        // freed by parking sessions idle on their boxes.
        self.make_room_for(u64::from(n)).await?;
        let model = self.catalog.resolve(req.model.as_deref())?;
        if req.repo.is_some() {
            return Err(Error::BadRequest(
                "a fan-out starts from a workspace on the gateway host, not from a repo URL; start one session with --repo, then fork it".into(),
            ));
        }
        let source = Path::new(&req.workspace);
        if !source.is_absolute() {
            return Err(Error::BadRequest(format!(
                "workspace {} must be an absolute path on the gateway host",
                req.workspace
            )));
        }
        let group = GroupId::from_suffix(&skiff_store::mint()?);
        let title = title_of(&req.prompt);
        let mut news: Vec<NewSession> = Vec::new();
        for _ in 0..n {
            let id = SessionId::from_suffix(&skiff_store::mint()?);
            match workspace::prepare(source, &id, &self.state).await {
                Ok(workspace) => news.push(NewSession {
                    id,
                    title: title.clone(),
                    workspace,
                    model_ref: model.to_string(),
                }),
                Err(e) => {
                    self.discard_workspaces(&news).await;
                    return Err(e.into());
                }
            }
        }
        let created = self
            .claim_group_slots(scope, &group, &title, &news, profile)
            .await;
        let created = match created {
            Ok(rows) => rows,
            Err(e) => {
                self.discard_workspaces(&news).await;
                return Err(e);
            }
        };
        if let Some(effort) = req.reasoning {
            for s in &created {
                self.store
                    .set_session_reasoning(scope, &s.id, Some(effort.as_str()))?;
            }
        }
        if let Some(policy) = &req.approval {
            for s in &created {
                self.store.set_session_approval(scope, &s.id, policy)?;
            }
        }
        self.audit(
            scope,
            "group.create",
            group.as_str(),
            "allowed",
            json!({
                "attempts": n,
                "profile": profile,
                "model": model.as_str(),
                "sessions": created.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            }),
        );
        let mut attempts = Vec::new();
        for s in &created {
            self.record_base(scope, &s.id, &s.workspace).await;
            attempts.push(
                self.start_run_with(
                    scope,
                    &s.id,
                    EntryBody::UserMessage {
                        text: req.prompt.clone(),
                    },
                )
                .await?,
            );
        }
        Ok(FanOutStarted {
            group_id: group,
            attempts,
        })
    }

    async fn discard_workspaces(&self, news: &[NewSession]) {
        for new in news {
            workspace::discard(&new.workspace).await;
        }
    }

    /// Parks sessions idle on their boxes until `needs` slots are free; refuses with how many
    /// are when that is not possible.
    async fn make_room_for(self: &Arc<Self>, needs: u64) -> Result<()> {
        let max = self.workers.max_workers;
        loop {
            let free = max.saturating_sub(self.store.worker_slots()?.live);
            if free >= needs {
                return Ok(());
            }
            if needs > max || !self.workers.park_least_recently_used().await? {
                return Err(skiff_store::Error::GroupAtCapacity { needs, free, max }.into());
            }
        }
    }

    /// Writes the group with its worker slots, parking idle sessions to make room when
    /// another request took a slot meanwhile (a bounded number of times).
    async fn claim_group_slots(
        self: &Arc<Self>,
        scope: &Scope,
        group: &GroupId,
        title: &str,
        news: &[NewSession],
        profile: &str,
    ) -> Result<Vec<SessionRow>> {
        let max = self.workers.max_workers;
        for _ in 0..news.len() + 2 {
            match self
                .store
                .create_group(scope, group, title, news, (profile, max))
            {
                Err(skiff_store::Error::GroupAtCapacity { .. }) => {
                    if !self.workers.park_least_recently_used().await? {
                        break;
                    }
                }
                other => return Ok(other?),
            }
        }
        Ok(self
            .store
            .create_group(scope, group, title, news, (profile, max))?)
    }

    /// The group's attempts side by side.
    pub(crate) async fn group_view(&self, scope: &Scope, id: &GroupId) -> Result<GroupView> {
        let group = self.store.group(scope, id)?;
        let sessions = self.store.group_sessions(scope, id)?;
        let mut attempts = Vec::new();
        let mut result_branch = None;
        for row in sessions {
            let picked = group.picked.as_ref() == Some(&row.id);
            if picked && let WorkspaceView::Git { branch, .. } = &row.workspace {
                result_branch = Some(branch.clone());
            }
            let status = self.store.runs(scope, &row.id)?.pop().map(|r| r.status);
            let (diff, diff_error) = match self.session_diff(scope, &row.id, true).await {
                Ok(d) => (
                    Some(DiffStat {
                        files: d.files.len() as u64,
                        insertions: d.insertions,
                        deletions: d.deletions,
                    }),
                    None,
                ),
                Err(e) => (None, Some(e.to_string())),
            };
            let transcript = self.store.transcript(scope, &row.id)?;
            let (last_exec_exit, final_line) = last_exec_and_message(&transcript);
            attempts.push(GroupAttemptView {
                session: self.session_view(scope, row)?,
                status,
                diff,
                diff_error,
                last_exec_exit,
                final_line,
                picked,
            });
        }
        Ok(GroupView {
            id: group.id,
            title: group.title,
            created_at_ms: group.created_at_ms,
            picked: group.picked,
            result_branch,
            attempts,
        })
    }

    /// Picks `id` as its group's result and parks its siblings (their boxes back to the pool).
    /// Refused while any attempt of the group runs a turn.
    pub(crate) async fn pick(
        self: &Arc<Self>,
        scope: &Scope,
        id: &SessionId,
    ) -> Result<PickResult> {
        let session = self.store.session(scope, id)?;
        let Some(group) = session.group_id.clone() else {
            return Err(Error::BadRequest(format!(
                "session {id} is not an attempt of a fan-out group (started with --attempts); there is nothing to pick it from"
            )));
        };
        let siblings = self.store.group_sessions(scope, &group)?;
        let running: Vec<String> = siblings
            .iter()
            .filter_map(|s| match self.store.open_run(scope, &s.id) {
                Ok(Some(_)) => Some(Ok(s.id.to_string())),
                Ok(None) => None,
                Err(e) => Some(Err(e)),
            })
            .collect::<skiff_store::Result<_>>()?;
        if !running.is_empty() {
            return Err(Error::Conflict(format!(
                "group {group} still has attempts running a turn ({}); wait for them to finish (or cancel them) before picking",
                running.join(", ")
            )));
        }
        self.store.pick(scope, &group, id)?;
        self.audit(
            scope,
            "group.pick",
            group.as_str(),
            "applied",
            json!({ "session": id.as_str() }),
        );
        let mut parked = Vec::new();
        for s in siblings.iter().filter(|s| s.id != *id) {
            let why = format!("attempt {id} was picked as group {group}'s result");
            if self.workers.park(scope, &s.id, &why).await? {
                parked.push(s.id.clone());
            }
        }
        Ok(PickResult {
            group: self.group_view(scope, &group).await?,
            parked,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(attempts: Option<u32>, profile: Option<&str>) -> CreateSessionRequest {
        CreateSessionRequest {
            prompt: "p".into(),
            workspace: "/w".into(),
            repo: None,
            model: None,
            profile: profile.map(str::to_owned),
            reasoning: None,
            approval: None,
            agent: None,
            attempts,
        }
    }

    #[test]
    fn a_fan_out_needs_two_to_eight_attempts_and_a_profile() {
        assert_eq!(
            check_attempts(&request(Some(3), Some("p"))).unwrap(),
            (3, "p")
        );
        for bad in [Some(0), Some(1), Some(9)] {
            let e = check_attempts(&request(bad, Some("p")))
                .unwrap_err()
                .to_string();
            assert!(e.contains("2 to 8 attempts"), "{e}");
        }
        let e = check_attempts(&request(Some(2), None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("name a worker profile"), "{e}");
    }

    #[test]
    fn the_last_exec_and_the_final_messages_first_line_are_found() {
        let entry = |body| skiff_protocol::transcript::TranscriptEntry {
            id: skiff_protocol::EntryId::from_suffix("a"),
            parent_id: None,
            run_id: None,
            body,
            created_at_ms: 0,
        };
        let entries = vec![
            entry(EntryBody::ToolResult {
                call_id: "1".into(),
                name: "exec".into(),
                content: "exit code: 3\nboom\n".into(),
                is_error: false,
                images: vec![],
            }),
            entry(EntryBody::ToolResult {
                call_id: "2".into(),
                name: "read".into(),
                content: "exit code: 9\n".into(),
                is_error: false,
                images: vec![],
            }),
        ];
        let (exit, message) = last_exec_and_message(&entries);
        assert_eq!(exit, Some(3));
        assert_eq!(message, None);
    }
}
