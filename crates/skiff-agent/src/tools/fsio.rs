//! How the file tools touch files: never in a way that can block, and never more than a bound.
//!
//! Opening a FIFO for reading waits for a writer, reading a character device may never end,
//! and a path can be swapped for either between a check and an open. So a file is opened with
//! `O_NONBLOCK | O_NOFOLLOW` (an open that cannot wait, of exactly the path that was checked),
//! and the *opened* file's type is checked again with `fstat`: whatever the path named a moment
//! earlier, only a regular file is ever read. Anything else is refused by name, in words the
//! model can act on. Reading is streamed line by line with a cap on how much of a line is kept,
//! so neither a huge file nor a file with no newlines is ever held in memory.

use super::Workspace;
use std::fs::{File, Metadata};
use std::io::{BufRead, BufReader, Read, Write as _};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// A NUL byte in this much of a file's start makes it binary (git's heuristic).
pub(super) const BINARY_SNIFF_BYTES: usize = 8000;

/// What a path is, for a refusal ("pipe is a FIFO, not a regular file").
pub(crate) fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a file this tool knows"
    }
}

/// Whether this is something that can block or never end when read: a FIFO, socket or device.
pub(super) fn is_special(meta: &Metadata) -> bool {
    let t = meta.file_type();
    !(t.is_file() || t.is_dir() || t.is_symlink())
}

/// The refusal for a path that is not a regular file.
pub(super) fn not_regular(name: &str, meta: &Metadata, tool: &str) -> String {
    if meta.is_dir() {
        return match tool {
            "read" => format!("{name} is a directory; use ls"),
            _ => format!("{name} is a directory, not a regular file; {tool} works on files"),
        };
    }
    format!(
        "{name} is {}, not a regular file; {tool} works only on regular files (reading a FIFO, \
         socket or device can block for ever)",
        kind(meta)
    )
}

/// A regular file of the workspace, opened for reading.
pub(crate) struct Opened {
    pub file: File,
    /// The file's own path (a symlink on the way resolved), inside the workspace.
    pub path: PathBuf,
    pub meta: Metadata,
}

/// Opens `user_path` for reading if, and only if, it is a regular file inside the workspace.
/// Never blocks: see the module doc.
pub(crate) fn open_regular(ws: &Workspace, user_path: &str, tool: &str) -> Result<Opened, String> {
    let lexical = ws.resolve(user_path)?;
    let cannot = |e: std::io::Error| format!("cannot {tool} {user_path}: {e}");
    let meta = std::fs::symlink_metadata(&lexical).map_err(cannot)?;
    let path = if meta.file_type().is_symlink() {
        // `resolve` has checked that the link stays inside; open its target itself, so that
        // O_NOFOLLOW below refuses a link swapped in afterwards.
        ws.contain(&lexical.canonicalize().map_err(cannot)?, user_path)?
    } else {
        lexical
    };
    let meta = std::fs::symlink_metadata(&path).map_err(cannot)?;
    if !meta.is_file() {
        return Err(not_regular(user_path, &meta, tool));
    }
    let file = open_nonblocking(&path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            format!("{user_path} changed into a symbolic link while it was being opened; retry")
        } else {
            cannot(e)
        }
    })?;
    let meta = file.metadata().map_err(cannot)?;
    if !meta.is_file() {
        return Err(not_regular(user_path, &meta, tool));
    }
    Ok(Opened { file, path, meta })
}

/// `open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)`: returns at once whatever
/// `path` is. The caller checks the opened file's type.
pub(crate) fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
}

/// Lines of a reader, each kept only up to a byte cap, in bounded memory whatever the input.
/// Stops with an error when `cancel` fires.
pub(super) struct Lines<R> {
    inner: BufReader<R>,
    cancel: CancellationToken,
}

impl<R: Read> Lines<R> {
    pub fn new(reader: R, cancel: CancellationToken) -> Self {
        Self {
            inner: BufReader::with_capacity(64 * 1024, reader),
            cancel,
        }
    }

