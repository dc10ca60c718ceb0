//! A session's result coming home: `session diff` (both modes, per session and per turn),
//! `session apply` (plain mode, only onto a directory that still matches the base) and
//! `session export`.

use crate::harness::{Gateway, git, stderr, stdout};
use skiff_test_support::TempGitRepo;
use std::collections::BTreeMap;
use std::path::Path;

/// A plain session's turn: edits a file, adds one, deletes one, adds a symlink.
const CHANGE_FILES: &str = r#"
[[turns]]
text = "Changing things."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes.txt", content = "final\n" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "docs/added.txt", content = "new file\n" }
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm gone.txt && ln -s notes.txt link" }

[[turns]]
text = "Done."
"#;

/// What a directory holds: each file's bytes and mode, each symlink's target, each directory.
fn tree(root: &Path) -> BTreeMap<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let what = if meta.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&path).unwrap().display())
            } else if meta.is_dir() {
                stack.push(path.clone());
                "dir".to_owned()
            } else {
                format!(
                    "{:o} {}",
                    meta.permissions().mode() & 0o777,
                    String::from_utf8_lossy(&std::fs::read(&path).unwrap())
                )
            };
            out.insert(rel, what);
        }
    }
    out
}

fn source_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "draft\n").unwrap();
    std::fs::write(dir.path().join("gone.txt"), "old\n").unwrap();
    std::fs::write(dir.path().join("keep.txt"), "same\n").unwrap();
    dir
}

fn run_id(gw: &Gateway, id: &str) -> String {
    let detail = gw.json(&["session", "show", id, "--json"]);
    detail["runs"][0]["id"].as_str().unwrap().to_owned()
}

