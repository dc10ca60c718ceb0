//! `skiff gateway drain` (issue 17): two gateways on one PostgreSQL; the one draining hands
//! its running turn to the other at once (no lease expiry waited out), which finishes it as
//! a new attempt with nothing lost or doubled, and exits 0. Alone, a gateway refuses to drain
//! unless forced.

use crate::harness::{Gateway, stderr, stdout};
use skiff_test_support::TempGitRepo;
use skiff_test_support::postgres::PgCluster;
use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;

#[test]
fn a_drained_gateways_running_turn_finishes_on_the_other_as_a_new_attempt_and_it_exits() {
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
    let script = format!(
        "[[turns]]\ntext = \"Running a long command.\"\n[[turns.tool_calls]]\nname = \"exec\"\n\
         arguments = {{ command = \"echo ran >> {ran}; sleep 31453 & echo started > {fifo}; wait\" }}\n\
         [[turns]]\ntext = \"Finished after the hand-over.\"\n",
        ran = ran.display(),
        fifo = fifo.display(),
    );
    // A long lease: the hand-over must not wait for it to expire.
    let config = format!(
        "[gateway]\nlease_ttl = \"15s\"\nlocal_sandbox_paths = [\"{}\"]\n\
         [store]\nurl = \"{url}\"\nworkspaces = \"{}\"\n",
        signals.display(),
        workspaces.display(),
    );
    let mut first = Gateway::start_with(&script, &config);
    let second = Gateway::join(&first, &script, &config);
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);

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
    // Gateway one is mid-turn once its command says it started.
    let mut said = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();

    let asked = std::time::Instant::now();
    let drained = first.run(&["gateway", "drain", "--json"]);
    assert!(drained.status.success(), "{}", stderr(&drained));
    let report: serde_json::Value = serde_json::from_str(stdout(&drained).trim()).unwrap();
    assert_eq!(report["handed_over"], 1, "{report}");
    assert_eq!(report["turns"], 1, "{report}");
    assert!(report["gateway"].as_str().unwrap().starts_with("gw_"));
    assert!(report["seconds"].as_f64().is_some(), "{report}");
    let exit = first.wait_exit();
    assert!(exit.success(), "the drained gateway exited with {exit}");

    // The follower on the second gateway sees the turn through to its end, which the
    // second gateway reached within a lease round (5 s), not the lease's 15 s.
    let lines: Vec<serde_json::Value> = BufReader::new(watch.stdout.take().unwrap())
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    assert!(
        watch.wait().unwrap().success(),
        "the watch ended: {lines:?}"
    );
    eprintln!(
        "drain: asked → turn finished on the other gateway in {} ms (lease_ttl 15s)",
        asked.elapsed().as_millis()
    );
    assert_eq!(lines.last().unwrap()["status"], "succeeded");

    let detail = second.json(&["session", "show", &id, "--json"]);
    assert_eq!(detail["runs"].as_array().unwrap().len(), 1);
    assert_eq!(detail["runs"][0]["status"], "succeeded");
    let statuses: Vec<&str> = detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["orphaned", "succeeded"], "{detail}");
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
    assert!(
        kinds[2]
            .1
            .contains("draining gateway handed this turn over"),
        "{kinds:?}"
    );
    assert!(kinds[3].1.contains("no result was recorded"), "{kinds:?}");
    assert_eq!(kinds[4].1, "Finished after the hand-over.");
    // The command ran once: the second gateway did not run it again.
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "ran\n");

    // The second gateway is now alone: it refuses to drain, and stays up.
    let refused = second.run(&["gateway", "drain"]);
    assert_eq!(refused.status.code(), Some(5), "{}", stderr(&refused));
    let err = stderr(&refused);
    assert!(
        err.contains("only live gateway") && err.contains("--force"),
        "{err}"
    );
    let listed = second.run(&["session", "show", &id]);
    assert!(listed.status.success(), "{}", stderr(&listed));
}

