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
