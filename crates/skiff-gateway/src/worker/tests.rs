//! Component tests of the gateway's side of the worker protocol: a gateway core opened on a
//! temp state dir inside the test process (`open_core`), and a worker connection that is an
//! in-memory channel — no listener, no box, no root. Database faults are injected through a
//! second SQLite connection to the same file (a renamed table, a trigger that aborts a write,
//! a row overwritten with bytes that are not JSON), so production code carries no test hook.

use super::endpoint::Admitted;
use crate::{Core, Options};
use skiff_protocol::api::{RunStatus, WorkspaceView};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, ModelRef, ModelRequest, ReasoningEffort, StopReason, Usage,
};
use skiff_protocol::transcript::EntryBody;
use skiff_protocol::worker::{
    Call, CredentialClaims, GatewayFrame, Method, ModelOptions, OpId, RefusalCode, Reply,
    StreamKind,
};
use skiff_protocol::{EnvironmentId, RunId, SessionId};
use skiff_store::{NewSession, PlacementChange};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::mpsc;

struct Harness {
    _dir: tempfile::TempDir,
    core: Arc<Core>,
    a: Admitted,
    frames: mpsc::UnboundedReceiver<GatewayFrame>,
    run: RunId,
    db: PathBuf,
}

impl Harness {
    /// A worker session placed on a box (`active`), a turn open, and its worker admitted.
    async fn new() -> anyhow::Result<Self> {
        Self::with_config("").await
    }

    /// Like [`Harness::new`], with `config` as the gateway's `skiff.toml`.
    async fn with_config(config: &str) -> anyhow::Result<Self> {
        Self::with_workspace(config, |_| WorkspaceView::Plain {
            source: "/src".into(),
            path: "/state/ws".into(),
        })
        .await
    }

    /// Like [`Harness::with_config`], with the session's workspace made from its id.
    async fn with_workspace(
        config: &str,
        workspace: impl FnOnce(&SessionId) -> WorkspaceView,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let state_dir = dir.path().join("state");
        let config_path = dir.path().join("skiff.toml");
        std::fs::write(&config_path, config)?;
        let (core, _, _) = crate::open_core(&Options {
            state_dir: state_dir.clone(),
            listen: "127.0.0.1:0".into(),
            config: Some(config_path),
        })
        .await?;
        // The session's owner is a user of the gateway: a worker acts with their rights.
        let scope = core
            .store
            .add_user(
                "owner@example.com",
                skiff_protocol::people::Role::Member,
                "ten_test",
            )?
            .scope();
        let session = SessionId::from_suffix(&skiff_store::mint()?);
        let env = EnvironmentId::from_suffix("box1");
        core.store.create_session_placed(
            &scope,
            &NewSession {
                id: session.clone(),
                title: "on a box".into(),
                workspace: workspace(&session),
                model_ref: "scripted/demo".into(),
            },
            Some(("local", 16)),
        )?;
        for to in [
            PlacementState::Provisioning,
            PlacementState::Syncing,
            PlacementState::Starting,
            PlacementState::Active,
        ] {
            let change = PlacementChange {
                environment_id: (to == PlacementState::Syncing).then_some(&env),
                advance_epoch: to == PlacementState::Starting,
                ..Default::default()
            };
            core.store
                .transition_placement(&scope, &session, to, &change)?;
        }
        let run = core.store.create_run(&scope, &session, "scripted/demo")?;
        for status in [RunStatus::Starting, RunStatus::Running] {
            core.store.transition_run(&scope, &run.id, status, None)?;
        }
        let epoch = core
            .store
            .placement(&scope, &session)?
            .map(|p| p.owner_epoch)
            .ok_or_else(|| anyhow::anyhow!("no placement"))?;
        let claims = CredentialClaims {
            credential_id: skiff_store::mint()?,
            environment_id: env,
            worker_key: "ssh-ed25519 test".into(),
            bundle_hash: "test".into(),
            session_id: session.clone(),
            owner_epoch: epoch,
            methods: vec![
                Method::TranscriptCommit,
                Method::EventPublish,
                Method::ModelStream,
                Method::ToolGateway,
                Method::TurnFinish,
                Method::CredentialRotate,
            ],
            issued_at_ms: 0,
            expires_at_ms: i64::MAX,
        };
        let live = core.workers.live(&session);
        let conn_id = core.workers.conn_id();
        let (tx, frames) = mpsc::unbounded_channel();
        let _closed = live.connect(conn_id, epoch, tx);
        let a = Admitted {
            scope,
            claims,
            live,
            conn_id,
            in_flight: Arc::new(tokio::sync::Semaphore::new(8)),
            revision: 0,
            pending_ack: std::sync::Mutex::new(None),
        };
        let db = core.state.database();
        Ok(Self {
            _dir: dir,
            core,
            a,
            frames,
            run: run.id,
            db,
        })
    }

    fn op(&self, stream: StreamKind, seq: u64) -> OpId {
        OpId {
            session_id: self.a.claims.session_id.clone(),
            lifecycle_revision: 0,
            run_id: Some(self.run.clone()),
            owner_epoch: self.a.claims.owner_epoch,
            stream,
            seq,
        }
    }

