use crate::harness::{Gateway, git, processes_containing, sandbox_shares, stderr, stdout};
use skiff_test_support::TempGitRepo;
use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;

const EDIT_AND_COMMIT: &str = r#"
[[turns]]
text = "Reading the file."
[[turns.tool_calls]]
name = "read"
arguments = { path = "notes.txt" }

[[turns]]
text = "Editing it."
[[turns.tool_calls]]
name = "edit"
arguments = { path = "notes.txt", edits = [{ old_text = "draft", new_text = "final" }] }

[[turns]]
text = "Committing."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "git add -A && git commit -q -m 'agent: finalize notes'" }

[[turns]]
text = "All done."
"#;

#[test]
fn a_session_commits_on_its_own_branch_and_leaves_the_checkout_alone() {
    let gw = Gateway::start(EDIT_AND_COMMIT);
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n"), ("keep.txt", "committed\n")]);
    // Uncommitted and untracked work of the user's: carried into the session, never touched.
    std::fs::write(repo.path().join("keep.txt"), "changed by the user\n").unwrap();
    std::fs::write(repo.path().join("scratch.txt"), "untracked\n").unwrap();
    let status_before = git(repo.path(), &["status", "--porcelain"]);
    let head_before = git(repo.path(), &["rev-parse", "HEAD"]);

    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/e2e",
        "finalize the notes",
    ]);
    assert!(
        out.status.success(),
        "exit {:?}\n{}",
        out.status,
        stderr(&out)
    );
    let shown = stdout(&out);
    assert!(
        shown.contains("Reading the file.") && shown.contains("All done."),
        "{shown}"
    );
    assert!(shown.contains("▸ read notes.txt  ✓"), "{shown}");
    assert!(shown.contains("▸ edit notes.txt  ✓"), "{shown}");
    assert!(
        stderr(&out).contains("fake/e2e (scripted)"),
        "{}",
        stderr(&out)
    );

    let list = gw.json(&["session", "list", "--json"]);
    let id = list["sessions"][0]["id"].as_str().unwrap().to_owned();
    let branch = format!("skiff/{id}");

    // The commit is on the session branch, with the agent's edit and the user's carried work.
    assert_eq!(
        git(repo.path(), &["log", "-1", "--format=%s", &branch]).trim(),
        "agent: finalize notes"
    );
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:notes.txt")]),
        "final notes\n"
    );
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:keep.txt")]),
        "changed by the user\n"
    );
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:scratch.txt")]),
        "untracked\n"
    );

    // The live checkout is exactly as it was.
    assert_eq!(git(repo.path(), &["status", "--porcelain"]), status_before);
    assert_eq!(git(repo.path(), &["rev-parse", "HEAD"]), head_before);
    assert_eq!(
        std::fs::read_to_string(repo.path().join("notes.txt")).unwrap(),
        "draft notes\n"
    );

    // The transcript has the shape of the turn, with gateway-assigned ids chained by parent.
    let detail = gw.json(&["session", "show", &id, "--json"]);
    let transcript = detail["transcript"].as_array().unwrap();
    let kinds: Vec<&str> = transcript
        .iter()
        .map(|e| e["body"]["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "assistant_message",
            "tool_result",
            "assistant_message",
            "tool_result",
            "assistant_message"
        ]
    );
    for pair in transcript.windows(2) {
        assert_eq!(pair[1]["parent_id"], pair[0]["id"]);
    }
    assert_eq!(detail["runs"][0]["status"], "succeeded");
    assert_eq!(detail["session"]["workspace"]["branch"], branch.as_str());
    assert_eq!(detail["session"]["model"]["label"], "fake/e2e (scripted)");

    let human = gw.run(&["session", "show", &id]);
    let human = stdout(&human);
    assert!(human.contains(&format!("branch     {branch}")), "{human}");
    assert!(human.contains("model      fake/e2e (scripted)"), "{human}");
}

