//! Big and awkward trees, as real repositories have them: each works, or is refused before
//! anything moves with an error that names the path and the rule — and nothing is left out
//! without saying so.

use crate::fixture::{TestBox, Workspace, cancel, git, snapshot};
use crate::plain_mode::{DIR, mirror, push_plain};
use skiff_sync::filelist::{self, Limits, Mode};
use skiff_sync::inbound_git::{self, Adoption};
use skiff_sync::outbound::{self, Outbound};
use skiff_sync::{Error, Rules};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

async fn list(root: &Path, mode: Mode) -> skiff_sync::Result<filelist::FileList> {
    let rules = Rules::load(root).unwrap();
    filelist::list(root, mode, &rules, &Limits::default(), &cancel()).await
}

#[tokio::test]
async fn a_name_that_is_not_utf8_is_refused_by_name_in_both_modes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ok.txt"), "ok\n").unwrap();
    let bad = std::ffi::OsStr::from_bytes(b"caf\xe9.txt");
    std::fs::write(dir.path().join(bad), "latin-1\n").unwrap();
    let err = list(dir.path(), Mode::Plain).await.unwrap_err();
    assert!(matches!(err, Error::NotUtf8 { .. }), "{err}");
    assert!(err.to_string().contains("caf"), "{err}");

    let ws = Workspace::git(&[("a.txt", "a\n")]);
    std::fs::write(ws.worktree.join(bad), "latin-1\n").unwrap();
    let err = list(&ws.worktree, Mode::Git).await.unwrap_err();
    assert!(matches!(err, Error::NotUtf8 { .. }), "{err}");
}

#[tokio::test]
async fn names_with_newlines_and_case_only_renames_go_both_ways() {
    let tb = TestBox::new().await;
    let ws = Workspace::git(&[("README.md", "readme\n"), ("a.txt", "a\n")]);
    ws.write("line\nbreak.txt", "two lines in the name\n");
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
    let dir = "workspace/repo";
    let remote = tb.remote(dir);
    let sent = outbound::push(&out, &remote, &cancel()).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(tb.path(dir).join("line\nbreak.txt")).unwrap(),
        "two lines in the name\n"
    );
    // On the box: a case-only rename, committed, and another odd name.
    tb.sh(&format!(
        "cd {dir} && git mv README.md Readme.md && git commit -q -m 'box: rename' \
         && printf 'x\\n' > \"$(printf 'tab\\there.txt')\""
    ))
    .await;
    let commit = sent.manifest.base_commit.clone().unwrap();
    let bundle = inbound_git::fetch_bundle(
        &remote,
        &ws.session,
        &commit,
        &Limits::default(),
        ws.scratch.path(),
        &cancel(),
    )
    .await
    .unwrap();
    let theirs = tb.manifest(dir, Mode::Git).await;
    let a = Adoption {
        worktree: &ws.worktree,
        session: &ws.session,
        base: &sent.manifest,
        expected_head: &commit,
        rules: &rules,
        limits: &Limits::default(),
        scratch: ws.scratch.path(),
    };
    let adopted = inbound_git::adopt(
        &a,
        bundle.as_ref().map(|b| b.path()),
        &theirs,
        &remote,
        &cancel(),
    )
    .await
    .unwrap();
    assert!(adopted.refused.is_empty(), "{:?}", adopted.refused);
    assert!(adopted.fast_forwarded);
    let names: Vec<String> = std::fs::read_dir(&ws.worktree)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.contains(&"Readme.md".to_owned()), "{names:?}");
    assert!(!names.contains(&"README.md".to_owned()), "{names:?}");
    assert!(names.contains(&"tab\there.txt".to_owned()), "{names:?}");
    assert!(names.contains(&"line\nbreak.txt".to_owned()), "{names:?}");
}

