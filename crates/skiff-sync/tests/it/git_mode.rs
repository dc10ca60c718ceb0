//! Git mode: outbound to a real repository on the box, adoption back, and everything that
//! must stop it.

use crate::fixture::{TestBox, Workspace, cancel, git, snapshot, status_lines};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::inbound_git::{self, Adoption};
use skiff_sync::outbound::{self, Dispatched, Outbound};
use skiff_sync::{Error, Method, Rules};

const DIR: &str = "workspace/repo";

fn files() -> Vec<(&'static str, &'static str)> {
    vec![
        // A Rust crate: `target/` beside it is build output.
        ("Cargo.toml", "[package]\nname = \"x\"\n"),
        ("a.txt", "alpha\n"),
        ("src/lib.rs", "pub fn f() {}\n"),
        ("del.txt", "to be deleted\n"),
        (".gitignore", "*.log\n"),
    ]
}

/// The user's uncommitted work, carried into the managed worktree.
fn dirty(ws: &Workspace) {
    ws.write("a.txt", "alpha, edited\n");
    std::fs::remove_file(ws.worktree.join("del.txt")).unwrap();
    ws.write("new.txt", "untracked\n");
    ws.write("debug.log", "ignored by .gitignore\n");
    ws.write("target/out.bin", "built-in exclude\n");
    ws.write("target/keep.txt", "re-included\n");
    ws.write("secret.txt", "excluded by .skiffignore\n");
    ws.write(".skiffignore", "secret.txt\n!target/keep.txt\n");
}

async fn dispatch(ws: &Workspace, tb: &TestBox) -> Dispatched {
    let rules = Rules::load(&ws.worktree).unwrap();
    let out = Outbound {
        local: &ws.worktree,
        mode: Mode::Git,
        session: &ws.session,
        rules: &rules,
        limits: &Limits::default(),
        scratch: ws.scratch.path(),
        identity: Some(("Box Agent", "agent@skiff.invalid")),
        history: Default::default(),
    };
    outbound::push(&out, &tb.remote(DIR), &cancel())
        .await
        .unwrap()
}

async fn adopt(
    ws: &Workspace,
    tb: &TestBox,
    base: &skiff_sync::Manifest,
) -> skiff_sync::Result<inbound_git::Adopted> {
    let rules = Rules::load(&ws.worktree).unwrap();
    let remote = tb.remote(DIR);
    let commit = base.base_commit.clone().unwrap();
    let bundle = inbound_git::fetch_bundle(
        &remote,
        &ws.session,
        &commit,
        &Limits::default(),
        ws.scratch.path(),
        &cancel(),
    )
    .await?;
    let theirs = tb.manifest(DIR, Mode::Git).await;
    let a = Adoption {
        worktree: &ws.worktree,
        session: &ws.session,
        base,
        expected_head: &commit,
        rules: &rules,
        limits: &Limits::default(),
        scratch: ws.scratch.path(),
    };
    inbound_git::adopt(
        &a,
        bundle.as_ref().map(|b| b.path()),
        &theirs,
        &remote,
        &cancel(),
    )
    .await
}

