//! Parking: a worker session whose turn ended keeps its box for its profile's `keep_attached`
//! (a follow-up starts at once), then gives it back — placement `parked`, the box `idle` in
//! the pool for any session of the same scope, profile and bundle. A session is also parked
//! early, the one idle longest first, when another session needs its worker slot.
//!
//! Parking needs nothing from the box: the turn was reconciled and checkpointed at
//! `turn.finish`, so the session's workspace on the gateway is complete. The session's worker
//! is stopped and its workspace moved out of sight into the box's keep area
//! (`.skiff/kept/<session>`, one session's at a time), with the base manifest of its last turn
//! remembered here ([`KeptWorkspace`]). The box stays in the pool of the same scope, profile
//! and bundle, so only the same owner's sessions can ever take it.
//!
//! The next message places a parked session again, preferring its own previous box when that
//! is idle: the kept workspace moves back and only what differs from the remembered manifest
//! travels (`skiff_sync::outbound::resume`; nothing when nothing changed, in one round trip).
//! Any other placement onto a box deletes whatever the box keeps before laying its own
//! workspace down, so no session ever sees another's files. A session whose own box is taken,
//! gone, or whose branch moved meanwhile is laid down afresh like a new one.
//!
//! Deliberately absent: reserving a box for a parked session (a kept box is anyone's in the
//! pool; keeping only makes coming back cheap) and remembering kept workspaces across a
//! gateway restart (the next taker of such a box clears it).

use super::place::box_workspace;
use crate::error::Result;
use serde_json::json;
use skiff_protocol::SessionId;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::EventKind;
use skiff_store::{Scope, now_ms};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How many sessions a claim parks, one after the other, before it gives up: another request
/// may take the slot a park just freed.
const CLAIM_ATTEMPTS: usize = 3;
/// How long a stopped worker has to exit before it is killed.
const WORKER_EXIT_GRACE_TENTHS: u32 = 50;

/// Where a box keeps parked sessions' workspaces, relative to the box user's home.
pub(crate) const KEEP_AREA: &str = ".skiff/kept";

/// A parked session's workspace kept on its previous box.
#[derive(Clone, Debug)]
pub(crate) struct KeptWorkspace {
    pub(crate) env: skiff_protocol::EnvironmentId,
    /// The base manifest (JSON) of the session's last turn: what the kept workspace holds.
    pub(crate) manifest: String,
    /// Whether the box is back in the pool, once the park has given it back (a message sent
    /// the moment the session is parked waits for that, not for another box).
    pub(crate) pooled: tokio::sync::watch::Receiver<Option<bool>>,
}

/// Where `session`'s workspace is kept on its box while it is parked.
pub(crate) fn kept_dir(session: &SessionId) -> String {
    format!("{KEEP_AREA}/{session}")
}

/// What a box runs before a workspace other than the kept one is laid onto it: everything
/// the box keeps goes.
pub(crate) fn clear_kept_script() -> String {
    format!("cd \"$HOME\" && rm -rf -- {KEEP_AREA} && [ ! -e {KEEP_AREA} ]")
}

impl super::WorkerSide {
    /// Remembers that `env` keeps `session`'s workspace (replacing whatever that box kept
    /// for another session: a box keeps one).
    fn keep(&self, session: &SessionId, kept: KeptWorkspace) {
        let mut all = super::lock(&self.kept);
        all.retain(|_, k| k.env != kept.env);
        all.insert(session.clone(), kept);
    }

    /// The box that keeps `session`'s workspace, if any (forgotten: a placement uses it
    /// once, or lays the workspace afresh).
    pub(crate) fn take_kept(&self, session: &SessionId) -> Option<KeptWorkspace> {
        super::lock(&self.kept).remove(session)
    }

