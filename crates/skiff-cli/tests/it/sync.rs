//! Checkpoints after local turns, and publishing a session branch to a remote.

use crate::harness::{Gateway, git, stderr};
use skiff_test_support::TempGitRepo;

// Only file tools: the exec tool's `bash -lc` runs the host's login profile, which is not
// this test's business.
const EDIT: &str = r#"
[[turns]]
text = "Editing."
[[turns.tool_calls]]
name = "write"
arguments = { path = "notes.txt", content = "final\n" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "wip.txt", content = "scratch\n" }

[[turns]]
text = "Done."
"#;

fn new_session(gw: &Gateway, workspace: &std::path::Path) -> String {
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        workspace.to_str().unwrap(),
        "--model",
        "fake/x",
        "--json",
        "work",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let list = gw.json(&["session", "list", "--json"]);
    list["sessions"][0]["id"].as_str().unwrap().to_owned()
}

#[test]
fn a_turn_leaves_a_checkpoint_and_publish_pushes_the_branch() {
    let gw = Gateway::start(EDIT);
    let repo = TempGitRepo::new(&[("notes.txt", "draft\n")]);
    let remote = tempfile::tempdir().unwrap();
    git(remote.path(), &["init", "-q", "--bare"]);
    git(
        repo.path(),
        &["remote", "add", "origin", remote.path().to_str().unwrap()],
    );
    let status_before = git(repo.path(), &["status", "--porcelain"]);
    let id = new_session(&gw, repo.path());
    let branch = format!("skiff/{id}");
    let detail = gw.json(&["session", "show", &id, "--json"]);
    let worktree =
        std::path::PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());

    let list = gw.json(&["session", "checkpoints", &id, "--json"]);
    let cps = list["checkpoints"].as_array().unwrap();
    assert_eq!(cps.len(), 1, "{list}");
    let cp = &cps[0];
    assert_eq!(cp["seq"], 1);
    assert_eq!(cp["mode"], "git");
    assert!(cp["id"].as_str().unwrap().starts_with("art_"));
    let git_ref = cp["git_ref"].as_str().unwrap();
    assert_eq!(git_ref, format!("refs/skiff/checkpoints/{id}/1"));
    // The checkpoint holds the turn's uncommitted work; the worktree still shows it uncommitted.
    assert_eq!(
        git(repo.path(), &["show", &format!("{git_ref}:wip.txt")]),
        "scratch\n"
    );
    assert_eq!(
        git(repo.path(), &["show", &format!("{git_ref}:notes.txt")]),
        "final\n"
    );
    assert_eq!(
        git(&worktree, &["status", "--porcelain"]),
        " M notes.txt\n?? wip.txt\n"
    );
    assert_eq!(
        git(repo.path(), &["rev-parse", &format!("{git_ref}^")]),
        git(repo.path(), &["rev-parse", &branch])
    );
    let human = gw.run(&["session", "checkpoints", &id]);
    assert!(String::from_utf8_lossy(&human.stdout).contains(git_ref));

    // The agent commits (as it would with its exec tool); publish pushes that commit under
    // the session's branch name, then under a name of our choosing.
    git(&worktree, &["add", "notes.txt"]);
    git(
        &worktree,
        &[
            "-c",
            "user.name=Agent",
            "-c",
            "user.email=a@skiff.invalid",
            "commit",
            "-q",
            "-m",
            "agent: notes",
        ],
    );
    let done = gw.json(&["session", "publish", &id, "--json"]);
    assert_eq!(done["branch"], branch.as_str());
    assert_eq!(done["remote"], "origin");
    let head = git(repo.path(), &["rev-parse", &branch]);
    assert_eq!(done["commit"], head.trim());
    assert_eq!(
        git(
            remote.path(),
            &["rev-parse", &format!("refs/heads/{branch}")]
        ),
        head
    );
    assert_eq!(
        git(remote.path(), &["log", "-1", "--format=%s", &branch]).trim(),
        "agent: notes"
    );
    let done = gw.json(&[
        "session",
        "publish",
        &id,
        "--branch",
        "feature/notes",
        "--json",
    ]);
    assert_eq!(done["branch"], "feature/notes");
    assert_eq!(
        git(remote.path(), &["rev-parse", "refs/heads/feature/notes"]),
        head
    );

    // Refusals: an unknown remote, a bad branch name.
    let out = gw.run(&["session", "publish", &id, "--remote", "nowhere"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no remote named nowhere"),
        "{}",
        stderr(&out)
    );
    let out = gw.run(&["session", "publish", &id, "--branch", "bad..name"]);
    assert_eq!(out.status.code(), Some(2));
    // The user's checkout is as it was.
    assert_eq!(git(repo.path(), &["status", "--porcelain"]), status_before);

    // A second turn: a second checkpoint.
    let out = gw.run(&["session", "send", &id, "again"]);
    assert!(
        out.status.success() || out.status.code() == Some(1),
        "{}",
        stderr(&out)
    );
    let list = gw.json(&["session", "checkpoints", &id, "--json"]);
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 2, "{list}");
    assert_eq!(list["checkpoints"][1]["seq"], 2);
}