#[tokio::test]
async fn outbound_lays_a_real_repository_with_the_users_changes() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    dirty(&ws);
    let sent = dispatch(&ws, &tb).await;
    assert_eq!(sent.method, Method::Rsync);
    assert_eq!(
        sent.manifest.base_commit.as_deref(),
        Some(ws.head().as_str())
    );
    let keys: Vec<&str> = sent.manifest.entries.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            ".gitignore",
            ".skiffignore",
            "Cargo.toml",
            "a.txt",
            "new.txt",
            "src/lib.rs",
            "target/keep.txt"
        ]
    );

    let on_box = tb
        .sh(&format!(
            "cd {DIR} && git status --porcelain --untracked-files=all"
        ))
        .await;
    assert_eq!(
        status_lines(&on_box),
        [
            " D del.txt",
            " M a.txt",
            "?? .skiffignore",
            "?? new.txt",
            "?? target/keep.txt"
        ]
    );
    // Exactly the local status, minus what sync excludes.
    let local = git(
        &ws.worktree,
        &["status", "--porcelain", "--untracked-files=all"],
    );
    let expected: Vec<String> = status_lines(&local)
        .into_iter()
        .filter(|l| !l.ends_with("secret.txt") && !l.ends_with("target/out.bin"))
        .collect();
    assert_eq!(status_lines(&on_box), expected);
    let box_head = tb
        .sh(&format!(
            "cd {DIR} && git rev-parse HEAD && git branch --show-current && git remote"
        ))
        .await;
    assert_eq!(box_head, format!("{}\nskiff/{}\n", ws.head(), ws.session));
    assert!(!tb.path(DIR).join("secret.txt").exists());
    assert!(!tb.path(DIR).join("target/out.bin").exists());
    // Only the base commit by default: a shallow repository holding one pack, and nothing of
    // the transfer left outside it.
    assert_eq!(
        tb.sh(&format!(
            "cd {DIR} && git rev-parse --is-shallow-repository && git rev-list --count HEAD && ls .git/objects/pack | grep -c '[.]pack$'"
        ))
        .await,
        "true\n1\n1\n"
    );
    assert!(
        !tb.path(".skiff/sync").exists(),
        "transfer files were left behind"
    );

    // A second dispatch into the same, now non-empty, directory is refused.
    let rules = Rules::builtin();
    let again = Outbound {
        local: &ws.worktree,
        mode: Mode::Git,
        session: &ws.session,
        rules: &rules,
        limits: &Limits::default(),
        scratch: ws.scratch.path(),
        identity: None,
        history: Default::default(),
    };
    let err = outbound::push(&again, &tb.remote(DIR), &cancel())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RemoteNotEmpty { .. }), "{err}");
}

/// `history = "full"` sends every commit of the session branch; either way the box checks out
/// the base commit and lays exactly the files that differ from it over it, so its working tree
/// is the workspace's, byte for byte.
#[tokio::test]
async fn full_history_on_request_and_the_same_files_either_way() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    ws.write("src/lib.rs", "pub fn g() {}\n");
    git(&ws.worktree, &["commit", "-q", "-am", "second"]);
    dirty(&ws);
    std::fs::set_permissions(
        ws.worktree.join("Cargo.toml"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let rules = Rules::load(&ws.worktree).unwrap();
    for (history, dir, shallow, commits) in [
        (outbound::History::Full, "full", "false", "2"),
        (outbound::History::Shallow, "shallow", "true", "1"),
    ] {
        let out = Outbound {
            local: &ws.worktree,
            mode: Mode::Git,
            session: &ws.session,
            rules: &rules,
            limits: &Limits::default(),
            scratch: ws.scratch.path(),
            identity: None,
            history,
        };
        let sent = outbound::push(&out, &tb.remote(dir), &cancel())
            .await
            .unwrap();
        assert_eq!(
            tb.sh(&format!(
                "cd {dir} && git rev-parse --is-shallow-repository && git rev-list --count HEAD"
            ))
            .await,
            format!("{shallow}\n{commits}\n")
        );
        // What the box holds is what the base manifest says, modes included.
        for (path, entry) in &sent.manifest.entries {
            let there = skiff_sync::manifest::entry_of(&tb.path(dir), path).unwrap();
            assert_eq!(&there, entry, "{dir}/{path}");
        }
        assert!(!tb.path(dir).join("del.txt").exists());
    }
}

/// A checkout on the box knows nothing of the gateway's filters (an LFS-like smudge): when
/// attributes exist, every file travels, so the box still gets the bytes the workspace has.
#[tokio::test]
async fn files_a_checkout_would_convert_travel_as_they_are() {
    let tb = TestBox::new().await;
    let repo = skiff_test_support::TempGitRepo::new(&[
        (".gitattributes", "*.txt filter=up\n"),
        ("a.txt", "lower case\n"),
    ]);
    repo.git(&["config", "filter.up.smudge", "tr a-z A-Z"]);
    repo.git(&["config", "filter.up.clean", "tr A-Z a-z"]);
    let session = "ses_filtered";
    let scratch = tempfile::tempdir().unwrap();
    let worktree = scratch.path().join("wt");
    repo.git(&[
        "worktree",
        "add",
        "-q",
        "-b",
        &format!("skiff/{session}"),
        worktree.to_str().unwrap(),
        "HEAD",
    ]);
    assert_eq!(
        std::fs::read_to_string(worktree.join("a.txt")).unwrap(),
        "LOWER CASE\n"
    );
    let rules = Rules::load(&worktree).unwrap();
    let out = Outbound {
        local: &worktree,
        mode: Mode::Git,
        session,
        rules: &rules,
        limits: &Limits::default(),
        scratch: scratch.path(),
        identity: None,
        history: Default::default(),
    };
    outbound::push(&out, &tb.remote(DIR), &cancel())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(tb.path(DIR).join("a.txt")).unwrap(),
        "LOWER CASE\n"
    );
}

