//! Keeping a worker session alive: a reconnecting worker gets its turn back, a turn orphaned by a
//! gateway restart is retried as a new turn, a dropped connection repairs the tunnel, a dead
//! worker is replaced under a new owner epoch, and a dead box reclaims the placement with a
//! notice of what was lost since the last checkpoint.

use super::lock;
use super::place::{RECONNECT_GRACE, RECOVERY_DEADLINE, wait_connected};
use crate::error::Result;
use serde_json::json;
use skiff_protocol::api::RunStatus;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::GatewayFrame;
use skiff_protocol::{EnvironmentId, SessionId};
use skiff_store::{PlacementChange, Scope};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often a dead worker is replaced on a box that still answers before the placement is
/// given up, and the pause before the second attempt (doubled each time).
const REPLACE_ATTEMPTS: u32 = 3;
const REPLACE_BACKOFF: Duration = Duration::from_secs(1);
/// The largest workspace listing `skiff box scan` may send (200,000 entries of a few hundred
/// bytes each).
const SCAN_MAX_BYTES: u64 = 128 << 20;

impl super::WorkerSide {
    /// After a worker is admitted: a reconnecting worker gets its turn again; a session whose
    /// turn was orphaned by a gateway restart gets it retried as a new turn.
    pub(super) async fn after_admission(self: &Arc<Self>, a: &super::endpoint::Admitted) {
        let session = &a.claims.session_id;
        // Every gateway of the deployment can reach the box from now on (`adopt.rs`).
        self.share_box_key(&a.scope, &a.claims.environment_id);
        if let Err(e) = self.resume_admitted(a).await {
            // Nothing is decided on a guess: the worker is sent away and, reconnecting, is
            // admitted again and gets this decision made again.
            tracing::error!(%session, error = %e, "could not read what an admitted worker should do; closing its connection so it reconnects");
            self.audit(
                &a.scope,
                "worker.resume",
                session.as_str(),
                "failed",
                serde_json::json!({ "epoch": a.claims.owner_epoch }),
            );
            a.live.close();
        }
    }

    async fn resume_admitted(self: &Arc<Self>, a: &super::endpoint::Admitted) -> Result<()> {
        let session = &a.claims.session_id;
        let Some(p) = self.store.placement(&a.scope, session)? else {
            return Ok(());
        };
        if p.state != PlacementState::Active {
            return Ok(());
        }
        let runs = self.store.runs(&a.scope, session)?;
        if let Some(last) = runs.last()
            && last.status == RunStatus::Orphaned
        {
            // Stop whatever the worker still does for it; its writes are fenced anyway.
            a.live.send(GatewayFrame::CancelTurn {
                run_id: last.id.clone(),
            });
            if let Err(e) = self
                .start_run_with(
                    &a.scope,
                    session,
                    EntryBody::Notice {
                        text: "The gateway restarted during the previous turn; that turn stopped and is retried as a new turn.".into(),
                    },
                )
                .await
            {
                tracing::warn!(%session, error = %e, "could not retry the orphaned turn");
            }
            return Ok(());
        }
        self.hand_over_turn(&a.scope, session)
    }

    /// A worker's connection closed: repair the tunnel, then replace a dead worker or reclaim
    /// a dead box.
    pub(super) fn on_worker_disconnect(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        epoch: u64,
    ) {
        let live = self.live(session);
        if !live.begin_recovery() {
            return;
        }
        let workers = self.clone();
        let (scope, session) = (scope.clone(), session.clone());
        tokio::spawn(async move {
            workers.recover(&scope, &session, epoch).await;
            workers.live(&session).end_recovery();
        });
    }

