//! Sessions from a remote repository: real git on both sides — a bare repository over
//! `file://`, and over smart HTTP (`git http-backend`) behind a loopback server that wants
//! basic auth — cloned once per URL into the gateway's storage, fetched again on reuse, the
//! session's worktree on `skiff/<id>` from the ref asked for, and published back with the
//! gateway's own credentials, which appear nowhere else.

use crate::harness::{Refused, TestGateway};
use skiff_protocol::api::{CreateSessionRequest, RepoSource, RunStarted};
use skiff_test_support::git_http::{GitHttpServer, bare_repo};
use std::path::Path;
use std::process::Command;

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

fn repo_request(url: &str, git_ref: Option<&str>) -> CreateSessionRequest {
    CreateSessionRequest {
        prompt: "look around".into(),
        workspace: String::new(),
        repo: Some(RepoSource {
            url: url.to_owned(),
            git_ref: git_ref.map(str::to_owned),
        }),
        model: Some("fake/x".into()),
        profile: None,
        reasoning: None,
        attempts: None,
        approval: None,
        agent: None,
    }
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", "Up Stream")
        .env("GIT_AUTHOR_EMAIL", "up@skiff.invalid")
        .env("GIT_COMMITTER_NAME", "Up Stream")
        .env("GIT_COMMITTER_EMAIL", "up@skiff.invalid")
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Commits `path` = `content` on `branch` of the bare repository `bare` (made from `main`
/// when new) and returns the commit.
fn push_commit(bare: &Path, branch: &str, path: &str, content: &str) -> String {
    let work = tempfile::tempdir().unwrap();
    let url = format!("file://{}", bare.display());
    git(work.path(), &["clone", "-q", &url, "w"]);
    let w = work.path().join("w");
    if git(&w, &["branch", "-r", "--list", &format!("origin/{branch}")]).is_empty() {
        git(&w, &["checkout", "-q", "-b", branch]);
    } else {
        git(&w, &["checkout", "-q", branch]);
    }
    std::fs::write(w.join(path), content).unwrap();
    git(&w, &["add", "-A"]);
    git(&w, &["commit", "-q", "-m", &format!("{path} on {branch}")]);
    git(&w, &["push", "-q", "origin", branch]);
    git(&w, &["rev-parse", "HEAD"])
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

async fn started(gw: &TestGateway, url: &str, git_ref: Option<&str>) -> RunStarted {
    let started = gw
        .client
        .create_session(&repo_request(url, git_ref))
        .await
        .unwrap_or_else(|e| panic!("a session from {url}: {e:?}"));
    gw.client.follow_until_run_end(&started.session.id, 0).await;
    started
}

fn refused(result: Result<RunStarted, Refused>) -> Refused {
    match result {
        Ok(s) => panic!("expected a refusal, got session {}", s.session.id),
        Err(e) => e,
    }
}

#[tokio::test]
async fn sessions_from_one_url_share_one_clone_fetched_again_and_start_from_the_ref_asked() {
    let gw = TestGateway::start(DONE).await;
    let remotes = tempfile::tempdir().unwrap();
    let bare = bare_repo(remotes.path(), "upstream", &[("README.md", "v1\n")]);
    let url = format!("file://{}", bare.display());
    let dev = push_commit(&bare, "dev", "dev.txt", "on dev\n");
    git(&bare, &["tag", "v1", "main"]);

    let first = started(&gw, &url, None).await;
    let ws = Path::new(first.session.workspace.path());
    assert_eq!(
        std::fs::read_to_string(ws.join("README.md")).unwrap(),
        "v1\n"
    );
    assert!(!ws.join("dev.txt").exists(), "the default branch is main");
    match &first.session.workspace {
        skiff_protocol::api::WorkspaceView::Git { remote, .. } => {
            assert_eq!(
                remote.as_deref(),
                Some(url.as_str()),
                "the session names its URL"
            )
        }
        other => panic!("a remote session is a git worktree: {other:?}"),
    }
    assert_eq!(
        git(ws, &["symbolic-ref", "--short", "HEAD"]),
        format!("skiff/{}", first.session.id)
    );
    assert_eq!(
        git(ws, &["rev-parse", "HEAD"]),
        git(&bare, &["rev-parse", "main"])
    );
    assert_eq!(git(ws, &["status", "--porcelain"]), "", "a clean checkout");
    let mirrors = gw.state_dir.join("mirrors");
    assert_eq!(entries(&mirrors).len(), 1, "one clone per URL");

    // A session's agent can write refs into the clone; a fetch puts back the remote's.
    let clone = mirrors.join(&entries(&mirrors)[0]);
    git(&clone, &["update-ref", "refs/remotes/origin/main", &dev]);
    git(&clone, &["tag", "-f", "v1", &dev]);
    git(&clone, &["tag", "planted", &dev]);

    // Upstream moves on: the next session's clone is the same, fetched again.
    let newer = push_commit(&bare, "main", "README.md", "v2\n");
    let second = started(&gw, &url, None).await;
    let ws2 = Path::new(second.session.workspace.path());
    assert_eq!(
        std::fs::read_to_string(ws2.join("README.md")).unwrap(),
        "v2\n"
    );
    assert_eq!(git(ws2, &["rev-parse", "HEAD"]), newer);
    assert_eq!(entries(&mirrors).len(), 1, "the clone is reused");

    let on_dev = started(&gw, &url, Some("dev")).await;
    let ws3 = Path::new(on_dev.session.workspace.path());
    assert_eq!(git(ws3, &["rev-parse", "HEAD"]), dev);
    assert_eq!(
        std::fs::read_to_string(ws3.join("dev.txt")).unwrap(),
        "on dev\n"
    );
    let on_tag = started(&gw, &url, Some("v1")).await;
    assert_eq!(
        std::fs::read_to_string(Path::new(on_tag.session.workspace.path()).join("README.md"))
            .unwrap(),
        "v1\n"
    );

    let e = refused(
        gw.client
            .create_session(&repo_request(&url, Some("planted")))
            .await,
    );
    assert!(e.error.message.contains("has no ref \"planted\""), "{e:?}");

    // Refusals name what to do and make nothing.
    let sessions = gw.client.sessions().await.unwrap().sessions.len();
    let worktrees = entries(&gw.state_dir.join("worktrees"));
    let e = refused(
        gw.client
            .create_session(&repo_request(&url, Some("nope")))
            .await,
    );
    assert_eq!(e.error.code, "bad_workspace", "{e:?}");
    assert!(e.error.message.contains("has no ref \"nope\""), "{e:?}");
    assert!(e.error.message.contains("branches: dev, main"), "{e:?}");
    let missing = format!("file://{}/absent.git", remotes.path().display());
    let e = refused(
        gw.client
            .create_session(&repo_request(&missing, None))
            .await,
    );
    assert_eq!(e.error.code, "bad_workspace", "{e:?}");
    assert!(
        e.error.message.contains("cannot reach the repository"),
        "{e:?}"
    );
    let e = refused(
        gw.client
            .create_session(&repo_request("https://me:pw@example.invalid/a.git", None))
            .await,
    );
    assert!(e.error.message.contains("[git.credentials]"), "{e:?}");
    assert!(!e.error.message.contains("pw@"), "{e:?}");
    assert_eq!(gw.client.sessions().await.unwrap().sessions.len(), sessions);
    assert_eq!(entries(&gw.state_dir.join("worktrees")), worktrees);
    assert_eq!(entries(&mirrors).len(), 1, "a failed clone leaves nothing");

    // Publish pushes the session's branch back to the URL it came from.
    let (status, body) = gw
        .client
        .raw(
            reqwest::Method::POST,
            &format!("/v1/sessions/{}/publish", first.session.id),
            "{}",
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        git(
            &bare,
            &[
                "rev-parse",
                &format!("refs/heads/skiff/{}", first.session.id)
            ]
        ),
        body["commit"].as_str().unwrap()
    );
}

#[tokio::test]
async fn an_http_remote_is_cloned_and_published_with_the_gateways_vault_token_only() {
    const TOKEN: &str = "tok-8f2c1a9e-never-shown";
    let remotes = tempfile::tempdir().unwrap();
    let bare = bare_repo(remotes.path(), "app", &[("src/lib.rs", "// app\n")]);
    bare_repo(remotes.path(), "other", &[("x", "x\n")]);
    git(&bare, &["config", "http.receivepack", "true"]);
    let server = GitHttpServer::start(remotes.path(), "skiff-bot", TOKEN).await;
    let config = format!(
        "[git.credentials.\"{}\"]\nusername = \"skiff-bot\"\ntoken = \"vault:forge\"\n",
        server.base_url()
    );
    let gw = TestGateway::configured(DONE, &config, None).await;
    let url = format!("{}app.git", server.base_url());

    // The vault has no such secret yet: the error names the key to fix.
    let e = refused(gw.client.create_session(&repo_request(&url, None)).await);
    assert!(e.error.message.contains("git.credentials"), "{e:?}");

    let put = |value: &'static str| {
        let client = gw.client.clone();
        async move {
            let (status, body) = client
                .raw(
                    reqwest::Method::PUT,
                    "/v1/secrets/forge",
                    &format!(r#"{{"value":"{value}"}}"#),
                )
                .await;
            assert!(status < 300, "{status} {body}");
        }
    };
    put(TOKEN).await;
    let first = started(&gw, &url, None).await;
    let ws = Path::new(first.session.workspace.path());
    assert_eq!(
        std::fs::read_to_string(ws.join("src/lib.rs")).unwrap(),
        "// app\n"
    );
    assert!(server.served() > 0);

    let (status, body) = gw
        .client
        .raw(
            reqwest::Method::POST,
            &format!("/v1/sessions/{}/publish", first.session.id),
            r#"{"branch":"from-skiff"}"#,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        git(&bare, &["rev-parse", "refs/heads/from-skiff"]),
        body["commit"].as_str().unwrap()
    );

    // A wrong token: refused by the server, said plainly, nothing made, the token not echoed.
    put("wrong-token-value").await;
    let mirrors = entries(&gw.state_dir.join("mirrors"));
    let before = server.refused();
    let other = format!("{}other.git", server.base_url());
    let e = refused(gw.client.create_session(&repo_request(&other, None)).await);
    assert_eq!(e.error.code, "bad_workspace", "{e:?}");
    assert!(
        e.error
            .message
            .contains("refused the gateway's credentials"),
        "{e:?}"
    );
    assert!(e.error.message.contains("git.credentials"), "{e:?}");
    assert!(!e.error.message.contains("wrong-token-value"), "{e:?}");
    assert!(server.refused() > before);
    assert_eq!(entries(&gw.state_dir.join("mirrors")), mirrors);
    let (status, body) = gw
        .client
        .raw(
            reqwest::Method::POST,
            &format!("/v1/sessions/{}/publish", first.session.id),
            r#"{"branch":"again"}"#,
        )
        .await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body.to_string()
            .contains("refused the gateway's credentials"),
        "{body}"
    );

    // The token is in no file of the gateway's storage (clone config, worktree, logs).
    let mut stack = vec![gw.state_dir.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() && path.extension().is_none_or(|e| e != "key") {
                let bytes = std::fs::read(&path).unwrap();
                assert!(
                    !bytes.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes()),
                    "the token is in {}",
                    path.display()
                );
            }
        }
    }
}

