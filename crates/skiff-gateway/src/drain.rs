//! `skiff gateway drain` (issue 17): a gateway hands its sessions to the other gateways on
//! its database and exits, so a rolling upgrade loses no turn.
//!
//! In order: the gateway marks itself draining (`/readyz` answers 503 so load balancers stop
//! sending; a turn sent to it is forwarded to another gateway, see `forward.rs`, or refused
//! 503); every session lease it holds is released in the database and the session's work
//! here stopped — the running turns are not waited for: the release refuses their fenced
//! writes at once, their cancel stops their model calls and tools, and the other gateways
//! claim the released sessions at their next lease round (not after an expiry) and go on with
//! each running turn as a new attempt, a tool call that was in flight getting the "no result
//! was recorded" result as on a takeover. A session's worker connection is closed cleanly and
//! its box left alone (the new owner re-adopts it). Then the gateway waits for its stopped
//! turns to let go, releases its gateway-wide chores, leaves the registry and exits 0.
//!
//! With no other live gateway a drain is refused unless forced; forced, the running turns are
//! stopped and orphaned as at a restart.

use crate::chores::{AUDIT_ARCHIVE, SWEEPER};
use crate::{Core, Error, Result};
use serde_json::json;
use skiff_protocol::drain::{DrainLine, DrainReport};
use skiff_store::LeaseKey;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long the stopped turns get to let go before the gateway leaves without them (their
/// writes are refused by then anyway; only their clean-up is cut short).
const LET_GO: Duration = Duration::from_secs(30);
/// How often the drain looks whether its stopped turns are gone.
const LOOK_EVERY: Duration = Duration::from_millis(50);

impl Core {
    /// Starts draining this gateway; the lines of its progress arrive on the receiver, the
    /// last one the report, after which the process is told to exit. Refused (nothing
    /// changed) when already draining, or when no other gateway is live and `force` is off.
    pub(crate) async fn drain(
        self: &Arc<Self>,
        force: bool,
    ) -> Result<mpsc::UnboundedReceiver<DrainLine>> {
        let core = self.clone();
        let others = tokio::task::spawn_blocking(move || core.cluster.others())
            .await
            .map_err(|e| Error::Internal(format!("the drain's check failed: {e}")))??;
        if others.is_empty() && !force {
            return Err(Error::Conflict(format!(
                "gateway {} is the only live gateway on its database: no other would take its \
                 sessions over. Start another gateway first, or drain with --force to stop its \
                 running turns (they end orphaned, as at a restart)",
                self.cluster.id()
            )));
        }
        if self.cluster.is_draining() {
            return Err(Error::Conflict(format!(
                "gateway {} is already draining",
                self.cluster.id()
            )));
        }
        self.cluster.start_draining();
        tracing::warn!(gateway = %self.cluster.id(), others = others.len(), force,
            "draining: handing this gateway's sessions to the other gateways");
        let (tx, rx) = mpsc::unbounded_channel();
        let core = self.clone();
        tokio::spawn(async move {
            let report = core.hand_over(!others.is_empty(), &tx).await;
            let _ = tx.send(DrainLine::Drained(report));
            drop(tx);
            core.drained.cancel();
        });
        Ok(rx)
    }

    /// The drain's work once it is marked: see the module doc.
    async fn hand_over(
        self: &Arc<Self>,
        others: bool,
        progress: &mpsc::UnboundedSender<DrainLine>,
    ) -> DrainReport {
        let started = Instant::now();
        let turns = self.running.lock().map(|m| m.len()).unwrap_or_default() as u64;
        let core = self.clone();
        let handed = tokio::task::spawn_blocking(move || core.cluster.hand_over_all())
            .await
            .unwrap_or_default();
        let scope = crate::auth::unattributed_scope();
        for session in &handed {
            // Cleanly, and without touching the box: whoever takes the session re-adopts it.
            self.workers.live(session).close();
            self.audit(
                &scope,
                "session.handover",
                session.as_str(),
                "applied",
                json!({ "gateway": self.cluster.id().as_str(), "others": others }),
            );
        }
        let _ = progress.send(DrainLine::Progress { turns, left: turns });
        let deadline = Instant::now() + LET_GO;
        let mut told = turns;
        loop {
            let left = self.running.lock().map(|m| m.len()).unwrap_or_default() as u64;
            if left != told {
                told = left;
                let _ = progress.send(DrainLine::Progress { turns, left });
            }
            if left == 0 {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    left,
                    "stopped turns did not let go within {} s; leaving without them",
                    LET_GO.as_secs()
                );
                break;
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
        let core = self.clone();
        let finished = tokio::task::spawn_blocking(move || core.leave(others)).await;
        match finished {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the drain could not finish cleanly"),
            Err(e) => tracing::warn!(error = %e, "the drain could not finish cleanly"),
        }
        let report = DrainReport {
            gateway: self.cluster.id().clone(),
            handed_over: handed.len() as u64,
            turns,
            others,
            seconds: started.elapsed().as_secs_f64(),
        };
        self.audit(
            &scope,
            "gateway.drain",
            self.cluster.id().as_str(),
            "applied",
            json!({ "handed_over": report.handed_over, "turns": turns, "others": others }),
        );
        tracing::warn!(gateway = %report.gateway, handed_over = report.handed_over, turns,
            seconds = report.seconds, "drained; exiting");
        report
    }

    /// The drain's last steps: with nobody to go on with them, the turns stopped here end
    /// orphaned (as at a restart); the chores' leases go; the gateway leaves the registry.
    fn leave(&self, others: bool) -> Result<()> {
        if !others {
            self.reconcile_on_start()?;
        }
        for chore in [SWEEPER, AUDIT_ARCHIVE] {
            let key = LeaseKey::singleton(chore);
            if let Some(lease) = self.store.lease(&key)?
                && lease.holder == *self.cluster.id()
            {
                self.store.release_lease(&lease)?;
            }
        }
        self.cluster.deregister()
    }
}

#[cfg(test)]
mod tests {
    use axum::body::to_bytes;
    use axum::extract::State;
    use axum::http::StatusCode;
    use skiff_protocol::drain::DrainLine;
    use tokio_util::sync::CancellationToken;

    async fn readyz(core: &std::sync::Arc<crate::Core>) -> (StatusCode, String) {
        let answer = crate::metrics::readyz(State(core.clone())).await;
        let status = answer.status();
        let body = to_bytes(answer.into_body(), 1 << 16).await.unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// A gateway alone on its database refuses a drain that is not forced and stays ready;
    /// forced, it says "draining" on `/readyz` for as long as a stopped turn has not let go,
    /// refuses turns, and tells the process to exit once the turn is gone.
    #[tokio::test]
    async fn a_lone_gateway_drains_only_when_forced_and_is_not_ready_while_it_drains()
    -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (core, _, _) = crate::open_core(&crate::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: None,
        })
        .await?;
        let Err(refused) = core.drain(false).await else {
            anyhow::bail!("a lone gateway drained without --force");
        };
        let said = refused.to_string();
        assert!(
            said.contains("only live gateway") && said.contains("--force"),
            "{said}"
        );
        assert_eq!(readyz(&core).await.0, StatusCode::OK);
        assert!(!core.cluster.is_draining());

        // A turn that has not let go yet holds the drain at its wait.
        let run = skiff_protocol::RunId::parse("run_0000000000000001").unwrap();
        let turn = CancellationToken::new();
        core.running
            .lock()
            .unwrap()
            .insert(run.clone(), turn.clone());
        let mut lines = core.drain(true).await?;
        assert_eq!(
            lines.recv().await,
            Some(DrainLine::Progress { turns: 1, left: 1 })
        );
        let (status, body) = readyz(&core).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.starts_with("draining"), "{body}");
        let session = skiff_protocol::SessionId::parse("ses_0000000000000001").unwrap();
        let err = core.own_session(&session).unwrap_err().to_string();
        assert!(err.contains("is draining"), "{err}");
        assert!(!core.drained.is_cancelled());

        core.running.lock().unwrap().remove(&run);
        assert_eq!(
            lines.recv().await,
            Some(DrainLine::Progress { turns: 1, left: 0 })
        );
        let Some(DrainLine::Drained(report)) = lines.recv().await else {
            anyhow::bail!("the drain sent no report");
        };
        assert_eq!((report.turns, report.others), (1, false));
        assert_eq!(&report.gateway, core.cluster.id());
        assert!(lines.recv().await.is_none());
        assert!(core.drained.is_cancelled());
        // It left the registry.
        assert!(core.store.gateways(core.cluster.lease_ttl())?.is_empty());
        Ok(())
    }
}
