use crate::harness::{Gateway, SKIFF, stderr};
use skiff_test_support::TempGitRepo;
use std::process::Command;

const DONE: &str = "[[turns]]\ntext = \"ok\"\n";

#[test]
fn an_unknown_model_is_refused_before_anything_is_created() {
    let gw = Gateway::start(DONE);
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "nope/gpt-9",
        "hi",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("nope/gpt-9") && err.contains("unknown provider"),
        "{err}"
    );
    let list = gw.json(&["session", "list", "--json"]);
    assert_eq!(list["sessions"].as_array().unwrap().len(), 0);
    assert_eq!(git_branches(&repo), "main\n", "a branch was created");
    assert_eq!(
        std::fs::read_dir(gw.state_dir.join("worktrees"))
            .unwrap()
            .count(),
        0
    );
}

fn git_branches(repo: &TempGitRepo) -> String {
    repo.git(&["branch", "--format=%(refname:short)"])
}

#[test]
fn a_missing_workspace_is_named() {
    let gw = Gateway::start(DONE);
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        "/nonexistent/skiff-ws",
        "--model",
        "fake/x",
        "hi",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("/nonexistent/skiff-ws does not exist"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn requests_without_a_valid_token_are_refused() {
    let gw = Gateway::start(DONE);
    let client = reqwest::blocking::Client::new();
    for auth in [None, Some("Bearer skf_wrong")] {
        let mut req = client.get(format!("{}/v1/sessions", gw.url));
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        let resp = req.send().unwrap();
        assert_eq!(resp.status(), 401);
        let body: serde_json::Value = resp.json().unwrap();
        assert_eq!(body["code"], "unauthorized");
    }
    let ok = client
        .get(format!("{}/v1/sessions", gw.url))
        .bearer_auth(&gw.token)
        .send()
        .unwrap();
    assert_eq!(ok.status(), 200, "the real token is accepted");
    let out = gw
        .cli()
        .args(["session", "list"])
        .env("SKIFF_URL", &gw.url)
        .env("SKIFF_TOKEN", "skf_wrong")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("missing or invalid token"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_unreachable_gateway_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(dir.path())
        .args(["session", "list"])
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(stderr(&out).contains("skiff gateway"), "{}", stderr(&out));
}

#[test]
fn an_invalid_config_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(&config, "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"http://127.0.0.1:9\"\napi_key_envv = \"X\"\n").unwrap();
    let out = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("providers.openai") && err.contains("api_key_envv"),
        "{err}"
    );
    assert!(
        !dir.path().join("state/gateway.json").exists(),
        "a gateway file was written for a gateway that never started"
    );
}

#[test]
fn an_empty_prompt_is_a_clear_error() {
    let gw = Gateway::start(DONE);
    let repo = TempGitRepo::new(&[("a.txt", "a\n")]);
    let out = gw.run(&[
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/x",
        "  ",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("the prompt is empty"),
        "{}",
        stderr(&out)
    );
}
