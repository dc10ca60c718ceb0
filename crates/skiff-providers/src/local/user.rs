//! A box's own unprivileged user (when the gateway is root): the box's processes cannot read
//! the gateway's state or another box's files.

use crate::Result;
use skiff_process::Cmd;
use std::path::Path;
use tokio_util::sync::CancellationToken;

pub(crate) fn name(box_id: &str) -> String {
    let tail = &box_id[box_id.len().saturating_sub(12)..];
    format!("skf-{tail}")
}

/// The uid of `user`, if it exists.
pub(crate) async fn uid(user: &str) -> Result<Option<u32>> {
    let out = Cmd::new("id")
        .args(["-u", user])
        .run(&CancellationToken::new())
        .await?;
    Ok(out
        .status
        .success()
        .then(|| out.stdout.into_string().trim().parse().ok())
        .flatten())
}

/// The primary group id of `user` (what files it creates belong to).
pub(crate) async fn gid(user: &str) -> Result<u32> {
    let out = Cmd::new("id")
        .args(["-g", user])
        .run_checked(&CancellationToken::new())
        .await?;
    out.trim().parse().map_err(|_| crate::Error::Provider {
        provider: "local",
        message: format!("`id -g {user}` printed {:?}, not a group id", out.trim()),
    })
}

/// Creates the user with `home` as its home, unless it exists. Returns its uid.
pub(crate) async fn create(user: &str, home: &Path) -> Result<u32> {
    if let Some(uid) = uid(user).await? {
        return Ok(uid);
    }
    // `*` (no password can match) rather than useradd's default `!` (locked): sshd without PAM
    // refuses every login, key-based too, to a locked account.
    Cmd::new("useradd")
        .args([
            "--system",
            "--no-create-home",
            "--shell",
            "/bin/bash",
            "--password",
            "*",
            "--home-dir",
        ])
        .arg(home)
        .arg(user)
        .run_checked(&CancellationToken::new())
        .await?;
    uid(user).await?.ok_or_else(|| crate::Error::Provider {
        provider: "local",
        message: format!("useradd {user} succeeded but the user does not exist"),
    })
}

pub(crate) async fn delete(user: &str) -> Result<()> {
    if uid(user).await?.is_none() {
        return Ok(());
    }
    let removed = Cmd::new("userdel")
        .arg(user)
        .run_checked(&CancellationToken::new())
        .await;
    match removed {
        Ok(_) => Ok(()),
        // Two teardowns of one box (a failover's and an operator's `env rm`) can race: the
        // loser's userdel finds the entry already gone. Gone is what was asked for.
        Err(_) if uid(user).await?.is_none() => Ok(()),
        Err(e) => Err(e.into()),
    }
}
