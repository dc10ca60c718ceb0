//! Two gateways on one PostgreSQL (issue 17), each with its own state dir, sharing the
//! database and `[store] workspaces`: what one gateway's turn writes reaches a follower on the
//! other live, and a cancel or an approval given through the other reaches the turn (whose
//! session lease gateway one's admission took).

use crate::harness::{Gateway, stderr, stdout};
use skiff_test_support::postgres::PgCluster;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long anything here may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(90);

struct Pair {
    one: Gateway,
    two: Gateway,
    url: String,
    _shared: tempfile::TempDir,
    _cluster: PgCluster,
}

/// Two gateways started with `script` on one fresh database and one workspaces directory.
fn two_gateways(script: &str) -> Pair {
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let shared = tempfile::tempdir().unwrap();
    let config = format!(
        "[gateway]\nlocal_sandbox = \"off\"\n[store]\nurl = \"{url}\"\nworkspaces = \"{}\"\n",
        shared.path().display()
    );
    let one = Gateway::start_with(script, &config);
    let two = Gateway::join(&one, script, &config);
    Pair {
        one,
        two,
        url,
        _shared: shared,
        _cluster: cluster,
    }
}

/// A named pipe: a command that reads it waits until the test writes.
fn gate() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("go");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    (dir, fifo)
}

/// A turn whose command waits at `fifo`, then one that ends the session's turn.
fn waiting_script(fifo: &std::path::Path) -> String {
    format!(
        r#"
[[turns]]
text = "Waiting for the go."
[[turns.tool_calls]]
name = "exec"
arguments = {{ command = "read x < {} && echo released-$x" }}

[[turns]]
text = "All done."
"#,
        fifo.display()
    )
}

/// Lines of a child's stdout as they come, each within [`PATIENCE`].
fn lines(out: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

fn next_line(rx: &mpsc::Receiver<String>, what: &str) -> Option<String> {
    match rx.recv_timeout(PATIENCE) {
        Ok(line) => Some(line),
        Err(mpsc::RecvTimeoutError::Disconnected) => None,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("no line of {what} within {PATIENCE:?}"),
    }
}

/// Lines until one contains `needle` (which is returned last).
fn until(rx: &mpsc::Receiver<String>, needle: &str, what: &str) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let Some(line) = next_line(rx, what) else {
            panic!("{what} ended before {needle:?}: {seen:#?}")
        };
        let found = line.contains(needle);
        seen.push(line);
        if found {
            return seen;
        }
    }
}

/// The child's exit, within [`PATIENCE`] (killed and failed otherwise).
fn exit_of(mut child: Child, what: &str) -> std::process::ExitStatus {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(PATIENCE) {
        Ok(status) => status.unwrap(),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            panic!("{what} did not end within {PATIENCE:?}")
        }
    }
}

/// `skiff session new --json` through `gw`, left running: the child, its stdout lines, and
/// the session id (its first line).
fn start_session(
    gw: &Gateway,
    ws: &std::path::Path,
    extra: &[&str],
) -> (Child, mpsc::Receiver<String>, String) {
    let mut child = gw
        .cli()
        .args(["session", "new", "--json", "--workspace"])
        .arg(ws)
        .args(["--model", "fake/e2e"])
        .args(extra)
        .arg("go ahead")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines(child.stdout.take().unwrap());
    let first = next_line(&rx, "session new").expect("session new printed nothing");
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    let id = first["session_id"].as_str().unwrap().to_owned();
    (child, rx, id)
}

fn cursors(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["cursor"].as_u64())
        .collect()
}

#[test]
fn a_follower_on_one_gateway_sees_a_turn_on_the_other_live_in_order_none_lost_or_doubled() {
    let (_gate_dir, fifo) = gate();
    let pair = two_gateways(&waiting_script(&fifo));
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("notes.txt"), "draft\n").unwrap();
    let (new, _new_lines, id) = start_session(&pair.one, ws.path(), &[]);

    let mut watch = pair
        .two
        .cli()
        .args(["session", "watch", "--json", &id])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let watched = lines(watch.stdout.take().unwrap());
    // The turn on gateway one has reached its command, and the follower on gateway two
    // has it: what comes next is written only after the test opens the gate.
    let mut seen = until(&watched, "read x <", "the watch on gateway two");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&fifo)
        .unwrap()
        .write_all(b"go\n")
        .unwrap();
    while let Some(line) = next_line(&watched, "the watch on gateway two") {
        seen.push(line);
    }
    assert!(
        exit_of(watch, "the watch on gateway two").success(),
        "the turn did not end well: {seen:#?}"
    );
    assert!(exit_of(new, "session new on gateway one").success());
    let text = seen.join("\n");
    assert!(
        text.contains("released-go") && text.contains("All done."),
        "the follower on gateway two missed what gateway one wrote after the gate: {text}"
    );

    // Every event once, in cursor order, the same as gateway one's own log.
    let live = cursors(&seen);
    let all = pair.one.run(&["session", "watch", "--json", &id]);
    assert!(all.status.success(), "{}", stderr(&all));
    let logged: Vec<String> = stdout(&all).lines().map(str::to_owned).collect();
    let logged_cursors = cursors(&logged);
    assert!(!live.is_empty());
    assert_eq!(
        live,
        (live[0]..live[0] + live.len() as u64).collect::<Vec<_>>(),
        "lost, doubled or reordered"
    );
    assert_eq!(
        live.last(),
        logged_cursors.last(),
        "the follower stopped short of the log"
    );
}

