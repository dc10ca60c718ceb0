//! Several gateways on one PostgreSQL database (issue 17): a session's turn is run by the
//! gateway that admitted it and followed through any other; when that gateway is killed, the
//! other takes the session over and the turn finishes there as a new attempt.

use crate::harness::{Gateway, stderr};
use skiff_test_support::TempGitRepo;
use skiff_test_support::postgres::PgCluster;
use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;
use std::time::Instant;

#[test]
fn a_killed_owners_turn_is_taken_over_by_another_gateway_and_finishes_as_a_new_attempt() {
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let shared = tempfile::tempdir().unwrap();
    let workspaces = shared.path().join("workspaces");
    let signals = shared.path().join("signals");
    std::fs::create_dir_all(&signals).unwrap();
    let fifo = signals.join("started");
    let ran = signals.join("ran.log");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    // Turn 1 runs a command that says it started and then outlives its gateway; turn 2 is
    // what the model answers once the lost call's result is recorded.
    let script = format!(
        "[[turns]]\ntext = \"Running a long command.\"\n[[turns.tool_calls]]\nname = \"exec\"\n\
         arguments = {{ command = \"echo ran >> {ran}; sleep 31452 & echo started > {fifo}; wait\" }}\n\
         [[turns]]\ntext = \"Finished after the takeover.\"\n",
        ran = ran.display(),
        fifo = fifo.display(),
    );
    let config = format!(
        "[gateway]\nlease_ttl = \"2s\"\nlocal_sandbox_paths = [\"{}\"]\n\
         [store]\nurl = \"{url}\"\nworkspaces = \"{}\"\n",
        signals.display(),
        workspaces.display(),
    );
    let mut first = Gateway::start_with(&script, &config);
    let second = Gateway::join(&first, &script, &config);
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);

    // Created and run through the first gateway, followed through the second.
    let started = first.json(&[
        "session",
        "new",
        "--detach",
        "--json",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/slow",
        "run it",
    ]);
    let id = started["session"]["id"].as_str().unwrap().to_owned();
    let mut watch = second
        .cli()
        .args(["session", "watch", &id, "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();

    // The owner is mid-turn once its command says it started.
    let mut said = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    // A turn sent to the other gateway meanwhile is refused, naming the owner.
    let refused = second.run(&["session", "send", &id, "again"]);
    assert!(!refused.status.success());
    let err = stderr(&refused);
    assert!(err.contains("is being run by gateway gw_"), "{err}");

    let killed = Instant::now();
    first.stop();

    // The follower on the second gateway sees the turn through to its end.
    let lines: Vec<serde_json::Value> = BufReader::new(watch.stdout.take().unwrap())
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let status = watch.wait().unwrap();
    eprintln!(
        "takeover: killed owner → turn finished on the other gateway in {} ms (lease_ttl 2s)",
        killed.elapsed().as_millis()
    );
    assert!(status.success(), "the watch ended: {lines:?}");
    assert_eq!(lines.last().unwrap()["status"], "succeeded");

    let detail = second.json(&["session", "show", &id, "--json"]);
    assert_eq!(detail["runs"].as_array().unwrap().len(), 1);
    assert_eq!(detail["runs"][0]["status"], "succeeded");
    let attempts = detail["attempts"].as_array().unwrap();
    let statuses: Vec<&str> = attempts
        .iter()
        .map(|a| a["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["orphaned", "succeeded"], "{attempts:?}");

    // Nothing lost or doubled: the user's message, the first step and its call once, the
    // lost call's result, the notice of the takeover, and the answer.
    let kinds: Vec<(String, String)> = detail["transcript"]
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
        .collect();
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
    assert_eq!(kinds[4].1, "Finished after the takeover.");
    // The command ran once: the new owner did not run it again.
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "ran\n");
}
