//! `skiff box warmup|status|heartbeat|stop|list`: this machine's local boxes behind the
//! lease-CLI contract that the `command` provider consumes — so that contract is exercised
//! against a real CLI, and operators can see what a conforming one looks like. With the
//! optional snapshot verbs (`snapshot`, `warmup --from-snapshot`, `restore`, `snapshot-rm`,
//! `snapshot-list`). Plus the hidden `proxy`, the `ProxyCommand` that reaches a box's sshd
//! inside its network namespace, `scan`, which prints a box workspace's manifest when the
//! gateway must capture its work without a worker, and the sandbox's two start stages.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use skiff_protocol::SnapshotId;
use skiff_protocol::lease::{LeaseCliSnapshot, LeaseCliStatus, is_lease_cli_id};
use skiff_providers::Isolation;
use skiff_providers::local::Boxes;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct BoxArgs {
    /// Where boxes live [default: /var/lib/skiff/boxes as root, else <state-dir>/boxes]
    #[arg(long, global = true, value_name = "DIR")]
    root: Option<PathBuf>,
    #[command(subcommand)]
    command: BoxCommand,
}

#[derive(Subcommand)]
enum BoxCommand {
    /// Lease a box (idempotent for the same id) and print its status
    Warmup {
        #[arg(long, value_name = "cbx_…")]
        lease_id: String,
        #[arg(long, value_enum)]
        isolation: Option<IsolationArg>,
        /// Lifetime of the lease
        #[arg(long, default_value = "8h")]
        ttl: String,
        /// Start the box's home as a copy of this snapshot
        #[arg(long, value_name = "snap_…")]
        from_snapshot: Option<String>,
    },
    /// Capture a box's home (without workspaces and ~/.skiff) as a snapshot; idempotent
    Snapshot {
        #[arg(long, value_name = "cbx_…")]
        id: String,
        #[arg(long, value_name = "snap_…")]
        snapshot_id: String,
    },
    /// Replace a running box's home (but its workspaces and ~/.skiff) with a snapshot's copy,
    /// owned by the box's user
    Restore {
        #[arg(long, value_name = "cbx_…")]
        id: String,
        #[arg(long, value_name = "snap_…")]
        snapshot_id: String,
    },
    /// Delete a snapshot (one that does not exist is already deleted)
    SnapshotRm {
        #[arg(value_name = "snap_…")]
        id: String,
    },
    /// Every snapshot, as {"id","sizeBytes"} objects
    SnapshotList,
    /// Print a lease's status (state `gone` for an unknown lease)
    Status {
        #[arg(long, value_name = "cbx_…|lbx_…")]
        id: String,
    },
    /// Extend a lease
    Heartbeat {
        #[arg(long, value_name = "cbx_…")]
        id: String,
        #[arg(long, default_value = "8h")]
        ttl: String,
    },
    /// Release a lease: kill the box's sshd and everything in it, remove it (also a box the
    /// gateway leased, `lbx_…`, that a crash left behind)
    Stop {
        #[arg(value_name = "cbx_…|lbx_…")]
        id: String,
    },
    /// Every lease, as status objects
    List,
    /// Connect stdin/stdout to HOST:PORT (an ssh ProxyCommand)
    #[command(hide = true)]
    Proxy { host: String, port: u16 },
    /// Print the manifest of a workspace on this box (JSON), for the gateway to capture a
    /// box's work when no worker can start there
    #[command(hide = true)]
    Scan { workspace: PathBuf },
    /// Start the sandbox of the box in DIR (run by `unshare` as root; see `sandbox.rs`)
    #[command(hide = true, name = skiff_providers::local::sandbox::START)]
    SandboxStart { dir: PathBuf },
    /// PID 1 of a box's sandbox: build it, run its sshd, reap, exit with sshd
    #[command(hide = true, name = skiff_providers::local::sandbox::INIT)]
    SandboxInit { dir: PathBuf },
}

#[derive(Clone, Copy, ValueEnum)]
enum IsolationArg {
    None,
    Netns,
}

fn check_id(id: &str) -> Result<()> {
    if !is_lease_cli_id(id) {
        bail!("lease id {id:?} is not `cbx_` followed by 12 lowercase hex characters");
    }
    Ok(())
}

