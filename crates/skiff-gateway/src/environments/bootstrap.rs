//! Installing the worker bundle on a box over SSH, idempotently, and verifying that what runs
//! there is exactly the gateway's build.

use crate::bundle::Bundle;
use crate::error::{Error, Result};
use skiff_ssh::Ssh;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug)]
pub(crate) struct BundleInstall {
    pub copied: bool,
    pub bytes: u64,
    pub duration: Duration,
}

pub(crate) async fn install(ssh: &Ssh, bundle: &Bundle) -> Result<BundleInstall> {
    let started = Instant::now();
    let cancel = CancellationToken::new();
    let dir = bundle.remote_dir();
    // A bundle directory is named by its hash and completed (manifest last) only after the
    // installed binary reported that hash, so presence is enough here. The worker's admission
    // handshake checks the build hash of what actually runs.
    let present = format!(
        "test -x \"$HOME/{dir}/skiff\" && test -f \"$HOME/{dir}/manifest.json\" && echo present || true"
    );
    if ssh.run(&present, &cancel).await?.trim() == "present" {
        return Ok(BundleInstall {
            copied: false,
            bytes: 0,
            duration: started.elapsed(),
        });
    }
    // Streamed from the file by `ssh` itself: many boxes bootstrapping at once must not each
    // hold a copy of the executable in the gateway's memory.
    let size = tokio::fs::metadata(&bundle.exe)
        .await
        .map_err(|e| Error::Internal(format!("cannot read {}: {e}", bundle.exe.display())))?
        .len();
    let manifest = skiff_ssh::shell_quote(&bundle.manifest());
    let script = format!(
        "set -e; umask 077; d=\"$HOME/{dir}\"; mkdir -p \"$d\"; cat > \"$d/skiff.part\"; \
         chmod 700 \"$d/skiff.part\"; rm -f \"$d/manifest.json\"; mv \"$d/skiff.part\" \"$d/skiff\"; \
         h=$(\"$d/skiff\" --build-hash); [ \"$h\" = {hash} ] && printf '%s' {manifest} > \"$d/manifest.json\"; echo \"$h\"",
        hash = bundle.hash
    );
    let installed = ssh
        .run_with_file_input(&script, &bundle.exe, Duration::from_secs(600), &cancel)
        .await?;
    if installed.trim() != bundle.hash {
        return Err(Error::BoxNotReady(format!(
            "the bundle installed on {} reports build {}, not the gateway's {}; refusing to use it",
            ssh.target().alias,
            installed.trim(),
            bundle.hash
        )));
    }
    Ok(BundleInstall {
        copied: true,
        bytes: size,
        duration: started.elapsed(),
    })
}
