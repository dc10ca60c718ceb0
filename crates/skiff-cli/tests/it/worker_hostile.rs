//! A compromised worker: a process on a box that speaks the worker protocol to the gateway's
//! endpoint with a valid credential for its own session (the test mints it with the gateway's
//! signing key, as the gateway would). Every attempt to reach past that session, its owner
//! epoch, its open run or the closed RPC set is refused with a stable code, audited, and leaves
//! the session as it was: its transcript, its provider bill and its next turn.
//!
//! The real worker is stopped (SIGSTOP) before the test's own connection is admitted, because
//! an admission for the same session and epoch replaces the live connection and the real worker
//! would reconnect and take it back.

use crate::harness::{SKIFF, stderr, stdout};
use crate::worker::{Rig, new_worker_session, text_reply};
use serde_json::{Value, json};
use skiff_protocol::model::{Message, ModelErrorKind, ModelEvent, ModelRef, ModelRequest};
use skiff_protocol::worker::{
    CredentialClaims, GatewayFrame, MAX_FRAME_BYTES, Method, PROTOCOL_VERSION, RefusalCode, Reply,
    StreamKind, features,
};
use skiff_protocol::{EnvironmentId, SessionId};
use skiff_test_support::{FakeResponse, TempGitRepo};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long the gateway has to answer a frame.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A sequence number far past any the real worker reaches at the same owner epoch, so the
/// test's operations never collide with the real worker's (a collision is refused as a
/// conflict, which would fail the real worker's turn).
const FAR: u64 = 1_000_000;

/// The session's model in every test here.
const MODEL: &str = "openai/gpt-fake";

/// What a worker needs to speak for a session, gathered the way a test on the gateway's host
/// may: the CLI, the state dir, the database.
struct Target {
    session: String,
    env: String,
    host_key: String,
    build: String,
    socket: PathBuf,
    /// Where the rig's boxes live (the worker's command line names its home under it).
    box_root: String,
    key: [u8; 32],
    store: std::sync::Arc<dyn skiff_store::Backend>,
    scope: skiff_store::Scope,
    /// Audit rows already looked at.
    audited: usize,
}

