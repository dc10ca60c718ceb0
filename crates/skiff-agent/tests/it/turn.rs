use crate::procs::{assert_gone, started};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::json;
use skiff_agent::tools::Tools;
use skiff_agent::{AgentConfig, BackendError, ModelClient, SessionBackend, TurnOutcome, run_turn};
use skiff_protocol::EntryId;
use skiff_protocol::event::EventKind;
use skiff_protocol::model::{
    Message, ModelErrorKind, ModelEvent, ModelRef, ModelRequest, StopReason, ToolCall,
};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use std::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// Plays reply N when the context holds N assistant messages.
pub(crate) struct Scripted(pub(crate) Vec<Vec<ModelEvent>>);

impl ModelClient for Scripted {
    fn stream(
        &self,
        request: ModelRequest,
        _cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        let n = request
            .messages
            .iter()
            .filter(|m| matches!(m, Message::Assistant { .. }))
            .count();
        stream::iter(self.0.get(n).cloned().unwrap_or_default()).boxed()
    }
}

#[derive(Default)]
pub(crate) struct Memory {
    pub(crate) entries: Mutex<Vec<TranscriptEntry>>,
    events: Mutex<Vec<EventKind>>,
    /// Asks for a live handoff once the transcript holds this many entries (0: never).
    pub(crate) hand_off_at: std::sync::atomic::AtomicUsize,
    /// How many tool starts are admitted before this owner is fenced (`None`: never fenced).
    pub(crate) fenced_after: Mutex<Option<usize>>,
}

impl SessionBackend for Memory {
    async fn admit_tool(&self, call: &ToolCall) -> Result<(), String> {
        let mut left = self.fenced_after.lock().unwrap();
        match left.as_mut() {
            None => Ok(()),
            Some(0) => Err(format!(
                "the gateway refused {}'s start (stale_epoch): owner epoch 2 is stale",
                call.id
            )),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
        }
    }

    fn handing_off(&self) -> bool {
        let at = self.hand_off_at.load(std::sync::atomic::Ordering::SeqCst);
        at > 0 && self.entries.lock().unwrap().len() >= at
    }

    async fn transcript(&self) -> Result<Vec<TranscriptEntry>, BackendError> {
        Ok(self.entries.lock().unwrap().clone())
    }

    async fn commit(
        &self,
        base_leaf: Option<EntryId>,
        bodies: Vec<EntryBody>,
    ) -> Result<Vec<TranscriptEntry>, BackendError> {
        let mut entries = self.entries.lock().unwrap();
        if entries.last().map(|e| e.id.clone()) != base_leaf {
            return Err(BackendError("stale leaf".into()));
        }
        let mut out = Vec::new();
        for body in bodies {
            let entry = TranscriptEntry {
                id: EntryId::from_suffix(&format!("e{}", entries.len())),
                parent_id: entries.last().map(|e| e.id.clone()),
                run_id: None,
                created_at_ms: 0,
                body,
            };
            entries.push(entry.clone());
            out.push(entry);
        }
        Ok(out)
    }

    async fn publish(&self, event: EventKind) {
        self.events.lock().unwrap().push(event);
    }

    async fn gateway_tool(
        &self,
        name: &str,
        arguments: &serde_json::Value,
        _cancel: &CancellationToken,
    ) -> skiff_agent::tools::ToolOutput {
        skiff_agent::tools::ToolOutput::ok(format!("gateway ran {name} with {arguments}"))
    }
}

pub(crate) fn tool_turn(calls: &[(&str, serde_json::Value)]) -> Vec<ModelEvent> {
    let mut events = vec![ModelEvent::TextDelta {
        text: "working".into(),
    }];
    for (i, (name, args)) in calls.iter().enumerate() {
        events.push(ModelEvent::ToolCall {
            call: ToolCall {
                id: format!("call_{i}"),
                name: (*name).into(),
                arguments: args.clone(),
            },
        });
    }
    events.push(ModelEvent::Done {
        stop_reason: StopReason::ToolUse,
    });
    events
}

