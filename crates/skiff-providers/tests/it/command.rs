//! The `command` provider against lease CLIs written for the test (shell scripts in a temp
//! dir): what it runs, what it accepts, and how it refuses a CLI that misbehaves. No box and
//! no root.

use skiff_protocol::SnapshotId;
use skiff_providers::{Context, Error, LeaseStatus, ProfileConfig, WorkerProvider};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

struct Cli {
    dir: tempfile::TempDir,
    provider: Arc<dyn WorkerProvider>,
}

impl Cli {
    /// A lease CLI whose body is `script` (sh; `$1` is the verb). Every call is appended to
    /// `calls.log` beside it.
    fn new(script: &str, snapshots: bool) -> Cli {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("lease-cli");
        let log = dir.path().join("calls.log");
        std::fs::write(
            &exe,
            format!("#!/bin/sh\necho \"$*\" >> '{}'\n{script}\n", log.display()),
        )
        .unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let profile: ProfileConfig = serde_json::from_value(serde_json::json!({
            "provider": "command",
            "command": [exe.display().to_string()],
            "snapshots": snapshots,
        }))
        .unwrap();
        let ctx = Context {
            skiff_exe: PathBuf::from("/nonexistent/skiff"),
            private_dir: dir.path().join("private"),
            default_box_root: dir.path().join("boxes"),
            state_dir: dir.path().join("state"),
        };
        let provider = skiff_providers::build("leased", &profile, &ctx).unwrap();
        Cli { dir, provider }
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn private(&self) -> PathBuf {
        self.dir.path().join("private")
    }
}

/// A `status` JSON for lease `$3` (the id after `--lease-id`/`--id`), in `state`, with an
/// inline private key.
fn status_json(state: &str) -> String {
    format!(
        r#"printf '{{"id":"%s","state":"{state}","sshHost":"127.0.0.1","sshPort":2222,"sshUser":"box","sshKey":"-----BEGIN OPENSSH PRIVATE KEY-----\\nAAAA\\n-----END OPENSSH PRIVATE KEY-----\\n","sshHostKey":"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKey"}}' "$3""#
    )
}

#[tokio::test]
async fn a_lease_is_asked_for_by_a_stable_id_and_its_inline_key_is_kept_private() {
    let cli = Cli::new(
        &format!(
            "case \"$1\" in warmup) {} ;; *) exit 9 ;; esac",
            status_json("running")
        ),
        false,
    );
    let first = cli.provider.provision("op-1").await.unwrap();
    let again = cli.provider.provision("op-1").await.unwrap();
    assert_eq!(
        first.lease_id, again.lease_id,
        "the same operation asks for the same lease"
    );
    assert!(first.lease_id.starts_with("cbx_"), "{}", first.lease_id);
    assert_ne!(
        cli.provider.provision("op-2").await.unwrap().lease_id,
        first.lease_id
    );
    assert_eq!(
        cli.calls()[0],
        format!("warmup --lease-id {} --json", first.lease_id)
    );
    assert_eq!(
        (first.host.as_str(), first.port, first.user.as_str()),
        ("127.0.0.1", 2222, "box")
    );
    let key = &first.identity_file;
    assert!(
        key.starts_with(cli.private()),
        "the key is written under the private dir: {key:?}"
    );
    let mode = std::fs::metadata(key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(
        std::fs::read_to_string(key)
            .unwrap()
            .contains("PRIVATE KEY")
    );
}

#[tokio::test]
async fn a_failing_cli_is_an_error_with_its_command_line_and_stderr() {
    let cli = Cli::new("echo 'quota exceeded for project p-7' >&2; exit 3", false);
    let err = cli.provider.provision("op-1").await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("warmup --lease-id cbx_") && text.contains("quota exceeded for project p-7"),
        "{text}"
    );
}

#[tokio::test]
async fn output_that_is_not_a_lease_is_refused_and_nothing_half_parsed_is_returned() {
    for (body, says) in [
        ("echo 'Starting box... done'", "not the expected JSON"),
        (
            r#"printf '{"id":"cbx_000000000000","state":"running","sshHost":"h","sshPort":22,"sshKey":"/k","sshHostKey":"ssh-ed25519 A"}'"#,
            "answered with lease",
        ),
        (
            r#"printf '{"id":"%s","state":"starting"}' "$3""#,
            "no SSH endpoint or host key",
        ),
    ] {
        let cli = Cli::new(body, false);
        let err = cli.provider.provision("op-1").await.unwrap_err();
        assert!(err.to_string().contains(says), "{body}: {err}");
        assert!(
            !cli.private().exists(),
            "{body}: a refused answer left a key file behind"
        );
    }
}

#[tokio::test]
async fn a_stop_the_cli_does_not_show_done_is_not_taken_as_gone() {
    let cli = Cli::new(
        &format!(
            "case \"$1\" in stop) exit 0 ;; status) {} ;; *) exit 9 ;; esac",
            status_json("running")
        ),
        false,
    );
    let err = cli.provider.destroy("cbx_0123456789ab").await.unwrap_err();
    assert!(
        matches!(err, Error::NoEvidence { .. }),
        "a box still running after stop is no evidence of gone: {err}"
    );
    assert_eq!(
        cli.provider.inspect("cbx_0123456789ab").await.unwrap(),
        LeaseStatus::Running
    );
}

#[tokio::test]
async fn without_snapshots_declared_no_snapshot_verb_is_ever_run() {
    let cli = Cli::new("exit 0", false);
    assert!(!cli.provider.snapshots());
    let snap = SnapshotId::parse("snap_00010203fcfdfeff").unwrap();
    let err = cli
        .provider
        .snapshot("cbx_0123456789ab", &snap)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::SnapshotsUnsupported { .. }), "{err}");
    assert!(cli.calls().is_empty(), "a verb ran: {:?}", cli.calls());
}
