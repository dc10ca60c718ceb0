//! FIFOs, sockets and huge files: every file tool answers at once, by name, within bounds.

use crate::tools::{call, workspace};
use serde_json::json;
use skiff_agent::tools::ToolOutput;
use std::path::Path;
use std::time::Duration;

fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(made.success());
}

/// A call that must come back on its own; the bound only turns a hang into a failure.
async fn prompt(
    tools: &skiff_agent::tools::Tools,
    name: &str,
    args: serde_json::Value,
) -> ToolOutput {
    let what = format!("{name} {args}");
    tokio::time::timeout(Duration::from_secs(20), call(tools, name, args))
        .await
        .unwrap_or_else(|_| panic!("`{what}` blocked"))
}

fn assert_refused(out: &ToolOutput, needle: &str) {
    assert!(out.is_error, "accepted: {}", out.content);
    assert!(out.content.contains(needle), "{}", out.content);
}

#[tokio::test]
async fn every_file_tool_refuses_a_fifo_by_name_without_blocking() {
    let (dir, tools) = workspace();
    mkfifo(&dir.path().join("pipe"));
    let fifo = "pipe is a FIFO, not a regular file";
    let out = prompt(&tools, "read", json!({"path": "pipe"})).await;
    assert_refused(&out, fifo);
    assert!(out.content.contains("block"), "{}", out.content);
    let out = prompt(&tools, "grep", json!({"pattern": "x", "path": "pipe"})).await;
    assert_refused(&out, fifo);
    let out = prompt(
        &tools,
        "edit",
        json!({"path": "pipe", "edits": [{"old_text": "a", "new_text": "b"}]}),
    )
    .await;
    assert_refused(&out, fifo);
    let out = prompt(&tools, "write", json!({"path": "pipe", "content": "x"})).await;
    assert_refused(&out, fifo);
    let out = prompt(&tools, "find", json!({"pattern": "*", "path": "pipe"})).await;
    assert_refused(&out, fifo);
    let out = prompt(&tools, "ls", json!({"path": "pipe"})).await;
    assert_refused(&out, "pipe is a FIFO, not a directory");

    // Next to other files it is listed for what it is and passed over by searches.
    let out = prompt(&tools, "ls", json!({})).await;
    assert!(out.content.contains("pipe (a FIFO)"), "{}", out.content);
    let out = prompt(&tools, "grep", json!({"pattern": "three"})).await;
    assert!(
        !out.is_error && out.content.contains("a.txt:3: three"),
        "{}",
        out.content
    );
    let out = prompt(&tools, "find", json!({"pattern": "*"})).await;
    assert!(
        !out.is_error && !out.content.contains("pipe"),
        "{}",
        out.content
    );

    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::symlink_metadata(dir.path().join("pipe")).unwrap();
    assert!(meta.file_type().is_fifo(), "write replaced the FIFO");
}

#[tokio::test]
async fn a_socket_is_refused_by_name() {
    let (dir, tools) = workspace();
    let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).unwrap();
    let out = prompt(&tools, "read", json!({"path": "sock"})).await;
    assert_refused(&out, "sock is a socket, not a regular file");
    let out = prompt(&tools, "grep", json!({"pattern": "x", "path": "sock"})).await;
    assert_refused(&out, "sock is a socket, not a regular file");
}

#[tokio::test]
async fn an_ignore_file_that_is_a_fifo_never_blocks_a_search() {
    let (dir, tools) = workspace();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub/b.txt"), "three\n").unwrap();
    mkfifo(&dir.path().join("sub/.gitignore"));
    let out = prompt(&tools, "grep", json!({"pattern": "three"})).await;
    assert!(!out.is_error, "{}", out.content);
    assert!(out.content.contains("a.txt:3: three"), "{}", out.content);
    assert!(
        out.content.contains("not searched")
            && out.content.contains("sub/ (its .gitignore is a FIFO)"),
        "{}",
        out.content
    );
    let out = prompt(&tools, "grep", json!({"pattern": "three", "path": "sub"})).await;
    assert_refused(&out, "sub/.gitignore is a FIFO, not a regular file");

    // A worktree's `.git` file leads the walker to `commondir`: a FIFO there is caught too.
    let (dir, tools) = workspace();
    let git_dir = dir.path().join("gitdir");
    std::fs::create_dir(&git_dir).unwrap();
    mkfifo(&git_dir.join("commondir"));
    std::fs::write(
        dir.path().join(".git"),
        format!("gitdir: {}\n", git_dir.display()),
    )
    .unwrap();
    let out = prompt(&tools, "find", json!({"pattern": "*.txt"})).await;
    assert_refused(&out, "gitdir/commondir is a FIFO, not a regular file");
}

