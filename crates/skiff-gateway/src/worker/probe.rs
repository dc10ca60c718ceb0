//! Readiness of an environment: after bootstrap, a worker is started on the box with a
//! credential that allows the canary and nothing else, admitted like any worker, and asked to
//! stream the canary through the inference proxy. Only then is the environment `ready`. The
//! probe worker is told to shut down afterwards; session workers are started per session.

use crate::error::Result;
use futures_util::future::BoxFuture;
use skiff_protocol::worker::{GatewayFrame, Method};
use skiff_protocol::{EnvironmentId, SessionId};
use skiff_store::EnvironmentRow;
use std::sync::{Arc, Weak};

const PROBE_PREFIX: &str = "probe";

/// The pseudo-session a readiness probe's credential is bound to.
pub(crate) fn probe_session(env: &EnvironmentId) -> SessionId {
    let suffix = env.as_str().trim_start_matches(EnvironmentId::PREFIX);
    SessionId::from_suffix(&format!("{PROBE_PREFIX}{suffix}"))
}

pub(crate) fn is_probe(session: &SessionId) -> bool {
    session
        .as_str()
        .trim_start_matches(SessionId::PREFIX)
        .starts_with(PROBE_PREFIX)
}

/// What the environments call once a box is bootstrapped.
pub(crate) trait Readiness: Send + Sync {
    fn verify<'a>(&'a self, env: &'a EnvironmentRow) -> BoxFuture<'a, Result<()>>;
}

/// The gateway's readiness check (weak: the environments keep no worker side alive).
pub(crate) struct Probe(pub Weak<super::WorkerSide>);

impl Readiness for Probe {
    fn verify<'a>(&'a self, env: &'a EnvironmentRow) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let Some(workers) = self.0.upgrade() else {
                return Err(crate::Error::Unavailable(
                    "the gateway is shutting down".into(),
                ));
            };
            workers.probe(env).await
        })
    }
}

impl super::WorkerSide {
    /// Launches a probe worker the way a placement launches one (`launch_verified`).
    async fn probe(self: &Arc<Self>, env: &EnvironmentRow) -> Result<()> {
        let session = probe_session(&env.id);
        let result = self
            .launch_verified(env, &session, 0, vec![Method::ModelStream], |_| Ok(()))
            .await;
        let live = self.live(&session);
        live.send(GatewayFrame::Shutdown {
            reason: "the environment is ready".into(),
        });
        live.close();
        self.forget(&session);
        self.close_probe_endpoint(&env.id);
        result
    }

    /// The probe opened the environment's endpoint; unless a session's worker uses it (a
    /// check of an attached environment), it closes with the probe, socket and all. A
    /// placement opens it again.
    fn close_probe_endpoint(&self, env: &EnvironmentId) {
        match self.store.live_placements() {
            Ok(live) if live.iter().all(|p| p.environment_id.as_ref() != Some(env)) => {
                self.close_worker_endpoint(env);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%env, error = %e, "cannot list placements; the probe's endpoint stays open");
            }
        }
    }
}
