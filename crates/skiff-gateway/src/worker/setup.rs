//! A box's setup phase: after the workspace is laid down and before the worker starts, the
//! repository's `.skiff/setup.sh` (or the profile's `setup` command) runs on the box as the box
//! user, in the workspace, under a timeout. Its output is streamed to the session's followers
//! as it arrives and kept whole as a `log` artifact; setup-only secrets reach the setup process
//! through its stdin (never a command line, a file or the worker's environment) and are
//! redacted from everything it prints.
//!
//! Deliberately absent: a second try. A failing setup fails the placement with its last lines;
//! the session stays usable and the next message places it again.

use super::place::box_workspace;
use crate::error::Result;
use serde_json::json;
use skiff_protocol::SessionId;
use skiff_protocol::environment::SetupLog;
use skiff_protocol::event::EventKind;
use skiff_store::{ArtifactRole, NewArtifact, PlacementRow, Retention, Scope, SessionRow};
use skiff_sync::cas::Cas;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The repository's setup script, relative to the workspace.
pub(crate) const SETUP_SCRIPT: &str = ".skiff/setup.sh";
/// What a box made from a prepared-box snapshot runs instead of setup, when present.
pub(crate) const MAINTAIN_SCRIPT: &str = ".skiff/maintain.sh";
/// The line of a setup script that names the files its result depends on.
const KEY_FILES_MARK: &str = "# skiff: key-files =";
/// How much setup output is published live; the rest is in the log only.
const LIVE_CAP: usize = 256 << 10;
/// How much of the log is kept.
const LOG_CAP: u64 = 32 << 20;
/// Output is published at most this often (or when a chunk fills up).
const PUBLISH_EVERY: Duration = Duration::from_millis(200);
const CHUNK: usize = 8 << 10;
/// The lines of the log a failed setup's error carries.
const TAIL_LINES: usize = 12;

/// What runs as setup.
pub(crate) struct SetupPlan {
    /// For people: `.skiff/setup.sh`, or `setup of profile NAME`.
    pub label: String,
    /// The shell line the box runs, in the workspace.
    command: String,
    timeout: Duration,
    /// `NAME=value` pairs for the setup process only.
    secrets: Vec<(String, String)>,
    /// Extra environment (the egress proxy's variables).
    env: Vec<(String, String)>,
    /// What a prepared box of this setup is kept under: the setup, the profile, the bundle
    /// and the key files, hashed.
    pub key: String,
    /// `.skiff/maintain.sh` when the workspace has one.
    pub maintain: Option<String>,
}

impl SetupPlan {
    /// The same plan running `.skiff/maintain.sh` instead (a box from a snapshot).
    pub(crate) fn maintenance(self) -> Option<SetupPlan> {
        let command = self.maintain.clone()?;
        Some(SetupPlan {
            label: MAINTAIN_SCRIPT.to_owned(),
            command,
            ..self
        })
    }

    pub(crate) fn with_env(mut self, env: Vec<(String, String)>) -> Self {
        self.env.extend(env);
        self
    }

    /// The script the box's `bash -s` reads: variables first (through stdin, so no value is on
    /// a command line or on disk), then the setup itself with no stdin of its own.
    fn stdin_script(&self, workspace: &str) -> Vec<u8> {
        let mut script = String::from("set -e\n");
        script.push_str(&format!(
            "cd \"$HOME\"/{}\n",
            skiff_ssh::shell_quote(workspace)
        ));
        for (key, value) in self.env.iter().chain(&self.secrets) {
            script.push_str(&format!("export {key}={}\n", skiff_ssh::shell_quote(value)));
        }
        script.push_str(&format!(
            "exec bash -c {} skiff-setup </dev/null 2>&1\n",
            skiff_ssh::shell_quote(&self.command)
        ));
        script.into_bytes()
    }
}

/// How a setup ended.
pub(crate) struct SetupOutcome {
    pub exit_code: i32,
    pub duration: Duration,
    pub timed_out: bool,
    /// The log's last lines (secrets redacted).
    pub tail: String,
}

impl SetupOutcome {
    pub(crate) fn succeeded(&self) -> bool {
        self.exit_code == 0 && !self.timed_out
    }