#[test]
fn a_plain_session_checkpoints_into_the_artifact_store_and_cannot_publish() {
    let gw = Gateway::start(EDIT);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "draft\n").unwrap();
    let id = new_session(&gw, dir.path());
    let list = gw.json(&["session", "checkpoints", &id, "--json"]);
    let cp = &list["checkpoints"][0];
    assert_eq!(cp["mode"], "plain");
    let manifest = cp["manifest"].as_str().unwrap();
    let blob = gw.state_dir.join("artifacts").join(manifest);
    let text = std::fs::read_to_string(&blob).unwrap();
    assert!(text.contains("notes.txt"), "{text}");
    let out = gw.run(&["session", "publish", &id]);
    assert_eq!(out.status.code(), Some(5));
    assert!(stderr(&out).contains("plain directory"), "{}", stderr(&out));
}

/// KiB in the repository's object store (loose and packed), by `git count-objects -v`.
fn object_store_kib(repo: &std::path::Path) -> u64 {
    git(repo, &["count-objects", "-v"])
        .lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| *k == "size" || *k == "size-pack")
        .map(|(_, v)| v.trim().parse::<u64>().unwrap())
        .sum()
}

#[test]
fn a_large_untracked_file_never_enters_the_users_object_store() {
    let gw = Gateway::start(EDIT);
    let repo = TempGitRepo::new(&[("notes.txt", "draft\n")]);
    // 20 MiB that do not compress.
    let mut big = vec![0u8; 20 << 20];
    blake3::Hasher::new()
        .update(b"big")
        .finalize_xof()
        .fill(&mut big);
    std::fs::create_dir_all(repo.path().join("assets")).unwrap();
    std::fs::write(repo.path().join("assets/big.bin"), &big).unwrap();
    let before = object_store_kib(repo.path());

    let id = new_session(&gw, repo.path());

    let grown = object_store_kib(repo.path()) - before;
    assert!(
        grown < 1024,
        "the user's object store grew by {grown} KiB after a session and its checkpoint"
    );
    // The worktree has the file…
    let detail = gw.json(&["session", "show", "--json", &id]);
    let worktree =
        std::path::PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());
    assert_eq!(std::fs::read(worktree.join("assets/big.bin")).unwrap(), big);
    // …and so does the turn's checkpoint, in the gateway's artifact store.
    let list = gw.json(&["session", "checkpoints", &id, "--json"]);
    let cp = &list["checkpoints"][0];
    assert_eq!(cp["mode"], "git");
    let tree = git(
        repo.path(),
        &[
            "ls-tree",
            "-r",
            "--name-only",
            cp["commit"].as_str().unwrap(),
        ],
    );
    assert!(!tree.contains("big.bin"), "{tree}");
    let artifacts = gw.state_dir.join("artifacts");
    let manifest: skiff_protocol::sync::Manifest = serde_json::from_slice(
        &std::fs::read(artifacts.join(cp["manifest"].as_str().expect("a manifest"))).unwrap(),
    )
    .unwrap();
    let Some(skiff_protocol::sync::ManifestEntry::File { blake3, size, .. }) =
        manifest.entries.get("assets/big.bin")
    else {
        panic!("{manifest:?}");
    };
    assert_eq!(*size, 20 << 20);
    assert_eq!(std::fs::read(artifacts.join(blake3)).unwrap(), big);
}

