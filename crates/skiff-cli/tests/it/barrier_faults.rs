//! Fault injection at every step of a move's barrier, in both directions, live and at a turn
//! boundary: the worker killed, the tunnel cut, the gateway killed (and restarted on the same
//! state dir), the box killed — at `drained`, `fenced` and `reconciled` (`[gateway]
//! barrier_fault`). Whatever strikes, the session ends in one consistent place (home with no
//! box, or on one box that is attached to it alone), every box is accounted for, no
//! transcript entry is doubled, no tool call runs twice (each `exec` appends its call id to
//! `runs.log`), and a message sent afterwards runs to its end wherever the session is. Real
//! gateway, real local boxes, the real worker, a fake OpenAI-compatible provider.

use crate::handoff::{mid_step, runs_log, show};
use crate::harness::stderr;
use crate::worker::{Rig, new_worker_session_args};
use crate::worker_faults::Following;
use serde_json::Value;
use skiff_test_support::{FakeResponse, RecordedRequest, TempGitRepo, openai_sse};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    /// `session dispatch --live`: the running turn goes from the gateway onto a box.
    DispatchLive,
    /// `session pull-back --live`: the running turn comes home from its box.
    PullBackLive,
    /// `session dispatch` between turns.
    Dispatch,
    /// `session pull-back` between turns.
    PullBack,
}

/// Every turn the fake answers: `exec` twice (each appends its own call id to `runs.log`),
/// then a closing text. With `slow`, a turn's first step streams for a few seconds, so a live
/// move can be asked mid-step. A turn retried after a restart starts over the same way.
fn responder(slow: bool) -> impl FnMut(&[RecordedRequest]) -> FakeResponse + Send + 'static {
    move |requests| {
        let n = requests.len();
        let body: Value = serde_json::from_slice(&requests[n - 1].body).unwrap();
        let messages = body["messages"].as_array().unwrap();
        let since_user = messages
            .iter()
            .rev()
            .take_while(|m| m["role"] != "user")
            .filter(|m| m["role"] == "tool")
            .count();
        let id = format!("c{n}");
        match since_user {
            0 if slow => crate::handoff::slow_exec(&id, &id),
            0 | 1 => crate::worker::tool_reply(
                &id,
                "exec",
                &format!(r#"{{"command":"echo {id} >> runs.log"}}"#),
            ),
            _ => FakeResponse::sse(
                [
                    openai_sse::text_chunks(&["done"]),
                    openai_sse::finish("stop"),
                    openai_sse::usage(10, 2),
                    openai_sse::done(),
                ]
                .concat(),
            ),
        }
    }
}

/// Runs `skiff session ARGS…` and returns its output.
fn session(rig: &Rig, args: &[&str]) -> std::process::Output {
    rig.session(args)
}

fn first_session_id(out: &std::process::Output) -> String {
    let first: Value =
        serde_json::from_str(crate::harness::stdout(out).lines().next().unwrap()).unwrap();
    first["session_id"].as_str().unwrap().to_owned()
}

/// One case: the session moves in `direction` with `step:action` injected, the gateway is
/// restarted if the fault killed it, and the outcome is checked.
fn case(direction: Direction, step: &str, action: &str) {
    let fault_line = format!("barrier_fault = \"{step}:{action}\"\n");
    let live = matches!(direction, Direction::DispatchLive | Direction::PullBackLive);
    let mut rig = Rig::start_with_responder(responder(live), &format!("[gateway]\n{fault_line}"));
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let ws = repo.path().to_str().unwrap();
    let on_gateway = [
        "new",
        "--json",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        ws,
        "log",
    ];
    let what = format!("{direction:?} {step}:{action}");
    let (id, turn) = match direction {
        Direction::DispatchLive => {
            let mut turn = Following::start(&rig, &on_gateway);
            mid_step(&mut turn, 1);
            let id = turn.session_id();
            let _ = rig
                .gw
                .run(&["session", "dispatch", &id, "--profile", "local", "--live"]);
            (id, Some(turn))
        }
        Direction::PullBackLive => {
            let mut turn = Following::start(&rig, &new_worker_session_args(repo.path(), "log"));
            mid_step(&mut turn, 1);
            let id = turn.session_id();
            let _ = rig.gw.run(&["session", "pull-back", "--live", &id]);
            (id, Some(turn))
        }
        Direction::Dispatch => {
            let out = session(&rig, &on_gateway);
            assert!(out.status.success(), "{what}: {}", stderr(&out));
            let id = first_session_id(&out);
            let _ = rig
                .gw
                .run(&["session", "dispatch", &id, "--profile", "local"]);
            (id, None)
        }
        Direction::PullBack => {
            let out = session(&rig, &new_worker_session_args(repo.path(), "log"));
            assert!(out.status.success(), "{what}: {}", stderr(&out));
            let id = first_session_id(&out);
            let _ = rig.gw.run(&["session", "pull-back", &id]);
            (id, None)
        }
    };
    if action == "kill-gateway" {
        rig.gw.await_death_and_restart(&fault_line);
    }
    if let Some(turn) = turn {
        // However the moved turn ended (a fault may fail it), its follower ends.
        let _ = turn.finish();
    }
    // The fault struck at its step (audited before it strikes, so a killed gateway's too). A
    // move without `--live` goes on after its command returned: its row is awaited.
    let struck = await_fault_row(&rig, &id, &what);
    assert_eq!(struck["detail"]["step"], step, "{what}");
    let out = rig.gw.run(&["audit", "tail", "--json", "-n", "1000"]);
    let rows = crate::harness::stdout(&out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["action"] == "barrier.fault" && r["target"] == id.as_str())
        .count();
    assert_eq!(rows, 1, "{what}: the fault struck once");
    // A message afterwards runs to its end wherever the session is: one owner took it.
    let after = send_when_idle(&rig, &id, &what);
    check_consistent(&rig, &id, &what, &after);
}

