//! Project instructions: the workspace's `AGENTS.md`, read at the start of every turn and given
//! to the model after the system prompt, so a project can say how it wants to be worked on
//! (its checks, its conventions).
//!
//! Only the workspace root's file counts: a Skiff workspace is the repository root, so there
//! are no parent folders to look in, and nested `AGENTS.md` files are ordinary files the model
//! may read. The file is opened like any file tool opens one (contained to the workspace,
//! never blocking on a FIFO or device) and bounded to [`MAX_INSTRUCTIONS_BYTES`].

use crate::tools::Workspace;
use crate::tools::fsio;
use std::io::Read;

/// The file, relative to the workspace root.
pub const INSTRUCTIONS_FILE: &str = "AGENTS.md";

/// The most of the file the model is given; the rest is cut with a line saying so.
pub const MAX_INSTRUCTIONS_BYTES: usize = 32 * 1024;

/// What a turn found at [`INSTRUCTIONS_FILE`].
#[derive(Debug)]
pub(crate) enum Found {
    Absent,
    /// The text the model reads (already cut, with its marker) and the file's size.
    Read {
        text: String,
        size: u64,
    },
    /// There is something, but it cannot be used (a directory, a FIFO, a symlink out, binary).
    Unusable(String),
}

impl Found {
    /// The one line people see at turn start; `None` when there is nothing to say.
    pub(crate) fn notice(&self) -> Option<String> {
        match self {
            Found::Absent => None,
            Found::Read { size, .. } if *size > MAX_INSTRUCTIONS_BYTES as u64 => Some(format!(
                "project instructions: {INSTRUCTIONS_FILE} ({}, only the first {} KiB given to the model)",
                kib(*size),
                MAX_INSTRUCTIONS_BYTES / 1024
            )),
            Found::Read { size, .. } => Some(format!(
                "project instructions: {INSTRUCTIONS_FILE} ({})",
                kib(*size)
            )),
            Found::Unusable(why) => Some(format!(
                "project instructions: {INSTRUCTIONS_FILE} not used: {why}"
            )),
        }
    }

    /// The system text for a request: the base prompt, then the instructions under a heading.
    // INVARIANT: built only from the file's bytes and constants — no absolute path, host or
    // placement — so the request is the same on the gateway and on a worker.
    pub(crate) fn system(&self, base: &str) -> String {
        match self {
            Found::Read { text, .. } => format!(
                "{base}\n\n# Project instructions\n\nThe workspace's {INSTRUCTIONS_FILE} says \
                 the following; follow it unless the user asks otherwise.\n\n{text}"
            ),
            Found::Absent | Found::Unusable(_) => base.to_owned(),
        }
    }
}

/// Reads the instructions on the blocking pool (the open never waits, see `fsio`).
pub(crate) async fn load(ws: &Workspace) -> Found {
    let ws = ws.clone();
    match tokio::task::spawn_blocking(move || read(&ws)).await {
        Ok(found) => found,
        Err(e) => Found::Unusable(format!("reading it crashed: {e}")),
    }
}