#[test]
fn a_gateway_killed_while_a_worktree_is_filled_writes_it_whole_at_restart() {
    // Enough files that writing the worktree takes a moment after `session new` returns.
    let contents: Vec<(String, String)> = (0..3000)
        .map(|i| {
            (
                format!("src/d{}/f{i}.txt", i % 40),
                format!("file {i}\n").repeat(50),
            )
        })
        .collect();
    let files: Vec<(&str, &str)> = contents
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    let repo = TempGitRepo::new(&files);
    // The user's uncommitted state: an edit, a deletion, a new file.
    std::fs::write(repo.path().join("src/d1/f1.txt"), "edited\n").unwrap();
    std::fs::remove_file(repo.path().join("src/d2/f2.txt")).unwrap();
    std::fs::write(repo.path().join("new.txt"), "new\n").unwrap();
    let mut gw = Gateway::start("[[turns]]\ntext = \"Done.\"\n");
    let out = gw.run(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "work",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = created["session"]["id"].as_str().unwrap().to_owned();
    // Killed at once, most likely while the worktree's files are being written.
    gw.crash_and_restart();

    let detail = gw.json(&["session", "show", &id, "--json"]);
    let worktree =
        std::path::PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());
    assert_eq!(
        git(&worktree, &["status", "--porcelain"]),
        " M src/d1/f1.txt\n D src/d2/f2.txt\n?? new.txt\n"
    );
    for (path, content) in &contents {
        if path == "src/d1/f1.txt" || path == "src/d2/f2.txt" {
            continue;
        }
        assert_eq!(
            &std::fs::read_to_string(worktree.join(path)).unwrap(),
            content,
            "{path}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(worktree.join("src/d1/f1.txt")).unwrap(),
        "edited\n"
    );
    // The session's changes against its base commit are the user's uncommitted ones.
    let diff = gw.json(&["session", "diff", &id, "--stat", "--json"]);
    let changed: Vec<(&str, &str)> = diff["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["status"].as_str().unwrap(), f["path"].as_str().unwrap()))
        .collect();
    assert_eq!(
        changed,
        [
            ("added", "new.txt"),
            ("modified", "src/d1/f1.txt"),
            ("deleted", "src/d2/f2.txt")
        ],
        "{diff:#}"
    );
    let filling = gw.state_dir.join("filling");
    let left: Vec<_> = std::fs::read_dir(&filling)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "fill records left: {left:?}");
}

/// `session new --repo URL --ref REF`: the gateway clones the remote, the session works on
/// `skiff/<id>` from REF, and `session publish` pushes the branch back to that URL.
#[test]
fn a_session_from_a_repo_url_starts_at_its_ref_and_publishes_back_to_it() {
    let gw = Gateway::start(EDIT);
    let remotes = tempfile::tempdir().unwrap();
    let bare = skiff_test_support::git_http::bare_repo(
        remotes.path(),
        "upstream",
        &[("notes.txt", "draft\n")],
    );
    let main = git(&bare, &["rev-parse", "main"]).trim().to_owned();
    git(&bare, &["branch", "release", "main"]);
    let url = format!("file://{}", bare.display());
    let out = gw.run(&[
        "session", "new", "--repo", &url, "--ref", "release", "--model", "fake/x", "--json", "work",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let list = gw.json(&["session", "list", "--json"]);
    let id = list["sessions"][0]["id"].as_str().unwrap().to_owned();
    let detail = gw.json(&["session", "show", &id, "--json"]);
    let workspace = &detail["session"]["workspace"];
    assert_eq!(workspace["branch"], format!("skiff/{id}"));
    assert_eq!(workspace["base_commit"], main.as_str());
    let worktree = std::path::PathBuf::from(workspace["path"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(worktree.join("notes.txt")).unwrap(),
        "final\n",
        "the turn worked in the clone's worktree"
    );

    let published = gw.json(&["session", "publish", &id, "--json"]);
    assert_eq!(published["remote"], "origin");
    assert_eq!(
        git(&bare, &["rev-parse", &format!("refs/heads/skiff/{id}")]).trim(),
        published["commit"].as_str().unwrap()
    );

    // A ref the remote lacks: refused, naming what exists, nothing made.
    let out = gw.run(&[
        "session", "new", "--repo", &url, "--ref", "nope", "--model", "fake/x", "work",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("has no ref \"nope\""), "{err}");
    assert!(err.contains("branches: main, release"), "{err}");
    let list = gw.json(&["session", "list", "--json"]);
    assert_eq!(list["sessions"].as_array().unwrap().len(), 1);
    // --ref means nothing without --repo.
    let out = gw.run(&["session", "new", "--ref", "main", "work"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
