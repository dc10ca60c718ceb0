//! A new worktree filled by copying the user's working tree ends exactly as a checkout of the
//! snapshot followed by `git reset` leaves it: the user's uncommitted changes as changes,
//! executable bits and symlinks as committed, and git trusting the copies without re-reading.

use skiff_sync::fill::{CopyFill, fill_by_copy};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

fn git(dir: &Path, args: &[&str]) -> String {
    git_env(dir, args, &[])
}

fn git_env(dir: &Path, args: &[&str], env: &[(&str, &Path)]) -> String {
    let mut cmd = Command::new("git");
    cmd.args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The user's repository with every kind of change, and the snapshot tree of its working state.
fn repo(dir: &Path) -> (std::path::PathBuf, String) {
    let repo = dir.join("repo");
    std::fs::create_dir(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    git(&repo, &["config", "user.name", "T"]);
    git(&repo, &["config", "user.email", "t@skiff.invalid"]);
    std::fs::create_dir_all(repo.join("dir/deep")).unwrap();
    for (path, text) in [
        ("a.txt", "alpha\n"),
        ("dir/b.txt", "beta\n"),
        ("dir/deep/c.txt", "gamma\n"),
        ("del.txt", "gone soon\n"),
        ("run.sh", "#!/bin/sh\necho hi\n"),
    ] {
        std::fs::write(repo.join(path), text).unwrap();
    }
    std::fs::set_permissions(repo.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("dir/b.txt", repo.join("link")).unwrap();
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "first"]);
    std::fs::write(repo.join("a.txt"), "alpha, edited\n").unwrap();
    std::fs::remove_file(repo.join("del.txt")).unwrap();
    std::fs::write(repo.join("new.txt"), "untracked\n").unwrap();
    let index = dir.join("snapshot.index");
    let env = [("GIT_INDEX_FILE", index.as_path())];
    git_env(&repo, &["read-tree", "HEAD"], &env);
    git_env(&repo, &["add", "-A"], &env);
    let tree = git_env(&repo, &["write-tree"], &env).trim().to_owned();
    (repo, tree)
}

#[tokio::test]
async fn a_copied_worktree_is_what_a_checkout_of_the_snapshot_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, tree) = repo(dir.path());
    // Settled long ago (every file copied), then not at all (every file written by git).
    for (name, since, copied) in [
        ("settled", SystemTime::now() + Duration::from_secs(60), 4),
        ("fresh", UNIX_EPOCH, 0),
    ] {
        let worktree = dir.path().join(name);
        git(
            &repo,
            &[
                "worktree",
                "add",
                "-q",
                "--no-checkout",
                "-b",
                name,
                worktree.to_str().unwrap(),
                "HEAD",
            ],
        );
        let fill = CopyFill {
            source: &repo,
            worktree: &worktree,
            tree: &tree,
            since,
        };
        let filled = fill_by_copy(&fill, &CancellationToken::new())
            .await
            .unwrap()
            .expect("a plain repository is filled by copy");
        assert_eq!(
            (filled.copied, filled.copied + filled.written),
            (copied, 6),
            "{name}"
        );
        assert_eq!(
            git(&worktree, &["status", "--porcelain"]),
            " M a.txt\n D del.txt\n?? new.txt\n",
            "{name}"
        );
        for path in ["a.txt", "dir/b.txt", "dir/deep/c.txt", "new.txt", "run.sh"] {
            assert_eq!(
                std::fs::read(worktree.join(path)).unwrap(),
                std::fs::read(repo.join(path)).unwrap(),
                "{name}: {path}"
            );
        }
        let mode = std::fs::metadata(worktree.join("run.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o100,
            0o100,
            "{name}: run.sh lost its executable bit"
        );
        assert_eq!(
            std::fs::read_link(worktree.join("link")).unwrap(),
            Path::new("dir/b.txt")
        );
        // The index git reads back holds the base commit, and the copies' stat data is
        // valid: nothing unchanged is listed as modified even without a refresh.
        assert_eq!(
            git(&worktree, &["ls-files", "-m"]),
            "a.txt\ndel.txt\n",
            "{name}"
        );
        assert_eq!(
            git(&worktree, &["diff-files", "--name-only"]),
            "a.txt\ndel.txt\n",
            "{name}"
        );
    }
}

/// Where a checkout could write other bytes than the user's files hold (here: an attributes
/// file), nothing is copied and the caller checks the snapshot out.
#[tokio::test]
async fn a_repository_with_attributes_is_not_filled_by_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, _) = repo(dir.path());
    std::fs::write(repo.join(".gitattributes"), "*.txt text eol=crlf\n").unwrap();
    git(&repo, &["add", ".gitattributes"]);
    git(&repo, &["commit", "-q", "-m", "attributes"]);
    let tree = git(&repo, &["rev-parse", "HEAD^{tree}"]).trim().to_owned();
    let worktree = dir.path().join("wt");
    git(
        &repo,
        &[
            "worktree",
            "add",
            "-q",
            "--no-checkout",
            "-b",
            "wt",
            worktree.to_str().unwrap(),
            "HEAD",
        ],
    );
    let fill = CopyFill {
        source: &repo,
        worktree: &worktree,
        tree: &tree,
        since: SystemTime::now() + Duration::from_secs(60),
    };
    let filled = fill_by_copy(&fill, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(filled, None);
    assert!(!worktree.join("a.txt").exists());
}

/// A directory the user swaps for a symlink after the snapshot (here to a folder outside the
/// repository holding a file of the same name) is never read through: its files are written
/// from the snapshot by git, and the worktree holds what the snapshot holds.
#[tokio::test]
async fn a_directory_swapped_for_a_symlink_is_not_read_through() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, tree) = repo(dir.path());
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(outside.join("deep")).unwrap();
    std::fs::write(outside.join("b.txt"), "secret\n").unwrap();
    std::fs::write(outside.join("deep/c.txt"), "secret\n").unwrap();
    std::fs::rename(repo.join("dir"), dir.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(&outside, repo.join("dir")).unwrap();
    let worktree = dir.path().join("wt");
    git(
        &repo,
        &[
            "worktree",
            "add",
            "-q",
            "--no-checkout",
            "-b",
            "wt",
            worktree.to_str().unwrap(),
            "HEAD",
        ],
    );
    let fill = CopyFill {
        source: &repo,
        worktree: &worktree,
        tree: &tree,
        since: SystemTime::now() + Duration::from_secs(60),
    };
    let filled = fill_by_copy(&fill, &CancellationToken::new())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(filled.copied, 2, "only run.sh and link are copied");
    assert_eq!(
        std::fs::read_to_string(worktree.join("dir/b.txt")).unwrap(),
        "beta\n"
    );
    assert_eq!(
        std::fs::read_to_string(worktree.join("dir/deep/c.txt")).unwrap(),
        "gamma\n"
    );
    assert_eq!(
        git(&worktree, &["status", "--porcelain"]),
        " M a.txt\n D del.txt\n?? new.txt\n"
    );
}
