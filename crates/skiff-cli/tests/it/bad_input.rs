use crate::harness::{Gateway, SKIFF, gateway_once, stderr};
use skiff_test_support::TempGitRepo;
use std::process::Command;

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

#[test]
fn requests_without_a_valid_token_are_refused() {
    // What the gateway answers is proved in-process (skiff-gateway's admission tests); this is
    // what the person at the CLI sees.
    let gw = Gateway::start(DONE);
    let out = gw
        .cli()
        .args(["session", "list"])
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", "skf_wrong")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("missing or invalid token"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_unreachable_gateway_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(dir.path())
        .args(["session", "list"])
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(stderr(&out).contains("skiff gateway"), "{}", stderr(&out));
}

#[test]
fn an_invalid_config_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(&config, "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"http://127.0.0.1:9\"\napi_key_envv = \"X\"\n").unwrap();
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("providers.openai") && err.contains("api_key_envv"),
        "{err}"
    );
    assert!(
        !dir.path().join("state/gateway.json").exists(),
        "a gateway file was written for a gateway that never started"
    );
}

fn mode_of(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn a_state_dir_other_users_can_write_is_refused_and_left_alone() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (code, out, err) = gateway_once(&shared, "127.0.0.1:0");
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains(&shared.display().to_string())
            && err.contains("1777")
            && err.contains("--state-dir"),
        "{err}"
    );
    assert_eq!(
        mode_of(&shared),
        0o1777,
        "the shared directory was chmod'ed"
    );
    assert_eq!(
        std::fs::read_dir(&shared).unwrap().count(),
        0,
        "something was written"
    );

    // Group-writable is as good as shared.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o770)).unwrap();
    let (code, _, err) = gateway_once(&shared, "127.0.0.1:0");
    assert_eq!(code, Some(1));
    assert!(err.contains("0770") && err.contains("its group"), "{err}");
}

#[test]
fn a_state_dir_owned_by_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    // 65534: nobody. The tests run as root, which may hand the directory over.
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let (code, out, err) = gateway_once(&theirs, "127.0.0.1:0");
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains(&theirs.display().to_string()) && err.contains("owned by uid 65534"),
        "{err}"
    );
}

#[test]
fn an_existing_private_state_dir_still_works() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (_, out, err) = gateway_once(&mine, "127.0.0.1:0");
    assert!(out.starts_with("skiff gateway listening on "), "{out}{err}");
    assert_eq!(mode_of(&mine), 0o700, "tightened as before");
}

#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let gw = Gateway::start(DONE);
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let id = gw.new_session(repo.path(), "fake/x", "hi");
    let root = tempfile::tempdir().unwrap();
    let root = root.path().to_str().unwrap();
    for args in [
        &["session", "list"][..],
        &["session", "list", "--json"],
        &["session", "show", &id],
        &["session", "checkpoints", &id],
        &["session", "send", &id, "again"],
        &["env", "list"],
        &["ui"],
        &["box", "list", "--root", root],
        &["--build-hash"],
    ] {
        // A reader that is gone before the first byte: `skiff … | head -0`, without the race.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut cmd = if args[0] == "--build-hash" {
            Command::new(SKIFF) // takes no other argument
        } else {
            gw.cli()
        };
        let out = cmd.args(args).stdout(writer).output().unwrap();
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "skiff {args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "skiff {args:?}: {err}");
        assert_eq!(out.status.code(), Some(0), "skiff {args:?}: {err}");
    }
}

#[test]
fn a_redirected_gateway_log_has_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(crate::harness::SKIFF)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["gateway", "--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut seen = String::new();
    for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)) {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains("gateway listening") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen.contains("gateway listening"), "{seen}");
    assert!(
        !seen.contains('\u{1b}'),
        "colour codes in a redirected log: {seen:?}"
    );
}

/// The exit code says whose fault a refusal is, so a script can tell "no such session" from
/// "not now" from "ask differently" (see `skiff --help`).
#[test]
fn exit_codes_tell_not_found_from_conflict_from_a_bad_request() {
    let gw = Gateway::start(DONE);
    let out = gw.run(&["session", "show", "ses_doesnotexist"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("session ses_doesnotexist not found"),
        "{}",
        stderr(&out)
    );

    let out = gw.run(&["session", "show", "not-a-session"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("is not a session id"),
        "{}",
        stderr(&out)
    );

    // What a refused session costs (no branch, no worktree) is proved in-process; here, that
    // the CLI names the problem and calls it the request's fault.
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let ws = repo.path().to_str().unwrap();
    for (args, says) in [
        (
            ["--workspace", ws, "--model", "nope/gpt-9", "hi"],
            "unknown provider",
        ),
        (
            [
                "--workspace",
                "/nonexistent/skiff-ws",
                "--model",
                "fake/x",
                "hi",
            ],
            "/nonexistent/skiff-ws does not exist",
        ),
        (
            ["--workspace", ws, "--model", "fake/x", "  "],
            "the prompt is empty",
        ),
    ] {
        let out = gw.run(&[&["session", "new"][..], &args[..]].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }

    // A finished session has no turn to cancel: the request is fine, the session's state is not.
    let id = gw.new_session(repo.path(), "fake/x", "hi");
    let out = gw.run(&["session", "cancel", &id]);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("has no running turn to cancel"),
        "{}",
        stderr(&out)
    );
}
