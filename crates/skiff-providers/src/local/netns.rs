//! Network namespaces for `isolation = "netns"`: a namespace with only a loopback interface, so
//! a box inside it has no route anywhere.

use crate::Result;
use skiff_process::Cmd;
use tokio_util::sync::CancellationToken;

pub(crate) fn name(box_id: &str) -> String {
    format!("skiff-{box_id}")
}

pub(crate) async fn exists(ns: &str) -> Result<bool> {
    let out = Cmd::new("ip")
        .args(["netns", "list"])
        .run_checked(&CancellationToken::new())
        .await?;
    Ok(out.lines().any(|l| l.split_whitespace().next() == Some(ns)))
}

/// Creates the namespace with loopback up (and nothing else), if it does not exist yet.
pub(crate) async fn create(ns: &str) -> Result<()> {
    let cancel = CancellationToken::new();
    if !exists(ns).await? {
        Cmd::new("ip")
            .args(["netns", "add", ns])
            .run_checked(&cancel)
            .await?;
    }
    Cmd::new("ip")
        .args(["-n", ns, "link", "set", "lo", "up"])
        .run_checked(&cancel)
        .await?;
    Ok(())
}

pub(crate) async fn delete(ns: &str) -> Result<()> {
    if exists(ns).await? {
        Cmd::new("ip")
            .args(["netns", "delete", ns])
            .run_checked(&CancellationToken::new())
            .await?;
    }
    Ok(())
}
