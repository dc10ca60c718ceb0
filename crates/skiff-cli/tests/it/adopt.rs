//! A worker session's box survives its gateway (issue 17): while its worker is attached, the
//! session is its gateway's (a message through another is forwarded to it; one while its turn
//! runs is refused, naming the owner); when
//! that gateway is killed, another takes the session over, reaches the box over SSH with the
//! key sealed in the shared vault, fences the old worker with a replacement of a higher
//! epoch, and the session goes on on the same box.
//!
//! Which path these tests exercise: a local box runs in a session of its own (`setsid`), so
//! killing its gateway with SIGKILL leaves the box and its sshd running — the re-adopt path.
//! Both gateways name the same box root, so the second one's provider sees the box alive.
//! The reclaim path is exercised by killing the box too, while its gateway is frozen.

use crate::env::BoxRoot;
use crate::harness::{Gateway, SKIFF, git, stderr};
use skiff_test_support::TempGitRepo;
use skiff_test_support::postgres::PgCluster;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

/// The deployment's vault key, the same on both gateways (base64 of 32 bytes).
const VAULT_KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// Two gateways on one fresh database, one shared workspaces directory, one box root and the
/// same vault key; `script` is the scripted model's.
struct Pair {
    first: Gateway,
    second: Gateway,
    repo: TempGitRepo,
    boxes: BoxRoot,
    /// The config both were started with, for a third to join.
    config: String,
    script: String,
    _shared: tempfile::TempDir,
    _cluster: PgCluster,
}

impl Pair {
    fn start(script: &str) -> Pair {
        let cluster = PgCluster::start();
        let url = cluster.fresh_database();
        let shared = tempfile::tempdir().unwrap();
        let boxes = BoxRoot::new();
        let config = format!(
            "[gateway]\nlease_ttl = \"2s\"\n\
             [store]\nurl = \"{url}\"\nworkspaces = \"{}\"\n\
             [profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n",
            shared.path().join("workspaces").display(),
            boxes.path().display(),
        );
        let env = [("SKIFF_VAULT_KEY", VAULT_KEY)];
        let first = Gateway::start_full(script, &config, &env);
        let second = Gateway::join_full(&first, script, &config, &env);
        Pair {
            first,
            second,
            repo: TempGitRepo::new(&[("a.txt", "a\n")]),
            boxes,
            config,
            script: script.to_owned(),
            _shared: shared,
            _cluster: cluster,
        }
    }

    /// A worker session on the `local` profile through the first gateway, its first turn
    /// finished; its id.
    fn new_local_session(&self) -> String {
        let out = self.first.run(&[
            "session",
            "new",
            "--json",
            "--profile",
            "local",
            "--workspace",
            self.repo.path().to_str().unwrap(),
            "--model",
            "fake/any",
            "hello",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let first_line: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap())
                .unwrap();
        first_line["session_id"].as_str().unwrap().to_owned()
    }
}

/// The session's live events through `gw`, from the start, as JSON lines of its SSE stream.
fn follow(gw: &Gateway, id: &str) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = std::process::Command::new("curl")
        .args(["-sN", "-H"])
        .arg(format!("Authorization: Bearer {}", gw.token))
        .arg(format!("{}/v1/sessions/{id}/events?after=0", gw.url))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

/// Reads events until one satisfies `until`; every event read, that one last.
fn read_until(
    events: &mut BufReader<std::process::ChildStdout>,
    mut until: impl FnMut(&serde_json::Value) -> bool,
) -> Vec<serde_json::Value> {
    let mut seen = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        let n = events.read_line(&mut line).unwrap();
        assert!(n > 0, "the event stream ended; seen: {seen:?}");
        let Some(data) = line.trim().strip_prefix("data:") else {
            continue;
        };
        let event: serde_json::Value = serde_json::from_str(data.trim()).unwrap();
        let done = until(&event);
        seen.push(event);
        if done {
            return seen;
        }
    }
}

