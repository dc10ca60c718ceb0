//! Fan-out groups: `skiff session new --attempts N` (following every attempt), `skiff session
//! compare GROUP` and `skiff session pick ID`.

use crate::client::Client;
use crate::render::{Detail, Live};
use anyhow::Result;
use skiff_protocol::SessionId;
use skiff_protocol::api::{FanOutStarted, GroupPick, GroupView, PickResult, RunStatus};
use std::process::ExitCode;

/// After `POST /v1/sessions` with attempts: prints the ids (`--detach`, `--json`) or follows
/// each attempt's first turn in turn, then shows the comparison. Succeeds when at least one
/// attempt succeeded (there is something to pick).
pub async fn started(
    client: &Client,
    started: FanOutStarted,
    detach: bool,
    json: bool,
    detail: Detail,
) -> Result<ExitCode> {
    let group = &started.group_id;
    if json {
        outln!("{}", serde_json::to_string(&started)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if detach {
        for a in &started.attempts {
            outln!("{}", a.session.id)?;
        }
        eprintln!(
            "started {} attempts as group {group}; compare them with `skiff session compare {group}`",
            started.attempts.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let n = started.attempts.len();
    let mut succeeded = 0;
    for (i, a) in started.attempts.iter().enumerate() {
        eprintln!(
            "── attempt {} of {n} · session {} · {} ──",
            i + 1,
            a.session.id,
            a.session.model.label
        );
        let mut live = Live::with_detail(false, detail);
        let status =
            crate::session::follow_until_end(client, &a.session.id, &a.run.id, &mut live).await?;
        if status == RunStatus::Succeeded {
            succeeded += 1;
        }
    }
    let view: GroupView = client
        .send(client.get(&format!("/v1/groups/{group}")))
        .await?;
    out!("{}", table(&view))?;
    eprintln!("pick one with `skiff session pick ID`");
    Ok(if succeeded > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub async fn compare(client: &Client, group: &str, json: bool) -> Result<ExitCode> {
    let view: GroupView = client
        .send(client.get(&format!("/v1/groups/{group}")))
        .await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&view)?)?;
    } else {
        out!("{}", table(&view))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn pick(client: &Client, id: &str, json: bool) -> Result<ExitCode> {
    let done: PickResult = client
        .send(client.post(&format!("/v1/sessions/{id}/pick"), &serde_json::json!({})))
        .await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&done)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    out!("{}", table(&done.group))?;
    for p in &done.parked {
        eprintln!("parked {p}: its box went back to the pool (the session stays readable)");
    }
    Ok(ExitCode::SUCCESS)
}

/// What `session show` says about a session's group.
pub fn membership(group: &GroupPick, this: &SessionId) -> String {
    match &group.picked {
        Some(p) if p == this => format!(
            "{} (this attempt was picked: its branch is the group's result)",
            group.id
        ),
        Some(p) => format!("{} (attempt {p} was picked as the result)", group.id),
        None => format!(
            "{} (no attempt picked yet; `skiff session compare {}`)",
            group.id, group.id
        ),
    }
}

/// The attempts side by side, one row each, with the picked one marked.
pub fn table(view: &GroupView) -> String {
    let mut out = format!("group {}  {}\n", view.id, view.title);
    match (&view.picked, &view.result_branch) {
        (Some(p), Some(branch)) => {
            out.push_str(&format!(
                "picked {p}: its branch {branch} is the group's result\n"
            ));
        }
        (Some(p), None) => out.push_str(&format!(
            "picked {p}: its workspace is the group's result\n"
        )),
        (None, _) => out.push_str("no attempt picked yet\n"),
    }
    let mut rows = Vec::new();
    for a in &view.attempts {
        let id = if a.picked {
            format!("{} *", a.session.id)
        } else {
            a.session.id.to_string()
        };
        let status = match a.status {
            Some(s) if a.session.placement == "parked" && s.is_terminal() => {
                format!("{s} (parked)")
            }
            Some(s) => s.to_string(),
            None => "queued".to_owned(),
        };
        let (files, lines) = match &a.diff {
            Some(d) => (
                d.files.to_string(),
                format!("+{} -{}", d.insertions, d.deletions),
            ),
            None => ("?".to_owned(), "?".to_owned()),
        };
        let tests = a
            .last_exec_exit
            .map_or_else(|| "-".to_owned(), |c| format!("exit {c}"));
        let message: String = a
            .final_line
            .as_deref()
            .unwrap_or("")
            .chars()
            .filter(|c| !c.is_control())
            .take(60)
            .collect();
        rows.push([id, status, files, lines, tests, message]);
    }
    out.push_str(&crate::render::table(
        &[
            "ATTEMPT",
            "STATUS",
            "FILES",
            "+/-",
            "TESTS",
            "FINAL MESSAGE",
        ],
        &rows,
    ));
    if view.attempts.iter().any(|a| a.picked) {
        out.push_str("(* picked)\n");
    }
    out
}
