//! Going back to a checkpoint: `session restore ID --checkpoint N` puts the workspace back to
//! turn N and keeps the transcript and the later checkpoints; `session fork ID --at N` starts
//! a new session from turn N. Git and plain mode, a real gateway, a scripted model.

use crate::harness::{Gateway, git, stderr, stdout};
use skiff_test_support::TempGitRepo;
use std::path::{Path, PathBuf};

// Only file tools: the exec tool's `bash -lc` runs the host's login profile, which is not this
// test's business. The scripted model picks its reply by the number of assistant messages, so
// turn 4 of a restored session (and turn 2 of a fork at 1) replay the turns listed here.
const THREE_TURNS: &str = r#"
[[turns]]
text = "Turn one."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes.txt", content = "one\n" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "u.txt", content = "untracked one\n" }
[[turns]]
text = "Done one."

[[turns]]
text = "Turn two."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes.txt", content = "two\n" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "b.txt", content = "turn two\n" }
[[turns]]
text = "Done two."

[[turns]]
text = "Turn three."
[[turns.tool_calls]]
name = "write"
arguments = { path = "sub/c.txt", content = "turn three\n" }
[[turns]]
text = "Done three."

[[turns]]
text = "Turn four."
[[turns.tool_calls]]
name = "write"
arguments = { path = "d.txt", content = "turn four\n" }
[[turns]]
text = "Done four."
"#;

fn send(gw: &Gateway, id: &str, prompt: &str) {
    let out = gw.run(&["session", "send", id, prompt]);
    assert!(out.status.success(), "send: {}", stderr(&out));
}

fn workspace_of(gw: &Gateway, id: &str) -> PathBuf {
    let detail = gw.json(&["session", "show", id, "--json"]);
    PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap())
}

fn transcript(gw: &Gateway, id: &str) -> Vec<serde_json::Value> {
    gw.json(&["session", "show", id, "--json"])["transcript"]
        .as_array()
        .unwrap()
        .clone()
}

fn seqs(gw: &Gateway, id: &str) -> Vec<u64> {
    gw.json(&["session", "checkpoints", id, "--json"])["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["seq"].as_u64().unwrap())
        .collect()
}

fn read(dir: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(rel)).ok()
}

/// Three turns on a fresh session; returns its id.
fn three_turns(gw: &Gateway, workspace: &Path, between: impl Fn(u32, &Path)) -> String {
    let id = gw.new_session(workspace, "fake/x", "turn one");
    let ws = workspace_of(gw, &id);
    between(1, &ws);
    send(gw, &id, "turn two");
    between(2, &ws);
    send(gw, &id, "turn three");
    assert_eq!(seqs(gw, &id), [1, 2, 3]);
    id
}