pub(crate) fn final_turn(text: &str) -> Vec<ModelEvent> {
    vec![
        ModelEvent::TextDelta { text: text.into() },
        ModelEvent::Done {
            stop_reason: StopReason::EndTurn,
        },
    ]
}

pub(crate) fn config() -> AgentConfig {
    AgentConfig {
        reasoning: None,
        model: ModelRef::parse("scripted/test").unwrap(),
        model_label: "scripted/test (scripted)".into(),
        max_steps: 10,
        max_output_tokens: 1024,
        context_window: 0,
        compact_at: skiff_agent::compact::DEFAULT_COMPACT_AT,
        agent_instructions: None,
    }
}

pub(crate) fn backend_with_prompt() -> Memory {
    let memory = Memory::default();
    memory.entries.lock().unwrap().push(TranscriptEntry {
        id: EntryId::from_suffix("user"),
        parent_id: None,
        run_id: None,
        created_at_ms: 0,
        body: EntryBody::UserMessage { text: "go".into() },
    });
    memory
}

pub(crate) fn kinds(memory: &Memory) -> Vec<&'static str> {
    memory
        .entries
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.body.kind())
        .collect()
}

#[tokio::test]
async fn a_live_handoff_stops_the_loop_after_a_committed_step_and_a_new_loop_goes_on_from_the_transcript()
 {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    let model = Scripted(vec![tool_turn(&[("ls", json!({}))]), final_turn("done")]);
    let memory = backend_with_prompt();
    // Asked once the first step's result is committed: the loop stops before its next request.
    memory
        .hand_off_at
        .store(3, std::sync::atomic::Ordering::SeqCst);
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, TurnOutcome::HandedOff);
    assert_eq!(
        kinds(&memory),
        ["user_message", "assistant_message", "tool_result"]
    );
    let asked = |memory: &Memory| {
        memory
            .events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| matches!(e, EventKind::ModelRequest { .. }))
            .count()
    };
    assert_eq!(asked(&memory), 1, "the next model request was not made");
    // The new owner's loop takes the turn up from the transcript: nothing lost or doubled.
    memory
        .hand_off_at
        .store(0, std::sync::atomic::Ordering::SeqCst);
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, TurnOutcome::Completed);
    assert_eq!(
        kinds(&memory),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "assistant_message"
        ]
    );
    assert_eq!(asked(&memory), 2);
}

#[tokio::test]
async fn failing_tools_become_results_and_the_loop_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    let model = Scripted(vec![
        tool_turn(&[
            ("read", json!({"path": "../etc/passwd"})),
            ("read", json!({"path": 7})),
            ("nope", json!({})),
        ]),
        final_turn("done"),
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
    assert_eq!(
        kinds(&memory),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "tool_result",
            "tool_result",
            "assistant_message"
        ]
    );
    let entries = memory.entries.lock().unwrap();
    for entry in &entries[2..5] {
        assert!(
            matches!(entry.body, EntryBody::ToolResult { is_error: true, .. }),
            "{entry:?}"
        );
    }
    let events = memory.events.lock().unwrap();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EventKind::ToolFinished { is_error: true, .. }))
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EventKind::TextDelta { text } if text == "done"))
    );
}

#[tokio::test]
async fn a_model_error_fails_the_turn_with_a_notice() {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    let model = Scripted(vec![vec![
        ModelEvent::TextDelta {
            text: "partial".into(),
        },
        ModelEvent::Error {
            kind: ModelErrorKind::Connection,
            message: "connection closed".into(),
        },
    ]]);
    let memory = backend_with_prompt();
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert!(
        matches!(&outcome, TurnOutcome::Failed(m) if m.contains("connection closed")),
        "{outcome:?}"
    );
    assert_eq!(
        kinds(&memory),
        ["user_message", "assistant_message", "notice"]
    );
}