/// The session's `barrier.fault` audit row, followed on `audit tail --follow` until it is
/// written.
fn await_fault_row(rig: &Rig, id: &str, what: &str) -> Value {
    let mut tail = rig
        .gw
        .cli()
        .args(["audit", "tail", "--json", "-n", "1000", "--follow"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    let mut found = None;
    for line in lines {
        let row: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if row["action"] == "barrier.fault" && row["target"] == id {
            found = Some(row);
            break;
        }
    }
    let _ = tail.kill();
    let _ = tail.wait();
    found.unwrap_or_else(|| panic!("{what}: the audit tail ended with no barrier.fault row"))
}

/// Sends a last message once no turn is open (a turn retried after a restart may hold the
/// session meanwhile) and waits for its end; returns the session's detail.
fn send_when_idle(rig: &Rig, id: &str, what: &str) -> Value {
    for _ in 0..4 {
        wait_no_open_run(rig, id);
        let out = session(rig, &["send", id, "after the move"]);
        if out.status.success() {
            return show(rig, id);
        }
        let err = stderr(&out);
        assert!(
            err.contains("busy") || err.contains("already running") || err.contains("open run"),
            "{what}: the message after the move failed: {err}"
        );
    }
    panic!("{what}: the session stayed busy");
}

/// Follows the session's events until none of its runs is open (returns at once if none is).
fn wait_no_open_run(rig: &Rig, id: &str) {
    let open = |d: &Value| {
        d["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| {
                !["succeeded", "failed", "cancelled", "orphaned", "timed_out"]
                    .contains(&r["status"].as_str().unwrap())
            })
            .map(|r| r["id"].as_str().unwrap().to_owned())
    };
    let Some(run) = open(&show(rig, id)) else {
        return;
    };
    let resp = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(180))
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
        if event["type"] == "run_status"
            && event["run_id"] == run.as_str()
            && ["succeeded", "failed", "cancelled", "orphaned", "timed_out"]
                .contains(&event["status"].as_str().unwrap())
        {
            return;
        }
    }
}

/// One owner, every box accounted for, nothing doubled, no tool call run twice.
fn check_consistent(rig: &Rig, id: &str, what: &str, detail: &Value) {
    let runs = detail["runs"].as_array().unwrap();
    assert_eq!(
        runs.last().unwrap()["status"],
        "succeeded",
        "{what}: {runs:#?}"
    );
    // One place: home with no box, or active on the one box attached to it.
    let placement = detail["session"]["placement"].as_str().unwrap();
    let env = detail["session"]["worker"]["environment_id"].as_str();
    let envs = rig.gw.json(&["env", "list", "--json"]);
    let envs = envs["environments"].as_array().unwrap();
    let attached: Vec<&Value> = envs
        .iter()
        .filter(|e| !e["attached_sessions"].as_array().unwrap().is_empty())
        .collect();
    match placement {
        "local" => assert!(attached.is_empty(), "{what}: home, yet {attached:#?}"),
        "active" => {
            let env = env.unwrap_or_else(|| panic!("{what}: active on no box"));
            assert_eq!(attached.len(), 1, "{what}: {attached:#?}");
            assert_eq!(attached[0]["id"], env, "{what}");
            assert_eq!(
                attached[0]["attached_sessions"],
                serde_json::json!([id]),
                "{what}"
            );
        }
        other => panic!("{what}: the session ended {other}"),
    }
    // Every box on the machine is one the gateway knows alive.
    let alive = envs
        .iter()
        .filter(|e| ["ready", "idle", "attached"].contains(&e["state"].as_str().unwrap()))
        .count();
    assert!(
        rig.root.boxes().len() <= alive,
        "{what}: boxes {:?} for {alive} live environments: {envs:#?}",
        rig.root.boxes()
    );

    // Nothing doubled: entries by id, calls by id, results by the call they answer.
    let entries = detail["transcript"].as_array().unwrap();
    let ids: HashSet<&str> = entries.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), entries.len(), "{what}: an entry is doubled");
    let calls: Vec<&str> = entries
        .iter()
        .flat_map(|e| e["body"]["tool_calls"].as_array().into_iter().flatten())
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    let call_set: HashSet<&str> = calls.iter().copied().collect();
    assert_eq!(call_set.len(), calls.len(), "{what}: a call is doubled");
    let results: Vec<&str> = entries
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["call_id"].as_str().unwrap())
        .collect();
    let result_set: HashSet<&str> = results.iter().copied().collect();
    assert_eq!(
        result_set.len(),
        results.len(),
        "{what}: a call answered twice"
    );
    assert!(
        result_set.is_subset(&call_set),
        "{what}: a result answers no call"
    );
    // Each exec ran at most once, and none ran unrecorded; the last turn's ran and came home.
    let log = runs_log(detail);
    let lines: Vec<&str> = log.lines().collect();
    let line_set: HashSet<&str> = lines.iter().copied().collect();
    assert_eq!(
        line_set.len(),
        lines.len(),
        "{what}: a tool call ran twice: {log}"
    );
    assert!(
        line_set.is_subset(&result_set),
        "{what}: an exec ran that the transcript does not answer: {log} vs {results:?}"
    );
    let last_two = &calls[calls.len() - 2..];
    for call in last_two {
        assert!(
            line_set.contains(call),
            "{what}: the last turn's {call} is not in the workspace: {log}"
        );
    }
}