#[test]
fn a_cancel_through_one_gateway_stops_the_turn_running_on_the_other() {
    let (_gate_dir, fifo) = gate();
    let pair = two_gateways(&waiting_script(&fifo));
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("notes.txt"), "draft\n").unwrap();
    let (new, new_lines, id) = start_session(&pair.one, ws.path(), &[]);
    // The command is running on gateway one.
    until(&new_lines, "read x <", "session new on gateway one");

    let out = pair.two.run(&["session", "cancel", &id]);
    assert!(out.status.success(), "cancel: {}", stderr(&out));
    let mut rest = Vec::new();
    while let Some(line) = next_line(&new_lines, "session new on gateway one") {
        rest.push(line);
    }
    // Gateway one stopped its turn: its follower saw the run end cancelled.
    assert!(!exit_of(new, "session new on gateway one").success());
    let text = rest.join("\n");
    assert!(text.contains(r#""cancelled""#), "{text}");
    assert!(
        text.contains("the command and everything it started were killed"),
        "the command on gateway one was not stopped: {text}"
    );
    let show = pair.two.json(&["session", "show", "--json", &id]);
    let status = show["runs"].as_array().unwrap().last().unwrap()["status"].clone();
    assert_eq!(status, "cancelled", "{show}");
}

const APPROVAL_SCRIPT: &str = r#"
[[turns]]
text = "Cleaning up."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned-up" }

[[turns]]
text = "All done."
"#;

#[test]
fn an_approval_answered_through_one_gateway_releases_the_call_waiting_on_the_other() {
    let pair = two_gateways(APPROVAL_SCRIPT);
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("build")).unwrap();
    std::fs::write(ws.path().join("build/x.o"), "x").unwrap();
    let (new, new_lines, _) = start_session(
        &pair.one,
        ws.path(),
        &["--approval", r#"{ exec = ["rm *"] }"#],
    );
    let asked = until(
        &new_lines,
        r#""state":"pending""#,
        "session new on gateway one",
    );
    let approval: serde_json::Value = serde_json::from_str(asked.last().unwrap()).unwrap();
    let approval_id = approval["approval"]["id"].as_str().unwrap().to_owned();

    let out = pair.two.run(&["approve", &approval_id]);
    assert!(out.status.success(), "approve: {}", stderr(&out));
    let mut rest = Vec::new();
    while let Some(line) = next_line(&new_lines, "session new on gateway one") {
        rest.push(line);
    }
    assert!(exit_of(new, "session new on gateway one").success());
    let text = rest.join("\n");
    assert!(
        text.contains("cleaned-up") && text.contains("All done."),
        "the call on gateway one was not released: {text}"
    );
}

#[test]
fn only_one_of_two_gateways_takes_the_sweeper_and_the_audit_says_which() {
    let pair = two_gateways("");
    let one = std::fs::read_to_string(pair.one.state_dir.join("gateway-id")).unwrap();
    let two = std::fs::read_to_string(pair.two.state_dir.join("gateway-id")).unwrap();
    let mut db = postgres::Client::connect(&pair.url, postgres::NoTls).unwrap();
    let takers: Vec<String> = db
        .query(
            "SELECT detail FROM audit WHERE action = 'chore.take' AND target = 'sweeper'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| {
            let detail: serde_json::Value = serde_json::from_str(row.get::<_, &str>(0)).unwrap();
            detail["gateway"].as_str().unwrap().to_owned()
        })
        .collect();
    // The first to start swept; the second found the sweeper alive and left it alone.
    assert_eq!(
        takers,
        vec![one.trim().to_owned()],
        "second was {}",
        two.trim()
    );
}
