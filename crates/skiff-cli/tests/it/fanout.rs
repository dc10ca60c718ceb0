//! Fan-out end to end: `session new --attempts 3` starts three sibling sessions on three real
//! local boxes with one prompt; a fake provider answers each attempt differently (telling them
//! apart by the session's prompt-cache key); `session compare` shows them side by side, and
//! `session pick` keeps one as the group's result and parks the rest.

use crate::harness::{git, stderr, stdout};
use crate::worker::{Rig, text_reply, tool_reply};
use serde_json::Value;
use skiff_test_support::{FakeResponse, RecordedRequest, TempGitRepo};

const PROMPT: &str = "make attempt.txt";

/// Which session asked: its prompt-cache key (one per session).
fn asker(req: &RecordedRequest) -> String {
    let body: Value = serde_json::from_slice(&req.body).unwrap();
    body["prompt_cache_key"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The k-th attempt to ask (k from 1) writes `attempt.txt` with k lines, commits, runs a
/// "test" that exits with k - 1, and says which attempt it was.
fn responder() -> impl FnMut(&[RecordedRequest]) -> FakeResponse + Send + 'static {
    let mut order: Vec<String> = Vec::new();
    move |requests| {
        let last = requests.last().unwrap();
        let who = asker(last);
        if !order.contains(&who) {
            order.push(who.clone());
        }
        let k = order.iter().position(|o| *o == who).unwrap() + 1;
        let n = requests.iter().filter(|r| asker(r) == who).count() - 1;
        let content: String = (1..=k).map(|i| format!("line {i}\\n")).collect();
        match n {
            0 => tool_reply(
                "w",
                "write",
                &format!(r#"{{"path":"attempt.txt","content":"{content}"}}"#),
            ),
            1 => tool_reply(
                "c",
                "exec",
                &format!(
                    r#"{{"command":"git add attempt.txt && git commit -q -m 'attempt {k}'"}}"#
                ),
            ),
            2 => tool_reply("t", "exec", &format!(r#"{{"command":"exit {}"}}"#, k - 1)),
            3 => text_reply(&[&format!("attempt {k} done\n"), "details follow"]),
            _ => FakeResponse::status(500, &[], "no reply left"),
        }
    }
}

fn new_args<'a>(repo: &'a str, attempts: &'a str) -> Vec<&'a str> {
    vec![
        "session",
        "new",
        "--attempts",
        attempts,
        "--profile",
        "local",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo,
        PROMPT,
    ]
}

#[test]
fn a_fan_out_of_three_is_compared_and_one_attempt_picked_while_the_rest_are_parked() {
    let rig = Rig::start_with_responder(responder(), "[gateway]\nmax_workers = 4\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let out = rig.gw.run(&new_args(repo.path().to_str().unwrap(), "3"));
    assert!(out.status.success(), "{}", stderr(&out));
    // It followed all three, then showed the comparison.
    let err = stderr(&out);
    for n in 1..=3 {
        assert!(
            err.contains(&format!("── attempt {n} of 3 · session ses_")),
            "{err}"
        );
    }
    assert!(
        stdout(&out).contains("no attempt picked yet"),
        "{}",
        stdout(&out)
    );

    let list = rig.gw.json(&["session", "list", "--json"]);
    let sessions = list["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 3, "{list:#}");
    let group = sessions[0]["group_id"].as_str().unwrap().to_owned();
    assert!(group.starts_with("grp_"), "{group}");
    assert!(sessions.iter().all(|s| s["group_id"] == group.as_str()));
    let listed = stdout(&rig.gw.run(&["session", "list"]));
    assert_eq!(
        listed.matches(&format!("(attempt of {group})")).count(),
        3,
        "{listed}"
    );
    let envs: std::collections::HashSet<&str> = sessions
        .iter()
        .map(|s| s["worker"]["environment_id"].as_str().unwrap())
        .collect();
    assert_eq!(envs.len(), 3, "three boxes: {list:#}");

    let compare = rig.gw.json(&["session", "compare", "--json", &group]);
    let attempts = compare["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3, "{compare:#}");
    // Each row: which attempt it was (its final message), its diffstat and its test's exit.
    let mut seen = Vec::new();
    for a in attempts {
        assert_eq!(a["status"], "succeeded", "{a:#}");
        let line = a["final_line"].as_str().unwrap();
        let k: u64 = line
            .strip_prefix("attempt ")
            .and_then(|r| r.strip_suffix(" done"))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(a["diff"]["files"], 1, "{a:#}");
        assert_eq!(a["diff"]["insertions"], k, "{a:#}");
        assert_eq!(a["diff"]["deletions"], 0, "{a:#}");
        assert_eq!(a["last_exec_exit"], k - 1, "its test's exit code: {a:#}");
        assert_eq!(a["picked"], false);
        seen.push((k, a["session"]["id"].as_str().unwrap().to_owned()));
    }
    seen.sort();
    assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3]);
    let table = stdout(&rig.gw.run(&["session", "compare", &group]));
    assert!(
        table.contains("STATUS")
            && table.contains("TESTS")
            && table.contains("+2 -0")
            && table.contains("exit 2"),
        "{table}"
    );

    // Pick attempt 2: its branch is the result, the others are parked, their boxes pooled.
    let picked = seen[1].1.clone();
    let done = rig.gw.json(&["session", "pick", "--json", &picked]);
    assert_eq!(done["group"]["picked"], picked.as_str(), "{done:#}");
    assert_eq!(
        done["group"]["result_branch"],
        format!("skiff/{picked}").as_str()
    );
    let parked: Vec<&str> = done["parked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(parked.len(), 2, "{done:#}");
    assert!(!parked.contains(&picked.as_str()));
    for (_, id) in &seen {
        let detail = rig.gw.json(&["session", "show", "--json", id]);
        let want = if *id == picked { "active" } else { "parked" };
        assert_eq!(detail["session"]["placement"], want, "{id}");
        assert_eq!(detail["group"]["picked"], picked.as_str());
        // Parked ones stay readable: the whole conversation is there.
        assert!(detail["transcript"].as_array().unwrap().len() >= 8, "{id}");
    }
    let boxes = rig.gw.json(&["env", "list", "--json"]);
    let idle = boxes["environments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["state"] == "idle")
        .count();
    assert_eq!(
        idle, 2,
        "the parked attempts' boxes are back in the pool: {boxes:#}"
    );

    let shown = stdout(&rig.gw.run(&["session", "show", &picked]));
    assert!(
        shown.contains("this attempt was picked: its branch is the group's result"),
        "{shown}"
    );
    let table = stdout(&rig.gw.run(&["session", "compare", &group]));
    assert!(
        table.contains(&format!(
            "picked {picked}: its branch skiff/{picked} is the group's result"
        )),
        "{table}"
    );
    // The picked branch holds its own attempt's work.
    assert_eq!(
        git(
            repo.path(),
            &["show", &format!("skiff/{picked}:attempt.txt")]
        ),
        "line 1\nline 2\n"
    );
    // A second pick of another attempt is refused, naming the one picked.
    let again = rig.gw.run(&["session", "pick", &seen[0].1]);
    assert_eq!(again.status.code(), Some(5), "a conflict");
    assert!(
        stderr(&again).contains(&format!("already has attempt {picked} picked")),
        "{}",
        stderr(&again)
    );
}

#[test]
fn a_fan_out_is_admitted_whole_or_refused_naming_the_free_workers() {
    let rig = Rig::start_with_responder(responder(), "[gateway]\nmax_workers = 2\n");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let path = repo.path().to_str().unwrap();
    let out = rig.gw.run(&new_args(path, "3"));
    assert_eq!(out.status.code(), Some(3), "at capacity: {}", stderr(&out));
    assert!(
        stderr(&out).contains("needs 3 workers, 2 free"),
        "{}",
        stderr(&out)
    );
    let list = rig.gw.json(&["session", "list", "--json"]);
    assert_eq!(
        list["sessions"].as_array().unwrap().len(),
        0,
        "nothing started"
    );

    // Bad counts and a missing profile are usage errors that say what is wrong.
    let out = rig.gw.run(&new_args(path, "9"));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("2..=8"), "{}", stderr(&out));
    let out = rig.gw.run(&[
        "session",
        "new",
        "--attempts",
        "2",
        "--workspace",
        path,
        PROMPT,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--profile"), "{}", stderr(&out));
    // Compare of something that is not a group says so.
    let out = rig.gw.run(&["session", "compare", "ses_nope"]);
    assert_eq!(out.status.code(), Some(2), "a bad request");
    assert!(
        stderr(&out).contains("is not a group id"),
        "{}",
        stderr(&out)
    );
}
