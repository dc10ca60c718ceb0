//! Turn time limits on a worker box: a real gateway, a real local box and worker, a fake
//! OpenAI-compatible provider that never finishes its answer.

use crate::harness::stderr;
use crate::worker::{Rig, text_reply, tool_reply};
use skiff_test_support::{FakeResponse, TempGitRepo};

#[test]
fn a_worker_turn_past_its_profiles_turn_timeout_is_stopped_and_its_work_kept() {
    let rig = Rig::start(
        vec![
            text_reply(&["placed"]),
            tool_reply(
                "c1",
                "write",
                r#"{"path":"partial.txt","content":"written before the limit\n"}"#,
            ),
            FakeResponse::stall(),
        ],
        // Long enough for a first placement on a busy machine, which the limit also covers.
        "turn_timeout = \"8s\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    // A first turn places the session, so the second one's limit is spent on the turn alone.
    let first = rig.session(&[
        "new",
        "--json",
        "--profile",
        "local",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.path().to_str().unwrap(),
        "hello",
    ]);
    assert!(first.status.success(), "{}", stderr(&first));
    let id = crate::harness::stdout(&first)
        .lines()
        .next()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .and_then(|v| v["session_id"].as_str().map(str::to_owned))
        .unwrap();

    let out = rig.session(&["send", &id, "write, then think forever"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a timed-out turn is a failed command"
    );
    let err = stderr(&out);
    assert!(
        err.contains("8s") && err.contains("profiles.local.turn_timeout"),
        "the CLI says which limit ended the turn: {err}"
    );
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["runs"][1]["status"], "timed_out");
    // What the turn did before the limit came back from the box.
    let workspace =
        std::path::PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(workspace.join("partial.txt")).unwrap(),
        "written before the limit\n"
    );
    // The worker stays for the next turn.
    assert_eq!(detail["session"]["placement"], "active");
}

#[test]
fn a_worker_that_stalls_past_stall_timeout_is_replaced_and_the_turn_goes_on() {
    let rig = Rig::start(
        vec![
            text_reply(&["placed"]),
            // A tool that hangs without a word: the worker shows no progress.
            tool_reply(
                "c1",
                "exec",
                r#"{"command":"echo started > hang.txt; sleep 600"}"#,
            ),
            text_reply(&["carried on"]),
        ],
        "stall_timeout = \"3s\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let first = rig.session(&[
        "new",
        "--json",
        "--profile",
        "local",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.path().to_str().unwrap(),
        "hello",
    ]);
    assert!(first.status.success(), "{}", stderr(&first));
    let id = crate::harness::stdout(&first)
        .lines()
        .next()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .and_then(|v| v["session_id"].as_str().map(str::to_owned))
        .unwrap();
    let epoch =
        rig.gw.json(&["session", "show", "--json", &id])["session"]["worker"]["owner_epoch"]
            .as_u64()
            .unwrap();

    let out = rig.session(&["send", &id, "run the hanging command"]);
    assert!(
        out.status.success(),
        "the turn finishes on the replacement: {}",
        stderr(&out)
    );
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["runs"][1]["status"], "succeeded");
    let new_epoch = detail["session"]["worker"]["owner_epoch"].as_u64().unwrap();
    assert!(
        new_epoch > epoch,
        "a new worker (epoch {new_epoch} after {epoch})"
    );
    let bodies: Vec<&serde_json::Value> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["body"])
        .collect();
    assert!(
        bodies.iter().any(|b| b["kind"] == "notice"
            && b["text"]
                .as_str()
                .unwrap()
                .contains("profiles.local.stall_timeout")),
        "the transcript says why the worker was replaced: {bodies:?}"
    );
    assert_eq!(bodies.last().unwrap()["text"], "carried on");
    // The hung command was not run again behind the model's back: the model was told.
    let asked = rig.fake.requests();
    assert_eq!(asked.len(), 3, "one request per reply, none repeated");
    let last = String::from_utf8_lossy(&asked[2].body).into_owned();
    assert!(last.contains("runtime running it stopped"), "{last}");
}