/// Peak resident memory of this process since the last [`reset_peak_rss`], in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap();
    kb * 1024
}

fn reset_peak_rss() {
    // "5" resets the peak (VmHWM) to the current resident size.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

#[tokio::test]
async fn a_huge_sparse_file_is_read_in_bounded_memory() {
    const SIZE: u64 = 200_000_000;
    let (dir, tools) = workspace();
    let path = dir.path().join("huge.log");
    let text: String = (1..=1000).map(|n| format!("line {n}\n")).collect();
    std::fs::write(&path, &text).unwrap();
    // 200 MB in all; after the text, one "line" of NUL bytes to the end.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    reset_peak_rss();
    let before = peak_rss();

    let out = prompt(
        &tools,
        "read",
        json!({"path": "huge.log", "offset": 500, "limit": 3}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    let shown: Vec<&str> = out.content.lines().take(3).collect();
    assert_eq!(
        shown,
        ["   500\tline 500", "   501\tline 501", "   502\tline 502"]
    );
    assert!(
        out.content
            .contains("more lines follow (huge.log is 200.0 MB); read with offset=503"),
        "{}",
        out.content
    );
    // The line of NULs is 199 MB long: it is cut, not loaded.
    let out = prompt(
        &tools,
        "read",
        json!({"path": "huge.log", "offset": 1001, "limit": 5}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    assert!(
        out.content.contains("[line cut]"),
        "{}",
        &out.content[..200]
    );
    assert!(out.content.len() < 20_000, "{} bytes", out.content.len());
    let out = prompt(&tools, "grep", json!({"pattern": "^line 99[0-9]$"})).await;
    assert!(
        out.content.contains("huge.log:999: line 999"),
        "{}",
        out.content
    );
    assert!(
        out.content
            .contains("only the first 16 MiB of these larger files were searched: huge.log"),
        "{}",
        out.content
    );
    let out = prompt(
        &tools,
        "edit",
        json!({"path": "huge.log", "edits": [{"old_text": "line 1\n", "new_text": "x"}]}),
    )
    .await;
    assert_refused(&out, "huge.log is 200.0 MB; edit rewrites the whole file");

    let grown = peak_rss().saturating_sub(before);
    assert!(
        grown < 32 << 20,
        "peak memory grew by {grown} bytes for a {SIZE}-byte file"
    );
}

#[tokio::test]
async fn a_read_stops_at_its_byte_cap_and_says_where_to_go_on() {
    let (dir, tools) = workspace();
    let text: String = (1..=2000)
        .map(|n| format!("{n:04} {}\n", "y".repeat(95)))
        .collect();
    std::fs::write(dir.path().join("wide.txt"), text).unwrap();
    let out = prompt(&tools, "read", json!({"path": "wide.txt"})).await;
    assert!(!out.is_error, "{}", out.content);
    assert!(out.content.len() <= skiff_agent::tools::MAX_RESULT_BYTES);
    let last = out.content.lines().last().unwrap();
    let next: usize = last
        .split("read with offset=")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no continuation in {last:?}"))
        .parse()
        .unwrap();
    assert!(last.starts_with("[output cut at"), "{last}");
    let shown = out.content.lines().count() - 1;
    assert_eq!(next, shown + 1);
    let out = prompt(
        &tools,
        "read",
        json!({"path": "wide.txt", "offset": next, "limit": 1}),
    )
    .await;
    assert!(
        out.content.starts_with(&format!("{next:>6}\t{next:04} ")),
        "{}",
        out.content
    );
}
