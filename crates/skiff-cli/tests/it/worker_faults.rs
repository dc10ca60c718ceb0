//! Fault injection on worker sessions, each mid-stream: the tunnel's ssh dies, the gateway
//! restarts, the worker dies, the box dies. Nothing of the conversation is lost or doubled,
//! and no tool call runs twice.

use crate::harness::{git, stderr};
use crate::worker::{Rig, new_worker_session_args, text_reply, tool_reply};
use serde_json::Value;
use skiff_test_support::{FakeResponse, TempGitRepo};
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The text of the slow final reply, streamed in 40 pieces 100 ms apart.
fn slow_words() -> Vec<String> {
    (0..40).map(|i| format!("w{i} ")).collect()
}

fn slow_reply() -> FakeResponse {
    let words = slow_words();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    text_reply(&refs).with_delay(Duration::from_millis(100))
}

/// One exec that appends to `runs.log` (how many times it ran is visible there), then the
/// slow reply.
fn exec_then_slow(line: &str) -> Vec<FakeResponse> {
    vec![
        tool_reply(
            "call_x",
            "exec",
            &format!(r#"{{"command":"echo {line} >> runs.log"}}"#),
        ),
        slow_reply(),
    ]
}

/// A running `skiff session new|send --json`, its event lines arriving on a channel.
pub struct Following {
    child: Child,
    lines: mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl Following {
    pub fn start(rig: &Rig, args: &[&str]) -> Following {
        let mut child = rig
            .gw
            .cli()
            .arg("session")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && tx.send(v).is_err()
                {
                    break;
                }
            }
        });
        Following {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits (up to a minute) for an event matching `pred`.
    pub fn until(&mut self, what: &str, pred: impl Fn(&Value, &[Value]) -> bool) -> Value {
        loop {
            let event = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no {what} within 60 s; saw {:#?}", self.seen));
            self.seen.push(event.clone());
            if pred(&event, &self.seen) {
                return event;
            }
        }
    }

    /// Waits until the second model call is streaming (its first text has arrived).
    fn mid_second_stream(&mut self) {
        self.until("text of the second model call", |e, seen| {
            e["type"] == "text_delta"
                && seen.iter().filter(|s| s["type"] == "model_request").count() == 2
        });
    }

    pub fn session_id(&self) -> String {
        self.seen[0]["session_id"].as_str().unwrap().to_owned()
    }

    /// Reads to the end; the exit status and every event seen.
    pub fn finish(mut self) -> (std::process::ExitStatus, Vec<Value>) {
        while let Ok(event) = self.lines.recv_timeout(Duration::from_secs(120)) {
            self.seen.push(event);
        }
        (self.child.wait().unwrap(), self.seen)
    }
}

fn new_following(rig: &Rig, repo: &std::path::Path, prompt: &str) -> Following {
    Following::start(rig, &new_worker_session_args(repo, prompt))
}

/// Processes whose command line contains every one of `needles`.
pub fn pids_with(needles: &[&str]) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            needles.iter().all(|n| cmd.contains(n)).then_some(pid)
        })
        .collect()
}

pub fn kill(pids: &[i32]) {
    assert!(!pids.is_empty(), "nothing to kill");
    for pid in pids {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

fn show(rig: &Rig, id: &str) -> Value {
    rig.gw.json(&["session", "show", "--json", id])
}

fn kinds(detail: &Value) -> Vec<String> {
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["body"]["kind"].as_str().unwrap().to_owned())
        .collect()
}

fn last_text(detail: &Value) -> String {
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["body"]["kind"] == "assistant_message")
        .map(|e| e["body"]["text"].as_str().unwrap().to_owned())
        .unwrap()
}

/// The text deltas the client saw for the turn, joined: nothing missing, nothing twice.
fn streamed_text(seen: &[Value], after_model_requests: usize) -> String {
    let mut requests = 0;
    let mut text = String::new();
    for e in seen {
        if e["type"] == "model_request" {
            requests += 1;
        } else if e["type"] == "text_delta" && requests > after_model_requests {
            text.push_str(e["text"].as_str().unwrap());
        }
    }
    text
}

