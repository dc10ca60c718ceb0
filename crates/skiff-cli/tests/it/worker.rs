//! Worker sessions end to end: a real gateway, a real local box (sshd in a network namespace,
//! its own user), the real `skiff worker` on it behind the SSH tunnel, and a fake
//! OpenAI-compatible provider (the only stand-in) that the gateway alone talks to.

use crate::env::BoxRoot;
use crate::harness::{Gateway, git, stderr, stdout};
use serde_json::Value;
use skiff_test_support::{FakeProvider, FakeResponse};
use skiff_test_support::{TempGitRepo, openai_sse};
use std::path::Path;

/// The provider key the gateway holds; it must never reach a box.
pub const PROVIDER_KEY: &str = "sk-test-provider-key-7c1d2e9f";

/// A gateway with an `openai` provider served by a fake, a `local` worker profile with boxes
/// under a root of the test's own, and the fake's runtime.
pub struct Rig {
    pub gw: Gateway,
    pub root: BoxRoot,
    pub fake: FakeProvider,
    _rt: tokio::runtime::Runtime,
}

impl Rig {
    pub fn start(responses: Vec<FakeResponse>, extra_config: &str) -> Rig {
        Self::start_with_env(responses, extra_config, &[])
    }

    /// Like [`Rig::start`], with more variables in the gateway's environment.
    pub fn start_with_env(
        responses: Vec<FakeResponse>,
        extra_config: &str,
        env: &[(&str, &str)],
    ) -> Rig {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let fake = rt.block_on(FakeProvider::start(responses));
        Self::serving(rt, fake, extra_config, env)
    }

    /// Like [`Rig::start`], with a fake whose answers `responder` computes from the requests
    /// so far (for sessions whose model calls interleave).
    pub fn start_with_responder(
        responder: impl FnMut(&[skiff_test_support::RecordedRequest]) -> FakeResponse + Send + 'static,
        extra_config: &str,
    ) -> Rig {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let fake = rt.block_on(FakeProvider::start_with(responder));
        Self::serving(rt, fake, extra_config, &[])
    }

    fn serving(
        rt: tokio::runtime::Runtime,
        fake: FakeProvider,
        extra_config: &str,
        env: &[(&str, &str)],
    ) -> Rig {
        let root = BoxRoot::new();
        // `{fake_url}` in the extra configuration is the fake's address (for more providers).
        let extra_config = extra_config.replace("{fake_url}", &fake.base_url());
        let config = format!(
            "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{}/v1\"\napi_key_env = \"SKIFF_TEST_PROVIDER_KEY\"\n\
             [profiles.local]\nprovider = \"local\"\nroot = \"{}\"\n{extra_config}",
            fake.base_url(),
            root.path().display()
        );
        let mut env = env.to_vec();
        env.push(("SKIFF_TEST_PROVIDER_KEY", PROVIDER_KEY));
        let gw = Gateway::start_full("", &config, &env);
        Rig {
            gw,
            root,
            fake,
            _rt: rt,
        }
    }

    /// `session new` (or `send`) with `args`, to the end of its turn; returns the output.
    pub fn session(&self, args: &[&str]) -> std::process::Output {
        self.gw.run(&[&["session"], args].concat())
    }
}

/// A model reply that calls one tool.
pub fn tool_reply(id: &str, name: &str, args: &str) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&["On it."]);
    events.extend(openai_sse::tool_call(0, id, name, args, 3));
    events.extend(openai_sse::finish("tool_calls"));
    events.extend(openai_sse::usage(120, 30));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

/// A final model reply.
pub fn text_reply(texts: &[&str]) -> FakeResponse {
    let mut events = openai_sse::text_chunks(texts);
    events.extend(openai_sse::finish("stop"));
    events.extend(openai_sse::usage(200, 10));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

/// Write a file, run a command, commit: what the agent does in the end-to-end tests.
pub fn write_run_commit() -> Vec<FakeResponse> {
    vec![
        tool_reply(
            "call_1",
            "write",
            r#"{"path":"hello.txt","content":"hello from the box\n"}"#,
        ),
        tool_reply(
            "call_2",
            "exec",
            r#"{"command":"cat hello.txt && wc -c hello.txt"}"#,
        ),
        tool_reply(
            "call_3",
            "exec",
            r#"{"command":"git add hello.txt && git commit -q -m 'Add hello' && git log --format=%s -1"}"#,
        ),
        text_reply(&["Wrote ", "hello.txt, ", "ran it, committed."]),
    ]
}

/// The transcript without what differs between any two sessions (ids, times, runs).
pub fn semantic(transcript: &Value) -> Vec<Value> {
    transcript
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["body"].clone())
        .collect()
}