    /// The error a failed placement records: what failed, the log's end, what to do.
    pub(crate) fn failure(&self, plan: &SetupPlan, session: &SessionId) -> String {
        let label = &plan.label;
        let how = if self.timed_out {
            format!(
                "did not finish within its timeout ({}; the profile's setup_timeout)",
                humantime::format_duration(plan.timeout)
            )
        } else {
            format!(
                "exited with status {} after {:.1} s",
                self.exit_code,
                self.duration.as_secs_f64()
            )
        };
        format!(
            "setup ({label}) {how}; its log ends:\n{}\nFix it and send the message again (the whole log: skiff session setup-log {session})",
            self.tail.trim_end()
        )
    }
}

impl super::WorkerSide {
    /// Whether [`WorkerSide::setup_plan`](super::WorkerSide::setup_plan) must wait for the session's worktree to be filled: it
    /// reads the workspace's `.skiff/` (the setup and maintenance scripts) and the key files
    /// a setup names. While a fill is under way, a profile without a `setup` whose workspace
    /// gets no `.skiff` (neither from the tree the fill writes nor, already there, from a
    /// large untracked file copied beside it) has no setup whatever the fill writes: the
    /// placement leases its box meanwhile.
    pub(super) async fn setup_reads_workspace(&self, session: &SessionRow, profile: &str) -> bool {
        let profile_setup = self
            .envs
            .profile_config(profile)
            .map_or(true, |config| config.setup.is_some());
        if profile_setup {
            return true;
        }
        let workspace = Path::new(session.workspace.path());
        let dir = SETUP_SCRIPT.split('/').next().unwrap_or(SETUP_SCRIPT);
        if workspace.join(dir).symlink_metadata().is_ok() {
            return true;
        }
        self.fills
            .writes_root_entry(&session.id, workspace, dir)
            .await
            .unwrap_or(true)
    }

    /// The setup this placement runs, if any: the profile's `setup`, else the repository's
    /// `.skiff/setup.sh` as the session's workspace holds it.
    pub(super) fn setup_plan(
        &self,
        session: &SessionRow,
        profile: &str,
    ) -> Result<Option<SetupPlan>> {
        let config = self.envs.profile_config(profile)?;
        let timeout = config.setup_timeout()?;
        let secrets = config.setup_secrets(profile, &|secret| {
            skiff_llm::Secrets::reveal(self.vault.as_ref(), secret).map_err(|e| e.to_string())
        })?;
        let workspace = Path::new(session.workspace.path());
        let script = workspace.join(SETUP_SCRIPT);
        let (label, command, text) = match &config.setup {
            Some(command) => (
                format!("setup of profile {profile}"),
                command.clone(),
                command.clone(),
            ),
            None => {
                if !script.is_file() {
                    return Ok(None);
                }
                let text = std::fs::read_to_string(&script).map_err(|e| {
                    crate::Error::Internal(format!("cannot read {SETUP_SCRIPT}: {e}"))
                })?;
                (
                    SETUP_SCRIPT.to_owned(),
                    format!("bash {SETUP_SCRIPT}"),
                    text,
                )
            }
        };
        let mut key_files: Vec<String> = config.setup_key_files.clone();
        key_files.extend(declared_key_files(&text));
        let key = snapshot_key(
            &text,
            profile,
            &format!("{:?}", config.egress.setup),
            self.envs.bundle_hash_now().as_deref().unwrap_or(""),
            workspace,
            &key_files,
        );
        let maintain = workspace
            .join(MAINTAIN_SCRIPT)
            .is_file()
            .then(|| format!("bash {MAINTAIN_SCRIPT}"));
        Ok(Some(SetupPlan {
            label,
            command,
            timeout,
            secrets,
            env: Vec::new(),
            key,
            maintain,
        }))
    }

