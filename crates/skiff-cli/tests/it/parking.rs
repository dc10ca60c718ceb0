//! Boxes come back: a worker session whose turn ended keeps its box for `keep_attached`, then
//! is `parked` and its box goes back to the idle pool (its workspace moved out of sight into
//! the box's keep area), where the next session takes it warm (and finds nothing of the parked
//! one) or the parked session comes back to it and finds its workspace, brought up to date; a
//! full gateway parks the session idle the longest instead of refusing, and refuses only when
//! every worker runs a turn. Real gateway, real local boxes,
//! the real worker, a fake OpenAI-compatible provider.

use crate::harness::{processes_containing, stderr, stdout};
use crate::worker::{Rig, new_worker_session, new_worker_session_args, text_reply, tool_reply};
use crate::worker_faults::wait_placement;
use serde_json::Value;
use skiff_test_support::{FakeResponse, TempGitRepo};
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Sessions park themselves soon after a turn, and the tick that parks them runs often.
const PARK_FAST: &str = "keep_attached = \"1s\"\n[gateway]\nlifetime_tick = \"100ms\"\n";

fn show(rig: &Rig, id: &str) -> Value {
    rig.gw.json(&["session", "show", "--json", id])
}

/// The environment a session's worker runs on now.
fn env_of(rig: &Rig, id: &str) -> String {
    show(rig, id)["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{id} runs on no box"))
        .to_owned()
}

fn env_show(rig: &Rig, env: &str) -> Value {
    rig.gw.json(&["env", "show", "--json", env])
}

