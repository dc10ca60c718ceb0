//! `open_pull_request`'s execution against a GitHub-compatible REST API:
//! `POST {api}/repos/{owner}/{repo}/pulls` with `Authorization: Bearer`, and
//! `GET {api}/repos/{owner}/{repo}` for a default base branch. Errors carry the forge's
//! `message`, never the request's headers.

use serde::Deserialize;
use serde_json::json;
use skiff_protocol::GrantId;
use skiff_protocol::grant::PullRequestResult;
use std::time::Duration;

/// `OWNER/REPO` split, when it is that.
pub(super) fn split_repository(text: &str) -> Option<(&str, &str)> {
    let (owner, repo) = text.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    (ok(owner) && ok(repo)).then_some((owner, repo))
}

/// `OWNER/REPO` read from a remote URL (`https://host/o/r.git`, `git@host:o/r.git`,
/// `ssh://git@host/o/r`).
pub(super) fn repository_of_url(url: &str) -> Option<String> {
    let path = if let Some((_, rest)) = url.split_once("://") {
        rest.split_once('/')?.1
    } else {
        url.split_once(':')?.1
    };
    let path = path.trim_end_matches('/').trim_end_matches(".git");
    let mut parts = path.rsplit('/');
    let repo = parts.next()?;
    let owner = parts.next()?;
    let text = format!("{owner}/{repo}");
    split_repository(&text).is_some().then_some(text)
}

pub(super) struct PullRequest<'a> {
    pub title: &'a str,
    pub body: &'a str,
    pub head: &'a str,
    pub base: &'a str,
}

fn client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .user_agent("skiff")
        .build()
        .map_err(|e| e.to_string())
}

fn request(builder: reqwest::RequestBuilder, token: &str) -> reqwest::RequestBuilder {
    builder
        .bearer_auth(token)
        .header("accept", "application/vnd.github+json")
        .header("x-github-api-version", "2022-11-28")
}

/// The forge's answer to a failed request: its status and `message`.
async fn failure(response: reqwest::Response) -> String {
    #[derive(Deserialize)]
    struct Message {
        message: Option<String>,
    }
    let code = response.status().as_u16();
    let message = response
        .json::<Message>()
        .await
        .ok()
        .and_then(|m| m.message)
        .unwrap_or_else(|| "no message".to_owned());
    format!("the forge answered HTTP {code}: {message}")
}

pub(super) async fn default_branch(
    api: &str,
    token: &str,
    repository: &str,
) -> Result<String, String> {
    #[derive(Deserialize)]
    struct Repo {
        default_branch: String,
    }
    let response = request(client()?.get(format!("{api}/repos/{repository}")), token)
        .send()
        .await
        .map_err(|e| format!("the forge could not be reached: {}", e.without_url()))?;
    if !response.status().is_success() {
        return Err(failure(response).await);
    }
    response
        .json::<Repo>()
        .await
        .map(|r| r.default_branch)
        .map_err(|e| format!("the forge's repository answer is not what GitHub sends: {e}"))
}

pub(super) async fn open_pull_request(
    api: &str,
    token: &str,
    repository: &str,
    pr: PullRequest<'_>,
    grant: &GrantId,
) -> Result<PullRequestResult, String> {
    #[derive(Deserialize)]
    struct Created {
        number: u64,
        html_url: String,
    }
    let body = json!({ "title": pr.title, "body": pr.body, "head": pr.head, "base": pr.base });
    let response = request(
        client()?.post(format!("{api}/repos/{repository}/pulls")),
        token,
    )
    .json(&body)
    .send()
    .await
    .map_err(|e| format!("the forge could not be reached: {}", e.without_url()))?;
    if !response.status().is_success() {
        return Err(failure(response).await);
    }
    let created = response
        .json::<Created>()
        .await
        .map_err(|e| format!("the forge's pull request answer is not what GitHub sends: {e}"))?;
    Ok(PullRequestResult {
        number: created.number,
        url: created.html_url,
        repository: repository.to_owned(),
        head: pr.head.to_owned(),
        base: pr.base.to_owned(),
        grant: grant.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_url_names_its_repository() {
        for url in [
            "https://github.com/acme/widgets.git",
            "https://github.com/acme/widgets",
            "git@github.com:acme/widgets.git",
            "ssh://git@github.com/acme/widgets/",
        ] {
            assert_eq!(
                repository_of_url(url).as_deref(),
                Some("acme/widgets"),
                "{url}"
            );
        }
        assert_eq!(repository_of_url("/srv/git/bare"), None);
    }
}
