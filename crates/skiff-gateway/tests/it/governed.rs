//! Governed actions (`[forge]`): `git_push` to a real bare repository and `open_pull_request`
//! against `skiff-test-support`'s fake forge (GitHub's wire format), each behind a one-time
//! grant and, by default, a person's approval; the forge token stays on the gateway.

use crate::harness::{TestGateway, session_request};
use serde_json::Value;
use skiff_protocol::SessionId;
use skiff_protocol::approval::{ApprovalState, ApprovalView};
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::{FakeForge, FakeResponse, TempGitRepo, openai_sse};
use std::path::Path;
use std::process::Command;

const TOKEN: &str = "ghp_s3cr3t-forge-token-9f8e7d";

fn tool_reply(id: &str, name: &str, args: &str) -> FakeResponse {
    let mut events = openai_sse::text_chunks(&["On it."]);
    events.extend(openai_sse::tool_call(0, id, name, args, 2));
    events.extend(openai_sse::finish("tool_calls"));
    events.extend(openai_sse::done());
    FakeResponse::sse(events)
}

fn answer(text: &str) -> FakeResponse {
    FakeResponse::sse(
        [
            openai_sse::text_chunks(&[text]),
            openai_sse::finish("stop"),
            openai_sse::done(),
        ]
        .concat(),
    )
}

fn offered(body: &[u8]) -> Vec<String> {
    let body: Value = serde_json::from_slice(body).unwrap();
    body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect()
}

fn pending(event: &SessionEvent) -> Option<ApprovalView> {
    match &event.kind {
        EventKind::Approval { approval } if approval.state == ApprovalState::Pending => {
            Some(approval.clone())
        }
        _ => None,
    }
}

/// A bare repository (the remote) holding `main` and `other`, and a clone-like working
/// repository whose `origin` it is.
fn repo_with_bare_remote() -> (TempGitRepo, tempfile::TempDir) {
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let bare = tempfile::tempdir().unwrap();
    let ok = Command::new("git")
        .args(["init", "-q", "--bare", "-b", "main"])
        .arg(bare.path())
        .status()
        .unwrap();
    assert!(ok.success());
    repo.git(&["remote", "add", "origin", bare.path().to_str().unwrap()]);
    repo.git(&["push", "-q", "origin", "main", "main:other"]);
    (repo, bare)
}