    /// The box that keeps `session`'s workspace, if any, without forgetting it; waits until
    /// the park that is giving it back has done so.
    pub(crate) async fn kept_box(
        &self,
        session: &SessionId,
    ) -> Option<skiff_protocol::EnvironmentId> {
        let (env, mut pooled) = {
            let all = super::lock(&self.kept);
            let kept = all.get(session)?;
            (kept.env.clone(), kept.pooled.clone())
        };
        let back = pooled
            .wait_for(Option::is_some)
            .await
            .ok()?
            .unwrap_or(false);
        back.then_some(env)
    }

    /// Forgets that `env` keeps anything (another session took it, or it is gone).
    pub(crate) fn forget_kept_on(&self, env: &skiff_protocol::EnvironmentId) {
        super::lock(&self.kept).retain(|_, k| &k.env != env);
    }

    /// Parks `session` if it holds a box between turns: moves the placement (checked against
    /// an open run in the same transaction), stops its worker and gives the box back to the
    /// pool. `why` says what made it happen. Returns whether it was parked; `false` when it
    /// is not idle on a box (any more).
    pub(crate) async fn park(&self, scope: &Scope, session: &SessionId, why: &str) -> Result<bool> {
        let Some(was) = self.store.park_placement(scope, session)? else {
            return Ok(false);
        };
        // Known before anyone hears of the park: the next message prefers this box, once it
        // is back in the pool.
        let keeping = match (&was.environment_id, &was.base_manifest) {
            (Some(env), Some(manifest)) => {
                let (tx, pooled) = tokio::sync::watch::channel(None);
                let kept = KeptWorkspace {
                    env: env.clone(),
                    manifest: manifest.clone(),
                    pooled,
                };
                self.keep(session, kept);
                Some(tx)
            }
            _ => None,
        };
        // From here the session is parked: its slot is free, and a message for it places it
        // again (on another box, or this one once it is back in the pool).
        let env = was.environment_id.clone();
        let detail = format!(
            "{why}: its box goes back to the pool; the next message places the session again"
        );
        let event = EventKind::Placement {
            state: PlacementState::Parked,
            environment_id: env.clone(),
            detail: detail.clone(),
        };
        if let Err(e) = self.hub.publish(scope, session, None, event) {
            tracing::warn!(%session, error = %e, "could not publish the parked placement");
        }
        tracing::info!(%session, placement = %PlacementState::Parked, detail, "placement");
        self.live(session)
            .stop_epoch(was.owner_epoch, "the session is parked");
        let pooled = match &env {
            Some(env) => {
                let pooled = self
                    .give_box_back(scope, session, env, was.worker_pid, keeping.is_some())
                    .await;
                if let Some(tx) = keeping {
                    if !pooled {
                        self.take_kept(session);
                    }
                    let _ = tx.send(Some(pooled));
                }
                pooled
            }
            None => false,
        };
        self.audit(
            scope,
            "placement.park",
            session.as_str(),
            "applied",
            json!({
                "env": env.as_ref().map(|e| e.as_str()),
                "epoch": was.owner_epoch,
                "reason": why,
                "box": env.as_ref().map(|_| if pooled { "idle" } else { "destroyed" }),
                "workspace": if pooled { "kept" } else { "gone" },
            }),
        );
        Ok(true)
    }

