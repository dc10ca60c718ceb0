//! Agent dispatch end to end: a gateway-placed session's agent starts child sessions on real
//! local boxes with its `dispatch` tool, and reads what they did. One fake provider answers
//! both sessions, telling them apart by their first user message.

use crate::harness::{stderr, stdout};
use crate::worker::{Rig, text_reply, tool_reply};
use crate::worker_faults::wait_runs_ended;
use serde_json::Value;
use skiff_test_support::{FakeResponse, RecordedRequest, TempGitRepo};
use std::path::Path;
use std::time::{Duration, Instant};

const PARENT_PROMPT: &str = "PARENT: plan the work";
const CHILD_MARK: &str = "CHILD:";

fn body(req: &RecordedRequest) -> Value {
    serde_json::from_slice(&req.body).unwrap()
}

/// The request's first user message, as JSON text: which session asked.
fn first_user(req: &RecordedRequest) -> String {
    body(req)["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "user")
        .map(|m| m["content"].to_string())
        .unwrap_or_default()
}

fn is_child(req: &RecordedRequest) -> bool {
    first_user(req).contains(CHILD_MARK)
}

fn tool_names(req: &RecordedRequest) -> Vec<String> {
    body(req)["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Answers the parent's n-th request with `parent(n, request)` and the child's n-th with
/// `child[n]`.
fn router(
    mut parent: impl FnMut(usize, &RecordedRequest) -> FakeResponse + Send + 'static,
    child: Vec<FakeResponse>,
) -> impl FnMut(&[RecordedRequest]) -> FakeResponse + Send + 'static {
    move |requests| {
        let last = requests.last().unwrap();
        let asker = first_user(last);
        let n = requests.iter().filter(|r| first_user(r) == asker).count() - 1;
        if is_child(last) {
            child
                .get(n)
                .cloned()
                .unwrap_or_else(|| FakeResponse::status(500, &[], "no child reply left"))
        } else {
            parent(n, last)
        }
    }
}

/// `session new --json` on the gateway itself (no profile) with the fake's model.
fn new_parent(rig: &Rig, repo: &Path) -> (std::process::Output, String) {
    let out = rig.session(&[
        "new",
        "--json",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.to_str().unwrap(),
        PARENT_PROMPT,
    ]);
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let id = first["session_id"].as_str().unwrap().to_owned();
    (out, id)
}

/// The session's tool results as (name, content, is_error).
fn tool_results(rig: &Rig, id: &str) -> Vec<(String, String, bool)> {
    let detail = rig.gw.json(&["session", "show", "--json", id]);
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .map(|e| {
            (
                e["body"]["name"].as_str().unwrap().to_owned(),
                e["body"]["content"].as_str().unwrap().to_owned(),
                e["body"]["is_error"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn sessions(rig: &Rig) -> Vec<Value> {
    rig.gw.json(&["session", "list", "--json"])["sessions"]
        .as_array()
        .unwrap()
        .clone()
}

/// The id in "started child session ses_…" of a `dispatch` result the request carries.
fn started_child(req: &RecordedRequest) -> String {
    let text = String::from_utf8_lossy(&req.body).into_owned();
    let at = text.find("started child session ").unwrap() + "started child session ".len();
    text[at..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

#[test]
fn a_dispatched_child_runs_on_a_box_from_the_parents_state_and_reports_back() {
    let rig = Rig::start_with_responder(
        router(
            |n, _| match n {
                0 => tool_reply(
                    "p1",
                    "write",
                    r#"{"path":"notes.txt","content":"from the parent\n"}"#,
                ),
                1 => tool_reply("p2", "dispatch", r#"{"prompt":"CHILD: add child.txt"}"#),
                _ => text_reply(&["parent done"]),
            },
            vec![
                tool_reply("c1", "read", r#"{"path":"notes.txt"}"#),
                tool_reply(
                    "c2",
                    "write",
                    r#"{"path":"child.txt","content":"one\ntwo\n"}"#,
                ),
                text_reply(&["child wrote ", "child.txt"]),
            ],
        ),
        "",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, parent) = new_parent(&rig, repo.path());
    assert!(out.status.success(), "{}", stderr(&out));

    let listed = sessions(&rig);
    let child = listed
        .iter()
        .find(|s| s["parent_id"] == parent.as_str())
        .expect("the child is listed with its parent");
    let child_id = child["id"].as_str().unwrap();
    assert_eq!(child["worker"]["profile"], "local", "{child:#}");
    assert_eq!(child["last_run"]["status"], "succeeded", "{child:#}");
    // The child's worker slot, claimed with its rows, is its first move followers see.
    let steps = crate::worker::placement_steps(&rig, child_id);
    assert_eq!(
        steps[0],
        (
            "requested".to_owned(),
            format!("claimed a worker slot on profile local for a child of session {parent}")
        ),
        "{steps:?}"
    );
    assert_eq!(steps[1].0, "provisioning", "{steps:?}");

    // The parent's tool result: status, branch, diffstat (the child's own change only) and
    // final message.
    let results = tool_results(&rig, &parent);
    let (_, report, is_error) = results.iter().find(|r| r.0 == "dispatch").unwrap();
    assert!(!is_error, "{report}");
    assert!(
        report.contains(&format!("child session {child_id}: succeeded")),
        "{report}"
    );
    assert!(
        report.contains(&format!("branch: skiff/{child_id}")),
        "{report}"
    );
    assert!(report.contains(" child.txt | +2 -0"), "{report}");
    assert!(!report.contains("notes.txt"), "{report}");
    assert!(
        report.ends_with("final message:\nchild wrote child.txt"),
        "{report}"
    );

    // The child started from the parent's uncommitted work.
    let child_results = tool_results(&rig, child_id);
    assert!(
        child_results[0].1.trim_end().ends_with("\tfrom the parent"),
        "{child_results:?}"
    );

    // Only the parent's model requests offer the dispatch tools.
    let requests = rig.fake.requests();
    let (kids, parents): (Vec<_>, Vec<_>) = requests.iter().partition(|r| is_child(r));
    assert_eq!((parents.len(), kids.len()), (3, 3));
    for r in &parents {
        let names = tool_names(r);
        for tool in ["dispatch", "dispatch_status", "dispatch_wait"] {
            assert!(names.iter().any(|n| n == tool), "{names:?}");
        }
    }
    for r in &kids {
        let names = tool_names(r);
        assert!(names.iter().any(|n| n == "write"), "{names:?}");
        assert!(
            !names.iter().any(|n| n.starts_with("dispatch")),
            "{names:?}"
        );
    }

    let shown = rig.gw.run(&["session", "show", child_id]);
    assert!(
        stdout(&shown).contains(&format!("parent     {parent}")),
        "{}",
        stdout(&shown)
    );
    // The child's branch is in the user's repository, as every session's is.
    crate::harness::git(
        repo.path(),
        &["rev-parse", "--verify", &format!("skiff/{child_id}")],
    );

    // `session list --tree`: the child right under its parent.
    let tree = rig.gw.run(&["session", "list", "--tree"]);
    assert!(tree.status.success(), "{}", stderr(&tree));
    let text = stdout(&tree);
    let lines: Vec<&str> = text.lines().collect();
    let at = lines.iter().position(|l| l.starts_with(&parent)).unwrap();
    assert!(
        lines[at + 1].starts_with(&format!("└ {child_id}")),
        "{text}"
    );
}

#[test]
fn without_waiting_the_parent_reads_its_child_later_and_the_cap_refuses_more() {
    let rig = Rig::start_with_responder(
        router(
            |n, req| match n {
                0 => tool_reply(
                    "p1",
                    "dispatch",
                    r#"{"prompt":"CHILD: say done","title":"the helper","wait":false}"#,
                ),
                1 => tool_reply(
                    "p2",
                    "dispatch_wait",
                    &format!(r#"{{"id":"{}","timeout_s":600}}"#, started_child(req)),
                ),
                2 => tool_reply("p3", "dispatch", r#"{"prompt":"CHILD: one too many"}"#),
                _ => text_reply(&["parent done"]),
            },
            vec![text_reply(&["child ", "finished"])],
        ),
        "[gateway]\nmax_children = 1\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, parent) = new_parent(&rig, repo.path());
    assert!(out.status.success(), "{}", stderr(&out));

    let results = tool_results(&rig, &parent);
    assert_eq!(results.len(), 3, "{results:?}");
    let (name, started, is_error) = &results[0];
    assert_eq!((name.as_str(), *is_error), ("dispatch", false), "{started}");
    let child_id = started
        .strip_prefix("started child session ")
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let (name, waited, is_error) = &results[1];
    assert_eq!(
        (name.as_str(), *is_error),
        ("dispatch_wait", false),
        "{waited}"
    );
    assert!(
        waited.contains(&format!("child session {child_id}: succeeded")),
        "{waited}"
    );
    assert!(
        waited.ends_with("final message:\nchild finished"),
        "{waited}"
    );
    let (name, refused, is_error) = &results[2];
    assert_eq!((name.as_str(), *is_error), ("dispatch", true), "{refused}");
    assert!(refused.contains("max_children"), "{refused}");

    let children: Vec<Value> = sessions(&rig)
        .into_iter()
        .filter(|s| s["parent_id"] == parent.as_str())
        .collect();
    assert_eq!(
        children.len(),
        1,
        "the refused child left no session behind"
    );
    assert_eq!(children[0]["title"], "the helper");
}

#[test]
fn cancelling_the_parent_cancels_its_running_child() {
    let rig = Rig::start_with_responder(
        router(
            |n, _| match n {
                0 => tool_reply("p1", "dispatch", r#"{"prompt":"CHILD: take your time"}"#),
                _ => text_reply(&["parent done"]),
            },
            // The child's model call hangs until its run is cancelled.
            vec![FakeResponse::stall()],
        ),
        "",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut parent_cli = rig
        .gw
        .cli()
        .args([
            "session",
            "new",
            "--json",
            "--model",
            "openai/gpt-fake",
            "--workspace",
            repo.path().to_str().unwrap(),
            PARENT_PROMPT,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(parent_cli.stdout.take().unwrap()));
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let parent = first["session_id"].as_str().unwrap().to_owned();
    std::thread::spawn(move || lines.for_each(drop));

    // Until the child's turn waits on the model, on its box.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !rig.fake.requests().iter().any(is_child) {
        assert!(Instant::now() < deadline, "the child never asked the model");
        std::thread::sleep(Duration::from_millis(50));
    }
    let child = sessions(&rig)
        .into_iter()
        .find(|s| s["parent_id"] == parent.as_str())
        .unwrap();
    let child_id = child["id"].as_str().unwrap();

    let cancel = rig.gw.run(&["session", "cancel", &parent]);
    assert!(cancel.status.success(), "{}", stderr(&cancel));
    let shown = wait_runs_ended(&rig, child_id, 1);
    assert_eq!(shown["runs"][0]["status"], "cancelled", "{shown:#}");
    let shown = wait_runs_ended(&rig, &parent, 1);
    assert_eq!(shown["runs"][0]["status"], "cancelled", "{shown:#}");
    parent_cli.wait().unwrap();
}
