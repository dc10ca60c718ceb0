//! Sessions that move: `session dispatch` places a session on a worker box without a message,
//! `session pull-back` brings it home through the migration barrier — the worker stopped and
//! fenced, the box's work in the gateway's workspace, the box back in the idle pool — and the
//! next turn runs on the gateway. Real gateway, real local boxes, the real worker, a fake
//! OpenAI-compatible provider.

use crate::harness::{stderr, stdout};
use crate::worker::{Rig, text_reply, tool_reply};
use crate::worker_faults::Following;
use serde_json::Value;
use skiff_test_support::{FakeResponse, TempGitRepo};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

fn show(rig: &Rig, id: &str) -> Value {
    rig.gw.json(&["session", "show", "--json", id])
}

/// A local session (no profile) on `repo`, after its first turn.
fn local_session(rig: &Rig, repo: &std::path::Path) -> String {
    let out = rig.session(&[
        "new",
        "--json",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.to_str().unwrap(),
        "hello",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    first["session_id"].as_str().unwrap().to_owned()
}

/// The environments `env list` shows, as (id, state).
fn environments(rig: &Rig) -> Vec<(String, String)> {
    let list = rig.gw.json(&["env", "list", "--json"]);
    list["environments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["id"].as_str().unwrap().to_owned(),
                e["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A reply streamed slowly enough (20 s) that commands can run while it streams.
fn long_reply() -> FakeResponse {
    let words: Vec<String> = (0..200).map(|i| format!("w{i} ")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    text_reply(&refs).with_delay(std::time::Duration::from_millis(100))
}

fn now_ms() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// Milliseconds from `since_ms` to the first model request of a `--json` turn stream.
fn first_model_request_after(out: &std::process::Output, since_ms: i64) -> i64 {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["type"] == "model_request")
        .map(|e| e["at_ms"].as_i64().unwrap() - since_ms)
        .unwrap_or_else(|| panic!("no model request in {}", stdout(out)))
}

/// The last tool result of the session's transcript.
fn last_tool_result(detail: &Value) -> String {
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap()
}

#[test]
fn a_dispatched_session_pulled_back_mid_turn_brings_the_boxs_work_home_and_runs_its_next_turn_on_the_gateway()
 {
    let mut responses = vec![text_reply(&["hello"])];
    // On the box: a change nobody commits, then a long reply to cancel.
    responses.push(tool_reply(
        "w1",
        "exec",
        r#"{"command":"echo made on the box >> runs.log"}"#,
    ));
    responses.push(long_reply());
    // At home: read the box's work where the gateway keeps the workspace.
    responses.push(tool_reply(
        "r1",
        "exec",
        r#"{"command":"cat runs.log && pwd"}"#,
    ));
    responses.push(text_reply(&["read it"]));
    // On a warm box again, then home again.
    responses.push(text_reply(&["on the box again"]));
    responses.push(text_reply(&["home again"]));
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = local_session(&rig, repo.path());
    let home = show(&rig, &id)["session"]["workspace"]["path"]
        .as_str()
        .unwrap()
        .to_owned();

    // Dispatch without a message: placed now, no turn.
    let started = Instant::now();
    let out = rig
        .gw
        .run(&["session", "dispatch", &id, "--profile", "local"]);
    let cold_dispatch = started.elapsed();
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    for step in ["◦ requested", "◦ provisioning", "◦ syncing", "◦ active"] {
        assert!(err.contains(step), "no {step} step: {err}");
    }
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    assert_eq!(detail["runs"].as_array().unwrap().len(), 1, "a turn ran");
    let env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Dispatching to the profile it is on is a no-op that says so.
    let again = rig
        .gw
        .run(&["session", "dispatch", &id, "--profile", "local"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("already on profile local"),
        "{}",
        stderr(&again)
    );

    // A turn on the box, mid-reply: pull-back is refused, then cancels it with --cancel.
    let mut turn = Following::start(&rig, &["send", "--json", &id, "log it and talk"]);
    turn.until("the slow reply streaming", |e, seen| {
        e["type"] == "text_delta"
            && seen.iter().filter(|s| s["type"] == "model_request").count() == 2
    });
    let refused = rig.gw.run(&["session", "pull-back", &id]);
    assert_eq!(refused.status.code(), Some(5), "busy: {}", stderr(&refused));
    assert!(
        stderr(&refused).contains("has a turn running; wait for it, pass --live"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(show(&rig, &id)["session"]["placement"], "active");

    let out = rig.gw.run(&["session", "pull-back", "--cancel", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    for step in ["◦ draining", "fences it", "◦ local"] {
        assert!(err.contains(step), "no {step:?} step: {err}");
    }
    let (status, _) = turn.finish();
    assert!(!status.success(), "the cancelled turn's follower succeeded");
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "local");
    assert_eq!(detail["session"]["worker"]["environment_id"], Value::Null);
    assert_eq!(
        detail["runs"].as_array().unwrap().last().unwrap()["status"],
        "cancelled"
    );
    // The uncommitted change made on the box is in the gateway's workspace.
    let log = std::fs::read_to_string(std::path::Path::new(&home).join("runs.log")).unwrap();
    assert_eq!(log, "made on the box\n");
    // The box is back in the idle pool, cleared of the session.
    assert_eq!(environments(&rig), vec![(env.clone(), "idle".to_owned())]);

    // The next turn runs on the gateway, in the workspace holding the box's work.
    let out = rig.session(&["send", "--json", &id, "read it"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "local");
    let read = last_tool_result(&detail);
    assert!(read.contains("made on the box"), "{read}");
    assert!(read.contains(&home), "the turn ran elsewhere: {read}");

    // Warm dispatch (the idle box) and its first remote model request.
    let t0 = now_ms();
    let out = rig
        .gw
        .run(&["session", "dispatch", &id, "--profile", "local"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        environments(&rig),
        vec![(env.clone(), "attached".to_owned())]
    );
    let out = rig.session(&["send", "--json", &id, "once more there"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let warm_dispatch_to_remote = first_model_request_after(&out, t0);

    // Between turns the pull-back needs no reconciliation; then the first local request.
    let t0 = now_ms();
    let out = rig.gw.run(&["session", "pull-back", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("◦ reconciling"), "{}", stderr(&out));
    let out = rig.session(&["send", "--json", &id, "and home"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let pull_back_to_local = first_model_request_after(&out, t0);
    assert_eq!(show(&rig, &id)["session"]["placement"], "local");
    // Pulling back a session at home is a no-op that says so.
    let out = rig.gw.run(&["session", "pull-back", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("already runs on the gateway"),
        "{}",
        stderr(&out)
    );

    eprintln!(
        "bench: cold dispatch {} ms; warm dispatch → first remote model request {warm_dispatch_to_remote} ms; \
         pull-back → first local model request {pull_back_to_local} ms",
        cold_dispatch.as_millis()
    );
}

#[test]
fn two_dispatches_at_once_place_the_session_once_on_one_box() {
    let rig = Rig::start(vec![text_reply(&["hello"]), text_reply(&["there"])], "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = local_session(&rig, repo.path());
    let spawn = || {
        rig.gw
            .cli()
            .args(["session", "dispatch", &id, "--profile", "local"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
    for out in &outs {
        assert!(out.status.success(), "{}", stderr(out));
    }
    let placed = outs
        .iter()
        .filter(|o| stderr(o).contains("◦ active"))
        .count();
    let no_op = outs
        .iter()
        .filter(|o| stderr(o).contains("already on profile local"))
        .count();
    assert_eq!(
        (placed, no_op),
        (1, 1),
        "{}\n---\n{}",
        stderr(&outs[0]),
        stderr(&outs[1])
    );
    let envs = environments(&rig);
    assert_eq!(envs.len(), 1, "{envs:?}");
    assert_eq!(envs[0].1, "attached");

    // The next message runs on that box.
    let out = rig.session(&["send", "--json", &id, "go"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active");
    assert_eq!(
        detail["session"]["worker"]["environment_id"],
        envs[0].0.as_str()
    );
}

/// The gateway's copy of the workspace changed while the session ran on its box, in the same
/// file the box's turn wrote: the pull-back is refused with an error naming the file, the
/// gateway's copy and the box's work are both left as they were, and the session stays active
/// on its box.
#[test]
fn a_pull_back_that_would_overwrite_a_change_made_at_home_is_refused_and_leaves_both_sides() {
    let responses = vec![
        text_reply(&["hello"]),
        // On the box: a change nobody commits, then a long reply to cancel.
        tool_reply(
            "w1",
            "exec",
            r#"{"command":"echo made on the box >> runs.log"}"#,
        ),
        long_reply(),
    ];
    let rig = Rig::start(responses, "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = local_session(&rig, repo.path());
    let home = std::path::PathBuf::from(
        show(&rig, &id)["session"]["workspace"]["path"]
            .as_str()
            .unwrap(),
    );
    let out = rig
        .gw
        .run(&["session", "dispatch", &id, "--profile", "local"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut turn = Following::start(&rig, &["send", "--json", &id, "log it and talk"]);
    turn.until("the slow reply streaming", |e, seen| {
        e["type"] == "text_delta"
            && seen.iter().filter(|s| s["type"] == "model_request").count() == 2
    });
    // Meanwhile, at home, someone writes the same file in the gateway's copy.
    std::fs::write(home.join("runs.log"), "changed at home\n").unwrap();

    let out = rig.gw.run(&["session", "pull-back", "--cancel", &id]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "refused: {err}");
    assert!(
        err.contains("runs.log"),
        "the refusal names the file: {err}"
    );
    let _ = turn.finish();

    let detail = show(&rig, &id);
    assert_eq!(detail["session"]["placement"], "active", "{detail:#}");
    assert_eq!(detail["session"]["worker"]["environment_id"], env.as_str());
    let why = detail["session"]["worker"]["error"].as_str().unwrap_or("");
    assert!(
        why.contains("runs.log") && why.contains("changed since the box got its copy"),
        "the session says why: {detail:#}"
    );
    // Both sides intact.
    assert_eq!(
        std::fs::read_to_string(home.join("runs.log")).unwrap(),
        "changed at home\n"
    );
    let boxes = rig.root.boxes();
    assert_eq!(boxes.len(), 1);
    let on_box = rig
        .root
        .path()
        .join(&boxes[0])
        .join("home/workspaces")
        .join(&id)
        .join("runs.log");
    assert_eq!(
        std::fs::read_to_string(on_box).unwrap(),
        "made on the box\n"
    );
    assert_eq!(environments(&rig), vec![(env, "attached".to_owned())]);
}