    /// Sends a call and returns the reply to it. Transcript and control calls are answered
    /// before `on_call` returns or by a task it spawned; the channel says when.
    async fn call(&mut self, stream: StreamKind, seq: u64, call: Call) -> anyhow::Result<Reply> {
        let op = self.op(stream, seq);
        self.core.workers.on_call(&self.a, op, call).await;
        loop {
            match next_frame(&mut self.frames).await? {
                GatewayFrame::Reply { seq: s, reply, .. } if s == seq => return Ok(reply),
                _ => {}
            }
        }
    }

    /// A second connection to the gateway's database, to break it the way a disk or a bug
    /// would.
    fn sql(&self, sql: &str) -> anyhow::Result<()> {
        let conn = rusqlite::Connection::open(&self.db)?;
        conn.execute_batch(sql)?;
        Ok(())
    }

    fn audit(&self, decision: &str) -> anyhow::Result<Vec<String>> {
        let conn = rusqlite::Connection::open(&self.db)?;
        let mut stmt = conn.prepare(
            "SELECT detail FROM audit WHERE actor = 'worker' AND decision = ?1 ORDER BY id",
        )?;
        let rows = stmt
            .query_map([decision], |r| r.get::<_, String>(0))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    fn transcript_len(&self) -> anyhow::Result<usize> {
        let conn = rusqlite::Connection::open(&self.db)?;
        let n: i64 = conn.query_row(
            "SELECT COUNT(*) FROM entries WHERE session_id = ?1",
            [self.a.claims.session_id.as_str()],
            |r| r.get(0),
        )?;
        Ok(usize::try_from(n)?)
    }
}

fn assistant(text: &str) -> EntryBody {
    EntryBody::AssistantMessage {
        reasoning: Vec::new(),
        text: text.into(),
        tool_calls: Vec::new(),
        model: "scripted/demo".into(),
        usage: Usage::default(),
        stop_reason: StopReason::EndTurn,
    }
}

fn commit(text: &str) -> Call {
    Call::TranscriptCommit {
        base_leaf: None,
        entries: vec![assistant(text)],
    }
}

fn model_call() -> anyhow::Result<Call> {
    Ok(Call::ModelStream {
        request: ModelRequest {
            reasoning: None,
            model: ModelRef::parse("scripted/demo").ok_or_else(|| anyhow::anyhow!("model ref"))?,
            system: String::new(),
            messages: vec![Message::User { text: "hi".into() }],
            tools: Vec::new(),
            max_output_tokens: 100,
        },
        options: ModelOptions::default(),
        resume_from: 0,
    })
}

fn refused(reply: &Reply) -> Option<(RefusalCode, &str)> {
    match reply {
        Reply::Refused { code, message } => Some((*code, message.as_str())),
        _ => None,
    }
}

/// The first model frame for `seq`.
async fn model_frame(h: &mut Harness, seq: u64) -> anyhow::Result<Vec<ModelEvent>> {
    loop {
        if let GatewayFrame::Model { seq: s, events, .. } = next_frame(&mut h.frames).await?
            && s == seq
        {
            return Ok(events);
        }
    }
}

/// The next frame to the worker. The bound only turns "the worker waits forever" into a
/// failure; every answer a test expects is on its way when the call returns or soon after.
async fn next_frame(
    frames: &mut mpsc::UnboundedReceiver<GatewayFrame>,
) -> anyhow::Result<GatewayFrame> {
    match tokio::time::timeout(std::time::Duration::from_secs(20), frames.recv()).await {
        Ok(Some(frame)) => Ok(frame),
        Ok(None) => anyhow::bail!("the connection closed"),
        Err(_) => anyhow::bail!("no frame reached the worker within 20 s: it would wait forever"),
    }
}

#[tokio::test]
async fn a_cache_that_cannot_be_read_fails_a_repeated_call_with_a_retryable_refusal() {
    let mut h = Harness::new().await.unwrap();
    let first = h
        .call(StreamKind::Transcript, 1, commit("done"))
        .await
        .unwrap();
    assert!(matches!(first, Reply::Committed { .. }), "{first:?}");
    // The worker did not see the answer and sends the call again; the cache cannot be read.
    h.sql("ALTER TABLE worker_ops RENAME TO worker_ops_unreadable")
        .unwrap();
    let again = h
        .call(StreamKind::Transcript, 1, commit("done"))
        .await
        .unwrap();
    let (code, message) = refused(&again).unwrap();
    assert_eq!(code, RefusalCode::Unavailable, "{message}");
    assert!(message.contains("send it again"), "{message}");
    assert_eq!(h.transcript_len().unwrap(), 1, "the commit ran once");
    assert!(
        !h.audit("refused").unwrap().is_empty(),
        "the refusal is audited"
    );
}

#[tokio::test]
async fn an_unreadable_cached_reply_is_a_terminal_refusal_never_silence() {
    let mut h = Harness::new().await.unwrap();
    h.call(StreamKind::Transcript, 1, commit("done"))
        .await
        .unwrap();
    h.sql("UPDATE worker_ops SET reply = 'not json'").unwrap();
    let again = h
        .call(StreamKind::Transcript, 1, commit("done"))
        .await
        .unwrap();
    let (code, message) = refused(&again).unwrap();
    assert_eq!(code, RefusalCode::Conflict, "{message}");
    assert!(message.contains("unreadable"), "{message}");
    assert_eq!(h.transcript_len().unwrap(), 1);
}

#[tokio::test]
async fn a_reply_or_cursor_that_cannot_be_recorded_is_still_answered_and_is_audited() {
    let mut h = Harness::new().await.unwrap();
    h.sql(
        "CREATE TRIGGER no_ops BEFORE INSERT ON worker_ops \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END; \
         CREATE TRIGGER no_cursor_insert BEFORE INSERT ON worker_cursors \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END; \
         CREATE TRIGGER no_cursor_update BEFORE UPDATE ON worker_cursors \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END;",
    )
    .unwrap();
    let reply = h
        .call(StreamKind::Transcript, 1, commit("done"))
        .await
        .unwrap();
    assert!(matches!(reply, Reply::Committed { .. }), "{reply:?}");
    let lost = h.audit("unrecorded").unwrap();
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(
        lost[0].contains("\"lost\":\"reply\"") && lost[0].contains("injected"),
        "{lost:?}"
    );
    assert!(lost[1].contains("\"lost\":\"cursor\""), "{lost:?}");
}

#[tokio::test]
async fn a_rotation_whose_use_cannot_be_recorded_hands_out_no_credential() {
    let mut h = Harness::new().await.unwrap();
    h.sql(
        "CREATE TRIGGER no_ops BEFORE INSERT ON worker_ops \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END;",
    )
    .unwrap();
    let reply = h
        .call(StreamKind::Control, 1, Call::CredentialRotate {})
        .await
        .unwrap();
    let (code, message) = refused(&reply).unwrap();
    assert_eq!(code, RefusalCode::Unavailable, "{message}");
    // Once the database is back the same op is answered with a credential.
    h.sql("DROP TRIGGER no_ops").unwrap();
    let reply = h
        .call(StreamKind::Control, 1, Call::CredentialRotate {})
        .await
        .unwrap();
    assert!(matches!(reply, Reply::Credential { .. }), "{reply:?}");
}

#[tokio::test]
async fn a_corrupt_cached_model_answer_ends_the_workers_wait_with_an_error() {
    let mut h = Harness::new().await.unwrap();
    let call = model_call().unwrap();
    let Call::ModelStream { request, .. } = &call else {
        unreachable!()
    };
    let hash = super::proxy::request_hash(request);
    h.sql(&format!(
        "INSERT INTO worker_ops (session_id, owner_epoch, stream, seq, method, call_hash, reply, at_ms) \
         VALUES ('{}', {}, 'model', 1, 'model.stream', '{hash}', '[{{\"truncated', 0)",
        h.a.claims.session_id,
        h.a.claims.owner_epoch
    ))
    .unwrap();
    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Model, 1), call)
        .await;
    let events = h.frames.try_recv();
    let Ok(GatewayFrame::Model { events, .. }) = events else {
        panic!("the worker got no answer: {events:?}");
    };
    assert!(
        matches!(events.as_slice(), [ModelEvent::Error { kind: ModelErrorKind::Connection, message }] if message.contains("unreadable")),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_model_cache_that_cannot_be_read_does_not_ask_the_provider_again() {
    let mut h = Harness::new().await.unwrap();
    h.sql("ALTER TABLE worker_ops RENAME TO worker_ops_unreadable")
        .unwrap();
    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Model, 1), model_call().unwrap())
        .await;
    let events = model_frame(&mut h, 1).await.unwrap();
    assert!(
        matches!(events.as_slice(), [ModelEvent::Error { message, .. }] if message.contains("could not read")),
        "the provider was asked: {events:?}"
    );
}

