//! `skiff agent list|show` and `session new --agent`: what a person reads about agent specs
//! and the version a session runs with.

use crate::harness::{Gateway, stderr, stdout};
use skiff_test_support::TempGitRepo;

const DONE: &str = "[[turns]]\ntext = \"Looked.\"\n";

#[test]
fn agent_list_show_and_a_pinned_session_read_well() {
    let gw = Gateway::start_with(
        DONE,
        "[agents.reviewer]\ninstructions = \"Review only.\"\ntools = [\"read\", \"grep\"]\nreasoning = \"low\"\n",
    );
    let list = gw.run(&["agent", "list"]);
    assert!(list.status.success(), "{}", stderr(&list));
    let line = stdout(&list);
    assert!(
        line.starts_with("reviewer@") && line.contains("(current)"),
        "{line}"
    );

    let show = gw.json(&["--json", "agent", "show", "reviewer"]);
    let digest = show["versions"][0]["digest"].as_str().unwrap().to_owned();
    assert_eq!(digest.len(), 64);
    assert_eq!(
        show["versions"][0]["spec"]["tools"],
        serde_json::json!(["grep", "read"])
    );
    let text = stdout(&gw.run(&["agent", "show", "reviewer"]));
    assert!(text.contains(&format!("digest     {digest}")), "{text}");
    assert!(text.contains("tools      grep, read"), "{text}");
    assert!(text.contains("  Review only."), "{text}");

    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = gw.run(&[
        "session",
        "new",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "--agent",
        &format!("reviewer@{}", &digest[..8]),
        "look",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let id = first["session_id"].as_str().unwrap();
    let show = stdout(&gw.run(&["session", "show", id]));
    assert!(
        show.contains(&format!("agent      reviewer@{}", &digest[..12])),
        "{show}"
    );
    assert!(
        show.contains("reasoning  low"),
        "the spec's reasoning applies: {show}"
    );

    let unknown = gw.run(&["agent", "show", "nobody"]);
    assert_eq!(unknown.status.code(), Some(4), "{}", stderr(&unknown));
    assert!(stderr(&unknown).contains("nobody"), "{}", stderr(&unknown));
}

/// A session on the `reviewer` spec whose first turn ("look") has run; its id.
fn reviewer_session(gw: &Gateway, repo: &TempGitRepo) -> String {
    let out = gw.run(&[
        "session",
        "new",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "--agent",
        "reviewer",
        "look",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    first["session_id"].as_str().unwrap().to_owned()
}

#[test]
fn session_send_agent_switches_the_spec_and_show_says_so() {
    let gw = Gateway::start_with(
        "[[turns]]\ntext = \"Looked.\"\n\n[[turns]]\ntext = \"Built.\"\n",
        "[agents.reviewer]\ninstructions = \"Review only.\"\n\n[agents.builder]\ninstructions = \"Build it.\"\nreasoning = \"high\"\n",
    );
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let id = reviewer_session(&gw, &repo);

    let unknown = gw.run(&["session", "send", &id, "--agent", "nobody", "go"]);
    assert_eq!(unknown.status.code(), Some(4), "{}", stderr(&unknown));
    assert!(
        stderr(&unknown).contains("no agent spec named nobody"),
        "{}",
        stderr(&unknown)
    );

    let sent = gw.run(&["session", "send", &id, "--agent", "builder", "build"]);
    assert!(sent.status.success(), "{}", stderr(&sent));
    let show = stdout(&gw.run(&["session", "show", &id]));
    assert!(show.contains("agent      builder@"), "{show}");
    assert!(
        show.contains("reasoning  high"),
        "the new spec's reasoning applies: {show}"
    );
}

#[test]
fn session_send_agent_without_a_prompt_switches_between_turns_and_starts_none() {
    let gw = Gateway::start_with(
        "[[turns]]\ntext = \"Looked.\"\n\n[[turns]]\ntext = \"Cleaning up.\"\n[[turns.tool_calls]]\nname = \"exec\"\narguments = { command = \"rm -rf build\" }\n\n[[turns]]\ntext = \"Done.\"\n",
        "[agents.reviewer]\ninstructions = \"Review only.\"\n\n[agents.builder]\ninstructions = \"Build it.\"\nreasoning = \"high\"\n",
    );
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let id = reviewer_session(&gw, &repo);
    let runs = |gw: &Gateway| {
        gw.json(&["--json", "session", "show", &id])["runs"]
            .as_array()
            .unwrap()
            .len()
    };

    // No prompt: the spec changes, and no turn starts.
    let switched = gw.run(&["session", "send", &id, "--agent", "builder"]);
    assert!(switched.status.success(), "{}", stderr(&switched));
    assert!(
        stdout(&switched).contains("runs agent builder@"),
        "{}",
        stdout(&switched)
    );
    let show = stdout(&gw.run(&["session", "show", &id]));
    assert!(show.contains("agent      builder@"), "{show}");
    assert!(show.contains("reasoning  high"), "{show}");
    assert_eq!(runs(&gw), 1, "a switch without a prompt started a turn");
    let store = gw.store();
    let audited: Vec<String> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "session.agent")
        .map(|r| r.detail["agent"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(audited.len(), 1, "{audited:?}");
    assert!(audited[0].starts_with("builder@"), "{audited:?}");

    // Neither a prompt nor --agent: a usage error.
    let neither = gw.run(&["session", "send", &id]);
    assert_eq!(neither.status.code(), Some(2), "{}", stderr(&neither));

    // While a turn runs (it waits on an approval), the switch is refused and changes nothing.
    let out = gw.run(&[
        "session",
        "send",
        &id,
        "--detach",
        "--approval",
        "{ exec = [\"rm *\"] }",
        "clean up",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let refused = gw.run(&["session", "send", &id, "--agent", "reviewer"]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("changes only between turns"),
        "{}",
        stderr(&refused)
    );
    let show = stdout(&gw.run(&["session", "show", &id]));
    assert!(show.contains("agent      builder@"), "{show}");
    assert_eq!(runs(&gw), 2);
    let out = gw.run(&["session", "cancel", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
}