macro_rules! cases {
    ($($name:ident: $direction:ident, $step:literal, $action:literal;)*) => {
        $(
            #[test]
            fn $name() {
                case(Direction::$direction, $step, $action);
            }
        )*
    };
}

// Home to a box: at `drained` nothing is placed yet (no box to kill or cut), so only the
// gateway can die there; a move to a box reconciles nothing inbound (no `reconciled` step).
cases! {
    dispatch_live_drained_kill_gateway: DispatchLive, "drained", "kill-gateway";
    dispatch_live_fenced_kill_worker: DispatchLive, "fenced", "kill-worker";
    dispatch_live_fenced_cut_tunnel: DispatchLive, "fenced", "cut-tunnel";
    dispatch_live_fenced_kill_gateway: DispatchLive, "fenced", "kill-gateway";
    dispatch_live_fenced_kill_box: DispatchLive, "fenced", "kill-box";
    dispatch_drained_kill_gateway: Dispatch, "drained", "kill-gateway";
    dispatch_fenced_kill_worker: Dispatch, "fenced", "kill-worker";
    dispatch_fenced_cut_tunnel: Dispatch, "fenced", "cut-tunnel";
    dispatch_fenced_kill_gateway: Dispatch, "fenced", "kill-gateway";
    dispatch_fenced_kill_box: Dispatch, "fenced", "kill-box";
}

// Box to home: every step, every fault.
cases! {
    pull_back_live_drained_kill_worker: PullBackLive, "drained", "kill-worker";
    pull_back_live_drained_cut_tunnel: PullBackLive, "drained", "cut-tunnel";
    pull_back_live_drained_kill_gateway: PullBackLive, "drained", "kill-gateway";
    pull_back_live_drained_kill_box: PullBackLive, "drained", "kill-box";
    pull_back_live_fenced_kill_worker: PullBackLive, "fenced", "kill-worker";
    pull_back_live_fenced_cut_tunnel: PullBackLive, "fenced", "cut-tunnel";
    pull_back_live_fenced_kill_gateway: PullBackLive, "fenced", "kill-gateway";
    pull_back_live_fenced_kill_box: PullBackLive, "fenced", "kill-box";
    pull_back_live_reconciled_kill_worker: PullBackLive, "reconciled", "kill-worker";
    pull_back_live_reconciled_cut_tunnel: PullBackLive, "reconciled", "cut-tunnel";
    pull_back_live_reconciled_kill_gateway: PullBackLive, "reconciled", "kill-gateway";
    pull_back_live_reconciled_kill_box: PullBackLive, "reconciled", "kill-box";
    pull_back_drained_kill_worker: PullBack, "drained", "kill-worker";
    pull_back_drained_cut_tunnel: PullBack, "drained", "cut-tunnel";
    pull_back_drained_kill_gateway: PullBack, "drained", "kill-gateway";
    pull_back_drained_kill_box: PullBack, "drained", "kill-box";
    pull_back_fenced_kill_worker: PullBack, "fenced", "kill-worker";
    pull_back_fenced_cut_tunnel: PullBack, "fenced", "cut-tunnel";
    pull_back_fenced_kill_gateway: PullBack, "fenced", "kill-gateway";
    pull_back_fenced_kill_box: PullBack, "fenced", "kill-box";
    pull_back_reconciled_kill_worker: PullBack, "reconciled", "kill-worker";
    pull_back_reconciled_cut_tunnel: PullBack, "reconciled", "cut-tunnel";
    pull_back_reconciled_kill_gateway: PullBack, "reconciled", "kill-gateway";
    pull_back_reconciled_kill_box: PullBack, "reconciled", "kill-box";
}
