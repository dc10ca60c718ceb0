//! The gateway on PostgreSQL (`[store] url`): a real throwaway cluster, the real binary. These
//! name their own database, whatever `SKIFF_TEST_STORE` says (the rest of the suite runs on
//! PostgreSQL too with `SKIFF_TEST_STORE=postgres`).

use crate::harness::{Gateway, SKIFF, git, stderr, stdout};
use skiff_test_support::TempGitRepo;
use skiff_test_support::postgres::TestDatabase;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

const EDIT_AND_COMMIT: &str = r#"
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
fn a_gateway_on_postgres_runs_a_session_and_keeps_it_across_a_restart() {
    let db = TestDatabase::new();
    let url = db.url();
    let mut gw = Gateway::start_with(EDIT_AND_COMMIT, &format!("[store]\nurl = \"{url}\"\n"));
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n")]);
    let id = gw.new_session(repo.path(), "fake/e2e", "finalize the notes");
    let branch = format!("skiff/{id}");
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:notes.txt")]),
        "final notes\n",
        "the turn ran and committed"
    );
    assert!(
        !gw.state_dir.join("skiff.db").exists(),
        "nothing was written to SQLite"
    );
    let before = stdout(&gw.run(&["session", "show", &id]));
    assert!(before.contains("All done."), "{before}");

    gw.crash_and_restart();
    let after = stdout(&gw.run(&["session", "show", &id]));
    assert_eq!(
        after, before,
        "the session and its transcript outlive the gateway"
    );
    let listed = gw.json(&["session", "list", "--json"]);
    assert!(listed.to_string().contains(&id), "{listed}");
}

/// `skiff gateway` with `config` as the state dir's skiff.toml: its exit code and stderr.
fn refused_start(config: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(state.join("skiff.toml"), config).unwrap();
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(&state)
        .args(["gateway", "--listen", "127.0.0.1:0"])
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(
        stdout(&out).is_empty(),
        "the gateway started: {}",
        stdout(&out)
    );
    (out.status.code(), stderr(&out))
}

#[test]
fn a_store_that_cannot_be_opened_stops_the_start_naming_the_key_never_the_password() {
    let db = TestDatabase::new();
    let socket = db.host().display().to_string();
    let cases = [
        // Nothing listens on port 1.
        (
            "[store]\nurl = \"postgres://skiff:hunter2-secret@127.0.0.1:1/app\"\n".to_owned(),
            "could not connect",
        ),
        (
            "[store]\nurl = \"postgres://skiff:hunter2-secret@127.0.0.1:notaport/app\"\n"
                .to_owned(),
            "malformed",
        ),
        // A database that does not exist on a server that answers; the password comes from
        // the environment.
        (
            format!(
                "[store]\nurl = \"host={socket} user=skiff dbname=nosuchdb\"\npassword = \"env:SKIFF_TEST_PG_PASSWORD\"\n"
            ),
            "nosuchdb",
        ),
        (
            "[store]\nurl = \"mysql://skiff:hunter2-secret@db/app\"\n".to_owned(),
            "not a PostgreSQL url",
        ),
        (
            "[store]\nurl = \"host=/tmp dbname=app\"\npassword = \"hunter2-secret\"\n".to_owned(),
            "env:VAR",
        ),
    ];
    for (config, says) in cases {
        let (code, err) = refused_start(&config, &[("SKIFF_TEST_PG_PASSWORD", "hunter2-secret")]);
        assert_ne!(code, Some(0), "{config}: {err}");
        assert!(err.contains("store."), "names the key: {config}\n{err}");
        assert!(err.contains(says), "{config}\n{err}");
        assert!(
            !err.contains("hunter2"),
            "the password appears in stderr: {config}\n{err}"
        );
    }
}