/// The transcript's entry kinds with their text.
fn kinds(detail: &serde_json::Value) -> Vec<(String, String)> {
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let body = &e["body"];
            let text = body["text"]
                .as_str()
                .or(body["content"].as_str())
                .unwrap_or_default();
            (body["kind"].as_str().unwrap().to_owned(), text.to_owned())
        })
        .collect()
}

fn refused_naming_the_owner(gw: &Gateway, id: &str) {
    let refused = gw.run(&["session", "send", id, "again"]);
    assert!(!refused.status.success());
    let err = stderr(&refused);
    assert!(err.contains("is being run by gateway gw_"), "{err}");
}

/// Turn 1 commits on the box and then outlives its gateway; turn 2 is what the model answers
/// once the lost call's result is recorded.
const LONG_COMMAND: &str = "[[turns]]\ntext = \"Running a long command.\"\n[[turns.tool_calls]]\nname = \"exec\"\n\
         arguments = { command = \"echo ran >> ran.log && git add ran.log && git commit -qm ran && sleep 31461\" }\n\
         [[turns]]\ntext = \"Finished on the re-adopted box.\"\n";

/// Starts a worker session through the first gateway and follows it through the second
/// until the box's worker started the long command: the session id, the box it runs on and
/// the event stream.
fn mid_command(pair: &Pair) -> (String, String, Child, BufReader<std::process::ChildStdout>) {
    let started = pair.first.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--profile",
        "local",
        "--workspace",
        pair.repo.path().to_str().unwrap(),
        "--model",
        "fake/slow",
        "run it",
    ]);
    let id = started["session"]["id"].as_str().unwrap().to_owned();
    let (stream, mut events) = follow(&pair.second, &id);
    // The owner is mid-turn once the box's worker started the command.
    let before = read_until(&mut events, |e| {
        e["type"] == "tool_started" && e["name"] == "exec"
    });
    let placed = before
        .iter()
        .rev()
        .find_map(|e| e["environment_id"].as_str())
        .expect("the session was placed on a box")
        .to_owned();
    (id, placed, stream, events)
}

fn until_run_ends(e: &serde_json::Value) -> bool {
    e["type"] == "run_status"
        && ["succeeded", "failed", "cancelled"].contains(&e["status"].as_str().unwrap())
}

#[test]
fn a_killed_gateways_worker_turn_finishes_on_its_readopted_box() {
    let mut pair = Pair::start(LONG_COMMAND);
    let (id, placed, mut stream, mut events) = mid_command(&pair);
    refused_naming_the_owner(&pair.second, &id);
    pair.first.stop();

    // The other gateway takes the session over, re-adopts the box and the turn ends there.
    let after = read_until(&mut events, |e| {
        e["type"] == "run_status"
            && ["succeeded", "failed", "cancelled"].contains(&e["status"].as_str().unwrap())
    });
    let _ = stream.kill();
    let _ = stream.wait();
    assert_eq!(after.last().unwrap()["status"], "succeeded", "{after:?}");
    let placements: Vec<(&str, &str)> = after
        .iter()
        .filter(|e| e["type"] == "placement")
        .map(|e| (e["state"].as_str().unwrap(), e["detail"].as_str().unwrap()))
        .collect();
    assert!(
        placements
            .iter()
            .any(|(s, d)| *s == "starting" && d.contains("old one is fenced")),
        "{placements:?}"
    );
    assert!(
        !placements.iter().any(|(s, _)| *s == "reclaimed"),
        "{placements:?}"
    );

    let detail = pair.second.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["runs"].as_array().unwrap().len(), 1);
    assert_eq!(detail["runs"][0]["status"], "succeeded");
    let attempts = detail["attempts"].as_array().unwrap();
    let summary: Vec<(&str, &str, u64)> = attempts
        .iter()
        .map(|a| {
            (
                a["status"].as_str().unwrap(),
                a["node"].as_str().unwrap(),
                a["owner_epoch"].as_u64().unwrap(),
            )
        })
        .collect();
    // The same box, under a higher epoch; the new attempt takes over from the old.
    assert_eq!(summary.len(), 2, "{attempts:?}");
    assert_eq!((summary[0].0, summary[0].1), ("orphaned", placed.as_str()));
    assert_eq!((summary[1].0, summary[1].1), ("succeeded", placed.as_str()));
    assert!(summary[1].2 > summary[0].2, "{summary:?}");
    assert_eq!(attempts[1]["resumed_from"], attempts[0]["id"]);

    // Nothing lost or doubled; the command's result never recorded is said to be lost.
    let kinds = kinds(&detail);
    let only: Vec<&str> = kinds.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        only,
        [
            "user_message",
            "assistant_message",
            "notice",
            "tool_result",
            "assistant_message"
        ],
        "{kinds:?}"
    );
    assert!(kinds[2].1.contains("goes on with it"), "{kinds:?}");
    assert!(kinds[3].1.contains("no result was recorded"), "{kinds:?}");
    assert_eq!(kinds[4].1, "Finished on the re-adopted box.");

    // The box's work came home, the command having run once.
    let branch = format!("skiff/{id}");
    assert_eq!(
        git(pair.repo.path(), &["show", &format!("{branch}:ran.log")]),
        "ran\n"
    );
}