#[tokio::test]
async fn limits_are_checked_before_anything_moves_and_name_the_largest() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&[("small.txt", "s\n")]);
    ws.write("big/one.bin", &"x".repeat(300_000));
    ws.write("big/two.bin", &"y".repeat(200_000));
    ws.write("medium.bin", &"z".repeat(50_000));
    let rules = Rules::builtin();
    for (limits, says) in [
        (
            Limits {
                max_file_bytes: 100_000,
                ..Limits::default()
            },
            "big/one.bin is 293.0 KiB, over the per-file limit of 97.7 KiB",
        ),
        (
            Limits {
                max_total_bytes: 400_000,
                ..Limits::default()
            },
            "in all, over the limit",
        ),
        (
            Limits {
                max_files: 2,
                ..Limits::default()
            },
            "4 files, over the limit of 2",
        ),
    ] {
        let out = Outbound {
            local: &ws.worktree,
            mode: Mode::Git,
            session: &ws.session,
            rules: &rules,
            limits: &limits,
            scratch: ws.scratch.path(),
            identity: None,
            history: Default::default(),
        };
        let err = outbound::push(&out, &tb.remote(DIR), &cancel())
            .await
            .unwrap_err();
        let msg = err.to_string();
        if limits.max_file_bytes == 100_000 {
            assert!(matches!(err, Error::FileTooLarge { .. }), "{msg}");
        } else {
            assert!(matches!(err, Error::TooLarge { .. }), "{msg}");
        }
        assert!(msg.contains(says), "{msg}");
        if limits.max_files == 2 {
            assert!(msg.contains("big (2 files)"), "{msg}");
        } else if limits.max_file_bytes == 100_000 {
            assert!(
                msg.contains("also over the limit: big/two.bin (195.3 KiB)"),
                "{msg}"
            );
        } else {
            assert!(msg.contains("big/one.bin (293.0 KiB)"), "{msg}");
            assert!(msg.find("big/one.bin") < msg.find("big/two.bin"), "{msg}");
        }
    }
    assert!(!tb.path(DIR).exists(), "something reached the box");
    // The base commit the box laid down meanwhile, in a staging directory, is gone too.
    assert_eq!(
        std::fs::read_dir(tb.path("workspace")).map_or(0, |d| d.count()),
        0,
        "a staging directory stayed on the box"
    );
}

