//! What a person sees of a tool's result in the terminal: `exec`'s exit code and the tail of
//! its output (all of it with `--full`), for the live turn and for `session show`.

use crate::harness::{Gateway, stderr, stdout};
use skiff_test_support::TempGitRepo;
use std::process::Output;

/// A turn whose test command fails after 30 lines, the reason last (on stderr).
const FAILING_TEST: &str = r#"
[[turns]]
text = "Reading the notes, then running the tests."
[[turns.tool_calls]]
name = "read"
arguments = { path = "notes.txt" }
[[turns.tool_calls]]
name = "exec"
arguments = { command = "printf 'line %s\\n' $(seq 1 30); echo 'assertion failed: x == 2' >&2; exit 1" }

[[turns]]
text = "The test fails: x is not 2."
"#;

/// Exit code, stdout and stderr together, the way a person meets them.
fn shown(out: &Output) -> String {
    format!(
        "success: {}\nexit_code: {}\n----- stdout -----\n{}----- stderr -----\n{}",
        out.status.success(),
        out.status.code().unwrap_or(-1),
        stdout(out),
        stderr(out)
    )
}

/// Ids, paths and times vary from run to run; what is left is what a person reads.
fn settings() -> insta::Settings {
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"(ses|run|ent)_[0-9a-z]{16}", "${1}_[id]");
    settings.add_filter(r"/tmp/[^\s)]+", "[path]");
    settings.add_filter(r"\b\d+(\.\d+)? (ms|s)\b", "[time]");
    settings.add_filter(r"from [0-9a-f]{12}", "from [commit]");
    settings.add_filter(r"in \d+ / out \d+ tokens", "in [n] / out [n] tokens");
    settings
}

fn failing_turn() -> (Gateway, TempGitRepo, Output) {
    let gw = Gateway::start(FAILING_TEST);
    let repo = TempGitRepo::new(&[("notes.txt", "x should be 2\n")]);
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/results",
        "run the tests",
    ]);
    (gw, repo, out)
}

#[test]
fn a_failing_command_shows_its_exit_code_and_the_tail_of_its_output() {
    let (gw, _repo, out) = failing_turn();
    settings().bind(|| {
        insta::assert_snapshot!(shown(&out), @r"
        success: true
        exit_code: 0
        ----- stdout -----
        Reading the notes, then running the tests.
          ▸ read notes.txt  ✓ 1 line · [time]
          ▸ exec printf 'line %s\n' $(seq 1 30); echo 'assertion failed: x == 2' >&2; exit 1  ✗ exit 1 · [time]
              … 21 earlier lines (--full shows all)
              line 22
              line 23
              line 24
              line 25
              line 26
              line 27
              line 28
              line 29
              line 30
              assertion failed: x == 2
        The test fails: x is not 2.
        ----- stderr -----
        session ses_[id] · fake/results (scripted) · [path]
        ✓ run succeeded
        ");
    });

    let id = gw.json(&["session", "list", "--json"])["sessions"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let show = gw.run(&["session", "show", &id]);
    settings().bind(|| {
        insta::assert_snapshot!(shown(&show), @r"
        success: true
        exit_code: 0
        ----- stdout -----
        session    ses_[id]
        title      run the tests
        state      idle
        placement  local
        model      fake/results (scripted)
        workspace  [path] (git worktree of [path])
        branch     skiff/ses_[id] (from [commit])
        runs       1
          run_[id]  succeeded  in [n] / out [n] tokens

        you    run the tests
        agent  Reading the notes, then running the tests.
          ▸ read notes.txt  ✓ 1 line
          ▸ exec printf 'line %s\n' $(seq 1 30); echo 'assertion failed: x == 2' >&2; exit 1  ✗ exit 1
              … 21 earlier lines (--full shows all)
              line 22
              line 23
              line 24
              line 25
              line 26
              line 27
              line 28
              line 29
              line 30
              assertion failed: x == 2
        agent  The test fails: x is not 2.
        ----- stderr -----
        ");
    });
}

#[test]
fn full_shows_all_of_the_output() {
    let (gw, _repo, out) = failing_turn();
    assert!(out.status.success(), "{}", stderr(&out));
    let id = gw.json(&["session", "list", "--json"])["sessions"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    for args in [["session", "show"], ["session", "watch"]] {
        let cut = stdout(&gw.run(&[args[0], args[1], &id]));
        assert!(
            !cut.contains("      line 1\n"),
            "{args:?} without --full:\n{cut}"
        );
        let full = gw.run(&[args[0], args[1], &id, "--full"]);
        assert!(full.status.success(), "{}", stderr(&full));
        let full = stdout(&full);
        for n in 1..=30 {
            assert!(
                full.contains(&format!("      line {n}\n")),
                "{args:?} --full lacks line {n}:\n{full}"
            );
        }
        assert!(full.contains("      assertion failed: x == 2\n"), "{full}");
        assert!(!full.contains("earlier lines"), "{full}");
    }
}
