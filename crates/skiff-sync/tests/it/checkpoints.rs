//! Checkpoints of a workspace that leave it exactly as it was.

use crate::fixture::{Workspace, cancel, git, snapshot};
use skiff_sync::cas::Cas;
use skiff_sync::checkpoint;
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::{Rules, manifest};

#[tokio::test]
async fn a_git_checkpoint_captures_everything_and_touches_nothing() {
    let ws = Workspace::git(&[("a.txt", "one\n"), ("gone.txt", "bye\n")]);
    ws.write("a.txt", "two\n");
    ws.write("untracked.txt", "new\n");
    ws.write("target/skip.bin", "excluded\n");
    std::fs::remove_file(ws.worktree.join("gone.txt")).unwrap();
    git(&ws.worktree, &["add", "a.txt"]); // something staged, too
    let index = std::fs::read(ws.repo.path().join(".git/worktrees/worktree/index")).unwrap();
    let status = git(&ws.worktree, &["status", "--porcelain"]);
    let (head, files) = (ws.head(), snapshot(&ws.worktree));

    let store = tempfile::tempdir().unwrap();
    let cas = Cas::open(&store.path().join("artifacts")).unwrap();
    let stores = checkpoint::GitStores {
        scratch: ws.scratch.path(),
        cas: &cas,
        large: checkpoint::LargeFiles::default(),
    };
    let cp = checkpoint::git_checkpoint(
        &ws.worktree,
        &ws.session,
        1,
        &Rules::builtin(),
        &Limits::default(),
        &stores,
        &cancel(),
    )
    .await
    .unwrap();
    assert_eq!(cp.outside_git, None, "nothing large");
    assert_eq!(
        cp.git_ref,
        format!("refs/skiff/checkpoints/{}/1", ws.session)
    );
    assert_eq!(
        git(&ws.worktree, &["rev-parse", &cp.git_ref]).trim(),
        cp.commit
    );
    assert_eq!(
        git(&ws.worktree, &["rev-parse", &format!("{}^", cp.commit)]).trim(),
        head
    );
    let tree = git(&ws.worktree, &["ls-tree", "-r", "--name-only", &cp.commit]);
    assert_eq!(tree.lines().collect::<Vec<_>>(), ["a.txt", "untracked.txt"]);
    assert_eq!(
        git(&ws.worktree, &["show", &format!("{}:a.txt", cp.commit)]),
        "two\n"
    );

    assert_eq!(ws.head(), head);
    assert_eq!(git(&ws.worktree, &["status", "--porcelain"]), status);
    assert_eq!(
        std::fs::read(ws.repo.path().join(".git/worktrees/worktree/index")).unwrap(),
        index
    );
    assert_eq!(snapshot(&ws.worktree), files);
}

#[tokio::test]
async fn a_plain_checkpoint_restores_byte_for_byte() {
    let dir = crate::plain_mode::plain_dir();
    std::os::unix::fs::symlink("README", dir.path().join("link")).unwrap();
    let store = tempfile::tempdir().unwrap();
    let cas = Cas::open(&store.path().join("artifacts")).unwrap();
    let rules = Rules::builtin();
    let cp = checkpoint::plain_checkpoint(dir.path(), &rules, &Limits::default(), &cas, &cancel())
        .await
        .unwrap();
    assert_eq!(cp.files, 6);
    let restored = tempfile::tempdir().unwrap();
    let target = restored.path().join("ws");
    let m = checkpoint::restore_plain(&cas, &cp.manifest, &target).unwrap();
    let original = manifest::scan(
        dir.path(),
        Mode::Plain,
        &rules,
        &Limits::default(),
        &cancel(),
    )
    .await
    .unwrap();
    assert_eq!(m, original);
    let back = manifest::scan(&target, Mode::Plain, &rules, &Limits::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(back, original);
    // Restoring never writes over something.
    assert!(checkpoint::restore_plain(&cas, &cp.manifest, &target).is_err());
}

/// Bytes that do not compress (a loose object of them is as large as they are).
fn noise(len: usize, seed: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut reader = blake3::Hasher::new().update(&[seed]).finalize_xof();
    out.resize(len, 0);
    reader.fill(&mut out);
    out
}

/// Whether `repo`'s object store holds the blob `bytes` would hash to.
fn has_blob(repo: &std::path::Path, bytes: &[u8]) -> bool {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), bytes).unwrap();
    let oid = git(repo, &["hash-object", file.path().to_str().unwrap()]);
    std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["cat-file", "-e", oid.trim()])
        .status()
        .unwrap()
        .success()
}

