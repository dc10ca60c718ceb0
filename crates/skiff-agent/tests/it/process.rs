//! `process`: background commands whose output the model reads, which end with the turn
//! unless kept, and with their registry (the session) always.

use crate::procs::{assert_gone, running, started};
use crate::tools::{call, hermetic_home, workspace};
use crate::turn::{Scripted, backend_with_prompt, config, final_turn, tool_turn};
use serde_json::json;
use skiff_agent::tools::{Processes, Tools};
use skiff_agent::{TurnOutcome, run_turn};
use tokio_util::sync::CancellationToken;

/// Reads process `id`'s output until it contains `text` (the process prints it when ready).
async fn output_until(tools: &Tools, id: &str, text: &str) -> String {
    let mut seen = String::new();
    while !seen.contains(text) {
        let out = call(tools, "process", json!({"action": "output", "id": id})).await;
        assert!(!out.is_error, "{}", out.content);
        // The first line is the status; the rest is new output.
        seen.push_str(out.content.split_once('\n').map_or("", |(_, rest)| rest));
        seen = seen.replace("(no new output)", "");
        tokio::task::yield_now().await;
    }
    seen
}

#[tokio::test]
async fn a_background_process_runs_its_output_is_read_and_stop_kills_all_it_started() {
    let (_dir, tools) = workspace();
    let escapees = ["sleep 31441", "sleep 31442"];
    let out = call(
        &tools,
        "process",
        json!({"action": "start", "workdir": "src",
               "command": "setsid sleep 31441 & echo serving from $(basename $PWD); sleep 31442"}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    assert!(
        out.content.starts_with("started process 1:"),
        "{}",
        out.content
    );
    started(&escapees).await;
    let seen = output_until(&tools, "1", "serving from src").await;
    assert_eq!(seen, "serving from src\n");
    let status = call(&tools, "process", json!({"action": "status"})).await;
    assert!(
        status.content.starts_with("process 1 running for"),
        "{}",
        status.content
    );
    // An id given as a number works too.
    let stopped = call(&tools, "process", json!({"action": "stop", "id": 1})).await;
    assert!(!stopped.is_error, "{}", stopped.content);
    assert!(
        stopped
            .content
            .starts_with("process 1 stopped; it and everything it started were killed"),
        "{}",
        stopped.content
    );
    assert_gone(&escapees);
    let gone = call(&tools, "process", json!({"action": "output", "id": "1"})).await;
    assert!(
        gone.is_error && gone.content.contains("no process 1"),
        "{}",
        gone.content
    );
}

#[tokio::test]
async fn a_process_that_exits_reports_its_code_and_last_output() {
    let (_dir, tools) = workspace();
    call(
        &tools,
        "process",
        json!({"action": "start", "command": "echo built; exit 3"}),
    )
    .await;
    let mut status = String::new();
    while !status.contains("exited") {
        status = call(&tools, "process", json!({"action": "status", "id": "1"}))
            .await
            .content;
        tokio::task::yield_now().await;
    }
    let out = call(&tools, "process", json!({"action": "output", "id": "1"})).await;
    assert_eq!(
        out.content,
        "process 1 exited with code 3: echo built; exit 3\nbuilt\n"
    );
}

#[tokio::test]
async fn background_processes_end_with_the_turn_unless_kept_and_with_the_session_always() {
    let dir = tempfile::tempdir().unwrap();
    let session = Processes::for_session();
    let tools = Tools::new(dir.path().to_path_buf(), hermetic_home(dir.path()))
        .unwrap()
        .with_processes(session.clone());
    let model = Scripted(vec![
        tool_turn(&[
            (
                "process",
                json!({"action": "start", "command": "sleep 31451"}),
            ),
            (
                "process",
                json!({"action": "start", "command": "sleep 31452", "keep": true}),
            ),
        ]),
        final_turn("both started"),
    ]);
    let memory = backend_with_prompt();
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, TurnOutcome::Completed);
    assert_gone(&["sleep 31451"]);
    started(&["sleep 31452"]).await;

    // The next turn (new tools, the session's registry) still sees the kept one.
    let next = Tools::new(dir.path().to_path_buf(), hermetic_home(dir.path()))
        .unwrap()
        .with_processes(session.clone());
    let status = call(&next, "process", json!({"action": "status"})).await;
    assert!(
        status.content.starts_with("process 2 running for") && status.content.contains("kept"),
        "{}",
        status.content
    );
    session.stop_all().await;
    assert_gone(&["sleep 31452"]);
}

#[tokio::test]
async fn dropping_the_registry_stops_kept_processes() {
    let (_dir, tools) = workspace();
    let tools = tools.with_processes(Processes::for_session());
    call(
        &tools,
        "process",
        json!({"action": "start", "command": "sleep 31461", "keep": true}),
    )
    .await;
    started(&["sleep 31461"]).await;
    drop(tools);
    // Stopping is asynchronous after a drop: wait for the condition, not for a time.
    while !running("sleep 31461").is_empty() {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn keep_says_so_where_the_runtime_ends_processes_with_the_turn() {
    let (_dir, tools) = workspace();
    let out = call(
        &tools,
        "process",
        json!({"action": "start", "command": "sleep 31471", "keep": true}),
    )
    .await;
    assert!(
        out.content.contains("keep is not available here"),
        "{}",
        out.content
    );
    tools.end_turn().await;
    assert_gone(&["sleep 31471"]);
}
