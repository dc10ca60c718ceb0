//! `read`, `write`, `edit` and `ls`. Every file is opened through [`fsio`], so a FIFO, socket
//! or device is refused by name and never blocks a call, and reads are streamed and bounded.

use super::fsio::{self, Lines};
use super::image::{self, MAX_IMAGE_BYTES, MAX_IMAGE_SIDE};
use super::{MAX_RESULT_BYTES, ToolOutput, Workspace};
use serde::Deserialize;
use std::fmt::Write as _;
use std::io::Read;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

const DEFAULT_READ_LINES: usize = 2000;
const MAX_LINE_CHARS: usize = 2000;
/// Bytes of a line kept before it is cut (a UTF-8 character is at most four).
const MAX_LINE_BYTES: usize = MAX_LINE_CHARS * 4;
/// The most a `read` returns; the rest of the range is left for another call.
const MAX_READ_BYTES: usize = MAX_RESULT_BYTES - 4 * 1024;
/// How far past the shown range `read` looks to say how many lines are left.
const COUNT_SCAN_BYTES: u64 = 8 << 20;
/// `edit` holds a file (twice) in memory and rewrites it whole; past this it refuses.
pub(crate) const MAX_EDIT_BYTES: u64 = 8 << 20;
const MAX_LS_ENTRIES: usize = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReadArgs {
    path: String,
    offset: Option<usize>,
    limit: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WriteArgs {
    path: String,
    content: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EditArgs {
    path: String,
    edits: Vec<Edit>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Edit {
    old_text: String,
    new_text: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LsArgs {
    path: Option<String>,
}

/// An image file (known by its first bytes: PNG, JPEG, GIF, WebP) is given to the model whole,
/// within [`MAX_IMAGE_BYTES`]. Of a text file, streams the lines `offset..offset + limit`
/// (1-based) without loading the file: lines before the range are skipped as they are read,
/// long lines are cut, and the output stops at [`MAX_READ_BYTES`], saying where to continue.
pub(super) fn read(
    ws: &Workspace,
    args: ReadArgs,
    cancel: &CancellationToken,
) -> Result<ToolOutput, String> {
    let opened = fsio::open_regular(ws, &args.path, "read")?;
    let name = ws.display(&opened.path);
    let failed = |e: std::io::Error| format!("cannot read {}: {e}", args.path);
    let mut lines = Lines::new(opened.file, cancel.clone());
    if let Some(format) = image::sniff(lines.head().map_err(failed)?) {
        return read_image(&name, format, lines, opened.meta.len(), cancel).map(|(text, image)| {
            ToolOutput {
                images: vec![image],
                ..ToolOutput::ok(text)
            }
        });
    }
    read_text_lines(&name, &args, lines, opened.meta.len()).map(ToolOutput::ok)
}

/// The whole of an image file, with its one-line description (`image: shot.png, 1280×720 PNG,
/// 84 KiB`).
fn read_image(
    name: &str,
    format: image::Format,
    lines: Lines<std::fs::File>,
    len: u64,
    cancel: &CancellationToken,
) -> Result<(String, skiff_protocol::model::Image), String> {
    let too_big = |bytes: u64| {
        format!(
            "{name} is a {} image of {}; read gives the model images up to {} (3 MiB once \
             base64-encoded: what a request has room for beside the conversation). Make it smaller first, e.g. with exec: convert {name} -resize 50% \
             smaller.png",
            format.name(),
            image::size(bytes),
            image::limit()
        )
    };
    if len > MAX_IMAGE_BYTES {
        return Err(too_big(len));
    }
    let mut bytes = Vec::new();
    lines
        .into_inner()
        .take(MAX_IMAGE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {name}: {e}"))?;
    if cancel.is_cancelled() {
        return Err("read was cancelled".to_owned());
    }
    if bytes.len() as u64 > MAX_IMAGE_BYTES {
        // It grew while being read.
        return Err(too_big(bytes.len() as u64));
    }
    let Some((width, height)) = image::dimensions(format, &bytes) else {
        return Err(format!(
            "{name} starts like a {} image but its size cannot be read from its header; the \
             file may be cut short or damaged",
            format.name()
        ));
    };
    if width.max(height) > MAX_IMAGE_SIDE {
        return Err(format!(
            "{name} is a {width}×{height} {} image; models take images up to {MAX_IMAGE_SIDE} \
             pixels a side. Make it smaller first, e.g. with exec: convert {name} -resize \
             {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} smaller.png",
            format.name()
        ));
    }
    let text = format!(
        "image: {name}, {width}×{height} {}, {}",
        format.name(),
        image::size(bytes.len() as u64)
    );
    Ok((text, image::encode(format, &bytes)))
}

fn read_text_lines(
    name: &str,
    args: &ReadArgs,
    mut lines: Lines<std::fs::File>,
    len: u64,
) -> Result<String, String> {
    let failed = |e: std::io::Error| format!("cannot read {}: {e}", args.path);
    if lines.looks_binary().map_err(failed)? {
        return Err(format!("{name} is a binary file"));
    }
    let offset = args.offset.unwrap_or(1).max(1);
    let limit = args.limit.unwrap_or(DEFAULT_READ_LINES).max(1);
    let mut buf = Vec::new();
    for skipped in 0..offset - 1 {
        if lines.next_line(&mut buf, 0).map_err(failed)?.is_none() {
            return Err(format!(
                "offset {offset} is past the end of {} ({skipped} lines)",
                args.path
            ));
        }
    }
    let mut out = String::new();
    let mut shown = 0;
    let mut full = false;
    while shown < limit {
        let Some(len) = lines.next_line(&mut buf, MAX_LINE_BYTES).map_err(failed)? else {
            break;
        };
        let text = String::from_utf8_lossy(&buf);
        let text = text.strip_suffix('\r').unwrap_or(&text);
        let line = if len > buf.len() || text.chars().count() > MAX_LINE_CHARS {
            format!(
                "{}… [line cut]",
                text.chars().take(MAX_LINE_CHARS).collect::<String>()
            )
        } else {
            text.to_owned()
        };
        let rendered = format!("{:>6}\t{line}\n", offset + shown);
        if out.len() + rendered.len() > MAX_READ_BYTES {
            full = true;
            break;
        }
        out.push_str(&rendered);
        shown += 1;
    }
    if shown == 0 {
        return if offset > 1 {
            Err(format!(
                "offset {offset} is past the end of {} ({} lines)",
                args.path,
                offset - 1
            ))
        } else {
            Ok(format!("({name} is empty)"))
        };
    }
    let next = offset + shown;
    if full {
        let _ = write!(
            out,
            "[output cut at {} KiB; read with offset={next} to continue]",
            MAX_READ_BYTES / 1024
        );
    } else if shown == limit {
        match lines.count_rest(COUNT_SCAN_BYTES).map_err(failed)? {
            Some(0) => {}
            Some(more) => {
                let _ = write!(
                    out,
                    "[… {more} more lines; read with offset={next} to continue]"
                );
            }
            None => {
                let _ = write!(
                    out,
                    "[… more lines follow ({name} is {}); read with offset={next} to continue]",
                    fsio::size(len)
                );
            }
        }
    }
    Ok(out)
}

pub(super) fn write(ws: &Workspace, args: WriteArgs) -> Result<String, String> {
    let lexical = ws.resolve(&args.path)?;
    let target = match std::fs::symlink_metadata(&lexical) {
        Ok(meta) if meta.file_type().is_symlink() => {
            // Write the file the link names (inside the workspace, as `resolve` checked).
            let real = lexical
                .canonicalize()
                .map_err(|e| format!("cannot write {}: {e}", args.path))?;
            ws.contain(&real, &args.path)?
        }
        _ => lexical,
    };
    ws.check_writable(&target, &args.path)?;
    if let Ok(meta) = std::fs::symlink_metadata(&target)
        && !meta.is_file()
    {
        return Err(if meta.is_dir() {
            format!("{} is a directory", args.path)
        } else {
            fsio::not_regular(&args.path, &meta, "write")
        });
    }
    fsio::write_atomic(&target, args.content.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", args.path))?;
    Ok(format!(
        "wrote {} bytes to {}",
        args.content.len(),
        ws.display(&target)
    ))
}

pub(super) fn edit(ws: &Workspace, args: EditArgs) -> Result<String, String> {
    let opened = fsio::open_regular(ws, &args.path, "edit")?;
    let (path, text) = read_text(ws, opened, &args.path, "edit")?;
    ws.check_writable(&path, &args.path)?;
    if args.edits.is_empty() {
        return Err("edits is empty; give at least one {old_text, new_text}".to_owned());
    }
    let mut spans = Vec::with_capacity(args.edits.len());
    for (n, edit) in args.edits.iter().enumerate() {
        if edit.old_text.is_empty() {
            return Err(format!("edit {}: old_text is empty", n + 1));
        }
        let mut found = text.match_indices(&edit.old_text);
        let Some((start, _)) = found.next() else {
            return Err(format!(
                "edit {}: old_text not found in {}",
                n + 1,
                args.path
            ));
        };
        let more = found.count();
        if more > 0 {
            return Err(format!(
                "edit {}: old_text occurs {} times in {}; include more surrounding text so it matches once",
                n + 1,
                more + 1,
                args.path
            ));
        }
        spans.push((start, start + edit.old_text.len(), n));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if pair[0].1 > pair[1].0 {
            return Err(format!(
                "edits {} and {} overlap",
                pair[0].2 + 1,
                pair[1].2 + 1
            ));
        }
    }
    let mut result = String::with_capacity(text.len());
    let mut at = 0;
    for &(start, end, n) in &spans {
        result.push_str(&text[at..start]);
        result.push_str(&args.edits[n].new_text);
        at = end;
    }
    result.push_str(&text[at..]);
    fsio::write_atomic(&path, result.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", args.path))?;
    Ok(format!(
        "applied {} edit(s) to {}",
        spans.len(),
        ws.display(&path)
    ))
}

/// The whole text of a file a tool is about to rewrite: at most [`MAX_EDIT_BYTES`], UTF-8 and
/// not binary. Returns the file's own path (a symlink on the way resolved) with it.
pub(super) fn read_text(
    ws: &Workspace,
    opened: fsio::Opened,
    user_path: &str,
    tool: &str,
) -> Result<(PathBuf, String), String> {
    let too_big = |bytes: u64| {
        format!(
            "{user_path} is {}; {tool} rewrites the whole file and works on files up to {} MiB. \
             Change a file this large with exec (sed, a script) instead",
            fsio::size(bytes),
            MAX_EDIT_BYTES >> 20
        )
    };
    if opened.meta.len() > MAX_EDIT_BYTES {
        return Err(too_big(opened.meta.len()));
    }
    let mut bytes = Vec::new();
    opened
        .file
        .take(MAX_EDIT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {user_path}: {e}"))?;
    if bytes.len() as u64 > MAX_EDIT_BYTES {
        // It grew while being read.
        return Err(too_big(bytes.len() as u64));
    }
    let path = opened.path;
    if bytes.contains(&0) {
        return Err(format!("{} is a binary file", ws.display(&path)));
    }
    let text =
        String::from_utf8(bytes).map_err(|_| format!("{} is not UTF-8 text", ws.display(&path)))?;
    Ok((path, text))
}

pub(super) fn ls(ws: &Workspace, args: LsArgs) -> Result<String, String> {
    let user_path = args.path.unwrap_or_default();
    let dir = ws.resolve(&user_path)?;
    let shown = if user_path.is_empty() {
        "."
    } else {
        &user_path
    };
    // stat, not open: it follows a symlink (`resolve` checked where it goes) and never blocks.
    let meta =
        std::fs::metadata(&dir).map_err(|e| format!("cannot list {}: {e}", ws.display(&dir)))?;
    if !meta.is_dir() {
        return Err(if meta.is_file() {
            format!("{shown} is a regular file, not a directory; use read")
        } else {
            format!("{shown} is {}, not a directory", fsio::kind(&meta))
        });
    }
    let reader =
        std::fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", ws.display(&dir)))?;
    let mut names: Vec<String> = reader
        .filter_map(Result::ok)
        .map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            match entry.file_type() {
                Ok(t) if t.is_dir() => format!("{name}/"),
                Ok(t) if t.is_symlink() => format!("{name}@"),
                Ok(t) if t.is_file() => name,
                // Named, so nobody tries to read one expecting text.
                Ok(_) => match entry.metadata() {
                    Ok(meta) => format!("{name} ({})", fsio::kind(&meta)),
                    Err(_) => name,
                },
                Err(_) => name,
            }
        })
        .collect();
    names.sort();
    let total = names.len();
    names.truncate(MAX_LS_ENTRIES);
    let mut out = names.join("\n");
    if total > MAX_LS_ENTRIES {
        let _ = write!(out, "\n[… {} more entries]", total - MAX_LS_ENTRIES);
    }
    if out.is_empty() {
        out = "(empty directory)".to_owned();
    }
    Ok(out)
}
