//! The worker against a fake gateway on a unix socket in a temp dir: the hello it sends, how it
//! treats refusals, and what it sends again after a dropped connection. No box, no root, no
//! gateway binary — the fake speaks the worker protocol's frames (`skiff-protocol`) through
//! the same codec (`skiff-wire`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly; clippy.toml only covers #[test] functions"
)]

use skiff_protocol::model::{ModelEvent, ModelRef, StopReason};
use skiff_protocol::worker::{
    Call, GatewayFrame, OpId, PROTOCOL_VERSION, RefusalCode, StreamKind, WorkerFrame,
};
use skiff_protocol::{SessionId, worker::features};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::UnixListener;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// One accepted connection of the fake gateway.
struct Conn {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
}

impl Conn {
    async fn accept(listener: &UnixListener) -> Conn {
        let (stream, _) = tokio::time::timeout(Duration::from_secs(20), listener.accept())
            .await
            .expect("the worker did not connect within 20 s")
            .unwrap();
        let (read, write) = stream.into_split();
        Conn {
            read: BufReader::new(read),
            write,
        }
    }

    /// The next frame from the worker; `None` when it closed the connection.
    async fn next(&mut self) -> Option<WorkerFrame> {
        let line = tokio::time::timeout(
            Duration::from_secs(20),
            skiff_wire::read_line(&mut self.read),
        )
        .await
        .expect("the worker sent nothing within 20 s")
        .unwrap()?;
        Some(serde_json::from_str(&line).unwrap())
    }

    /// The next frame, skipping the acknowledgements of model events (credit), which the
    /// worker sends on its own schedule.
    async fn next_call(&mut self) -> WorkerFrame {
        loop {
            match self.next().await.expect("the worker closed the connection") {
                WorkerFrame::ModelAck { .. } => continue,
                frame => return frame,
            }
        }
    }

    async fn send(&mut self, frame: &GatewayFrame) {
        skiff_wire::write_frame(&mut self.write, frame)
            .await
            .unwrap();
    }

    /// Reads the hello and answers with a welcome for `epoch`, handing out `next_credential`.
    async fn admit(
        &mut self,
        epoch: u64,
        next_credential: &str,
        cursors: BTreeMap<StreamKind, u64>,
    ) -> Hello {
        let hello = self.hello().await;
        self.send(&GatewayFrame::Welcome {
            session_id: session(),
            lifecycle_revision: 0,
            owner_epoch: epoch,
            credential: next_credential.into(),
            credential_expires_at_ms: far_future_ms(),
            cursors,
            workspace: "workspaces/ses_test".into(),
        })
        .await;
        hello
    }

    async fn hello(&mut self) -> Hello {
        match self.next().await.expect("no hello") {
            WorkerFrame::Hello {
                protocol_version,
                build_hash,
                features,
                credential,
            } => Hello {
                protocol_version,
                build_hash,
                features,
                credential,
            },
            other => panic!("expected a hello first, got {other:?}"),
        }
    }
}

#[derive(Debug)]
struct Hello {
    protocol_version: u32,
    build_hash: String,
    features: Vec<String>,
    credential: String,
}

fn session() -> SessionId {
    SessionId::from_suffix("test")
}

fn far_future_ms() -> i64 {
    // An hour from now: no credential rotation during a test.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    i64::try_from(now).unwrap() + 3_600_000
}

fn options(dir: &Path, give_up_after: Duration) -> skiff_worker::Options {
    skiff_worker::Options {
        socket: dir.join("gateway.sock"),
        credential: "first-credential".into(),
        build_hash: "build-abc".into(),
        home: dir.join("home"),
        give_up_after,
    }
}

struct Fake {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    listener: UnixListener,
}

fn fake_gateway() -> Fake {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("home/workspaces/ses_test")).unwrap();
    let listener = UnixListener::bind(dir.path().join("gateway.sock")).unwrap();
    Fake {
        dir: dir.path().to_path_buf(),
        _dir: dir,
        listener,
    }
}