#[tokio::test]
async fn adoption_fast_forwards_and_brings_back_uncommitted_work() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    dirty(&ws);
    let sent = dispatch(&ws, &tb).await;

    // The agent on the box: commits the user's carried edit and one of its own, leaves more
    // uncommitted, deletes an untracked file, adds one.
    tb.sh(&format!(
        "cd {DIR} && echo 'box edit' >> src/lib.rs && git add -A a.txt src/lib.rs del.txt \
         && git commit -q -m 'box: work' && echo 'uncommitted' > a.txt && rm new.txt \
         && mkdir -p docs && echo doc > docs/box.md && ln -s ../a.txt docs/link"
    ))
    .await;
    let box_tip = tb.sh(&format!("cd {DIR} && git rev-parse HEAD")).await;

    let adopted = adopt(&ws, &tb, &sent.manifest).await.unwrap();
    assert!(adopted.fast_forwarded);
    assert_eq!(adopted.head, box_tip.trim());
    assert_eq!(ws.head(), box_tip.trim());
    assert_eq!(
        git(&ws.worktree, &["log", "-1", "--format=%s %an"]).trim(),
        "box: work Box Agent"
    );
    let box_status = tb
        .sh(&format!(
            "cd {DIR} && git status --porcelain --untracked-files=all"
        ))
        .await;
    let here = git(
        &ws.worktree,
        &["status", "--porcelain", "--untracked-files=all"],
    );
    let here: Vec<String> = status_lines(&here)
        .into_iter()
        .filter(|l| !l.ends_with("secret.txt") && !l.ends_with("target/out.bin"))
        .collect();
    assert_eq!(here, status_lines(&box_status));
    assert_eq!(
        std::fs::read_to_string(ws.worktree.join("a.txt")).unwrap(),
        "uncommitted\n"
    );
    assert!(!ws.worktree.join("new.txt").exists());
    assert_eq!(
        std::fs::read_link(ws.worktree.join("docs/link"))
            .unwrap()
            .to_str(),
        Some("../a.txt")
    );
    // What sync never saw is still here.
    assert!(ws.worktree.join("secret.txt").exists());
    assert!(ws.worktree.join("target/out.bin").exists());
    assert!(ws.worktree.join("debug.log").exists());
}

#[tokio::test]
async fn divergence_is_refused_with_both_sides_intact() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    let sent = dispatch(&ws, &tb).await;
    tb.sh(&format!(
        "cd {DIR} && echo more >> a.txt && git commit -qam 'box: more'"
    ))
    .await;
    let box_before = tb
        .sh(&format!(
            "cd {DIR} && git rev-parse HEAD && git status --porcelain"
        ))
        .await;

    // The managed branch moved on the gateway while the box held the session.
    git(
        &ws.worktree,
        &[
            "-c",
            "user.name=x",
            "-c",
            "user.email=x@x",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "local",
        ],
    );
    let local_head = ws.head();
    let local_before = snapshot(&ws.worktree);
    let err = adopt(&ws, &tb, &sent.manifest).await.unwrap_err();
    assert!(matches!(err, Error::Diverged { .. }), "{err}");
    assert!(err.to_string().contains("moved"), "{err}");
    assert_eq!(ws.head(), local_head);
    assert_eq!(snapshot(&ws.worktree), local_before);
    assert_eq!(
        tb.sh(&format!(
            "cd {DIR} && git rev-parse HEAD && git status --porcelain"
        ))
        .await,
        box_before
    );

    // The box rewrote history below the base: its tip does not descend from it.
    git(
        &ws.worktree,
        &[
            "reset",
            "-q",
            "--hard",
            sent.manifest.base_commit.as_deref().unwrap(),
        ],
    );
    tb.sh(&format!(
        "cd {DIR} && git checkout -q --orphan tmp && git commit -qm rewritten && \
         git branch -f skiff/{0} tmp && git checkout -q skiff/{0} && git branch -D tmp -q",
        ws.session
    ))
    .await;
    let local_before = snapshot(&ws.worktree);
    let err = adopt(&ws, &tb, &sent.manifest).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Diverged { .. })
            && (msg.contains("does not descend") || msg.contains("does not verify")),
        "{msg}"
    );
    assert_eq!(snapshot(&ws.worktree), local_before);
    assert_eq!(ws.head(), sent.manifest.base_commit.clone().unwrap());
}

