//! `skiff demo`: the whole flow on the embedded default, offline. A gateway on a temporary
//! state dir, a small generated git repository, and a session that reads files, edits one,
//! runs the test and commits; then what changed and how to look at the transcript.

use crate::client::Client;
use crate::render::Live;
use crate::session::follow_until_end;
use anyhow::{Context, Result, bail};
use clap::Args;
use skiff_process::Cmd;
use skiff_protocol::api::{CreateSessionRequest, RunStatus, WorkspaceView};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub struct DemoArgs {
    /// Configuration to use [default: <state-dir>/skiff.toml when it exists]; its default model
    /// runs the demo, else the built-in scripted/demo
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Run the session on the gateway itself instead of a worker box of the `local` profile
    #[arg(long)]
    on_gateway: bool,
}

const PROMPT: &str = "greet.sh prints \"Helo\" instead of \"Hello\". Fix the typo, run ./test.sh to check, and commit the fix.";

const FILES: &[(&str, &str, bool)] = &[
    (
        "README.md",
        "# greeter\n\nA tiny greeter. `./greet.sh NAME` prints a greeting; `./test.sh` checks it.\n",
        false,
    ),
    (
        "greet.sh",
        "#!/usr/bin/env bash\necho \"Helo, ${1:-world}!\"\n",
        true,
    ),
    (
        "test.sh",
        "#!/usr/bin/env bash\nset -euo pipefail\nout=$(./greet.sh Skiff)\nif [ \"$out\" != \"Hello, Skiff!\" ]; then\n  echo \"FAIL: expected 'Hello, Skiff!', got '$out'\"\n  exit 1\nfi\necho \"ok: $out\"\n",
        true,
    ),
];

fn step(text: &str) {
    eprintln!("› {text}");
}

async fn git(repo: &Path, args: &[&str]) -> Result<String> {
    Ok(Cmd::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .run_checked(&CancellationToken::new())
        .await?)
}

async fn sample_repo(repo: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(repo).with_context(|| format!("cannot create {}", repo.display()))?;
    for (name, text, executable) in FILES {
        let path = repo.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        if *executable {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    git(repo, &["init", "-q", "-b", "main"]).await?;
    git(repo, &["config", "user.name", "Skiff Demo"]).await?;
    git(repo, &["config", "user.email", "demo@skiff.invalid"]).await?;
    git(repo, &["add", "-A"]).await?;
    git(repo, &["commit", "-q", "-m", "Initial greeter"]).await?;
    Ok(())
}

pub async fn run(args: DemoArgs, user_state_dir: &Path, json: bool) -> Result<ExitCode> {
    let started = std::time::Instant::now();
    let root = tempfile::Builder::new()
        .prefix("skiff-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?
        .keep();
    let repo = root.join("greeter");
    let state_dir = root.join("state");
    let config = args
        .config
        .or_else(|| Some(user_state_dir.join("skiff.toml")).filter(|p| p.exists()));

    step(&format!(
        "creating a sample git repository at {}",
        repo.display()
    ));
    sample_repo(&repo).await?;

    step(&format!(
        "starting a gateway with state dir {}",
        state_dir.display()
    ));
    let gateway = skiff_gateway::start(skiff_gateway::Options {
        state_dir: state_dir.clone(),
        listen: "127.0.0.1:0".into(),
        config,
    })
    .await?;
    // The demo's state dir holds its own SQLite database, whose admin token it always has.
    let Some(token) = gateway.token.clone() else {
        anyhow::bail!("the demo gateway wrote no admin token to its gateway.json");
    };
    let client = Client::new(&gateway.url, &token);

    let outcome = async {
        let started_run = client
            .create_session(&CreateSessionRequest {
                prompt: PROMPT.into(),
                workspace: repo.display().to_string(),
                repo: None,
                model: None,
                profile: (!args.on_gateway).then(|| "local".to_owned()),
                reasoning: None,
                attempts: None,
                approval: None,
                agent: None,
            })
            .await?;
        let session = started_run.session.clone();
        step(&format!(
            "session {} on {}{}",
            session.id,
            session.model.label,
            if args.on_gateway {
                ", running on the gateway"
            } else {
                ", running on a worker box (profile local)"
            }
        ));
        if let WorkspaceView::Git { path, branch, .. } = &session.workspace {
            step(&format!("its own worktree {path} on branch {branch}"));
        }
        eprintln!("\nyou    {PROMPT}\n");
        let status = follow_until_end(
            &client,
            &session.id,
            &started_run.run.id,
            &mut Live::new(json),
        )
        .await?;
        anyhow::Ok((session, status))
    }
    .await;
    // The demo's box goes with the demo.
    if let Ok(detail) = client
        .session(outcome.as_ref().map_or("", |(s, _)| s.id.as_str()))
        .await
        && let Some(env) = detail.session.worker.and_then(|w| w.environment_id)
    {
        step(&format!("tearing down worker box {env}"));
        let torn: Result<serde_json::Value> = client
            .send(client.delete(&format!("/v1/environments/{env}?force=true")))
            .await;
        if let Err(e) = torn {
            eprintln!(
                "warning: could not tear down {env}: {e:#}; run `skiff env destroy {env} --force`"
            );
        }
    }
    gateway.shutdown().await;
    let (session, status) = outcome?;
    if status != RunStatus::Succeeded {
        bail!(
            "the demo session ended {status}; see `skiff --state-dir {} session show {}`",
            state_dir.display(),
            session.id
        );
    }

    let WorkspaceView::Git {
        branch,
        base_commit,
        ..
    } = &session.workspace
    else {
        bail!("the demo workspace should be a git worktree");
    };
    let commit = git(&repo, &["rev-parse", "--short", branch]).await?;
    let changes = git(&repo, &["diff", "--stat", base_commit, branch]).await?;
    let live_status = git(&repo, &["status", "--short"]).await?;
    outln!()?;
    outln!(
        "What changed (on branch {branch}, commit {}):",
        commit.trim()
    )?;
    out!("{changes}")?;
    outln!(
        "Your checkout at {} is untouched ({}).",
        repo.display(),
        if live_status.trim().is_empty() {
            "git status is clean"
        } else {
            "it has the changes it had before"
        }
    )?;
    let skiff = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "skiff".into());
    outln!()?;
    outln!("Look at it:")?;
    outln!("  git -C {} log -p main..{branch}", repo.display())?;
    outln!(
        "  {skiff} --state-dir {} gateway --listen 127.0.0.1:0 &",
        state_dir.display()
    )?;
    outln!(
        "  {skiff} --state-dir {} session show {}",
        state_dir.display(),
        session.id
    )?;
    eprintln!(
        "\ndemo finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