#[tokio::test]
async fn the_hello_carries_the_credential_build_and_protocol_and_a_fatal_refusal_ends_the_worker() {
    let fake = fake_gateway();
    let worker = tokio::spawn(skiff_worker::run(options(
        &fake.dir,
        Duration::from_secs(30),
    )));
    let mut conn = Conn::accept(&fake.listener).await;
    let hello = conn.hello().await;
    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
    assert_eq!(hello.build_hash, "build-abc");
    assert_eq!(hello.credential, "first-credential");
    assert_eq!(hello.features, features());
    conn.send(&GatewayFrame::Refused {
        code: RefusalCode::BuildMismatch,
        message: "this gateway runs build xyz".into(),
    })
    .await;
    let ended = tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("a refused worker must exit")
        .unwrap();
    let err = ended.expect_err("a build mismatch is fatal");
    let text = err.to_string();
    assert!(
        text.contains("build_mismatch") && text.contains("this gateway runs build xyz"),
        "the error names the code and the gateway's reason: {text}"
    );
}

#[tokio::test]
async fn an_unavailable_gateway_is_tried_again_and_a_shutdown_ends_the_worker_cleanly() {
    let fake = fake_gateway();
    let worker = tokio::spawn(skiff_worker::run(options(
        &fake.dir,
        Duration::from_secs(30),
    )));
    let mut first = Conn::accept(&fake.listener).await;
    first.hello().await;
    first
        .send(&GatewayFrame::Refused {
            code: RefusalCode::Unavailable,
            message: "the store is busy".into(),
        })
        .await;
    drop(first);
    let mut second = Conn::accept(&fake.listener).await;
    let hello = second.admit(1, "second-credential", BTreeMap::new()).await;
    assert_eq!(
        hello.credential, "first-credential",
        "a refused hello used nothing up: the same credential is offered again"
    );
    second
        .send(&GatewayFrame::Shutdown {
            reason: "test over".into(),
        })
        .await;
    let ended = tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("a worker told to shut down exits")
        .unwrap();
    assert!(ended.is_ok(), "a shutdown is a clean exit: {ended:?}");
}

#[tokio::test]
async fn a_worker_whose_gateway_never_answers_gives_up_and_says_where_it_looked() {
    let dir = tempfile::tempdir().unwrap();
    let ended = tokio::time::timeout(
        Duration::from_secs(20),
        skiff_worker::run(options(dir.path(), Duration::from_millis(300))),
    )
    .await
    .expect("the worker gives up on its own");
    let text = ended.expect_err("nothing listens").to_string();
    assert!(
        text.contains("gateway.sock") && text.contains("giving up"),
        "the error names the socket: {text}"
    );
}

/// The readiness canary's model stream is cut after one event; on the next connection the
/// worker asks again from where it stopped (`resume_from`), under the same operation id and
/// with the credential the first welcome handed it, and its answer holds every event once.
#[tokio::test]
async fn a_model_stream_cut_by_a_dropped_connection_resumes_where_it_stopped() {
    let fake = fake_gateway();
    let worker = tokio::spawn(skiff_worker::run(options(
        &fake.dir,
        Duration::from_secs(30),
    )));
    let mut first = Conn::accept(&fake.listener).await;
    first.admit(1, "second-credential", BTreeMap::new()).await;
    first
        .send(&GatewayFrame::Canary {
            nonce: "n-42".into(),
            model: ModelRef::parse("fake/model").unwrap(),
        })
        .await;
    let (op, resume_from) = model_call(first.next_call().await);
    assert_eq!(resume_from, 0);
    assert_eq!(op.stream, StreamKind::Model);
    assert_eq!(op.owner_epoch, 1);
    assert_eq!(op.run_id, None, "the canary belongs to no run");
    first
        .send(&GatewayFrame::Model {
            seq: op.seq,
            index: 0,
            events: vec![ModelEvent::TextDelta { text: "n-".into() }],
        })
        .await;
    drop(first);

    let mut second = Conn::accept(&fake.listener).await;
    let hello = second.admit(1, "third-credential", BTreeMap::new()).await;
    assert_eq!(
        hello.credential, "second-credential",
        "each connection is admitted with the credential the last welcome handed out"
    );
    let (again, resume_from) = model_call(second.next_call().await);
    assert_eq!(
        again, op,
        "the same operation, so the gateway answers it from its cache"
    );
    assert_eq!(resume_from, 1, "the worker already has one event");
    // The gateway replays from the start of its cache; the worker drops what it has.
    second
        .send(&GatewayFrame::Model {
            seq: op.seq,
            index: 0,
            events: vec![
                ModelEvent::TextDelta { text: "n-".into() },
                ModelEvent::TextDelta { text: "42".into() },
                ModelEvent::Done {
                    stop_reason: StopReason::EndTurn,
                },
            ],
        })
        .await;
    match second.next_call().await {
        WorkerFrame::CanaryAnswer { nonce, text } => {
            assert_eq!(nonce, "n-42");
            assert_eq!(text, "n-42", "every event once, none doubled");
        }
        other => panic!("expected the canary's answer, got {other:?}"),
    }
    second
        .send(&GatewayFrame::Shutdown {
            reason: "test over".into(),
        })
        .await;
    assert!(worker.await.unwrap().is_ok());
}