#[tokio::test]
async fn a_bundle_with_any_other_ref_is_refused() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    let sent = dispatch(&ws, &tb).await;
    let base = sent.manifest.base_commit.clone().unwrap();
    tb.sh(&format!(
        "cd {DIR} && echo x >> a.txt && git commit -qam box && git branch evil && git tag v1"
    ))
    .await;
    let remote = tb.remote(DIR);
    for extra in ["refs/heads/evil", "refs/tags/v1"] {
        let path = ws.scratch.path().join("foreign.bundle");
        remote
            .fetch_output(
                &format!(
                    "cd {DIR} && git bundle create -q - {base}..skiff/{} {extra}",
                    ws.session
                ),
                &path,
                1 << 20,
                &cancel(),
            )
            .await
            .unwrap();
        let err = inbound_git::verify_bundle(&ws.worktree, &path, &ws.session, &cancel())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::ForeignRef { .. }), "{err}");
        assert!(err.to_string().contains(extra), "{err}");
        // Through adoption too: nothing moves.
        let rules = Rules::builtin();
        let before = snapshot(&ws.worktree);
        let theirs = tb.manifest(DIR, Mode::Git).await;
        let a = Adoption {
            worktree: &ws.worktree,
            session: &ws.session,
            base: &sent.manifest,
            expected_head: &base,
            rules: &rules,
            limits: &Limits::default(),
            scratch: ws.scratch.path(),
        };
        let err = inbound_git::adopt(&a, Some(&path), &theirs, &remote, &cancel())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::ForeignRef { .. }), "{err}");
        assert_eq!(snapshot(&ws.worktree), before);
        assert_eq!(ws.head(), base);
    }
    // A bundle larger than the limits is refused while it arrives.
    let tiny = Limits {
        max_total_bytes: 100,
        ..Limits::default()
    };
    let err = inbound_git::fetch_bundle(
        &remote,
        &ws.session,
        &base,
        &tiny,
        ws.scratch.path(),
        &cancel(),
    )
    .await
    .err()
    .unwrap();
    assert!(err.to_string().contains("more than 100 bytes"), "{err}");
    // A bundle of some other branch alone is refused as well.
    let path = ws.scratch.path().join("other.bundle");
    remote
        .fetch_output(
            &format!("cd {DIR} && git bundle create -q - {base}..evil"),
            &path,
            1 << 20,
            &cancel(),
        )
        .await
        .unwrap();
    let err = inbound_git::verify_bundle(&ws.worktree, &path, &ws.session, &cancel())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ForeignRef { .. }), "{err}");
}

#[tokio::test]
async fn a_commit_with_an_escaping_symlink_is_refused_even_when_the_files_hide_it() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    let sent = dispatch(&ws, &tb).await;
    let head_before = ws.head();

    // The box commits a symlink out of the workspace, then removes it from its working tree,
    // so its file manifest looks clean: only the commit carries it.
    tb.sh(&format!(
        "cd {DIR} && ln -s /etc/passwd leak && git add leak && git commit -q -m 'box: leak' \
         && rm leak"
    ))
    .await;

    let adopted = adopt(&ws, &tb, &sent.manifest).await.unwrap();
    assert_eq!(adopted.refused.len(), 1, "{:?}", adopted.refused);
    let why = &adopted.refused[0];
    assert_eq!(why.path, "(commits)");
    assert!(
        why.reason.contains("leak") && why.reason.contains("outside the workspace"),
        "{why:?}"
    );
    assert!(adopted.commits_refused.is_some());
    assert!(!adopted.fast_forwarded);
    assert_eq!(ws.head(), head_before, "the branch moved");
    assert!(!ws.worktree.join("leak").exists());
}