fn read(ws: &Workspace) -> Found {
    match std::fs::symlink_metadata(ws.root().join(INSTRUCTIONS_FILE)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Found::Absent,
        Err(e) => return Found::Unusable(e.to_string()),
        Ok(_) => {}
    }
    let opened = match fsio::open_regular(ws, INSTRUCTIONS_FILE, "read") {
        Ok(opened) => opened,
        Err(why) => return Found::Unusable(why),
    };
    let size = opened.meta.len();
    let mut bytes = Vec::new();
    if let Err(e) = opened
        .file
        .take(MAX_INSTRUCTIONS_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
    {
        return Found::Unusable(format!("cannot read it: {e}"));
    }
    if bytes.contains(&0) {
        return Found::Unusable("it is a binary file".to_owned());
    }
    let cut = bytes.len() > MAX_INSTRUCTIONS_BYTES;
    bytes.truncate(MAX_INSTRUCTIONS_BYTES);
    // A cut through a character drops that character rather than showing a replacement.
    if let Err(e) = std::str::from_utf8(&bytes)
        && e.error_len().is_none()
    {
        bytes.truncate(e.valid_up_to());
    }
    let mut text = String::from_utf8_lossy(&bytes).into_owned();
    if cut {
        // The size it had when opened, which is what the notice says too.
        let size = size.max(bytes.len() as u64 + 1);
        text.push_str(&format!(
            "\n\n[{INSTRUCTIONS_FILE} is {}; only its first {} KiB are shown here. Read the \
             file for the rest.]",
            kib(size),
            MAX_INSTRUCTIONS_BYTES / 1024
        ));
    }
    Found::Read { text, size }
}

/// "812 bytes", "1.2 KiB".
fn kib(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(content: Option<&[u8]>) -> (tempfile::TempDir, Workspace) {
        let dir = tempfile::tempdir().unwrap();
        if let Some(content) = content {
            std::fs::write(dir.path().join(INSTRUCTIONS_FILE), content).unwrap();
        }
        let ws = Workspace::new(dir.path().to_path_buf()).unwrap();
        (dir, ws)
    }

    #[test]
    fn no_file_changes_nothing_and_says_nothing() {
        let (_d, ws) = ws(None);
        let found = read(&ws);
        assert!(found.notice().is_none());
        assert_eq!(found.system("base"), "base");
    }

    #[test]
    fn a_small_file_is_given_whole_and_named_with_its_size() {
        let (_d, ws) = ws(Some("Run `make check`.\n".repeat(100).as_bytes()));
        let found = read(&ws);
        assert_eq!(
            found.notice().unwrap(),
            "project instructions: AGENTS.md (1.8 KiB)"
        );
        let system = found.system("base");
        assert!(system.starts_with("base\n\n# Project instructions\n"));
        assert!(system.ends_with("Run `make check`.\n"));
    }

    #[test]
    fn a_large_file_is_cut_on_a_character_boundary_with_a_line_saying_so() {
        // 'é' is two bytes; at an odd offset the cut falls inside one.
        let content = format!("x{}", "é".repeat(MAX_INSTRUCTIONS_BYTES));
        let (_d, ws) = ws(Some(content.as_bytes()));
        let found = read(&ws);
        let Found::Read { text, size } = &found else {
            panic!("{found:?}")
        };
        assert_eq!(*size, content.len() as u64);
        let (shown, marker) = text.split_once("\n\n[").unwrap();
        assert_eq!(shown.len(), MAX_INSTRUCTIONS_BYTES - 1);
        assert!(content.starts_with(shown));
        assert!(marker.contains("only its first 32 KiB"), "{marker}");
        assert!(
            found.notice().unwrap().contains("only the first 32 KiB"),
            "{:?}",
            found.notice()
        );
    }

    #[test]
    fn a_directory_or_fifo_is_named_and_not_used() {
        let (dir, ws) = ws(None);
        std::fs::create_dir(dir.path().join(INSTRUCTIONS_FILE)).unwrap();
        let found = read(&ws);
        assert_eq!(found.system("base"), "base");
        assert!(
            found
                .notice()
                .unwrap()
                .contains("not used: AGENTS.md is a directory"),
            "{:?}",
            found.notice()
        );
        std::fs::remove_dir(dir.path().join(INSTRUCTIONS_FILE)).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(dir.path().join(INSTRUCTIONS_FILE))
            .status()
            .unwrap();
        assert!(made.success());
        let found = read(&ws);
        assert!(
            found.notice().unwrap().contains("a FIFO"),
            "{:?}",
            found.notice()
        );
    }

    #[test]
    fn a_symlink_out_of_the_workspace_is_not_followed() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "secret").unwrap();
        let (dir, ws) = ws(None);
        std::os::unix::fs::symlink(
            outside.path().join("secret"),
            dir.path().join(INSTRUCTIONS_FILE),
        )
        .unwrap();
        let found = read(&ws);
        assert_eq!(found.system("base"), "base");
        assert!(
            found.notice().unwrap().contains("outside the workspace"),
            "{:?}",
            found.notice()
        );
    }
}