/// A live event the gateway acknowledged before the connection dropped is not sent again; one
/// it did not acknowledge is, with its sequence number unchanged.
#[tokio::test]
async fn only_unacknowledged_operations_are_sent_again_after_a_reconnect() {
    let fake = fake_gateway();
    let worker = tokio::spawn(skiff_worker::run(options(
        &fake.dir,
        Duration::from_secs(30),
    )));
    let mut first = Conn::accept(&fake.listener).await;
    first.admit(1, "c2", BTreeMap::new()).await;
    for nonce in ["one", "two"] {
        first
            .send(&GatewayFrame::Canary {
                nonce: nonce.into(),
                model: ModelRef::parse("fake/model").unwrap(),
            })
            .await;
    }
    let mut ops = [
        model_call(first.next_call().await).0,
        model_call(first.next_call().await).0,
    ];
    ops.sort_by_key(|op| op.seq);
    // Answer the first call in full; leave the second unanswered.
    first
        .send(&GatewayFrame::Model {
            seq: ops[0].seq,
            index: 0,
            events: vec![
                ModelEvent::TextDelta { text: "a".into() },
                ModelEvent::Done {
                    stop_reason: StopReason::EndTurn,
                },
            ],
        })
        .await;
    // Its canary answer proves the worker took the reply before the drop.
    assert!(matches!(
        first.next_call().await,
        WorkerFrame::CanaryAnswer { .. }
    ));
    drop(first);

    let mut second = Conn::accept(&fake.listener).await;
    second.admit(1, "c3", BTreeMap::new()).await;
    let (resent, _) = model_call(second.next_call().await);
    assert_eq!(resent, ops[1], "only the unanswered call comes again");
    second
        .send(&GatewayFrame::Shutdown {
            reason: "test over".into(),
        })
        .await;
    assert!(worker.await.unwrap().is_ok());
}

fn model_call(frame: WorkerFrame) -> (OpId, u64) {
    match frame {
        WorkerFrame::Call {
            op,
            call: Call::ModelStream { resume_from, .. },
        } => (op, resume_from),
        other => panic!("expected a model call, got {other:?}"),
    }
}

/// The next call the worker makes, skipping live events and model acknowledgements (neither
/// needs an answer here).
async fn next_op(conn: &mut Conn) -> (OpId, Call) {
    loop {
        match conn.next_call().await {
            WorkerFrame::Call {
                call: Call::EventPublish { .. },
                ..
            } => continue,
            WorkerFrame::Call { op, call } => return (op, call),
            other => panic!("expected a call, got {other:?}"),
        }
    }
}