/// (status, path, insertions, deletions) of a diff document.
fn files(diff: &serde_json::Value) -> Vec<(String, String, u64, u64)> {
    diff["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["status"].as_str().unwrap().to_owned(),
                f["path"].as_str().unwrap().to_owned(),
                f["insertions"].as_u64().unwrap(),
                f["deletions"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn owned(rows: &[(&str, &str, u64, u64)]) -> Vec<(String, String, u64, u64)> {
    rows.iter()
        .map(|(s, p, i, d)| ((*s).to_owned(), (*p).to_owned(), *i, *d))
        .collect()
}

#[test]
fn a_plain_sessions_result_is_diffed_applied_and_exported() {
    let gw = Gateway::start(CHANGE_FILES);
    let src = source_dir();
    let before = tree(src.path());
    let id = gw.new_session(src.path(), "fake/x", "change things");
    assert_eq!(
        tree(src.path()),
        before,
        "the session wrote the user's directory"
    );

    // The session's changes against what it started from.
    let expected = owned(&[
        ("added", "docs/added.txt", 1, 0),
        ("deleted", "gone.txt", 0, 1),
        ("added", "link", 1, 0),
        ("modified", "notes.txt", 1, 1),
    ]);
    let diff = gw.json(&["session", "diff", &id, "--stat", "--json"]);
    assert_eq!(files(&diff), expected, "{diff:#}");
    assert_eq!(diff["mode"], "plain");
    assert_eq!(
        (diff["insertions"].as_u64(), diff["deletions"].as_u64()),
        (Some(3), Some(2))
    );
    assert!(
        diff["files"][0].get("patch").is_none(),
        "--stat carries no patch"
    );

    // The patch reads like git's.
    let out = gw.run(&["session", "diff", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let patch = stdout(&out);
    for want in [
        "diff --git a/notes.txt b/notes.txt\n--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-draft\n+final\n",
        "diff --git a/link b/link\nnew file mode 120000\n",
        "diff --git a/gone.txt b/gone.txt\ndeleted file mode 100644\n",
        "+++ b/docs/added.txt\n@@ -0,0 +1 @@\n+new file\n",
    ] {
        assert!(patch.contains(want), "{want:?} not in\n{patch}");
    }

    // The turn's changes are the same (it is the only turn), from its checkpoint.
    let run = run_id(&gw, &id);
    let turn = gw.json(&["session", "diff", &id, "--run", &run, "--stat", "--json"]);
    assert_eq!(files(&turn), expected, "{turn:#}");
    assert_eq!(turn["run_id"], run.as_str());

    // Apply writes exactly those changes into the source directory.
    let applied = gw.json(&["session", "apply", &id, "--json"]);
    assert_eq!(
        applied["written"],
        serde_json::json!(["docs/added.txt", "link", "notes.txt"])
    );
    assert_eq!(applied["deleted"], serde_json::json!(["gone.txt"]));
    let mut want = before.clone();
    want.remove("gone.txt");
    want.insert("notes.txt".into(), "644 final\n".into());
    want.insert("docs".into(), "dir".into());
    want.insert("docs/added.txt".into(), "644 new file\n".into());
    want.insert("link".into(), "-> notes.txt".into());
    assert_eq!(tree(src.path()), want);
    // Applying again changes nothing and is not a conflict.
    let again = gw.json(&["session", "apply", &id, "--json"]);
    assert_eq!(again["written"], serde_json::json!([]));
    assert_eq!(again["unchanged"].as_array().unwrap().len(), 4, "{again:#}");
    assert_eq!(tree(src.path()), want);

    // Export writes the whole result into a new directory, and refuses a non-empty one.
    let out_root = tempfile::tempdir().unwrap();
    let export = out_root.path().join("result");
    let done = gw.json(&[
        "session",
        "export",
        &id,
        "--to",
        export.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(done["files"], 4);
    assert_eq!(tree(&export), want);
    let out = gw.run(&[
        "session",
        "export",
        &id,
        "--to",
        src.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("is not empty"), "{}", stderr(&out));
    assert_eq!(tree(src.path()), want, "a refused export wrote something");
}

#[test]
fn apply_refuses_a_directory_that_changed_where_the_session_changed_it() {
    let gw = Gateway::start(CHANGE_FILES);
    let src = source_dir();
    let id = gw.new_session(src.path(), "fake/x", "change things");
    // Meanwhile the user edits a file the session changed too.
    std::fs::write(src.path().join("notes.txt"), "the user's own edit\n").unwrap();
    let before = tree(src.path());

    let out = gw.run(&["session", "apply", &id]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("notes.txt (changed in the target since the session started)"),
        "{err}"
    );
    assert!(err.contains("nothing was written"), "{err}");
    assert!(!err.contains("keep.txt"), "{err}");
    assert_eq!(tree(src.path()), before, "a refused apply wrote something");

    // Another directory that matches the base takes the changes.
    let other = source_dir();
    let done = gw.json(&[
        "session",
        "apply",
        &id,
        "--to",
        other.path().to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(done["deleted"], serde_json::json!(["gone.txt"]));
    assert_eq!(
        std::fs::read_to_string(other.path().join("notes.txt")).unwrap(),
        "final\n"
    );

    // Both attempts are audited; the routes need a token like every other.
    let store = gw.store();
    let decisions: Vec<String> = store
        .audit_rows()
        .unwrap()
        .into_iter()
        .filter(|r| r.action == "session.apply")
        .map(|r| r.decision)
        .collect();
    assert_eq!(decisions, ["refused", "applied"]);
    let http = reqwest::blocking::Client::new();
    for req in [
        http.get(format!("{}/v1/sessions/{id}/diff", gw.url)),
        http.post(format!("{}/v1/sessions/{id}/apply", gw.url))
            .json(&serde_json::json!({})),
        http.post(format!("{}/v1/sessions/{id}/export", gw.url))
            .json(&serde_json::json!({ "to": "/tmp/nowhere" })),
    ] {
        assert_eq!(req.send().unwrap().status(), 401);
    }
}

#[test]
fn diff_stat_reads_well() {
    let gw = Gateway::start(CHANGE_FILES);
    let src = source_dir();
    let id = gw.new_session(src.path(), "fake/x", "change things");
    let out = gw.run(&["session", "diff", &id, "--stat"]);
    let shown = format!(
        "exit: {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        stdout(&out),
        stderr(&out)
    );
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"(ses|run)_[0-9a-z]{16}", "${1}_[id]");
    settings.add_filter(r"/tmp/[^\s)]+", "[path]");
    settings.bind(|| {
        insta::assert_snapshot!(shown, @r"
        exit: Some(0)
        --- stdout
         A docs/added.txt | 1 +
         D gone.txt       | 1 -
         A link           | 1 +
         M notes.txt      | 2 +-
         4 files changed, 3 insertions(+), 2 deletions(-)
        --- stderr
        ");
    });
}

/// A git session's turn: commits an edit, then leaves an untracked file.
const COMMIT_AND_LEAVE: &str = r#"
[[turns]]
text = "Committing."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes.txt", content = "final\n" }
[[turns.tool_calls]]
name = "exec"
arguments = { command = "git commit -q -am 'agent: finalize notes'" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "wip.txt", content = "scratch\n" }

[[turns]]
text = "Done."
"#;

#[test]
fn a_git_sessions_diff_shows_its_commits_and_uncommitted_work() {
    let gw = Gateway::start(COMMIT_AND_LEAVE);
    let repo = TempGitRepo::new(&[("notes.txt", "draft\n"), ("keep.txt", "committed\n")]);
    // The user's uncommitted work is carried into the session.
    std::fs::write(repo.path().join("keep.txt"), "the user's edit\n").unwrap();
    let id = gw.new_session(repo.path(), "fake/x", "finalize the notes");

    let diff = gw.json(&["session", "diff", &id, "--json"]);
    assert_eq!(diff["mode"], "git");
    assert_eq!(
        diff["base"].as_str().unwrap(),
        git(repo.path(), &["rev-parse", "HEAD"]).trim()
    );
    let commits = diff["commits"].as_array().unwrap();
    assert_eq!(commits.len(), 1, "{diff:#}");
    assert_eq!(commits[0]["summary"], "agent: finalize notes");
    assert_eq!(
        files(&diff),
        owned(&[
            ("modified", "keep.txt", 1, 1),
            ("modified", "notes.txt", 1, 1),
            ("added", "wip.txt", 1, 0),
        ])
    );
    let wip = &diff["files"][2]["patch"];
    assert!(
        wip.as_str().unwrap().contains("new file mode 100644")
            && wip.as_str().unwrap().contains("+scratch"),
        "{wip}"
    );

    // The turn's own changes leave out what the user brought in.
    let run = run_id(&gw, &id);
    let turn = gw.json(&["session", "diff", &id, "--run", &run, "--json"]);
    assert_eq!(
        files(&turn),
        owned(&[("modified", "notes.txt", 1, 1), ("added", "wip.txt", 1, 0)]),
        "{turn:#}"
    );
    assert_eq!(turn["commits"][0]["summary"], "agent: finalize notes");

    // A git session's result is its branch: apply says so; export writes its files, no .git.
    let out = gw.run(&["session", "apply", &id]);
    assert_eq!(out.status.code(), Some(5));
    assert!(
        stderr(&out).contains("skiff session publish"),
        "{}",
        stderr(&out)
    );
    let out_root = tempfile::tempdir().unwrap();
    let export = out_root.path().join("result");
    gw.json(&[
        "session",
        "export",
        &id,
        "--to",
        export.to_str().unwrap(),
        "--json",
    ]);
    let got = tree(&export);
    assert_eq!(
        got.keys().map(String::as_str).collect::<Vec<_>>(),
        ["keep.txt", "notes.txt", "wip.txt"]
    );
    assert_eq!(got["notes.txt"], "644 final\n");
}