#[tokio::test]
async fn cancelling_a_never_ending_command_ends_the_turn_and_kills_all_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    let escapees = ["sleep 31431", "sleep 31432"];
    let command = "setsid sleep 31431 & ( (sleep 31432 &) & ); while :; do sleep 1; done";
    let model = Scripted(vec![tool_turn(&[
        ("exec", json!({"command": command})),
        ("ls", json!({})),
    ])]);
    let memory = backend_with_prompt();
    let cancel = CancellationToken::new();
    let config = config();
    let (outcome, ()) = tokio::join!(run_turn(&model, &memory, &tools, &config, &cancel), async {
        // Cancel once the command runs with everything it started.
        started(&escapees).await;
        cancel.cancel();
    });
    assert_eq!(outcome, TurnOutcome::Cancelled);
    assert_gone(&escapees);
    // Every tool call has a result (the second one was not run), then the notice.
    assert_eq!(
        kinds(&memory),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "tool_result",
            "notice"
        ]
    );
}

#[tokio::test]
async fn reading_a_fifo_does_not_wedge_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        std::process::Command::new("mkfifo")
            .arg(dir.path().join("pipe"))
            .status()
            .unwrap()
            .success()
    );
    let tools = Tools::new(dir.path().to_path_buf(), Vec::new()).unwrap();
    let model = Scripted(vec![
        tool_turn(&[("read", json!({"path": "pipe"}))]),
        final_turn("it is a pipe"),
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
    let entries = memory.entries.lock().unwrap();
    let result = entries
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .unwrap();
    assert!(result.1, "{}", result.0);
    assert!(result.0.contains("pipe is a FIFO"), "{}", result.0);
}

#[tokio::test]
async fn gateway_tools_go_through_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    let model = Scripted(vec![
        tool_turn(&[("web_fetch", json!({"url": "https://example.invalid/"}))]),
        final_turn("fetched"),
    ]);
    let backend = backend_with_prompt();
    let tools = Tools::new(dir.path().to_path_buf(), Vec::new()).unwrap();
    let outcome = run_turn(
        &model,
        &backend,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, TurnOutcome::Completed);
    let entries = backend.entries.lock().unwrap();
    let result = entries
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult { content, .. } => Some(content.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        result,
        r#"gateway ran web_fetch with {"url":"https://example.invalid/"}"#
    );
}

/// Plays a script and keeps every request it was sent.
struct Recording {
    script: Scripted,
    requests: Mutex<Vec<ModelRequest>>,
}

impl Recording {
    fn new(script: Vec<Vec<ModelEvent>>) -> Self {
        Self {
            script: Scripted(script),
            requests: Mutex::default(),
        }
    }
}

impl ModelClient for Recording {
    fn stream(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        self.requests.lock().unwrap().push(request.clone());
        self.script.stream(request, cancel)
    }
}

/// Runs a turn that lists the workspace and finishes, in a workspace holding `agents_md`.
async fn turn_with_instructions(agents_md: &str) -> (tempfile::TempDir, Memory, Vec<ModelRequest>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("AGENTS.md"), agents_md).unwrap();
    let tools = Tools::new(dir.path().to_path_buf(), Vec::new()).unwrap();
    let model = Recording::new(vec![tool_turn(&[("ls", json!({}))]), final_turn("done")]);
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
    let requests = model.requests.into_inner().unwrap();
    (dir, memory, requests)
}

#[tokio::test]
async fn agents_md_reaches_every_request_and_people_are_told() {
    let (_dir, memory, requests) =
        turn_with_instructions("Run `make check` before you finish.\n").await;
    assert_eq!(requests.len(), 2);
    for request in &requests {
        assert!(
            request
                .system
                .ends_with("# Project instructions\n\nThe workspace's AGENTS.md says the following; follow it unless the user asks otherwise.\n\nRun `make check` before you finish.\n"),
            "{}",
            request.system
        );
        // Instructions are not a message of the conversation.
        assert!(matches!(&request.messages[0], Message::User { text } if text == "go"));
    }
    let entries = memory.entries.lock().unwrap();
    assert!(
        matches!(&entries[1].body, EntryBody::Notice { text } if text == "project instructions: AGENTS.md (36 bytes)"),
        "{:?}",
        entries[1]
    );
    let events = memory.events.lock().unwrap();
    assert!(events.iter().any(|e| matches!(e,
        EventKind::Entry { entry } if matches!(&entry.body, EntryBody::Notice { text } if text.starts_with("project instructions: AGENTS.md")))));
}

