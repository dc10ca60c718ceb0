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
        "turn_timeout = \"3s\"\n",
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
        err.contains("3s") && err.contains("profiles.local.turn_timeout"),
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