    async fn recover(self: &Arc<Self>, scope: &Scope, session: &SessionId, epoch: u64) {
        let live = self.live(session);
        let started = std::time::Instant::now();
        let cancel = CancellationToken::new();
        loop {
            if live.connected_epoch() == Some(epoch) {
                return;
            }
            let Ok(Some(p)) = self.store.placement(scope, session) else {
                return;
            };
            if p.owner_epoch != epoch
                || !matches!(
                    p.state,
                    PlacementState::Active | PlacementState::Reconciling
                )
            {
                return;
            }
            let Ok(env) = self.placement_env(scope, &p) else {
                return;
            };
            let Ok(ssh) = self.envs.ssh(&env) else {
                return;
            };
            let _ = self.open_worker_endpoint(&env.id);
            match self.open_tunnel(&env, &ssh, &cancel).await {
                Ok(_) => {}
                Err(e) => {
                    if !self.envs.box_alive(&env).await || started.elapsed() > RECOVERY_DEADLINE {
                        let reason = format!("its box cannot be reached: {e}");
                        self.reclaim_on(scope, session, &env.id, &reason).await;
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            }
            if wait_connected(&live, epoch, RECONNECT_GRACE).await {
                self.audit(
                    scope,
                    "worker.reconnect",
                    session.as_str(),
                    "applied",
                    json!({ "env": env.id.as_str(), "epoch": epoch }),
                );
                return;
            }
            let pid = p.worker_pid.unwrap_or(0);
            match ssh
                .run(
                    &format!("kill -0 {pid} 2>/dev/null && echo alive || echo dead"),
                    &cancel,
                )
                .await
            {
                Ok(out) if out.trim() == "dead" => {
                    self.replace_with_retries(scope, session, &env, &ssh).await;
                    return;
                }
                Ok(_) if started.elapsed() < RECOVERY_DEADLINE => continue,
                Ok(_) => {
                    self.replace_with_retries(scope, session, &env, &ssh).await;
                    return;
                }
                Err(e) => {
                    if !self.envs.box_alive(&env).await {
                        let reason = format!("its box stopped: {e}");
                        self.reclaim_on(scope, session, &env.id, &reason).await;
                        return;
                    }
                }
            }
        }
    }

    /// Replaces the worker, trying again (with backoff) while the box itself answers: a
    /// replacement that died before admission says nothing about the box. The placement is
    /// reclaimed only on evidence — the box no longer answers and its provider no longer
    /// reports it running — or when every attempt failed on a box that still answers.
    pub(super) async fn replace_with_retries(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        env: &skiff_store::EnvironmentRow,
        ssh: &skiff_ssh::Ssh,
    ) {
        let mut backoff = REPLACE_BACKOFF;
        let mut last = String::new();
        for attempt in 1..=REPLACE_ATTEMPTS {
            match self.replace_worker(scope, session).await {
                Ok(()) => return,
                Err(e) => last = e.to_string(),
            }
            tracing::warn!(%session, attempt, error = %last, "a replacement worker did not start");
            let answers = ssh.run("true", &CancellationToken::new()).await.is_ok();
            if !answers && !self.envs.box_alive(env).await {
                let reason = format!("its box stopped: {last}");
                self.reclaim_on(scope, session, &env.id, &reason).await;
                return;
            }
            if attempt == REPLACE_ATTEMPTS {
                break;
            }
            // Still the session's, still on this box: say so, and try again.
            if let Err(e) = self.place(
                scope,
                session,
                PlacementState::Starting,
                &PlacementChange::default(),
                &format!(
                    "a new worker did not start ({last}); the box answers, trying again in {} s (attempt {} of {REPLACE_ATTEMPTS})",
                    backoff.as_secs(),
                    attempt + 1
                ),
            ) {
                tracing::warn!(%session, error = %e, "could not record the retry");
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
        // The box answers but runs no worker: bring its work home before giving it up.
        let captured = match self.capture_box_work(scope, session).await {
            Ok(()) => "its work was brought back first".to_owned(),
            Err(e) => format!("bringing its work back failed too: {e}"),
        };
        self.reclaim_on(
            scope,
            session,
            &env.id,
            &format!("no new worker could start after {REPLACE_ATTEMPTS} attempts on a box that still answers ({last}); {captured}"),
        )
        .await;
    }

    /// Brings home what a box holds when no worker can run there: the workspace listed by
    /// the installed bundle (`skiff box scan`), adopted with every check a turn's end gets,
    /// then checkpointed.
    pub(super) async fn capture_box_work(&self, scope: &Scope, session: &SessionId) -> Result<()> {
        let p = self
            .store
            .placement(scope, session)?
            .ok_or_else(|| crate::Error::Conflict(format!("session {session} has no placement")))?;
        let env = self.placement_env(scope, &p)?;
        let ssh = self.envs.ssh(&env)?;
        let bundle = p
            .bundle_hash
            .clone()
            .or_else(|| self.envs.bundle_hash_now())
            .ok_or_else(|| crate::Error::Unavailable("the box's bundle is not known".into()))?;
        // The listing of a real workspace is large: it comes back as a file, bounded by what a
        // manifest of the sync limits can be, never through a capped command output.
        let remote = skiff_sync::Remote::new(ssh, &super::place::box_workspace(session))?;
        let listing = self
            .tmp()
            .join(format!("scan-{}.json", skiff_store::mint()?));
        let fetched = remote
            .fetch_output(
                &format!(
                    "\"$HOME/.skiff/bundles/{bundle}/skiff\" box scan {}",
                    remote.quoted_dir()
                ),
                &listing,
                SCAN_MAX_BYTES,
                &CancellationToken::new(),
            )
            .await;
        let text = fetched.and_then(|()| {
            std::fs::read_to_string(&listing).map_err(|e| skiff_sync::Error::Io {
                path: listing.display().to_string(),
                source: e,
            })
        });
        if let Err(e) = std::fs::remove_file(&listing)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %listing.display(), error = %e, "could not remove a workspace listing");
        }
        let theirs = skiff_sync::manifest::from_json(text?.trim())?;
        let run = match self.store.open_run(scope, session)? {
            Some(run) => Some(run.id),
            None => self
                .store
                .runs(scope, session)?
                .last()
                .map(|r| r.id.clone()),
        };
        let (base, known) = self
            .reconcile_inner(scope, session, &p, Ok(theirs), false, run.as_ref())
            .await?;
        // Both sides hold the same work now: a barrier cut short after this (a gateway
        // restart) leaves the session on its box, whose next turn is reconciled against it.
        self.store.mark_box_in_step(scope, session, &base)?;
        if let Some(run) = run {
            let row = self.store.session(scope, session)?;
            self.checkpoint_turn(scope, &row, &run, known.as_ref())
                .await;
        }
        self.audit(
            scope,
            "placement.capture",
            session.as_str(),
            "applied",
            json!({ "env": env.id.as_str() }),
        );
        Ok(())
    }

    /// A new worker on the same box under a new owner epoch; the old one is fenced.
    async fn replace_worker(self: &Arc<Self>, scope: &Scope, session: &SessionId) -> Result<()> {
        // One driver of the placement at a time: a turn's `ensure_worker` may be replacing the
        // same lost worker, and two replacements would fence each other's worker mid-step.
        let live = self.live(session);
        let placing = live.placing.clone();
        let _placing = placing.lock_owned().await;
        let before = self
            .store
            .placement(scope, session)?
            .ok_or_else(|| crate::Error::Conflict(format!("session {session} has no placement")))?;
        if before.state == PlacementState::Active
            && live.connected_epoch() == Some(before.owner_epoch)
        {
            // Replaced meanwhile by that other driver, and its worker is connected.
            return Ok(());
        }
        self.stop_before_fencing(scope, &before).await;
        let p = self.place(
            scope,
            session,
            PlacementState::Starting,
            &PlacementChange {
                advance_epoch: true,
                ..Default::default()
            },
            "the worker stopped; starting a new one (the old one is fenced)",
        )?;
        self.cancel_model_calls(session);
        self.audit(
            scope,
            "worker.replace",
            session.as_str(),
            "applied",
            json!({ "epoch": p.owner_epoch }),
        );
        self.start_worker(scope, &p).await.map(|_| ())
    }

    /// At gateway start: placements caught mid-placement failed; active ones get their
    /// endpoint back and wait for their worker to re-attach (repairing the tunnel if needed).
    /// Sessions another live gateway holds are that gateway's and left alone.
    pub(crate) async fn reconcile_placements_on_start(
        self: &Arc<Self>,
        held_elsewhere: &std::collections::HashSet<SessionId>,
    ) -> Result<()> {
        let laying = self.unfinished_lay_downs();
        for p in self.store.live_placements()? {
            if held_elsewhere.contains(&p.session_id) {
                continue;
            }
            if p.state == PlacementState::HandingOff && p.environment_id.is_none() {
                // A live dispatch cut short: its turn was on the gateway, which restarted.
                self.store.come_home(&p.scope, &p.session_id)?;
                continue;
            }
            if let Some(env) = laying.get(&p.session_id)
                && p.environment_id.as_ref() == Some(env)
            {
                // Its worker started while the box was still being laid, and nobody saw that
                // end: the box may lack the workspace. Like a placement cut short, it fails;
                // its box, attached to nothing now, is given up after this pass (lib.rs).
                let why = format!(
                    "the gateway restarted while the workspace was being laid onto {env}; that box is given up. Send a message to place the session afresh"
                );
                self.place(
                    &p.scope,
                    &p.session_id,
                    PlacementState::Failed,
                    &PlacementChange {
                        error: Some(&why),
                        ..Default::default()
                    },
                    &why,
                )?;
                continue;
            }
            match p.state {
                PlacementState::Active
                | PlacementState::Reconciling
                | PlacementState::Draining
                | PlacementState::HandingOff => {
                    if p.state != PlacementState::Active {
                        // A pull-back cut short leaves the session on its box: pulling it
                        // back again finishes it, and a message runs there meanwhile.
                        let why = match p.state {
                            PlacementState::Draining | PlacementState::HandingOff => {
                                "the gateway restarted during a pull-back; the session stays on its box"
                            }
                            _ => "the gateway restarted during reconciliation",
                        };
                        self.place(
                            &p.scope,
                            &p.session_id,
                            PlacementState::Active,
                            &PlacementChange::default(),
                            why,
                        )?;
                    }
                    if let Some(env) = &p.environment_id {
                        self.open_worker_endpoint(env)?;
                        // The worker's proxy variables name this port; serve it again.
                        if let Ok(row) = self.store.environment(&p.scope, env)
                            && let Err(e) = self
                                .open_egress(
                                    &row,
                                    &p.profile,
                                    crate::egress::Phase::Agent,
                                    &CancellationToken::new(),
                                )
                                .await
                        {
                            tracing::warn!(env = %env, error = %e, "could not re-open the agent's egress");
                        }
                    }
                    self.on_worker_disconnect(&p.scope, &p.session_id, p.owner_epoch);
                }
                _ => {
                    let why = "the gateway restarted while placing this session; send a message to try again";
                    self.place(
                        &p.scope,
                        &p.session_id,
                        PlacementState::Failed,
                        &PlacementChange {
                            error: Some(why),
                            ..Default::default()
                        },
                        why,
                    )?;
                }
            }
        }
        self.forget_lay_downs();
        Ok(())
    }

    /// The failover of a run whose box died under it: `reclaimed → failed_over` (the dead
    /// box forgotten, a worker slot held again), a placement event that names the box, why it
    /// was given up and where the new attempt starts from. The new attempt's placement then
    /// goes `failed_over → requested → …`; a failover that cannot be recorded is placed from
    /// `reclaimed` as before.
    pub(super) fn enter_failover(
        &self,
        scope: &Scope,
        session: &SessionId,
        dead: &skiff_store::PlacementRow,
        from: &str,
        n: u32,
        allowed: u32,
    ) {
        let why = self
            .store
            .placement(scope, session)
            .ok()
            .flatten()
            .and_then(|p| p.error)
            .unwrap_or_else(|| "its box stopped".to_owned());
        let the_box = dead
            .environment_id
            .as_ref()
            .map_or_else(|| "its box".to_owned(), |e| format!("box {e}"));
        let detail = format!(
            "failing over: {the_box} of epoch {} died mid-run ({why}); its attempt failed; a new attempt of the same run is placed on a fresh box from {from} (failover {n} of {allowed})",
            dead.owner_epoch
        );
        let row = match self.store.begin_failover(scope, session, &why) {
            Ok(row) => row,
            Err(e) => {
                tracing::warn!(%session, error = %e, "could not record the failover");
                return;
            }
        };
        let run = self
            .store
            .open_run(scope, session)
            .ok()
            .flatten()
            .map(|r| r.id);
        let event = skiff_protocol::event::EventKind::Placement {
            state: row.state,
            environment_id: None,
            detail: detail.clone(),
        };
        if let Err(e) = self.hub.publish(scope, session, run.as_ref(), event) {
            tracing::warn!(%session, error = %e, "could not publish the failover");
        }
        tracing::info!(%session, placement = %row.state, detail, "placement");
    }

    /// What the user lost with a dead box: the changes the running turn made since the last
    /// checkpoint (every finished turn was reconciled and checkpointed).
    fn lost_work_notice(
        &self,
        scope: &Scope,
        session: &SessionId,
        env: Option<&EnvironmentId>,
        reason: &str,
    ) -> String {
        let last = self
            .store
            .artifacts(scope, session, skiff_store::ArtifactRole::Checkpoint)
            .ok()
            .and_then(|a| a.last().map(|r| (r.seq, r.created_at_ms)));
        let checkpoint = last.and_then(|(seq, _)| seq);
        let since_ms = last.map_or(i64::MIN, |(_, at)| at);
        // Every change the agent made after the last checkpoint — in the running turn and in
        // any turn since whose work never came back — not only the open run's.
        let mut changes = Vec::new();
        if let Ok(entries) = self.store.transcript(scope, session) {
            let after = entries.iter().filter(|e| e.created_at_ms > since_ms);
            for entry in after {
                if let EntryBody::AssistantMessage { tool_calls, .. } = &entry.body {
                    for call in tool_calls
                        .iter()
                        .filter(|c| matches!(c.name.as_str(), "write" | "edit" | "exec"))
                    {
                        changes.push(format!(
                            "{} {}",
                            call.name,
                            skiff_agent::tools::summary(call)
                        ));
                    }
                }
            }
        }
        let env = env
            .map(|e| e.to_string())
            .unwrap_or_else(|| "its box".into());
        let since = match checkpoint {
            Some(n) => format!("checkpoint {n}"),
            None => "the start of the session".into(),
        };
        let lost = if changes.is_empty() {
            format!("Nothing the agent changed there since {since} was lost.")
        } else {
            format!(
                "Workspace changes made there since {since} were lost: {}.",
                changes.join("; ")
            )
        };
        format!(
            "The worker box {env} stopped ({reason}). The conversation is intact. {lost} Your next message starts a fresh box from {since}."
        )
    }

    /// The session's box is gone: keep the conversation, mark the placement reclaimed, tell
    /// the user what was lost, and end the turn that was running there.
    pub(crate) async fn reclaim(&self, scope: &Scope, session: &SessionId, reason: &str) {
        self.reclaim_at(scope, session, None, reason).await;
    }

    /// [`Self::reclaim`], only while the placement is still on the box `dead`: a recovery
    /// reaches its verdict on one box after seconds of SSH attempts, and by then the session
    /// may have been reclaimed and placed on a fresh box — which must not be given up for the
    /// old box's death.
    pub(super) async fn reclaim_on(
        &self,
        scope: &Scope,
        session: &SessionId,
        dead: &EnvironmentId,
        reason: &str,
    ) {
        self.reclaim_at(scope, session, Some(dead), reason).await;
    }

    async fn reclaim_at(
        &self,
        scope: &Scope,
        session: &SessionId,
        dead: Option<&EnvironmentId>,
        reason: &str,
    ) {
        let p = self.store.placement(scope, session).ok().flatten();
        if p.as_ref().is_some_and(|p| {
            matches!(
                p.state,
                PlacementState::Reclaimed
                    | PlacementState::FailedOver
                    | PlacementState::Failed
                    | PlacementState::Local
                    | PlacementState::Parked
            )
        }) {
            // Already settled (a second path found the same dead box, or the session gave its
            // box back before it died): one notice, or none, not two.
            return;
        }
        if let (Some(p), Some(dead)) = (&p, dead)
            && p.environment_id.as_ref() != Some(dead)
        {
            tracing::debug!(%session, %dead, "the session moved to another box before: {reason}");
            return;
        }
        let live = self.live(session);
        // A worker that can still hear it is told to go (explicit close).
        live.send(GatewayFrame::Shutdown {
            reason: reason.to_owned(),
        });
        live.close();
        self.cancel_model_calls(session);
        let env = p.as_ref().and_then(|p| p.environment_id.clone());
        if let Some(env) = &env {
            self.close_worker_endpoint(env);
        }
        // The notice goes in before the placement says `reclaimed`, so whoever sees the
        // reclaim (a follower, the CLI) finds what was lost already in the transcript.
        let open = self.store.open_run(scope, session).ok().flatten();
        let notice = self.lost_work_notice(scope, session, env.as_ref(), reason);
        self.transcript()
            .notify(scope, session, open.as_ref().map(|r| &r.id), &notice);
        if let Err(e) = self.place(
            scope,
            session,
            PlacementState::Reclaimed,
            &PlacementChange {
                error: Some(reason),
                ..Default::default()
            },
            reason,
        ) {
            tracing::warn!(%session, error = %e, "could not reclaim the placement");
        }
        self.audit(
            scope,
            "placement.reclaim",
            session.as_str(),
            "applied",
            json!({ "env": env.as_ref().map(|e| e.as_str()), "reason": reason }),
        );
        live.end_all_turns(&format!("the session's box stopped ({reason})"));
        if let Some(env) = env {
            self.envs.abandon(scope, &env, reason).await;
        }
    }
}

impl super::Live {
    pub(super) fn begin_recovery(&self) -> bool {
        let mut r = lock(&self.recovering);
        if *r {
            return false;
        }
        *r = true;
        true
    }

    pub(super) fn end_recovery(&self) {
        *lock(&self.recovering) = false;
    }
}
