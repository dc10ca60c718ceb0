//! Where a box meets the egress proxy: one [`Egress`] per environment, serving a unix socket
//! under `<state>/egress/`, reached from the box through a remote forward of the box's own
//! control connection to a loopback port on the box (the box still has no route of its own).
//!
//! Setup always gets the proxy (with `egress.setup`, or nothing allowed, so a refused request
//! is a readable 403 naming the key to change rather than a DNS failure); when setup ends the
//! forward is removed and a probe from the box proves it closed before the worker starts. The
//! agent phase gets the proxy only when the profile has `egress.agent`; then the worker is
//! launched with the proxy variables and hands them to `exec`.
//!
//! The port on the box derives from the environment id, so a repaired control connection or a
//! restarted gateway forwards the same port the worker's variables name.

use crate::egress::{Decision, Egress, HostCounters, Options, Phase, Policy};
use crate::error::{Error, Result};
use serde_json::json;
use skiff_protocol::EnvironmentId;
use skiff_store::{EnvironmentRow, Scope};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// One environment's proxy while a phase uses it.
struct Gate {
    egress: Egress,
    port: u16,
}

/// The gateway's egress gates, and what finished ones counted.
#[derive(Default)]
pub(crate) struct Gates {
    open: Mutex<HashMap<EnvironmentId, Gate>>,
    /// Counters of phases that ended, per environment (shown by `env show`).
    finished: Mutex<HashMap<EnvironmentId, Vec<HostCounters>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The loopback port on the box that reaches the proxy (stable per environment).
pub(crate) fn box_port(env: &EnvironmentId) -> u16 {
    let hash = blake3::hash(env.as_str().as_bytes());
    let [a, b, ..] = *hash.as_bytes();
    20_000 + u16::from_be_bytes([a, b]) % 40_000
}

/// The variables that send a process's HTTP(S) through the proxy at `port`.
fn proxy_env(port: u16) -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{port}");
    let mut env = Vec::new();
    for (key, value) in [
        ("HTTP_PROXY", url.as_str()),
        ("HTTPS_PROXY", url.as_str()),
        // Only the box's own name; an address is a target like any other (and refused unless
        // an exact rule names it).
        ("NO_PROXY", "localhost"),
    ] {
        env.push((key.to_owned(), value.to_owned()));
        env.push((key.to_lowercase(), value.to_owned()));
    }
    env
}

impl super::WorkerSide {
    fn egress_socket(&self, env: &EnvironmentId) -> PathBuf {
        self.egress_dir.join(format!("{env}.sock"))
    }

    /// The policy of `phase` for a profile; `None` when the profile gives the agent no egress.
    fn egress_policy(&self, profile: &str, phase: Phase) -> Result<Option<Policy>> {
        let config = self.envs.profile_config(profile)?;
        let (rules, name) = match phase {
            Phase::Setup => (&config.egress.setup, "setup"),
            Phase::Agent => (&config.egress.agent, "agent"),
        };
        let key = format!("profiles.{profile}.egress.{name}");
        if rules.is_empty() {
            return Ok((phase == Phase::Setup).then(|| Policy::none(key)));
        }
        Policy::parse(key, rules)
            .map(Some)
            .map_err(|e| Error::BadProfile(e.to_string()))
    }

    /// Opens (or re-forwards) the environment's proxy for `phase` and returns the variables a
    /// process on the box needs to use it; `None` when the phase gets no egress.
    pub(super) async fn open_egress(
        &self,
        env: &EnvironmentRow,
        profile: &str,
        phase: Phase,
        cancel: &CancellationToken,
    ) -> Result<Option<Vec<(String, String)>>> {
        let Some(policy) = self.egress_policy(profile, phase)? else {
            return Ok(None);
        };
        let port = box_port(&env.id);
        let socket = self.egress_socket(&env.id);
        let started = {
            let mut open = lock(&self.egress.open);
            match open.get(&env.id) {
                Some(gate) => {
                    // A swap ends the connections of the previous phase; the same phase keeps
                    // them (a repair re-opens, it does not change what is allowed).
                    if gate.egress.phase() != phase {
                        gate.egress.set_policy(phase, policy);
                    }
                    false
                }
                None => {
                    let egress = Egress::new(phase, policy, self.egress_options(env));
                    let listener = bind(&socket)?;
                    let serving = egress.clone();
                    tokio::spawn(async move { serving.serve(listener).await });
                    open.insert(env.id.clone(), Gate { egress, port });
                    true
                }
            }
        };
        let ssh = self.envs.ssh(env)?;
        if let Err(e) = ssh.forward_port(port, &socket, cancel).await {
            // A forward that is already there (the same port, the same socket) is what we want;
            // anything else leaves the phase without egress, which a probe would show.
            if started {
                self.close_egress_gate(&env.id);
                return Err(e.into());
            }
            tracing::debug!(env = %env.id, error = %e, "egress forward request");
        }
        Ok(Some(proxy_env(port)))
    }