fn session_id(out: &std::process::Output) -> String {
    let first: Value = serde_json::from_str(stdout(out).lines().next().unwrap()).unwrap();
    first["session_id"].as_str().unwrap().to_owned()
}

/// `session new --json` on the `local` worker profile with the fake's model.
pub fn new_worker_session_args<'a>(repo: &'a Path, prompt: &'a str) -> [&'a str; 9] {
    [
        "new",
        "--json",
        "--profile",
        "local",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.to_str().unwrap(),
        prompt,
    ]
}

pub fn new_worker_session(rig: &Rig, repo: &Path, prompt: &str) -> (std::process::Output, String) {
    let out = rig.session(&new_worker_session_args(repo, prompt));
    let id = session_id(&out);
    (out, id)
}

#[test]
fn a_worker_session_commits_back_and_matches_a_local_one() {
    // The same four replies for a local session, then for a worker session.
    let mut responses = write_run_commit();
    responses.extend(write_run_commit());
    let rig = Rig::start(responses, "");
    // Project instructions too must reach the provider identically from both placements.
    let repo = TempGitRepo::new(&[
        ("README.md", "a repo\n"),
        ("AGENTS.md", "Say things plainly.\n"),
    ]);

    let local = rig
        .gw
        .new_session(repo.path(), "openai/gpt-fake", "Say hello in a file");
    let (out, remote) = new_worker_session(&rig, repo.path(), "Say hello in a file");
    assert!(
        out.status.success(),
        "worker session failed: {}",
        stderr(&out)
    );

    // Placement progress, then the turn, streamed like a local one.
    let events: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let placements: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "placement")
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        placements,
        [
            "provisioning",
            "syncing",
            "starting",
            "active",
            "reconciling",
            "active"
        ]
    );
    // The worker slot claimed with the session's rows is its first move (before the turn,
    // so not in the turn's stream), then the box is leased.
    let steps = placement_steps(&rig, &remote);
    assert_eq!(
        steps[0],
        (
            "requested".to_owned(),
            "claimed a worker slot on profile local for the new session".to_owned()
        ),
        "{steps:?}"
    );
    assert_eq!(steps[1].0, "provisioning", "{steps:?}");
    let tools: Vec<(&str, bool)> = events
        .iter()
        .filter(|e| e["type"] == "tool_finished")
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                e["is_error"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(tools, [("write", false), ("exec", false), ("exec", false)]);

    // The commit came back to the managed branch; the user's checkout is untouched.
    let branch = format!("skiff/{remote}");
    let log = git(repo.path(), &["log", "--format=%s", &branch]);
    assert_eq!(log.lines().next(), Some("Add hello"), "{log}");
    assert_eq!(
        git(repo.path(), &["show", &format!("{branch}:hello.txt")]),
        "hello from the box\n"
    );
    assert!(!repo.path().join("hello.txt").exists());

    // Same script, same transcript, wherever the loop ran.
    let local_detail = rig.gw.json(&["session", "show", "--json", &local]);
    let remote_detail = rig.gw.json(&["session", "show", "--json", &remote]);
    assert_eq!(
        semantic(&local_detail["transcript"]),
        semantic(&remote_detail["transcript"])
    );
    assert_eq!(remote_detail["session"]["placement"], "active");

    // The gateway built every provider request; they are byte-identical across placements
    // (prompt-cache affinity) but for the session's own cache key, and carry the API key only
    // on the gateway's side of the wire.
    let requests = rig.fake.requests();
    assert_eq!(requests.len(), 8);
    assert!(
        String::from_utf8_lossy(&requests[4].body).contains("Say things plainly."),
        "the worker's request lacks the project instructions"
    );
    let keys: Vec<String> = requests.iter().map(prompt_cache_key).collect();
    assert!(keys[..4].iter().all(|k| *k == keys[0]), "{keys:?}");
    assert!(keys[4..].iter().all(|k| *k == keys[4]), "{keys:?}");
    assert_ne!(keys[0], keys[4], "two sessions share a prompt cache key");
    for i in 0..4 {
        // A session on the gateway may dispatch children; a worker session never can, so its
        // tool list lacks those three tools (they come last) and is otherwise the same bytes.
        let local = String::from_utf8_lossy(&requests[i].body).replace(&keys[0], "KEY");
        let worker = String::from_utf8_lossy(&requests[i + 4].body).replace(&keys[4], "KEY");
        let dispatch = local
            .find(r#",{"function":{"description":"Hand a task to a child session"#)
            .expect("a gateway session is offered dispatch");
        assert!(local.ends_with("]}"), "the tools come last");
        assert!(
            !worker.contains(r#""name":"dispatch"#),
            "a worker is offered dispatch"
        );
        assert_eq!(
            format!("{}]}}", &local[..dispatch]),
            worker,
            "request {i} differs between placements"
        );
    }
    assert_eq!(
        requests[4].header("authorization"),
        Some(format!("Bearer {PROVIDER_KEY}").as_str())
    );

    // `session list` marks the worker session with its environment; `env show` has the
    // session, the tunnel and the controlled-egress accounting.
    let env = remote_detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let list = stdout(&rig.gw.run(&["session", "list"]));
    let row = list.lines().find(|l| l.contains(&remote)).unwrap();
    assert!(row.contains(&format!("active {env}")), "{row}");
    let shown = rig.gw.json(&["env", "show", "--json", &env]);
    assert_eq!(shown["state"], "attached");
    assert_eq!(shown["attached_sessions"][0], remote.as_str());
    assert_eq!(shown["tunnel"], "up");
    let egress = &shown["accounting"];
    assert_eq!(egress["model_requests"], 4);
    assert_eq!(egress["input_tokens"], 3 * 120 + 200);
    assert_eq!(egress["output_tokens"], 3 * 30 + 10);
    assert!(egress["bytes_out"].as_u64().unwrap() > 1000, "{egress}");
    assert!(egress["bytes_in"].as_u64().unwrap() > 100, "{egress}");
}

/// The `prompt_cache_key` the gateway put in a chat-completions request; it never names the
/// session it stands for.
/// Every placement step the session's event stream holds, oldest first: its state and what
/// it said (read from the store, so steps no run carries are there too).
pub fn placement_steps(rig: &Rig, id: &str) -> Vec<(String, String)> {
    let store = rig.gw.store();
    let scope = skiff_store::Scope::new(skiff_store::FIRST_ADMIN, skiff_store::DEFAULT_TENANT);
    let session = skiff_protocol::SessionId::parse(id).unwrap();
    store
        .events_after(&scope, &session, 0, 1_000_000)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.kind {
            skiff_protocol::event::EventKind::Placement { state, detail, .. } => {
                Some((state.as_str().to_owned(), detail))
            }
            _ => None,
        })
        .collect()
}

pub fn prompt_cache_key(request: &skiff_test_support::RecordedRequest) -> String {
    let body: Value = serde_json::from_slice(&request.body).unwrap();
    let key = body["prompt_cache_key"].as_str().unwrap().to_owned();
    assert!(!key.contains("ses_"), "{key}");
    key
}

/// Every file under `dir` that contains one of `needles` (bytes), as paths. Copies of the
/// `skiff` executable (the installed bundle) are compared with it instead of searched.
pub fn files_containing(dir: &Path, needles: &[&str]) -> Vec<String> {
    let skiff = std::fs::read(crate::harness::SKIFF).unwrap();
    let mut hits = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file()
                && let Ok(bytes) = std::fs::read(&path)
                && bytes != skiff
                && needles
                    .iter()
                    .any(|n| bytes.windows(n.len()).any(|w| w == n.as_bytes()))
            {
                hits.push(path.display().to_string());
            }
        }
    }
    hits
}