#[tokio::test]
async fn agents_md_is_bounded_and_the_same_bytes_wherever_the_workspace_lies() {
    let big = "Prefer small functions; name things for the reader.\n".repeat(2000);
    let (dir_a, memory_a, requests_a) = turn_with_instructions(&big).await;
    let (dir_b, _memory_b, requests_b) = turn_with_instructions(&big).await;
    assert_ne!(dir_a.path(), dir_b.path());
    assert_eq!(
        serde_json::to_vec(&requests_a).unwrap(),
        serde_json::to_vec(&requests_b).unwrap(),
        "the requests differ between two workspace locations"
    );
    let system = &requests_a[0].system;
    assert!(!system.contains(dir_a.path().to_str().unwrap()));
    assert!(
        system.len() < skiff_agent::MAX_INSTRUCTIONS_BYTES + 2048,
        "{} bytes of system text",
        system.len()
    );
    assert!(
        system.contains("[AGENTS.md is 101.6 KiB; only its first 32 KiB are shown here."),
        "{}",
        &system[system.len() - 300..]
    );
    let entries = memory_a.entries.lock().unwrap();
    assert!(
        matches!(&entries[1].body, EntryBody::Notice { text } if text == "project instructions: AGENTS.md (101.6 KiB, only the first 32 KiB given to the model)"),
        "{:?}",
        entries[1]
    );
}

#[tokio::test]
async fn without_agents_md_nothing_is_added() {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(dir.path().to_path_buf(), Vec::new()).unwrap();
    let model = Recording::new(vec![final_turn("done")]);
    let memory = backend_with_prompt();
    run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert!(
        !model.requests.lock().unwrap()[0]
            .system
            .contains("Project instructions")
    );
    assert_eq!(kinds(&memory), ["user_message", "assistant_message"]);
}

/// A workspace that is a subfolder of a repository gets the AGENTS.md of every folder from the
/// repository root down to it, root first, each under its path; a folder between them without
/// one is skipped, and the system text names no absolute path.
#[tokio::test]
async fn agents_md_from_parent_folders_up_to_the_repository_root_reach_the_request() {
    let repo = tempfile::tempdir().unwrap();
    let workspace = repo.path().join("services/api");
    std::fs::create_dir_all(&workspace).unwrap();
    std::fs::write(repo.path().join("AGENTS.md"), "Use conventional commits.\n").unwrap();
    std::fs::write(workspace.join("AGENTS.md"), "Run `make api-test`.\n").unwrap();
    let tools = Tools::new(workspace.clone(), Vec::new())
        .unwrap()
        .with_repository_root(repo.path())
        .unwrap();
    let model = Recording::new(vec![final_turn("done")]);
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
    let requests = model.requests.into_inner().unwrap();
    let system = &requests[0].system;
    assert!(
        system.ends_with(
            "# Project instructions\n\nThese AGENTS.md files say the following, the repository \
             root's first; where they disagree, the one nearer the workspace wins. Follow them \
             unless the user asks otherwise.\n\n## AGENTS.md\n\nUse conventional commits.\n\n\n\
             ## services/api/AGENTS.md\n\nRun `make api-test`.\n"
        ),
        "{system}"
    );
    assert!(!system.contains(&repo.path().display().to_string()));
    let entries = memory.entries.lock().unwrap();
    assert!(
        matches!(&entries[1].body, EntryBody::Notice { text } if text == "project instructions: AGENTS.md (26 bytes), services/api/AGENTS.md (21 bytes)"),
        "{:?}",
        entries[1]
    );
    drop(entries);

    // A repository root that is not above the workspace is refused by name.
    let other = tempfile::tempdir().unwrap();
    let err = Tools::new(workspace, Vec::new())
        .unwrap()
        .with_repository_root(other.path())
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("is not a folder above the workspace root"),
        "{err}"
    );
}