/// `status` and `stop` also take the ids of boxes the gateway's local provider leased (`lbx_…`,
/// listed by `skiff box list` beside the lease CLI's own), so an operator can see and end a box
/// a crashed gateway or test left behind.
fn check_any_box_id(id: &str) -> Result<()> {
    let local = id.strip_prefix("lbx_").is_some_and(|hex| {
        hex.len() == 12
            && hex
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    });
    if !local && !is_lease_cli_id(id) {
        bail!(
            "box id {id:?} is not `cbx_` or `lbx_` followed by 12 lowercase hex characters \
             (`skiff box list` shows the boxes there are)"
        );
    }
    Ok(())
}

fn snapshot_id(id: &str) -> Result<SnapshotId> {
    SnapshotId::parse(id).with_context(|| {
        format!("snapshot id {id:?} is not `snap_` followed by 16 lowercase hex characters")
    })
}

fn print_snapshot(snapshot: &LeaseCliSnapshot, json: bool) -> Result<()> {
    if json {
        outln!("{}", serde_json::to_string(snapshot)?)?;
    } else {
        outln!("{}  {} bytes", snapshot.id, snapshot.size_bytes)?;
    }
    Ok(())
}

fn ttl(text: &str) -> Result<std::time::Duration> {
    humantime::parse_duration(text)
        .with_context(|| format!("--ttl {text:?} is not a duration like 8h"))
}

fn print(status: &LeaseCliStatus, json: bool) -> Result<()> {
    if json {
        outln!("{}", serde_json::to_string(status)?)?;
    } else {
        outln!(
            "{}  {}  {}@{}:{}",
            status.id,
            status.state,
            status.ssh_user,
            status.ssh_host,
            status.ssh_port
        )?;
    }
    Ok(())
}

/// Runs a stage of a box's sandbox, when that is the command. Called before any async runtime
/// exists: after `unshare --pid` the starter may not start threads, and the init is PID 1.
pub fn sandbox_stage(args: &BoxArgs) -> Option<ExitCode> {
    use skiff_providers::local::sandbox;
    let done = match &args.command {
        BoxCommand::SandboxStart { dir } => sandbox::start(dir).map(|()| 0),
        BoxCommand::SandboxInit { dir } => sandbox::init(dir),
        _ => return None,
    };
    Some(match done {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    })
}

