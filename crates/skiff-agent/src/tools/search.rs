//! `find` (glob over paths) and `grep` (regex over contents). Both walk the workspace with the
//! `ignore` crate, so `.gitignore` and friends are respected and `.git` is skipped.

use super::{Workspace, cap};
use serde::Deserialize;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::Path;

const MAX_FIND_RESULTS: usize = 1000;
const MAX_GREP_MATCHES: usize = 500;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FindArgs {
    pattern: String,
    path: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GrepArgs {
    pattern: String,
    path: Option<String>,
    glob: Option<String>,
    ignore_case: Option<bool>,
}

fn walk(root: &Path) -> impl Iterator<Item = ignore::DirEntry> {
    ignore::WalkBuilder::new(root)
        .hidden(false)
        .require_git(false)
        .filter_entry(|e| e.file_name() != ".git")
        .sort_by_file_path(Ord::cmp)
        .build()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_some_and(|t| t.is_file()))
}

fn glob(pattern: &str) -> Result<globset::GlobMatcher, String> {
    globset::GlobBuilder::new(pattern)
        .literal_separator(false)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| format!("invalid glob {pattern:?}: {e}"))
}

pub(super) fn find(ws: &Workspace, args: FindArgs) -> Result<String, String> {
    let base = ws.resolve(args.path.as_deref().unwrap_or(""))?;
    let matcher = glob(&args.pattern)?;
    let mut hits = Vec::new();
    let mut more = 0usize;
    for entry in walk(&base) {
        let rel = entry.path().strip_prefix(&base).unwrap_or(entry.path());
        if matcher.is_match(rel) || rel.file_name().is_some_and(|n| matcher.is_match(n)) {
            if hits.len() < MAX_FIND_RESULTS {
                hits.push(ws.display(entry.path()));
            } else {
                more += 1;
            }
        }
    }
    if hits.is_empty() {
        return Ok(format!("no files match {}", args.pattern));
    }
    let mut out = hits.join("\n");
    if more > 0 {
        let _ = write!(out, "\n[… {more} more files; narrow the pattern]");
    }
    Ok(out)
}

pub(super) fn grep(ws: &Workspace, args: GrepArgs) -> Result<String, String> {
    let base = ws.resolve(args.path.as_deref().unwrap_or(""))?;
    let regex = regex::RegexBuilder::new(&args.pattern)
        .case_insensitive(args.ignore_case.unwrap_or(false))
        .build()
        .map_err(|e| format!("invalid regex: {e}"))?;
    let filter = args.glob.as_deref().map(glob).transpose()?;
    let mut out = String::new();
    let mut matches = 0usize;
    let files: Box<dyn Iterator<Item = std::path::PathBuf>> = if base.is_file() {
        Box::new(std::iter::once(base.clone()))
    } else {
        Box::new(walk(&base).map(ignore::DirEntry::into_path))
    };
    for path in files {
        if let Some(f) = &filter {
            let rel = path.strip_prefix(&base).unwrap_or(&path);
            if !f.is_match(rel) && !path.file_name().is_some_and(|n| f.is_match(n)) {
                continue;
            }
        }
        let Ok(file) = std::fs::File::open(&path) else {
            continue;
        };
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            // Binary or non-UTF-8 content ends the file's scan.
            let Ok(line) = line else { break };
            if regex.is_match(&line) {
                matches += 1;
                if matches <= MAX_GREP_MATCHES {
                    let shown: String = line.chars().take(300).collect();
                    let _ = writeln!(out, "{}:{}: {shown}", ws.display(&path), i + 1);
                }
            }
        }
    }
    if matches == 0 {
        return Ok(format!("no matches for {}", args.pattern));
    }
    if matches > MAX_GREP_MATCHES {
        let _ = write!(
            out,
            "[… {} more matches; narrow the search]",
            matches - MAX_GREP_MATCHES
        );
    }
    Ok(cap(out, "narrow the search"))
}