#[tokio::test]
async fn an_event_whose_cursor_cannot_be_read_is_neither_applied_nor_acknowledged() {
    let mut h = Harness::new().await.unwrap();
    h.sql("ALTER TABLE worker_cursors RENAME TO worker_cursors_unreadable")
        .unwrap();
    let event = Call::EventPublish {
        event: skiff_protocol::event::EventKind::ModelRequest {
            model: "scripted/demo".into(),
        },
    };
    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Events, 1), event)
        .await;
    assert_eq!(
        *super::lock(&h.a.pending_ack),
        None,
        "nothing to acknowledge"
    );
    assert!(
        h.frames.try_recv().is_err(),
        "no frame: the worker keeps the event"
    );
    assert_eq!(h.audit("deferred").unwrap().len(), 1);
}

#[tokio::test]
async fn admission_on_a_database_error_says_so_rather_than_that_the_box_is_gone() {
    let h = Harness::new().await.unwrap();
    h.core.envs.warm_bundle().await;
    let build = h.core.envs.bundle_hash_now().unwrap();
    let mut claims = h.a.claims.clone();
    claims.bundle_hash = build.clone();
    let hello = skiff_protocol::worker::WorkerFrame::Hello {
        protocol_version: skiff_protocol::worker::PROTOCOL_VERSION,
        build_hash: build,
        features: claims
            .methods
            .iter()
            .map(|m| m.as_str().to_owned())
            .collect(),
        credential: h.core.workers.signer.sign(&claims),
    };
    let line = serde_json::to_string(&hello).unwrap();
    h.sql("ALTER TABLE environments RENAME TO environments_unreadable")
        .unwrap();
    let Err(r) = h.core.workers.admit(&claims.environment_id, &line) else {
        panic!("admitted without an environment");
    };
    assert_eq!(r.code, RefusalCode::Unavailable, "{}", r.message);
    assert!(r.message.contains("try again"), "{}", r.message);
}

