//! `skiff ui`: prints a one-use login link for the Control UI (and opens it with `--open`).
//!
//! The link carries a ticket, not the token: the gateway trades it once, within a minute, for
//! an HttpOnly session cookie, and redirects so the ticket leaves the address bar.

use crate::client::Client;
use anyhow::Result;
use clap::Args;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub struct UiArgs {
    /// Open the link in the desktop's browser (xdg-open)
    #[arg(long)]
    open: bool,
}

/// With `--json`: `{url, expires_at_ms}`.
pub async fn run(args: UiArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    let client = Client::discover(state_dir)?;
    let ticket = client.ui_ticket().await?;
    let url = format!("{}{}", client.url(), ticket.login_path);
    if json {
        outln!(
            "{}",
            serde_json::json!({ "url": url, "expires_at_ms": ticket.expires_at_ms })
        )?;
    } else {
        outln!("{url}")?;
        eprintln!("open it within a minute; it works once (run `skiff ui` again for a new one)");
    }
    if args.open {
        let mut open = skiff_process::Cmd::new("xdg-open")
            .arg(&url)
            .timeout(Duration::from_secs(10));
        // The helper starts children with a clean environment; a browser needs the session's
        // display and bus to find the desktop.
        for key in [
            "DISPLAY",
            "WAYLAND_DISPLAY",
            "XDG_RUNTIME_DIR",
            "DBUS_SESSION_BUS_ADDRESS",
            "BROWSER",
        ] {
            if let Some(value) = std::env::var_os(key) {
                open = open.env(key, value);
            }
        }
        let opened = open.run_checked(&CancellationToken::new()).await;
        if let Err(e) = opened {
            eprintln!("could not open a browser ({e}); open the link above yourself");
        }
    }
    Ok(ExitCode::SUCCESS)
}
