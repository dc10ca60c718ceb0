//! `process`: commands that keep running in the background (a dev server, a watcher) while the
//! agent works, started like `exec`'s ([`exec::shell`]: contained, a clean environment,
//! recorded in the ledger), their output kept in a bounded ring the model reads from.
//!
//! Nothing outlives its owner: [`Processes::end_turn`] stops every process not started with
//! `keep`, and dropping the last handle of a [`Processes`] stops the rest — so a process lives
//! at most as long as whoever holds the registry (a turn's [`super::Tools`] by default; a
//! session's runtime when it hands one in with [`super::Tools::with_processes`]), and never
//! past [`MAX_LIFETIME`].

use super::{MAX_RESULT_BYTES, Workspace, exec};
use serde::Deserialize;
use skiff_process::{Error, Ledger, Sandbox};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio_util::sync::{CancellationToken, DropGuard};

/// Output kept per process; older output is dropped (and counted) as new output arrives.
pub const RING_BYTES: usize = MAX_RESULT_BYTES - 4 * 1024;
/// The most processes that may run at once in one registry.
pub const MAX_RUNNING: usize = 8;
/// How long a background process may run before it is stopped, `keep` or not.
pub const MAX_LIFETIME: Duration = Duration::from_secs(8 * 3600);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProcessArgs {
    action: Action,
    id: Option<Id>,
    command: Option<String>,
    workdir: Option<String>,
    keep: Option<bool>,
}

/// Models send an id back as they received it, or as a number; both are fine.
#[derive(Deserialize)]
#[serde(untagged)]
enum Id {
    Text(String),
    Number(u32),
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum Action {
    Start,
    Status,
    Output,
    Stop,
}

/// The background processes of a turn or a session. Cloning shares them.
#[derive(Clone, Debug)]
pub struct Processes(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// Cancelled when the last handle goes: every process is a child of it.
    all: CancellationToken,
    _stop_all: DropGuard,
    /// Whether this registry outlives a turn, so that `keep` means something.
    session: bool,
}

#[derive(Debug, Default)]
struct State {
    next: u32,
    procs: BTreeMap<u32, Proc>,
}

#[derive(Debug)]
struct Proc {
    command: String,
    keep: bool,
    started: Instant,
    stop: CancellationToken,
    /// Cancelled by the process's task once everything it started is gone.
    ended: CancellationToken,
    shared: Arc<Mutex<Shared>>,
}

#[derive(Debug, Default)]
struct Shared {
    ring: VecDeque<u8>,
    /// Bytes of output ever received, and how far the model has read.
    total: u64,
    read: u64,
    /// How it ended, once it has.
    end: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain data behind, still consistent enough to
    // report and stop processes with.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Processes {
    /// A registry for one turn: it goes with the turn's tools, `keep` or not.
    pub fn for_turn() -> Self {
        Self::with_scope(false)
    }

    /// A registry a session holds across its turns: `keep` processes live on between them
    /// until [`Processes::stop_all`] or the registry is dropped.
    pub fn for_session() -> Self {
        Self::with_scope(true)
    }

    fn with_scope(session: bool) -> Self {
        let all = CancellationToken::new();
        Self(Arc::new(Inner {
            state: Mutex::default(),
            _stop_all: all.clone().drop_guard(),
            all,
            session,
        }))
    }

    /// Stops every process not started with `keep`, and waits until each is gone.
    pub async fn end_turn(&self) {
        self.stop_where(|p| !p.keep).await;
    }

    /// Stops every process, kept ones too (the session is ending), and waits until each is
    /// gone.
    pub async fn stop_all(&self) {
        self.stop_where(|_| true).await;
    }

    async fn stop_where(&self, which: impl Fn(&Proc) -> bool) {
        let ended: Vec<CancellationToken> = {
            let mut state = lock(&self.0.state);
            let ids: Vec<u32> = state
                .procs
                .iter()
                .filter(|(_, p)| which(p))
                .map(|(id, _)| *id)
                .collect();
            ids.iter()
                .filter_map(|id| state.procs.remove(id))
                .map(|p| {
                    p.stop.cancel();
                    p.ended
                })
                .collect()
        };
        for ended in ended {
            ended.cancelled().await;
        }
    }

