//! Live handoff: `session dispatch --live` and `session pull-back --live` move a session while
//! its turn runs. The current model step and its tool calls finish and are committed at the
//! old owner, the old owner is stopped (and fenced, on a box), the workspace reconciled, and
//! the same run goes on at the new owner: every `exec` ran exactly once (one line each in
//! `runs.log`), no transcript entry is lost or doubled, no model call is made twice, and the
//! turn ends `succeeded` where it moved to. Faults injected at the pull-back's barrier steps
//! (`[gateway] barrier_fault`) change none of that. Real gateway, real local boxes, the real
//! worker, a fake OpenAI-compatible provider.

use crate::harness::stderr;
use crate::worker::{Rig, new_worker_session_args, text_reply, tool_reply};
use crate::worker_faults::Following;
use serde_json::Value;
use skiff_test_support::{FakeResponse, TempGitRepo, openai_sse};
use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

/// A model step that streams for a few seconds (so a move can be asked mid-step), then calls
/// `exec` to append `line` to `runs.log`.
pub fn slow_exec(id: &str, line: &str) -> FakeResponse {
    let words: Vec<String> = (0..30).map(|i| format!("s{i} ")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let mut events = openai_sse::text_chunks(&refs);
    events.extend(openai_sse::tool_call(
        0,
        id,
        "exec",
        &format!(r#"{{"command":"echo {line} >> runs.log"}}"#),
        3,
    ));
    events.extend(openai_sse::finish("tool_calls"));
    events.extend(openai_sse::usage(120, 30));
    events.extend(openai_sse::done());
    FakeResponse::sse(events).with_delay(Duration::from_millis(100))
}

fn exec(id: &str, line: &str) -> FakeResponse {
    tool_reply(
        id,
        "exec",
        &format!(r#"{{"command":"echo {line} >> runs.log"}}"#),
    )
}

pub fn show(rig: &Rig, id: &str) -> Value {
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

/// No entry twice (by id), and every tool call answered by exactly one result.
fn nothing_doubled(detail: &Value) {
    let entries = detail["transcript"].as_array().unwrap();
    let ids: HashSet<&str> = entries.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids.len(),
        entries.len(),
        "an entry is doubled: {entries:#?}"
    );
    let calls: Vec<String> = entries
        .iter()
        .flat_map(|e| {
            e["body"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    let results: Vec<String> = entries
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["call_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(calls, results, "every call answered once, in order");
}

pub fn runs_log(detail: &Value) -> String {
    let home = detail["session"]["workspace"]["path"].as_str().unwrap();
    std::fs::read_to_string(Path::new(home).join("runs.log")).unwrap_or_default()
}

/// The attempts of the session's last run, as (node is the gateway, status).
fn attempts(detail: &Value) -> Vec<(bool, String)> {
    let run = detail["runs"].as_array().unwrap().last().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["run_id"] == run.as_str())
        .map(|a| {
            (
                a["node"] == "gateway",
                a["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn last_run_status(detail: &Value) -> String {
    detail["runs"].as_array().unwrap().last().unwrap()["status"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Waits until the `n`-th model request of the followed turn streams text.
pub fn mid_step(f: &mut Following, n: usize) {
    f.until(&format!("text of model request {n}"), |e, seen| {
        e["type"] == "text_delta"
            && seen.iter().filter(|s| s["type"] == "model_request").count() == n
    });
}

/// The handoff pause in a followed turn's events: from the last event of the old owner (the
/// last one before the barrier's first step after the claim) to the first event of the new
/// owner (the first one after the placement settles), in ms.
pub fn handoff_pause_ms(seen: &[Value], settled: &str) -> i64 {
    let claim = seen
        .iter()
        .position(|e| e["type"] == "placement" && e["state"] == "handing_off")
        .unwrap_or_else(|| panic!("no handing_off step in {seen:#?}"));
    let barrier = claim
        + 1
        + seen[claim + 1..]
            .iter()
            .position(|e| e["type"] == "placement")
            .unwrap();
    let last_old = seen[..barrier]
        .iter()
        .rev()
        .find(|e| e["type"] != "placement")
        .unwrap();
    let home = barrier
        + seen[barrier..]
            .iter()
            .position(|e| e["type"] == "placement" && e["state"] == settled)
            .unwrap();
    let first_new = seen[home..]
        .iter()
        .find(|e| e["type"] != "placement")
        .unwrap();
    first_new["at_ms"].as_i64().unwrap() - last_old["at_ms"].as_i64().unwrap()
}

#[test]
fn a_turn_dispatched_live_from_the_gateway_goes_on_on_a_box_with_every_exec_run_once() {
    let rig = Rig::start(
        vec![
            text_reply(&["hello"]),
            // Turn 2: step 1 on the gateway, mid-stream when the dispatch is asked.
            slow_exec("g1", "one"),
            // Steps 2 and 3 on the box.
            exec("b1", "two"),
            text_reply(&["done ", "on ", "the ", "box"]),
        ],
        "",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let out = rig.session(&[
        "new",
        "--json",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.path().to_str().unwrap(),
        "hello",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first: Value =
        serde_json::from_str(crate::harness::stdout(&out).lines().next().unwrap()).unwrap();
    let id = first["session_id"].as_str().unwrap().to_owned();

    let mut turn = Following::start(&rig, &["send", "--json", &id, "log twice"]);
    mid_step(&mut turn, 1);
    let out = rig
        .gw
        .run(&["session", "dispatch", &id, "--profile", "local", "--live"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    for step in ["◦ handing_off", "◦ requested", "◦ syncing", "◦ active"] {
        assert!(err.contains(step), "no {step} step: {err}");
    }
    let (status, seen) = turn.finish();
    assert!(
        status.success(),
        "the moved turn did not succeed: {seen:#?}"
    );
    println!(
        "live handoff pause (gateway → box): {} ms",
        handoff_pause_ms(&seen, "active")
    );

    let detail = show(&rig, &id);
    assert_eq!(last_run_status(&detail), "succeeded");
    assert_eq!(detail["session"]["placement"], "active");
    // One run, two attempts: handed off on the gateway, finished on the box.
    assert_eq!(detail["runs"].as_array().unwrap().len(), 2);
    assert_eq!(
        attempts(&detail),
        [(true, "handed_off".into()), (false, "succeeded".into())]
    );
    assert_eq!(
        kinds(&detail),
        [
            "user_message",
            "assistant_message",
            "user_message",
            "assistant_message",
            "tool_result",
            "assistant_message",
            "tool_result",
            "assistant_message",
        ]
    );
    nothing_doubled(&detail);
    // Each exec ran once: one on the gateway, one on the box (reconciled at the turn's end).
    assert_eq!(runs_log(&detail), "one\ntwo\n");
    // The provider was asked once per step: nothing was asked twice across the move.
    assert_eq!(rig.fake.requests().len(), 4);
}

/// A worker session whose first turn is pulled back live mid-step; `fault` is an extra
/// `[gateway]` configuration (a barrier fault). Checks everything a user would notice and
/// returns the turn's events.
fn pull_back_live(fault: &str) -> Vec<Value> {
    let rig = Rig::start(
        vec![
            // Step 1 on the box, mid-stream when the pull-back is asked.
            slow_exec("b1", "one"),
            // Steps 2 and 3 at home.
            exec("g1", "two"),
            text_reply(&["done ", "at ", "home"]),
        ],
        fault,
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut turn = Following::start(&rig, &new_worker_session_args(repo.path(), "log twice"));
    mid_step(&mut turn, 1);
    let id = turn.session_id();
    let env = show(&rig, &id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = rig.gw.run(&["session", "pull-back", "--live", &id]);
    assert!(out.status.success(), "{fault}: {}", stderr(&out));
    let err = stderr(&out);
    for step in ["◦ handing_off", "fences it", "◦ reconciling", "◦ local"] {
        assert!(err.contains(step), "{fault}: no {step:?} step: {err}");
    }
    let (status, seen) = turn.finish();
    assert!(status.success(), "{fault}: the moved turn did not succeed");

    let detail = show(&rig, &id);
    assert_eq!(last_run_status(&detail), "succeeded", "{fault}");
    // One consistent place: home, no box held, the box back in the pool.
    assert_eq!(detail["session"]["placement"], "local", "{fault}");
    assert_eq!(detail["session"]["worker"]["environment_id"], Value::Null);
    let envs = rig.gw.json(&["env", "list", "--json"]);
    let envs = envs["environments"].as_array().unwrap();
    assert!(
        envs.iter()
            .all(|e| e["attached_sessions"].as_array().unwrap().is_empty()),
        "{fault}: a box still holds the session: {envs:#?}"
    );
    assert!(
        envs.iter()
            .any(|e| e["id"] == env.as_str() && e["state"] == "idle"),
        "{fault}: the box is not back in the pool: {envs:#?}"
    );
    assert_eq!(
        attempts(&detail),
        [(false, "handed_off".into()), (true, "succeeded".into())],
        "{fault}"
    );
    assert_eq!(
        kinds(&detail),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "assistant_message",
            "tool_result",
            "assistant_message",
        ],
        "{fault}"
    );
    nothing_doubled(&detail);
    // The box's exec came home with its work; the gateway's ran here: once each.
    assert_eq!(runs_log(&detail), "one\ntwo\n", "{fault}");
    // The worker's held model call never reached the provider.
    assert_eq!(rig.fake.requests().len(), 3, "{fault}");
    seen
}

#[test]
fn a_turn_pulled_back_live_from_a_box_goes_on_on_the_gateway_with_every_exec_run_once() {
    let seen = pull_back_live("");
    println!(
        "live handoff pause (box → gateway): {} ms",
        handoff_pause_ms(&seen, "local")
    );
}

#[test]
fn a_worker_killed_once_drained_still_hands_its_turn_home_whole() {
    pull_back_live("[gateway]\nbarrier_fault = \"drained:kill-worker\"\n");
}

#[test]
fn a_tunnel_cut_once_fenced_still_hands_the_turn_home_whole() {
    pull_back_live("[gateway]\nbarrier_fault = \"fenced:cut-tunnel\"\n");
}

#[test]
fn a_bad_barrier_fault_is_refused_at_start_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(
        state.join("skiff.toml"),
        "[gateway]\nbarrier_fault = \"soon:explode\"\n",
    )
    .unwrap();
    let (code, first, err) = crate::harness::gateway_once(&state, "127.0.0.1:0");
    assert_ne!(code, Some(0), "the gateway started: {first}");
    assert!(err.contains("[gateway] barrier_fault"), "{err}");
    assert!(err.contains("no barrier step \"soon\""), "{err}");
}