/// A recovery's verdict on a box comes seconds after it began; a session reclaimed and placed
/// on a fresh box meanwhile keeps that box (found by the CLI suite on PostgreSQL, where the
/// timing made the old box's recovery give up the new one).
#[tokio::test]
async fn a_late_verdict_on_an_old_box_leaves_the_sessions_new_box_alone() {
    let h = Harness::new().await.unwrap();
    let (scope, session) = (&h.a.scope, &h.a.claims.session_id);
    let entries = h.transcript_len().unwrap();
    let old = EnvironmentId::from_suffix("box0");
    h.core
        .workers
        .reclaim_on(
            scope,
            session,
            &old,
            "its box stopped: `(connect)` on box0 failed",
        )
        .await;
    let p = h.core.store.placement(scope, session).unwrap().unwrap();
    assert_eq!(p.state, PlacementState::Active);
    assert_eq!(p.environment_id, Some(EnvironmentId::from_suffix("box1")));
    assert_eq!(
        h.transcript_len().unwrap(),
        entries,
        "no notice for the old box"
    );

    // The verdict on the box it is on still reclaims it, with the notice.
    h.core
        .workers
        .reclaim_on(
            scope,
            session,
            &EnvironmentId::from_suffix("box1"),
            "its box stopped",
        )
        .await;
    let p = h.core.store.placement(scope, session).unwrap().unwrap();
    assert_eq!(p.state, PlacementState::Reclaimed);
    assert_eq!(h.transcript_len().unwrap(), entries + 1);
}

#[tokio::test]
async fn a_lost_work_notice_that_cannot_be_written_is_audited() {
    let h = Harness::new().await.unwrap();
    h.sql(
        "CREATE TRIGGER no_entries BEFORE INSERT ON entries \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END;",
    )
    .unwrap();
    h.core.notify(
        &h.a.scope,
        &h.a.claims.session_id,
        Some(&h.run),
        "The worker box stopped. Workspace changes were lost.",
    );
    let conn = rusqlite::Connection::open(&h.db).unwrap();
    let detail: String = conn
        .query_row(
            "SELECT detail FROM audit WHERE action = 'session.notice' AND decision = 'lost'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(detail.contains("injected"), "{detail}");
    assert!(
        !detail.contains("Workspace changes"),
        "the audit keeps metadata only: {detail}"
    );
}

#[tokio::test]
async fn an_event_that_cannot_be_stored_is_not_acknowledged_and_the_worker_reconnects_to_resend_it()
{
    let h = Harness::new().await.unwrap();
    // The connection the harness admitted; dropping it is how the worker learns to resend.
    let live = h.a.live.clone();
    let (tx, _frames) = mpsc::unbounded_channel();
    let closed = live.connect(h.a.conn_id, h.a.claims.owner_epoch, tx);
    h.sql(
        "CREATE TRIGGER no_events BEFORE INSERT ON events \
           BEGIN SELECT RAISE(ABORT, 'injected: disk full'); END;",
    )
    .unwrap();
    let event = Call::EventPublish {
        event: skiff_protocol::event::EventKind::ModelRequest {
            model: "scripted/demo".into(),
        },
    };
    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Events, 1), event.clone())
        .await;
    assert_eq!(
        *super::lock(&h.a.pending_ack),
        None,
        "a lost event was acknowledged"
    );
    assert!(closed.is_cancelled(), "the connection stays open");
    assert_eq!(h.audit("deferred").unwrap().len(), 1);
    // Sent again once the database is back, it is stored and acknowledged.
    h.sql("DROP TRIGGER no_events").unwrap();
    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Events, 1), event)
        .await;
    assert_eq!(*super::lock(&h.a.pending_ack), Some(1));
}