    fn start(
        &self,
        ws: &Workspace,
        extra_env: &[(String, String)],
        ledger: Option<&Ledger>,
        sandbox: Option<&Sandbox>,
        args: &ProcessArgs,
    ) -> Result<String, String> {
        let Some(command) = args.command.as_deref().filter(|c| !c.trim().is_empty()) else {
            return Err("start needs a command".to_owned());
        };
        let cwd = match &args.workdir {
            Some(dir) => exec::workdir(ws, dir)?,
            None => ws.root().to_path_buf(),
        };
        let mut state = lock(&self.0.state);
        let running = state
            .procs
            .values()
            .filter(|p| !p.ended.is_cancelled())
            .count();
        if running >= MAX_RUNNING {
            return Err(format!(
                "{running} processes are running already (at most {MAX_RUNNING}); stop one first"
            ));
        }
        state.next += 1;
        let id = state.next;
        let (tee, mut chunks) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        // The capture of `run` is not read (the ring is), so it is kept small.
        let cmd = exec::shell(extra_env, ledger, sandbox, command, &cwd)
            .timeout(MAX_LIFETIME)
            .output_cap(1024)
            .tee(tee);
        let stop = self.0.all.child_token();
        let ended = CancellationToken::new();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let task = {
            let (stop, ended, shared) = (stop.clone(), ended.clone(), shared.clone());
            async move {
                let _ended = ended.drop_guard();
                let pump = async {
                    // Ends when the command's output closes, which `run` waits for.
                    while let Some(chunk) = chunks.recv().await {
                        push(&mut lock(&shared), &chunk);
                    }
                };
                let (result, ()) = tokio::join!(cmd.run(&stop), pump);
                lock(&shared).end = Some(match result {
                    Ok(done) => format!("exited with code {}", done.code()),
                    Err(Error::Cancelled { .. }) => {
                        "stopped; it and everything it started were killed".to_owned()
                    }
                    Err(Error::TimedOut { .. }) => format!(
                        "stopped after running for {} hours, the limit",
                        MAX_LIFETIME.as_secs() / 3600
                    ),
                    Err(e) => format!("failed: {e}"),
                });
            }
        };
        tokio::spawn(task);
        let keep = args.keep.unwrap_or(false) && self.0.session;
        state.procs.insert(
            id,
            Proc {
                command: command.to_owned(),
                keep,
                started: Instant::now(),
                stop,
                ended,
                shared,
            },
        );
        let until = match (keep, args.keep) {
            (true, _) => " or the session ends",
            (false, Some(true)) => {
                " or this turn ends (keep is not available here: this runtime ends background \
                 processes with the turn)"
            }
            (false, _) => " or this turn ends",
        };
        Ok(format!(
            "started process {id}: {command}\nit runs until stopped{until}; read its output \
             with {{\"action\": \"output\", \"id\": \"{id}\"}}"
        ))
    }

    fn status(&self, id: Option<&str>) -> Result<String, String> {
        let state = lock(&self.0.state);
        if let Some(id) = id {
            let (n, p) = find(&state, id)?;
            return Ok(line(n, p));
        }
        if state.procs.is_empty() {
            return Ok("no background processes".to_owned());
        }
        Ok(state
            .procs
            .iter()
            .map(|(n, p)| line(*n, p))
            .collect::<Vec<_>>()
            .join("\n"))
    }

    fn output(&self, id: Option<&str>) -> Result<String, String> {
        let id = id.ok_or("output needs the id of a process")?;
        let state = lock(&self.0.state);
        let (n, p) = find(&state, id)?;
        let mut out = format!("{}\n", line(n, p));
        out.push_str(&unread(&mut lock(&p.shared)));
        Ok(out)
    }

