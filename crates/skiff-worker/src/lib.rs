//! Worker mode (`skiff worker`): the agent loop on a box, with its model client and session
//! backend made of gateway RPCs over the SSH tunnel.
//!
//! The worker connects to a box-local unix socket that the gateway's SSH connection forwards
//! to the gateway's worker endpoint, says hello with the credential it was started with, and
//! then runs the turns the gateway hands it. When the connection drops it reconnects with
//! backoff and sends again whatever was in flight; when the gateway refuses it for good
//! (credential used or expired, build mismatch, stale epoch) it exits and the gateway starts a
//! new worker.
//!
//! Deliberately absent: any gateway surface (no HTTP, no store), local credentials (it holds
//! only the credential it was handed, in memory), and a model catalog — it does not depend on
//! `skiff-llm`, `skiff-store` or `skiff-gateway`.

mod backend;
mod gate;
mod link;
mod turns;

pub use turns::scan_workspace;

use link::{Ident, Link};
use skiff_protocol::worker::{GatewayFrame, PROTOCOL_VERSION, RefusalCode, WorkerFrame, features};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::BufReader;
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// How a worker is started.
#[derive(Clone, Debug)]
pub struct Options {
    /// The box-local end of the tunnel.
    pub socket: PathBuf,
    /// The credential minted for this worker.
    pub credential: String,
    pub build_hash: String,
    /// The directory workspace paths are relative to (the box user's home).
    pub home: PathBuf,
    /// Give up when the gateway has been unreachable this long.
    pub give_up_after: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the gateway refused this worker ({}): {message}", code.as_str())]
    Refused { code: RefusalCode, message: String },
    #[error("the gateway has been unreachable at {socket} for {secs} s; giving up")]
    GatewayGone { socket: String, secs: u64 },
}

/// Runs until the gateway says shut down, refuses this worker, or stays unreachable.
pub async fn run(options: Options) -> Result<(), Error> {
    let link = Arc::new(Link::new(options.credential.clone()));
    let turns = Arc::new(turns::Turns::new(link.clone(), options.home.clone()));
    let mut backoff = Duration::from_millis(50);
    let mut unreachable_since = Instant::now();
    loop {
        match connect_once(&options, &link, &turns).await {
            Ok(Session::Shutdown(reason)) => {
                tracing::info!(reason, "the gateway shut this worker down");
                turns.cancel_all();
                return Ok(());
            }
            Ok(Session::Dropped) => {
                backoff = Duration::from_millis(50);
                unreachable_since = Instant::now();
                let (calls, events, models) = link.in_flight();
                tracing::info!(
                    calls,
                    events,
                    models,
                    "connection to the gateway dropped; reconnecting"
                );
            }
            Err(Attempt::Refused(code, message)) if fatal(code) => {
                turns.cancel_all();
                return Err(Error::Refused { code, message });
            }
            Err(Attempt::Refused(code, message)) => {
                tracing::warn!(
                    code = code.as_str(),
                    message,
                    "the gateway cannot take this worker yet"
                );
            }
            Err(Attempt::Io(e)) => {
                tracing::warn!(error = %e, "cannot reach the gateway");
            }
        }
        if unreachable_since.elapsed() > options.give_up_after {
            turns.cancel_all();
            return Err(Error::GatewayGone {
                socket: options.socket.display().to_string(),
                secs: options.give_up_after.as_secs(),
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

fn fatal(code: RefusalCode) -> bool {
    !matches!(code, RefusalCode::Unavailable)
}

enum Session {
    Shutdown(String),
    Dropped,
}

enum Attempt {
    Refused(RefusalCode, String),
    Io(std::io::Error),
}

impl From<std::io::Error> for Attempt {
    fn from(e: std::io::Error) -> Self {
        Attempt::Io(e)
    }
}

async fn connect_once(
    options: &Options,
    link: &Arc<Link>,
    turns: &Arc<turns::Turns>,
) -> Result<Session, Attempt> {
    let stream = UnixStream::connect(&options.socket).await?;
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let hello = WorkerFrame::Hello {
        protocol_version: PROTOCOL_VERSION,
        build_hash: options.build_hash.clone(),
        features: features(),
        credential: link.credential(),
    };
    skiff_wire::write_frame(&mut write, &hello)
        .await
        .map_err(wire_error)?;
    let first = tokio::time::timeout(Duration::from_secs(30), skiff_wire::read_line(&mut reader))
        .await
        .map_err(|_| std::io::Error::other("no welcome from the gateway within 30 s"))?
        .map_err(wire_error)?;
    let Some(first) = first else {
        return Err(
            std::io::Error::other("the gateway closed the connection during the hello").into(),
        );
    };
    let (ident, cursors, workspace) = match parse(&first)? {
        GatewayFrame::Welcome {
            session_id,
            lifecycle_revision,
            owner_epoch,
            credential,
            credential_expires_at_ms,
            cursors,
            workspace,
        } => {
            link.set_credential(credential, credential_expires_at_ms);
            let ident = Ident {
                session_id,
                lifecycle_revision,
                owner_epoch,
            };
            (ident, cursors, workspace)
        }
        GatewayFrame::Refused { code, message } => return Err(Attempt::Refused(code, message)),
        other => {
            return Err(std::io::Error::other(format!("expected a welcome, got {other:?}")).into());
        }
    };
    tracing::info!(session = %ident.session_id, epoch = ident.owner_epoch, "admitted by the gateway");
    turns.set_workspace(options.home.join(workspace));

    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if skiff_wire::write_line(&mut write, line).await.is_err() {
                break;
            }
        }
    });
    link.attach(ident, &cursors, tx);
    let rotation = tokio::spawn(turns::rotate_credentials(link.clone()));

    let outcome = loop {
        let frame = match skiff_wire::read_line(&mut reader).await {
            Ok(Some(line)) => line,
            Ok(None) | Err(_) => break Session::Dropped,
        };
        let frame = match parse(&frame) {
            Ok(frame) => frame,
            Err(e) => {
                tracing::warn!(error = %e, "ignoring a frame this worker does not understand");
                continue;
            }
        };
        match frame {
            GatewayFrame::Reply { stream, seq, reply } => link.on_reply(stream, seq, reply),
            GatewayFrame::Model { seq, index, events } => {
                for (i, event) in (index..).zip(events) {
                    link.on_model_event(seq, i, event);
                }
            }
            GatewayFrame::EventAck { seq } => link.on_event_ack(seq),
            GatewayFrame::Turn { turn } => turns.start(turn),
            GatewayFrame::CancelTurn { run_id } => turns.cancel(&run_id),
            GatewayFrame::Canary { nonce, model } => turns.canary(nonce, model),
            GatewayFrame::Shutdown { reason } => break Session::Shutdown(reason),
            GatewayFrame::WorkspaceLaid { error } => turns.workspace_laid(error),
            GatewayFrame::Refused { code, message } => {
                tracing::warn!(code = code.as_str(), message, "the gateway refused a frame");
            }
            GatewayFrame::Welcome { .. } => {
                tracing::warn!("ignoring a second welcome");
            }
        }
    };
    link.detach();
    rotation.abort();
    writer.abort();
    Ok(outcome)
}

fn parse(line: &str) -> std::io::Result<GatewayFrame> {
    serde_json::from_str(line).map_err(|e| std::io::Error::other(format!("bad frame: {e}")))
}

/// A framing failure, as the connection error the reconnect loop handles.
fn wire_error(e: skiff_wire::Error) -> std::io::Error {
    match e {
        skiff_wire::Error::Io(e) => e,
        other => std::io::Error::other(format!("from the gateway: {other}")),
    }
}