/// A fake worker on the real endpoint socket: hello, welcome, the turn handed over, a commit
/// answered, and a frame that is not UTF-8 refused — both ends framed by `skiff_wire`.
#[tokio::test]
async fn a_worker_on_the_endpoint_socket_is_admitted_handed_its_turn_and_answered() {
    let h = Harness::new().await.unwrap();
    let env = h.a.claims.environment_id.clone();
    let host_key = "ssh-ed25519 AAAAC3Nza-test-box";
    h.core
        .store
        .create_environment(&h.a.scope, &env, "local", "local", "op_test")
        .unwrap();
    let lease = serde_json::json!({
        "lease_id": "lease_test", "host": "127.0.0.1", "port": 22, "user": "box",
        "identity_file": "/nonexistent", "host_key": host_key,
    });
    h.core
        .store
        .set_environment_lease(&h.a.scope, &env, "lease_test", &lease.to_string(), None)
        .unwrap();
    h.core.envs.warm_bundle().await;
    let build = h.core.envs.bundle_hash_now().unwrap();
    let mut claims = h.a.claims.clone();
    claims.bundle_hash = build.clone();
    claims.worker_key = host_key.into();
    claims.credential_id = skiff_store::mint().unwrap();
    h.core.workers.open_worker_endpoint(&env).unwrap();

    let stream = tokio::net::UnixStream::connect(h.core.workers.socket_path(&env))
        .await
        .unwrap();
    let (read, mut write) = stream.into_split();
    let mut read = tokio::io::BufReader::new(read);
    let hello = skiff_protocol::worker::WorkerFrame::Hello {
        protocol_version: skiff_protocol::worker::PROTOCOL_VERSION,
        build_hash: build,
        features: claims
            .methods
            .iter()
            .map(|m| m.as_str().to_owned())
            .collect(),
        credential: h.core.workers.signer.sign(&claims),
    };
    skiff_wire::write_frame(&mut write, &hello).await.unwrap();
    let mut next = async || -> GatewayFrame {
        let line = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            skiff_wire::read_line(&mut read),
        )
        .await
        .expect("the gateway answers within 20 s")
        .unwrap()
        .expect("the gateway keeps the connection open");
        serde_json::from_str(&line).unwrap()
    };
    let welcome = next().await;
    assert!(
        matches!(welcome, GatewayFrame::Welcome { .. }),
        "{welcome:?}"
    );
    let turn = next().await;
    assert!(
        matches!(&turn, GatewayFrame::Turn { turn } if turn.run_id == h.run),
        "{turn:?}"
    );

    let call = skiff_protocol::worker::WorkerFrame::Call {
        op: h.op(StreamKind::Transcript, 1),
        call: commit("done on the box"),
    };
    skiff_wire::write_frame(&mut write, &call).await.unwrap();
    let reply = next().await;
    assert!(
        matches!(&reply, GatewayFrame::Reply { seq: 1, reply: Reply::Committed { entries }, .. } if entries.len() == 1),
        "{reply:?}"
    );

    use tokio::io::AsyncWriteExt;
    write.write_all(b"\xff\xfe\n").await.unwrap();
    let refused = next().await;
    assert!(
        matches!(&refused, GatewayFrame::Refused { code: RefusalCode::BadFrame, message } if message.contains("UTF-8")),
        "{refused:?}"
    );
}

/// A worker whose session's owner was removed is refused at the endpoint with a reason that
/// names the owner, the refusal is audited as the owner's (never another user's), and the
/// worker never acts with anyone's rights.
#[tokio::test]
async fn a_worker_whose_sessions_owner_was_removed_is_refused_and_the_refusal_audited_as_theirs() {
    let h = Harness::new().await.unwrap();
    let env = h.a.claims.environment_id.clone();
    h.core
        .store
        .create_environment(&h.a.scope, &env, "local", "local", "op_test")
        .unwrap();
    let owner = h.core.store.user_of(&h.a.scope).unwrap().unwrap();
    h.core.store.remove_user(&owner).unwrap();
    h.core.envs.warm_bundle().await;
    let build = h.core.envs.bundle_hash_now().unwrap();
    let mut claims = h.a.claims.clone();
    claims.bundle_hash = build.clone();
    claims.credential_id = skiff_store::mint().unwrap();
    let hello = skiff_protocol::worker::WorkerFrame::Hello {
        protocol_version: skiff_protocol::worker::PROTOCOL_VERSION,
        build_hash: build,
        features: claims
            .methods
            .iter()
            .map(|m| m.as_str().to_owned())
            .collect(),
        credential: h.core.workers.signer.sign(&claims),
    };
    let (gateway_end, worker_end) = tokio::net::UnixStream::pair().unwrap();
    let serving = tokio::spawn(
        h.core
            .workers
            .clone()
            .serve_worker(env.clone(), gateway_end),
    );
    let (read, mut write) = worker_end.into_split();
    let mut read = tokio::io::BufReader::new(read);
    skiff_wire::write_frame(&mut write, &hello).await.unwrap();
    let line = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        skiff_wire::read_line(&mut read),
    )
    .await
    .expect("the gateway answers within 20 s")
    .unwrap()
    .expect("the gateway answers before it closes");
    let frame: GatewayFrame = serde_json::from_str(&line).unwrap();
    let GatewayFrame::Refused { code, message } = frame else {
        panic!("a worker of a removed owner was not refused: {frame:?}");
    };
    assert_eq!(code, RefusalCode::Forbidden, "{message}");
    assert!(
        message.contains(&owner.id) && message.contains("no longer a user"),
        "{message}"
    );
    serving.await.unwrap();

    let conn = rusqlite::Connection::open(&h.db).unwrap();
    let rows: Vec<(String, String, String)> = conn
        .prepare("SELECT owner_id, tenant_id, detail FROM audit WHERE action = 'worker.admit' AND decision = 'refused'")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].0.as_str(), rows[0].1.as_str()),
        (owner.id.as_str(), "ten_test")
    );
    assert!(rows[0].2.contains("forbidden"), "{}", rows[0].2);
}