    async fn stop(&self, id: Option<&str>) -> Result<String, String> {
        let id = id.ok_or("stop needs the id of a process")?;
        let (n, p) = {
            let mut state = lock(&self.0.state);
            let (n, _) = find(&state, id)?;
            (n, state.procs.remove(&n).ok_or("it is gone")?)
        };
        p.stop.cancel();
        p.ended.cancelled().await;
        let mut out = format!("{}\n", line(n, &p));
        out.push_str(&unread(&mut lock(&p.shared)));
        Ok(out)
    }
}

pub(super) async fn process(
    processes: &Processes,
    ws: &Workspace,
    extra_env: &[(String, String)],
    ledger: Option<&Ledger>,
    sandbox: Option<&Sandbox>,
    args: ProcessArgs,
) -> Result<String, String> {
    let id = match &args.id {
        Some(Id::Text(text)) => Some(text.clone()),
        Some(Id::Number(n)) => Some(n.to_string()),
        None => None,
    };
    let id = id.as_deref();
    match args.action {
        Action::Start => {
            // Refused now, in words the model reads, rather than as a process that ended.
            if let Some(sandbox) = sandbox
                && let Err(reason) = skiff_process::sandbox::probe().await
            {
                return Err(Error::Sandbox {
                    reason,
                    hint: sandbox.hint_text().to_owned(),
                }
                .to_string());
            }
            processes.start(ws, extra_env, ledger, sandbox, &args)
        }
        Action::Status => processes.status(id),
        Action::Output => processes.output(id),
        Action::Stop => processes.stop(id).await,
    }
}

fn find<'a>(state: &'a State, id: &str) -> Result<(u32, &'a Proc), String> {
    id.trim()
        .parse()
        .ok()
        .and_then(|n| state.procs.get_key_value(&n))
        .map(|(n, p)| (*n, p))
        .ok_or_else(|| {
            let known: Vec<String> = state.procs.keys().map(u32::to_string).collect();
            format!(
                "no process {id}; known: {}",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            )
        })
}

/// `1 running for 12 s: npm run dev` / `2 exited with code 1: make watch`.
fn line(id: u32, p: &Proc) -> String {
    let end = lock(&p.shared).end.clone();
    let state = match end {
        Some(end) => end,
        None => format!("running for {} s", p.started.elapsed().as_secs()),
    };
    let kept = if p.keep { " (kept across turns)" } else { "" };
    format!("process {id} {state}{kept}: {}", p.command)
}

fn push(shared: &mut Shared, chunk: &[u8]) {
    shared.total += chunk.len() as u64;
    shared.ring.extend(chunk);
    let over = shared.ring.len().saturating_sub(RING_BYTES);
    shared.ring.drain(..over);
}

/// The output the model has not read yet (what the ring still holds of it), marked as read.
fn unread(shared: &mut Shared) -> String {
    let held_from = shared.total - shared.ring.len() as u64;
    let from = shared.read.max(held_from);
    let mut out = String::new();
    if from > shared.read {
        let _ = writeln!(
            out,
            "[… {} bytes of earlier output were dropped; only the last {} KiB are kept]",
            from - shared.read,
            RING_BYTES / 1024
        );
    }
    let skip = usize::try_from(from - held_from).unwrap_or(usize::MAX);
    let bytes: Vec<u8> = shared.ring.iter().skip(skip).copied().collect();
    if bytes.is_empty() && out.is_empty() {
        out.push_str("(no new output)");
    }
    out.push_str(&String::from_utf8_lossy(&bytes));
    shared.read = shared.total;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_output_and_says_what_it_dropped() {
        let mut shared = Shared::default();
        push(&mut shared, b"hello ");
        assert_eq!(unread(&mut shared), "hello ");
        assert_eq!(unread(&mut shared), "(no new output)");
        push(&mut shared, b"world");
        assert_eq!(unread(&mut shared), "world");
        push(&mut shared, &vec![b'a'; RING_BYTES]);
        push(&mut shared, b"end");
        let out = unread(&mut shared);
        assert!(
            out.starts_with("[… 3 bytes of earlier output were dropped"),
            "{}",
            &out[..100]
        );
        assert!(out.ends_with("aaaend"));
        assert_eq!(shared.ring.len(), RING_BYTES);
    }
}
