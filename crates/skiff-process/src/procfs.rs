//! What this crate reads from `/proc`: a process's parent, state and start time, and the
//! processes below one. Start times tell a process from a later one that reuses its pid.

use std::collections::HashMap;

/// The fields of `/proc/<pid>/stat` this crate uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stat {
    pub ppid: i32,
    /// `Z` for a zombie: it has exited and only waits to be reaped.
    pub state: char,
    /// Clock ticks after boot; together with the pid it names one process for good.
    pub start_time: u64,
}

impl Stat {
    pub(crate) fn is_exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// `None` when the process does not exist (or /proc cannot be read).
pub(crate) fn stat(pid: i32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_stat(text: &str) -> Option<Stat> {
    // The command name (field 2) is in parentheses and may itself contain spaces and
    // parentheses: the fields that follow start after the last `)`.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        // Field 22 overall; field 3 (the state) is index 0 here.
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// Every process's parent, from one pass over /proc.
fn parents() -> HashMap<i32, i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, stat(pid)?)))
        .filter(|(_, s)| !s.is_exited())
        .map(|(pid, s)| (pid, s.ppid))
        .collect()
}

/// The live processes whose parent is `pid`.
pub(crate) fn children(pid: i32) -> Vec<i32> {
    parents()
        .into_iter()
        .filter(|&(_, ppid)| ppid == pid)
        .map(|(child, _)| child)
        .collect()
}

/// Every live process below `pid` (children, their children, …).
pub(crate) fn descendants(pid: i32) -> Vec<i32> {
    let parents = parents();
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for (&child, &ppid) in &parents {
            if ppid == parent && !found.contains(&child) {
                found.push(child);
                frontier.push(child);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let line = "4242 (a) b (c) S 17 4242 4242 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                ppid: 17,
                state: 'S',
                start_time: 987654
            })
        );
    }

    #[test]
    fn this_process_is_its_parents_child() {
        let me = i32::try_from(std::process::id()).unwrap();
        let parent = stat(me).unwrap().ppid;
        assert!(children(parent).contains(&me));
        assert!(descendants(parent).contains(&me));
    }
}