/// Issue 14's window, held open by the fake gateway: the worker has committed a step of two
/// `exec` calls and asks before each one starts. The first start is admitted and runs; the
/// worker is fenced before the second (a new owner epoch), so that start is refused — and the
/// second command never runs. Its result says why, and the worker's later writes are refused
/// as a fenced owner's are.
#[tokio::test]
async fn a_worker_fenced_before_a_tool_starts_does_not_run_it() {
    use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
    use skiff_protocol::worker::{Reply, TurnAssignment};
    use skiff_protocol::{EntryId, RunId};

    let fake = fake_gateway();
    let worker = tokio::spawn(skiff_worker::run(options(
        &fake.dir,
        Duration::from_secs(30),
    )));
    let mut conn = Conn::accept(&fake.listener).await;
    conn.admit(2, "c2", BTreeMap::new()).await;
    let run = RunId::from_suffix("test");
    let user = TranscriptEntry {
        id: EntryId::from_suffix("user"),
        parent_id: None,
        run_id: Some(run.clone()),
        created_at_ms: 0,
        body: EntryBody::UserMessage {
            text: "log twice".into(),
        },
    };
    let turn: TurnAssignment = serde_json::from_value(serde_json::json!({
        "run_id": run,
        "model": "fake/model",
        "model_label": "fake/model",
        "max_steps": 4,
        "max_output_tokens": 256,
        "context_window": 0,
        "compact_at": 0.8,
        "transcript": [user],
    }))
    .unwrap();
    conn.send(&GatewayFrame::Turn { turn }).await;

    let (op, call) = next_op(&mut conn).await;
    assert!(matches!(call, Call::ModelStream { .. }), "{call:?}");
    let exec = |id: &str, line: &str| ModelEvent::ToolCall {
        call: skiff_protocol::model::ToolCall {
            id: id.into(),
            name: "exec".into(),
            arguments: serde_json::json!({ "command": format!("echo {line} >> runs.log") }),
        },
    };
    conn.send(&GatewayFrame::Model {
        seq: op.seq,
        index: 0,
        events: vec![
            exec("call_1", "one"),
            exec("call_2", "two"),
            ModelEvent::Done {
                stop_reason: StopReason::ToolUse,
            },
        ],
    })
    .await;

    // The step is committed before any of its tools starts.
    let (op, call) = next_op(&mut conn).await;
    let Call::TranscriptCommit { entries, .. } = call else {
        panic!("expected the step's commit, got {call:?}");
    };
    let committed: Vec<TranscriptEntry> = entries
        .into_iter()
        .enumerate()
        .map(|(n, body)| TranscriptEntry {
            id: EntryId::from_suffix(&format!("step{n}")),
            parent_id: Some(EntryId::from_suffix("user")),
            run_id: Some(run.clone()),
            created_at_ms: 0,
            body,
        })
        .collect();
    conn.send(&GatewayFrame::Reply {
        stream: op.stream,
        seq: op.seq,
        reply: Reply::Committed { entries: committed },
    })
    .await;

    // The first start is admitted under epoch 2, and that command runs.
    let (op, call) = next_op(&mut conn).await;
    assert_eq!(
        call,
        Call::ToolStart {
            call_id: "call_1".into(),
            name: "exec".into()
        }
    );
    assert_eq!((op.owner_epoch, op.stream), (2, StreamKind::Tool));
    conn.send(&GatewayFrame::Reply {
        stream: op.stream,
        seq: op.seq,
        reply: Reply::Finished,
    })
    .await;
    // Held just before the second tool starts: the worker waits for the answer, and the
    // owner is fenced meanwhile.
    let (op, call) = next_op(&mut conn).await;
    assert_eq!(
        call,
        Call::ToolStart {
            call_id: "call_2".into(),
            name: "exec".into()
        }
    );
    let log = fake.dir.join("home/workspaces/ses_test/runs.log");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "one\n",
        "the admitted command ran before the next start was asked"
    );
    let stale = "owner epoch 2 is stale; the session's owner is epoch 3";
    conn.send(&GatewayFrame::Reply {
        stream: op.stream,
        seq: op.seq,
        reply: Reply::Refused {
            code: RefusalCode::StaleEpoch,
            message: stale.into(),
        },
    })
    .await;

    // The step's results come next: the refused call's says it did not run, and why.
    let (op, call) = next_op(&mut conn).await;
    let Call::TranscriptCommit { entries, .. } = call else {
        panic!("expected the results' commit, got {call:?}");
    };
    match &entries[1] {
        EntryBody::ToolResult {
            call_id,
            content,
            is_error,
            ..
        } => {
            assert_eq!(call_id, "call_2");
            assert!(*is_error);
            assert!(
                content.starts_with("not run: ") && content.contains(stale),
                "{content}"
            );
        }
        other => panic!("expected the refused call's result, got {other:?}"),
    }
    conn.send(&GatewayFrame::Reply {
        stream: op.stream,
        seq: op.seq,
        reply: Reply::Refused {
            code: RefusalCode::StaleEpoch,
            message: stale.into(),
        },
    })
    .await;
    // A fenced owner's turn ends there; whatever it says at the end changes nothing.
    let (_, call) = next_op(&mut conn).await;
    assert!(matches!(call, Call::TurnFinish { .. }), "{call:?}");
    conn.send(&GatewayFrame::Shutdown {
        reason: "test over".into(),
    })
    .await;
    assert!(worker.await.unwrap().is_ok());
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "one\n",
        "a command ran after its owner was fenced"
    );
}
