//! What a killed gateway leaves behind is gone after the next start; what is live stays.

use crate::harness::Gateway;
use std::path::Path;

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

fn sock(path: &Path) {
    // A socket file whose listener is gone, as a killed gateway leaves it.
    drop(std::os::unix::net::UnixListener::bind(path).unwrap());
    assert!(path.exists());
}

#[test]
fn a_restart_removes_staging_dirs_stale_sockets_and_empty_box_roots() {
    let roots = tempfile::tempdir().unwrap();
    let empty_root = roots.path().join("boxes-empty");
    let kept_root = roots.path().join("boxes-kept");
    let config = format!(
        "[profiles.empty]\nprovider = \"local\"\nroot = \"{}\"\n\
         [profiles.kept]\nprovider = \"local\"\nroot = \"{}\"\n",
        empty_root.display(),
        kept_root.display()
    );
    let mut gw = Gateway::start_with(DONE, &config);
    let state = gw.state_dir.clone();

    // An interrupted reconciliation's staging (pulled bytes), a session's private index, a
    // half-written blob, a socket of an environment no placement holds, an empty box root.
    let staging = state.join("tmp/bundle-in-4242-0badf00d-0");
    std::fs::create_dir_all(staging.join("files/src")).unwrap();
    std::fs::write(staging.join("files/src/big.bin"), vec![7u8; 1 << 20]).unwrap();
    std::fs::write(state.join("tmp/ses_gone.index"), b"DIRC").unwrap();
    std::fs::create_dir_all(state.join("artifacts")).unwrap();
    std::fs::write(state.join("artifacts/.tmp-4242-1"), b"half").unwrap();
    std::fs::create_dir_all(state.join("workers")).unwrap();
    sock(&state.join("workers/env_gone.sock"));
    std::fs::create_dir_all(&empty_root).unwrap();
    // A root that holds something is not ours to judge.
    std::fs::create_dir_all(&kept_root).unwrap();
    std::fs::write(kept_root.join("README"), "the operator's\n").unwrap();
    let blob = state.join("artifacts").join("a".repeat(64));
    std::fs::write(&blob, b"a whole blob").unwrap();

    gw.crash_and_restart();

    assert_eq!(
        std::fs::read_dir(state.join("tmp")).unwrap().count(),
        0,
        "staging left in {}",
        state.join("tmp").display()
    );
    assert!(!state.join("artifacts/.tmp-4242-1").exists());
    assert!(blob.exists(), "a whole blob is not a leftover");
    assert!(!state.join("workers/env_gone.sock").exists());
    assert!(!empty_root.exists(), "the empty box root is still there");
    assert!(kept_root.join("README").exists());

    // The gateway works as before, staging dirs and all.
    let repo = skiff_test_support::TempGitRepo::new(&[("a.txt", "a\n")]);
    gw.new_session(repo.path(), "fake/x", "hi");
    assert_eq!(
        std::fs::read_dir(state.join("tmp")).unwrap().count(),
        0,
        "a session left its staging behind"
    );
}