/// Follows the session's event stream from the start until `count` runs have ended.
pub fn wait_runs_ended(rig: &Rig, id: &str, count: usize) -> Value {
    let resp = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
        .get(format!("{}/v1/sessions/{id}/events?after=0", rig.gw.url))
        .bearer_auth(&rig.gw.token)
        .send()
        .unwrap();
    let mut ended = 0;
    for line in BufReader::new(resp).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let event: Value = serde_json::from_str(data).unwrap();
        let terminal = ["succeeded", "failed", "cancelled", "orphaned", "timed_out"];
        if event["type"] == "run_status" && terminal.contains(&event["status"].as_str().unwrap()) {
            ended += 1;
            if ended == count {
                return show(rig, id);
            }
        }
    }
    panic!("the event stream ended before {count} runs of {id} ended");
}

fn runs_log(repo: &TempGitRepo, branch: &str) -> String {
    git(repo.path(), &["show", &format!("{branch}:runs.log")])
}

fn commit_runs_log() -> FakeResponse {
    tool_reply(
        "call_c",
        "exec",
        r#"{"command":"git add runs.log && git commit -q -m 'log'"}"#,
    )
}

#[test]
fn killing_the_tunnel_mid_stream_loses_nothing() {
    let mut responses = exec_then_slow("one");
    responses.insert(1, commit_runs_log());
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut f = new_following(&rig, repo.path(), "log once");
    f.until("the third model call's text", |e, seen| {
        e["type"] == "text_delta"
            && seen.iter().filter(|s| s["type"] == "model_request").count() == 3
    });
    let id = f.session_id();
    // The control connection's ssh master carries the reverse tunnel.
    let state = rig.gw.state_dir.display().to_string();
    kill(&pids_with(&[
        "ssh ",
        &format!("{state}/ssh/"),
        "control.sock",
        "ControlMaster=yes",
    ]));
    let (status, seen) = f.finish();
    assert!(status.success(), "the turn did not survive the tunnel blip");
    // The client saw every word once, in order, although the stream crossed two connections.
    assert_eq!(streamed_text(&seen, 2), slow_words().concat());
    // Every word once, in order, although the stream crossed two connections.
    let f_seen = show(&rig, &id);
    assert_eq!(last_text(&f_seen), slow_words().concat());
    assert_eq!(
        kinds(&f_seen),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "assistant_message",
            "tool_result",
            "assistant_message"
        ]
    );
    assert_eq!(runs_log(&repo, &format!("skiff/{id}")), "one\n");
    // The provider was asked three times: the stream was resumed, not requested again.
    assert_eq!(rig.fake.requests().len(), 3);
    let audit = rig.gw.run(&["session", "show", &id]);
    assert!(audit.status.success(), "{}", stderr(&audit));
}

#[test]
fn killing_the_worker_mid_stream_starts_a_new_one_that_finishes_the_turn() {
    let mut responses = exec_then_slow("one");
    // The replacement worker asks again for the step the dead one never finished.
    responses.push(text_reply(&["finished ", "by ", "the ", "new ", "worker"]));
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut f = new_following(&rig, repo.path(), "log once");
    f.mid_second_stream();
    let id = f.session_id();
    let epoch_before = show(&rig, &id)["session"]["worker"]["owner_epoch"]
        .as_u64()
        .unwrap();
    kill(&pids_with(&[
        "worker",
        "--socket",
        &rig.root.path().display().to_string(),
    ]));
    let (status, _) = f.finish();
    assert!(status.success(), "the run did not finish on the new worker");
    let detail = show(&rig, &id);
    assert_eq!(
        detail["session"]["worker"]["owner_epoch"].as_u64().unwrap(),
        epoch_before + 1,
        "the new worker owns the session under a new epoch"
    );
    assert_eq!(
        kinds(&detail),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "assistant_message"
        ]
    );
    assert_eq!(last_text(&detail), "finished by the new worker");
    assert_eq!(detail["runs"].as_array().unwrap().len(), 1);
    // The exec ran once: its result was committed before the worker died.
    let ws = format!("workspaces/{id}/runs.log");
    let envs = rig.root.boxes();
    let on_box =
        std::fs::read_to_string(rig.root.path().join(&envs[0]).join("home").join(ws)).unwrap();
    assert_eq!(on_box, "one\n");
    assert_eq!(rig.fake.requests().len(), 3);
}