    /// The lifetime tick: parks every session idle on its box past its profile's
    /// `keep_attached`. A session whose worker is being repaired is left to its repair.
    pub(crate) async fn park_idle_sessions(&self) {
        let idle = match self.store.idle_placements() {
            Ok(idle) => idle,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list idle worker sessions to park");
                return;
            }
        };
        let now = now_ms();
        for p in idle {
            let keep = self.envs.keep_attached(&p.profile);
            let idle_for = Duration::from_millis(u64::try_from(now - p.idle_since_ms).unwrap_or(0));
            if idle_for < keep || self.recovering(&p.session_id) {
                continue;
            }
            let why = format!(
                "idle for {} (keep_attached of profile {} is {})",
                humantime::format_duration(Duration::from_secs(idle_for.as_secs())),
                p.profile,
                humantime::format_duration(keep)
            );
            if let Err(e) = self.park(&p.scope, &p.session_id, &why).await {
                tracing::warn!(session = %p.session_id, error = %e, "could not park an idle session");
            }
        }
    }

    /// Parks the session idle on its box the longest, to free its slot. `false` when no
    /// session is idle on a box: every slot has a turn (or a placement) in flight.
    pub(crate) async fn park_least_recently_used(&self) -> Result<bool> {
        for p in self.store.idle_placements()? {
            if self.recovering(&p.session_id) {
                continue;
            }
            if self
                .park(
                    &p.scope,
                    &p.session_id,
                    "its worker slot was needed by another session",
                )
                .await?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The quick answer before slow work (a new session's workspace): a slot is free, or one
    /// was freed by parking an idle session. Only an answer: the slot itself is claimed by
    /// [`WorkerSide::claim_worker_slot`](super::WorkerSide::claim_worker_slot).
    pub(crate) async fn make_worker_room(&self) -> Result<()> {
        let max = self.max_workers;
        for _ in 0..CLAIM_ATTEMPTS {
            let Some(refusal) = self.store.worker_slots()?.refusal(max) else {
                return Ok(());
            };
            if !self.park_least_recently_used().await? {
                return Err(refusal.into());
            }
        }
        match self.store.worker_slots()?.refusal(max) {
            Some(refusal) => Err(refusal.into()),
            None => Ok(()),
        }
    }

    /// Claims a worker slot with `claim`, which counts and claims in one immediate
    /// transaction (`request_placement`, or a new session's rows). When every slot is taken,
    /// the session idle the longest is parked and the claim tried again, a bounded number of
    /// times; the refusal comes only when no session is idle on a box.
    pub(crate) async fn claim_worker_slot<T>(
        &self,
        claim: impl Fn(u64) -> skiff_store::Result<T>,
    ) -> Result<T> {
        let max = self.max_workers;
        for _ in 0..CLAIM_ATTEMPTS {
            match claim(max) {
                Err(skiff_store::Error::WorkersAtCapacity { .. }) => {
                    if !self.park_least_recently_used().await? {
                        break;
                    }
                }
                other => return Ok(other?),
            }
        }
        Ok(claim(max)?)
    }
}

/// What stops a session's worker on its box, run there: asked first, killed after a grace;
/// only a process that is still the `skiff worker` it started, so a reused pid is left alone.
/// The commands its tools started die with it (each runs contained, as the init of its own
/// PID namespace, killed when the worker goes). Exits 0 once the worker is gone.
pub(super) fn stop_worker_script(worker_pid: Option<i64>) -> String {
    let pid = worker_pid.map(|p| p.to_string()).unwrap_or_default();
    format!(
        "set -u; p='{pid}'; \
         ours() {{ [ -n \"$p\" ] && tr '\\0' ' ' </proc/\"$p\"/cmdline 2>/dev/null | grep -q -- ' worker --socket '; }}; \
         if ours; then kill -TERM \"$p\" 2>/dev/null; n=0; \
         while ours && [ $n -lt {WORKER_EXIT_GRACE_TENTHS} ]; do sleep 0.1; n=$((n+1)); done; \
         if ours; then kill -KILL \"$p\" 2>/dev/null; fi; fi; ! ours"
    )
}

/// What clears a parked session off its box, run there: its worker stopped
/// ([`stop_worker_script`]), its workspace and the worker's log removed. Prints the home
/// directory (the tunnel's socket is under it) and fails unless the workspace is gone.
fn clear_script(session: &SessionId, worker_pid: Option<i64>) -> String {
    let workspace = skiff_ssh::shell_quote(&box_workspace(session));
    format!(
        "{stop}; cd \"$HOME\" || exit 1; \
         rm -rf -- {workspace} && rm -f -- .skiff/worker.log && [ ! -e {workspace} ] && printf %s \"$HOME\"",
        stop = stop_worker_script(worker_pid)
    )
}

/// What moves a parked session's workspace into the box's keep area, run there: its worker
/// stopped ([`stop_worker_script`]), whatever the box kept before removed (a box keeps one
/// session's), the workspace moved, the worker's log removed. Prints the home directory and
/// fails unless the workspace is out of its place.
fn keep_script(session: &SessionId, worker_pid: Option<i64>) -> String {
    let workspace = skiff_ssh::shell_quote(&box_workspace(session));
    let kept = skiff_ssh::shell_quote(&kept_dir(session));
    format!(
        "{stop}; cd \"$HOME\" || exit 1; \
         rm -rf -- {KEEP_AREA} && mkdir -p -m 700 {KEEP_AREA} && \
         {{ [ ! -d {workspace} ] || [ -L {workspace} ] || mv -- {workspace} {kept}; }} && \
         rm -rf -- {workspace} && rm -f -- .skiff/worker.log && [ ! -e {workspace} ] && printf %s \"$HOME\"",
        stop = stop_worker_script(worker_pid)
    )
}

impl super::WorkerSide {
    /// Stops the session's worker, removes its workspace (or, with `keep`, moves it into the
    /// box's keep area) and the tunnel to it, and puts the box in the idle pool (or destroys it
    /// when that cannot be done). Returns whether the box is in the pool. The session no
    /// longer names the box (parked, or home).
    pub(super) async fn give_box_back(
        &self,
        scope: &Scope,
        session: &SessionId,
        env: &skiff_protocol::EnvironmentId,
        worker_pid: Option<i64>,
        keep: bool,
    ) -> bool {
        self.close_worker_endpoint(env);
        if !keep {
            self.forget_kept_on(env);
        }
        let row = match self.store.environment(scope, env) {
            Ok(row) => row,
            Err(e) => {
                tracing::warn!(%session, %env, error = %e, "cannot read the parked session's box");
                return false;
            }
        };
        let clear = async {
            let ssh = self.envs.ssh(&row)?;
            let cancel = CancellationToken::new();
            let script = if keep {
                keep_script(session, worker_pid)
            } else {
                clear_script(session, worker_pid)
            };
            let home = ssh.run(&script, &cancel).await?;
            let remote_socket = format!("{}/.skiff/worker.sock", home.trim());
            if let Err(e) = ssh
                .cancel_forward(&remote_socket, &self.socket_path(env), &cancel)
                .await
            {
                // The endpoint it led to is closed, and the next placement on this box
                // forwards the same socket to the same endpoint again.
                tracing::debug!(%env, error = %e, "cancelling the worker forward");
            }
            Ok(())
        };
        self.envs.release_to_pool(scope, env, clear).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clear_script_removes_only_the_sessions_workspace() {
        let session = SessionId::from_suffix("abc");
        let script = clear_script(&session, Some(42));
        assert!(script.contains("p='42'"), "{script}");
        assert!(script.contains("rm -rf -- workspaces/ses_abc "), "{script}");
        assert!(script.contains("[ ! -e workspaces/ses_abc ]"), "{script}");
        let none = clear_script(&session, None);
        assert!(none.contains("p=''"), "{none}");
    }

    #[test]
    fn the_keep_script_moves_the_workspace_out_of_sight() {
        let session = SessionId::from_suffix("abc");
        let script = keep_script(&session, Some(42));
        assert!(script.contains("p='42'"), "{script}");
        assert!(
            script.contains("mv -- workspaces/ses_abc .skiff/kept/ses_abc"),
            "{script}"
        );
        assert!(script.contains("rm -rf -- .skiff/kept &&"), "{script}");
        assert!(script.contains("[ ! -e workspaces/ses_abc ]"), "{script}");
    }
}
