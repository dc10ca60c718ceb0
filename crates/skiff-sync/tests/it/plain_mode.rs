//! Plain mode: a manifest-diffed mirror with deletes, drift refusal, and the tar fallback.

use crate::fixture::{TestBox, cancel, snapshot};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::inbound_plain::{self, Inbound};
use skiff_sync::outbound::{self, Outbound};
use skiff_sync::{Error, Manifest, Method, Remote, Rules, manifest};
use std::path::Path;

pub const DIR: &str = "workspace/plain";

pub fn plain_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    std::fs::create_dir_all(p.join("src/deep")).unwrap();
    std::fs::create_dir_all(p.join("old")).unwrap();
    std::fs::create_dir_all(p.join("node_modules/x")).unwrap();
    std::fs::write(p.join("README"), "readme\n").unwrap();
    std::fs::write(p.join("src/main.c"), "int main(){}\n").unwrap();
    std::fs::write(p.join("src/deep/util.c"), "void u(){}\n").unwrap();
    std::fs::write(p.join("old/gone.txt"), "going\n").unwrap();
    std::fs::write(p.join("node_modules/x/index.js"), "excluded\n").unwrap();
    std::fs::write(p.join("run.sh"), "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(
        p.join("run.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    dir
}

pub async fn push_plain(local: &Path, remote: &Remote, scratch: &Path) -> (Manifest, Method) {
    let rules = Rules::load(local).unwrap();
    let out = Outbound {
        local,
        mode: Mode::Plain,
        session: "ses_plain",
        rules: &rules,
        limits: &Limits::default(),
        scratch,
        identity: None,
        history: Default::default(),
    };
    let sent = outbound::push(&out, remote, &cancel()).await.unwrap();
    (sent.manifest, sent.method)
}

pub async fn mirror(
    local: &Path,
    base: &Manifest,
    theirs: &Manifest,
    remote: &Remote,
    scratch: &Path,
    limits: &Limits,
) -> skiff_sync::Result<inbound_plain::Mirrored> {
    let rules = Rules::load(local).unwrap();
    let inb = Inbound {
        target: local,
        base,
        rules: &rules,
        limits,
        scratch,
    };
    inbound_plain::mirror(&inb, theirs, remote, &cancel()).await
}

async fn round_trip(tb: &TestBox, remote: Remote, expect: Method) {
    let local = plain_dir();
    let scratch = tempfile::tempdir().unwrap();
    let (base, method) = push_plain(local.path(), &remote, scratch.path()).await;
    assert_eq!(method, expect);
    assert!(!tb.path(DIR).join("node_modules").exists());
    assert_eq!(
        std::fs::read_to_string(tb.path(DIR).join("src/deep/util.c")).unwrap(),
        "void u(){}\n"
    );
    assert_eq!(
        tb.manifest(DIR, Mode::Plain).await,
        base,
        "the box got exactly the base"
    );

    tb.sh(&format!(
        "cd {DIR} && rm -r old && echo changed > README && mkdir -p new/dir && \
         printf 'x%.0s' $(seq 1 5000) > new/dir/data.txt && ln -s ../README new/link && \
         chmod 644 run.sh && rm src/deep/util.c"
    ))
    .await;
    let theirs = tb.manifest(DIR, Mode::Plain).await;
    let applied = mirror(
        local.path(),
        &base,
        &theirs,
        &remote,
        scratch.path(),
        &Limits::default(),
    )
    .await
    .unwrap();
    assert_eq!(applied.files.method, Some(expect));
    assert_eq!(
        applied.files.deleted,
        ["old/gone.txt", "src/deep/util.c"].map(String::from)
    );
    let now = manifest::scan(
        local.path(),
        Mode::Plain,
        &Rules::builtin(),
        &Limits::default(),
        &cancel(),
    )
    .await
    .unwrap();
    assert_eq!(now, theirs, "the gateway's copy mirrors the box");
    assert!(
        !local.path().join("old").exists(),
        "an emptied directory stayed"
    );
    assert!(
        !local.path().join("src/deep").exists(),
        "an emptied directory stayed"
    );
    assert!(
        local.path().join("node_modules/x/index.js").exists(),
        "an excluded file was lost"
    );
    assert!(
        scratch.path().read_dir().unwrap().next().is_none(),
        "staging was left behind"
    );
}

#[tokio::test]
async fn plain_mirror_with_deletes_over_rsync() {
    let tb = TestBox::new().await;
    round_trip(&tb, tb.remote(DIR), Method::Rsync).await;
}

#[tokio::test]
async fn without_rsync_on_the_box_tar_carries_both_ways() {
    let tb = TestBox::new().await;
    round_trip(
        &tb,
        tb.remote(DIR).with_rsync_path("/nonexistent/rsync"),
        Method::Tar,
    )
    .await;
}

#[tokio::test]
async fn drift_on_the_gateway_stops_with_nothing_written() {
    let tb = TestBox::new().await;
    let remote = tb.remote(DIR);
    let local = plain_dir();
    let scratch = tempfile::tempdir().unwrap();
    let (base, _) = push_plain(local.path(), &remote, scratch.path()).await;
    tb.sh(&format!(
        "cd {DIR} && echo box > README && echo new > added.txt && rm run.sh"
    ))
    .await;
    let theirs = tb.manifest(DIR, Mode::Plain).await;

    std::fs::write(local.path().join("src/main.c"), "edited on the gateway\n").unwrap();
    std::fs::write(local.path().join("local-only.txt"), "new here\n").unwrap();
    let before = snapshot(local.path());
    let err = mirror(
        local.path(),
        &base,
        &theirs,
        &remote,
        scratch.path(),
        &Limits::default(),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Drift { .. }), "{msg}");
    assert!(
        msg.contains("local-only.txt") && msg.contains("src/main.c"),
        "{msg}"
    );
    assert_eq!(snapshot(local.path()), before);
}

