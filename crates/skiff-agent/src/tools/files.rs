//! `read`, `write`, `edit` and `ls`.

use super::{Workspace, cap};
use serde::Deserialize;
use std::fmt::Write as _;
use std::path::Path;

const DEFAULT_READ_LINES: usize = 2000;
const MAX_LINE_CHARS: usize = 2000;
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

fn read_text(ws: &Workspace, user_path: &str, path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {user_path}: {e}"))?;
    if bytes.contains(&0) {
        return Err(format!("{} is a binary file", ws.display(path)));
    }
    String::from_utf8(bytes).map_err(|_| format!("{} is not UTF-8 text", ws.display(path)))
}

pub(super) fn read(ws: &Workspace, args: ReadArgs) -> Result<String, String> {
    let path = ws.resolve(&args.path)?;
    if path.is_dir() {
        return Err(format!("{} is a directory; use ls", args.path));
    }
    let text = read_text(ws, &args.path, &path)?;
    let offset = args.offset.unwrap_or(1).max(1);
    let limit = args.limit.unwrap_or(DEFAULT_READ_LINES).max(1);
    let total = text.lines().count();
    if total > 0 && offset > total {
        return Err(format!(
            "offset {offset} is past the end of {} ({total} lines)",
            args.path
        ));
    }
    let mut out = String::new();
    for (i, line) in text.lines().enumerate().skip(offset - 1).take(limit) {
        let line = if line.chars().count() > MAX_LINE_CHARS {
            format!(
                "{}… [line cut]",
                line.chars().take(MAX_LINE_CHARS).collect::<String>()
            )
        } else {
            line.to_owned()
        };
        let _ = writeln!(out, "{:>6}\t{line}", i + 1);
    }
    let shown_to = (offset - 1 + limit).min(total);
    if shown_to < total {
        let _ = write!(
            out,
            "[… {} more lines; read with offset={} to continue]",
            total - shown_to,
            shown_to + 1
        );
    }
    Ok(cap(out, "read a smaller range with offset and limit"))
}

pub(super) fn write(ws: &Workspace, args: WriteArgs) -> Result<String, String> {
    let path = ws.resolve(&args.path)?;
    if path.is_dir() {
        return Err(format!("{} is a directory", args.path));
    }
    write_atomic(&path, args.content.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", args.path))?;
    Ok(format!(
        "wrote {} bytes to {}",
        args.content.len(),
        ws.display(&path)
    ))
}

pub(super) fn edit(ws: &Workspace, args: EditArgs) -> Result<String, String> {
    let path = ws.resolve(&args.path)?;
    let text = read_text(ws, &args.path, &path)?;
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
    write_atomic(&path, result.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", args.path))?;
    Ok(format!(
        "applied {} edit(s) to {}",
        spans.len(),
        ws.display(&path)
    ))
}

pub(super) fn ls(ws: &Workspace, args: LsArgs) -> Result<String, String> {
    let user_path = args.path.unwrap_or_default();
    let dir = ws.resolve(&user_path)?;
    let reader =
        std::fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", ws.display(&dir)))?;
    let mut names: Vec<String> = reader
        .filter_map(Result::ok)
        .map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            match entry.file_type() {
                Ok(t) if t.is_dir() => format!("{name}/"),
                Ok(t) if t.is_symlink() => format!("{name}@"),
                _ => name,
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

/// Writes through a temporary file and a rename, so a crash never leaves half a file. Keeps
/// the permissions of a file it replaces (an edited script stays executable).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".{name}.skiff-tmp"));
    std::fs::write(&tmp, bytes)?;
    if let Ok(meta) = std::fs::metadata(path) {
        std::fs::set_permissions(&tmp, meta.permissions())?;
    }
    std::fs::rename(&tmp, path)
}