/// Polls the environment (it has no event stream) until it is `state`, with a deadline.
fn wait_env_state(rig: &Rig, env: &str, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let shown = env_show(rig, env);
        if shown["state"] == state {
            return shown;
        }
        assert!(
            Instant::now() < deadline,
            "{env} did not become {state}: {shown:#}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The directory of the box behind `env`.
fn box_dir(rig: &Rig, env: &str) -> PathBuf {
    let lease = env_show(rig, env)["lease_id"].as_str().unwrap().to_owned();
    rig.root.path().join(lease)
}

/// The workspaces on a box, by session id.
fn workspaces_on(box_dir: &std::path::Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(box_dir.join("home/workspaces")) else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// What the box under `box_dir` keeps of parked sessions, by session id.
fn kept_on(box_dir: &std::path::Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(box_dir.join("home/.skiff/kept")) else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// `skiff worker` processes of the box under `box_dir`.
fn workers_on(box_dir: &std::path::Path) -> Vec<String> {
    processes_containing(&format!("worker --socket {}/", box_dir.display()))
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

/// The box a `--json` session stream's placement was laid onto (read from the stream, not
/// asked afterwards: a session may be parked by then).
fn env_in(out: &std::process::Output) -> String {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["type"] == "placement")
        .filter_map(|e| e["environment_id"].as_str().map(str::to_owned))
        .next_back()
        .unwrap_or_else(|| panic!("no box in the stream: {}", stdout(out)))
}

/// The placement states a `--json` session stream went through.
fn placements(out: &std::process::Output) -> Vec<String> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["type"] == "placement")
        .map(|e| e["state"].as_str().unwrap().to_owned())
        .collect()
}

/// Writes `notes.txt`, then says so.
fn write_notes(text: &str) -> Vec<FakeResponse> {
    vec![
        tool_reply(
            "w1",
            "write",
            &format!(r#"{{"path":"notes.txt","content":"{text}\n"}}"#),
        ),
        text_reply(&["wrote it"]),
    ]
}

/// Reads `notes.txt` and lists the box's workspaces, then says so.
fn read_notes() -> Vec<FakeResponse> {
    vec![
        tool_reply(
            "r1",
            "exec",
            r#"{"command":"cat notes.txt && ls -a ../ | grep -v '^\\.'"}"#,
        ),
        text_reply(&["read it"]),
    ]
}

#[test]
fn three_sessions_on_two_workers_each_get_a_box_and_the_parked_one_comes_back_with_its_files() {
    let mut responses = write_notes("from the first turn of A");
    responses.push(text_reply(&["B"]));
    responses.push(text_reply(&["C"]));
    responses.extend(read_notes());
    let rig = Rig::start(responses, "[gateway]\nmax_workers = 2\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);

    let (out, a) = new_worker_session(&rig, repo.path(), "write notes");
    assert!(out.status.success(), "{}", stderr(&out));
    let a_box = env_of(&rig, &a);
    let (out, b) = new_worker_session(&rig, repo.path(), "B");
    assert!(out.status.success(), "{}", stderr(&out));
    let b_box = env_of(&rig, &b);

    // Both workers are taken, by sessions between turns: the third is placed anyway, on the
    // box of the session idle the longest, which is parked for it.
    let (out, c) = new_worker_session(&rig, repo.path(), "C");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(show(&rig, &a)["session"]["placement"], "parked");
    assert_eq!(show(&rig, &b)["session"]["placement"], "active");
    assert_eq!(env_of(&rig, &c), a_box, "C took the box A gave back (warm)");
    assert_eq!(rig.root.boxes().len(), 2, "no third box was leased");
    let a_dir = box_dir(&rig, &a_box);
    assert_eq!(
        workspaces_on(&a_dir),
        std::slice::from_ref(&c),
        "A's files left the box before C got it"
    );
    // `session list` and `session show` say so.
    let list = stdout(&rig.gw.run(&["session", "list"]));
    let row = list.lines().find(|l| l.contains(&a)).unwrap();
    assert!(row.contains("parked (local)"), "{row}");
    let shown = stdout(&rig.gw.run(&["session", "show", &a]));
    assert!(
        shown.contains("placement  parked on no box (the next message places it again)"),
        "{shown}"
    );
    // The park is audited, metadata only: which box, why, where it went.
    let store = rig.gw.store();
    let parks: Vec<_> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "placement.park")
        .collect();
    assert_eq!(parks.len(), 1, "{parks:?}");
    assert_eq!(parks[0].target, a);
    assert_eq!(parks[0].detail["env"], a_box.as_str());
    assert_eq!(parks[0].detail["box"], "idle");
    assert_eq!(
        parks[0].detail["reason"],
        "its worker slot was needed by another session"
    );

    // A's next message places it again (B is parked for it now) and A sees its own files,
    // and no other session's. The slot the message claims with its turn is in the turn's
    // stream, first.
    let out = rig.session(&["send", "--json", &a, "read the notes"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        placements(&out),
        [
            "requested",
            "provisioning",
            "syncing",
            "starting",
            "active",
            "reconciling",
            "active"
        ]
    );
    let detail = show(&rig, &a);
    assert_eq!(detail["session"]["placement"], "active");
    let result = last_tool_result(&detail);
    assert!(result.contains("from the first turn of A"), "{result}");
    let listed: Vec<&str> = result.lines().filter(|l| l.starts_with("ses_")).collect();
    assert_eq!(listed, [a.as_str()], "A's box holds A's workspace only");
    assert_eq!(show(&rig, &b)["session"]["placement"], "parked");
    assert_eq!(
        env_of(&rig, &a),
        b_box,
        "A came back on the box B gave back"
    );
    assert_eq!(rig.root.boxes().len(), 2);
}

#[test]
fn an_idle_session_parks_itself_after_keep_attached_and_its_box_serves_the_next_one() {
    let mut responses = write_notes("A was here");
    responses.extend(read_notes());
    let rig = Rig::start(responses, PARK_FAST);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, a) = new_worker_session(&rig, repo.path(), "write notes");
    assert!(out.status.success(), "{}", stderr(&out));
    let env = env_in(&out);
    let dir = box_dir(&rig, &env);

    let detail = wait_placement(&rig, &a, "parked");
    assert!(detail["session"]["worker"]["environment_id"].is_null());
    let shown = wait_env_state(&rig, &env, "idle");
    assert_eq!(shown["attached_sessions"], serde_json::json!([]));
    assert_eq!(shown["tunnel"], "none");
    assert_eq!(workers_on(&dir), Vec::<String>::new(), "A's worker is gone");
    assert_eq!(
        workspaces_on(&dir),
        Vec::<String>::new(),
        "A's files are out of sight"
    );
    assert_eq!(kept_on(&dir), std::slice::from_ref(&a), "kept for A alone");
    let store = rig.gw.store();
    let park = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .find(|r| r.action == "placement.park")
        .unwrap();
    assert!(
        park.detail["reason"]
            .as_str()
            .unwrap()
            .contains("keep_attached of profile local is 1s"),
        "{park:?}"
    );

    // The next session takes the warm box from the pool: no new lease.
    let (out, b) = new_worker_session(&rig, repo.path(), "read the notes");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(env_in(&out), env);
    assert_eq!(rig.root.boxes().len(), 1, "{:?}", rig.root.boxes());
    let result = last_tool_result(&show(&rig, &b));
    // B's workspace comes from the repository: A's uncommitted notes are not in it, and the
    // box holds B's workspace only.
    assert!(result.contains("No such file"), "{result}");
    assert!(!result.contains(&a), "{result}");
    assert_eq!(
        kept_on(&dir),
        Vec::<String>::new(),
        "what the box kept for A went before B's workspace came"
    );
}

#[test]
fn a_parked_session_comes_back_to_its_own_box_and_sees_what_changed_on_the_gateway_meanwhile() {
    let mut responses = vec![
        tool_reply(
            "w1",
            "exec",
            r#"{"command":"echo from A > notes.txt && echo built > build.log && echo old > gone.txt"}"#,
        ),
        text_reply(&["wrote it"]),
    ];
    responses.extend([
        tool_reply(
            "r1",
            "exec",
            r#"{"command":"cat notes.txt README.md build.log; ls; ls -a ../ | grep -v '^\\.'"}"#,
        ),
        text_reply(&["read it"]),
    ]);
    let rig = Rig::start(responses, PARK_FAST);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n"), (".gitignore", "*.log\n")]);
    let (out, a) = new_worker_session(&rig, repo.path(), "write notes");
    assert!(out.status.success(), "{}", stderr(&out));
    let env = env_in(&out);
    let dir = box_dir(&rig, &env);
    let worktree = PathBuf::from(
        show(&rig, &a)["session"]["workspace"]["path"]
            .as_str()
            .unwrap(),
    );
    wait_placement(&rig, &a, "parked");
    wait_env_state(&rig, &env, "idle");
    assert_eq!(workspaces_on(&dir), Vec::<String>::new());
    assert_eq!(kept_on(&dir), std::slice::from_ref(&a));

    // Meanwhile the session's workspace changes on the gateway, and another idle box waits in
    // the pool: A still prefers its own.
    std::fs::write(worktree.join("README.md"), "changed on the gateway\n").unwrap();
    std::fs::remove_file(worktree.join("gone.txt")).unwrap();
    let other = rig
        .gw
        .json(&["env", "create", "--profile", "local", "--json"]);
    assert_eq!(other["state"], "idle", "{other}");

    let out = rig.session(&["send", "--json", &a, "read the notes"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(env_in(&out), env, "A came back to its own box");
    // The message claimed a worker slot again: a move followers see, right after `parked`.
    let steps = crate::worker::placement_steps(&rig, &a);
    let parked = steps
        .iter()
        .position(|(s, _)| s == "parked")
        .unwrap_or_else(|| panic!("no parked step: {steps:?}"));
    assert_eq!(
        steps[parked + 1],
        (
            "requested".to_owned(),
            "claimed a worker slot on profile local (the placement was parked)".to_owned()
        ),
        "{steps:?}"
    );
    assert_eq!(steps[parked + 2].0, "provisioning", "{steps:?}");
    let stream = stdout(&out);
    assert!(
        stream.contains("its own previous box, which kept its workspace"),
        "{stream}"
    );
    let result = last_tool_result(&show(&rig, &a));
    assert!(result.contains("from A"), "{result}");
    assert!(result.contains("changed on the gateway"), "{result}");
    assert!(!result.contains("a repo"), "stale README: {result}");
    assert!(
        !result.contains("gone.txt"),
        "a file deleted meanwhile: {result}"
    );
    // What only the box had (an ignored build output) is still there: the workspace was
    // kept, not laid down again.
    assert!(result.contains("built"), "{result}");
    let listed: Vec<&str> = result.lines().filter(|l| l.starts_with("ses_")).collect();
    assert_eq!(listed, [a.as_str()], "{result}");
    assert_eq!(kept_on(&dir), Vec::<String>::new());
    let store = rig.gw.store();
    let outbound: Vec<_> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "sync.outbound")
        .map(|r| r.detail["workspace"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(outbound, ["laid down", "resumed"]);
}

#[test]
fn another_session_on_a_box_that_kept_a_parked_workspace_sees_none_of_it() {
    let mut responses = write_notes("A's secret plan");
    responses.extend([
        tool_reply(
            "r1",
            "exec",
            r#"{"command":"find \"$HOME\" -name notes.txt 2>/dev/null; ls -A \"$HOME/.skiff/kept\" 2>&1; echo searched"}"#,
        ),
        text_reply(&["looked"]),
    ]);
    let rig = Rig::start(responses, PARK_FAST);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, a) = new_worker_session(&rig, repo.path(), "write notes");
    assert!(out.status.success(), "{}", stderr(&out));
    let env = env_in(&out);
    let dir = box_dir(&rig, &env);
    wait_placement(&rig, &a, "parked");
    wait_env_state(&rig, &env, "idle");
    assert_eq!(kept_on(&dir), std::slice::from_ref(&a));

    let (out, b) = new_worker_session(&rig, repo.path(), "look around");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(env_in(&out), env, "B took the box A kept its workspace on");
    let result = last_tool_result(&show(&rig, &b));
    assert!(result.contains("searched"), "{result}");
    assert!(!result.contains("notes.txt"), "{result}");
    assert!(!result.contains(&a), "{result}");
    assert_eq!(kept_on(&dir), Vec::<String>::new());
}

#[test]
fn a_gateway_restart_while_a_session_is_parked_loses_nothing() {
    let mut responses = write_notes("kept across the restart");
    responses.extend(read_notes());
    let mut rig = Rig::start(responses, PARK_FAST);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, a) = new_worker_session(&rig, repo.path(), "write notes");
    assert!(out.status.success(), "{}", stderr(&out));
    let env = env_in(&out);
    wait_placement(&rig, &a, "parked");
    wait_env_state(&rig, &env, "idle");

    rig.gw.crash_and_restart();
    // Parked is not a placement in flight: the restart leaves it, and its box, alone.
    assert_eq!(show(&rig, &a)["session"]["placement"], "parked");
    assert_eq!(env_show(&rig, &env)["state"], "idle");

    let out = rig.session(&["send", "--json", &a, "read the notes"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let result = last_tool_result(&show(&rig, &a));
    assert!(result.contains("kept across the restart"), "{result}");
    assert_eq!(
        env_in(&out),
        env,
        "it came back on the box it left, from the pool"
    );
    assert_eq!(rig.root.boxes().len(), 1);
}

/// `session new --json` on the `local` profile, started and followed until its turn asks the
/// model (placed, running). Returns the child and the session id.
fn start_following(
    rig: &Rig,
    repo: &std::path::Path,
    prompt: &str,
) -> (std::process::Child, String) {
    let mut child = rig
        .gw
        .cli()
        .arg("session")
        .args(new_worker_session_args(repo, prompt))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut id = String::new();
    for line in lines.by_ref() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        id = event["session_id"].as_str().unwrap().to_owned();
        if event["type"] == "model_request" {
            break;
        }
    }
    // Keep draining the stream so the child never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (child, id)
}

#[test]
fn a_session_running_a_turn_is_never_parked_and_only_then_is_a_request_refused() {
    // The first two turns wait on the model until they are cancelled.
    let rig = Rig::start(
        vec![
            FakeResponse::stall(),
            FakeResponse::stall(),
            text_reply(&["third"]),
        ],
        "keep_attached = \"0s\"\n[gateway]\nmax_workers = 2\nlifetime_tick = \"100ms\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (mut first, a) = start_following(&rig, repo.path(), "first");
    let (mut second, b) = start_following(&rig, repo.path(), "second");

    let out = rig.session(&new_worker_session_args(repo.path(), "third"));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("at capacity: 2 of 2 workers are running turns; try again when one finishes"),
        "{}",
        stderr(&out)
    );
    // Nothing of the refused session exists; the two running ones were not touched (even
    // with keep_attached at zero and the tick running).
    let list = rig.gw.json(&["session", "list", "--json"]);
    assert_eq!(list["sessions"].as_array().unwrap().len(), 2);
    for id in [&a, &b] {
        let detail = show(&rig, id);
        assert_ne!(detail["session"]["placement"], "parked", "{detail:#}");
        assert_eq!(detail["runs"][0]["finished_at_ms"], Value::Null);
    }

    // Once a turn ends, its session is idle: the next request gets a worker.
    for id in [&a, &b] {
        let out = rig.session(&["cancel", id]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    assert_eq!(first.wait().unwrap().code(), Some(1));
    assert_eq!(second.wait().unwrap().code(), Some(1));
    let out = rig.session(&new_worker_session_args(repo.path(), "third"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        placements(&out).contains(&"active".to_owned()),
        "{}",
        stdout(&out)
    );
}

#[test]
fn a_box_whose_work_did_not_come_back_is_not_given_back() {
    // The turn writes a file on the box, then talks slowly: meanwhile the session's branch
    // moves on the gateway, so its work cannot be adopted at the turn's end.
    let words: Vec<String> = (0..40).map(|i| format!("w{i} ")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let rig = Rig::start(
        vec![
            tool_reply(
                "w1",
                "write",
                r#"{"path":"made-on-the-box.txt","content":"only here\n"}"#,
            ),
            text_reply(&refs).with_delay(Duration::from_millis(50)),
        ],
        "keep_attached = \"0s\"\n[gateway]\nmax_workers = 1\nlifetime_tick = \"100ms\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut child = rig
        .gw
        .cli()
        .arg("session")
        .args(new_worker_session_args(repo.path(), "write it"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut id = String::new();
    let mut env = String::new();
    let mut wrote = false;
    for line in lines.by_ref() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        id = event["session_id"].as_str().unwrap().to_owned();
        if let Some(e) = event["environment_id"].as_str() {
            env = e.to_owned();
        }
        wrote |= event["type"] == "tool_finished";
        if wrote && event["type"] == "text_delta" {
            break;
        }
    }
    let detail = show(&rig, &id);
    let worktree = PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());
    crate::harness::git(
        &worktree,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "moved here",
        ],
    );
    lines.for_each(drop);
    child.wait().unwrap();
    let detail = show(&rig, &id);
    let notices = crate::worker_faults::notices(&detail);
    assert!(
        notices
            .iter()
            .any(|n| n.contains("could not be brought back")),
        "{notices:?}"
    );

    // Idle, with keep_attached at zero, and its slot wanted: still it keeps its box, which
    // holds the only copy of what the turn made.
    let out = rig.session(&new_worker_session_args(repo.path(), "another"));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("0 of 1 workers are running turns and 1 more cannot give its box back yet"),
        "{}",
        stderr(&out)
    );
    assert_eq!(show(&rig, &id)["session"]["placement"], "active");
    assert_eq!(env_show(&rig, &env)["state"], "attached");
    let kept = box_dir(&rig, &env)
        .join("home/workspaces")
        .join(&id)
        .join("made-on-the-box.txt");
    assert_eq!(std::fs::read_to_string(kept).unwrap(), "only here\n");
}
