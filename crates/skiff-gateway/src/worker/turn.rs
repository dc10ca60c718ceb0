//! Turns on a worker: the run handed over (again after a reconnect, with the transcript), its
//! end awaited, and at `turn.finish` the box's work reconciled into the session's workspace
//! (git: verified bundle + fast-forward; plain: checked mirror) and checkpointed.

use super::LayDown;
use super::place::box_workspace;
use crate::error::Result;
use crate::quarantine::Refused;
use serde_json::json;
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::sync::{Refusal, RefusalKind};
use skiff_protocol::worker::{GatewayFrame, Reply, TurnEnd};
use skiff_protocol::{AttemptId, RunId, SessionId};
use skiff_store::{PlacementChange, PlacementRow, RunRow, Scope, SessionRow};
use skiff_sync::filelist::Limits;
use skiff_sync::inbound_git::{self, Adoption};
use skiff_sync::inbound_plain::{self, Inbound};
use skiff_sync::{Remote, Rules, manifest, quarantine};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl super::WorkerSide {
    /// Sends the session's open run to its worker (again: the worker starts a run once).
    pub(crate) fn hand_over_turn(&self, scope: &Scope, session: &SessionId) -> Result<()> {
        let Some(run) = self.store.open_run(scope, session)? else {
            return Ok(());
        };
        if run.status != RunStatus::Running {
            return Ok(());
        }
        let mut turn = self.lent.specs()?.assignment(scope, session, &run)?;
        let live = self.live(session);
        live.set_open_run(Some(run.id.clone()));
        // A workspace laid down behind the worker's start: the turn's tools wait for it, and
        // the word of its end follows every hand-over (one sent while the worker was away is
        // lost).
        let laid = live.lay_down();
        turn.wait_for_workspace = laid != LayDown::Before;
        live.send(GatewayFrame::Turn { turn });
        if let LayDown::Ended(outcome) = laid {
            live.send(GatewayFrame::WorkspaceLaid {
                error: outcome.err(),
            });
        }
        Ok(())
    }

    /// Runs the admitted run on the session's worker and waits for its end. A box that dies
    /// mid-turn ends its attempt `failed`; unless the profile says `failover = "manual"` (or
    /// the run used up its `failover_attempts`), a fresh box takes the run over from the last
    /// checkpoint under a new owner epoch, and the chat says what was lost.
    pub(crate) async fn run_turn_on_worker(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        cancel: &CancellationToken,
    ) -> Result<skiff_agent::TurnOutcome> {
        let mut p = self.ensure_worker_for_turn(scope, session, cancel).await?;
        // Running already when a live move brought the turn here.
        if self.store.run(scope, &run.id)?.status != RunStatus::Running {
            self.set_run_status(scope, &session.id, &run.id, RunStatus::Running, None)?;
        }
        let allowed = self.envs.failovers_allowed(&p.profile);
        let mut failovers = 0;
        // A run taken over from a gateway that died goes on after the attempt it left.
        let mut resume: Option<(AttemptId, Option<String>)> = self
            .store
            .attempts(scope, &session.id)?
            .into_iter()
            .rfind(|a| a.run_id == run.id)
            .filter(|a| a.status == skiff_store::AttemptStatus::Orphaned)
            .map(|a| (a.id, None));
        loop {
            let env = p
                .environment_id
                .clone()
                .map(|e| e.to_string())
                .unwrap_or_default();
            let epoch = i64::try_from(p.owner_epoch).unwrap_or(0);
            let attempt = match &resume {
                None => self.store.start_attempt(scope, run, &env, epoch)?,
                Some((after, checkpoint)) => self.store.resume_attempt(
                    scope,
                    run,
                    &env,
                    epoch,
                    skiff_store::Resume {
                        after: Some(after),
                        checkpoint_artifact_id: checkpoint.as_deref(),
                    },
                )?,
            };
            let Some(end) = self.attend_turn(scope, session, run, &p, cancel).await? else {
                // Drained for a live move home: this attempt ends here, the run goes on.
                if let Err(e) = self.store.finish_attempt(
                    scope,
                    &attempt,
                    skiff_store::AttemptStatus::HandedOff,
                    None,
                ) {
                    tracing::warn!(run = %run.id, error = %e, "could not finish the attempt");
                }
                match self.hand_off_home(scope, &session.id, Some(&run.id)).await {
                    Ok(()) => return Ok(skiff_agent::TurnOutcome::HandedOff),
                    Err(e) => {
                        // Still on its box, its worker stopped: a new one takes the turn up.
                        tracing::warn!(session = %session.id, error = %e, "a live pull-back stopped; the turn goes on on its box");
                        p = self.ensure_worker_for_turn(scope, session, cancel).await?;
                        resume = Some((attempt, None));
                        continue;
                    }
                }
            };
            if let LayDown::Ended(Err(why)) = self.live(&session.id).lay_down() {
                // The box never held the whole workspace: nothing of it was brought back, and
                // the box is given up so the next message places the session afresh.
                let error = format!("the workspace could not be laid onto the box: {why}");
                if let Err(e) = self.store.finish_attempt(
                    scope,
                    &attempt,
                    skiff_store::AttemptStatus::Failed,
                    Some(&error),
                ) {
                    tracing::warn!(run = %run.id, error = %e, "could not finish the attempt");
                }
                let e = crate::Error::BoxNotReady(error.clone());
                let why = "the workspace could not be laid onto the box";
                self.fail_placement(scope, &p, e, why).await;
                return Ok(skiff_agent::TurnOutcome::Failed(error));
            }
            if let TurnEnd::Failed { error } = &end
                && !cancel.is_cancelled()
                && self.box_died(scope, &session.id)
            {
                if let Err(e) = self.store.finish_attempt(
                    scope,
                    &attempt,
                    skiff_store::AttemptStatus::Failed,
                    Some(error),
                ) {
                    tracing::warn!(run = %run.id, error = %e, "could not finish the attempt");
                }
                if failovers < allowed {
                    failovers += 1;
                    let checkpoint = self.fail_over(scope, session, run, &p, failovers, allowed);
                    p = self.ensure_worker_for_turn(scope, session, cancel).await?;
                    resume = Some((attempt, checkpoint));
                    continue;
                }
                let why = if allowed == 0 {
                    format!("{error} (profiles.{}.failover is \"manual\")", p.profile)
                } else {
                    format!(
                        "{error}; the turn already moved to a fresh box {allowed} time(s) (profiles.{}.failover_attempts)",
                        p.profile
                    )
                };
                return Ok(skiff_agent::TurnOutcome::Failed(why));
            }
            let (status, outcome, error) = match end {
                TurnEnd::Completed => (
                    skiff_store::AttemptStatus::Succeeded,
                    skiff_agent::TurnOutcome::Completed,
                    None,
                ),
                TurnEnd::Cancelled => (
                    skiff_store::AttemptStatus::Cancelled,
                    skiff_agent::TurnOutcome::Cancelled,
                    None,
                ),
                TurnEnd::Failed { error } => (
                    skiff_store::AttemptStatus::Failed,
                    skiff_agent::TurnOutcome::Failed(error.clone()),
                    Some(error),
                ),
            };
            if let Err(e) = self
                .store
                .finish_attempt(scope, &attempt, status, error.as_deref())
            {
                tracing::warn!(run = %run.id, error = %e, "could not finish the attempt");
            }
            return Ok(outcome);
        }
    }

    /// Hands the open run to the placement's worker and waits for the turn's end: a stalled
    /// worker is replaced meanwhile, a cancel is passed on. `None`: the worker was drained
    /// for a live move home (its next model call held; the turn is not over).
    async fn attend_turn(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        p: &PlacementRow,
        cancel: &CancellationToken,
    ) -> Result<Option<TurnEnd>> {
        let live = self.live(&session.id);
        let done = live.expect_turn(&run.id);
        // From here the box may hold work the gateway lacks, until this turn's reconciliation
        // succeeds: the session is not parked (its box not cleared) before then.
        self.store.mark_box_ahead(scope, &session.id)?;
        self.hand_over_turn(scope, &session.id)?;
        tokio::pin!(done);
        let stall = self.envs.stall_timeout(&p.profile);
        let end = loop {
            let since = std::time::Instant::now();
            live.touch();
            tokio::select! {
                end = &mut done => break end.ok(),
                () = live.drained() => return Ok(None),
                _ = cancel.cancelled() => {
                    live.send(GatewayFrame::CancelTurn { run_id: run.id.clone() });
                    self.cancel_model_calls(&session.id);
                    break tokio::time::timeout(Duration::from_secs(30), &mut done).await.ok().and_then(|r| r.ok());
                }
                () = stalled(&live, since, stall) => {
                    // A dead worker by another name: it is replaced (new epoch) and the new
                    // one takes the turn up from the transcript.
                    self.end_stalled_worker(scope, &session.id, &p.profile, stall).await;
                }
            }
        };
        Ok(Some(end.unwrap_or(TurnEnd::Failed {
            error: "the worker did not finish the turn".into(),
        })))
    }

    /// A worker that showed no progress for `stall` is killed on its box and its connection
    /// closed; the recovery that follows a lost worker replaces it.
    async fn end_stalled_worker(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        profile: &str,
        stall: Duration,
    ) {
        // The worker of the current epoch (an earlier stall may have replaced the first).
        let Ok(Some(p)) = self.store.placement(scope, session) else {
            return;
        };
        let reason = format!(
            "the worker showed no progress for {} (profiles.{profile}.stall_timeout); it is replaced and the turn goes on",
            humantime::format_duration(stall),
        );
        tracing::warn!(%session, epoch = p.owner_epoch, "{reason}");
        self.audit(
            scope,
            "worker.stall",
            session.as_str(),
            "applied",
            json!({ "epoch": p.owner_epoch, "stall_timeout_s": stall.as_secs() }),
        );
        self.notify(scope, session, None, &reason);
        // Killed before its connection is closed: a live worker would reconnect at once.
        let pid = p.worker_pid.unwrap_or(0);
        if pid > 0
            && let Ok(env) = self.placement_env(scope, &p)
            && let Ok(ssh) = self.envs.ssh(&env)
            && let Err(e) = ssh
                .run(
                    &format!("kill -9 {pid} 2>/dev/null; true"),
                    &CancellationToken::new(),
                )
                .await
        {
            tracing::warn!(%session, error = %e, "could not kill the stalled worker");
        }
        self.live(session).close();
        self.on_worker_disconnect(scope, session, p.owner_epoch);
    }

    /// `turn.finish`: reconcile the box's work into the session's workspace, checkpoint it,
    /// and end the turn the run executor is waiting for.
    pub(super) async fn worker_turn_finished(
        self: &Arc<Self>,
        scope: &Scope,
        claims: &skiff_protocol::worker::CredentialClaims,
        op: &skiff_protocol::worker::OpId,
        end: TurnEnd,
        theirs: std::result::Result<skiff_protocol::sync::Manifest, String>,
    ) -> Reply {
        let Some(run) = op.run_id.clone() else {
            return Reply::Finished;
        };
        let session = &claims.session_id;
        tracing::debug!(%session, %run, "turn.finish arrived");
        let open = self.store.open_run(scope, session).ok().flatten();
        if open.as_ref().map(|r| &r.id) != Some(&run) {
            // A fenced turn (its run already ended): nothing of it is adopted here; the next
            // turn's reconciliation carries whatever it left in the workspace.
            return Reply::Finished;
        }
        let end = match self
            .reconcile(scope, session, theirs.clone(), &run, false)
            .await
        {
            Ok(()) => end,
            Err(e) if self.half_dead(scope, session).await => {
                // The box's sshd takes no new connection, but the one the gateway holds still
                // works: bring the work home through it, then give the box up (its next turn
                // could not come back), with one notice that says which of the two happened.
                let captured = self.reconcile(scope, session, theirs, &run, true).await;
                let reason = match &captured {
                    Ok(()) => format!(
                        "it accepts no new SSH connections ({e}); this turn's work was brought back over the connection still open"
                    ),
                    Err(again) => format!(
                        "it accepts no new SSH connections, and the work could not be brought back over the connection still open either: {again}"
                    ),
                };
                let end = match captured {
                    Ok(()) => end,
                    Err(_) => TurnEnd::Failed {
                        error: format!("the session's box {reason}"),
                    },
                };
                self.live(session).end_turn(&run, end);
                let workers = self.clone();
                let (scope, session) = (scope.clone(), session.clone());
                tokio::spawn(async move { workers.reclaim(&scope, &session, &reason).await });
                return Reply::Finished;
            }
            Err(e) => {
                let kept = self
                    .store
                    .artifacts(scope, session, skiff_store::ArtifactRole::Quarantine)
                    .is_ok_and(|rows| rows.iter().any(|r| r.run_id.as_ref() == Some(&run)));
                let where_ = if kept {
                    format!(
                        ", and what it made is kept in the session's quarantine (`skiff session quarantine {session}`)"
                    )
                } else {
                    String::new()
                };
                let text = format!(
                    "The box's work could not be brought back: {e}. Nothing was overwritten; the box keeps its copy{where_}."
                );
                self.notify(scope, session, Some(&run), &text);
                TurnEnd::Failed { error: text }
            }
        };
        self.live(session).end_turn(&run, end);
        Reply::Finished
    }

    /// Brings the box's work back; `over_control` carries the transfers over the control
    /// connection (a half-dead box).
    async fn reconcile(
        &self,
        scope: &Scope,
        session_id: &SessionId,
        theirs: std::result::Result<skiff_protocol::sync::Manifest, String>,
        run: &RunId,
        over_control: bool,
    ) -> Result<()> {
        // A turn that ends while a live move home waits for its next step goes back to
        // `handing_off`, and the move is made at the boundary.
        let back_to = match self.store.placement(scope, session_id)? {
            Some(p) if p.state == PlacementState::HandingOff => PlacementState::HandingOff,
            _ => PlacementState::Active,
        };
        let p = self.place(
            scope,
            session_id,
            PlacementState::Reconciling,
            &PlacementChange::default(),
            "bringing the box's work back",
        )?;
        let started = std::time::Instant::now();
        let result = self
            .reconcile_inner(scope, session_id, &p, theirs, over_control, Some(run))
            .await;
        tracing::debug!(session = %session_id, ms = started.elapsed().as_millis() as u64, "reconciled");
        // An unchanged base (a turn that changed nothing) is not written again.
        let base = result
            .as_ref()
            .ok()
            .map(|(b, _)| b)
            .filter(|b| p.base_manifest.as_deref() != Some(b.as_str()))
            .cloned();
        let detail = match &result {
            Ok(_) => "the box's work is in the session's workspace".to_owned(),
            Err(e) => format!("reconciliation stopped: {e}"),
        };
        self.place(
            scope,
            session_id,
            back_to,
            &PlacementChange {
                base_manifest: base.as_deref(),
                // Failed, the box keeps what did not come back: it stays ahead.
                box_in_step: result.is_ok().then_some(true),
                ..Default::default()
            },
            &detail,
        )?;
        if let Ok((_, known)) = &result {
            let session = self.store.session(scope, session_id)?;
            self.checkpoint_turn(scope, &session, run, known.as_ref())
                .await;
        }
        result.map(|_| ())
    }

    pub(super) async fn reconcile_inner(
        &self,
        scope: &Scope,
        session_id: &SessionId,
        p: &PlacementRow,
        theirs: std::result::Result<skiff_protocol::sync::Manifest, String>,
        over_control: bool,
        run: Option<&RunId>,
    ) -> Result<(String, Option<skiff_sync::checkpoint::Known>)> {
        let mut theirs = theirs.map_err(|why| {
            // The box's words: bounded, and said to be the worker's.
            let why: String = why.chars().take(2000).collect();
            crate::Error::BoxFailed(format!("the worker could not list its workspace: {why}"))
        })?;
        let session = self.store.session(scope, session_id)?;
        let base = manifest::from_json(p.base_manifest.as_deref().unwrap_or(""))?;
        let env = self.placement_env(scope, p)?;
        let mut ssh = self.envs.ssh(&env)?;
        if over_control {
            ssh = ssh.transfers_over_control();
        }
        let remote = Remote::new(ssh, &box_workspace(session_id))?;
        let local = Path::new(session.workspace.path());
        let rules = Rules::load(local)?;
        let limits = Limits::default();
        let scratch = self.tmp();
        let cancel = CancellationToken::new();
        // Git mode: the box's bundle and the checks of this side need nothing of each other.
        let git_base = match &session.workspace {
            WorkspaceView::Git { .. } => Some(base.base_commit.clone().ok_or_else(|| {
                crate::Error::Internal("the base manifest has no base commit".into())
            })?),
            WorkspaceView::Plain { .. } => None,
        };
        let adoption = git_base.as_deref().map(|commit| Adoption {
            worktree: local,
            session: session_id.as_str(),
            base: &base,
            expected_head: commit,
            rules: &rules,
            limits: &limits,
            scratch: &scratch,
        });
        let (bundle, here) = match (&adoption, git_base.as_deref()) {
            (Some(a), Some(commit)) => {
                let (bundle, here) = tokio::join!(
                    inbound_git::fetch_bundle(
                        &remote,
                        session_id.as_str(),
                        commit,
                        &limits,
                        &scratch,
                        &cancel,
                    ),
                    inbound_git::check_here(a, &cancel)
                );
                (bundle?, Some(here))
            }
            _ => (None, None),
        };
        let bundle_path = bundle.as_ref().map(|b| b.path());
        // What containment refuses is kept before anything is adopted (a failure here leaves
        // both sides as they were). A manifest refused as a whole is the adoption's error.
        // Screened once: the same split is what gets adopted below.
        let screened = quarantine::screen(&theirs, &base, &limits, &rules);
        let mut kept = match &screened {
            Ok(screened) if !screened.refused.is_empty() => Some(
                self.quarantine(
                    scope,
                    Refused {
                        session: session_id,
                        run,
                        remote: &remote,
                        refused: &screened.refused,
                        theirs: &theirs,
                        bundle: bundle_path,
                    },
                )
                .await?,
            ),
            _ => None,
        };
        let adopted = match (adoption, here) {
            (Some(a), Some(here)) => {
                let adopted = match (here, screened) {
                    (Ok(here), Ok(screened)) => {
                        inbound_git::adopt_screened(
                            &a,
                            here,
                            bundle_path,
                            screened,
                            &remote,
                            &cancel,
                        )
                        .await
                    }
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
                adopted.map(|adopted| {
                    self.audit(scope, "sync.inbound", session_id.as_str(), "applied", json!({
                        "env": env.id.as_str(), "mode": "git", "head": adopted.head, "fast_forwarded": adopted.fast_forwarded,
                        "written": adopted.files.written.len(), "deleted": adopted.files.deleted.len(),
                        "refused": adopted.refused.len(),
                    }));
                    let reset_to = adopted.commits_refused.as_ref().map(|_| adopted.head.clone());
                    (adopted.manifest, adopted.refused, reset_to, adopted.unchanged)
                })
            }
            _ => {
                let inb = Inbound {
                    target: local,
                    base: &base,
                    rules: &rules,
                    limits: &limits,
                    scratch: &scratch,
                };
                let mirrored = match screened {
                    Ok(screened) => {
                        inbound_plain::mirror_screened(&inb, screened, &remote, &cancel).await
                    }
                    Err(e) => Err(e),
                };
                mirrored.map(|m| {
                        self.audit(scope, "sync.inbound", session_id.as_str(), "applied", json!({
                            "env": env.id.as_str(), "mode": "plain", "written": m.files.written.len(),
                            "deleted": m.files.deleted.len(), "refused": m.refused.len(),
                        }));
                        (m.manifest, m.refused, None, None)
                    })
            }
        };
        let (adopted, refused, reset_to, unchanged) = match adopted {
            Ok(done) => done,
            Err(e) => {
                // Nothing was adopted: the whole turn's work is kept (when it was not already).
                let everything = Refusal {
                    path: "(all)".into(),
                    reason: format!("nothing was adopted: {e}"),
                    kind: RefusalKind::Everything,
                };
                if kept.is_none() {
                    let all: Vec<Refusal> = std::iter::once(everything)
                        .chain(
                            manifest::diff(&base, &theirs)
                                .changed
                                .into_keys()
                                .map(|path| Refusal {
                                    path,
                                    reason: "not adopted with the rest of the turn".into(),
                                    kind: RefusalKind::Path,
                                }),
                        )
                        .collect();
                    let whole = Refused {
                        session: session_id,
                        run,
                        remote: &remote,
                        refused: &all,
                        theirs: &theirs,
                        bundle: bundle_path,
                    };
                    match self.quarantine(scope, whole).await {
                        Ok(k) => kept = Some(k),
                        Err(q) => {
                            tracing::warn!(session = %session_id, error = %q, "could not keep the refused work in quarantine");
                        }
                    }
                } else if let Some(k) = kept.as_mut()
                    && let Err(q) = self.add_to_quarantine(scope, k, &[everything])
                {
                    tracing::warn!(session = %session_id, error = %q, "could not record the refusal in quarantine");
                }
                if let Some(k) = &kept {
                    self.announce_quarantine(scope, session_id, run, k);
                }
                return Err(e.into());
            }
        };
        // From here the work is adopted: what follows only tells and tidies, and never undoes
        // it (a failure is said, and the adopted manifest is still the next base).
        let late: Vec<Refusal> = refused
            .iter()
            .filter(|r| r.kind != RefusalKind::Path)
            .cloned()
            .collect();
        if !late.is_empty() {
            let added = match kept.as_mut() {
                Some(k) => self.add_to_quarantine(scope, k, &late),
                None => self
                    .quarantine(
                        scope,
                        Refused {
                            session: session_id,
                            run,
                            remote: &remote,
                            refused: &late,
                            theirs: &theirs,
                            bundle: bundle_path,
                        },
                    )
                    .await
                    .map(|k| kept = Some(k)),
            };
            if let Err(e) = added {
                tracing::warn!(session = %session_id, error = %e, "could not record the refused commits in quarantine");
            }
        }
        if let Some(k) = &kept {
            self.announce_quarantine(scope, session_id, run, k);
            if let Err(e) = quarantine::revert_on_box(
                &remote,
                local,
                &adopted,
                &k.paths,
                reset_to.as_deref(),
                &cancel,
            )
            .await
            {
                tracing::warn!(session = %session_id, error = %e, "could not put the box back in step after a quarantine");
                self.notify(
                    scope,
                    session_id,
                    run,
                    &format!("The box still has the refused paths (putting it back in step failed: {e}); they will be refused again next turn."),
                );
            }
        }
        theirs = adopted;
        Ok((manifest::to_json(&theirs)?, unchanged))
    }

    /// Whether the session's box was given up (reclaimed) under its turn.
    fn box_died(&self, scope: &Scope, session: &SessionId) -> bool {
        matches!(
            self.store.placement(scope, session),
            Ok(Some(p)) if p.state == PlacementState::Reclaimed
        )
    }

    /// Whether the session's box is half dead: no new SSH connection opens, while the
    /// control connection the gateway holds still answers.
    async fn half_dead(&self, scope: &Scope, session: &SessionId) -> bool {
        let Ok(Some(p)) = self.store.placement(scope, session) else {
            return false;
        };
        let Ok(env) = self.placement_env(scope, &p) else {
            return false;
        };
        let Ok(ssh) = self.envs.ssh(&env) else {
            return false;
        };
        !ssh.accepts_new_connections().await && ssh.master_alive(skiff_ssh::Channel::Control).await
    }

    /// Records a failover and tells the chat; returns the checkpoint the next attempt's
    /// workspace starts from (the session's last).
    pub(super) fn fail_over(
        &self,
        scope: &Scope,
        session: &SessionRow,
        run: &RunRow,
        p: &PlacementRow,
        n: u32,
        allowed: u32,
    ) -> Option<String> {
        let last = self
            .store
            .artifacts(scope, &session.id, skiff_store::ArtifactRole::Checkpoint)
            .ok()
            .and_then(|rows| rows.last().map(|r| (r.id.to_string(), r.seq)));
        let from = match last.as_ref().and_then(|(_, seq)| *seq) {
            Some(seq) => format!("checkpoint {seq}"),
            None => "the workspace the session started with".to_owned(),
        };
        let text = format!(
            "The turn goes on on a fresh box from {from} (failover {n} of {allowed}, profiles.{}.failover_attempts).",
            p.profile
        );
        self.audit(
            scope,
            "run.failover",
            run.id.as_str(),
            "applied",
            json!({
                "session": session.id.as_str(),
                "from_env": p.environment_id.as_ref().map(|e| e.as_str()),
                "epoch": p.owner_epoch,
                "failover": n,
            }),
        );
        self.revoke_approvals(
            scope,
            &session.id,
            "the session's box was lost and its turn moves to a fresh one",
        );
        self.transcript()
            .notify(scope, &session.id, Some(&run.id), &text);
        self.enter_failover(scope, &session.id, p, &from, n, allowed);
        last.map(|(id, _)| id)
    }
}

/// Resolves once the worker has shown no progress for `stall` (counting from `since` at the
/// earliest).
async fn stalled(live: &super::Live, since: std::time::Instant, stall: Duration) {
    loop {
        let idle = live.idle_for(since);
        if idle >= stall {
            return;
        }
        tokio::time::sleep(stall - idle).await;
    }
}