pub async fn run(args: BoxArgs, state_dir: &Path, json: bool) -> Result<ExitCode> {
    if let BoxCommand::Proxy { host, port } = &args.command {
        return proxy(host, *port).await;
    }
    if let BoxCommand::Scan { workspace } = &args.command {
        let manifest = skiff_worker::scan_workspace(workspace)
            .await
            .with_context(|| format!("cannot list the workspace {}", workspace.display()))?;
        outln!("{}", serde_json::to_string(&manifest)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let root = args.root.unwrap_or_else(|| {
        if skiff_providers::running_as_root() {
            PathBuf::from("/var/lib/skiff/boxes")
        } else {
            state_dir.join("boxes")
        }
    });
    let exe = std::env::current_exe().context("cannot locate the skiff executable")?;
    let boxes = Boxes::new(root, exe);
    match args.command {
        BoxCommand::Warmup {
            lease_id,
            isolation,
            ttl: t,
            from_snapshot,
        } => {
            check_id(&lease_id)?;
            let isolation = match isolation {
                Some(IsolationArg::None) => Isolation::None,
                Some(IsolationArg::Netns) => Isolation::Netns,
                None => Isolation::host_default(),
            };
            let status = match from_snapshot {
                Some(snap) => {
                    boxes
                        .create_from_snapshot(&lease_id, &snapshot_id(&snap)?, isolation, ttl(&t)?)
                        .await?
                }
                None => boxes.create(&lease_id, isolation, ttl(&t)?).await?,
            };
            print(&status, json)?;
        }
        BoxCommand::Snapshot {
            id,
            snapshot_id: snap,
        } => {
            check_id(&id)?;
            let info = boxes.snapshot(&id, &snapshot_id(&snap)?).await?;
            print_snapshot(
                &LeaseCliSnapshot {
                    id: info.id.to_string(),
                    size_bytes: info.size_bytes,
                },
                json,
            )?;
        }
        BoxCommand::Restore {
            id,
            snapshot_id: snap,
        } => {
            check_id(&id)?;
            boxes.restore(&id, &snapshot_id(&snap)?).await?;
        }
        BoxCommand::SnapshotRm { id } => {
            boxes.delete_snapshot(&snapshot_id(&id)?).await?;
        }
        BoxCommand::SnapshotList => {
            let all: Vec<LeaseCliSnapshot> = boxes
                .list_snapshots()?
                .into_iter()
                .map(|s| LeaseCliSnapshot {
                    id: s.id.to_string(),
                    size_bytes: s.size_bytes,
                })
                .collect();
            if json {
                outln!("{}", serde_json::to_string(&all)?)?;
            } else {
                for snapshot in &all {
                    print_snapshot(snapshot, false)?;
                }
            }
        }
        BoxCommand::Status { id } => {
            check_any_box_id(&id)?;
            print(
                &boxes
                    .status(&id)?
                    .unwrap_or_else(|| LeaseCliStatus::without_endpoint(&id, "gone")),
                json,
            )?;
        }
        BoxCommand::Heartbeat { id, ttl: t } => {
            check_id(&id)?;
            boxes.heartbeat(&id, ttl(&t)?)?;
        }
        BoxCommand::Stop { id } => {
            check_any_box_id(&id)?;
            boxes.destroy(&id).await?;
        }
        BoxCommand::List => {
            let mut all = Vec::new();
            for id in boxes.list()? {
                if let Some(status) = boxes.status(&id)? {
                    all.push(status);
                }
            }
            if json {
                outln!("{}", serde_json::to_string(&all)?)?;
            } else {
                for status in &all {
                    print(status, false)?;
                }
            }
        }
        BoxCommand::Proxy { .. }
        | BoxCommand::Scan { .. }
        | BoxCommand::SandboxStart { .. }
        | BoxCommand::SandboxInit { .. } => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Pipes stdin/stdout to a TCP connection until the box side closes. Plain threads and
/// blocking reads with a large buffer rather than async stdio (whose every read hops through a
/// blocking thread) or `std::io::copy` (whose splice path stalled OpenSSH's handshake here):
/// this carries bundle copies.
async fn proxy(host: &str, port: u16) -> Result<ExitCode> {
    let stream = std::net::TcpStream::connect((host, port))
        .with_context(|| format!("cannot connect to {host}:{port}"))?;
    // SSH packets carry token streams: Nagle's algorithm would hold each small one back until
    // the previous is acknowledged (tens of milliseconds with delayed ACKs).
    stream
        .set_nodelay(true)
        .context("cannot set TCP_NODELAY on the box connection")?;
    let mut to_box = stream
        .try_clone()
        .context("cannot clone the box connection")?;
    // Raw descriptors: the standard handles buffer (stdout by line), which would hold back
    // SSH's binary stream.
    use std::os::fd::AsFd;
    let mut stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
    let mut stdout = std::fs::File::from(std::io::stdout().as_fd().try_clone_to_owned()?);
    std::thread::spawn(move || {
        pump(&mut stdin, &mut to_box);
        let _ = to_box.shutdown(std::net::Shutdown::Write);
    });
    let mut from_box = QuickAck(stream);
    pump(&mut from_box, &mut stdout);
    Ok(ExitCode::SUCCESS)
}

/// Reads from the box acknowledging at once: sshd sends small packets without `TCP_NODELAY`
/// (it sets it only for interactive sessions), so each one otherwise waits for this side's
/// delayed ACK of the one before. Linux clears quick-ACK mode by itself; it is set per read.
struct QuickAck(std::net::TcpStream);

impl std::io::Read for QuickAck {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.0.read(buf)?;
        let _ = rustix::net::sockopt::set_tcp_quickack(&self.0, true);
        Ok(n)
    }
}

fn pump(from: &mut impl std::io::Read, to: &mut impl std::io::Write) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
