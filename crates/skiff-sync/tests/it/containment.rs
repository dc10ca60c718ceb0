//! Bad input from a box. A path containment refuses is refused by name while the rest of the
//! box's work is adopted (and nothing refused is ever written); bytes that do not match the
//! box's manifest stop the whole adoption with nothing written.

use crate::fixture::{TestBox, snapshot};
use crate::plain_mode::{DIR, mirror, plain_dir, push_plain};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::{Error, Manifest, ManifestEntry};

fn with(theirs: &Manifest, path: &str, entry: ManifestEntry) -> Manifest {
    let mut m = theirs.clone();
    m.entries.insert(path.to_owned(), entry);
    m
}

fn file(blake3: &str, size: u64) -> ManifestEntry {
    ManifestEntry::File {
        blake3: blake3.to_owned(),
        size,
        mode: 0o644,
    }
}

/// The cases whose bad path is refused by name (the rest adopted); every other case is a
/// transfer that does not match the manifest, which stops everything.
const BY_NAME: &[&str] = &[
    "dot-dot path",
    "nested dot-dot",
    "absolute path",
    "git internals",
    "below a file",
    "escaping symlinks",
    "over the per-file limit",
];

#[tokio::test]
async fn every_bad_input_is_refused_and_nothing_refused_is_written() {
    let tb = TestBox::new().await;
    let remote = tb.remote(DIR);
    let local = plain_dir();
    let scratch = tempfile::tempdir().unwrap();
    let (base, _) = push_plain(local.path(), &remote, scratch.path()).await;
    // A legitimate change rides along with every bad one: adopted beside a refused path,
    // never written when the transfer itself is refused.
    tb.sh(&format!("cd {DIR} && echo legit > README")).await;
    let honest = tb.manifest(DIR, Mode::Plain).await;
    let some_hash = match honest.entries.get("README") {
        Some(ManifestEntry::File { blake3, .. }) => blake3.clone(),
        other => panic!("{other:?}"),
    };
    let before = snapshot(local.path());
    let limits = Limits::default();

    let mut cases: Vec<(&str, Manifest, Limits)> = vec![
        (
            "dot-dot path",
            with(&honest, "../escape.txt", file(&some_hash, 7)),
            limits,
        ),
        (
            "nested dot-dot",
            with(&honest, "src/../../escape", file(&some_hash, 7)),
            limits,
        ),
        (
            "absolute path",
            with(&honest, "/etc/cron.d/x", file(&some_hash, 7)),
            limits,
        ),
        (
            "git internals",
            with(&honest, ".git/hooks/pre-commit", file(&some_hash, 7)),
            limits,
        ),
        (
            "below a file",
            with(&honest, "README/x", file(&some_hash, 7)),
            limits,
        ),
        (
            "manifest mismatch",
            with(&honest, "README", file(&"0".repeat(64), 6)),
            limits,
        ),
        (
            "promised file that does not exist",
            with(&honest, "ghost.txt", file(&some_hash, 7)),
            limits,
        ),
    ];

    // A symlink that resolves outside the workspace, made by the box itself.
    tb.sh(&format!(
        "cd {DIR} && ln -s ../../../../etc/passwd evil && ln -s /etc/shadow evil2"
    ))
    .await;
    cases.push((
        "escaping symlinks",
        tb.manifest(DIR, Mode::Plain).await,
        limits,
    ));
    tb.sh(&format!("cd {DIR} && rm evil evil2")).await;

    // An oversized file.
    tb.sh(&format!("cd {DIR} && head -c 300000 /dev/zero > big.bin"))
        .await;
    cases.push((
        "over the per-file limit",
        tb.manifest(DIR, Mode::Plain).await,
        Limits {
            max_file_bytes: 100_000,
            ..Limits::default()
        },
    ));
    tb.sh(&format!("cd {DIR} && rm big.bin")).await;

    // A FIFO the box claims is a file: it does not transfer, so the bytes cannot match.
    tb.sh(&format!("cd {DIR} && mkfifo pipe")).await;
    let err = tb.try_manifest(DIR, Mode::Plain).await.unwrap_err();
    assert!(matches!(err, Error::Special { kind: "FIFO", .. }), "{err}");
    cases.push((
        "a FIFO passed off as a file",
        with(&honest, "pipe", file(&some_hash, 7)),
        limits,
    ));

    // A device file and a socket (made by root here; a box user cannot mknod).
    let dev = tb.path(DIR).join("null-dev");
    let made = std::process::Command::new("mknod")
        .arg(&dev)
        .args(["c", "1", "3"])
        .status()
        .unwrap();
    assert!(made.success());
    let err = skiff_sync::manifest::entry_of(&tb.path(DIR), "null-dev").unwrap_err();
    assert!(
        matches!(
            err,
            Error::Special {
                kind: "device file",
                ..
            }
        ),
        "{err}"
    );
    cases.push((
        "a device passed off as a file",
        with(&honest, "null-dev", file(&some_hash, 7)),
        limits,
    ));
    let sock = tb.path(DIR).join("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let err = skiff_sync::manifest::entry_of(&tb.path(DIR), "sock").unwrap_err();
    assert!(
        matches!(err, Error::Special { kind: "socket", .. }),
        "{err}"
    );
    cases.push((
        "a socket passed off as a file",
        with(&honest, "sock", file(&some_hash, 7)),
        limits,
    ));

    for (case, theirs, limits) in cases {
        let result = mirror(
            local.path(),
            &base,
            &theirs,
            &remote,
            scratch.path(),
            &limits,
        )
        .await;
        if BY_NAME.contains(&case) {
            let mirrored = result.unwrap_or_else(|e| panic!("{case}: {e}"));
            assert!(!mirrored.refused.is_empty(), "{case}: nothing refused");
            assert_eq!(mirrored.files.written, ["README"], "{case}");
            assert_eq!(
                std::fs::read_to_string(local.path().join("README")).unwrap(),
                "legit\n",
                "{case}"
            );
            // Back to the base, for the next case.
            std::fs::write(local.path().join("README"), "readme\n").unwrap();
        } else {
            let err = result.expect_err(case);
            let msg = err.to_string();
            assert!(matches!(err, Error::Mismatch { .. }), "{case}: {msg}");
            assert!(msg.contains("nothing was written"), "{case}: {msg}");
        }
        assert_eq!(snapshot(local.path()), before, "{case} wrote something");
        assert!(
            scratch.path().read_dir().unwrap().next().is_none(),
            "{case}: staging left"
        );
        for outside in ["/etc/cron.d/x", "/escape.txt"] {
            assert!(!std::path::Path::new(outside).exists(), "{case}: {outside}");
        }
    }

    // Where the gateway's rules do not look, the box may not write (it could be anything here,
    // a symlink out of the workspace included).
    std::os::unix::fs::symlink("/tmp", local.path().join("node_modules/x/out")).unwrap();
    let theirs = with(
        &honest,
        "node_modules/x/out/planted.txt",
        file(&some_hash, 7),
    );
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
    assert_eq!(mirrored.refused.len(), 1, "{:?}", mirrored.refused);
    assert_eq!(mirrored.refused[0].path, "node_modules/x/out/planted.txt");
    assert!(mirrored.refused[0].reason.contains("rules exclude it"));
    assert!(!std::path::Path::new("/tmp/planted.txt").exists());
}

#[tokio::test]
async fn a_file_over_the_per_file_limit_is_named_with_its_size_and_the_limit() {
    let limits = Limits {
        max_file_bytes: 100_000,
        ..Limits::default()
    };
    let dir = plain_dir();
    std::fs::create_dir_all(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub/big.bin"), vec![0u8; 300_000]).unwrap();
    std::fs::write(dir.path().join("also.bin"), vec![0u8; 200_000]).unwrap();

    // What a worker runs to list its workspace for the gateway, and what outbound sync runs.
    let err = skiff_sync::manifest::scan(
        dir.path(),
        Mode::Plain,
        &skiff_sync::Rules::builtin(),
        &limits,
        &tokio_util::sync::CancellationToken::new(),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::FileTooLarge { .. }), "{msg}");
    let big = dir.path().join("sub/big.bin");
    assert!(
        msg.starts_with(&format!(
            "{} is 293.0 KiB, over the per-file limit of 97.7 KiB; add `/sub/big.bin` to the workspace's .skiffignore",
            big.display()
        )),
        "{msg}"
    );
    assert!(
        msg.contains("also.bin (195.3 KiB)"),
        "the others are named too: {msg}"
    );

    // A box's manifest claiming such a file.
    let theirs = with(
        &Manifest {
            version: skiff_protocol::sync::MANIFEST_VERSION,
            ..Manifest::default()
        },
        "sub/big.bin",
        file(&"0".repeat(64), 300_000),
    );
    let err = skiff_sync::contain::check_manifest(&theirs, None, &limits).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "the box's sub/big.bin is 293.0 KiB, over the per-file limit of 97.7 KiB; delete it on the box"
        ),
        "{msg}"
    );
}
