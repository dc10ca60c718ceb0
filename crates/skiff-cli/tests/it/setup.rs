//! A box's setup phase end to end: `.skiff/setup.sh` (or a profile's `setup`) runs on a real
//! local box after the workspace is laid down and before the worker starts; its output streams
//! to the session, its log is kept, setup-only secrets stay out of the worker, the box's disk
//! and every log; a failing setup fails the placement with its last lines and the session
//! stays usable.

use crate::harness::{stderr, stdout};
use crate::worker::{Rig, new_worker_session, text_reply, tool_reply};
use serde_json::Value;
use skiff_test_support::TempGitRepo;
use std::path::Path;
use std::process::Command;

const SECRET: &str = "npm-secret-4f1b9c2ad7e0";

pub(crate) fn events(out: &std::process::Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn placements(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == "placement")
        .map(|e| e["state"].as_str().unwrap().to_owned())
        .collect()
}

/// The error the run ended with (`--json` prints it in the final run status).
fn run_error(out: &std::process::Output) -> String {
    events(out)
        .iter()
        .rev()
        .find_map(|e| e["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("no run error in {}", stdout(out)))
}

/// Every file under `dir` that holds `needle` (as bytes).
fn files_holding(dir: &Path, needle: &str) -> String {
    let out = Command::new("grep")
        .args(["-rlF", "--binary-files=text", "--no-messages", needle])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn setup_runs_before_the_worker_streams_its_output_and_keeps_its_secrets_to_itself() {
    let rig = Rig::start_with_env(
        vec![
            tool_reply(
                "call_1",
                "exec",
                r#"{"command":"$HOME/.local/bin/made-by-setup; env | grep -c SETUP_TOKEN || true"}"#,
            ),
            text_reply(&["The tool from setup works."]),
        ],
        "setup_env = { SETUP_TOKEN = \"env:SKIFF_TEST_SETUP_TOKEN\" }\n",
        &[("SKIFF_TEST_SETUP_TOKEN", SECRET)],
    );
    let script = "set -e\n\
                  echo installing tools\n\
                  mkdir -p \"$HOME/.local/bin\"\n\
                  printf '#!/bin/sh\\necho tool-from-setup\\n' > \"$HOME/.local/bin/made-by-setup\"\n\
                  chmod +x \"$HOME/.local/bin/made-by-setup\"\n\
                  echo \"the token is $SETUP_TOKEN\"\n\
                  echo \"in $(basename \"$PWD\") as $(id -un)\" >&2\n";
    let repo = TempGitRepo::new(&[("README.md", "a repo\n"), (".skiff/setup.sh", script)]);

    let (out, id) = new_worker_session(&rig, repo.path(), "Use the tool setup made");
    assert!(out.status.success(), "{}", stderr(&out));
    let events = events(&out);
    let states = placements(&events);
    assert_eq!(
        &states[..4],
        ["provisioning", "syncing", "setup", "starting"],
        "{states:?}"
    );
    // The output streamed while setup ran, secrets redacted, stderr interleaved.
    let live: String = events
        .iter()
        .filter(|e| e["type"] == "setup_output")
        .map(|e| e["text"].as_str().unwrap())
        .collect();
    assert!(live.contains("installing tools\n"), "{live}");
    assert!(
        live.contains("the token is [SETUP_TOKEN redacted]"),
        "{live}"
    );
    assert!(live.contains(&format!("in {id} as ")), "{live}");
    assert!(!live.contains(SECRET));

    // What setup installed is there for the agent; the secret is not in its environment.
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    let result = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap();
    assert!(result.contains("tool-from-setup"), "{result}");
    assert!(result.lines().any(|l| l.trim() == "0"), "{result}");

    // The whole log is kept.
    let log = rig.gw.json(&["session", "setup-log", "--json", &id]);
    assert_eq!(log["exit_code"], 0);
    assert_eq!(log["setup"], ".skiff/setup.sh");
    assert!(log["text"].as_str().unwrap().contains("installing tools"));
    let shown = rig.gw.run(&["session", "setup-log", &id]);
    assert!(stdout(&shown).contains("the token is [SETUP_TOKEN redacted]"));
    assert!(stderr(&shown).contains(".skiff/setup.sh succeeded after"));

    // Nowhere on the box's disk, nowhere in the gateway's state (database, logs, artifacts).
    assert_eq!(files_holding(rig.root.path(), SECRET), "");
    assert_eq!(files_holding(&rig.gw.state_dir, SECRET), "");
}

#[test]
fn a_failing_setup_fails_the_placement_with_its_last_lines_and_the_session_recovers() {
    let mut rig = Rig::start(
        vec![text_reply(&["Setup is fixed."])],
        "setup = \"echo step one; echo no such package: left-pad >&2; exit 3\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "Hello");
    assert!(!out.status.success());
    let err = run_error(&out);
    assert!(
        err.contains("setup (setup of profile local) exited with status 3"),
        "{err}"
    );
    assert!(err.contains("no such package: left-pad"), "{err}");
    assert!(
        err.contains(&format!("skiff session setup-log {id}")),
        "{err}"
    );
    assert_eq!(
        rig.fake.requests().len(),
        0,
        "the model was asked before setup passed"
    );
    let log = rig.gw.json(&["session", "setup-log", "--json", &id]);
    assert_eq!(log["exit_code"], 3);
    assert_eq!(log["text"], "step one\nno such package: left-pad\n");
    // The failed placement gave its box up.
    let envs = rig.gw.json(&["env", "list", "--json"]);
    assert!(
        envs["environments"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["state"] != "attached"),
        "{envs}"
    );

    // Fix the profile, and the same session goes on.
    let config = std::fs::read_to_string(rig.gw.config_path()).unwrap();
    std::fs::write(
        rig.gw.config_path(),
        config.replace(
            "echo step one; echo no such package: left-pad >&2; exit 3",
            "echo fixed",
        ),
    )
    .unwrap();
    rig.gw.crash_and_restart();
    let out = rig.session(&["send", "--json", &id, "Try again"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let states = placements(&events(&out));
    assert!(states.contains(&"setup".to_owned()), "{states:?}");
    let log = rig.gw.json(&["session", "setup-log", "--json", &id]);
    assert_eq!(log["text"], "fixed\n");
}

#[test]
fn a_setup_past_its_timeout_is_ended_and_says_so() {
    let rig = Rig::start(
        vec![],
        "setup = \"echo starting; sleep 600\"\nsetup_timeout = \"2s\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, _id) = new_worker_session(&rig, repo.path(), "Hello");
    assert!(!out.status.success());
    let err = run_error(&out);
    assert!(
        err.contains("did not finish within its timeout (2s; the profile's setup_timeout)"),
        "{err}"
    );
    assert!(err.contains("starting"), "{err}");
}

#[test]
fn a_session_without_setup_goes_straight_to_starting() {
    let rig = Rig::start(vec![text_reply(&["Hi."])], "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "Hello");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!placements(&events(&out)).contains(&"setup".to_owned()));
    let missing = rig.gw.run(&["session", "setup-log", &id]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains(&format!("setup log for session {id} not found")),
        "{}",
        stderr(&missing)
    );
}

/// A directory under `/opt` (root's alone, as a shared toolchain must be), removed on drop.
struct OptDir(std::path::PathBuf);

impl OptDir {
    fn new() -> OptDir {
        let base = Path::new("/opt/skiff-test-shares");
        std::fs::create_dir_all(base).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("toolchain-")
            .tempdir_in(base)
            .unwrap()
            .keep();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        OptDir(dir)
    }
}

impl Drop for OptDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_shared_toolchain_directory_is_on_the_box_read_only() {
    use std::os::unix::fs::PermissionsExt;
    let share = OptDir::new();
    let bin = share.0.join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::write(bin.join("mytool"), "#!/bin/sh\necho shared-tool-ok\n").unwrap();
    std::fs::set_permissions(bin.join("mytool"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let tool = bin.join("mytool").display().to_string();
    let exec = format!(
        r#"{{"command":"{tool}; touch {}/x 2>&1 || true"}}"#,
        share.0.display()
    );
    let rig = Rig::start(
        vec![
            tool_reply("call_1", "exec", &exec),
            text_reply(&["The shared tool runs."]),
        ],
        &format!("share = [\"{}\"]\n", share.0.display()),
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "Run the shared tool");
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    let result = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap();
    assert!(result.contains("shared-tool-ok"), "{result}");
    assert!(result.contains("Read-only file system"), "{result}");
    assert!(!share.0.join("x").exists());
}

#[test]
fn a_share_that_others_may_write_or_that_holds_gateway_state_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let share = OptDir::new();
    let writable = share.0.join("writable");
    std::fs::create_dir(&writable).unwrap();
    std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(0o777)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let start = |share: &Path| {
        std::fs::write(
            state.join("skiff.toml"),
            format!(
                "[profiles.tools]\nprovider = \"local\"\nshare = [\"{}\"]\n",
                share.display()
            ),
        )
        .unwrap();
        crate::harness::gateway_once(&state, "127.0.0.1:0")
    };
    let (code, first, err) = start(&writable);
    assert_ne!(code, Some(0), "{first}");
    assert!(err.contains("profile `tools`"), "{err}");
    assert!(err.contains("writable by no one else"), "{err}");
    assert!(err.contains(&writable.display().to_string()), "{err}");

    let (code, first, err) = start(&state);
    assert_ne!(code, Some(0), "{first}");
    assert!(err.contains("which boxes must never see"), "{err}");
}

/// Placement details of a `--json` run, in order.
pub(crate) fn placement_details(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == "placement")
        .map(|e| {
            format!(
                "{} {}",
                e["state"].as_str().unwrap(),
                e["detail"].as_str().unwrap()
            )
        })
        .collect()
}

#[test]
fn a_session_with_the_same_setup_starts_from_the_prepared_box_and_a_key_file_change_sets_up_again()
{
    let count = r#"{"command":"cat $HOME/setup-runs | wc -l; cat $HOME/maintain-runs 2>/dev/null | wc -l"}"#;
    let rig = Rig::start(
        vec![
            tool_reply("call_1", "exec", count),
            text_reply(&["First."]),
            tool_reply("call_2", "exec", count),
            text_reply(&["Second."]),
            tool_reply("call_3", "exec", count),
            text_reply(&["Third."]),
        ],
        "",
    );
    let repo = TempGitRepo::new(&[
        ("README.md", "a repo\n"),
        ("requirements.txt", "left-pad==1.0\n"),
        (
            ".skiff/setup.sh",
            "# skiff: key-files = requirements.txt\necho run >> \"$HOME/setup-runs\"\ncat requirements.txt\n",
        ),
        (
            ".skiff/maintain.sh",
            "echo maintained >> \"$HOME/maintain-runs\"\n",
        ),
    ]);
    let counts = |id: &str| {
        let detail = rig.gw.json(&["session", "show", "--json", id]);
        let result = detail["transcript"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["body"]["kind"] == "tool_result")
            .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
            .unwrap();
        result
            .lines()
            .skip(1)
            .map(|l| l.trim().to_owned())
            .collect::<Vec<_>>()
    };

    // The first session sets the box up and keeps it.
    let (out, first) = new_worker_session(&rig, repo.path(), "One");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    let kept = steps
        .iter()
        .find(|s| s.contains("the prepared box is kept as snap_"))
        .unwrap_or_else(|| panic!("{steps:?}"));
    let snapshot = kept
        .split("kept as ")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    assert_eq!(counts(&first), ["1", "0"]);
    let listed = rig.gw.json(&["env", "snapshots", "--json"]);
    assert!(listed.to_string().contains(&snapshot), "{listed}");

    // The second starts from it: setup does not run again, maintain.sh does.
    let (out, second) = new_worker_session(&rig, repo.path(), "Two");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    assert!(
        steps
            .iter()
            .any(|s| s.contains(&format!("from {snapshot}"))),
        "{steps:?}"
    );
    assert!(
        steps
            .iter()
            .any(|s| s.starts_with("setup ") && s.contains("running .skiff/maintain.sh")),
        "{steps:?}"
    );
    assert_eq!(counts(&second), ["1", "1"]);
    let log = rig.gw.json(&["session", "setup-log", "--json", &second]);
    assert_eq!(log["setup"], ".skiff/maintain.sh");

    // A changed key file is a different prepared box: setup runs on a fresh one.
    std::fs::write(repo.path().join("requirements.txt"), "left-pad==2.0\n").unwrap();
    repo.git(&["commit", "-qam", "Bump left-pad"]);
    let (out, third) = new_worker_session(&rig, repo.path(), "Three");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    assert!(
        steps
            .iter()
            .any(|s| s.starts_with("setup ") && s.contains("running .skiff/setup.sh")),
        "{steps:?}"
    );
    assert_eq!(counts(&third), ["1", "0"]);
    let log = rig.gw.json(&["session", "setup-log", "--json", &third]);
    assert!(log["text"].as_str().unwrap().contains("left-pad==2.0"));
}

#[test]
fn a_parked_box_that_setup_prepared_serves_the_next_session_without_setup() {
    let count = r#"{"command":"cat $HOME/setup-runs | wc -l"}"#;
    let rig = Rig::start(
        vec![
            tool_reply("call_1", "exec", count),
            text_reply(&["First."]),
            tool_reply("call_2", "exec", count),
            text_reply(&["Second."]),
        ],
        "keep_attached = \"1s\"\n[gateway]\nlifetime_tick = \"100ms\"\n",
    );
    let repo = TempGitRepo::new(&[
        ("README.md", "a repo\n"),
        (".skiff/setup.sh", "echo run >> \"$HOME/setup-runs\"\n"),
    ]);
    let (out, first) = new_worker_session(&rig, repo.path(), "One");
    assert!(out.status.success(), "{}", stderr(&out));
    // Parked by the lifetime tick, its box back in the pool.
    crate::worker_faults::wait_placement(&rig, &first, "parked");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while rig.gw.json(&["env", "list", "--json"])["environments"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["state"] != "idle")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the box never came back to the pool"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    let (out, second) = new_worker_session(&rig, repo.path(), "Two");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    assert!(
        steps
            .iter()
            .any(|s| s.contains("(a box this setup already prepared)")),
        "{steps:?}"
    );
    assert!(!steps.iter().any(|s| s.starts_with("setup ")), "{steps:?}");
    let detail = rig.gw.json(&["session", "show", "--json", &second]);
    let result = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap();
    assert_eq!(result.lines().nth(1).map(str::trim), Some("1"), "{result}");
    // One box served both.
    assert_eq!(
        rig.gw.json(&["env", "list", "--json"])["environments"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}
