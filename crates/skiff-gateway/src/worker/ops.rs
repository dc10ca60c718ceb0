//! The closed RPC set. Every call is checked against the connection's credential (session,
//! method set), the session's current owner epoch and lifecycle revision, and the session's
//! open run; a duplicate (same epoch, stream and sequence number) gets the cached terminal
//! reply and changes nothing.

use super::endpoint::{Admitted, Refusal, refuse};
use serde_json::json;
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::{
    Call, EVENT_WINDOW, GatewayFrame, OpId, RefusalCode, Reply, StreamKind,
};
use skiff_store::CachedOp;
use std::sync::Arc;

impl super::WorkerSide {
    pub(super) async fn on_call(self: &Arc<Self>, a: &Admitted, op: OpId, call: Call) {
        let stream = op.stream;
        let seq = op.seq;
        if let Err(r) = self.check_op(a, &op, &call) {
            self.refuse_op(a, &op, &call, r);
            return;
        }
        // Duplicates: answer from the cache.
        let session = &a.claims.session_id;
        let epoch = op.owner_epoch;
        if let Call::EventPublish { .. } = call {
            let applied = a.live.applied_events(epoch, || {
                self.store
                    .worker_cursors(session, epoch)
                    .map(|c| c.get(&StreamKind::Events).copied().unwrap_or(0))
            });
            let applied = match applied {
                Ok(applied) => applied,
                Err(e) => {
                    // Not acknowledged, so the worker keeps the event and sends it again
                    // after it reconnects; applying it now could apply it twice.
                    tracing::warn!(session = %session, seq, error = %e, "could not read a worker's event cursor; the event is not applied yet");
                    self.audit_worker(
                        &a.scope,
                        "worker.call",
                        session.as_str(),
                        "deferred",
                        json!({
                            "method": "event.publish", "code": "unavailable", "reason": e.to_string(),
                            "epoch": epoch, "stream": stream.as_str(), "seq": seq,
                        }),
                    );
                    return;
                }
            };
            // A worker holds at most a window of unacknowledged events; a number beyond it
            // would skip the events in between.
            if seq > applied + EVENT_WINDOW {
                let r = refuse(
                    RefusalCode::BadFrame,
                    format!("event {seq} is beyond the window after {applied}"),
                );
                self.refuse_op(a, &op, &call, r);
                return;
            }
            if seq > applied {
                if let Err(e) = self.apply_event(a, &op, call) {
                    // Not acknowledged, and not skipped by a later acknowledgement (they are
                    // cumulative): the connection is dropped, and the reconnected worker sends
                    // its unacknowledged events again, in order.
                    tracing::warn!(session = %session, seq, error = %e, "could not store a worker's event; dropping the connection so it is sent again");
                    self.audit_worker(
                        &a.scope,
                        "worker.call",
                        session.as_str(),
                        "deferred",
                        json!({
                            "method": "event.publish", "code": "unavailable", "reason": e.to_string(),
                            "epoch": epoch, "stream": stream.as_str(), "seq": seq,
                        }),
                    );
                    a.live.drop_conn(a.conn_id);
                    return;
                }
                a.live.set_applied_events(epoch, seq);
            }
            let mut pending = super::lock(&a.pending_ack);
            *pending = Some(pending.unwrap_or(0).max(seq).max(applied));
            return;
        }
        if let Call::ModelStream { .. } = call {
            self.model_call(a, op, call);
            return;
        }
        if let Call::ToolStart { call_id, name } = &call {
            // `check_op` found this worker's epoch current, and every epoch advance stops the
            // worker it fences first: a tool admitted here ends before its owner is fenced.
            // Nothing is recorded, so a repeat after a reconnect is simply checked again.
            tracing::debug!(session = %session, epoch, call = %call_id, tool = %name, "tool start admitted");
            a.live.send_on(
                a.conn_id,
                GatewayFrame::Reply {
                    stream,
                    seq,
                    reply: Reply::Finished,
                },
            );
            return;
        }
        let hash = call_hash(&call);
        // The cache is what makes a repeated call harmless: when it cannot be read, running
        // the call could repeat its side effect (a second commit, a second inbound sync), so
        // the worker is told to send it again later instead.
        let cached = match self.store.worker_op(session, epoch, stream, seq) {
            Ok(cached) => cached,
            Err(e) => {
                let r = refuse(
                    RefusalCode::Unavailable,
                    format!(
                        "could not read whether {} {seq} was already answered ({e}); send it again",
                        stream.as_str()
                    ),
                );
                self.refuse_op(a, &op, &call, r);
                return;
            }
        };
        if let Some(cached) = cached {
            if cached.method != call.method().as_str() || cached.call_hash != hash {
                let r = refuse(
                    RefusalCode::Conflict,
                    format!(
                        "{} {seq} already answered another operation; sequence numbers are not reusable",
                        stream.as_str()
                    ),
                );
                self.refuse_op(a, &op, &call, r);
                return;
            }
            match serde_json::from_str::<Reply>(&cached.reply) {
                Ok(reply) => {
                    a.live
                        .send_on(a.conn_id, GatewayFrame::Reply { stream, seq, reply });
                }
                Err(e) => {
                    // The call ran once; its answer is lost. Running it again could repeat
                    // its effect, so the worker gets a terminal refusal, never silence.
                    let r = refuse(
                        RefusalCode::Conflict,
                        format!(
                            "{} {seq} was answered before, but its cached answer is unreadable ({e}); it is not run twice",
                            stream.as_str()
                        ),
                    );
                    self.refuse_op(a, &op, &call, r);
                }
            }
            return;
        }
        if let Call::CredentialRotate {} = call {
            // A credential is never written to the database: the cache keeps a refusal, so a
            // repeated rotation op mints nothing (each mint is one-use).
            let reply = match self.rotate(a, &op) {
                Ok(reply) => {
                    let spent = Reply::Refused {
                        code: RefusalCode::Conflict,
                        message: "this rotation was already answered".into(),
                    };
                    let recorded = serde_json::to_string(&spent)
                        .map_err(|e| e.to_string())
                        .and_then(|reply| {
                            let cached = CachedOp {
                                method: call.method().as_str().to_owned(),
                                call_hash: hash.clone(),
                                reply,
                            };
                            self.store
                                .record_worker_op(session, epoch, stream, seq, &cached)
                                .map_err(|e| e.to_string())
                        });
                    if let Err(e) = recorded {
                        // A credential whose use could not be recorded is never handed out: a
                        // repeat of this op would mint another. Nothing was sent, so a retry
                        // is safe.
                        let r = refuse(
                            RefusalCode::Unavailable,
                            format!("could not record this rotation ({e}); send it again"),
                        );
                        self.refuse_op(a, &op, &call, r);
                        return;
                    }
                    reply
                }
                Err(r) => Reply::Refused {
                    code: r.code,
                    message: r.message,
                },
            };
            a.live
                .send_on(a.conn_id, GatewayFrame::Reply { stream, seq, reply });
            return;
        }
        // Long calls run beside the frame loop, a bounded number at a time; their replies are
        // cached before they are sent.
        let permit = if stream == StreamKind::Transcript {
            None
        } else {
            match a.in_flight.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    let r = refuse(
                        RefusalCode::Unavailable,
                        format!(
                            "more than {} calls in flight; wait for answers",
                            super::endpoint::MAX_CALLS_IN_FLIGHT
                        ),
                    );
                    self.refuse_op(a, &op, &call, r);
                    return;
                }
            }
        };
        let method = call.method().as_str();
        let workers = self.clone();
        let live = a.live.clone();
        let scope = a.scope.clone();
        let claims = a.claims.clone();
        let conn_id = a.conn_id;
        let work = async move {
            let reply = match call {
                Call::TranscriptCommit { base_leaf, entries } => {
                    workers.worker_commit(&scope, &op, base_leaf, entries)
                }
                Call::ToolGateway { name, arguments } => {
                    let cancel = op
                        .run_id
                        .as_ref()
                        .and_then(|run| workers.run_cancel_token(run))
                        .unwrap_or_default();
                    let out = workers
                        .gateway_tool(
                            &scope,
                            &op.session_id,
                            &claims.environment_id,
                            op.run_id.as_ref(),
                            &name,
                            &arguments,
                            &cancel,
                        )
                        .await;
                    Reply::ToolOutput {
                        content: out.content,
                        is_error: out.is_error,
                    }
                }
                Call::TurnFinish {
                    end,
                    manifest,
                    manifest_error,
                } => {
                    let theirs = manifest.ok_or_else(|| {
                        manifest_error.unwrap_or_else(|| "the worker did not say why".into())
                    });
                    workers
                        .worker_turn_finished(&scope, &claims, &op, end, theirs)
                        .await
                }
                Call::ApprovalRequest {
                    tool,
                    kind,
                    subject,
                    reason,
                } => {
                    workers
                        .worker_approval(&scope, &claims, &op, tool, kind, subject, reason)
                        .await
                }
                Call::EventPublish { .. }
                | Call::ModelStream { .. }
                | Call::CredentialRotate {}
                | Call::ToolStart { .. } => {
                    return;
                }
            };
            if let Reply::Refused { code, message } = &reply {
                // Refused inside the call (a forbidden entry kind, a moved leaf…): audited like
                // every refusal, and not cached, so a corrected call may follow.
                workers.audit_worker(
                    &scope,
                    "worker.call",
                    op.session_id.as_str(),
                    "refused",
                    json!({
                        "method": method, "code": code.as_str(), "reason": message,
                        "epoch": op.owner_epoch, "stream": stream.as_str(), "seq": seq,
                    }),
                );
            } else {
                // The call's effect has happened: the worker gets its real answer either way.
                // A reply that could not be cached is reported, since a repeat of this call
                // would no longer be recognised as one.
                let recorded = serde_json::to_string(&reply)
                    .map_err(|e| e.to_string())
                    .and_then(|reply| {
                        let cached = CachedOp {
                            method: method.to_owned(),
                            call_hash: hash,
                            reply,
                        };
                        workers
                            .store
                            .record_worker_op(&op.session_id, op.owner_epoch, stream, seq, &cached)
                            .map_err(|e| e.to_string())
                    });
                if let Err(e) = recorded {
                    workers.report_lost_write(&scope, &op, method, "reply", &e);
                }
            }
            if let Err(e) =
                workers
                    .store
                    .advance_worker_cursor(&op.session_id, op.owner_epoch, stream, seq)
            {
                workers.report_lost_write(&scope, &op, method, "cursor", &e.to_string());
            }
            live.send_on(conn_id, GatewayFrame::Reply { stream, seq, reply });
            drop(permit);
        };
        // Transcript commits stay in order with the frames around them; the rest may take
        // long (inbound sync, a web fetch) and must not hold the connection's other frames.
        if stream == StreamKind::Transcript {
            work.await;
        } else {
            tokio::spawn(work);
        }
    }

    /// `approval.request`: a call the worker's policy holds waits for a person here, as a
    /// gateway-placed loop's does; the run's cancel (and the barrier's revocation) end it.
    #[allow(
        clippy::too_many_arguments,
        reason = "the call's fields, unpacked where it is matched"
    )]
    async fn worker_approval(
        &self,
        scope: &skiff_store::Scope,
        claims: &skiff_protocol::worker::CredentialClaims,
        op: &OpId,
        tool: String,
        kind: skiff_protocol::approval::ApprovalKind,
        subject: String,
        reason: Option<String>,
    ) -> Reply {
        let Some(run) = op.run_id.clone() else {
            return Reply::Refused {
                code: RefusalCode::WrongScope,
                message: "an approval belongs to a run".into(),
            };
        };
        let limit = skiff_agent::approval::MAX_SUBJECT_BYTES + 256;
        if subject.len() > limit || reason.as_ref().is_some_and(|r| r.len() > limit) {
            return Reply::Refused {
                code: RefusalCode::TooLarge,
                message: format!("an approval's subject and reason are at most {limit} bytes"),
            };
        }
        let cancel = self.run_cancel_token(&run).unwrap_or_default();
        let ask = skiff_agent::approval::Ask {
            tool,
            kind,
            subject,
            reason,
        };
        let requested_by = format!("worker {}", claims.environment_id);
        match self
            .ask_approval(scope, &op.session_id, &run, &ask, &requested_by, &cancel)
            .await
        {
            Ok(()) => Reply::Approval {
                approved: true,
                message: None,
            },
            Err(message) => Reply::Approval {
                approved: false,
                message: Some(message),
            },
        }
    }

    fn worker_commit(
        &self,
        scope: &skiff_store::Scope,
        op: &OpId,
        base_leaf: Option<skiff_protocol::EntryId>,
        entries: Vec<EntryBody>,
    ) -> Reply {
        if entries.is_empty() || entries.len() > 256 {
            return Reply::Refused {
                code: RefusalCode::BadFrame,
                message: "a commit carries 1 to 256 entries".into(),
            };
        }
        // A compaction from the worker's loop is allowed: it only shapes the model context,
        // and the entries it summarises stay in the transcript.
        if entries
            .iter()
            .any(|e| matches!(e, EntryBody::UserMessage { .. }))
        {
            return Reply::Refused {
                code: RefusalCode::Forbidden,
                message:
                    "workers commit assistant messages, tool results, notices and compactions only"
                        .into(),
            };
        }
        let Some(run) = &op.run_id else {
            return Reply::Refused {
                code: RefusalCode::WrongScope,
                message: "the commit names no run".into(),
            };
        };
        match self.transcript().append_entries_published(
            scope,
            &op.session_id,
            base_leaf.as_ref(),
            Some(run),
            &entries,
        ) {
            Ok(committed) => {
                for body in &entries {
                    if let EntryBody::AssistantMessage { usage, .. }
                    | EntryBody::Compaction { usage, .. } = body
                        && let Err(e) = self.record_usage(scope, &op.session_id, run, *usage)
                    {
                        tracing::warn!(%run, error = %e, "could not account a worker's model usage");
                    }
                }
                Reply::Committed { entries: committed }
            }
            Err(skiff_store::Error::LeafConflict { .. }) => Reply::Refused {
                code: RefusalCode::Conflict,
                message: "the transcript moved: the base leaf is not the session's leaf".into(),
            },
            Err(e) => Reply::Refused {
                code: RefusalCode::Unavailable,
                message: e.to_string(),
            },
        }
    }

    /// A write that keeps a repeated call harmless (its cached reply, or the cursor that
    /// tells a re-attaching worker what was answered) failed after the call took effect. The
    /// worker still gets its answer; the loss is logged and audited, never dropped.
    pub(super) fn report_lost_write(
        &self,
        scope: &skiff_store::Scope,
        op: &OpId,
        method: &str,
        what: &str,
        error: &str,
    ) {
        tracing::warn!(session = %op.session_id, method, what, error, "could not record a worker call's {what}; a repeat of it may run again");
        self.audit_worker(
            scope,
            "worker.call",
            op.session_id.as_str(),
            "unrecorded",
            json!({
                "method": method, "lost": what, "reason": error,
                "epoch": op.owner_epoch, "stream": op.stream.as_str(), "seq": op.seq,
            }),
        );
    }

    fn refuse_op(&self, a: &Admitted, op: &OpId, call: &Call, r: Refusal) {
        tracing::warn!(session = %a.claims.session_id, method = call.method().as_str(), code = r.code.as_str(), reason = r.message, "refused a worker call");
        self.audit_worker(
            &a.scope,
            "worker.call",
            a.claims.session_id.as_str(),
            "refused",
            json!({
                "method": call.method().as_str(), "code": r.code.as_str(), "reason": r.message,
                "epoch": op.owner_epoch, "stream": op.stream.as_str(), "seq": op.seq,
            }),
        );
        let reply = Reply::Refused {
            code: r.code,
            message: r.message,
        };
        if let Call::EventPublish { .. } = call {
            // The worker retains events until acknowledged; a refused one is dropped for good.
            a.live
                .send_on(a.conn_id, GatewayFrame::EventAck { seq: op.seq });
        }
        a.live.send_on(
            a.conn_id,
            GatewayFrame::Reply {
                stream: op.stream,
                seq: op.seq,
                reply,
            },
        );
    }

    fn check_op(&self, a: &Admitted, op: &OpId, call: &Call) -> Result<(), Refusal> {
        let c = &a.claims;
        if op.session_id != c.session_id {
            return Err(refuse(
                RefusalCode::WrongScope,
                format!("this worker may act for session {} only", c.session_id),
            ));
        }
        if !c.methods.contains(&call.method()) {
            return Err(refuse(
                RefusalCode::Forbidden,
                format!(
                    "method {} is not in this worker's set",
                    call.method().as_str()
                ),
            ));
        }
        if super::probe::is_probe(&c.session_id) {
            // A readiness probe streams the canary and nothing else.
            return match call {
                Call::ModelStream { request, .. }
                    if op.run_id.is_none()
                        && op.owner_epoch == 0
                        && super::WorkerSide::canary_call(a, request.model.as_str()) =>
                {
                    Ok(())
                }
                _ => Err(refuse(
                    RefusalCode::Forbidden,
                    "a readiness probe may stream the canary only",
                )),
            };
        }
        let expected_stream = match call {
            Call::TranscriptCommit { .. } => StreamKind::Transcript,
            Call::EventPublish { .. } => StreamKind::Events,
            Call::ModelStream { .. } => StreamKind::Model,
            Call::ToolGateway { .. } | Call::ApprovalRequest { .. } | Call::ToolStart { .. } => {
                StreamKind::Tool
            }
            Call::TurnFinish { .. } | Call::CredentialRotate {} => StreamKind::Control,
        };
        if op.stream != expected_stream || op.seq == 0 {
            return Err(refuse(
                RefusalCode::BadFrame,
                format!(
                    "{} belongs on stream {} with a sequence number from 1",
                    call.method().as_str(),
                    expected_stream.as_str()
                ),
            ));
        }
        if let Call::EventPublish { .. } = call {
            return self.check_event(a, op);
        }
        let placement = self
            .store
            .placement(&a.scope, &c.session_id)
            .map_err(|e| {
                refuse(
                    RefusalCode::Unavailable,
                    format!("could not read the session's placement ({e}); send it again"),
                )
            })?
            .ok_or_else(|| refuse(RefusalCode::WrongScope, "the session has no placement"))?;
        if op.owner_epoch != placement.owner_epoch || op.owner_epoch != c.owner_epoch {
            return Err(refuse(
                RefusalCode::StaleEpoch,
                format!(
                    "owner epoch {} is stale; the session's owner is epoch {}",
                    op.owner_epoch, placement.owner_epoch
                ),
            ));
        }
        check_revision(a, op)?;
        let needs_run = match call {
            Call::CredentialRotate {} => false,
            Call::ModelStream { request, .. } => {
                !(op.run_id.is_none() && super::WorkerSide::canary_call(a, request.model.as_str()))
            }
            _ => true,
        };
        if needs_run {
            let open = self
                .store
                .open_run(&a.scope, &c.session_id)
                .map_err(|e| refuse(RefusalCode::Unavailable, e.to_string()))?;
            // A finished run's turn.finish may be repeated (answered from the cache).
            let finished_repeat = matches!(call, Call::TurnFinish { .. });
            match (&op.run_id, open) {
                (Some(run), Some(open)) if *run == open.id => {}
                (Some(_), _) if finished_repeat => {}
                (Some(run), _) => {
                    return Err(refuse(
                        RefusalCode::WrongScope,
                        format!("run {run} is not this session's open run; its writes are fenced"),
                    ));
                }
                (None, _) => {
                    return Err(refuse(
                        RefusalCode::WrongScope,
                        "the operation names no run",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The hot path (one call per streamed token): the connection's own epoch and revision,
    /// and the open run the gateway handed over, all in memory. Sound because every epoch
    /// advance closes the session's connection, and every run's end clears the open run; when
    /// memory has no open run, the store decides.
    fn check_event(&self, a: &Admitted, op: &OpId) -> Result<(), Refusal> {
        if op.owner_epoch != a.claims.owner_epoch {
            return Err(refuse(
                RefusalCode::StaleEpoch,
                format!(
                    "owner epoch {} is stale; this connection's owner is epoch {}",
                    op.owner_epoch, a.claims.owner_epoch
                ),
            ));
        }
        check_revision(a, op)?;
        let Some(run) = &op.run_id else {
            return Err(refuse(
                RefusalCode::WrongScope,
                "the operation names no run",
            ));
        };
        if a.live.open_run().as_ref() == Some(run) {
            return Ok(());
        }
        let open = self
            .store
            .open_run(&a.scope, &a.claims.session_id)
            .map_err(|e| refuse(RefusalCode::Unavailable, e.to_string()))?;
        match open {
            Some(open) if &open.id == run => {
                a.live.set_open_run(Some(open.id));
                Ok(())
            }
            _ => Err(refuse(
                RefusalCode::WrongScope,
                format!("run {run} is not this session's open run; its writes are fenced"),
            )),
        }
    }

    /// Stores and fans out a worker's live event (moving its ACK cursor with it). A refused
    /// kind is dropped for good (audited); only a failure to store is an error.
    fn apply_event(&self, a: &Admitted, op: &OpId, call: Call) -> Result<(), skiff_store::Error> {
        let Call::EventPublish { event } = call else {
            return Ok(());
        };
        // Entries, run status and approvals are the gateway's to announce, never a worker's
        // (a forged approval card could trick a person).
        if matches!(
            event,
            EventKind::Entry { .. }
                | EventKind::RunStatus { .. }
                | EventKind::Placement { .. }
                | EventKind::Approval { .. }
        ) {
            self.audit_worker(&a.scope, "worker.call", a.claims.session_id.as_str(), "refused", json!({
                "method": "event.publish", "code": "forbidden", "reason": "workers may not publish entries, run status, placement or approvals",
            }));
            if let Err(e) = self.store.advance_worker_cursor(
                &op.session_id,
                op.owner_epoch,
                StreamKind::Events,
                op.seq,
            ) {
                self.report_lost_write(&a.scope, op, "event.publish", "cursor", &e.to_string());
            }
            return Ok(());
        }
        let published = self.hub.publish_with(&a.scope, &op.session_id, || {
            self.store.append_worker_event(
                &a.scope,
                &op.session_id,
                op.run_id.as_ref(),
                event,
                op.owner_epoch,
                op.seq,
            )
        });
        published.map(|_| ())
    }

    fn rotate(&self, a: &Admitted, op: &OpId) -> Result<Reply, Refusal> {
        let c = &a.claims;
        let (credential, expires_at_ms) = self
            .mint_worker_credential(
                &c.environment_id,
                &c.worker_key,
                &c.bundle_hash,
                &c.session_id,
                op.owner_epoch,
                c.methods.clone(),
            )
            .map_err(|e| refuse(RefusalCode::Unavailable, e.to_string()))?;
        self.audit_worker(
            &a.scope,
            "worker.credential.rotate",
            c.session_id.as_str(),
            "allowed",
            json!({ "env": c.environment_id.as_str(), "epoch": op.owner_epoch }),
        );
        Ok(Reply::Credential {
            credential,
            expires_at_ms,
        })
    }
}

/// The session's lifecycle revision, as read at admission (v1 never changes it).
fn check_revision(a: &Admitted, op: &OpId) -> Result<(), Refusal> {
    if op.lifecycle_revision != a.revision {
        return Err(refuse(
            RefusalCode::WrongScope,
            format!(
                "lifecycle revision {} is not the session's",
                op.lifecycle_revision
            ),
        ));
    }
    Ok(())
}

/// What identifies a call for duplicate detection: its method and content.
pub(super) fn call_hash(call: &Call) -> String {
    let json = serde_json::to_vec(call).unwrap_or_default();
    blake3::hash(&json).to_hex().to_string()
}