/// `refname objectname` of every ref of the bare repository.
fn refs(bare: &Path) -> Vec<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(bare)
        .args(["for-each-ref", "--format=%(refname) %(objectname)"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn forge_config(api: &str, extra: &str) -> String {
    format!("[forge]\napi = \"{api}\"\ntoken = \"vault:forge\"\n{extra}")
}

async fn set_token(gw: &TestGateway) {
    set_secret(gw, "forge", TOKEN).await;
}

async fn set_secret(gw: &TestGateway, name: &str, value: &str) {
    let (status, _) = gw
        .client
        .raw(
            reqwest::Method::PUT,
            &format!("/v1/secrets/{name}"),
            &serde_json::json!({ "value": value }).to_string(),
        )
        .await;
    assert!(status < 300, "setting the secret {name}: {status}");
}

fn results(
    transcript: &[skiff_protocol::transcript::TranscriptEntry],
) -> Vec<(String, String, bool)> {
    transcript
        .iter()
        .filter_map(|e| match &e.body {
            EntryBody::ToolResult {
                name,
                content,
                is_error,
                ..
            } => Some((name.clone(), content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

fn audit(gw: &TestGateway) -> Vec<skiff_store::AuditRow> {
    skiff_store::Store::open(&gw.state_dir.join("skiff.db"))
        .unwrap()
        .audit_rows()
        .unwrap()
}

/// Approves each governed action as it asks, until the run ends.
async fn approve_until_run_end(gw: &TestGateway, id: &SessionId, approvals: usize) {
    let mut cursor = 0;
    for _ in 0..approvals {
        let events = gw
            .client
            .follow_until(id, cursor, |e| pending(e).is_some())
            .await;
        let last = events.last().unwrap();
        cursor = last.cursor;
        let asked = pending(last).unwrap();
        assert!(
            asked
                .request_reason
                .as_deref()
                .unwrap_or("")
                .starts_with("grant grt_"),
            "{asked:?}"
        );
        gw.client.decide(&asked.id, true, None).await.unwrap();
    }
    gw.client.follow_until_run_end(id, cursor).await;
}

#[tokio::test]
async fn git_push_pushes_exactly_the_session_branch_to_a_bare_repository() {
    let (repo, bare) = repo_with_bare_remote();
    let before = refs(bare.path());
    let responses = vec![
        tool_reply("call_1", "git_push", r#"{"branch":"main"}"#),
        tool_reply("call_2", "git_push", "{}"),
        tool_reply("call_3", "git_push", "{}"),
        answer("pushed"),
    ];
    let gw = TestGateway::configured(
        "",
        &forge_config("http://127.0.0.1:9", "repository = \"acme/widgets\"\n"),
        Some(responses),
    )
    .await;
    set_token(&gw).await;
    let started = gw
        .client
        .create_session(&session_request(repo.path(), "http/m", "push it"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    let branch = format!("skiff/{id}");
    approve_until_run_end(&gw, &id, 2).await;

    // Offered to the model (after the built-in tools).
    let requests = gw.provider.as_ref().unwrap().requests();
    let names = offered(&requests[0].body);
    assert!(names.contains(&"git_push".to_owned()), "{names:?}");
    assert!(names.contains(&"open_pull_request".to_owned()), "{names:?}");

    let results = results(&gw.client.session(&id).await.unwrap().transcript);
    assert_eq!(results.len(), 3, "{results:?}");
    let (_, refused, is_error) = &results[0];
    assert!(
        *is_error
            && refused.contains(&format!(
                "pushes only the session branch {branch}, never main"
            )),
        "{refused}"
    );
    let (_, pushed, is_error) = &results[1];
    assert!(!is_error, "{pushed}");
    let pushed: skiff_protocol::grant::GitPushResult = serde_json::from_str(pushed).unwrap();
    assert_eq!(pushed.branch, branch);
    assert_eq!(pushed.remote, "origin");
    // The second push (its own grant, approved again) changes nothing and succeeds.
    assert!(!results[2].2, "{}", results[2].1);

    // Exactly the session branch appeared; main and other are untouched.
    let session_commit = repo.git(&["rev-parse", &branch]).trim().to_owned();
    assert_eq!(pushed.commit, session_commit);
    let mut expected = before.clone();
    expected.push(format!("refs/heads/{branch} {session_commit}"));
    expected.sort();
    let mut after = refs(bare.path());
    after.sort();
    assert_eq!(after, expected);

    // Audited: two grants minted and executed, one proposal refused; never the token.
    let rows = audit(&gw);
    let count = |action: &str, decision: &str| {
        rows.iter()
            .filter(|r| r.action == action && r.decision == decision)
            .count()
    };
    assert_eq!(count("governed.grant", "minted"), 2);
    assert_eq!(count("governed.execute", "applied"), 2);
    assert_eq!(count("governed.refused", "refused"), 1);
    assert!(rows.iter().all(|r| !r.detail.to_string().contains(TOKEN)));
    gw.shutdown().await;
}

/// Every file under `dir` (recursively) whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &str) -> Vec<String> {
    let mut found = Vec::new();
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
                && bytes.windows(needle.len()).any(|w| w == needle.as_bytes())
            {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

#[tokio::test]
async fn a_pull_request_reaches_the_forge_with_the_bearer_token_which_stays_on_the_gateway() {
    let (repo, _bare) = repo_with_bare_remote();
    let forge = FakeForge::start("acme", "widgets", TOKEN).await;
    let responses = vec![
        tool_reply(
            "call_1",
            "open_pull_request",
            r#"{"title":"Add widgets","body":"It adds widgets.\n\nCloses #4."}"#,
        ),
        tool_reply(
            "call_2",
            "open_pull_request",
            r#"{"title":"Again","body":"b","base":"other"}"#,
        ),
        answer("opened"),
    ];
    let gw = TestGateway::configured(
        "",
        &forge_config(
            &forge.api(),
            "repository = \"acme/widgets\"\nconfirm = false\n",
        ),
        Some(responses),
    )
    .await;
    set_token(&gw).await;
    let started = gw
        .client
        .create_session(&session_request(repo.path(), "http/m", "open a PR"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    gw.client.follow_until_run_end(&id, 0).await;
    let branch = format!("skiff/{id}");

    let detail = gw.client.session(&id).await.unwrap();
    let results = results(&detail.transcript);
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(!results[0].2, "{}", results[0].1);
    let opened: skiff_protocol::grant::PullRequestResult =
        serde_json::from_str(&results[0].1).unwrap();
    assert_eq!(opened.number, 1);
    assert_eq!(opened.url, "https://github.example/acme/widgets/pull/1");
    assert_eq!(
        (opened.head.as_str(), opened.base.as_str()),
        (branch.as_str(), "main")
    );
    assert!(!results[1].2, "{}", results[1].1);

    // The forge saw GitHub's requests: the default branch read, then each pull request,
    // with the bearer token and GitHub's media type.
    let requests = forge.requests();
    let seen: Vec<(String, String)> = requests
        .iter()
        .map(|r| (r.method.clone(), r.path.clone()))
        .collect();
    assert_eq!(
        seen,
        [
            ("GET".to_owned(), "/repos/acme/widgets".to_owned()),
            ("POST".to_owned(), "/repos/acme/widgets/pulls".to_owned()),
            ("POST".to_owned(), "/repos/acme/widgets/pulls".to_owned()),
        ]
    );
    for r in &requests {
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {TOKEN}").as_str())
        );
        assert_eq!(r.header("accept"), Some("application/vnd.github+json"));
    }
    let pulls = forge.pulls();
    assert_eq!(
        pulls[0],
        serde_json::json!({
            "title": "Add widgets", "body": "It adds widgets.\n\nCloses #4.",
            "head": branch, "base": "main",
        })
    );
    assert_eq!(pulls[1]["base"], "other");

    // The token is nowhere but the vault's sealed row: not in the transcript or events, not
    // in an audit row, not in any file of the state dir (logs, database, archive), the
    // session's workspace or the repository.
    let transcript = serde_json::to_string(&detail).unwrap();
    assert!(!transcript.contains(TOKEN));
    let events = gw.client.follow_until_run_end(&id, 0).await;
    assert!(!serde_json::to_string(&events).unwrap().contains(TOKEN));
    let rows = audit(&gw);
    assert!(
        rows.iter()
            .any(|r| r.action == "governed.execute" && r.decision == "applied")
    );
    assert!(rows.iter().all(|r| !r.detail.to_string().contains(TOKEN)));
    assert_eq!(files_containing(&gw.state_dir, TOKEN), Vec::<String>::new());
    assert_eq!(files_containing(repo.path(), TOKEN), Vec::<String>::new());
    assert_eq!(
        files_containing(Path::new(detail.session.workspace.path()), TOKEN),
        Vec::<String>::new()
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_denied_governed_action_says_denied_and_pushes_nothing() {
    let (repo, bare) = repo_with_bare_remote();
    let before = refs(bare.path());
    let responses = vec![tool_reply("call_1", "git_push", "{}"), answer("ok")];
    let gw = TestGateway::configured(
        "",
        &forge_config("http://127.0.0.1:9", "repository = \"acme/widgets\"\n"),
        Some(responses),
    )
    .await;
    set_token(&gw).await;
    let started = gw
        .client
        .create_session(&session_request(repo.path(), "http/m", "push it"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    let events = gw
        .client
        .follow_until(&id, 0, |e| pending(e).is_some())
        .await;
    let last = events.last().unwrap();
    let asked = pending(last).unwrap();
    assert_eq!(asked.tool, "git_push");
    assert!(
        asked
            .subject
            .contains(&format!("git push origin refs/heads/skiff/{id}")),
        "{}",
        asked.subject
    );
    gw.client
        .decide(&asked.id, false, Some("not today"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&id, last.cursor).await;
    let results = results(&gw.client.session(&id).await.unwrap().transcript);
    let (_, content, is_error) = &results[0];
    assert!(
        *is_error && content.contains("denied this call"),
        "{content}"
    );
    assert!(content.contains("not today"), "{content}");
    assert_eq!(refs(bare.path()), before);
    let rows = audit(&gw);
    assert!(
        rows.iter()
            .any(|r| r.action == "governed.refused" && r.decision == "denied")
    );
    assert!(!rows.iter().any(|r| r.action == "governed.execute"));
    gw.shutdown().await;
}

#[tokio::test]
async fn without_forge_the_governed_tools_are_not_offered() {
    let responses = vec![answer("hello")];
    let gw = TestGateway::configured("", "", Some(responses)).await;
    let ws = gw.plain_dir("ws", &[("a.txt", "a\n")]);
    let started = gw
        .client
        .create_session(&session_request(&ws, "http/m", "hi"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    let requests = gw.provider.as_ref().unwrap().requests();
    let names = offered(&requests[0].body);
    assert!(
        !names
            .iter()
            .any(|n| n == "git_push" || n == "open_pull_request"),
        "{names:?}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn rules_that_hold_every_call_confirm_a_governed_action_once_even_when_forge_does_not() {
    let (repo, bare) = repo_with_bare_remote();
    let responses = vec![tool_reply("call_1", "git_push", "{}"), answer("ok")];
    let gw = TestGateway::configured(
        "",
        &forge_config(
            "http://127.0.0.1:9",
            "repository = \"acme/widgets\"\nconfirm = false\n",
        ),
        Some(responses),
    )
    .await;
    set_token(&gw).await;
    let mut request = session_request(repo.path(), "http/m", "push it");
    request.approval = Some(serde_json::from_str(r#"{"all":true}"#).unwrap());
    let started = gw.client.create_session(&request).await.unwrap();
    let id = started.session.id.clone();
    approve_until_run_end(&gw, &id, 1).await;
    // Asked once (by the gateway, bound to the grant), not a second time by the agent's policy.
    let asked = gw.client.approvals(Some(&id)).await.unwrap().approvals;
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(asked[0].tool, "git_push");
    assert!(
        refs(bare.path())
            .iter()
            .any(|r| r.starts_with(&format!("refs/heads/skiff/{id} "))),
        "nothing was pushed"
    );
    gw.shutdown().await;
}

/// `[forge]` without a token: a push to an http remote authenticates with the
/// `[git.credentials]` entry for its URL, and pull requests (which need the API token) are not
/// offered.
#[tokio::test]
async fn without_a_forge_token_git_push_uses_the_git_credentials_for_the_remote() {
    const GIT_TOKEN: &str = "tok-4d1e-push-credential-never-shown";
    let remotes = tempfile::tempdir().unwrap();
    let bare = skiff_test_support::git_http::bare_repo(remotes.path(), "app", &[("a.txt", "a\n")]);
    let ok = Command::new("git")
        .arg("-C")
        .arg(&bare)
        .args(["config", "http.receivepack", "true"])
        .status()
        .unwrap();
    assert!(ok.success());
    let server =
        skiff_test_support::git_http::GitHttpServer::start(remotes.path(), "skiff-bot", GIT_TOKEN)
            .await;
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    repo.git(&[
        "remote",
        "add",
        "origin",
        &format!("{}app.git", server.base_url()),
    ]);

    let responses = vec![tool_reply("call_1", "git_push", "{}"), answer("pushed")];
    let config = format!(
        "[forge]\nconfirm = false\n\n[git.credentials.\"{}\"]\nusername = \"skiff-bot\"\ntoken = \"vault:git\"\n",
        server.base_url()
    );
    let gw = TestGateway::configured("", &config, Some(responses)).await;
    set_secret(&gw, "git", GIT_TOKEN).await;
    let started = gw
        .client
        .create_session(&session_request(repo.path(), "http/m", "push it"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    gw.client.follow_until_run_end(&id, 0).await;

    let requests = gw.provider.as_ref().unwrap().requests();
    let names = offered(&requests[0].body);
    assert!(names.contains(&"git_push".to_owned()), "{names:?}");
    assert!(
        !names.contains(&"open_pull_request".to_owned()),
        "no forge token, no pull requests: {names:?}"
    );
    let results = results(&gw.client.session(&id).await.unwrap().transcript);
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(!results[0].2, "{}", results[0].1);
    let branch = format!("skiff/{id}");
    let pushed = refs(&bare);
    assert!(
        pushed
            .iter()
            .any(|r| r.starts_with(&format!("refs/heads/{branch} "))),
        "{pushed:?}"
    );
    assert!(server.served() > 0, "the push went through the server");
    // The credential is in no file of the session's repository, the state dir or the audit.
    assert!(files_containing(repo.path(), GIT_TOKEN).is_empty());
    assert!(files_containing(&gw.state_dir, GIT_TOKEN).is_empty());
    assert!(
        audit(&gw)
            .iter()
            .all(|r| !r.detail.to_string().contains(GIT_TOKEN))
    );
    gw.shutdown().await;
}