/// The environment of every `skiff worker` process running as `user`.
fn worker_environments(user: &str) -> Vec<String> {
    let uid = std::process::Command::new("id")
        .args(["-u", user])
        .output()
        .unwrap();
    let uid = String::from_utf8_lossy(&uid.stdout).trim().to_owned();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let owner = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("");
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let is_worker = String::from_utf8_lossy(&cmdline).contains("worker\0--socket");
        if owner == uid
            && is_worker
            && let Ok(env) = std::fs::read(entry.path().join("environ"))
        {
            out.push(String::from_utf8_lossy(&env).replace('\0', "\n"));
        }
    }
    out
}

#[test]
fn the_box_and_the_worker_hold_no_secret() {
    let rig = Rig::start(write_run_commit(), "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    // A git credential in the user's repository: the remote URL carries a token.
    let forge_token = "ghp_forgetoken0123456789abcdef";
    repo.git(&[
        "remote",
        "add",
        "origin",
        &format!("https://skiff:{forge_token}@forge.invalid/team/repo.git"),
    ]);
    let (out, id) = new_worker_session(&rig, repo.path(), "Say hello in a file");
    assert!(out.status.success(), "{}", stderr(&out));

    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    let env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap();
    let shown = rig.gw.json(&["env", "show", "--json", env]);
    let user = shown["ssh_target"]
        .as_str()
        .unwrap()
        .split('@')
        .next()
        .unwrap()
        .to_owned();
    let boxes = rig.root.boxes();
    assert_eq!(boxes.len(), 1);
    let box_dir = rig.root.path().join(&boxes[0]);

    // The worker is running (it waits for the next turn) as the box's own user.
    let envs = worker_environments(&user);
    assert_eq!(envs.len(), 1, "one worker runs as {user}");
    let admin_token = rig.gw.token.clone();
    let signing_key = std::fs::read(rig.gw.state_dir.join("worker-signing.key")).unwrap();
    let signing_hex: String = signing_key.iter().map(|b| format!("{b:02x}")).collect();
    let secrets = [
        PROVIDER_KEY,
        admin_token.as_str(),
        forge_token,
        signing_hex.as_str(),
    ];
    // No secret on the box's disk; the worker's own credential file is gone too (the
    // worker holds it in memory only).
    let on_disk = [&secrets[..], &["skw1."]].concat();
    assert_eq!(
        files_containing(&box_dir, &on_disk),
        Vec::<String>::new(),
        "a secret is on the box"
    );
    for secret in secrets {
        for env in &envs {
            assert!(
                !env.contains(secret),
                "a secret is in a box process's environment"
            );
        }
    }
    for env in &envs {
        for var in env.lines() {
            let name = var.split('=').next().unwrap_or("");
            assert!(
                ["HOME", "USER", "PATH", "LANG"].contains(&name) || name.is_empty(),
                "the worker's environment is not scrubbed: it has {name}"
            );
        }
    }
    // The box's repository has no remote and no credential helper.
    let ws = box_dir.join("home/workspaces").join(&id);
    let remotes = std::process::Command::new("git")
        .arg("-C")
        .arg(&ws)
        .args(["-c", "safe.directory=*", "remote", "-v"])
        .output()
        .unwrap();
    assert!(remotes.status.success(), "{}", stderr(&remotes));
    assert_eq!(stdout(&remotes), "");
}

#[test]
fn past_its_worker_limit_the_gateway_refuses_at_once() {
    // The first session's turn waits on the model: its worker is busy, not merely attached
    // (an idle one would be parked to make room).
    let rig = Rig::start(
        vec![FakeResponse::stall(), text_reply(&["local"])],
        "[gateway]\nmax_workers = 1\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut first = rig
        .gw
        .cli()
        .arg("session")
        .args(new_worker_session_args(repo.path(), "first"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(first.stdout.take().unwrap()));
    // Until its turn asks the model (which answers the next request, the local session's).
    let mut id = String::new();
    for line in lines.by_ref() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        id = event["session_id"].as_str().unwrap().to_owned();
        if event["type"] == "model_request" {
            break;
        }
    }
    let out = rig.session(&[
        "new",
        "--profile",
        "local",
        "--model",
        "openai/gpt-fake",
        "--workspace",
        repo.path().to_str().unwrap(),
        "second",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("at capacity: 1 of 1 workers is running a turn"),
        "{}",
        stderr(&out)
    );
    // Nothing was half-created: no second session, no second box; local sessions still run.
    let list = rig.gw.json(&["session", "list", "--json"]);
    assert_eq!(list["sessions"].as_array().unwrap().len(), 1);
    assert!(rig.root.boxes().len() <= 1, "{:?}", rig.root.boxes());
    rig.gw
        .new_session(repo.path(), "openai/gpt-fake", "on the gateway");
    let out = rig.session(&["cancel", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    lines.for_each(drop);
    assert_eq!(first.wait().unwrap().code(), Some(1));
}

#[test]
fn cancelling_a_worker_turn_stops_it_there() {
    let words: Vec<String> = (0..60).map(|i| format!("w{i} ")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let slow = text_reply(&refs).with_delay(std::time::Duration::from_millis(100));
    let rig = Rig::start(vec![slow], "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut child = rig
        .gw
        .cli()
        .args([
            "session",
            "new",
            "--json",
            "--profile",
            "local",
            "--model",
            "openai/gpt-fake",
            "--workspace",
            repo.path().to_str().unwrap(),
            "talk slowly",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut id = String::new();
    for line in lines.by_ref() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        id = event["session_id"].as_str().unwrap().to_owned();
        if event["type"] == "text_delta" {
            break;
        }
    }
    let out = rig.session(&["cancel", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    for _ in lines.by_ref() {}
    assert_eq!(child.wait().unwrap().code(), Some(1));
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["runs"][0]["status"], "cancelled");
    let last = detail["transcript"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["body"]["text"], "The run was cancelled.");
    // The worker stays for the next turn.
    assert_eq!(detail["session"]["placement"], "active");
}

#[test]
fn a_worker_rotates_its_credential_and_reattaches_with_the_new_one() {
    let rig = Rig::start(
        vec![text_reply(&["first"]), text_reply(&["second"])],
        "[gateway]\nworker_credential_ttl = \"3s\"\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "first");
    assert!(out.status.success(), "{}", stderr(&out));
    let epoch =
        rig.gw.json(&["session", "show", "--json", &id])["session"]["worker"]["owner_epoch"]
            .clone();
    // Past the lifetime of the credential the worker was welcomed with: only a rotated one
    // still admits it.
    std::thread::sleep(std::time::Duration::from_secs(4));
    let state = rig.gw.state_dir.display().to_string();
    let masters = crate::worker_faults::pids_with(&[
        "ssh ",
        &format!("{state}/ssh/"),
        "control.sock",
        "ControlMaster=yes",
    ]);
    crate::worker_faults::kill(&masters);
    let out = rig.session(&["send", "--json", &id, "second"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    assert_eq!(
        detail["session"]["worker"]["owner_epoch"], epoch,
        "the same worker came back"
    );
    let log = std::fs::read_to_string(
        rig.root
            .path()
            .join(&rig.root.boxes()[0])
            .join("home/.skiff/worker.log"),
    )
    .unwrap();
    let admitted = format!("admitted by the gateway session={id}");
    assert_eq!(log.matches(&admitted).count(), 2, "{log}");
    assert!(!log.contains("refused this worker"), "{log}");
}

#[test]
fn web_fetch_runs_on_the_gateway_for_allowed_hosts_only_and_is_accounted() {
    let page = "Skiff docs: the worker protocol is a closed RPC set.";
    let site_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let site = site_rt.block_on(FakeProvider::start(vec![FakeResponse::status(
        200,
        &[("content-type", "text/plain")],
        page,
    )]));
    let rig = Rig::start(
        vec![
            tool_reply(
                "f1",
                "web_fetch",
                &format!(r#"{{"url":"{}/docs"}}"#, site.base_url()),
            ),
            tool_reply("f2", "web_fetch", r#"{"url":"http://localhost:9/secret"}"#),
            text_reply(&["read ", "it"]),
        ],
        "[gateway]\nweb_fetch_allow = [\"127.0.0.1\"]\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "read the docs");
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    let results: Vec<(String, bool)> = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .map(|e| {
            (
                e["body"]["content"].as_str().unwrap().to_owned(),
                e["body"]["is_error"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(results[0], (format!("HTTP 200\n\n{page}"), false));
    assert!(
        results[1].1 && results[1].0.contains("may not reach localhost"),
        "{results:?}"
    );
    assert_eq!(
        site.requests().len(),
        1,
        "only the allowed host was reached"
    );
    let env = detail["session"]["worker"]["environment_id"]
        .as_str()
        .unwrap();
    let shown = rig.gw.json(&["env", "show", "--json", env]);
    assert_eq!(shown["accounting"]["gateway_tool_calls"], 1);
    assert!(shown["accounting"]["bytes_in"].as_u64().unwrap() >= page.len() as u64);
}

#[test]
fn the_demo_runs_its_session_on_a_worker_box_and_tears_it_down() {
    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(crate::harness::SKIFF)
        .arg("--state-dir")
        .arg(home.path().join("user-state"))
        .arg("demo")
        .env("HOME", home.path())
        .env("TMPDIR", home.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    for step in [
        "running on a worker box",
        "◦ provisioning",
        "◦ syncing",
        "◦ starting",
        "◦ active",
        "✓ run succeeded",
        "tearing down worker box env_",
    ] {
        assert!(err.contains(step), "missing {step:?} in:\n{err}");
    }
    assert!(stdout(&out).contains("greet.sh | 2 +-"), "{}", stdout(&out));
    // The demo's state dir is in its output; its box root is empty again.
    let state = stdout(&out)
        .lines()
        .find_map(|l| l.split("--state-dir ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .to_owned();
    let tag = blake3::hash(state.as_bytes()).to_hex();
    let root = std::path::PathBuf::from(format!("/var/lib/skiff/boxes-{}", &tag[..12]));
    let left: Vec<_> = std::fs::read_dir(&root)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "boxes left behind in {}: {left:?}",
        root.display()
    );
    let _ = std::fs::remove_dir(&root);
}

#[test]
fn a_local_session_is_dispatched_to_a_worker_at_a_turn_boundary() {
    let rig = Rig::start(
        vec![
            tool_reply(
                "c1",
                "write",
                r#"{"path":"notes.txt","content":"written at home\n"}"#,
            ),
            text_reply(&["wrote it"]),
            tool_reply(
                "c2",
                "exec",
                r#"{"command":"cat notes.txt && hostname -I | wc -w"}"#,
            ),
            text_reply(&["read it on the box"]),
        ],
        "",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let id = rig
        .gw
        .new_session(repo.path(), "openai/gpt-fake", "write notes");
    assert_eq!(
        rig.gw.json(&["session", "show", "--json", &id])["session"]["placement"],
        "local"
    );
    let out = rig.session(&["send", "--profile", "local", &id, "now read them on a box"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("◦ active"), "{}", stderr(&out));
    // The claim that the message dispatches the session is a move followers see, before the
    // box is leased.
    let steps = placement_steps(&rig, &id);
    let claimed = steps
        .iter()
        .position(|(s, _)| s == "requested")
        .unwrap_or_else(|| panic!("no requested step: {steps:?}"));
    assert_eq!(
        steps[claimed].1, "dispatching to profile local with this message",
        "{steps:?}"
    );
    assert_eq!(steps[claimed + 1].0, "provisioning", "{steps:?}");
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["session"]["placement"], "active");
    let result = detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .unwrap();
    // The uncommitted file written on the gateway travelled with the workspace.
    assert!(result.contains("written at home"), "{result}");
    // The gateway chose the prompt cache key in both placements: the same one, so the
    // provider's cache of this conversation survives the move.
    let keys: Vec<String> = rig.fake.requests().iter().map(prompt_cache_key).collect();
    assert_eq!(keys.len(), 4);
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    // A second dispatch to another profile is refused, not silently moved.
    let out = rig.session(&["send", "--profile", "elsewhere", &id, "move"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no worker profile `elsewhere`"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_placement_that_fails_says_why_and_gives_its_box_back() {
    let rig = Rig::start(vec![text_reply(&["never asked"])], "");
    // A plain workspace with a file over the sync limit (sparse: no disk is spent).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "small\n").unwrap();
    let big = std::fs::File::create(dir.path().join("disk.img")).unwrap();
    big.set_len(300 << 20).unwrap();
    let (out, id) = new_worker_session(&rig, dir.path(), "look");
    assert_eq!(out.status.code(), Some(1));
    // The run's end names the file and the limit.
    let end = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["type"] == "run_status" && e["status"] == "failed")
        .unwrap();
    let error = end["error"].as_str().unwrap();
    assert!(
        error.contains("disk.img") && error.contains("per-file limit"),
        "{error}"
    );
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    assert_eq!(detail["session"]["placement"], "failed");
    assert!(
        detail["session"]["worker"]["error"]
            .as_str()
            .unwrap()
            .contains("disk.img")
    );
    // The box it had leased is torn down, not left attached to nobody.
    let envs = rig.gw.json(&["env", "list", "--json"]);
    let states: Vec<&str> = envs["environments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["destroyed"]);
    assert!(rig.root.boxes().is_empty());
    assert_eq!(rig.fake.requests().len(), 0, "no model call was made");
}

#[test]
fn a_long_reply_streams_through_the_credit_window_to_the_end() {
    // Far more events than one credit window (256): the worker's acknowledgements must keep
    // the window moving after the provider has finished.
    let words: Vec<String> = (0..1000).map(|i| format!("t{i} ")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let rig = Rig::start(vec![text_reply(&refs)], "");
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "talk a lot");
    assert!(out.status.success(), "{}", stderr(&out));
    let streamed: String = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["type"] == "text_delta")
        .map(|e| e["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(streamed, words.concat());
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    let last = detail["transcript"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["body"]["text"], words.concat());
}

#[test]
fn twenty_requests_at_once_never_exceed_the_worker_limit() {
    // Every turn waits on the model until it is cancelled, so no worker is ever idle (and
    // parked to make room) while the requests arrive.
    let rig = Rig::start(
        vec![FakeResponse::stall(), FakeResponse::stall()],
        "[gateway]\nmax_workers = 2\n",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let mut children: Vec<std::process::Child> = (0..20)
        .map(|i| {
            rig.gw
                .cli()
                .arg("session")
                .args(new_worker_session_args(
                    repo.path(),
                    &format!("request {i}"),
                ))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // A placed request prints its session at once; a refused one prints nothing and exits.
    let firsts: Vec<Option<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = children
            .iter_mut()
            .map(|child| {
                let stdout = child.stdout.take().unwrap();
                s.spawn(move || {
                    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
                    let first = lines.next().map(|l| l.unwrap());
                    // Keep draining: a placed session's child must never block on its pipe.
                    std::thread::spawn(move || lines.for_each(drop));
                    first
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let placed: Vec<String> = firsts
        .iter()
        .flatten()
        .map(|l| {
            let event: Value = serde_json::from_str(l).unwrap();
            event["session_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(placed.len(), 2, "exactly max_workers sessions are placed");
    for id in &placed {
        let out = rig.session(&["cancel", id]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let mut refused = 0;
    for (child, first) in children.into_iter().zip(&firsts) {
        let out = child.wait_with_output().unwrap();
        if first.is_some() {
            assert_eq!(out.status.code(), Some(1), "a cancelled turn");
        } else {
            assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
            assert!(stderr(&out).contains("at capacity"), "{}", stderr(&out));
            refused += 1;
        }
    }
    assert_eq!(refused, 18, "every other request is refused");
    // Refused requests leave nothing behind: no session, no box, no branch.
    let list = rig.gw.json(&["session", "list", "--json"]);
    assert_eq!(list["sessions"].as_array().unwrap().len(), 2);
    assert!(rig.root.boxes().len() <= 2, "{:?}", rig.root.boxes());
    let branches = git(repo.path(), &["branch", "--list", "skiff/*"]);
    assert_eq!(branches.lines().count(), 2, "{branches}");
}

#[test]
fn what_reconciliation_refuses_is_quarantined_and_the_rest_adopted() {
    let rig = Rig::start(
        vec![
            tool_reply(
                "call_1",
                "exec",
                r#"{"command":"ln -s /etc/passwd leak && echo fine > ok.txt && git add -A && git commit -q -m 'box: work'"}"#,
            ),
            text_reply(&["done"]),
            text_reply(&["next ", "turn"]),
        ],
        "",
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let (out, id) = new_worker_session(&rig, repo.path(), "link something");
    // The turn succeeds: only the refused path is held back.
    assert!(out.status.success(), "{}", stderr(&out));
    let detail = rig.gw.json(&["session", "show", "--json", &id]);
    let worktree =
        std::path::PathBuf::from(detail["session"]["workspace"]["path"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(worktree.join("ok.txt")).unwrap(),
        "fine\n"
    );
    assert!(
        std::fs::symlink_metadata(worktree.join("leak")).is_err(),
        "the escaping symlink was written"
    );
    let notice = crate::worker_faults::notices(&detail).pop().unwrap();
    assert!(
        notice.contains("`leak`") && notice.contains("skiff session quarantine"),
        "{notice}"
    );

    let list = rig.gw.json(&["session", "quarantine", &id, "--json"]);
    let q = &list["quarantines"][0];
    let paths: Vec<&str> = q["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"leak") && paths.contains(&"(commits)"),
        "{paths:?}"
    );
    let bundle = q["bundle"].as_str().unwrap();
    assert!(
        std::path::Path::new(bundle).is_file(),
        "the box's commits are kept"
    );
    // The box is back in step with what was adopted.
    let box_ws = rig
        .root
        .path()
        .join(&rig.root.boxes()[0])
        .join("home/workspaces")
        .join(&id);
    assert!(std::fs::symlink_metadata(box_ws.join("leak")).is_err());

    // An operator takes it anyway: written here and on the box, and the next turn runs clean.
    let out = rig.session(&["quarantine", "accept", &id, "leak"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_link(worktree.join("leak")).unwrap(),
        std::path::Path::new("/etc/passwd")
    );
    assert_eq!(
        std::fs::read_link(box_ws.join("leak")).unwrap(),
        std::path::Path::new("/etc/passwd")
    );
    let out = rig.session(&["send", "--json", &id, "go on"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = rig.session(&["quarantine", "discard", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let list = rig.gw.json(&["session", "quarantine", &id, "--json"]);
    assert!(list["quarantines"].as_array().unwrap().is_empty(), "{list}");
    // A path that can never be accepted is refused with its reason.
    let out = rig.session(&["quarantine", "accept", &id, "../x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("can never be accepted"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn what_sync_leaves_behind_is_said_at_the_syncing_step_and_in_session_show() {
    let rig = Rig::start(vec![text_reply(&["done"])], "");
    let repo = TempGitRepo::new(&[
        ("Cargo.toml", "[package]\nname = \"x\"\n"),
        (
            "src/target/mod.rs",
            "// source that happens to be called target\n",
        ),
    ]);
    std::fs::create_dir_all(repo.path().join("target/debug")).unwrap();
    std::fs::write(repo.path().join("target/debug/app"), "built\n").unwrap();
    let (out, id) = new_worker_session(&rig, repo.path(), "look around");
    assert!(out.status.success(), "{}", stderr(&out));
    let starting: Vec<Value> = stdout(&out)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["type"] == "placement" && e["state"] == "starting")
        .collect();
    let detail = starting[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("left out: target/ (1 file) by target/ (built in, beside Cargo.toml"),
        "{detail}"
    );
    let show = stdout(&rig.gw.run(&["session", "show", &id]));
    assert!(show.contains("sync       left out: target/"), "{show}");
    // The source folder named target reached the box.
    let box_ws = rig
        .root
        .path()
        .join(&rig.root.boxes()[0])
        .join("home/workspaces")
        .join(&id);
    assert!(box_ws.join("src/target/mod.rs").is_file());
    assert!(!box_ws.join("target").exists());
}

/// A git workspace without setup or `AGENTS.md` is laid onto the box behind the worker's
/// start: the step says so, and the first tool (held until the box holds the whole workspace)
/// sees the user's uncommitted edit, deletion and new file, as a sequential lay-down gives it.
#[test]
fn the_first_model_call_does_not_wait_for_the_box_and_the_first_tool_sees_the_whole_workspace() {
    let rig = Rig::start(
        vec![
            tool_reply(
                "call_1",
                "exec",
                r#"{"command":"{ cat edited.txt; git status --porcelain --untracked-files=all; } > seen.txt && git add seen.txt && git commit -q -m seen"}"#,
            ),
            text_reply(&["seen"]),
        ],
        "",
    );
    let repo = TempGitRepo::new(&[
        ("edited.txt", "as committed\n"),
        ("gone.txt", "deleted by the user\n"),
        ("src/lib.rs", "pub fn f() {}\n"),
    ]);
    std::fs::write(repo.path().join("edited.txt"), "edited by the user\n").unwrap();
    std::fs::remove_file(repo.path().join("gone.txt")).unwrap();
    std::fs::write(repo.path().join("new.txt"), "new\n").unwrap();
    let (out, id) = new_worker_session(&rig, repo.path(), "look");
    assert!(out.status.success(), "{}", stderr(&out));
    let steps = placement_steps(&rig, &id);
    let starting = steps
        .iter()
        .find(|(state, _)| state == "starting")
        .map(|(_, detail)| detail.as_str())
        .unwrap_or_default();
    assert!(
        starting.contains("going onto the box") && starting.contains("the worker starts meanwhile"),
        "{steps:?}"
    );
    let branch = format!("skiff/{id}");
    let seen = git(repo.path(), &["show", &format!("{branch}:seen.txt")]);
    assert_eq!(
        seen, "edited by the user\n M edited.txt\n D gone.txt\n?? new.txt\n?? seen.txt\n",
        "the first tool saw another workspace"
    );
}