#[test]
fn cancel_stops_a_running_command_and_ends_the_run_cancelled() {
    let fifo_dir = tempfile::tempdir().unwrap();
    let fifo = fifo_dir.path().join("started");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let script = format!(
        "[[turns]]\ntext = \"Running a long command.\"\n[[turns.tool_calls]]\nname = \"exec\"\narguments = {{ command = \"sleep 31451 & echo started > {}; wait\" }}\n",
        fifo.display()
    );
    // The FIFO is outside the workspace: the sandbox is told to show it.
    let gw = Gateway::start_with(&script, &sandbox_shares(fifo_dir.path()));
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);

    let started = gw.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/slow",
        "wait",
    ]);
    let id = started["session"]["id"].as_str().unwrap().to_owned();
    let mut watch = gw
        .cli()
        .args(["session", "watch", &id, "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();

    // The command has started once it says so.
    let mut started = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut started)
        .unwrap();
    assert!(!processes_containing("sleep 31451").is_empty());

    let out = gw.run(&["session", "cancel", &id]);
    assert!(out.status.success(), "{}", stderr(&out));

    let lines: Vec<serde_json::Value> = BufReader::new(watch.stdout.take().unwrap())
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let status = watch.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(1),
        "watch exits non-zero for a cancelled run"
    );
    let last = lines.last().unwrap();
    assert_eq!(last["type"], "run_status");
    assert_eq!(last["status"], "cancelled");

    let left = processes_containing("sleep 31451");
    assert!(left.is_empty(), "the sleep survived the cancel: {left:?}");

    let detail = gw.json(&["session", "show", &id, "--json"]);
    assert_eq!(detail["runs"][0]["status"], "cancelled");
    let transcript = detail["transcript"].as_array().unwrap();
    let exec_result = &transcript[transcript.len() - 2]["body"];
    assert_eq!(exec_result["kind"], "tool_result");
    assert_eq!(exec_result["is_error"], true);
    assert_eq!(transcript.last().unwrap()["body"]["kind"], "notice");

    // The session takes the next turn.
    let out = gw.run(&["session", "send", &id, "go on"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_plain_directory_gets_a_gateway_owned_copy() {
    let script = "[[turns]]\ntext = \"Writing.\"\n[[turns.tool_calls]]\nname = \"write\"\narguments = { path = \"out.txt\", content = \"made by the agent\" }\n\n[[turns]]\ntext = \"Done.\"\n";
    let gw = Gateway::start(script);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("input.txt"), "data").unwrap();
    let out = gw.run(&[
        "session",
        "new",
        "--json",
        "--workspace",
        dir.path().to_str().unwrap(),
        "--model",
        "fake/plain",
        "write it",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let id = first["session_id"].as_str().unwrap();
    let detail = gw.json(&["session", "show", id, "--json"]);
    let copy = std::path::PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());
    assert_eq!(detail["session"]["workspace"]["kind"], "plain");
    assert!(copy.starts_with(&gw.state_dir));
    assert_eq!(
        std::fs::read_to_string(copy.join("out.txt")).unwrap(),
        "made by the agent"
    );
    assert_eq!(
        std::fs::read_to_string(copy.join("input.txt")).unwrap(),
        "data"
    );
    assert!(
        !dir.path().join("out.txt").exists(),
        "the user's directory was written"
    );
}

#[test]
fn session_show_reads_well() {
    let gw = Gateway::start(EDIT_AND_COMMIT);
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n")]);
    let id = gw.new_session(repo.path(), "fake/e2e", "finalize the notes");
    let shown = stdout(&gw.run(&["session", "show", &id]));
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"(ses|run|ent)_[0-9a-z]{16}", "${1}_[id]");
    settings.add_filter(r"/tmp/[^\s)]+", "[path]");
    settings.add_filter(r"from [0-9a-f]{12}", "from [commit]");
    settings.add_filter(r"in \d+ / out \d+ tokens", "in [n] / out [n] tokens");
    settings.bind(|| {
        insta::assert_snapshot!(shown, @r#"
        session    ses_[id]
        title      finalize the notes
        state      idle
        placement  local
        model      fake/e2e (scripted)
        workspace  [path] (git worktree of [path])
        branch     skiff/ses_[id] (from [commit])
        runs       1
          run_[id]  succeeded  in [n] / out [n] tokens

        you    finalize the notes
        agent  Reading the file.
          ▸ read notes.txt  ✓ 1 line
        agent  Editing it.
          ▸ edit notes.txt  ✓ 1 edit
        agent  Committing.
          ▸ exec git add -A && git commit -q -m 'agent: finalize notes'  ✓ exit 0
        agent  All done.
        "#);
    });
}

#[test]
fn sessions_created_at_once_on_one_repository_all_get_their_worktree() {
    let gw = Gateway::start("[[turns]]\ntext = \"ok\"\n");
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let outs: Vec<std::process::Output> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let (gw, repo) = (&gw, &repo);
                s.spawn(move || {
                    gw.run(&[
                        "session",
                        "new",
                        "--detach",
                        "--model",
                        "fake/x",
                        "--workspace",
                        repo.path().to_str().unwrap(),
                        &format!("session {i}"),
                    ])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for out in &outs {
        assert!(out.status.success(), "{}", stderr(out));
    }
    let branches = git(repo.path(), &["branch", "--list", "skiff/*"]);
    assert_eq!(branches.lines().count(), 8, "{branches}");
}

#[test]
fn tool_processes_of_a_local_session_die_with_a_crashed_gateway() {
    let fifo_dir = tempfile::tempdir().unwrap();
    let fifo = fifo_dir.path().join("started");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    // A detached writer into the worktree, then a long wait.
    let writer = "skiff-e2e-writer-31461";
    let script = format!(
        "[[turns]]\ntext = \"Starting a writer.\"\n[[turns.tool_calls]]\nname = \"exec\"\narguments = {{ command = \"setsid bash -c 'while :; do date >> bg.log; sleep 0.1; done' {writer} & echo started > {}; sleep 31462\" }}\n",
        fifo.display()
    );
    let mut gw = Gateway::start_with(&script, &sandbox_shares(fifo_dir.path()));
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    gw.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/writer",
        "write in the background",
    ]);
    let mut started = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut started)
        .unwrap();
    assert!(
        !processes_containing(writer).is_empty(),
        "the writer never ran"
    );
    let records = std::fs::read_dir(gw.state_dir.join("procs"))
        .unwrap()
        .count();
    assert_eq!(records, 1, "the running command is not recorded");

    gw.crash_and_restart();
    // The new gateway has printed "listening": nothing of the old one's command is left.
    let left = processes_containing(writer);
    assert!(left.is_empty(), "survived the gateway: {left:?}");
    assert!(processes_containing("sleep 31462").is_empty());
    let records = std::fs::read_dir(gw.state_dir.join("procs"))
        .unwrap()
        .count();
    assert_eq!(records, 0, "the record was not cleared");
}

#[test]
fn a_second_gateway_on_a_state_dir_in_use_exits_and_leaves_the_first_ones_turns_alone() {
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let release = dir.path().join("release");
    for fifo in [&started, &release] {
        assert!(
            std::process::Command::new("mkfifo")
                .arg(fifo)
                .status()
                .unwrap()
                .success()
        );
    }
    let script = format!(
        "[[turns]]\ntext = \"Waiting.\"\n[[turns.tool_calls]]\nname = \"exec\"\narguments = {{ command = \"echo go > {}; cat {}\" }}\n[[turns]]\ntext = \"Done.\"\n",
        started.display(),
        release.display()
    );
    let gw = Gateway::start_with(&script, &sandbox_shares(dir.path()));
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let run = gw.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/wait",
        "wait for me",
    ]);
    let id = run["session"]["id"].as_str().unwrap().to_owned();
    // The turn is running once its command has started.
    let mut go = String::new();
    std::fs::File::open(&started)
        .unwrap()
        .read_to_string(&mut go)
        .unwrap();

    // Same state dir, another port: refused before it reads or repairs anything.
    let second = std::process::Command::new(crate::harness::SKIFF)
        .arg("--state-dir")
        .arg(&gw.state_dir)
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(gw.config_path())
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = stderr(&second);
    assert!(
        err.contains("another gateway (pid ") && err.contains("is using the state dir"),
        "{err}"
    );

    // The first gateway's turn was not orphaned: it finishes when its command does.
    std::fs::write(&release, "done\n").unwrap();
    let out = gw.run(&["session", "watch", &id, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["runs"][0]["status"], "succeeded");
}