/// The migration barrier fences the old owner: once a session is pulled back, a write its
/// old worker still sends (with the epoch it held) is refused and changes nothing.
#[tokio::test]
async fn after_a_pull_back_the_old_workers_writes_are_refused_as_stale() {
    use futures_util::StreamExt;
    let mut h = Harness::new().await.unwrap();
    let (scope, session) = (h.a.scope.clone(), h.a.claims.session_id.clone());
    // The turn ended and its work came back: the session is between turns, its box in step.
    h.core
        .store
        .transition_run(&scope, &h.run, RunStatus::Succeeded, None)
        .unwrap();
    for to in [PlacementState::Reconciling, PlacementState::Active] {
        let change = PlacementChange {
            box_in_step: (to == PlacementState::Active).then_some(true),
            ..Default::default()
        };
        h.core
            .store
            .transition_placement(&scope, &session, to, &change)
            .unwrap();
    }
    let old_epoch = h.a.claims.owner_epoch;
    let before = h.transcript_len().unwrap();

    let answer = h
        .core
        .pull_back(&scope, &session, false, false)
        .await
        .unwrap();
    assert!(answer.moved, "{}", answer.message);
    let events = h
        .core
        .hub
        .subscribe(scope.clone(), session.clone(), answer.after_cursor)
        .unwrap();
    let mut events = std::pin::pin!(events);
    let mut steps = Vec::new();
    while let Some(event) = events.next().await {
        if let skiff_protocol::event::EventKind::Placement { state, .. } = event.unwrap().kind {
            steps.push(state);
            if state == PlacementState::Local {
                break;
            }
        }
    }
    assert_eq!(
        steps,
        [
            PlacementState::Draining,
            PlacementState::Draining,
            PlacementState::Local
        ],
        "claimed, fenced, home: no reconciliation for a box in step"
    );
    let home = h.core.store.placement(&scope, &session).unwrap().unwrap();
    assert_eq!(home.state, PlacementState::Local);
    assert!(home.owner_epoch > old_epoch);
    assert_eq!(home.environment_id, None);

    // A frame the old worker sent before it was stopped arrives on its connection.
    let (tx, frames) = mpsc::unbounded_channel();
    let _closed = h.a.live.connect(h.a.conn_id, old_epoch, tx);
    h.frames = frames;
    let reply = h
        .call(
            StreamKind::Transcript,
            1,
            commit("written by a fenced worker"),
        )
        .await
        .unwrap();
    let (code, message) = refused(&reply).unwrap();
    assert_eq!(code, RefusalCode::StaleEpoch, "{message}");
    assert_eq!(h.transcript_len().unwrap(), before, "the late write landed");

    // Pulling back a session already home changes nothing and says so.
    let again = h
        .core
        .pull_back(&scope, &session, false, false)
        .await
        .unwrap();
    assert!(!again.moved);
    assert!(
        again.message.contains("already runs on the gateway"),
        "{}",
        again.message
    );
}

/// What an admitted worker should do next (its turn again, or a retried orphaned turn) is read
/// from the database; a failed read sends the worker away to reconnect rather than leaving it
/// waiting for a turn that never comes.
#[tokio::test]
async fn a_worker_whose_next_step_cannot_be_read_is_sent_away_to_reconnect() {
    let h = Harness::new().await.unwrap();
    let live = h.a.live.clone();
    let (tx, mut frames) = mpsc::unbounded_channel();
    let closed = live.connect(h.a.conn_id, h.a.claims.owner_epoch, tx);
    h.sql("ALTER TABLE runs RENAME TO runs_unreadable").unwrap();
    h.core.workers.after_admission(&h.a).await;
    assert!(closed.is_cancelled(), "the worker was left waiting");
    assert!(
        frames.try_recv().is_err(),
        "a turn was handed over on a guess"
    );
    let conn = rusqlite::Connection::open(&h.db).unwrap();
    let failed: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM audit WHERE action = 'worker.resume' AND decision = 'failed'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(failed, 1);
    // Reconnected once the database is back, it gets its turn.
    h.sql("ALTER TABLE runs_unreadable RENAME TO runs").unwrap();
    let (tx, mut frames) = mpsc::unbounded_channel();
    let _closed = live.connect(h.a.conn_id, h.a.claims.owner_epoch, tx);
    h.core.workers.after_admission(&h.a).await;
    let turn = next_frame(&mut frames).await.unwrap();
    assert!(
        matches!(&turn, GatewayFrame::Turn { turn } if turn.run_id == h.run),
        "{turn:?}"
    );
}