#[tokio::test]
async fn files_other_users_cannot_read_never_reach_a_box() {
    use std::os::unix::fs::PermissionsExt;
    let tb = TestBox::new().await;
    let scratch = tempfile::tempdir().unwrap();
    let rules = Rules::builtin();
    let push = |local: &Path| {
        let local = local.to_path_buf();
        let (rules, scratch) = (&rules, scratch.path());
        let remote = tb.remote(DIR);
        async move {
            let out = Outbound {
                local: &local,
                mode: Mode::Plain,
                session: "ses_plain",
                rules,
                limits: &Limits::default(),
                scratch,
                identity: None,
                history: Default::default(),
            };
            outbound::push(&out, &remote, &cancel()).await
        }
    };
    let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m));

    // A copy of `/etc`-like material: a root-only file of someone else's…
    let local = plain_dir();
    let shadow = local.path().join("src/shadow");
    std::fs::write(&shadow, "root:$6$secret\n").unwrap();
    mode(&shadow, 0o640).unwrap();
    std::os::unix::fs::chown(&shadow, Some(65534), Some(65534)).unwrap();
    let err = push(local.path()).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Private { .. }), "{msg}");
    assert!(
        msg.starts_with(&format!(
            "{} is private (mode 0640, owned by uid 65534",
            shadow.display()
        )),
        "{msg}"
    );
    assert!(
        msg.contains(".skiffignore") && msg.contains("chmod o+r"),
        "{msg}"
    );
    assert!(!tb.path(DIR).exists(), "something reached the box");

    // …one of the gateway's own user (root here: the real /etc/shadow's case)…
    std::os::unix::fs::chown(&shadow, Some(0), Some(0)).unwrap();
    let msg = push(local.path()).await.unwrap_err().to_string();
    assert!(msg.contains("the gateway's own user"), "{msg}");
    assert!(!tb.path(DIR).exists(), "something reached the box");

    // …and a readable file in a directory others cannot enter.
    mode(&shadow, 0o644).unwrap();
    mode(&local.path().join("src/deep"), 0o700).unwrap();
    let msg = push(local.path()).await.unwrap_err().to_string();
    assert!(
        msg.contains("src/deep/util.c is private (it is inside")
            && msg.contains("mode 0700")
            && msg.contains("cannot enter"),
        "{msg}"
    );
    assert!(!tb.path(DIR).exists(), "something reached the box");

    // Excluded, the same workspace goes; readable, it goes whole.
    std::fs::write(local.path().join(".skiffignore"), "/src/deep/\n").unwrap();
    let rules_ignoring = Rules::load(local.path()).unwrap();
    let out = Outbound {
        local: local.path(),
        mode: Mode::Plain,
        session: "ses_plain",
        rules: &rules_ignoring,
        limits: &Limits::default(),
        scratch: scratch.path(),
        identity: None,
        history: Default::default(),
    };
    outbound::push(&out, &tb.remote(DIR), &cancel())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(tb.path(DIR).join("src/shadow")).unwrap(),
        "root:$6$secret\n"
    );
    assert!(!tb.path(DIR).join("src/deep").exists());
}