#[tokio::test]
async fn large_untracked_files_stay_out_of_the_repository_and_come_back_on_restore() {
    use std::os::unix::fs::PermissionsExt;
    let ws = Workspace::git(&[("a.txt", "one\n")]);
    ws.write("a.txt", "two\n");
    let big = noise(50_000, 1);
    std::fs::create_dir_all(ws.worktree.join("data")).unwrap();
    std::fs::write(ws.worktree.join("data/big.bin"), &big).unwrap();
    std::fs::set_permissions(
        ws.worktree.join("data/big.bin"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let store = tempfile::tempdir().unwrap();
    let cas = Cas::open(&store.path().join("artifacts")).unwrap();
    let stores = checkpoint::GitStores {
        scratch: ws.scratch.path(),
        cas: &cas,
        large: checkpoint::LargeFiles {
            threshold: 10_000,
            cap: 60_000,
        },
    };
    let cp = checkpoint::git_checkpoint(
        &ws.worktree,
        &ws.session,
        1,
        &Rules::builtin(),
        &Limits::default(),
        &stores,
        &cancel(),
    )
    .await
    .unwrap();
    assert!(
        !has_blob(ws.repo.path(), &big),
        "the large file became a git object"
    );
    assert!(
        has_blob(ws.repo.path(), b"two\n"),
        "small changes are committed"
    );
    let tree = git(&ws.worktree, &["ls-tree", "-r", "--name-only", &cp.commit]);
    assert_eq!(tree.lines().collect::<Vec<_>>(), ["a.txt"]);
    assert_eq!(cp.files, 2, "the checkpoint still counts it");

    // The checkpoint names it, and restoring the checkpoint brings it back, mode and all.
    let kept = cp
        .outside_git
        .clone()
        .expect("a manifest of the large files");
    let m = manifest::from_json(&String::from_utf8(cas.get(&kept).unwrap()).unwrap()).unwrap();
    assert_eq!(m.entries.keys().collect::<Vec<_>>(), ["data/big.bin"]);
    let restored = tempfile::tempdir().unwrap();
    let target = restored.path().join("ws");
    checkpoint::restore_git(
        &ws.worktree,
        &cp.commit,
        Some(&kept),
        &stores,
        &target,
        &cancel(),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(target.join("data/big.bin")).unwrap(), big);
    let mode = std::fs::metadata(target.join("data/big.bin"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
    assert_eq!(
        std::fs::read_to_string(target.join("a.txt")).unwrap(),
        "two\n"
    );

    // Past the cap, the checkpoint is refused, naming the file and the cap; no ref is made.
    std::fs::write(ws.worktree.join("data/more.bin"), noise(20_000, 2)).unwrap();
    let err = checkpoint::git_checkpoint(
        &ws.worktree,
        &ws.session,
        2,
        &Rules::builtin(),
        &Limits::default(),
        &stores,
        &cancel(),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "cannot checkpoint {} (19.5 KiB)",
            ws.worktree.join("data/more.bin").display()
        )) && msg.contains("cap of 58.6 KiB")
            && msg.contains(".skiffignore"),
        "{msg}"
    );
    let refs = git(&ws.worktree, &["for-each-ref", "refs/skiff/checkpoints"]);
    assert_eq!(refs.lines().count(), 1, "{refs}");
}

/// A checkpoint of an unchanged workspace reuses the previous tree; any change (here one with
/// the same size) makes a new one.
#[tokio::test]
async fn an_unchanged_workspace_reuses_the_previous_tree() {
    let ws = Workspace::git(&[("a.txt", "one\n")]);
    ws.write("new.txt", "untracked\n");
    let store = tempfile::tempdir().unwrap();
    let cas = Cas::open(&store.path().join("artifacts")).unwrap();
    let stores = checkpoint::GitStores {
        scratch: ws.scratch.path(),
        cas: &cas,
        large: checkpoint::LargeFiles::default(),
    };
    let take =
        |seq: u64, previous: Option<checkpoint::Previous>, known: Option<checkpoint::Known>| {
            let (ws, stores) = (&ws, &stores);
            async move {
                checkpoint::git_checkpoint_after(
                    &ws.worktree,
                    &ws.session,
                    seq,
                    &Rules::builtin(),
                    &Limits::default(),
                    stores,
                    previous.as_ref(),
                    known.as_ref(),
                    &cancel(),
                )
                .await
                .unwrap()
            }
        };
    let previous = |cp: &checkpoint::GitCheckpoint| {
        Some(checkpoint::Previous {
            state: cp.state.clone(),
            commit: cp.commit.clone(),
            tree: cp.tree.clone(),
            outside_git: cp.outside_git.clone(),
        })
    };
    let first = take(1, None, None).await;
    assert!(!first.reused);
    let second = take(2, previous(&first), None).await;
    assert!(second.reused);
    assert_eq!(
        (&second.commit, &second.tree, &second.state),
        (&first.commit, &first.tree, &first.state)
    );
    assert_eq!(
        git(&ws.worktree, &["rev-parse", &second.git_ref]).trim(),
        second.commit
    );
    // What a reconciliation found the worktree to hold decides too, without a listing.
    let scanned = manifest::scan(
        &ws.worktree,
        Mode::Git,
        &Rules::builtin(),
        &Limits::default(),
        &cancel(),
    )
    .await
    .unwrap();
    let known = |m: skiff_sync::Manifest| {
        Some(checkpoint::Known {
            head: ws.head(),
            manifest: m,
        })
    };
    let third = take(3, previous(&second), known(scanned.clone())).await;
    assert!(third.reused);
    assert_eq!((third.files, third.bytes), (first.files, first.bytes));
    let mut other = scanned.clone();
    other.entries.remove("new.txt");
    // A known state that is not the previous one's: the checkpoint lists for itself (and
    // finds nothing changed).
    let fourth = take(4, previous(&third), known(other)).await;
    assert_eq!(fourth.tree, first.tree);

    // A previous checkpoint whose commit is gone is not reused: the checkpoint is made anew.
    let gone = previous(&fourth).map(|p| checkpoint::Previous {
        commit: "0123456789012345678901234567890123456789".into(),
        ..p
    });
    let anew = take(6, gone, None).await;
    assert!(!anew.reused);
    assert_eq!(anew.tree, fourth.tree);

    ws.write("new.txt", "untrackeD\n");
    let fifth = take(5, previous(&fourth), None).await;
    assert!(!fifth.reused);
    assert_ne!(fifth.tree, fourth.tree);
    assert_eq!(
        git(
            &ws.worktree,
            &["show", &format!("{}:new.txt", fifth.commit)]
        ),
        "untrackeD\n"
    );
}

/// A restore in place writes through no symlink: a directory of the checkpoint that is a
/// symlink out of the workspace now is replaced by the directory, and what it pointed at is
/// left alone. Files the rules leave out stay; a checkpoint that cannot be rebuilt changes
/// nothing.
#[tokio::test]
async fn a_plain_rewind_never_writes_through_a_symlink() {
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("ws");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/c.txt"), "checkpointed\n").unwrap();
    std::fs::write(root.join("a.txt"), "one\n").unwrap();
    let store = tempfile::tempdir().unwrap();
    let cas = Cas::open(&store.path().join("artifacts")).unwrap();
    let cp = checkpoint::plain_checkpoint(
        &root,
        &Rules::builtin(),
        &Limits::default(),
        &cas,
        &cancel(),
    )
    .await
    .unwrap();

    let outside = ws.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("c.txt"), "not yours\n").unwrap();
    std::fs::remove_dir_all(root.join("sub")).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("sub")).unwrap();
    std::fs::write(root.join("a.txt"), "two\n").unwrap();
    std::fs::write(root.join("later.txt"), "later\n").unwrap();
    std::fs::create_dir_all(root.join("node_modules/x")).unwrap();
    std::fs::write(root.join("package.json"), "{}\n").unwrap();
    std::fs::write(root.join("node_modules/x/i.js"), "ignored\n").unwrap();
    let scratch = tempfile::tempdir().unwrap();

    // A manifest that is not in the store: refused before anything is written.
    let before = snapshot(&root);
    assert!(
        skiff_sync::rewind::rewind_plain(&root, &cas, &"0".repeat(64), scratch.path(), &cancel())
            .await
            .is_err()
    );
    assert_eq!(snapshot(&root), before);

    let done =
        skiff_sync::rewind::rewind_plain(&root, &cas, &cp.manifest, scratch.path(), &cancel())
            .await
            .unwrap();
    assert_eq!(done.deleted, ["later.txt", "package.json", "sub"]);
    assert_eq!(
        std::fs::read_to_string(outside.join("c.txt")).unwrap(),
        "not yours\n"
    );
    let sub = std::fs::symlink_metadata(root.join("sub")).unwrap();
    assert!(sub.is_dir() && !sub.file_type().is_symlink());
    assert_eq!(
        std::fs::read_to_string(root.join("sub/c.txt")).unwrap(),
        "checkpointed\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("a.txt")).unwrap(),
        "one\n"
    );
    assert!(!root.join("later.txt").exists());
    // Left out by the rules, so not the checkpoint's business.
    assert_eq!(
        std::fs::read_to_string(root.join("node_modules/x/i.js")).unwrap(),
        "ignored\n"
    );
}