#[tokio::test]
async fn a_worker_cannot_dispatch_a_child_even_by_naming_the_tool() {
    let mut h = Harness::new().await.unwrap();
    let scope = h.a.scope.clone();
    let before = h.core.store.sessions(&scope).unwrap().len();
    for (seq, name) in skiff_agent::tools::DISPATCH_TOOLS.into_iter().enumerate() {
        let reply = h
            .call(
                StreamKind::Tool,
                seq as u64 + 1,
                Call::ToolGateway {
                    name: name.into(),
                    arguments: serde_json::json!({"prompt": "CHILD: recurse", "id": "ses_x"}),
                },
            )
            .await
            .unwrap();
        match reply {
            Reply::ToolOutput { content, is_error } => {
                assert!(is_error, "{name}: {content}");
                assert!(content.contains("cannot start children"), "{content}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    assert_eq!(h.core.store.sessions(&scope).unwrap().len(), before);
}

#[tokio::test]
async fn a_worker_cannot_choose_how_hard_the_model_thinks() {
    let mut h = Harness::new().await.unwrap();
    let with_reasoning = |effort| {
        let mut call = model_call().unwrap();
        if let Call::ModelStream { request, .. } = &mut call {
            request.reasoning = Some(effort);
        }
        call
    };
    h.core
        .workers
        .on_call(
            &h.a,
            h.op(StreamKind::Model, 1),
            with_reasoning(ReasoningEffort::High),
        )
        .await;
    let events = model_frame(&mut h, 1).await.unwrap();
    assert!(
        matches!(events.as_slice(), [ModelEvent::Error { kind: ModelErrorKind::Rejected, message }] if message.contains("reasoning high is not this session's choice")),
        "{events:?}"
    );

    // The session's own choice is what the worker was handed, and passes.
    let session = h.a.claims.session_id.clone();
    h.core
        .store
        .set_session_reasoning(&h.a.scope, &session, Some("high"))
        .unwrap();
    h.core
        .workers
        .on_call(
            &h.a,
            h.op(StreamKind::Model, 2),
            with_reasoning(ReasoningEffort::High),
        )
        .await;
    let events = model_frame(&mut h, 2).await.unwrap();
    assert!(
        !events.iter().any(|e| matches!(e, ModelEvent::Error { .. })),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_worker_sessions_model_call_past_its_profiles_budget_is_refused_before_the_provider() {
    let mut h = Harness::with_config(
        "[budgets]\nsession_tokens = 100000\n\
         [profiles.local]\nprovider = \"local\"\n[profiles.local.budgets]\nsession_tokens = 100\n",
    )
    .await
    .unwrap();
    // The first call has the whole budget.
    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Model, 1), model_call().unwrap())
        .await;
    let events = model_frame(&mut h, 1).await.unwrap();
    assert!(
        !matches!(events.first(), Some(ModelEvent::Error { .. })),
        "{events:?}"
    );
    // Its reply, committed with its usage: 120 tokens of the profile's 100.
    let mut reply = assistant("first");
    if let EntryBody::AssistantMessage { usage, .. } = &mut reply {
        usage.input_tokens = 100;
        usage.output_tokens = 20;
    }
    let committed = h
        .call(
            StreamKind::Transcript,
            1,
            Call::TranscriptCommit {
                base_leaf: None,
                entries: vec![reply],
            },
        )
        .await
        .unwrap();
    assert!(refused(&committed).is_none(), "{committed:?}");

    h.core
        .workers
        .on_call(&h.a, h.op(StreamKind::Model, 2), model_call().unwrap())
        .await;
    let events = model_frame(&mut h, 2).await.unwrap();
    let [
        ModelEvent::Error {
            kind: ModelErrorKind::BudgetExhausted,
            message,
        },
    ] = events.as_slice()
    else {
        panic!("{events:?}");
    };
    // The profile's key, not the gateway's (which has room), with the figures.
    assert!(
        message.contains("`profiles.local.budgets.session_tokens`")
            && message.contains("used 120 tokens")
            && message.contains("the limit is 100 tokens"),
        "{message}"
    );
    let session = h.a.claims.session_id.clone();
    let lines = h.core.usage_lines(&h.a.scope, &session).unwrap();
    assert!(lines[0].exhausted && lines[0].tokens == 120, "{lines:?}");
}

/// A worker session's agent spec travels with its turn (the worker offers only its tools),
/// and the gateway does not take the worker's word for it: a gateway tool outside the list
/// is refused, and a model request's tools are cut to the list before the provider.
#[tokio::test]
async fn a_worker_sessions_agent_spec_limits_its_tools_on_both_sides() {
    let mut h = Harness::with_config(
        "[agents.reader]\ninstructions = \"Only read.\"\ntools = [\"read\", \"grep\"]\n",
    )
    .await
    .unwrap();
    let (scope, session) = (h.a.scope.clone(), h.a.claims.session_id.clone());
    let version = h
        .core
        .store
        .agent_spec_versions("reader")
        .unwrap()
        .remove(0);
    h.core
        .store
        .pin_session_agent(&scope, &session, "reader", &version.digest)
        .unwrap();

    h.core.workers.hand_over_turn(&scope, &session).unwrap();
    let turn = loop {
        if let GatewayFrame::Turn { turn } = next_frame(&mut h.frames).await.unwrap() {
            break turn;
        }
    };
    assert_eq!(
        turn.tools_allowed,
        Some(vec!["grep".to_owned(), "read".to_owned()]),
        "the stored (canonical) list"
    );
    assert_eq!(turn.agent_instructions.as_deref(), Some("Only read."));

    let reply = h
        .call(
            StreamKind::Tool,
            1,
            Call::ToolGateway {
                name: skiff_agent::tools::WEB_FETCH.into(),
                arguments: serde_json::json!({"url": "http://example.com/"}),
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(&reply, Reply::ToolOutput { is_error: true, content } if content.contains("not one of this agent's tools")),
        "{reply:?}"
    );
    let audit = h.audit("allowed").unwrap();
    assert!(
        !audit.iter().any(|a| a.contains("web_fetch")),
        "the refused fetch ran: {audit:?}"
    );
}

/// A worker session's `git_push` runs on the gateway (`tool.gateway`), from the gateway's
/// repository with its credential: the box sends only the call and gets the bounded result.
#[tokio::test]
async fn a_worker_sessions_git_push_runs_on_the_gateway_under_a_grant() {
    let repo = skiff_test_support::TempGitRepo::new(&[("a.txt", "a\n")]);
    let bare = tempfile::tempdir().unwrap();
    let init = std::process::Command::new("git")
        .args(["init", "-q", "--bare"])
        .arg(bare.path())
        .status()
        .unwrap();
    assert!(init.success());
    repo.git(&["remote", "add", "origin", bare.path().to_str().unwrap()]);
    let source = repo.path().display().to_string();
    let mut h = Harness::with_workspace(
        "[forge]\ntoken = \"vault:forge\"\nrepository = \"acme/w\"\nconfirm = false\n",
        |session| {
            repo.git(&["branch", &format!("skiff/{session}")]);
            WorkspaceView::Git {
                source: source.clone(),
                path: "/state/ws".into(),
                branch: format!("skiff/{session}"),
                base_commit: "0".repeat(40),
                remote: None,
            }
        },
    )
    .await
    .unwrap();
    h.core.vault.set("forge", "ghp_worker_test_token").unwrap();
    let session = h.a.claims.session_id.clone();
    let reply = h
        .call(
            StreamKind::Tool,
            1,
            Call::ToolGateway {
                name: "git_push".into(),
                arguments: serde_json::json!({}),
            },
        )
        .await
        .unwrap();
    let Reply::ToolOutput { content, is_error } = reply else {
        panic!("{reply:?}");
    };
    assert!(!is_error, "{content}");
    assert!(!content.contains("ghp_worker_test_token"), "{content}");
    let pushed: skiff_protocol::grant::GitPushResult = serde_json::from_str(&content).unwrap();
    assert_eq!(pushed.branch, format!("skiff/{session}"));
    let refs = std::process::Command::new("git")
        .arg("-C")
        .arg(bare.path())
        .args(["for-each-ref", "--format=%(refname)"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(refs.stdout).unwrap().trim(),
        format!("refs/heads/skiff/{session}")
    );
    // The grant was minted for this worker's environment and consumed.
    let rows = h.core.store.audit_rows().unwrap();
    let minted = rows
        .iter()
        .find(|r| r.action == "governed.grant")
        .expect("a grant was minted");
    assert_eq!(minted.detail["env"], h.a.claims.environment_id.as_str());
    assert!(
        rows.iter()
            .any(|r| r.action == "governed.execute" && r.decision == "applied")
    );
}

/// A gateway with a worker endpoint open (its listener task holds the core) and a worker
/// connected on it: shutdown stops both and returns only once the state dir's lock is let go,
/// so a gateway started next in the same process takes the state dir at once.
#[tokio::test]
async fn shutdown_with_a_worker_endpoint_open_frees_the_state_dir_for_the_next_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        state_dir: dir.path().join("state"),
        listen: "127.0.0.1:0".into(),
        config: None,
    };
    let running = crate::start(options.clone()).await.unwrap();
    let env = EnvironmentId::from_suffix("box1");
    running.core.workers.open_worker_endpoint(&env).unwrap();
    let socket = running.core.workers.socket_path(&env);
    // A worker that connected and has not said hello yet: its connection holds the core too.
    let _worker = tokio::net::UnixStream::connect(&socket).await.unwrap();
    running.shutdown().await;

    let again = crate::start(options)
        .await
        .unwrap_or_else(|e| panic!("the next gateway could not take the state dir: {e}"));
    again.shutdown().await;
}