impl Target {
    fn of(rig: &Rig, session: &str) -> Target {
        let detail = show(rig, session);
        let env = detail["session"]["worker"]["environment_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let store = rig.gw.store();
        let row = store
            .live_environments()
            .unwrap()
            .into_iter()
            .find(|r| r.id.as_str() == env)
            .unwrap_or_else(|| panic!("environment {env} is not live"));
        let lease: Value = serde_json::from_str(row.lease.as_deref().unwrap()).unwrap();
        let build = std::process::Command::new(SKIFF)
            .arg("--build-hash")
            .output()
            .unwrap();
        assert!(build.status.success(), "{}", stderr(&build));
        let key = std::fs::read(rig.gw.state_dir.join("worker-signing.key")).unwrap();
        let audited = store.audit_rows().unwrap().len();
        Target {
            session: session.to_owned(),
            socket: rig.gw.state_dir.join("workers").join(format!("{env}.sock")),
            box_root: rig.root.path().display().to_string(),
            env,
            host_key: lease["host_key"].as_str().unwrap().to_owned(),
            build: stdout(&build).trim().to_owned(),
            key: key.as_slice().try_into().unwrap(),
            scope: row.scope,
            store,
            audited,
        }
    }

    /// Claims for this session's worker at `epoch`, as the gateway mints them.
    fn claims(&self, epoch: u64) -> CredentialClaims {
        let now = skiff_store::now_ms();
        CredentialClaims {
            credential_id: skiff_store::mint().unwrap(),
            environment_id: EnvironmentId::parse(&self.env).unwrap(),
            worker_key: self.host_key.clone(),
            bundle_hash: self.build.clone(),
            session_id: SessionId::parse(&self.session).unwrap(),
            owner_epoch: epoch,
            methods: Method::ALL.to_vec(),
            issued_at_ms: now,
            expires_at_ms: now + 10 * 60 * 1000,
        }
    }

    fn credential(&self, epoch: u64) -> String {
        sign(&self.key, &self.claims(epoch))
    }

    /// Says hello with `credential`; returns the connection and the gateway's first answer.
    fn hello(&self, credential: &str) -> (Conn, GatewayFrame) {
        let mut conn = Conn::open(&self.socket);
        conn.send(&json!({
            "type": "hello",
            "protocol_version": PROTOCOL_VERSION,
            "build_hash": self.build,
            "features": features(),
            "credential": credential,
        }));
        let first = conn
            .next()
            .expect("the gateway closed the connection without answering the hello");
        (conn, first)
    }

    /// An admitted connection for `credential`, and who it speaks for.
    fn admit(&self, credential: &str) -> (Conn, Ident) {
        match self.hello(credential) {
            (
                conn,
                GatewayFrame::Welcome {
                    session_id,
                    lifecycle_revision,
                    owner_epoch,
                    cursors,
                    ..
                },
            ) => {
                assert_eq!(session_id.as_str(), self.session);
                let ident = Ident {
                    session: self.session.clone(),
                    revision: lifecycle_revision,
                    epoch: owner_epoch,
                    cursors,
                };
                (conn, ident)
            }
            (_, other) => panic!("expected a welcome, got {other:?}"),
        }
    }

    /// A hello the gateway must refuse: its code and message; the connection is closed after.
    fn refused_hello(&self, credential: &str) -> (RefusalCode, String) {
        let (mut conn, first) = self.hello(credential);
        let GatewayFrame::Refused { code, message } = first else {
            panic!("expected a refusal, got {first:?}");
        };
        assert!(
            conn.next().is_none(),
            "the connection stays open after a refused hello"
        );
        (code, message)
    }

    /// Asserts that a worker refusal with `action` and `code` was audited since the last check.
    fn expect_audited(&mut self, action: &str, code: RefusalCode) -> Value {
        let new = self.new_refusals();
        new.iter()
            .find(|(a, detail)| a == action && detail["code"] == code.as_str())
            .map(|(_, detail)| detail.clone())
            .unwrap_or_else(|| {
                panic!("no audited {action} refusal {code:?}; new worker refusals: {new:?}")
            })
    }

    /// Every worker refusal audited since the last look: action and detail.
    fn new_refusals(&mut self) -> Vec<(String, Value)> {
        let rows = self.store.audit_rows().unwrap();
        let new = rows
            .iter()
            .skip(self.audited)
            .filter(|r| r.actor == "worker" && r.decision == "refused")
            .map(|r| (r.action.clone(), r.detail.clone()))
            .collect();
        self.audited = rows.len();
        new
    }

    /// The host's pid of the session's current worker. The gateway records the pid the box
    /// sees, in the box's own PID namespace.
    fn worker_pid(&self) -> String {
        let p = self
            .store
            .placement(&self.scope, &SessionId::parse(&self.session).unwrap())
            .unwrap()
            .unwrap();
        crate::env::host_pid(p.worker_pid.unwrap(), &["worker\0--socket", &self.box_root])
            .to_string()
    }

    /// Live events of the session whose streamed text is `text`.
    fn text_events(&self, text: &str) -> usize {
        let session = SessionId::parse(&self.session).unwrap();
        self.store
            .events_after(&self.scope, &session, 0, 1_000_000)
            .unwrap()
            .iter()
            .filter(|e| {
                matches!(&e.kind, skiff_protocol::event::EventKind::TextDelta { text: t } if t == text)
            })
            .count()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `skw1.<hex claims JSON>.<hex keyed blake3>`, the gateway's credential format.
fn sign(key: &[u8; 32], claims: &CredentialClaims) -> String {
    let json = serde_json::to_vec(claims).unwrap();
    format!(
        "skw1.{}.{}",
        hex(&json),
        blake3::keyed_hash(key, &json).to_hex()
    )
}

fn signal(pid: &str, sig: &str) {
    let out = std::process::Command::new("kill")
        .args([sig, pid])
        .output()
        .unwrap();
    assert!(out.status.success(), "kill {sig} {pid}: {}", stderr(&out));
}

fn show(rig: &Rig, session: &str) -> Value {
    rig.gw.json(&["session", "show", "--json", session])
}

fn transcript(rig: &Rig, session: &str) -> Vec<Value> {
    show(rig, session)["transcript"].as_array().unwrap().clone()
}

fn owner_epoch(rig: &Rig, session: &str) -> u64 {
    show(rig, session)["session"]["worker"]["owner_epoch"]
        .as_u64()
        .unwrap()
}

/// The identity an admitted connection's calls carry.
struct Ident {
    session: String,
    revision: u64,
    epoch: u64,
    cursors: BTreeMap<StreamKind, u64>,
}

impl Ident {
    fn op(&self, run: Option<&str>, stream: &str, seq: u64) -> Value {
        json!({
            "session_id": self.session,
            "lifecycle_revision": self.revision,
            "run_id": run,
            "owner_epoch": self.epoch,
            "stream": stream,
            "seq": seq,
        })
    }

    /// The next sequence number on `stream` after what the gateway has applied.
    fn next(&self, stream: StreamKind) -> u64 {
        self.cursors.get(&stream).copied().unwrap_or(0) + 1
    }
}

fn call(op: Value, method: &str, params: Value) -> Value {
    json!({ "type": "call", "op": op, "call": { "method": method, "params": params } })
}

fn notice(text: &str) -> Value {
    json!({ "kind": "notice", "text": text })
}

fn model_request(model: &str, text: &str, max_output_tokens: u32) -> Value {
    let request = ModelRequest {
        reasoning: None,
        model: ModelRef::parse(model).unwrap(),
        system: String::new(),
        messages: vec![Message::User { text: text.into() }],
        tools: Vec::new(),
        max_output_tokens,
    };
    serde_json::to_value(request).unwrap()
}

/// One connection to the worker endpoint, read with a timeout.
struct Conn {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Conn {
    fn open(socket: &std::path::Path) -> Conn {
        let stream = UnixStream::connect(socket)
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", socket.display()));
        stream.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
        let writer = stream.try_clone().unwrap();
        Conn {
            reader: BufReader::new(stream),
            writer,
        }
    }

    fn send(&mut self, frame: &Value) {
        let mut line = serde_json::to_vec(frame).unwrap();
        line.push(b'\n');
        self.writer.write_all(&line).unwrap();
    }

    /// The next frame; `None` when the gateway closed the connection.
    fn next(&mut self) -> Option<GatewayFrame> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => None,
            Ok(_) => Some(
                serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("the gateway sent a bad frame ({e}): {line}")),
            ),
            // A peer that closes with our bytes unread resets the connection: closed all the same.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => None,
            Err(e) => panic!("no frame from the gateway within {ANSWER_TIMEOUT:?}: {e}"),
        }
    }

    /// The first frame `pick` takes, past what the gateway sends unasked (a turn handed over,
    /// event acks). A refusal nobody asked for fails the test.
    fn until<T>(&mut self, what: &str, mut pick: impl FnMut(&GatewayFrame) -> Option<T>) -> T {
        loop {
            let Some(frame) = self.next() else {
                panic!("the gateway closed the connection while the test waited for {what}");
            };
            if let Some(found) = pick(&frame) {
                return found;
            }
            if let GatewayFrame::Refused { .. } = frame {
                panic!("waiting for {what}, the gateway refused a frame: {frame:?}");
            }
        }
    }

    /// A refusal of a whole frame.
    fn refused(&mut self) -> (RefusalCode, String) {
        self.until("a frame refusal", |f| match f {
            GatewayFrame::Refused { code, message } => Some((*code, message.clone())),
            _ => None,
        })
    }

    /// The terminal answer to call `seq` on `stream`.
    fn reply(&mut self, stream: StreamKind, seq: u64) -> Reply {
        self.until(&format!("the reply to {stream:?} {seq}"), |f| match f {
            GatewayFrame::Reply {
                stream: s,
                seq: n,
                reply,
            } if *s == stream && *n == seq => Some(reply.clone()),
            _ => None,
        })
    }

    /// A call the gateway must refuse: the code and message of its reply.
    fn refused_reply(&mut self, stream: StreamKind, seq: u64) -> (RefusalCode, String) {
        match self.reply(stream, seq) {
            Reply::Refused { code, message } => (code, message),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// The last event of model call `seq` (a `Done` or an `Error`).
    fn model_end(&mut self, seq: u64) -> ModelEvent {
        self.until(&format!("the end of model call {seq}"), |f| match f {
            GatewayFrame::Model { seq: n, events, .. }
                if *n == seq
                    && matches!(
                        events.last(),
                        Some(ModelEvent::Done { .. } | ModelEvent::Error { .. })
                    ) =>
            {
                events.last().cloned()
            }
            _ => None,
        })
    }

    fn event_ack(&mut self) -> u64 {
        self.until("an event ack", |f| match f {
            GatewayFrame::EventAck { seq } => Some(*seq),
            _ => None,
        })
    }
}

/// A worker session whose first turn finished (idle, its worker connected), on a rig whose
/// fake provider has `more` replies after the first turn's.
fn idle_worker_session(more: Vec<FakeResponse>) -> (Rig, TempGitRepo, String) {
    let mut responses = vec![text_reply(&["hello"])];
    responses.extend(more);
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "Say hello");
    assert!(out.status.success(), "worker session: {}", stderr(&out));
    (rig, repo, id)
}

/// Sends a message to the end of its turn; returns the assistant's reply as the transcript has it.
fn send_and_read_reply(rig: &Rig, session: &str, prompt: &str) -> String {
    let out = rig.session(&["send", session, prompt]);
    assert!(out.status.success(), "session send: {}", stderr(&out));
    let last = transcript(rig, session).pop().unwrap();
    assert_eq!(last["body"]["kind"], "assistant_message", "{last}");
    last["body"]["text"].as_str().unwrap().to_owned()
}

#[test]
fn forged_expired_replayed_foreign_and_stale_credentials_are_not_admitted() {
    let (rig, _repo, id) = idle_worker_session(vec![text_reply(&["fine"])]);
    let mut t = Target::of(&rig, &id);
    let epoch = owner_epoch(&rig, &id);
    assert!(epoch >= 1, "a placed session has an owner epoch");
    let before = transcript(&rig, &id);
    let real = t.worker_pid();
    signal(&real, "-STOP");

    // A credential for this session admits once; the gateway's answer carries the next one.
    let first = t.credential(epoch);
    let (mut conn, ident) = t.admit(&first);
    assert_eq!(ident.epoch, epoch);

    // Rotation mints one credential per operation: asking again with the same sequence number
    // is answered, not minted anew.
    let seq = FAR;
    let rotate = call(
        ident.op(None, "control", seq),
        "credential.rotate",
        json!({}),
    );
    conn.send(&rotate);
    let Reply::Credential {
        credential: rotated,
        ..
    } = conn.reply(StreamKind::Control, seq)
    else {
        panic!("credential.rotate did not answer with a credential");
    };
    conn.send(&rotate);
    match conn.reply(StreamKind::Control, seq) {
        Reply::Refused { code, message } => {
            assert_eq!(code, RefusalCode::Conflict, "{message}");
            assert!(message.contains("already answered"), "{message}");
        }
        other => panic!("a repeated rotation minted again: {other:?}"),
    }

    // The rotated credential admits once (replacing the connection it came from); neither
    // credential admits again.
    let (conn2, _) = t.admit(&rotated);
    drop(conn);
    for used in [&rotated, &first] {
        let (code, message) = t.refused_hello(used);
        assert_eq!(code, RefusalCode::CredentialReplayed, "{message}");
        t.expect_audited("worker.admit", RefusalCode::CredentialReplayed);
    }

    // Expired.
    let mut claims = t.claims(epoch);
    claims.issued_at_ms -= 20 * 60 * 1000;
    claims.expires_at_ms = skiff_store::now_ms() - 1000;
    let (code, message) = t.refused_hello(&sign(&t.key, &claims));
    assert_eq!(code, RefusalCode::CredentialExpired, "{message}");
    t.expect_audited("worker.admit", RefusalCode::CredentialExpired);

    // Signed with a key that is not the gateway's.
    let mut forged_key = t.key;
    forged_key[0] ^= 0xff;
    let (code, message) = t.refused_hello(&sign(&forged_key, &t.claims(epoch)));
    assert_eq!(code, RefusalCode::BadCredential, "{message}");
    t.expect_audited("worker.admit", RefusalCode::BadCredential);

    // Validly signed, but for another environment than the socket it arrives on.
    let mut claims = t.claims(epoch);
    claims.environment_id = EnvironmentId::from_suffix("someone-elses-box");
    let (code, message) = t.refused_hello(&sign(&t.key, &claims));
    assert_eq!(code, RefusalCode::WrongScope, "{message}");
    t.expect_audited("worker.admit", RefusalCode::WrongScope);

    // Validly signed, but bound to another box's host key.
    let mut claims = t.claims(epoch);
    claims.worker_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIanotherbox".into();
    let (code, message) = t.refused_hello(&sign(&t.key, &claims));
    assert_eq!(code, RefusalCode::BadCredential, "{message}");
    t.expect_audited("worker.admit", RefusalCode::BadCredential);

    // A credential of the previous owner epoch: that worker is fenced.
    let (code, message) = t.refused_hello(&t.credential(epoch - 1));
    assert_eq!(code, RefusalCode::StaleEpoch, "{message}");
    assert!(message.contains(&format!("epoch {epoch}")), "{message}");
    t.expect_audited("worker.admit", RefusalCode::StaleEpoch);

    // None of it touched the session: the real worker comes back (same epoch, nothing replaced)
    // and runs the next turn.
    drop(conn2);
    signal(&real, "-CONT");
    assert_eq!(transcript(&rig, &id), before);
    assert_eq!(send_and_read_reply(&rig, &id, "Still there?"), "fine");
    assert_eq!(owner_epoch(&rig, &id), epoch);
    assert_eq!(transcript(&rig, &id).len(), before.len() + 2);
}

#[test]
fn an_admitted_worker_cannot_leave_its_session_epoch_run_or_method_set() {
    let (rig, repo, id) = idle_worker_session(vec![text_reply(&["other"]), text_reply(&["fine"])]);
    // Another session of the same user, on the gateway.
    let other = rig.gw.new_session(repo.path(), MODEL, "Another session");
    let other_before = transcript(&rig, &other);
    let other_run = show(&rig, &other)["runs"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let finished_run = show(&rig, &id)["runs"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let before = transcript(&rig, &id);
    let mut t = Target::of(&rig, &id);
    let epoch = owner_epoch(&rig, &id);
    let real = t.worker_pid();
    signal(&real, "-STOP");
    let (mut conn, ident) = t.admit(&t.credential(epoch));
    let leaf = before.last().unwrap()["id"].as_str().unwrap().to_owned();
    let mut seq = FAR;

    // A method outside the closed set is not a frame of the protocol; the connection stays.
    conn.send(&call(
        ident.op(None, "control", FAR),
        "sessions.list",
        json!({}),
    ));
    let (code, message) = conn.refused();
    assert_eq!(code, RefusalCode::BadFrame);
    assert!(message.contains("unknown variant"), "{message}");
    t.expect_audited("worker.frame", RefusalCode::BadFrame);

    // Writing into another session's transcript.
    conn.send(&call(
        json!({
            "session_id": other, "lifecycle_revision": 0, "run_id": other_run,
            "owner_epoch": epoch, "stream": "transcript", "seq": seq,
        }),
        "transcript.commit",
        json!({ "base_leaf": null, "entries": [notice("planted in another session")] }),
    ));
    let (code, message) = conn.refused_reply(StreamKind::Transcript, seq);
    assert_eq!(code, RefusalCode::WrongScope, "{message}");
    t.expect_audited("worker.call", RefusalCode::WrongScope);
    assert_eq!(transcript(&rig, &other), other_before);

    // Writing as the previous owner epoch.
    seq += 1;
    let mut stale = ident.op(Some(&finished_run), "transcript", seq);
    stale["owner_epoch"] = json!(epoch - 1);
    conn.send(&call(
        stale,
        "transcript.commit",
        json!({ "base_leaf": leaf, "entries": [notice("from the past")] }),
    ));
    let (code, message) = conn.refused_reply(StreamKind::Transcript, seq);
    assert_eq!(code, RefusalCode::StaleEpoch, "{message}");
    t.expect_audited("worker.call", RefusalCode::StaleEpoch);

    // Writing into the finished turn, or into no turn at all: the session has no open run.
    for run in [Some(finished_run.as_str()), None] {
        seq += 1;
        conn.send(&call(
            ident.op(run, "transcript", seq),
            "transcript.commit",
            json!({ "base_leaf": leaf, "entries": [notice("after the fact")] }),
        ));
        let (code, message) = conn.refused_reply(StreamKind::Transcript, seq);
        assert_eq!(code, RefusalCode::WrongScope, "{message}");
        t.expect_audited("worker.call", RefusalCode::WrongScope);
    }

    // The same connection still gets answers after all of that.
    let rotate_seq = FAR;
    conn.send(&call(
        ident.op(None, "control", rotate_seq),
        "credential.rotate",
        json!({}),
    ));
    assert!(
        matches!(
            conn.reply(StreamKind::Control, rotate_seq),
            Reply::Credential { .. }
        ),
        "the connection is not usable after refused frames"
    );

    // Nothing was written, and the real worker takes the next turn under the same epoch.
    drop(conn);
    signal(&real, "-CONT");
    assert_eq!(transcript(&rig, &id), before);
    assert_eq!(transcript(&rig, &other), other_before);
    assert_eq!(send_and_read_reply(&rig, &id, "Still there?"), "fine");
    assert_eq!(owner_epoch(&rig, &id), epoch);
}

#[test]
fn during_a_turn_a_worker_cannot_forge_entries_pick_models_or_apply_anything_twice() {
    let (rig, _repo, id) = idle_worker_session(vec![
        // The real worker's model call of the second turn hangs until the gateway cancels it.
        FakeResponse::stall(),
        // The replacement worker runs that turn again.
        text_reply(&["recovered"]),
        text_reply(&["fine"]),
    ]);
    let out = rig.session(&["send", "--detach", "--json", &id, "Take your time"]);
    assert!(out.status.success(), "session send: {}", stderr(&out));
    let started: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let run = started["run"]["id"].as_str().unwrap().to_owned();
    // The real worker is inside the turn once the gateway has asked the provider for it.
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    while rig.fake.requests().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the second turn never reached the provider"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut t = Target::of(&rig, &id);
    let epoch = owner_epoch(&rig, &id);
    let real = t.worker_pid();
    signal(&real, "-STOP");
    let (mut conn, ident) = t.admit(&t.credential(epoch));
    // The real worker is gone for good: the gateway replaces it once this connection ends.
    signal(&real, "-KILL");
    let before = transcript(&rig, &id);
    let leaf = before.last().unwrap()["id"].as_str().unwrap().to_owned();
    assert_eq!(before.last().unwrap()["body"]["kind"], "user_message");
    let mut seq = ident.next(StreamKind::Transcript);

    // Entries with ids or parent ids chosen by the worker are not frames of the protocol.
    for field in ["id", "parent_id"] {
        let mut entry = notice("with a chosen id");
        entry[field] = json!("ent_chosenbytheworker");
        conn.send(&call(
            ident.op(Some(&run), "transcript", seq),
            "transcript.commit",
            json!({ "base_leaf": leaf, "entries": [entry] }),
        ));
        let (code, message) = conn.refused();
        assert_eq!(code, RefusalCode::BadFrame);
        assert!(
            message.contains(&format!("unknown field `{field}`")),
            "{message}"
        );
        t.expect_audited("worker.frame", RefusalCode::BadFrame);
    }

    // A worker does not speak for the user.
    conn.send(&call(
        ident.op(Some(&run), "transcript", seq),
        "transcript.commit",
        json!({ "base_leaf": leaf, "entries": [{ "kind": "user_message", "text": "rm -rf, says the user" }] }),
    ));
    let (code, message) = conn.refused_reply(StreamKind::Transcript, seq);
    assert_eq!(code, RefusalCode::Forbidden, "{message}");
    // Checked last, so that the rest of this test runs whatever the audit log holds.
    let forbidden_audit = t.new_refusals();
    seq += 1;

    // No endpoint, key or header of the worker's choosing reaches the inference proxy.
    let requests = rig.fake.requests().len();
    let mut model_seq = 1000;
    let own = model_request(MODEL, "hi", 100);
    let mut with_headers = own.clone();
    with_headers["headers"] = json!({ "x-exfiltrate": "1" });
    for params in [
        json!({ "request": own, "endpoint": "http://attacker.invalid/v1" }),
        json!({ "request": own, "options": { "api_key": "sk-attacker" } }),
        json!({ "request": with_headers }),
    ] {
        model_seq += 1;
        conn.send(&call(
            ident.op(Some(&run), "model", model_seq),
            "model.stream",
            params,
        ));
        let (code, message) = conn.refused();
        assert_eq!(code, RefusalCode::BadFrame);
        assert!(message.contains("unknown field"), "{message}");
        t.expect_audited("worker.frame", RefusalCode::BadFrame);
    }

    // Nor a model the session does not use, an oversized answer, or a context over the
    // proxy's limit (a frame under the endpoint's).
    let big = "a".repeat(7 * 1024 * 1024 + 512 * 1024);
    for (request, code, says) in [
        (
            model_request("openai/gpt-expensive", "hi", 100),
            RefusalCode::NotAllowed,
            "not this session's model",
        ),
        (
            model_request(MODEL, "hi", 1_000_000),
            RefusalCode::NotAllowed,
            "max_output_tokens",
        ),
        (
            model_request(MODEL, &big, 100),
            RefusalCode::TooLarge,
            "limit is 7340032",
        ),
    ] {
        model_seq += 1;
        conn.send(&call(
            ident.op(Some(&run), "model", model_seq),
            "model.stream",
            json!({ "request": request }),
        ));
        match conn.model_end(model_seq) {
            ModelEvent::Error { kind, message } => {
                assert_eq!(kind, ModelErrorKind::Rejected, "{message}");
                assert!(message.contains(says), "{message}");
            }
            other => panic!("the proxy served a request it must refuse: {other:?}"),
        }
        t.expect_audited("worker.call", code);
    }
    assert_eq!(
        rig.fake.requests().len(),
        requests,
        "a refused model call reached the provider"
    );
    assert_eq!(
        transcript(&rig, &id),
        before,
        "a refused write changed the transcript"
    );

    // A live event delivered twice is acknowledged twice and published once.
    let marker = "streamed exactly once";
    let event_seq = ident.next(StreamKind::Events);
    let publish = call(
        ident.op(Some(&run), "events", event_seq),
        "event.publish",
        json!({ "event": { "type": "text_delta", "text": marker } }),
    );
    for _ in 0..2 {
        conn.send(&publish);
        assert_eq!(conn.event_ack(), event_seq);
    }
    assert_eq!(t.text_events(marker), 1);

    // A commit delivered twice gets the same answer twice and lands once.
    let commit = call(
        ident.op(Some(&run), "transcript", seq),
        "transcript.commit",
        json!({ "base_leaf": leaf, "entries": [notice("committed exactly once")] }),
    );
    conn.send(&commit);
    let first = conn.reply(StreamKind::Transcript, seq);
    let Reply::Committed { entries } = &first else {
        panic!("the commit was refused: {first:?}");
    };
    assert_eq!(entries.len(), 1);
    assert_eq!(
        entries[0].parent_id.as_ref().map(|p| p.as_str()),
        Some(leaf.as_str()),
        "the gateway chose the parent"
    );
    conn.send(&commit);
    assert_eq!(conn.reply(StreamKind::Transcript, seq), first);
    // The same number with another call is not a duplicate: it is refused, never answered
    // with the first call's reply.
    let reuse = call(
        ident.op(Some(&run), "transcript", seq),
        "transcript.commit",
        json!({ "base_leaf": leaf, "entries": [notice("a different commit")] }),
    );
    conn.send(&reuse);
    let (code, _) = conn.refused_reply(StreamKind::Transcript, seq);
    assert_eq!(code, RefusalCode::Conflict);
    t.expect_audited("worker.call", RefusalCode::Conflict);
    let after = transcript(&rig, &id);
    assert_eq!(after.len(), before.len() + 1);
    assert_eq!(after.last().unwrap()["id"], entries[0].id.as_str());

    // The session is unharmed: the gateway replaces the dead worker, the turn finishes on the
    // replacement, and the next message gets its answer.
    drop(conn);
    let watched = rig.session(&["watch", &id]);
    assert!(
        watched.status.success(),
        "the interrupted turn did not finish: {}",
        stderr(&watched)
    );
    assert!(
        owner_epoch(&rig, &id) > epoch,
        "the dead worker was not replaced"
    );
    let texts: Vec<Value> = transcript(&rig, &id)
        .iter()
        .map(|e| e["body"]["text"].clone())
        .collect();
    assert_eq!(
        texts
            .iter()
            .filter(|t| *t == "committed exactly once")
            .count(),
        1
    );
    assert_eq!(texts.last().unwrap(), "recovered");
    assert_eq!(send_and_read_reply(&rig, &id, "Still there?"), "fine");

    assert!(
        forbidden_audit
            .iter()
            .any(|(action, detail)| action == "worker.call" && detail["code"] == "forbidden"),
        "the refused user_message commit was not audited; worker refusals: {forbidden_audit:?}"
    );
}

#[test]
fn an_oversized_frame_is_refused_and_ends_the_connection() {
    let (rig, _repo, id) = idle_worker_session(vec![text_reply(&["fine"])]);
    let before = transcript(&rig, &id);
    let mut t = Target::of(&rig, &id);
    let epoch = owner_epoch(&rig, &id);
    let real = t.worker_pid();
    signal(&real, "-STOP");
    let (mut conn, _) = t.admit(&t.credential(epoch));

    let mut huge = vec![b'x'; MAX_FRAME_BYTES + 1024];
    huge.push(b'\n');
    let mut writer = conn.writer.try_clone().unwrap();
    // The gateway stops reading at the limit, so the rest of the write may never drain.
    let pusher = std::thread::spawn(move || {
        let _ = writer.write_all(&huge);
    });
    let answer = conn.next();
    let closed = answer.is_none() || conn.next().is_none();
    pusher.join().unwrap();
    t.expect_audited("worker.frame", RefusalCode::TooLarge);
    assert!(closed, "the connection stays open after an oversized frame");

    // The session is unharmed: the real worker comes back and takes the next turn.
    drop(conn);
    signal(&real, "-CONT");
    assert_eq!(transcript(&rig, &id), before);
    assert_eq!(send_and_read_reply(&rig, &id, "Still there?"), "fine");
    assert_eq!(owner_epoch(&rig, &id), epoch);

    // And the worker was told why its connection ended.
    match answer {
        Some(GatewayFrame::Refused { code, message }) => {
            assert_eq!(code, RefusalCode::TooLarge, "{message}");
            assert!(message.contains("8388608"), "{message}");
        }
        other => panic!(
            "the gateway closed an oversized frame's connection without saying why: {other:?}"
        ),
    }
}

/// Issue 14's window, held open: the old worker has committed a step that calls `exec` and is
/// held just before the tool starts (this test's connection is that worker). Its epoch is
/// fenced meanwhile — its connection ends and the gateway replaces it. Whatever it does next,
/// the call never runs: a start asked under the old epoch is refused, and the old epoch cannot
/// even connect again. The new owner answers the call in the transcript (its result was never
/// recorded) instead of running it, and the turn goes on.
#[test]
fn a_worker_fenced_just_before_its_tool_starts_never_runs_it() {
    let (rig, _repo, id) = idle_worker_session(vec![
        // The real worker's model call of the second turn hangs until the gateway cancels it.
        FakeResponse::stall(),
        // The replacement asks for the step after the held one.
        text_reply(&["recovered"]),
    ]);
    let out = rig.session(&["send", "--detach", "--json", &id, "Log it"]);
    assert!(out.status.success(), "session send: {}", stderr(&out));
    let started: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let run = started["run"]["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    while rig.fake.requests().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the second turn never reached the provider"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut t = Target::of(&rig, &id);
    let epoch = owner_epoch(&rig, &id);
    let real = t.worker_pid();
    signal(&real, "-STOP");
    let (mut conn, ident) = t.admit(&t.credential(epoch));
    signal(&real, "-KILL");

    // The held worker's step: one `exec` that would leave its mark in the workspace.
    let leaf = transcript(&rig, &id).last().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let step = skiff_protocol::transcript::EntryBody::AssistantMessage {
        text: "On it.".into(),
        tool_calls: vec![skiff_protocol::model::ToolCall {
            id: "call_held".into(),
            name: "exec".into(),
            arguments: json!({ "command": "echo call_held >> runs.log" }),
        }],
        model: MODEL.into(),
        usage: Default::default(),
        stop_reason: skiff_protocol::model::StopReason::ToolUse,
        reasoning: Vec::new(),
    };
    let seq = FAR;
    conn.send(&call(
        ident.op(Some(&run), "transcript", seq),
        "transcript.commit",
        json!({ "base_leaf": leaf, "entries": [serde_json::to_value(&step).unwrap()] }),
    ));
    assert!(
        matches!(
            conn.reply(StreamKind::Transcript, seq),
            Reply::Committed { .. }
        ),
        "the held worker's step was not committed"
    );
    let start = json!({ "call_id": "call_held", "name": "exec" });
    // A start asked in the name of an epoch that is no longer the owner's is refused.
    let mut stale = ident.op(Some(&run), "tool", FAR);
    stale["owner_epoch"] = json!(epoch - 1);
    conn.send(&call(stale, "tool.start", start.clone()));
    let (code, message) = conn.refused_reply(StreamKind::Tool, FAR);
    assert_eq!(code, RefusalCode::StaleEpoch, "{message}");
    t.expect_audited("worker.call", RefusalCode::StaleEpoch);

    // The fence: the held worker's connection ends, and the gateway replaces it under a new
    // epoch; the new worker takes the turn up from the transcript.
    drop(conn);
    let watched = rig.session(&["watch", &id]);
    assert!(
        watched.status.success(),
        "the turn did not finish at the new owner: {}",
        stderr(&watched)
    );
    assert!(owner_epoch(&rig, &id) > epoch, "the worker was not fenced");

    // Released, the old worker cannot ask again: its epoch is not admitted.
    let (code, message) = t.refused_hello(&t.credential(epoch));
    assert_eq!(code, RefusalCode::StaleEpoch, "{message}");

    // The call never ran, on the box or after its work came home; the transcript answers it
    // once, saying its result was never recorded; the turn went on to its end.
    let detail = show(&rig, &id);
    assert_eq!(crate::handoff::runs_log(&detail), "", "the fenced call ran");
    for env in rig.root.boxes() {
        let on_box = rig
            .root
            .path()
            .join(env)
            .join("home/workspaces")
            .join(&id)
            .join("runs.log");
        assert!(!on_box.exists(), "the fenced call ran on the box");
    }
    let entries = transcript(&rig, &id);
    let answers: Vec<&Value> = entries
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result" && e["body"]["call_id"] == "call_held")
        .collect();
    assert_eq!(answers.len(), 1, "{entries:#?}");
    assert_eq!(answers[0]["body"]["is_error"], true);
    assert!(
        answers[0]["body"]["content"]
            .as_str()
            .unwrap()
            .starts_with("no result was recorded for this call"),
        "{:#?}",
        answers[0]
    );
    assert_eq!(
        entries.last().unwrap()["body"]["text"],
        "recovered",
        "{entries:#?}"
    );
}