#[tokio::test]
async fn an_owner_fenced_during_a_step_starts_none_of_its_remaining_tools() {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    let model = Scripted(vec![
        tool_turn(&[
            ("exec", json!({"command": "echo one >> runs.log"})),
            ("exec", json!({"command": "echo two >> runs.log"})),
        ]),
        final_turn("done"),
    ]);
    let memory = backend_with_prompt();
    // The first call is admitted; the owner is fenced before the second one starts.
    *memory.fenced_after.lock().unwrap() = Some(1);
    run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(dir.path().join("runs.log")).unwrap(),
        "one\n",
        "a tool ran after its owner was fenced"
    );
    let entries = memory.entries.lock().unwrap();
    let refused = entries
        .iter()
        .find_map(|e| match &e.body {
            EntryBody::ToolResult {
                call_id,
                content,
                is_error,
                ..
            } if call_id == "call_1" => Some((content.clone(), *is_error)),
            _ => None,
        })
        .expect("the refused call has its result");
    assert!(refused.1, "{refused:?}");
    assert!(
        refused.0.starts_with("not run: ") && refused.0.contains("stale_epoch"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn calls_a_stopped_runtime_left_unanswered_get_their_result_entry_and_are_not_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let tools = Tools::new(
        dir.path().to_path_buf(),
        crate::tools::hermetic_home(dir.path()),
    )
    .unwrap();
    let memory = backend_with_prompt();
    {
        // The previous owner committed a step of two calls and the first one's result, then
        // stopped while the second ran.
        let mut entries = memory.entries.lock().unwrap();
        let step = tool_turn(&[
            ("exec", json!({"command": "echo one >> runs.log"})),
            ("exec", json!({"command": "echo two >> runs.log"})),
        ]);
        let tool_calls: Vec<ToolCall> = step
            .into_iter()
            .filter_map(|e| match e {
                ModelEvent::ToolCall { call } => Some(call),
                _ => None,
            })
            .collect();
        for (n, body) in [
            EntryBody::AssistantMessage {
                text: "working".into(),
                tool_calls,
                model: "scripted/test (scripted)".into(),
                usage: Default::default(),
                stop_reason: StopReason::ToolUse,
                reasoning: Vec::new(),
            },
            EntryBody::ToolResult {
                call_id: "call_0".into(),
                name: "exec".into(),
                content: "ok".into(),
                is_error: false,
                images: Vec::new(),
            },
        ]
        .into_iter()
        .enumerate()
        {
            let entry = TranscriptEntry {
                id: EntryId::from_suffix(&format!("prev{n}")),
                parent_id: entries.last().map(|e| e.id.clone()),
                run_id: None,
                created_at_ms: 0,
                body,
            };
            entries.push(entry);
        }
    }
    let model = Scripted(vec![Vec::new(), final_turn("done")]);
    let outcome = run_turn(
        &model,
        &memory,
        &tools,
        &config(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, TurnOutcome::Completed);
    assert_eq!(
        kinds(&memory),
        [
            "user_message",
            "assistant_message",
            "tool_result",
            "tool_result",
            "assistant_message"
        ]
    );
    let entries = memory.entries.lock().unwrap();
    match &entries[3].body {
        EntryBody::ToolResult {
            call_id,
            content,
            is_error,
            ..
        } => {
            assert_eq!(call_id, "call_1");
            assert!(*is_error);
            assert!(
                content.starts_with("no result was recorded for this call"),
                "{content}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Neither call ran here: the new owner never repeats a call behind the model's back.
    assert!(!dir.path().join("runs.log").exists());
}