#[tokio::test]
async fn workspaces_live_where_the_store_says() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared/skiff");
    let remotes = tempfile::tempdir().unwrap();
    let bare = bare_repo(remotes.path(), "upstream", &[("a.txt", "a\n")]);
    let config = format!("[store]\nworkspaces = \"{}\"\n", shared.display());
    let gw = TestGateway::configured(DONE, &config, None).await;
    let first = started(&gw, &format!("file://{}", bare.display()), None).await;
    let real = shared.canonicalize().unwrap();
    assert!(
        Path::new(first.session.workspace.path()).starts_with(real.join("worktrees")),
        "{}",
        first.session.workspace.path()
    );
    assert_eq!(entries(&real.join("mirrors")).len(), 1);
    assert!(
        real.join("artifacts").is_dir(),
        "checkpoint blobs live there too"
    );
    assert!(entries(&gw.state_dir.join("mirrors")).is_empty());

    // A result is never written into the directory that holds every session's worktree.
    let into = real.join("worktrees/exported");
    let (status, body) = gw
        .client
        .raw(
            reqwest::Method::POST,
            &format!("/v1/sessions/{}/export", first.session.id),
            &serde_json::json!({ "to": into }).to_string(),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.to_string().contains("[store] workspaces"),
        "the refusal names the setting: {body}"
    );
    assert!(!into.exists(), "nothing was written");
}

#[tokio::test]
async fn a_workspaces_directory_that_cannot_be_used_stops_the_start_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    for (workspaces, why) in [
        (file.display().to_string(), "cannot create it"),
        ("relative/dir".to_owned(), "not an absolute path"),
        (
            "/usr/share/skiff".to_owned(),
            "every sandboxed session command can read",
        ),
    ] {
        let config = dir.path().join("skiff.toml");
        std::fs::write(&config, format!("[store]\nworkspaces = \"{workspaces}\"\n")).unwrap();
        let err = skiff_gateway::start(skiff_gateway::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: Some(config),
        })
        .await
        .err()
        .expect("the start is refused");
        let text = err.to_string();
        assert!(text.contains("[store] workspaces"), "{text}");
        assert!(text.contains(why), "{workspaces}: {text}");
    }
}