#[test]
fn an_attached_session_is_owned_between_turns_and_readopted_after_its_gateway_dies() {
    let script = "[[turns]]\ntext = \"First.\"\n[[turns]]\ntext = \"Second.\"\n";
    let mut pair = Pair::start(script);
    let id = pair.new_local_session();
    let detail = pair.first.json(&["session", "show", "--json", &id]);
    let placed = detail["attempts"][0]["node"].as_str().unwrap().to_owned();
    assert!(placed.starts_with("env_"), "{detail}");

    // Between turns the attached worker keeps the session its gateway's (a message through
    // another gateway is forwarded to it: see the next test).

    let (mut stream, mut events) = follow(&pair.second, &id);
    pair.first.stop();
    // The other gateway re-adopts the box: the old worker fenced, a new one ready.
    let mut fenced = false;
    read_until(&mut events, |e| {
        if e["type"] != "placement" {
            return false;
        }
        let detail = e["detail"].as_str().unwrap_or_default();
        fenced |= e["state"] == "starting" && detail.contains("old one is fenced");
        fenced && e["state"] == "active"
    });
    let _ = stream.kill();
    let _ = stream.wait();

    let out = pair.second.run(&["session", "send", &id, "again"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = pair.second.json(&["session", "show", "--json", &id]);
    let runs: Vec<&str> = detail["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(runs, ["succeeded", "succeeded"]);
    let attempts = detail["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[1]["node"], placed.as_str(), "{attempts:?}");
    assert!(
        attempts[1]["owner_epoch"].as_u64() > attempts[0]["owner_epoch"].as_u64(),
        "{attempts:?}"
    );
    let texts: Vec<String> = kinds(&detail)
        .into_iter()
        .filter(|(k, _)| k == "assistant_message")
        .map(|(_, t)| t)
        .collect();
    assert_eq!(texts, ["First.", "Second."]);
    // The box's key reached the other gateway through the vault (opened into its own state
    // dir), never as a listed secret.
    let opened = pair
        .second
        .state_dir
        .join("ssh")
        .join(&placed)
        .join("identity");
    assert!(opened.exists(), "{}", opened.display());
    let listed = pair.second.run(&["secret", "list", "--json"]);
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains("box-key"),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );
}

#[test]
fn a_killed_gateways_worker_turn_whose_box_died_too_fails_over_to_a_fresh_box() {
    let mut pair = Pair::start(LONG_COMMAND);
    let (id, placed, mut stream, mut events) = mid_command(&pair);
    // The box dies with its gateway: the gateway frozen first, so it never sees the box go.
    let frozen = std::process::Command::new("kill")
        .args(["-STOP", &pair.first.pid().to_string()])
        .status()
        .unwrap();
    assert!(frozen.success());
    let boxes = skiff_providers::local::Boxes::new(pair.boxes.path().to_path_buf(), SKIFF.into());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for lease in pair.boxes.boxes() {
        rt.block_on(boxes.destroy(&lease)).unwrap();
    }
    pair.first.stop();

    // The other gateway takes the session over, cannot reach the box and reclaims it; the
    // turn's new attempt runs on a fresh box.
    let after = read_until(&mut events, until_run_ends);
    let _ = stream.kill();
    let _ = stream.wait();
    assert_eq!(after.last().unwrap()["status"], "succeeded", "{after:?}");
    assert!(
        after
            .iter()
            .any(|e| e["type"] == "placement" && e["state"] == "reclaimed"),
        "no reclaim: {after:?}"
    );

    let detail = pair.second.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["session"]["placement"], "active", "{detail}");
    let attempts = detail["attempts"].as_array().unwrap();
    let summary: Vec<(&str, &str)> = attempts
        .iter()
        .map(|a| (a["status"].as_str().unwrap(), a["node"].as_str().unwrap()))
        .collect();
    assert_eq!(summary.len(), 2, "{attempts:?}");
    assert_eq!(summary[0], ("orphaned", placed.as_str()));
    assert_eq!(summary[1].0, "succeeded");
    assert!(
        summary[1].1.starts_with("env_") && summary[1].1 != placed,
        "{summary:?}"
    );
    assert_eq!(attempts[1]["resumed_from"], attempts[0]["id"]);

    // The conversation is whole; what the dead box held is named as lost, and the command
    // is not run again.
    let kinds = kinds(&detail);
    let count = |kind: &str| kinds.iter().filter(|(k, _)| k == kind).count();
    assert_eq!(
        (
            count("user_message"),
            count("assistant_message"),
            count("tool_result")
        ),
        (1, 2, 1),
        "{kinds:?}"
    );
    let notices: Vec<&str> = kinds
        .iter()
        .filter(|(k, _)| k == "notice")
        .map(|(_, t)| t.as_str())
        .collect();
    assert!(
        notices.iter().any(|t| t.contains("goes on with it")),
        "{notices:?}"
    );
    assert!(
        notices
            .iter()
            .any(|t| t.contains(&format!("The worker box {placed} stopped"))
                && t.contains("were lost: exec")),
        "{notices:?}"
    );
    assert!(
        kinds
            .iter()
            .any(|(k, t)| k == "tool_result" && t.contains("no result was recorded")),
        "{kinds:?}"
    );
    let shown = std::process::Command::new("git")
        .arg("-C")
        .arg(pair.repo.path())
        .args(["cat-file", "-e", &format!("skiff/{id}:ran.log")])
        .output()
        .unwrap();
    assert!(
        !shown.status.success(),
        "the dead box's commit cannot have come home"
    );
}

#[test]
fn a_gateway_starting_beside_one_with_an_attached_worker_leaves_it_alone_and_forwards_to_it() {
    let script = "[[turns]]\ntext = \"First.\"\n[[turns]]\ntext = \"Second.\"\n";
    let pair = Pair::start(script);
    let id = pair.new_local_session();

    // A third gateway starts while gateway one holds the session's attached worker: its
    // start-up reconciles only what no live gateway holds.
    let env = [("SKIFF_VAULT_KEY", VAULT_KEY)];
    let third = Gateway::join_full(&pair.first, &pair.script, &pair.config, &env);

    // A message through the third is forwarded to the gateway holding the session, whose
    // worker runs it on the same box under the same epoch.
    let out = third.run(&["session", "send", &id, "again"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = pair.first.json(&["session", "show", "--json", &id]);
    let attempts = detail["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[1]["node"], attempts[0]["node"], "{attempts:?}");
    assert_eq!(
        attempts[1]["owner_epoch"], attempts[0]["owner_epoch"],
        "the worker was never replaced: {attempts:?}"
    );
    let placements: Vec<String> = kinds(&detail)
        .into_iter()
        .filter(|(k, _)| k == "notice")
        .map(|(_, t)| t)
        .collect();
    assert!(placements.is_empty(), "{placements:?}");
}
