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

    let cp = checkpoint::git_checkpoint(
        &ws.worktree,
        &ws.session,
        1,
        &Rules::builtin(),
        &Limits::default(),
        ws.scratch.path(),
        &cancel(),
    )
    .await
    .unwrap();
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