#[tokio::test]
async fn a_committed_symlink_out_of_the_workspace_is_data_and_never_strands_the_work() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&files());
    // The repository itself commits symlinks that point outside (a real pattern:
    // `licenses -> /usr/share/common-licenses`).
    std::os::unix::fs::symlink("/usr/share/common-licenses", ws.worktree.join("licenses")).unwrap();
    std::os::unix::fs::symlink("../outside", ws.worktree.join("up")).unwrap();
    git(&ws.worktree, &["add", "licenses", "up"]);
    git(
        &ws.worktree,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            "links",
        ],
    );
    let sent = dispatch(&ws, &tb).await;

    // The box works as usual: a commit and an uncommitted file.
    tb.sh(&format!(
        "cd {DIR} && echo made > made.txt && git add made.txt && git commit -q -m 'box: made' \
         && echo loose > loose.txt"
    ))
    .await;
    let adopted = adopt(&ws, &tb, &sent.manifest).await.unwrap();
    assert!(adopted.fast_forwarded);
    assert_eq!(
        std::fs::read_to_string(ws.worktree.join("made.txt")).unwrap(),
        "made\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.worktree.join("loose.txt")).unwrap(),
        "loose\n"
    );
    // Still symlinks, never followed on either side.
    for (link, target) in [
        ("licenses", "/usr/share/common-licenses"),
        ("up", "../outside"),
    ] {
        assert_eq!(
            std::fs::read_link(ws.worktree.join(link)).unwrap(),
            std::path::Path::new(target)
        );
        assert_eq!(
            std::fs::read_link(tb.home.join(DIR).join(link)).unwrap(),
            std::path::Path::new(target)
        );
    }

    // A symlink the box changes to point elsewhere outside is still refused.
    let head = ws.head();
    let tb = TestBox::new().await;
    let sent = dispatch(&ws, &tb).await;
    tb.sh(&format!(
        "cd {DIR} && ln -sfn /etc licenses && git add licenses && git commit -q -m 'box: repoint'"
    ))
    .await;
    let adopted = adopt(&ws, &tb, &sent.manifest).await.unwrap();
    let mut refused: Vec<&str> = adopted.refused.iter().map(|r| r.path.as_str()).collect();
    refused.sort_unstable();
    assert_eq!(refused, ["(commits)", "licenses"], "{:?}", adopted.refused);
    assert!(
        adopted
            .refused
            .iter()
            .all(|r| r.reason.contains("outside the workspace"))
    );
    assert_eq!(ws.head(), head, "the branch moved");
    assert_eq!(
        std::fs::read_link(ws.worktree.join("licenses")).unwrap(),
        std::path::Path::new("/usr/share/common-licenses"),
        "the changed symlink was not written"
    );
}

/// The early word (what lets a placement start the worker while the box lays the workspace
/// down) comes with the base manifest the lay-down ends with, and the session's directory is
/// never seen half-made: it is empty (made by a waiting worker, and replaced by the rename) or
/// whole. A workspace with a top-level `AGENTS.md` (read before a turn's first model call) gets
/// no early word.
#[tokio::test]
async fn the_early_word_comes_before_a_directory_that_appears_whole() {
    let tb = TestBox::new().await;
    for agents in [false, true] {
        let ws = Workspace::git(&files());
        dirty(&ws);
        if agents {
            ws.write("AGENTS.md", "be brief\n");
        }
        let dir = if agents { "with-agents" } else { "plain-tree" };
        // A worker waiting for the workspace made its directory.
        tb.sh(&format!("mkdir -p {dir}")).await;
        let rules = Rules::load(&ws.worktree).unwrap();
        let out = Outbound {
            local: &ws.worktree,
            mode: Mode::Git,
            session: &ws.session,
            rules: &rules,
            limits: &Limits::default(),
            scratch: ws.scratch.path(),
            identity: None,
            history: Default::default(),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let remote = tb.remote(dir);
        let cancel = cancel();
        let pushing = outbound::push_after(
            &out,
            &remote,
            "true",
            std::future::ready(Ok(())),
            Some(tx.into()),
            &cancel,
        );
        let watching = async {
            let planned = rx.await.ok()?;
            // Seen at the early word: nothing, or everything.
            Some((planned, snapshot(&tb.path(dir))))
        };
        let (sent, early) = tokio::join!(pushing, watching);
        let sent = sent.unwrap();
        let whole = snapshot(&tb.path(dir));
        match early {
            Some((planned, seen)) => {
                assert!(!agents, "an AGENTS.md workspace got the early word");
                assert_eq!(planned.manifest, sent.manifest);
                assert_eq!((planned.files, planned.bytes), (sent.files, sent.bytes));
                assert!(seen.is_empty() || seen == whole, "seen half-made: {seen:?}");
            }
            None => assert!(agents, "no early word for a plain tree"),
        }
        // Whole: the user's edits, deletions and new files are there, and git agrees.
        assert_eq!(
            std::fs::read_to_string(tb.path(dir).join("a.txt")).unwrap(),
            "alpha, edited\n"
        );
        assert!(!tb.path(dir).join("del.txt").exists());
        assert!(tb.path(dir).join("new.txt").exists());
        assert!(!tb.path(&format!("{dir}.incoming")).exists());
        for (path, entry) in &sent.manifest.entries {
            let there = skiff_sync::manifest::entry_of(&tb.path(dir), path).unwrap();
            assert_eq!(&there, entry, "{dir}/{path}");
        }
    }
}
