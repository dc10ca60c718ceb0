//! A fake GitHub-compatible forge: `GET /repos/{owner}/{repo}` and
//! `POST /repos/{owner}/{repo}/pulls` answered in GitHub's REST wire format (201 with the pull
//! request object, 401 `Bad credentials`, 404 `Not Found`, 422 `Validation Failed`), every
//! request recorded for the test to assert on.

use crate::fake_provider::{FakeProvider, FakeResponse, RecordedRequest};
use serde_json::{Value, json};

/// The running fake; it stops when dropped.
pub struct FakeForge {
    server: FakeProvider,
    owner: String,
    repo: String,
}

impl FakeForge {
    /// A forge holding `owner/repo` (default branch `main`) that accepts `token` only.
    pub async fn start(owner: &str, repo: &str, token: &str) -> FakeForge {
        let full = format!("{owner}/{repo}");
        let bearer = format!("Bearer {token}");
        let server =
            FakeProvider::start_with(move |requests| answer(&full, &bearer, requests)).await;
        FakeForge {
            server,
            owner: owner.to_owned(),
            repo: repo.to_owned(),
        }
    }

    /// The API's base URL (`[forge] api`).
    pub fn api(&self) -> String {
        self.server.base_url()
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.server.requests()
    }

    /// The pull requests opened so far (the JSON bodies of accepted `POST …/pulls`).
    pub fn pulls(&self) -> Vec<Value> {
        let path = format!("/repos/{}/{}/pulls", self.owner, self.repo);
        self.requests()
            .iter()
            .filter(|r| r.method == "POST" && r.path == path)
            .filter_map(|r| serde_json::from_slice(&r.body).ok())
            .collect()
    }
}

fn json_response(code: u16, body: &Value) -> FakeResponse {
    FakeResponse::status(
        code,
        &[("x-github-media-type", "github.v3; format=json")],
        &body.to_string(),
    )
}

fn answer(full: &str, bearer: &str, requests: &[RecordedRequest]) -> FakeResponse {
    let Some(request) = requests.last() else {
        return json_response(500, &json!({"message": "no request"}));
    };
    if request.header("authorization") != Some(bearer) {
        return json_response(
            401,
            &json!({"message": "Bad credentials", "documentation_url": "https://docs.github.com/rest", "status": "401"}),
        );
    }
    let not_found = || {
        json_response(
            404,
            &json!({"message": "Not Found", "documentation_url": "https://docs.github.com/rest", "status": "404"}),
        )
    };
    let repo_path = format!("/repos/{full}");
    let html = format!("https://github.example/{full}");
    if request.method == "GET" && request.path == repo_path {
        return json_response(
            200,
            &json!({
                "id": 1, "name": full.split('/').nth(1), "full_name": full, "private": true,
                "html_url": html, "default_branch": "main",
            }),
        );
    }
    if request.method == "POST" && request.path == format!("{repo_path}/pulls") {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let field = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_owned);
        let missing: Vec<&str> = ["title", "head", "base"]
            .into_iter()
            .filter(|k| field(k).is_none())
            .collect();
        if !missing.is_empty() {
            let errors: Vec<Value> = missing
                .iter()
                .map(|k| json!({"resource": "PullRequest", "field": k, "code": "missing_field"}))
                .collect();
            return json_response(
                422,
                &json!({"message": "Validation Failed", "errors": errors, "documentation_url": "https://docs.github.com/rest/pulls/pulls#create-a-pull-request", "status": "422"}),
            );
        }
        let number = requests
            .iter()
            .filter(|r| r.method == "POST" && r.path == request.path)
            .count();
        return json_response(
            201,
            &json!({
                "url": format!("{repo_path}/pulls/{number}"),
                "id": 1000 + number,
                "number": number,
                "state": "open",
                "html_url": format!("{html}/pull/{number}"),
                "title": field("title"),
                "body": field("body"),
                "head": {"ref": field("head"), "label": field("head")},
                "base": {"ref": field("base"), "label": field("base")},
                "draft": false,
                "merged": false,
            }),
        );
    }
    not_found()
}
