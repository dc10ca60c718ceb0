//! A snapshot restored onto a warm box end to end: a session whose setup has a snapshot, with
//! only a box that another setup prepared in the pool, gets that box with its home restored
//! from the snapshot — no new box, no setup.

use crate::harness::stderr;
use crate::setup::{events, placement_details};
use crate::worker::{Rig, new_worker_session, text_reply, tool_reply};
use skiff_test_support::TempGitRepo;
use std::time::{Duration, Instant};

/// Waits until the session is parked and every box is back in the pool.
fn wait_pooled(rig: &Rig, session: &str) {
    crate::worker_faults::wait_placement(rig, session, "parked");
    let deadline = Instant::now() + Duration::from_secs(60);
    while rig.gw.json(&["env", "list", "--json"])["environments"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["state"] != "idle")
    {
        assert!(
            Instant::now() < deadline,
            "the box never came back to the pool"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The output of the session's one `exec`.
fn exec_output(rig: &Rig, session: &str) -> String {
    let detail = rig.gw.json(&["session", "show", "--json", session]);
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap()
}

#[test]
fn a_warm_box_prepared_by_another_setup_is_restored_from_the_snapshot_instead_of_set_up() {
    let runs = r#"{"command":"cat $HOME/setup-runs"}"#;
    let rig = Rig::start(
        vec![
            tool_reply("call_1", "exec", runs),
            text_reply(&["One."]),
            tool_reply("call_2", "exec", runs),
            text_reply(&["Two."]),
            tool_reply("call_3", "exec", runs),
            text_reply(&["Three."]),
        ],
        "keep_attached = \"1s\"\n[gateway]\nlifetime_tick = \"100ms\"\n",
    );
    // Two setups, so two keys; each leaves its mark in the home.
    let first_setup = TempGitRepo::new(&[
        ("README.md", "a repo\n"),
        (".skiff/setup.sh", "echo k1 >> \"$HOME/setup-runs\"\n"),
    ]);
    let second_setup = TempGitRepo::new(&[
        ("README.md", "another repo\n"),
        (".skiff/setup.sh", "echo k2 >> \"$HOME/setup-runs\"\n"),
    ]);

    // A sets up (key 1), keeps a snapshot, and parks.
    let (out, a) = new_worker_session(&rig, first_setup.path(), "One");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    let snapshot = steps
        .iter()
        .find_map(|s| s.split("the prepared box is kept as ").nth(1))
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("no snapshot kept: {steps:?}"))
        .to_owned();
    wait_pooled(&rig, &a);

    // B (key 2) sets up on A's box and parks: the box is prepared for key 2 now.
    let (out, b) = new_worker_session(&rig, second_setup.path(), "Two");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    assert!(
        steps
            .iter()
            .any(|s| s.starts_with("setup ") && s.contains("running .skiff/setup.sh")),
        "{steps:?}"
    );
    assert_eq!(
        exec_output(&rig, &b).lines().skip(1).collect::<Vec<_>>(),
        ["k1", "k2"]
    );
    wait_pooled(&rig, &b);

    // C (key 1) gets that warm box with key 1's home restored: setup does not run, and what
    // B's setup left is gone.
    let (out, c) = new_worker_session(&rig, first_setup.path(), "Three");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_details(&events(&out));
    assert!(
        steps
            .iter()
            .any(|s| s.contains(&format!("(a warm box, its home restored from {snapshot})"))),
        "{steps:?}"
    );
    assert!(!steps.iter().any(|s| s.starts_with("setup ")), "{steps:?}");
    assert_eq!(
        exec_output(&rig, &c).lines().skip(1).collect::<Vec<_>>(),
        ["k1"]
    );
    // One box served all three.
    let envs = rig.gw.json(&["env", "list", "--json"]);
    assert_eq!(envs["environments"].as_array().unwrap().len(), 1, "{envs}");
}