    /// Runs `plan` on the placement's box, streaming its output to the session and keeping the
    /// whole log as an artifact.
    pub(super) async fn run_setup(
        &self,
        scope: &Scope,
        p: &PlacementRow,
        plan: &SetupPlan,
        cancel: &CancellationToken,
    ) -> Result<SetupOutcome> {
        let env = self.placement_env(scope, p)?;
        let ssh = self.envs.ssh(&env)?;
        let session = &p.session_id;
        let log_path = self.tmp().join(format!("setup-{session}.log"));
        std::fs::create_dir_all(self.tmp())
            .map_err(|e| crate::Error::Internal(format!("cannot make the setup log: {e}")))?;
        let (tee, chunks) = mpsc::unbounded_channel();
        let secrets: Vec<_> = plan.secrets.clone();
        let collector = Collector::new(&log_path, secrets)?;
        let started = Instant::now();
        let secs = plan.timeout.as_secs().max(1);
        // `timeout` on the box ends the whole setup (its process group) in time; the local
        // bound is only a backstop for a box that stops answering.
        let remote = format!("timeout --kill-after=10s {secs}s bash -s");
        let run = ssh.run_streaming(
            &remote,
            plan.stdin_script(&box_workspace(session)),
            plan.timeout + Duration::from_secs(30),
            tee,
            cancel,
        );
        let publish = self.publish_setup_output(scope, session, chunks, collector);
        let (result, collector) = tokio::join!(run, publish);
        let duration = started.elapsed();
        let mut collector = collector?;
        // Refusals said once more at the end, with the key to change: a tool's own retry
        // messages rarely show the proxy's answer.
        let key = format!("profiles.{}.egress.setup", p.profile);
        for c in self.egress_counters(&env.id) {
            if c.phase == crate::egress::Phase::Setup && c.refused > 0 {
                collector.note(&format!(
                    "[skiff] the egress proxy refused {} request(s) to {}: to allow it, add \"{}\" to {key}",
                    c.refused, c.host, c.host
                ))?;
            }
        }
        if let Some(text) = collector.take_live() {
            let run = self
                .store
                .open_run(scope, session)
                .ok()
                .flatten()
                .map(|r| r.id);
            let _ = self.hub.publish(
                scope,
                session,
                run.as_ref(),
                EventKind::SetupOutput { text },
            );
        }
        let (exit_code, timed_out) = match result {
            Ok((code, _)) => (code, code == 124 || code == 137),
            Err(skiff_ssh::Error::Process(skiff_process::Error::TimedOut { .. })) => (124, true),
            Err(e) => {
                let _ = std::fs::remove_file(&log_path);
                return Err(e.into());
            }
        };
        let tail = collector.tail(TAIL_LINES);
        self.keep_setup_log(scope, session, &log_path, exit_code, duration, &plan.label)?;
        let outcome = SetupOutcome {
            exit_code,
            duration,
            timed_out,
            tail,
        };
        self.audit(
            scope,
            "placement.setup",
            session.as_str(),
            if outcome.succeeded() { "ok" } else { "error" },
            json!({ "env": env.id.as_str(), "exit": exit_code, "timed_out": timed_out,
                    "duration_ms": duration.as_millis() as u64, "setup": plan.label }),
        );
        Ok(outcome)
    }

    /// Keeps the setup log as a `log` artifact of the session (the newest is the one
    /// `session setup-log` shows).
    fn keep_setup_log(
        &self,
        scope: &Scope,
        session: &SessionId,
        log: &Path,
        exit_code: i32,
        duration: Duration,
        label: &str,
    ) -> Result<()> {
        let cas = Cas::open(&self.artifacts_dir())?;
        let (hash, size) = cas.put_file(log)?;
        let _ = std::fs::remove_file(log);
        self.store.create_artifact(
            scope,
            &NewArtifact {
                session_id: Some(session.clone()),
                run_id: None,
                role: ArtifactRole::Log,
                retention: Retention::Session,
                hash,
                size,
                meta: json!({ "purpose": "setup", "exit": exit_code, "setup": label,
                              "duration_ms": duration.as_millis() as u64 }),
                expires_at_ms: None,
            },
        )?;
        Ok(())
    }