    /// Ends setup's egress: removes the forward, proves from the box that the port no longer
    /// answers, and stops the proxy (its counters are kept for `env show`).
    pub(super) async fn close_setup_egress(
        &self,
        env: &EnvironmentRow,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let port = box_port(&env.id);
        let ssh = self.envs.ssh(env)?;
        let removed = ssh
            .cancel_port_forward(port, &self.egress_socket(&env.id), cancel)
            .await;
        self.close_egress_gate(&env.id);
        if let Err(e) = removed {
            tracing::debug!(env = %env.id, error = %e, "egress forward cancel");
        }
        // Proof, not hope: a connection from the box to the port must fail now.
        let probe = format!(
            "bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' 2>/dev/null && echo open || echo closed"
        );
        let answer = ssh.run(&probe, cancel).await?;
        if answer.trim() != "closed" {
            return Err(Error::BoxFailed(format!(
                "the egress forward to port {port} on {} still answers after setup; the worker was not started",
                env.id
            )));
        }
        Ok(())
    }

    /// Forwards the open gate's port again (a repaired control connection lost it).
    pub(super) async fn reforward_egress(
        &self,
        env: &EnvironmentRow,
        ssh: &skiff_ssh::Ssh,
        cancel: &CancellationToken,
    ) {
        let open = lock(&self.egress.open).get(&env.id).map(|g| g.port);
        if let Some(port) = open
            && let Err(e) = ssh
                .forward_port(port, &self.egress_socket(&env.id), cancel)
                .await
        {
            tracing::debug!(env = %env.id, error = %e, "egress forward request");
        }
    }

    /// The agent phase's proxy variables for a worker on `env`, when its gate is open.
    pub(super) fn agent_egress_env(&self, env: &EnvironmentId) -> Vec<(String, String)> {
        lock(&self.egress.open)
            .get(env)
            .filter(|g| g.egress.phase() == Phase::Agent)
            .map(|g| proxy_env(g.port))
            .unwrap_or_default()
    }

    /// Stops the environment's proxy, if one is open, keeping what it counted.
    pub(crate) fn close_egress_gate(&self, env: &EnvironmentId) {
        let gate = lock(&self.egress.open).remove(env);
        if let Some(gate) = gate {
            gate.egress.stop();
            let mut finished = lock(&self.egress.finished);
            let kept = finished.entry(env.clone()).or_default();
            kept.retain(|c| c.phase != gate.egress.phase());
            kept.extend(gate.egress.counters());
        }
        let _ = std::fs::remove_file(self.egress_socket(env));
    }

    /// Per-host egress counters of an environment: finished phases and the open one.
    pub(crate) fn egress_counters(&self, env: &EnvironmentId) -> Vec<HostCounters> {
        let mut all = lock(&self.egress.finished)
            .get(env)
            .cloned()
            .unwrap_or_default();
        if let Some(gate) = lock(&self.egress.open).get(env) {
            let phase = gate.egress.phase();
            all.retain(|c| c.phase != phase);
            all.extend(gate.egress.counters());
        }
        all
    }

    /// Every decision is an audit row of the environment's owner (host, port, phase and
    /// verdict only: never a path or header).
    fn egress_options(&self, env: &EnvironmentRow) -> Options {
        let store = self.store.clone();
        let scope: Scope = env.scope.clone();
        let target = env.id.to_string();
        let audit = Arc::new(move |d: &Decision| {
            let decision = if d.allowed() { "allowed" } else { "refused" };
            let detail = json!({ "phase": d.phase, "key": d.key, "host": d.host, "port": d.port, "verdict": d.verdict });
            if let Err(e) = store.audit(
                &scope,
                "egress",
                "egress.request",
                &target,
                decision,
                &detail,
            ) {
                tracing::warn!(error = %e, "could not write an egress audit row");
            }
        });
        Options {
            audit: Some(audit),
            ..Options::default()
        }
    }
}

fn bind(socket: &std::path::Path) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(dir) = socket.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::Internal(format!("cannot make {}: {e}", dir.display())))?;
    }
    let _ = std::fs::remove_file(socket);
    tokio::net::UnixListener::bind(socket).map_err(|e| {
        Error::Internal(format!(
            "cannot listen for the egress proxy on {}: {e}",
            socket.display()
        ))
    })
}
