//! A directory of records, one per running contained command, so a process that restarts
//! after a crash can kill what its predecessor left running.
//!
//! A record names the command's leader by pid *and* start time (from `/proc/<pid>/stat`): a
//! pid the kernel has since given to an unrelated process is recognised and left alone. The
//! record is written as soon as the leader exists and removed once everything it started is
//! gone. The parent-death signal of contained commands normally kills them with their parent;
//! the ledger is the second line, for whatever that signal missed.

use crate::{Error, Result, procfs};
use rustix::process::{Pid, Signal};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long [`Ledger::kill_leftovers`] waits for a killed tree to be gone.
const GONE_WAIT: Duration = Duration::from_secs(5);

/// The directory of records (for the gateway, `<state>/procs/`).
#[derive(Clone, Debug)]
pub struct Ledger {
    dir: Arc<PathBuf>,
}

/// A recorded command that was still running when [`Ledger::kill_leftovers`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leftover {
    pub pid: i32,
    pub command: String,
    /// Processes killed: the leader and everything below it.
    pub killed: usize,
}

impl Ledger {
    /// Opens (and creates, mode 0700) the directory of records.
    pub fn open(dir: &Path) -> Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| Error::Ledger {
                path: dir.display().to_string(),
                source,
            })?;
        Ok(Self {
            dir: Arc::new(dir.to_path_buf()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kills every recorded command whose leader is still the process that was recorded,
    /// with everything below it, waits (a few seconds at most) until they are gone, and
    /// clears the records. Call it before anything new is started under this ledger.
    pub fn kill_leftovers(&self) -> Result<Vec<Leftover>> {
        let entries = fs::read_dir(self.dir.as_path()).map_err(|source| Error::Ledger {
            path: self.dir.display().to_string(),
            source,
        })?;
        let mut leftovers = Vec::new();
        let mut doomed = Vec::new();
        for entry in entries.filter_map(std::result::Result::ok) {
            let path = entry.path();
            let text = fs::read_to_string(&path).unwrap_or_default();
            if let Some(record) = parse(&text)
                && procfs::stat(record.pid)
                    .is_some_and(|s| s.start_time == record.start_time && !s.is_exited())
            {
                let tree = kill_tree(record.pid);
                leftovers.push(Leftover {
                    pid: record.pid,
                    command: record.command,
                    killed: tree.len(),
                });
                doomed.extend(tree);
            }
            // A record whose leader is gone (or is now someone else) names nothing to kill; an
            // unreadable one cannot be acted on safely. Either way it is done with.
            fs::remove_file(&path).map_err(|source| Error::Ledger {
                path: path.display().to_string(),
                source,
            })?;
        }
        wait_gone(&doomed, GONE_WAIT);
        Ok(leftovers)
    }

    /// Records a just-started leader. `None` when it has already exited (nothing to record).
    pub(crate) fn record(&self, pid: i32, command: &str) -> Result<Option<Record>> {
        let Some(stat) = procfs::stat(pid) else {
            return Ok(None);
        };
        let path = self.dir.join(format!("{pid}-{}", stat.start_time));
        let text = format!(
            "pid {pid}\nstart {}\ncommand {}\n",
            stat.start_time,
            command.replace('\n', " ")
        );
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&path)?;
            // No fsync: the record is for a process that crashes, not a machine (a reboot ends
            // every process anyway), and the page cache outlives a process.
            file.write_all(text.as_bytes())
        };
        write().map_err(|source| Error::Ledger {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Some(Record { path }))
    }
}

/// Removes its record when dropped: the command it names has ended.
#[derive(Debug)]
pub(crate) struct Record {
    path: PathBuf,
}

impl Drop for Record {
    fn drop(&mut self) {
        // A record left behind is harmless: its leader's start time no longer matches any
        // process, so the next `kill_leftovers` only deletes it.
        let _ = fs::remove_file(&self.path);
    }
}

struct Parsed {
    pid: i32,
    start_time: u64,
    command: String,
}

fn parse(text: &str) -> Option<Parsed> {
    let mut pid = None;
    let mut start_time = None;
    let mut command = String::new();
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("pid", v)) => pid = v.parse().ok(),
            Some(("start", v)) => start_time = v.parse().ok(),
            Some(("command", v)) => command = v.to_owned(),
            _ => {}
        }
    }
    Some(Parsed {
        pid: pid?,
        start_time: start_time?,
        command,
    })
}

/// SIGKILLs `leader`, everything below it and its process group. Returns what it killed, as
/// (pid, start time), so waiting for them is not fooled by a reused pid.
fn kill_tree(leader: i32) -> Vec<(i32, u64)> {
    let mut tree = procfs::descendants(leader);
    tree.push(leader);
    let tree: Vec<(i32, u64)> = tree
        .into_iter()
        .filter_map(|pid| Some((pid, procfs::stat(pid)?.start_time)))
        .collect();
    for &(pid, _) in &tree {
        if let Some(pid) = Pid::from_raw(pid) {
            // ESRCH: it ended on its own meanwhile.
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
    }
    if let Some(group) = Pid::from_raw(leader) {
        let _ = rustix::process::kill_process_group(group, Signal::KILL);
    }
    tree
}

/// Polls /proc until every process is gone (an exited zombie counts), for at most `bound`.
fn wait_gone(procs: &[(i32, u64)], bound: Duration) {
    let deadline = Instant::now() + bound;
    let alive = |&(pid, start): &(i32, u64)| {
        procfs::stat(pid).is_some_and(|s| s.start_time == start && !s.is_exited())
    };
    while Instant::now() < deadline && procs.iter().any(alive) {
        std::thread::sleep(Duration::from_millis(10));
    }
}