    /// The newest setup log of a session.
    pub(crate) fn setup_log(&self, scope: &Scope, session: &SessionId) -> Result<SetupLog> {
        self.store.session(scope, session)?;
        let newest = self
            .store
            .artifacts(scope, session, ArtifactRole::Log)?
            .into_iter()
            .rfind(|a| a.meta.get("purpose").and_then(|p| p.as_str()) == Some("setup"));
        let Some(row) = newest else {
            // "setup log for session ses_… not found": no setup ran on a box for it.
            return Err(skiff_store::Error::NotFound {
                what: "setup log for session",
                id: session.to_string(),
            }
            .into());
        };
        let cas = Cas::open(&self.artifacts_dir())?;
        let bytes = cas.get(&row.hash)?;
        let meta = |key: &str| row.meta.get(key).cloned().unwrap_or_default();
        Ok(SetupLog {
            setup: meta("setup").as_str().unwrap_or_default().to_owned(),
            exit_code: meta("exit")
                .as_i64()
                .and_then(|c| i32::try_from(c).ok())
                .unwrap_or(-1),
            duration_ms: meta("duration_ms").as_u64().unwrap_or_default(),
            text: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }

    /// Publishes setup output in chunks as it arrives, until the command's output ends.
    async fn publish_setup_output(
        &self,
        scope: &Scope,
        session: &SessionId,
        mut chunks: mpsc::UnboundedReceiver<Vec<u8>>,
        mut collector: Collector,
    ) -> Result<Collector> {
        let run = self
            .store
            .open_run(scope, session)
            .ok()
            .flatten()
            .map(|r| r.id);
        let mut last = Instant::now();
        loop {
            let chunk = tokio::time::timeout(PUBLISH_EVERY, chunks.recv()).await;
            let ended = matches!(chunk, Ok(None));
            if let Ok(Some(bytes)) = chunk {
                collector.push(&bytes)?;
            }
            if ended {
                collector.finish()?;
            }
            if ended || last.elapsed() >= PUBLISH_EVERY || collector.pending.len() >= CHUNK {
                if let Some(text) = collector.take_live() {
                    let _ = self.hub.publish(
                        scope,
                        session,
                        run.as_ref(),
                        EventKind::SetupOutput { text },
                    );
                }
                last = Instant::now();
            }
            if ended {
                return Ok(collector);
            }
        }
    }
}

/// The files a setup script says its result depends on: `# skiff: key-files = a b`.
fn declared_key_files(script: &str) -> Vec<String> {
    script
        .lines()
        .filter_map(|l| l.trim().strip_prefix(KEY_FILES_MARK))
        .flat_map(|rest| rest.split_whitespace().map(str::to_owned))
        .collect()
}

/// The key of a prepared box: a change to any part (the script, the profile and what it lets
/// setup reach, the worker bundle, a key file's bytes or presence) makes a new one. A key file
/// that is missing or outside the workspace counts as missing.
fn snapshot_key(
    script: &str,
    profile: &str,
    egress: &str,
    bundle: &str,
    workspace: &Path,
    key_files: &[String],
) -> String {
    let mut h = blake3::Hasher::new();
    for part in [script, profile, egress, bundle] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let mut files: Vec<&String> = key_files.iter().collect();
    files.sort();
    files.dedup();
    for name in files {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        let inside = !name.starts_with('/') && !name.split('/').any(|c| c == "..");
        match std::fs::read(workspace.join(name)).ok().filter(|_| inside) {
            Some(bytes) => {
                h.update(b"+");
                h.update(blake3::hash(&bytes).as_bytes());
            }
            None => {
                h.update(b"-");
            }
        }
    }
    h.finalize().to_hex().to_string()
}

/// Setup output on its way to the log and the live stream: split into lines (so a secret is
/// never cut in two before it is redacted), redacted, bounded.
struct Collector {
    log: std::fs::File,
    logged: u64,
    secrets: Vec<(String, String)>,
    /// Bytes of an unfinished line.
    partial: Vec<u8>,
    /// Redacted text not yet published.
    pending: String,
    published: usize,
    /// The last lines, for a failure's message.
    tail: std::collections::VecDeque<String>,
}

impl Collector {
    fn new(log: &Path, secrets: Vec<(String, String)>) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(log)
            .map_err(|e| crate::Error::Internal(format!("cannot write {}: {e}", log.display())))?;
        Ok(Self {
            log: file,
            logged: 0,
            secrets: secrets.into_iter().filter(|(_, v)| !v.is_empty()).collect(),
            partial: Vec::new(),
            pending: String::new(),
            published: 0,
            tail: Default::default(),
        })
    }

    fn push(&mut self, bytes: &[u8]) -> Result<()> {
        self.partial.extend_from_slice(bytes);
        while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            self.line(&line)?;
        }
        // A very long line without a newline is cut, not held for ever.
        if self.partial.len() > CHUNK {
            let line = std::mem::take(&mut self.partial);
            self.line(&line)?;
        }
        Ok(())
    }

    /// A line of Skiff's own, after the command's output.
    fn note(&mut self, text: &str) -> Result<()> {
        self.line(format!("{text}\n").as_bytes())?;
        self.log
            .flush()
            .map_err(|e| crate::Error::Internal(format!("cannot write the setup log: {e}")))
    }

