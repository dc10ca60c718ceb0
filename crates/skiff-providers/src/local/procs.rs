//! Finding and killing a box's processes through `/proc`: by owner (a box's own user) and by
//! ancestry (everything its sshd started).

use std::collections::{BTreeSet, HashMap};

struct Proc {
    ppid: i32,
    uid: u32,
    zombie: bool,
}

fn read(pid: i32) -> Option<Proc> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .map(str::to_owned)
    };
    Some(Proc {
        ppid: field("PPid:")?.parse().ok()?,
        uid: field("Uid:")?.split_whitespace().next()?.parse().ok()?,
        zombie: field("State:")?.starts_with('Z'),
    })
}

fn all() -> HashMap<i32, Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, read(pid)?)))
        .collect()
}

/// Whether `pid` is a live (non-zombie) process.
pub(crate) fn alive(pid: i32) -> bool {
    read(pid).is_some_and(|p| !p.zombie)
}

/// Whether `pid` is alive and its command line mentions `needle` (the sandbox init's marker,
/// or an unsandboxed box's sshd_config path):
/// a pid file can outlive its process, and the number may since belong to someone else.
pub(crate) fn alive_running(pid: i32, needle: &str) -> bool {
    alive(pid)
        && std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
}

/// `pid` and every live descendant of it.
pub(crate) fn tree(pid: i32) -> BTreeSet<i32> {
    let procs = all();
    let mut found = BTreeSet::new();
    if procs.get(&pid).is_some_and(|p| !p.zombie) {
        found.insert(pid);
    }
    let mut grew = true;
    while grew {
        grew = false;
        for (child, p) in &procs {
            if !p.zombie && found.contains(&p.ppid) && found.insert(*child) {
                grew = true;
            }
        }
    }
    found
}

/// Every live process owned by `uid`.
pub(crate) fn owned_by(uid: u32) -> BTreeSet<i32> {
    all()
        .into_iter()
        .filter(|(_, p)| p.uid == uid && !p.zombie)
        .map(|(pid, _)| pid)
        .collect()
}

pub(crate) fn kill(pids: &BTreeSet<i32>) {
    for pid in pids {
        if let Some(pid) = rustix::process::Pid::from_raw(*pid) {
            // ESRCH means it is already gone, which is what we want.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}