#[tokio::test]
async fn what_the_rules_leave_out_is_reported_by_folder_and_rule() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    for (path, text) in [
        ("Cargo.toml", "[package]\n"),
        ("src/lib.rs", "pub fn f() {}\n"),
        ("src/target/mod.rs", "// source, not build output\n"),
        ("target/debug/app", "binary\n"),
        ("target/debug/deps/x.rlib", "binary\n"),
        ("web/node_modules/left/index.js", "x\n"),
        ("notes.log", "log\n"),
        (".skiffignore", "*.log\n"),
    ] {
        std::fs::create_dir_all(p.join(path).parent().unwrap()).unwrap();
        std::fs::write(p.join(path), text).unwrap();
    }
    let listed = list(p, Mode::Plain).await.unwrap();
    let paths = listed.paths();
    assert!(paths.contains(&"src/target/mod.rs".to_owned()), "{paths:?}");
    assert!(!paths.iter().any(|p| p.starts_with("target/")), "{paths:?}");
    let summary = listed.left_out.summary().unwrap();
    for expected in [
        "target/ by target/ (built in, beside Cargo.toml or pom.xml)",
        "web/node_modules/ by node_modules/ (built in)",
        "notes.log by *.log (.skiffignore)",
    ] {
        assert!(
            summary.contains(expected),
            "{expected:?} not in {summary:?}"
        );
    }
    assert!(!summary.contains("src/target"), "{summary}");

    // Git mode: a submodule is said to be left out, not skipped silently.
    let ws = Workspace::git(&[("a.txt", "a\n")]);
    let inner = Workspace::git(&[("lib.txt", "lib\n")]);
    let inner_head = inner.head();
    git(
        &ws.worktree,
        &[
            "update-index",
            "--add",
            "--cacheinfo",
            &format!("160000,{inner_head},vendor/lib"),
        ],
    );
    std::fs::create_dir_all(ws.worktree.join("vendor/lib")).unwrap();
    let listed = list(&ws.worktree, Mode::Git).await.unwrap();
    assert_eq!(listed.left_out.submodules, ["vendor/lib"]);
    assert!(
        listed
            .left_out
            .summary()
            .unwrap()
            .contains("submodule vendor/lib (another repository)")
    );
}

#[tokio::test]
async fn lfs_pointer_files_travel_as_the_text_they_are() {
    let tb = TestBox::new().await;
    let pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n";
    let ws = Workspace::git(&[
        (
            ".gitattributes",
            "*.bin filter=lfs diff=lfs merge=lfs -text\n",
        ),
        ("model.bin", pointer),
    ]);
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
    let dir = "workspace/repo";
    outbound::push(&out, &tb.remote(dir), &cancel())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(tb.path(dir).join("model.bin")).unwrap(),
        pointer
    );
}

#[tokio::test]
async fn a_workspace_of_a_hundred_thousand_small_files_syncs_and_comes_back() {
    let tb = TestBox::new().await;
    let remote = tb.remote(DIR);
    let local = tempfile::tempdir().unwrap();
    for d in 0..100 {
        let dir = local.path().join(format!("d{d:03}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..1000 {
            std::fs::write(dir.join(format!("f{f:04}.txt")), format!("{d}/{f}\n")).unwrap();
        }
    }
    let scratch = tempfile::tempdir().unwrap();
    let (base, _) = push_plain(local.path(), &remote, scratch.path()).await;
    assert_eq!(base.entries.len(), 100_000);
    tb.sh(&format!(
        "cd {DIR} && echo changed > d042/f0042.txt && rm d099/f0999.txt"
    ))
    .await;
    let theirs = tb.manifest(DIR, Mode::Plain).await;
    let before = snapshot(local.path()).len();
    let mirrored = mirror(
        local.path(),
        &base,
        &theirs,
        &remote,
        scratch.path(),
        &Limits::default(),
    )
    .await
    .unwrap();
    assert_eq!(mirrored.files.written, ["d042/f0042.txt"]);
    assert_eq!(mirrored.files.deleted, ["d099/f0999.txt"]);
    assert_eq!(snapshot(local.path()).len(), before - 1);
}