    fn finish(&mut self) -> Result<()> {
        if !self.partial.is_empty() {
            let mut line = std::mem::take(&mut self.partial);
            line.push(b'\n');
            self.line(&line)?;
        }
        self.log
            .flush()
            .map_err(|e| crate::Error::Internal(format!("cannot write the setup log: {e}")))
    }

    fn line(&mut self, bytes: &[u8]) -> Result<()> {
        let mut text = String::from_utf8_lossy(bytes).into_owned();
        for (name, value) in &self.secrets {
            if text.contains(value.as_str()) {
                text = text.replace(value.as_str(), &format!("[{name} redacted]"));
            }
        }
        if self.logged < LOG_CAP {
            self.log
                .write_all(text.as_bytes())
                .map_err(|e| crate::Error::Internal(format!("cannot write the setup log: {e}")))?;
            self.logged += text.len() as u64;
            if self.logged >= LOG_CAP {
                let _ = self
                    .log
                    .write_all(b"[skiff: the rest of the setup output was not kept]\n");
            }
        }
        if self.published + self.pending.len() < LIVE_CAP {
            self.pending.push_str(&text);
            if self.published + self.pending.len() >= LIVE_CAP {
                self.pending.push_str(
                    "[skiff: more output is in the whole log: skiff session setup-log]\n",
                );
            }
        }
        if self.tail.len() == TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(text.trim_end_matches('\n').to_owned());
        Ok(())
    }

    fn take_live(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        self.published += self.pending.len();
        Some(std::mem::take(&mut self.pending))
    }

    fn tail(&self, lines: usize) -> String {
        let skip = self.tail.len().saturating_sub(lines);
        let mut out = String::new();
        for line in self.tail.iter().skip(skip) {
            out.push_str(line);
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collector(secrets: &[(&str, &str)]) -> (tempfile::TempDir, Collector) {
        let dir = tempfile::tempdir().unwrap();
        let secrets = secrets
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let c = Collector::new(&dir.path().join("log"), secrets).unwrap();
        (dir, c)
    }

    #[test]
    fn the_snapshot_key_follows_the_script_and_its_key_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("requirements.txt"), "left-pad==1\n").unwrap();
        let script =
            "# skiff: key-files = requirements.txt missing.lock\npip install -r requirements.txt\n";
        let files = declared_key_files(script);
        assert_eq!(files, ["requirements.txt", "missing.lock"]);
        let key = |script: &str, files: &[String]| {
            snapshot_key(script, "local", "[]", "b1", dir.path(), files)
        };
        let first = key(script, &files);
        assert_eq!(first, key(script, &files));
        assert_ne!(first, key("pip install .\n", &files));
        assert_ne!(
            first,
            snapshot_key(script, "other", "[]", "b1", dir.path(), &files)
        );
        assert_ne!(
            first,
            snapshot_key(script, "local", "[]", "b2", dir.path(), &files)
        );
        std::fs::write(dir.path().join("requirements.txt"), "left-pad==2\n").unwrap();
        assert_ne!(first, key(script, &files));
    }

    #[test]
    fn a_secret_split_across_chunks_is_still_redacted() {
        let (dir, mut c) = collector(&[("NPM_TOKEN", "s3cr3t-value")]);
        c.push(b"token is s3cr").unwrap();
        c.push(b"3t-value ok\nnext line\npartial").unwrap();
        c.finish().unwrap();
        let live = c.take_live().unwrap();
        assert_eq!(
            live,
            "token is [NPM_TOKEN redacted] ok\nnext line\npartial\n"
        );
        let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
        assert_eq!(log, live);
        assert!(!c.tail(2).contains("s3cr3t"));
        assert_eq!(c.tail(2), "next line\npartial\n");
    }

    #[test]
    fn live_output_is_bounded_and_says_where_the_rest_is() {
        let (_dir, mut c) = collector(&[]);
        let line = format!("{}\n", "x".repeat(1000));
        for _ in 0..400 {
            c.push(line.as_bytes()).unwrap();
        }
        let live = c.take_live().unwrap();
        assert!(live.len() < LIVE_CAP + 2000, "{}", live.len());
        assert!(
            live.ends_with("skiff session setup-log]\n"),
            "{}",
            &live[live.len() - 80..]
        );
        c.push(line.as_bytes()).unwrap();
        assert_eq!(c.take_live(), None);
    }
}
