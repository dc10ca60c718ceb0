//! The worker endpoint: a unix socket per attached environment, admission, and the frame loop
//! of each connection.
//!
//! INVARIANT: the socket lives in the 0700 state dir and is reached from a box only through
//! the reverse forward of that environment's own SSH connection, so the socket a connection
//! arrives on names its environment; a credential for another environment is refused.

use super::{CANARY_MODEL, Live, lock};
use serde_json::json;
use skiff_protocol::EnvironmentId;
use skiff_protocol::worker::{
    Call, CredentialClaims, GatewayFrame, Method, PROTOCOL_VERSION, RefusalCode, WorkerFrame,
};
use skiff_store::{Scope, now_ms};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A refusal: what the worker is told, and what the audit records.
pub(super) struct Refusal {
    pub code: RefusalCode,
    pub message: String,
}

pub(super) fn refuse(code: RefusalCode, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

/// An admitted connection.
pub(super) struct Admitted {
    pub scope: Scope,
    pub claims: CredentialClaims,
    pub live: Arc<Live>,
    pub conn_id: u64,
    /// Calls that run beside the frame loop (tools, turn ends), bounded per connection.
    pub in_flight: Arc<tokio::sync::Semaphore>,
    /// The session's lifecycle revision at admission (v1 never changes it).
    pub revision: u64,
    /// Live events applied but not yet acknowledged: acknowledgements go out in batches.
    pub pending_ack: std::sync::Mutex<Option<u64>>,
}

/// Acknowledge live events at least every this many, and whenever the worker's frames pause.
const ACK_EVERY: u64 = 64;

/// How many long calls one worker connection may have in flight.
pub(super) const MAX_CALLS_IN_FLIGHT: usize = 8;

impl super::WorkerSide {
    /// Listens for `env`'s worker (idempotent).
    pub(crate) fn open_worker_endpoint(self: &Arc<Self>, env: &EnvironmentId) -> crate::Result<()> {
        let mut listeners = lock(&self.listeners);
        if listeners.contains_key(env) {
            return Ok(());
        }
        if self.stopping.is_cancelled() {
            return Err(crate::Error::Internal(
                "the gateway is stopping; workers connect to the next one".into(),
            ));
        }
        std::fs::create_dir_all(&self.socket_dir).map_err(|e| {
            crate::Error::Internal(format!(
                "cannot create the worker socket directory {}: {e}",
                self.socket_dir.display()
            ))
        })?;
        let path = self.socket_path(env);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|e| {
            crate::Error::Internal(format!(
                "cannot listen for workers on {}: {e}",
                path.display()
            ))
        })?;
        let stop = CancellationToken::new();
        listeners.insert(env.clone(), stop.clone());
        let workers = self.clone();
        let env = env.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            let workers = workers.clone();
                            let env = env.clone();
                            tokio::spawn(async move { workers.serve_worker(env, stream).await });
                        }
                        Err(e) => {
                            tracing::warn!(%env, error = %e, "worker endpoint accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
        });
        Ok(())
    }

    pub(super) async fn serve_worker(self: Arc<Self>, env: EnvironmentId, stream: UnixStream) {
        let (read, mut write) = stream.into_split();
        let mut reader = BufReader::new(read);
        let first = tokio::select! {
            first = tokio::time::timeout(Duration::from_secs(10), skiff_wire::read_line(&mut reader)) => first,
            // The gateway is stopping: the worker says hello to the next one.
            () = self.stopping.cancelled() => return,
        };
        let admitted = match first {
            Ok(Ok(Some(line))) => self.admit(&env, &line),
            _ => Err(refuse(RefusalCode::BadFrame, "no hello within 10 s")),
        };
        let admitted = match admitted {
            Ok(a) => a,
            Err(r) => {
                // The environment's owner, whatever its state; never somebody else.
                let scope = match self.store.environment_owner(&env) {
                    Ok(Some(owner)) => owner,
                    Ok(None) => crate::auth::unattributed_scope(),
                    Err(e) => {
                        tracing::warn!(%env, error = %e, "could not look up who owns the environment of a refused worker");
                        crate::auth::unattributed_scope()
                    }
                };
                self.audit_worker(
                    &scope,
                    "worker.admit",
                    env.as_str(),
                    "refused",
                    json!({ "code": r.code.as_str(), "reason": r.message }),
                );
                tracing::warn!(%env, code = r.code.as_str(), reason = r.message, "refused a worker");
                let frame = GatewayFrame::Refused {
                    code: r.code,
                    message: r.message,
                };
                let _ = skiff_wire::write_frame(&mut write, &frame).await;
                return;
            }
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<GatewayFrame>();
        // The welcome goes first: nothing may reach the worker before it.
        if let Err(e) = self.welcome(&admitted, &tx) {
            tracing::warn!(%env, error = %e, "could not welcome a worker");
            return;
        }
        let closed =
            admitted
                .live
                .connect(admitted.conn_id, admitted.claims.owner_epoch, tx.clone());
        let writer = tokio::spawn(async move {
            while let Some(frame) = rx.recv().await {
                if skiff_wire::write_frame(&mut write, &frame).await.is_err() {
                    break;
                }
            }
        });
        let session = admitted.claims.session_id.clone();
        tracing::info!(%env, %session, epoch = admitted.claims.owner_epoch, "worker admitted");
        self.after_admission(&admitted).await;
        loop {
            let line = tokio::select! {
                _ = closed.cancelled() => break,
                _ = self.stopping.cancelled() => break,
                line = skiff_wire::read_line(&mut reader) => line,
            };
            let line = match line {
                Ok(Some(line)) => line,
                Ok(None) => break,
                Err(skiff_wire::Error::Io(_)) => break,
                Err(e) => {
                    let code = match e {
                        skiff_wire::Error::TooLarge => RefusalCode::TooLarge,
                        _ => RefusalCode::BadFrame,
                    };
                    self.audit_worker(
                        &admitted.scope,
                        "worker.frame",
                        session.as_str(),
                        "refused",
                        json!({ "code": code.as_str(), "reason": e.to_string() }),
                    );
                    let _ = tx.send(GatewayFrame::Refused {
                        code,
                        message: format!("{e}; the connection is closed"),
                    });
                    break;
                }
            };
            let frame = match serde_json::from_str::<WorkerFrame>(&line) {
                Ok(frame) => frame,
                Err(e) => {
                    let reason = format!("not a frame of worker protocol {PROTOCOL_VERSION}: {e}");
                    self.audit_worker(
                        &admitted.scope,
                        "worker.frame",
                        session.as_str(),
                        "refused",
                        json!({ "code": "bad_frame", "reason": reason }),
                    );
                    let _ = tx.send(GatewayFrame::Refused {
                        code: RefusalCode::BadFrame,
                        message: reason,
                    });
                    continue;
                }
            };
            self.on_frame(&admitted, frame).await;
            // Batched acknowledgements: when the worker's frames pause, or every ACK_EVERY.
            let mut pending = lock(&admitted.pending_ack);
            if let Some(seq) = *pending
                && (reader.buffer().is_empty() || seq % ACK_EVERY == 0)
            {
                admitted
                    .live
                    .send_on(admitted.conn_id, GatewayFrame::EventAck { seq });
                *pending = None;
            }
        }
        admitted.live.disconnect(admitted.conn_id);
        // What was queued (a shutdown, a last reply) still goes out; a worker that stopped
        // reading does not hold the connection open.
        drop(tx);
        let abort = writer.abort_handle();
        if tokio::time::timeout(Duration::from_secs(2), writer)
            .await
            .is_err()
        {
            abort.abort();
        }
        tracing::info!(%env, %session, "worker connection closed");
        if self.stopping.is_cancelled() {
            // The gateway is stopping: the worker reconnects to the next one.
            return;
        }
        self.on_worker_disconnect(&admitted.scope, &session, admitted.claims.owner_epoch);
    }

    async fn on_frame(self: &Arc<Self>, a: &Admitted, frame: WorkerFrame) {
        // A credential rotation comes on a timer whatever the turn does: it is not progress.
        if !matches!(
            frame,
            WorkerFrame::Call {
                call: Call::CredentialRotate { .. },
                ..
            }
        ) {
            a.live.touch();
        }
        match frame {
            WorkerFrame::Hello { .. } => {
                self.audit_worker(
                    &a.scope,
                    "worker.frame",
                    a.claims.session_id.as_str(),
                    "refused",
                    json!({ "code": "bad_frame", "reason": "a second hello" }),
                );
                a.live.send_on(
                    a.conn_id,
                    GatewayFrame::Refused {
                        code: RefusalCode::BadFrame,
                        message: "already admitted".into(),
                    },
                );
            }
            WorkerFrame::Call { op, call } => self.on_call(a, op, call).await,
            WorkerFrame::ModelAck { seq, received } => {
                self.model_ack(&a.claims.session_id, a.claims.owner_epoch, seq, received);
            }
            WorkerFrame::ModelCancel { seq } => {
                self.model_cancel(&a.claims.session_id, a.claims.owner_epoch, seq);
            }
            WorkerFrame::CanaryAnswer { nonce, text } => a.live.answer_canary(&nonce, text),
        }
    }

    pub(crate) fn close_worker_endpoint(&self, env: &EnvironmentId) {
        if let Some(stop) = lock(&self.listeners).remove(env) {
            stop.cancel();
        }
        let _ = std::fs::remove_file(self.socket_path(env));
        self.close_egress_gate(env);
    }

    /// Checks a hello: signature, expiry, bindings, build, protocol, one use.
    pub(super) fn admit(&self, env: &EnvironmentId, line: &str) -> Result<Admitted, Refusal> {
        let hello = serde_json::from_str::<WorkerFrame>(line).map_err(|e| {
            refuse(
                RefusalCode::BadFrame,
                format!("the first frame must be a hello: {e}"),
            )
        })?;
        let WorkerFrame::Hello {
            protocol_version,
            build_hash,
            features,
            credential,
        } = hello
        else {
            return Err(refuse(
                RefusalCode::BadFrame,
                "the first frame must be a hello",
            ));
        };
        if protocol_version != PROTOCOL_VERSION {
            return Err(refuse(
                RefusalCode::ProtocolMismatch,
                format!(
                    "this gateway speaks worker protocol {PROTOCOL_VERSION}, not {protocol_version}"
                ),
            ));
        }
        let claims = self
            .signer
            .verify(&credential)
            .map_err(|e| refuse(RefusalCode::BadCredential, e.to_string()))?;
        if &claims.environment_id != env {
            return Err(refuse(
                RefusalCode::WrongScope,
                format!(
                    "the credential is for {}, not this environment",
                    claims.environment_id
                ),
            ));
        }
        if claims.expires_at_ms <= now_ms() {
            return Err(refuse(
                RefusalCode::CredentialExpired,
                "the credential has expired",
            ));
        }
        // A worker acts with its session owner's rights, and with nobody else's: an owner who
        // was removed has none left.
        let owner = self
            .store
            .environment_owner(env)
            .and_then(|owner| match owner {
                Some(scope) => Ok(Some((self.store.user_of(&scope)?.is_some(), scope))),
                None => Ok(None),
            });
        match owner {
            // An environment that is gone is refused below, with the other checks of its row.
            Ok(None) | Ok(Some((true, _))) => {}
            Ok(Some((false, scope))) => {
                return Err(refuse(
                    RefusalCode::Forbidden,
                    format!(
                        "the owner of this box's session ({}) is no longer a user of this gateway, so its worker is not admitted; add the user again to let it work",
                        scope.owner_id
                    ),
                ));
            }
            Err(e) => {
                return Err(refuse(
                    RefusalCode::Unavailable,
                    format!("could not look up the session's owner ({e}); try again"),
                ));
            }
        }
        let gateway_hash = self.envs.bundle_hash_now();
        if build_hash != claims.bundle_hash || Some(&build_hash) != gateway_hash.as_ref() {
            return Err(refuse(
                RefusalCode::BuildMismatch,
                format!("worker build {build_hash} is not the gateway's build"),
            ));
        }
        let missing: Vec<&str> = claims
            .methods
            .iter()
            .map(|m| m.as_str())
            .filter(|m| !features.iter().any(|f| f == m))
            .collect();
        if !missing.is_empty() {
            return Err(refuse(
                RefusalCode::ProtocolMismatch,
                format!("the worker lacks features {}", missing.join(", ")),
            ));
        }
        // A database that cannot answer is not evidence that the environment is gone: the
        // worker is told to come back (retryable), not that its box was taken away.
        let env_row = self
            .store
            .live_environments()
            .map_err(|e| {
                refuse(
                    RefusalCode::Unavailable,
                    format!("could not look up environment {env} ({e}); try again"),
                )
            })?
            .into_iter()
            .find(|r| &r.id == env)
            .ok_or_else(|| refuse(RefusalCode::WrongScope, "the environment is gone"))?;
        if self.envs.host_key(&env_row).as_deref() != Some(claims.worker_key.as_str()) {
            return Err(refuse(
                RefusalCode::BadCredential,
                "the credential is for another box",
            ));
        }
        let scope = env_row.scope.clone();
        if super::probe::is_probe(&claims.session_id) {
            // A readiness probe: no session, epoch 0, and nothing but the canary.
            if claims.session_id != super::probe::probe_session(env)
                || claims.owner_epoch != 0
                || claims.methods != [Method::ModelStream]
            {
                return Err(refuse(
                    RefusalCode::Forbidden,
                    "a readiness probe may stream the canary only",
                ));
            }
        } else {
            let placement = self
                .store
                .placement(&scope, &claims.session_id)
                .map_err(|e| {
                    refuse(
                        RefusalCode::Unavailable,
                        format!(
                            "could not look up the placement of {} ({e}); try again",
                            claims.session_id
                        ),
                    )
                })?
                .ok_or_else(|| refuse(RefusalCode::WrongScope, "no such worker session"))?;
            if placement.environment_id.as_ref() != Some(env) {
                return Err(refuse(
                    RefusalCode::WrongScope,
                    "the session is not placed on this environment",
                ));
            }
            if placement.owner_epoch != claims.owner_epoch {
                return Err(refuse(
                    RefusalCode::StaleEpoch,
                    format!(
                        "owner epoch {} is stale; the session's owner is epoch {}",
                        claims.owner_epoch, placement.owner_epoch
                    ),
                ));
            }
        }
        match self
            .store
            .use_worker_credential(&claims.credential_id, &claims.session_id, env)
        {
            Ok(true) => {}
            Ok(false) => {
                return Err(refuse(
                    RefusalCode::CredentialReplayed,
                    "the credential was already used; each is admitted once",
                ));
            }
            Err(e) => return Err(refuse(RefusalCode::Unavailable, e.to_string())),
        }
        self.audit_worker(
            &scope,
            "worker.admit",
            claims.session_id.as_str(),
            "allowed",
            json!({ "env": env.as_str(), "epoch": claims.owner_epoch }),
        );
        let revision = if super::probe::is_probe(&claims.session_id) {
            0
        } else {
            self.store
                .session(&scope, &claims.session_id)
                .map(|s| u64::try_from(s.lifecycle_revision).unwrap_or(0))
                .map_err(|e| refuse(RefusalCode::Unavailable, e.to_string()))?
        };
        Ok(Admitted {
            scope,
            live: self.live(&claims.session_id),
            conn_id: self.conn_id(),
            claims,
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_CALLS_IN_FLIGHT)),
            revision,
            pending_ack: std::sync::Mutex::new(None),
        })
    }

    /// Mints a credential for the session's current owner on `env`.
    pub(crate) fn mint_worker_credential(
        &self,
        env: &EnvironmentId,
        worker_key: &str,
        bundle_hash: &str,
        session: &skiff_protocol::SessionId,
        epoch: u64,
        methods: Vec<Method>,
    ) -> crate::Result<(String, i64)> {
        let now = now_ms();
        let claims = CredentialClaims {
            credential_id: skiff_store::mint()?,
            environment_id: env.clone(),
            worker_key: worker_key.to_owned(),
            bundle_hash: bundle_hash.to_owned(),
            session_id: session.clone(),
            owner_epoch: epoch,
            methods,
            issued_at_ms: now,
            expires_at_ms: now + self.credential_ttl_ms,
        };
        Ok((self.signer.sign(&claims), claims.expires_at_ms))
    }

    fn welcome(&self, a: &Admitted, tx: &mpsc::UnboundedSender<GatewayFrame>) -> crate::Result<()> {
        let c = &a.claims;
        let (credential, expires) = self.mint_worker_credential(
            &c.environment_id,
            &c.worker_key,
            &c.bundle_hash,
            &c.session_id,
            c.owner_epoch,
            c.methods.clone(),
        )?;
        let cursors = self.store.worker_cursors(&c.session_id, c.owner_epoch)?;
        let _ = tx.send(GatewayFrame::Welcome {
            session_id: c.session_id.clone(),
            lifecycle_revision: a.revision,
            owner_epoch: c.owner_epoch,
            credential,
            credential_expires_at_ms: expires,
            cursors,
            workspace: super::place::box_workspace(&c.session_id),
        });
        Ok(())
    }

    /// Whether a model call without a run is the pending readiness canary.
    pub(super) fn canary_call(a: &Admitted, model: &str) -> bool {
        model == CANARY_MODEL && a.live.canary_pending()
    }
}