#[test]
fn a_gateway_restart_mid_turn_fails_it_and_retries_it_as_a_new_turn() {
    let mut responses = exec_then_slow("one");
    responses.push(text_reply(&["retried ", "after ", "the ", "restart"]));
    let mut rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut f = new_following(&rig, repo.path(), "log once");
    f.mid_second_stream();
    let id = f.session_id();
    let env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let workers = rig.gw.state_dir.join("workers");
    let stale = workers.join("env_0000000000gone.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    rig.gw.crash_and_restart();
    // The attached environment's socket is live again; the stale one is gone.
    assert!(workers.join(format!("{env}.sock")).exists());
    assert!(
        !stale.exists(),
        "a stale worker socket survived the restart"
    );
    // The client's stream was cut with the gateway; it says so (exit 3), the session goes on.
    let (status, _) = f.finish();
    assert_eq!(status.code(), Some(3));
    let detail = wait_runs_ended(&rig, &id, 2);
    let runs: Vec<&str> = detail["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(runs, ["orphaned", "succeeded"]);
    assert_eq!(
        kinds(&detail),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "notice",
            "assistant_message"
        ]
    );
    assert_eq!(last_text(&detail), "retried after the restart");
    // The half-finished provider stream was not replayed: a new request made the retry, and
    // the tool call before it ran once.
    assert_eq!(rig.fake.requests().len(), 3);
    let on_box = rig
        .root
        .path()
        .join(&rig.root.boxes()[0])
        .join("home/workspaces")
        .join(&id)
        .join("runs.log");
    assert_eq!(std::fs::read_to_string(on_box).unwrap(), "one\n");
}

#[test]
fn with_manual_failover_a_dead_box_reclaims_the_placement_and_the_next_message_starts_fresh() {
    let responses = vec![
        // Turn 1: log "one", commit, done (checkpoint 1 has it).
        tool_reply("c1", "exec", r#"{"command":"echo one >> runs.log"}"#),
        commit_runs_log(),
        text_reply(&["logged ", "one"]),
        // Turn 2: log "two", then the box dies mid-stream.
        tool_reply("c2", "exec", r#"{"command":"echo two >> runs.log"}"#),
        slow_reply(),
        // Turn 3, on a fresh box: what is in the log?
        tool_reply("c3", "exec", r#"{"command":"cat runs.log"}"#),
        text_reply(&["only ", "one"]),
    ];
    let rig = Rig::start(responses, "failover = \"manual\"\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let f = new_following(&rig, repo.path(), "log one");
    assert!(f.finish().0.success());
    let id = {
        let list = rig.gw.json(&["session", "list", "--json"]);
        list["sessions"][0]["id"].as_str().unwrap().to_owned()
    };
    let first_env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut f = Following::start(&rig, &["send", "--json", &id, "log two"]);
    f.until("the second turn's slow text", |e, seen| {
        e["type"] == "text_delta"
            && seen.iter().filter(|s| s["type"] == "model_request").count() == 2
    });
    // The box dies: sshd and everything of it, as `skiff box stop` does.
    let boxes = skiff_providers::local::Boxes::new(
        rig.root.path().to_path_buf(),
        crate::harness::SKIFF.into(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(boxes.destroy(&rig.root.boxes()[0])).unwrap();
    let (status, _) = f.finish();
    assert_eq!(status.code(), Some(1), "the turn on the dead box failed");

    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "reclaimed");
    let error = detail["runs"][1]["error"].as_str().unwrap();
    assert!(
        error.contains("profiles.local.failover is \"manual\""),
        "the failure names the setting that kept the turn from moving on: {error}"
    );
    let notice = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["body"]["kind"] == "notice")
        .map(|e| e["body"]["text"].as_str().unwrap().to_owned())
        .unwrap();
    assert!(notice.contains(&first_env), "{notice}");
    assert!(notice.contains("since checkpoint 1"), "{notice}");
    assert!(notice.contains("exec echo two >> runs.log"), "{notice}");
    // The conversation is intact: both user messages and everything committed are there.
    let users = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "user_message")
        .count();
    assert_eq!(users, 2);

    // The next message leases a fresh box and re-syncs from checkpoint 1.
    let out = rig.session(&["send", "--json", &id, "what is logged?"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = show(&rig, &id);
    let second_env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap();
    assert_ne!(second_env, first_env);
    assert_eq!(detail["session"]["placement"], "active");
    let cat = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap();
    assert!(cat.ends_with("one\n") && !cat.contains("two"), "{cat}");
    // The dead box's environment failed and was torn down.
    let old = rig.gw.json(&["env", "show", "--json", &first_env]);
    assert!(
        ["destroyed", "failed", "destroying"].contains(&old["state"].as_str().unwrap()),
        "{old:#}"
    );
}

/// Fills `path` with `len` bytes that do not compress.
fn incompressible(path: &std::path::Path, len: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_gateway_killed_at_each_placement_step_leaves_no_box_attached_without_a_session() {
    let responses = (0..6).map(|_| text_reply(&["placed"])).collect();
    let mut rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    // Big enough that laying the workspace onto the box takes a moment.
    incompressible(&repo.path().join("blob.bin"), 48 << 20);
    for step in ["provisioning", "syncing", "starting"] {
        let mut f = new_following(&rig, repo.path(), "place me");
        f.until(&format!("the {step} step"), |e, _| {
            e["type"] == "placement" && e["state"] == step
        });
        rig.gw.crash_and_restart();
        let _ = f.finish();
        // The restarted gateway reconciled before it listened: every box still attached
        // belongs to a live placement, and no box is kept for an environment that is gone.
        let envs = rig.gw.json(&["env", "list", "--json"]);
        let envs = envs["environments"].as_array().unwrap();
        for env in envs {
            if env["state"] == "attached" {
                assert!(
                    !env["attached_sessions"].as_array().unwrap().is_empty(),
                    "killed at {step}: an environment is attached to no session: {env:#}"
                );
            }
        }
        let alive = envs
            .iter()
            .filter(|e| ["ready", "idle", "attached"].contains(&e["state"].as_str().unwrap()))
            .count();
        assert!(
            rig.root.boxes().len() <= alive,
            "killed at {step}: boxes {:?} for {alive} live environments",
            rig.root.boxes()
        );
    }
}

/// The `skiff` executable installed on the test's only box.
fn installed_bundle(rig: &Rig) -> std::path::PathBuf {
    let boxes = rig.root.boxes();
    let bundles = rig.root.path().join(&boxes[0]).join("home/.skiff/bundles");
    let hash = std::fs::read_dir(&bundles)
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .file_name();
    bundles.join(hash).join("skiff")
}

#[test]
fn a_replacement_worker_that_dies_before_admission_is_retried_and_the_box_kept() {
    let mut responses = exec_then_slow("one");
    responses.push(text_reply(&["finished ", "after ", "a ", "retry"]));
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut f = new_following(&rig, repo.path(), "log once");
    f.mid_second_stream();
    let id = f.session_id();
    let env_before = show(&rig, &id)["session"]["worker"]["environment_id"].clone();
    // The first replacement cannot start: the worker's executable is away.
    let bundle = installed_bundle(&rig);
    let away = bundle.with_extension("away");
    std::fs::rename(&bundle, &away).unwrap();
    kill(&pids_with(&[
        "worker",
        "--socket",
        &rig.root.path().display().to_string(),
    ]));
    f.until("a second attempt", |e, _| {
        e["type"] == "placement"
            && e["detail"]
                .as_str()
                .is_some_and(|d| d.contains("the box answers, trying again"))
    });
    std::fs::rename(&away, &bundle).unwrap();
    let (status, _) = f.finish();
    assert!(status.success(), "the turn did not finish after the retry");
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    assert_eq!(
        detail["session"]["worker"]["environment_id"], env_before,
        "the healthy box was kept"
    );
    assert_eq!(last_text(&detail), "finished after a retry");
    assert!(
        !kinds(&detail).contains(&"notice".to_owned()),
        "nothing was reported lost"
    );
    let ws = format!("workspaces/{id}/runs.log");
    let on_box = std::fs::read_to_string(
        rig.root
            .path()
            .join(&rig.root.boxes()[0])
            .join("home")
            .join(ws),
    )
    .unwrap();
    assert_eq!(on_box, "one\n", "the exec ran once");
}

#[test]
fn a_box_that_takes_no_new_connections_gives_its_work_back_over_the_open_one() {
    let responses = vec![
        text_reply(&["first ", "turn"]),
        tool_reply(
            "call_w",
            "write",
            r#"{"path":"hello.txt","content":"made on a half-dead box\n"}"#,
        ),
        tool_reply(
            "call_c",
            "exec",
            r#"{"command":"git add hello.txt && git commit -q -m 'Add hello'"}"#,
        ),
        text_reply(&["committed"]),
        text_reply(&["on ", "a ", "fresh ", "box"]),
    ];
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = crate::worker::new_worker_session(&rig, repo.path(), "first");
    assert!(out.status.success(), "{}", stderr(&out));
    let env_before = show(&rig, &id)["session"]["worker"]["environment_id"].clone();

    // The box's sshd stops answering new connections; the connections it has stay up. The
    // gateway's transfer connection is gone, so bringing work back needs a new one.
    let box_dir = rig.root.path().join(&rig.root.boxes()[0]);
    let init = std::fs::read_to_string(box_dir.join("box.pid")).unwrap();
    let init = init.trim();
    // The box's sshd listener: the child of its sandbox init that runs sshd.
    let children = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap();
    let listener = children
        .split_whitespace()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("sshd"))
        })
        .unwrap()
        .to_owned();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &listener])
        .status()
        .unwrap();
    assert!(stopped.success());
    kill(&pids_with(&[
        "ControlMaster=yes",
        "transfer.sock",
        &rig.gw.state_dir.display().to_string(),
    ]));

    let out = rig.session(&["send", "--json", &id, "commit a file"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let branch = format!("skiff/{id}");
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:hello.txt")]),
        "made on a half-dead box\n",
        "the turn's commit came home over the open connection"
    );
    let detail = wait_placement(&rig, &id, "reclaimed");
    let notices = notices(&detail);
    assert_eq!(notices.len(), 1, "{notices:#?}");
    assert!(
        notices[0].contains("accepts no new SSH connections")
            && notices[0].contains("brought back")
            && notices[0].contains("Nothing the agent changed there"),
        "{}",
        notices[0]
    );
    // The next message places the session on a fresh box.
    let out = rig.session(&["send", "--json", &id, "go on"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    assert_ne!(detail["session"]["worker"]["environment_id"], env_before);
}

/// The texts of the session's notices, in transcript order.
pub fn notices(detail: &Value) -> Vec<String> {
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "notice")
        .map(|e| e["body"]["text"].as_str().unwrap().to_owned())
        .collect()
}

/// Follows the session's events until its placement reaches `state`.
pub fn wait_placement(rig: &Rig, id: &str, state: &str) -> Value {
    let detail = show(rig, id);
    if detail["session"]["placement"] == state {
        return detail;
    }
    let resp = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
        .get(format!("{}/v1/sessions/{id}/events?after=0", rig.gw.url))
        .bearer_auth(&rig.gw.token)
        .send()
        .unwrap();
    for line in BufReader::new(resp).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let event: Value = serde_json::from_str(data).unwrap();
        if event["type"] == "placement" && event["state"] == state {
            return show(rig, id);
        }
    }
    panic!("the event stream ended before {id} was {state}");
}

#[test]
fn a_box_that_answers_but_runs_no_worker_gives_its_work_back_before_it_goes() {
    // Manual failover: what is proved here is the box's work coming home before it goes (a
    // failover would place the turn on a box whose worker cannot start either).
    let rig = Rig::start(exec_then_slow("one"), "failover = \"manual\"\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut f = new_following(&rig, repo.path(), "log once");
    f.mid_second_stream();
    let id = f.session_id();
    // From now on `skiff worker` exits at once on the box; the rest of the bundle works.
    let bundle = installed_bundle(&rig);
    std::fs::rename(&bundle, bundle.with_extension("real")).unwrap();
    std::fs::write(
        &bundle,
        "#!/bin/sh\n[ \"$1\" = worker ] && exit 1\nexec \"$(dirname \"$0\")/skiff.real\" \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&bundle, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    kill(&pids_with(&[
        "worker",
        "--socket",
        &rig.root.path().display().to_string(),
    ]));
    let (status, _) = f.finish();
    assert!(!status.success(), "the turn cannot finish without a worker");
    let detail = wait_placement(&rig, &id, "reclaimed");
    // The exec's file, made on the box in the interrupted turn, is in the session's workspace.
    let workspace = detail["session"]["workspace"]["path"].as_str().unwrap();
    assert_eq!(
        std::fs::read_to_string(std::path::Path::new(workspace).join("runs.log")).unwrap(),
        "one\n"
    );
    let notices = notices(&detail);
    assert_eq!(notices.len(), 1, "{notices:#?}");
    assert!(
        notices[0].contains("its work was brought back first")
            && notices[0].contains("Nothing the agent changed there since checkpoint 1"),
        "{}",
        notices[0]
    );
}

#[test]
fn a_box_that_fails_its_check_reclaims_its_session_at_once() {
    let rig = Rig::start(
        vec![text_reply(&["placed"]), text_reply(&["on a fresh box"])],
        "isolation = \"none\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = crate::worker::new_worker_session(&rig, repo.path(), "first");
    assert!(out.status.success(), "{}", stderr(&out));
    let env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let box_dir = rig.root.path().join(&rig.root.boxes()[0]);
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(box_dir.join("box.json")).unwrap()).unwrap();
    crate::env::change_host_key(&box_dir, record["port"].as_u64().unwrap());

    let out = rig.gw.run(&["env", "check", &env, "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    // The session does not stay `active` on a failed box until someone destroys it.
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "reclaimed");
    let notices = notices(&detail);
    assert_eq!(notices.len(), 1, "{notices:#?}");
    assert!(
        notices[0].contains("failed a check") && notices[0].contains("host key"),
        "{}",
        notices[0]
    );
    let out = rig.session(&["send", "--json", &id, "go on"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    assert_ne!(detail["session"]["worker"]["environment_id"], env.as_str());
}

/// A box that dies mid-turn costs the work since the last checkpoint, never the turn: the
/// attempt ends failed with its evidence, a fresh box takes the run over from checkpoint 1
/// under a new epoch, the chat says so, and no tool call runs twice.
#[test]
fn a_box_that_dies_mid_turn_fails_over_to_a_fresh_box_and_the_turn_goes_on() {
    let responses = vec![
        // Turn 1: log "one", commit, done (checkpoint 1 has it).
        tool_reply("c1", "exec", r#"{"command":"echo one >> runs.log"}"#),
        commit_runs_log(),
        text_reply(&["logged ", "one"]),
        // Turn 2: log "two", then the box dies mid-stream...
        tool_reply("c2", "exec", r#"{"command":"echo two >> runs.log"}"#),
        slow_reply(),
        // ...and the turn goes on on a fresh box, from checkpoint 1.
        tool_reply("c3", "exec", r#"{"command":"cat runs.log"}"#),
        text_reply(&["only ", "one"]),
    ];
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    assert!(
        new_following(&rig, repo.path(), "log one")
            .finish()
            .0
            .success()
    );
    let id = {
        let list = rig.gw.json(&["session", "list", "--json"]);
        list["sessions"][0]["id"].as_str().unwrap().to_owned()
    };
    let first_env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut f = Following::start(&rig, &["send", "--json", &id, "log two"]);
    f.mid_second_stream();
    let boxes = skiff_providers::local::Boxes::new(
        rig.root.path().to_path_buf(),
        crate::harness::SKIFF.into(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let killed = std::time::Instant::now();
    rt.block_on(boxes.destroy(&rig.root.boxes()[0])).unwrap();
    f.until("the new attempt's model request", |e, seen| {
        e["type"] == "model_request"
            && seen.iter().filter(|s| s["type"] == "model_request").count() == 3
    });
    // A figure for the closing note, not an assertion: this machine is shared.
    eprintln!(
        "failover: box killed → first model request of the new attempt: {} ms",
        killed.elapsed().as_millis()
    );
    let (status, seen) = f.finish();
    assert!(status.success(), "the turn went on and finished");
    // The placement went through `failed_over` while the new attempt was placed, and said
    // which box died and where the new attempt starts from.
    let steps: Vec<&str> = seen
        .iter()
        .filter(|e| e["type"] == "placement")
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    let over = steps
        .iter()
        .position(|s| *s == "failed_over")
        .unwrap_or_else(|| panic!("no failed_over step: {steps:?}"));
    assert_eq!(steps[over - 1], "reclaimed", "{steps:?}");
    // The new attempt claims a worker slot (a move followers see), then leases a fresh box.
    assert_eq!(
        steps[over + 1..over + 3],
        ["requested", "provisioning"],
        "{steps:?}"
    );
    assert_eq!(steps.last(), Some(&"active"), "{steps:?}");
    let detail_of_over = seen
        .iter()
        .find(|e| e["type"] == "placement" && e["state"] == "failed_over")
        .unwrap()["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        detail_of_over.contains(&format!("box {first_env}"))
            && detail_of_over.contains("from checkpoint 1 (failover 1 of 2)"),
        "{detail_of_over}"
    );

    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    let second_env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(second_env, first_env);
    assert_eq!(detail["runs"][1]["status"], "succeeded");
    let run = detail["runs"][1]["id"].as_str().unwrap();
    let attempts: Vec<&Value> = detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["run_id"] == run)
        .collect();
    assert_eq!(attempts.len(), 2, "{attempts:#?}");
    assert_eq!(attempts[0]["node"], first_env.as_str());
    assert_eq!(attempts[0]["status"], "failed");
    assert!(
        attempts[0]["error"].as_str().unwrap().contains("box"),
        "{attempts:#?}"
    );
    assert_eq!(attempts[1]["node"], second_env.as_str());
    assert_eq!(attempts[1]["status"], "succeeded");
    assert_eq!(attempts[1]["resumed_from"], attempts[0]["id"]);
    assert_eq!(attempts[1]["from_checkpoint"], 1);
    assert!(attempts[1]["owner_epoch"].as_u64() > attempts[0]["owner_epoch"].as_u64());

    let notices: Vec<&str> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "notice")
        .map(|e| e["body"]["text"].as_str().unwrap())
        .collect();
    assert!(
        notices
            .iter()
            .any(|n| n.contains("exec echo two >> runs.log")),
        "the chat names what was lost: {notices:#?}"
    );
    assert!(
        notices
            .iter()
            .any(|n| n
                .contains("The turn goes on on a fresh box from checkpoint 1 (failover 1 of 2")),
        "{notices:#?}"
    );
    // The new box started from checkpoint 1, and the lost exec was not run again.
    let results: Vec<&str> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap())
        .collect();
    let cat = results.last().unwrap();
    assert!(cat.ends_with("one\n") && !cat.contains("two"), "{cat}");
    assert_eq!(rig.fake.requests().len(), 7, "no model call was made twice");

    let out = rig.gw.run(&["session", "show", &id]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("attempt 1  {first_env}"))
            && text.contains(&format!("attempt 2  {second_env}"))
            && text.contains("from checkpoint 1  succeeded"),
        "{text}"
    );
}

/// Destroys the one box under the rig's root (the session's current one), as a dead machine.
fn kill_the_box(rig: &Rig) {
    let live = rig.root.boxes();
    assert_eq!(live.len(), 1, "one live box: {live:?}");
    let boxes = skiff_providers::local::Boxes::new(
        rig.root.path().to_path_buf(),
        crate::harness::SKIFF.into(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(boxes.destroy(&live[0])).unwrap();
}

/// With `failover_attempts = 2`, a run survives two box deaths (each a failover from the last
/// checkpoint onto a fresh box); the third fails the run with an error naming the key, and
/// the session is left reclaimed with every attempt and its evidence listed.
#[test]
fn a_run_fails_over_twice_then_the_third_box_death_fails_it_naming_the_cap() {
    let responses = vec![
        // Turn 1: log "one", commit, done (checkpoint 1 has it).
        tool_reply("c1", "exec", r#"{"command":"echo one >> runs.log"}"#),
        commit_runs_log(),
        text_reply(&["logged ", "one"]),
        // Turn 2: log "two", then the box dies mid-stream, three times over.
        tool_reply("c2", "exec", r#"{"command":"echo two >> runs.log"}"#),
        slow_reply(),
        slow_reply(),
        slow_reply(),
    ];
    let rig = Rig::start(responses, "failover_attempts = 2\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    assert!(
        new_following(&rig, repo.path(), "log one")
            .finish()
            .0
            .success()
    );
    let id = {
        let list = rig.gw.json(&["session", "list", "--json"]);
        list["sessions"][0]["id"].as_str().unwrap().to_owned()
    };

    let mut f = Following::start(&rig, &["send", "--json", &id, "log two"]);
    let mut envs = vec![
        show(&rig, &id)["session"]["worker"]["environment_id"]
            .as_str()
            .unwrap()
            .to_owned(),
    ];
    for requests in [2, 3, 4] {
        // Mid-stream of the turn's `requests`-th model call (the new attempt's first after a
        // failover), the box dies.
        f.until("text of the model call to cut", |e, seen| {
            e["type"] == "text_delta"
                && seen.iter().filter(|s| s["type"] == "model_request").count() == requests
        });
        if requests > 2 {
            let env = show(&rig, &id)["session"]["worker"]["environment_id"]
                .as_str()
                .unwrap()
                .to_owned();
            assert!(
                !envs.contains(&env),
                "a fresh box each time: {env} in {envs:?}"
            );
            envs.push(env);
        }
        kill_the_box(&rig);
    }
    let (status, seen) = f.finish();
    assert_eq!(status.code(), Some(1), "the third death failed the run");
    // Two failovers, each through `failed_over` onto a fresh box; none after the cap.
    let over: Vec<&str> = seen
        .iter()
        .filter(|e| e["type"] == "placement" && e["state"] == "failed_over")
        .map(|e| e["detail"].as_str().unwrap())
        .collect();
    assert_eq!(over.len(), 2, "{over:#?}");
    for (n, (detail, env)) in over.iter().zip(&envs).enumerate() {
        assert!(
            detail.contains(&format!("box {env}"))
                && detail.contains(&format!("(failover {} of 2)", n + 1)),
            "{detail}"
        );
    }

    let detail = show(&rig, &id);
    let run = &detail["runs"][1];
    assert_eq!(run["status"], "failed");
    let error = run["error"].as_str().unwrap();
    assert!(
        error.contains(
            "the turn already moved to a fresh box 2 time(s) (profiles.local.failover_attempts)"
        ),
        "the failure names the cap and its key: {error}"
    );
    assert_eq!(detail["session"]["placement"], "reclaimed");
    let attempts: Vec<&Value> = detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["run_id"] == run["id"])
        .collect();
    assert_eq!(attempts.len(), 3, "{attempts:#?}");
    for (a, env) in attempts.iter().zip(&envs) {
        assert_eq!(a["status"], "failed", "{a:#}");
        assert_eq!(a["node"], env.as_str(), "{a:#}");
        assert!(a["error"].as_str().unwrap().contains("box"), "{a:#}");
    }
    assert_eq!(attempts[1]["resumed_from"], attempts[0]["id"]);
    assert_eq!(attempts[2]["resumed_from"], attempts[1]["id"]);
    assert_eq!(attempts[2]["from_checkpoint"], 1);
    let notes = notices(&detail);
    for n in 1..=2 {
        assert!(
            notes
                .iter()
                .any(|t| t.contains(&format!("from checkpoint 1 (failover {n} of 2"))),
            "{notes:#?}"
        );
    }
    assert!(
        !notes.iter().any(|t| t.contains("failover 3")),
        "no third failover: {notes:#?}"
    );
    // No model call was made twice: 3 for turn 1, then one per attempt after the exec.
    assert_eq!(rig.fake.requests().len(), 7);
}

/// A gateway killed (kill -9) while its worker runs and the box is still being laid (held
/// there by `barrier_fault = "laying:hold"`: the early word is out, the workspace not yet on
/// the box) leaves no session on a box without its workspace: the restarted gateway fails
/// that placement, saying why, and gives the box up; the next message places the session
/// afresh and its tools see the workspace.
#[test]
fn a_gateway_killed_while_the_box_is_laid_places_the_session_afresh_at_the_next_message() {
    let fault = "barrier_fault = \"laying:hold\"\n";
    // The first turn's call (it may or may not be made before the kill) says "held"; the
    // next message's reads the README, then answers.
    let responder = |requests: &[skiff_test_support::RecordedRequest]| {
        let body: Value = serde_json::from_slice(&requests[requests.len() - 1].body).unwrap();
        let messages = body["messages"].as_array().unwrap();
        let last = &messages[messages.len() - 1];
        if last["role"] == "tool" {
            text_reply(&["read ", "it"])
        } else if last.to_string().contains("again") {
            tool_reply("c1", "exec", r#"{"command":"cat README.md"}"#)
        } else {
            text_reply(&["held"])
        }
    };
    let mut rig = Rig::start_with_responder(responder, &format!("[gateway]\n{fault}"));
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut f = new_following(&rig, repo.path(), "first");
    f.until("the placement going active", |e, _| {
        e["type"] == "placement" && e["state"] == "active"
    });
    let id = f.session_id();
    let first_env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // The restarted gateway holds nothing.
    let config = std::fs::read_to_string(rig.gw.config_path()).unwrap();
    std::fs::write(rig.gw.config_path(), config.replace(fault, "")).unwrap();
    rig.gw.crash_and_restart();
    let _ = f.finish();

    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "failed", "{detail:#}");
    let error = detail["session"]["worker"]["error"].as_str().unwrap_or("");
    assert!(
        error.contains("restarted while the workspace was being laid onto")
            && error.contains(&first_env),
        "{detail:#}"
    );

    let out = rig.session(&["send", "--json", &id, "again"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    assert_ne!(
        detail["session"]["worker"]["environment_id"].as_str(),
        Some(first_env.as_str())
    );
    let cat = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap();
    assert!(cat.contains("a repo"), "{cat}");
    assert_eq!(last_text(&detail), "read it");
    // The box that lacked the workspace was given up.
    let old = rig.gw.json(&["env", "show", "--json", &first_env]);
    assert!(
        ["destroyed", "failed", "destroying"].contains(&old["state"].as_str().unwrap()),
        "{old:#}"
    );
}