/// A session whose lease gateway one holds between turns (as a gateway with the session's
/// worker box attached does) gets its next message through gateway two: the request is
/// forwarded with the caller's token, the turn runs on gateway one, and the forward is
/// audited without the token.
#[test]
fn a_message_through_another_gateway_runs_on_the_gateway_holding_the_session() {
    let cluster = PgCluster::start();
    let url = cluster.fresh_database();
    let shared = tempfile::tempdir().unwrap();
    let script = "[[turns]]\ntext = \"First.\"\n[[turns]]\ntext = \"Second, on its owner.\"\n";
    let config = format!(
        "[gateway]\nlocal_sandbox = \"off\"\n[store]\nurl = \"{url}\"\nworkspaces = \"{}\"\n",
        shared.path().display()
    );
    let first = Gateway::start_with(script, &config);
    // A person's token, made on gateway one: every gateway checks tokens in the database.
    let added = first.run(&[
        "admin",
        "user",
        "add",
        "dana@alpha.test",
        "--role",
        "member",
        "--tenant",
        "alpha",
    ]);
    assert!(added.status.success(), "{}", stderr(&added));
    let made = first.run(&[
        "admin",
        "token",
        "create",
        "--user",
        "dana@alpha.test",
        "--scope",
        "write",
        "--expires",
        "1d",
    ]);
    assert!(made.status.success(), "{}", stderr(&made));
    let token = stdout(&made).trim().to_owned();
    let second = Gateway::join(&first, script, &config);
    let as_dana = |gw: &Gateway, args: &[&str]| {
        gw.cli()
            .env("SKIFF_URL", &gw.url)
            .env("SKIFF_TOKEN", &token)
            .args(args)
            .output()
            .unwrap()
    };
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let created = as_dana(
        &first,
        &[
            "session",
            "new",
            "--json",
            "--workspace",
            repo.path().to_str().unwrap(),
            "--model",
            "fake/m",
            "one",
        ],
    );
    assert!(created.status.success(), "{}", stderr(&created));
    let first_line: serde_json::Value =
        serde_json::from_str(stdout(&created).lines().next().unwrap()).unwrap();
    let id = first_line["session_id"].as_str().unwrap().to_owned();

    // Gateway one keeps the session between turns.
    let one = std::fs::read_to_string(first.state_dir.join("gateway-id")).unwrap();
    let one = skiff_protocol::GatewayId::parse(one.trim()).unwrap();
    let session = skiff_protocol::SessionId::parse(&id).unwrap();
    let key = skiff_store::LeaseKey::Session(session);
    // The gateways' own database (the harness's `store()` is the state dir's file).
    let store = skiff_store::open_backend(skiff_store::Location::Postgres {
        url: &url,
        password: None,
    })
    .unwrap();
    let kept = store
        .acquire_lease(&key, &one, std::time::Duration::from_secs(300))
        .unwrap();
    assert!(matches!(kept, skiff_store::Claim::Won(_)), "{kept:?}");

    let sent = as_dana(&second, &["session", "send", &id, "--json", "two"]);
    assert!(sent.status.success(), "{}", stderr(&sent));
    let shown = as_dana(&second, &["session", "show", &id, "--json"]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let detail: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    let runs = detail["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{detail}");
    assert_eq!(runs[1]["status"], "succeeded", "{detail}");
    let texts: Vec<&str> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["body"]["text"].as_str())
        .collect();
    assert_eq!(texts, ["one", "First.", "two", "Second, on its owner."]);
    // Gateway two never held the session: gateway one ran the turn (and lets go at its end).
    let lease = store.lease(&key).unwrap();
    assert!(lease.as_ref().is_none_or(|l| l.holder == one), "{lease:?}");

    let audit = second.run(&["audit", "tail", "-n", "200", "--json"]);
    assert!(audit.status.success(), "{}", stderr(&audit));
    let rows = stdout(&audit);
    let forward = rows
        .lines()
        .find(|l| l.contains("request.forward"))
        .unwrap_or_else(|| panic!("no forward audited: {rows}"));
    assert!(forward.contains(one.as_str()), "{forward}");
    assert!(!rows.contains(&token), "the token reached the audit trail");
}