const PATCH_AND_COMMIT: &str = r#"
[[turns]]
text = "Patching."
[[turns.tool_calls]]
name = "apply_patch"
arguments = { patch = """
*** Begin Patch
*** Add File: docs/usage.md
+Run `make` first.
*** Update File: notes.txt
@@
-draft notes
+final notes
*** Delete File: old.txt
*** End Patch
""" }

[[turns]]
text = "Committing."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "git add -A && git commit -q -m 'agent: patch'" }

[[turns]]
text = "All done."
"#;

#[test]
fn a_patch_lands_on_the_session_branch_and_project_instructions_are_named() {
    let gw = Gateway::start(PATCH_AND_COMMIT);
    let repo = TempGitRepo::new(&[
        ("notes.txt", "draft notes\n"),
        ("old.txt", "stale\n"),
        ("AGENTS.md", "Keep notes short.\n"),
    ]);
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/e2e",
        "patch the notes",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("! project instructions: AGENTS.md (18 bytes)"),
        "{}",
        stderr(&out)
    );
    let shown = stdout(&out);
    assert!(
        shown.contains("▸ apply_patch docs/usage.md, notes.txt, old.txt  ✓ 3 files"),
        "{shown}"
    );

    let list = gw.json(&["session", "list", "--json"]);
    let branch = format!("skiff/{}", list["sessions"][0]["id"].as_str().unwrap());
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:notes.txt")]),
        "final notes\n"
    );
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:docs/usage.md")]),
        "Run `make` first.\n"
    );
    let files = git(repo.path(), &["ls-tree", "--name-only", &branch]);
    assert!(!files.lines().any(|f| f == "old.txt"), "{files}");
}