fn texts(entries: &[serde_json::Value]) -> Vec<String> {
    entries
        .iter()
        .map(|e| {
            let b = &e["body"];
            format!(
                "{}: {}",
                b["kind"].as_str().unwrap(),
                b["text"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// Turn 1's entries, as the fork must start with them.
fn turn_one() -> Vec<String> {
    vec![
        "user_message: turn one".to_owned(),
        "assistant_message: Turn one.".to_owned(),
        "tool_result: ".to_owned(),
        "tool_result: ".to_owned(),
        "assistant_message: Done one.".to_owned(),
    ]
}

#[test]
fn a_git_session_restores_checkpoint_one_of_three_and_forks_there() {
    let gw = Gateway::start(THREE_TURNS);
    let repo = TempGitRepo::new(&[("notes.txt", "draft\n")]);
    // An untracked file over the size a checkpoint keeps outside git.
    let mut big = vec![0u8; 9 << 20];
    blake3::Hasher::new()
        .update(b"big")
        .finalize_xof()
        .fill(&mut big);
    std::fs::create_dir_all(repo.path().join("assets")).unwrap();
    std::fs::write(repo.path().join("assets/big.bin"), &big).unwrap();
    let committed = std::cell::RefCell::new(String::new());
    let id = three_turns(&gw, repo.path(), |after, ws| {
        if after == 2 {
            // The agent commits turn two's file and deletes two untracked files (as it would
            // with its exec tool).
            git(ws, &["add", "b.txt"]);
            git(
                ws,
                &[
                    "-c",
                    "user.name=Agent",
                    "-c",
                    "user.email=a@skiff.invalid",
                    "commit",
                    "-q",
                    "-m",
                    "agent: b",
                ],
            );
            *committed.borrow_mut() = git(ws, &["rev-parse", "HEAD"]).trim().to_owned();
            std::fs::remove_file(ws.join("u.txt")).unwrap();
            std::fs::remove_file(ws.join("assets/big.bin")).unwrap();
        }
    });
    let ws = workspace_of(&gw, &id);
    let before = transcript(&gw, &id);
    let cp1 = gw.json(&["session", "checkpoints", &id, "--json"])["checkpoints"][0]["commit"]
        .as_str()
        .unwrap()
        .to_owned();

    let done = gw.json(&["session", "restore", &id, "--checkpoint", "1", "--json"]);
    assert_eq!(done["checkpoint"], 1);
    assert_eq!(done["later"], serde_json::json!([2, 3]));
    // Turn one's content is back, turns two and three's files are gone, and so are their
    // directories; the untracked files deleted later are back (the large one from the
    // gateway's artifact store).
    assert_eq!(read(&ws, "notes.txt").as_deref(), Some("one\n"));
    assert_eq!(read(&ws, "u.txt").as_deref(), Some("untracked one\n"));
    assert_eq!(std::fs::read(ws.join("assets/big.bin")).unwrap(), big);
    assert_eq!(read(&ws, "b.txt"), None);
    assert!(!ws.join("sub").exists());
    // Uncommitted work shows as uncommitted again; the branch kept its history and records
    // the restore in a new commit with the tree the checkpoint was taken on.
    assert_eq!(
        git(&ws, &["status", "--porcelain"]),
        " M notes.txt\n?? assets/\n?? u.txt\n"
    );
    let head = git(&ws, &["rev-parse", "HEAD"]);
    assert_eq!(done["commit"], head.trim());
    assert_eq!(
        git(&ws, &["rev-parse", "HEAD^"]).trim(),
        *committed.borrow()
    );
    assert_eq!(
        git(&ws, &["rev-parse", "HEAD^{tree}"]),
        git(&ws, &["rev-parse", &format!("{cp1}^^{{tree}}")])
    );
    assert!(
        git(&ws, &["log", "-1", "--format=%s"]).contains("restored to checkpoint 1"),
        "{}",
        git(&ws, &["log", "-1", "--format=%s"])
    );
    // The transcript is kept whole, with a notice at its end.
    let after = transcript(&gw, &id);
    assert_eq!(after.len(), before.len() + 1);
    assert_eq!(after[..before.len()], before[..]);
    let notice = texts(&after[before.len()..]).remove(0);
    assert!(
        notice.starts_with("notice: workspace restored to checkpoint 1 (end of turn 1); later checkpoints are kept: 2, 3"),
        "{notice}"
    );
    // The later checkpoints are kept and restorable; the next turn takes checkpoint 4.
    assert_eq!(seqs(&gw, &id), [1, 2, 3]);
    send(&gw, &id, "turn four");
    assert_eq!(seqs(&gw, &id), [1, 2, 3, 4]);
    assert_eq!(read(&ws, "d.txt").as_deref(), Some("turn four\n"));
    let out = gw.run(&["session", "restore", &id, "--checkpoint", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("restored session"),
        "{}",
        stderr(&out)
    );
    assert_eq!(read(&ws, "sub/c.txt").as_deref(), Some("turn three\n"));
    assert_eq!(read(&ws, "b.txt").as_deref(), Some("turn two\n"));
    assert_eq!(read(&ws, "d.txt"), None);
    assert_eq!(read(&ws, "u.txt"), None);
    // As at the end of turn three: turn two's edit uncommitted, turn three's file untracked,
    // and the branch where it was (its tree is the agent's commit's).
    assert_eq!(
        git(&ws, &["status", "--porcelain"]),
        " M notes.txt\n?? sub/\n"
    );
    assert_eq!(
        git(&ws, &["rev-parse", "HEAD^{tree}"]),
        git(
            &ws,
            &["rev-parse", &format!("{}^{{tree}}", committed.borrow())]
        )
    );

    // A fork at checkpoint 1: turn one's transcript, turn one's workspace, its own branch.
    let original = transcript(&gw, &id);
    let fork = gw.json(&["session", "fork", &id, "--at", "1", "--json"]);
    let fork_id = fork["id"].as_str().unwrap().to_owned();
    assert_ne!(fork_id, id);
    assert!(
        fork["title"].as_str().unwrap().ends_with("(fork at 1)"),
        "{fork}"
    );
    let entries = transcript(&gw, &fork_id);
    let mut expected = turn_one();
    expected.push(format!(
        "notice: forked from session {id} at checkpoint 1 (end of turn 1): the workspace starts as that checkpoint holds it"
    ));
    assert_eq!(texts(&entries), expected);
    let fws = workspace_of(&gw, &fork_id);
    assert_ne!(fws, ws);
    assert_eq!(read(&fws, "notes.txt").as_deref(), Some("one\n"));
    assert_eq!(read(&fws, "u.txt").as_deref(), Some("untracked one\n"));
    assert_eq!(std::fs::read(fws.join("assets/big.bin")).unwrap(), big);
    assert_eq!(read(&fws, "b.txt"), None);
    assert_eq!(
        git(&fws, &["status", "--porcelain"]),
        " M notes.txt\n?? assets/\n?? u.txt\n"
    );
    assert_eq!(
        git(&fws, &["rev-parse", "--abbrev-ref", "HEAD"]).trim(),
        format!("skiff/{fork_id}")
    );
    assert_eq!(seqs(&gw, &fork_id), [1]);
    // The fork's next turn runs (the model sees turn one only, so it replays turn two) and
    // its checkpoints go on from there; the original is untouched.
    send(&gw, &fork_id, "turn two again");
    assert_eq!(read(&fws, "b.txt").as_deref(), Some("turn two\n"));
    assert_eq!(seqs(&gw, &fork_id), [1, 2]);
    assert_eq!(transcript(&gw, &id), original);
    assert_eq!(read(&ws, "d.txt"), None);
    assert_eq!(seqs(&gw, &id), [1, 2, 3, 4]);
}

#[test]
fn a_plain_session_restores_checkpoint_one_of_three_and_forks_there() {
    let gw = Gateway::start(THREE_TURNS);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "draft\n").unwrap();
    std::fs::create_dir(dir.path().join("keep")).unwrap();
    std::fs::write(dir.path().join("keep/k.txt"), "kept\n").unwrap();
    let id = three_turns(&gw, dir.path(), |after, ws| {
        if after == 2 {
            // Gone by hand after turn two: the restore must bring it back.
            std::fs::remove_file(ws.join("u.txt")).unwrap();
        }
    });
    let ws = workspace_of(&gw, &id);
    let before = transcript(&gw, &id);

    let out = gw.run(&["session", "restore", &id, "--checkpoint", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    assert!(printed.contains("deleted  b.txt"), "{printed}");
    assert!(printed.contains("wrote    u.txt"), "{printed}");
    assert!(
        stderr(&out).contains(&format!("skiff session restore {id} --checkpoint 3")),
        "{}",
        stderr(&out)
    );
    assert_eq!(read(&ws, "notes.txt").as_deref(), Some("one\n"));
    assert_eq!(read(&ws, "u.txt").as_deref(), Some("untracked one\n"));
    assert_eq!(read(&ws, "keep/k.txt").as_deref(), Some("kept\n"));
    assert_eq!(read(&ws, "b.txt"), None);
    assert!(!ws.join("sub").exists());
    let after = transcript(&gw, &id);
    assert_eq!(after[..before.len()], before[..]);
    assert_eq!(
        texts(&after[before.len()..]),
        ["notice: workspace restored to checkpoint 1 (end of turn 1); later checkpoints are kept: 2, 3 (`skiff session restore ".to_owned()
            + &id
            + " --checkpoint 3` goes back)"]
    );
    assert_eq!(seqs(&gw, &id), [1, 2, 3]);
    send(&gw, &id, "turn four");
    assert_eq!(seqs(&gw, &id), [1, 2, 3, 4]);

    let fork = gw.json(&[
        "session",
        "fork",
        &id,
        "--at",
        "1",
        "--title",
        "other way",
        "--json",
    ]);
    let fork_id = fork["id"].as_str().unwrap().to_owned();
    assert_eq!(fork["title"], "other way");
    let mut expected = turn_one();
    expected.push(format!(
        "notice: forked from session {id} at checkpoint 1 (end of turn 1): the workspace starts as that checkpoint holds it"
    ));
    assert_eq!(texts(&transcript(&gw, &fork_id)), expected);
    let fws = workspace_of(&gw, &fork_id);
    assert_ne!(fws, ws);
    assert_eq!(read(&fws, "notes.txt").as_deref(), Some("one\n"));
    assert_eq!(read(&fws, "u.txt").as_deref(), Some("untracked one\n"));
    assert_eq!(read(&fws, "keep/k.txt").as_deref(), Some("kept\n"));
    assert_eq!(read(&fws, "d.txt"), None);
    send(&gw, &fork_id, "turn two again");
    assert_eq!(read(&fws, "b.txt").as_deref(), Some("turn two\n"));
    assert_eq!(seqs(&gw, &fork_id), [1, 2]);
    // The fork measures its result against what the original started from.
    let diff = gw.json(&["session", "diff", &fork_id, "--stat", "--json"]);
    let paths: Vec<&str> = diff["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["b.txt", "notes.txt", "u.txt"], "{diff}");
    // The original is untouched by its fork.
    assert_eq!(read(&ws, "b.txt"), None);
    assert_eq!(read(&ws, "d.txt").as_deref(), Some("turn four\n"));
}

#[test]
fn an_unknown_checkpoint_is_refused_naming_the_ones_there_are() {
    let gw = Gateway::start(THREE_TURNS);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "draft\n").unwrap();
    let id = gw.new_session(dir.path(), "fake/x", "turn one");
    let ws = workspace_of(&gw, &id);
    for args in [
        ["session", "restore", &id, "--checkpoint", "7"],
        ["session", "fork", &id, "--at", "7"],
    ] {
        let out = gw.run(&args);
        assert_eq!(out.status.code(), Some(4), "not found: {args:?}");
        assert!(
            stderr(&out).contains(&format!(
                "session {id} has no checkpoint 7; its checkpoints are 1"
            )),
            "{}",
            stderr(&out)
        );
    }
    assert_eq!(read(&ws, "notes.txt").as_deref(), Some("one\n"));
    assert_eq!(
        gw.json(&["session", "list", "--json"])["sessions"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(transcript(&gw, &id).len(), 5);
}

// A turn that stays open: many words, streamed slowly.
const SLOW: &str = r#"
chunk_delay_ms = 200
[[turns]]
text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three twenty-four twenty-five twenty-six twenty-seven twenty-eight twenty-nine thirty thirty-one thirty-two thirty-three thirty-four thirty-five thirty-six thirty-seven thirty-eight thirty-nine forty forty-one forty-two forty-three forty-four forty-five forty-six forty-seven forty-eight forty-nine fifty fifty-one fifty-two fifty-three fifty-four fifty-five fifty-six fifty-seven fifty-eight fifty-nine sixty end"
"#;

#[test]
fn a_restore_is_refused_while_a_run_is_open() {
    let gw = Gateway::start(SLOW);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "draft\n").unwrap();
    let out = gw.run(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        dir.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "talk",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = gw.json(&["session", "list", "--json"])["sessions"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let run = gw.json(&["session", "show", &id, "--json"])["runs"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = gw.run(&["session", "restore", &id, "--checkpoint", "1"]);
    assert_eq!(out.status.code(), Some(5), "a conflict");
    assert!(
        stderr(&out).contains(&run) && stderr(&out).contains(&id),
        "{}",
        stderr(&out)
    );
    let kinds: Vec<String> = texts(&transcript(&gw, &id))
        .into_iter()
        .filter(|t| t.starts_with("notice"))
        .collect();
    assert!(kinds.is_empty(), "{kinds:?}");
    let out = gw.run(&["session", "cancel", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
}