    fn fill(&mut self) -> std::io::Result<&[u8]> {
        if self.cancel.is_cancelled() {
            return Err(std::io::Error::other("cancelled"));
        }
        loop {
            match self.inner.fill_buf() {
                Ok(_) => return Ok(self.inner.buffer()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The start of the input, without consuming it (what a file's type is told by).
    pub fn head(&mut self) -> std::io::Result<&[u8]> {
        self.fill()
    }

    /// The reader, with what was buffered and not yet consumed still to be read.
    pub fn into_inner(self) -> BufReader<R> {
        self.inner
    }

    /// Whether the start of the input looks binary (a NUL byte early on).
    pub fn looks_binary(&mut self) -> std::io::Result<bool> {
        let head = self.fill()?;
        Ok(head[..head.len().min(BINARY_SNIFF_BYTES)].contains(&0))
    }

    /// Reads the next line into `out` (cleared first), keeping at most `keep` bytes of it and
    /// dropping the newline. Returns the line's full length, or `None` at the end.
    pub fn next_line(&mut self, out: &mut Vec<u8>, keep: usize) -> std::io::Result<Option<usize>> {
        out.clear();
        let mut len = 0;
        let mut any = false;
        loop {
            let buf = self.fill()?;
            if buf.is_empty() {
                return Ok(any.then_some(len));
            }
            any = true;
            let (end, newline) = match memchr::memchr(b'\n', buf) {
                Some(i) => (i, true),
                None => (buf.len(), false),
            };
            let room = keep.saturating_sub(out.len());
            out.extend_from_slice(&buf[..end.min(room)]);
            len += end;
            self.inner.consume(end + usize::from(newline));
            if newline {
                return Ok(Some(len));
            }
        }
    }

    /// Counts the lines left, reading at most `budget` more bytes; `None` when the end was
    /// not reached within it.
    pub fn count_rest(&mut self, budget: u64) -> std::io::Result<Option<usize>> {
        let mut lines = 0;
        let mut scanned = 0u64;
        let mut open_line = false;
        loop {
            let buf = self.fill()?;
            if buf.is_empty() {
                return Ok(Some(lines + usize::from(open_line)));
            }
            if scanned >= budget {
                return Ok(None);
            }
            let n = buf.len();
            lines += memchr::memchr_iter(b'\n', buf).count();
            open_line = buf.last() != Some(&b'\n');
            scanned += n as u64;
            self.inner.consume(n);
        }
    }
}

/// Ignore files the walker of `find` and `grep` opens in a directory. It opens them with a
/// plain (blocking) open, so one that is a FIFO, socket or device must be caught first.
const IGNORE_FILES: &[&str] = &[".gitignore", ".ignore", ".git/info/exclude"];

/// The first file the walker would open for `dir` that is a FIFO, socket or device, with what
/// it is: its ignore files and, when `.git` is a file (a worktree), the files it points to.
pub(super) fn special_ignore_file(dir: &Path) -> Option<(PathBuf, &'static str)> {
    let special = |path: PathBuf| {
        // stat, not open: it follows a symlink to its target without ever blocking.
        let meta = std::fs::metadata(&path).ok()?;
        is_special(&meta).then(|| (path, kind(&meta)))
    };
    if let Some(found) = IGNORE_FILES.iter().find_map(|name| special(dir.join(name))) {
        return Some(found);
    }
    // A worktree's `.git` names its git dir, whose `commondir` names the repository whose
    // `info/exclude` applies; the walker opens each in turn.
    let git_dir = PathBuf::from(first_line(&dir.join(".git"))?.strip_prefix("gitdir: ")?);
    let commondir = git_dir.join("commondir");
    if let Some(found) = special(commondir.clone()) {
        return Some(found);
    }
    let common = git_dir.join(first_line(&commondir)?);
    special(common.join("info/exclude"))
}

/// The first line of a small regular file, read without blocking; `None` for anything else.
fn first_line(path: &Path) -> Option<String> {
    let file = open_nonblocking(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut lines = Lines::new(file.take(4096), CancellationToken::new());
    let mut buf = Vec::new();
    lines.next_line(&mut buf, 4096).ok()??;
    String::from_utf8(buf).ok()
}

/// Human-readable size ("200.0 MB").
pub(super) fn size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["bytes", "kB", "MB", "GB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Writes through a new temporary file and a rename, so a crash never leaves half a file. Keeps
/// the permissions of a file it replaces (an edited script stays executable). The temporary
/// file is created exclusively (`O_EXCL | O_NOFOLLOW`), so nothing planted at its name — a
/// FIFO, a symlink — is ever opened.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_like(path, bytes, path)
}

/// [`write_atomic`], with the permissions of `like` when it exists (a moved file keeps its
/// mode).
pub(super) fn write_atomic_like(path: &Path, bytes: &[u8], like: &Path) -> std::io::Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (tmp, mut file) = (0u32..1000)
        .map(|n| parent.join(format!(".{name}.{}-{n}.skiff-tmp", std::process::id())))
        .find_map(|tmp| {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o666)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)
            {
                Ok(file) => Some(Ok((tmp, file))),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                Err(e) => Some(Err(e)),
            }
        })
        .unwrap_or_else(|| Err(std::io::Error::other("no free temporary name")))?;
    let written = file.write_all(bytes).and_then(|()| {
        if let Ok(meta) = std::fs::metadata(like) {
            file.set_permissions(meta.permissions())?;
        }
        std::fs::rename(&tmp, path)
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_are_kept_only_up_to_the_cap() {
        let text = format!("short\n{}\nlast", "x".repeat(200_000));
        let mut lines = Lines::new(text.as_bytes(), CancellationToken::new());
        let mut buf = Vec::new();
        assert_eq!(lines.next_line(&mut buf, 10).unwrap(), Some(5));
        assert_eq!(buf, b"short");
        assert_eq!(lines.next_line(&mut buf, 10).unwrap(), Some(200_000));
        assert_eq!(buf.len(), 10);
        assert_eq!(lines.count_rest(1 << 20).unwrap(), Some(1));
        assert_eq!(lines.next_line(&mut buf, 10).unwrap(), None);
    }

    #[test]
    fn counting_stops_at_its_budget() {
        let text = "a\n".repeat(100_000);
        let mut lines = Lines::new(text.as_bytes(), CancellationToken::new());
        assert_eq!(lines.count_rest(1).unwrap(), None);
        let mut lines = Lines::new(text.as_bytes(), CancellationToken::new());
        assert_eq!(lines.count_rest(1 << 20).unwrap(), Some(100_000));
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(size(12), "12 bytes");
        assert_eq!(size(200_000_000), "200.0 MB");
    }
}
