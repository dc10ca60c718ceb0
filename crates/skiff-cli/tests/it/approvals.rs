//! `skiff approve`, `skiff deny` and `skiff approvals` against a real gateway: `session new`
//! shows the call that waits and how to decide it, and the decision reaches the agent.

use crate::harness::{Gateway, stderr, stdout};
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

const SCRIPT: &str = r#"
[[turns]]
text = "Cleaning up."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned-up" }

[[turns]]
text = "First turn done."

[[turns]]
text = "Cleaning again."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "rm -rf build && echo cleaned-again" }

[[turns]]
text = "Second turn done."
"#;

/// Reads `child`'s stderr until the line that asks for approval; returns the approval id and
/// the line, and hands the rest of stderr back to be drained.
fn wait_for_ask(child: &mut Child) -> (String, String, BufReader<std::process::ChildStderr>) {
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = err.read_line(&mut line).unwrap();
        assert!(n > 0, "the command ended without asking: {seen}");
        seen.push_str(&line);
        if let Some(rest) = line.strip_prefix("approval needed: ") {
            let id = rest.split_whitespace().next().unwrap().to_owned();
            return (id, line, err);
        }
    }
}

#[test]
fn a_call_waits_in_the_cli_until_skiff_approve_or_deny_decides_it() {
    let gw = Gateway::start(SCRIPT);
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("build")).unwrap();
    std::fs::write(ws.path().join("build/x.o"), "x").unwrap();

    let mut new = gw
        .cli()
        .args([
            "session",
            "new",
            "--workspace",
            ws.path().to_str().unwrap(),
            "--model",
            "fake/e2e",
            "--approval",
            r#"{ exec = ["rm *"] }"#,
            "clean up",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (id, line, mut rest) = wait_for_ask(&mut new);
    assert!(id.starts_with("apr_"), "{line}");
    assert!(
        line.contains(r#"exec "rm -rf build && echo cleaned-up""#)
            && line.contains(&format!("skiff approve {id} / skiff deny {id} [--reason]")),
        "{line}"
    );
    let pending = gw.json(&["approvals", "--pending", "--json"]);
    assert_eq!(pending["approvals"][0]["id"], id.as_str());
    assert_eq!(pending["approvals"][0]["state"], "pending");
    let session = pending["approvals"][0]["session_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let approved = gw.run(&["approve", &id]);
    assert!(approved.status.success(), "{}", stderr(&approved));
    assert!(
        stdout(&approved).starts_with(&format!("approved {id} exec")),
        "{}",
        stdout(&approved)
    );
    let out = new.wait_with_output().unwrap();
    let mut tail = String::new();
    std::io::Read::read_to_string(&mut rest, &mut tail).unwrap();
    assert!(out.status.success(), "{tail}");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("cleaned-up"), "{shown}");
    assert!(
        tail.contains(&format!("approval {id} approved by")),
        "{tail}"
    );

    // The second turn's call is denied with a reason the agent reads.
    let mut send = gw
        .cli()
        .args(["session", "send", &session, "clean again"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (second, _, mut rest) = wait_for_ask(&mut send);
    let denied = gw.run(&["deny", &second, "--reason", "keep the build cache"]);
    assert!(denied.status.success(), "{}", stderr(&denied));
    let out = send.wait_with_output().unwrap();
    let mut tail = String::new();
    std::io::Read::read_to_string(&mut rest, &mut tail).unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("denied this call") && shown.contains("keep the build cache"),
        "{shown}\n{tail}"
    );

    // Deciding again is a conflict (exit 5); a malformed id is a usage error (exit 2).
    let again = gw.run(&["approve", &second]);
    assert_eq!(again.status.code(), Some(5), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("already denied"),
        "{}",
        stderr(&again)
    );
    let bad = gw.run(&["deny", "ses_nope"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));

    let table = gw.run(&["approvals", "--session", &session]);
    let table = stdout(&table);
    assert!(
        table.contains(&id) && table.contains("approved") && table.contains("denied"),
        "{table}"
    );
    assert!(table.contains("keep the build cache"), "{table}");
}

/// A worker session under its profile's policy: the box's call asks the gateway, an approval
/// lets it run on the box, and a pull-back revokes the one that waits (the call is not run).
#[test]
fn a_worker_sessions_call_waits_for_the_gateway_and_a_pull_back_revokes_it() {
    use crate::worker::{Rig, new_worker_session_args, text_reply, tool_reply};
    use crate::worker_faults::Following;
    use skiff_test_support::TempGitRepo;

    let rig = Rig::start(
        vec![
            tool_reply("c1", "exec", r#"{"command":"echo ran on the box"}"#),
            text_reply(&["first turn done"]),
            tool_reply(
                "c2",
                "exec",
                r#"{"command":"echo must not run > marker.txt"}"#,
            ),
            text_reply(&["second turn done"]),
            text_reply(&["spare"]),
        ],
        "approval = { exec = [\"echo *\"] }\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let pending = |e: &serde_json::Value, _: &[serde_json::Value]| {
        e["type"] == "approval" && e["approval"]["state"] == "pending"
    };

    let mut turn = Following::start(&rig, &new_worker_session_args(repo.path(), "run it"));
    let asked = turn.until("a pending approval", pending);
    let apr = asked["approval"]["id"].as_str().unwrap().to_owned();
    let session = asked["session_id"].as_str().unwrap().to_owned();
    assert!(
        asked["approval"]["requested_by"]
            .as_str()
            .unwrap()
            .starts_with("worker env_"),
        "{asked}"
    );
    assert_eq!(asked["approval"]["subject"], "echo ran on the box");
    let out = rig.gw.run(&["approve", &apr]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (status, seen) = turn.finish();
    assert!(status.success(), "{seen:#?}");
    let detail = rig.gw.json(&["session", "show", "--json", &session]);
    assert_eq!(detail["session"]["placement"], "active");
    let results: Vec<&serde_json::Value> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .collect();
    assert!(
        results[0]["body"]["content"]
            .as_str()
            .unwrap()
            .contains("ran on the box"),
        "{results:#?}"
    );

    let mut turn = Following::start(&rig, &["send", "--json", &session, "again"]);
    let asked = turn.until("a second pending approval", pending);
    let second = asked["approval"]["id"].as_str().unwrap().to_owned();
    let out = rig.gw.run(&["session", "pull-back", "--cancel", &session]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (status, _) = turn.finish();
    assert!(!status.success(), "the cancelled turn's follower succeeded");
    let list = rig.gw.json(&["approvals", "--session", &session, "--json"]);
    let row = list["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == second.as_str())
        .unwrap()
        .clone();
    assert_eq!(row["state"], "revoked", "{row}");
    assert_eq!(row["reason"], "the session is pulled back to the gateway");
    let detail = rig.gw.json(&["session", "show", "--json", &session]);
    assert_eq!(detail["session"]["placement"], "local");
    let home = detail["session"]["workspace"]["path"].as_str().unwrap();
    assert!(
        !std::path::Path::new(home).join("marker.txt").exists(),
        "the revoked call ran"
    );
}
