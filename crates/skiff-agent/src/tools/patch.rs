//! The patch format of `apply_patch`, the one OpenAI's models are trained on: parsing it, and
//! applying an update's hunks to a file's text in memory. Nothing here touches the file
//! system (`apply_patch.rs` does).
//!
//! ```text
//! *** Begin Patch
//! *** Add File: src/new.rs
//! +fn new() {}
//! *** Delete File: src/old.rs
//! *** Update File: src/lib.rs
//! *** Move to: src/core.rs
//! @@ fn main() {
//!      let a = 1;
//! -    let b = 2;
//! +    let b = 3;
//! *** End of File
//! *** End Patch
//! ```
//!
//! Tolerances, as in the reference implementation (models make these slips): a hunk line that
//! is completely empty is an empty context line (its leading space was lost); the first hunk
//! of a file may start without `@@`; a hunk's lines are found first exactly, then ignoring
//! trailing whitespace (so a file with CRLF endings or trailing blanks still matches); a hunk
//! whose last context line is empty may match without it at the end of the file. Updated files
//! always end with a newline and keep CRLF line endings when they had them.
//! Where this differs from the reference: a hunk that only adds lines goes right after its
//! `@@` context line (the reference appends it to the file), and consecutive `@@` lines narrow
//! the search one after another (`@@ impl A` then `@@ fn f`).

use std::fmt::Write as _;

const BEGIN: &str = "*** Begin Patch";
const END: &str = "*** End Patch";
const ADD: &str = "*** Add File: ";
const DELETE: &str = "*** Delete File: ";
const UPDATE: &str = "*** Update File: ";
const MOVE: &str = "*** Move to: ";
const END_OF_FILE: &str = "*** End of File";

/// One file's section of a patch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum FileOp {
    /// A new file and its whole text.
    Add {
        path: String,
        text: String,
    },
    Delete {
        path: String,
    },
    Update {
        path: String,
        move_to: Option<String>,
        hunks: Vec<Hunk>,
    },
}

/// One `@@` section of an update: where to look, what must be there, what replaces it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Hunk {
    /// The `@@ …` lines: each is found in turn (after the previous hunk), and the hunk's
    /// lines are looked for after the last one.
    pub contexts: Vec<String>,
    pub old: Vec<String>,
    pub new: Vec<String>,
    /// `*** End of File`: the old lines are at the end of the file.
    pub end_of_file: bool,
}

/// Parses a whole patch. Errors name the patch's line (1-based) and say what was expected.
pub(super) fn parse(patch: &str) -> Result<Vec<FileOp>, String> {
    let lines: Vec<&str> = patch.trim().lines().collect();
    if lines.first().map(|l| l.trim_end()) != Some(BEGIN) {
        return Err(format!("a patch starts with the line `{BEGIN}`"));
    }
    if lines.len() < 2 || lines.last().map(|l| l.trim_end()) != Some(END) {
        return Err(format!("a patch ends with the line `{END}`"));
    }
    let body = &lines[1..lines.len() - 1];
    let mut ops = Vec::new();
    let mut i = 0;
    while i < body.len() {
        let at = i + 2; // 1-based, after the Begin line
        let line = body[i];
        i += 1;
        if let Some(path) = line.strip_prefix(ADD) {
            let path = file_path(path, at)?;
            let mut text = String::new();
            while i < body.len() && !is_file_header(body[i]) {
                let Some(content) = body[i].strip_prefix('+') else {
                    return Err(format!(
                        "patch line {}: every line of an added file starts with `+`; got `{}`",
                        i + 2,
                        body[i]
                    ));
                };
                text.push_str(content);
                text.push('\n');
                i += 1;
            }
            ops.push(FileOp::Add { path, text });
        } else if let Some(path) = line.strip_prefix(DELETE) {
            ops.push(FileOp::Delete {
                path: file_path(path, at)?,
            });
        } else if let Some(path) = line.strip_prefix(UPDATE) {
            let path = file_path(path, at)?;
            let mut move_to = None;
            if let Some(to) = body.get(i).and_then(|l| l.strip_prefix(MOVE)) {
                move_to = Some(file_path(to, i + 2)?);
                i += 1;
            }
            let start = i;
            while i < body.len() && !is_file_header(body[i]) {
                i += 1;
            }
            let hunks = hunks(&body[start..i], start + 2)?;
            if hunks.is_empty() && move_to.is_none() {
                return Err(format!(
                    "patch line {at}: `{UPDATE}{path}` has no hunks; give `@@` sections with \
                     ` `, `-` and `+` lines"
                ));
            }
            ops.push(FileOp::Update {
                path,
                move_to,
                hunks,
            });
        } else {
            return Err(format!(
                "patch line {at}: expected `{ADD}`, `{DELETE}` or `{UPDATE}` followed by a \
                 path; got `{line}`"
            ));
        }
    }
    if ops.is_empty() {
        return Err("the patch changes no file".to_owned());
    }
    Ok(ops)
}

fn is_file_header(line: &str) -> bool {
    [ADD, DELETE, UPDATE].iter().any(|h| line.starts_with(h))
}

fn file_path(raw: &str, at: usize) -> Result<String, String> {
    let path = raw.trim();
    if path.is_empty() {
        return Err(format!("patch line {at}: the path is missing"));
    }
    Ok(path.to_owned())
}

/// The hunks of one update; `first` is the patch line number of `lines[0]`.
fn hunks(lines: &[&str], first: usize) -> Result<Vec<Hunk>, String> {
    let mut hunks = Vec::new();
    let mut hunk = Hunk::default();
    let mut closed = false; // after `*** End of File`, only a new `@@` may follow
    for (n, line) in lines.iter().enumerate() {
        let at = first + n;
        if let Some(rest) = line.strip_prefix("@@") {
            if !hunk.old.is_empty() || !hunk.new.is_empty() {
                hunks.push(std::mem::take(&mut hunk));
            }
            closed = false;
            let context = rest.strip_prefix(' ').unwrap_or(rest);
            if !context.trim().is_empty() {
                hunk.contexts.push(context.to_owned());
            }
            continue;
        }
        if line.trim_end() == END_OF_FILE {
            if hunk.old.is_empty() && hunk.new.is_empty() {
                return Err(format!(
                    "patch line {at}: `{END_OF_FILE}` ends an empty hunk"
                ));
            }
            hunk.end_of_file = true;
            hunks.push(std::mem::take(&mut hunk));
            closed = true;
            continue;
        }
        if closed {
            return Err(format!(
                "patch line {at}: after `{END_OF_FILE}` a new hunk starts with `@@`; got `{line}`"
            ));
        }
        match line.split_at_checked(1) {
            Some((" ", text)) => {
                hunk.old.push(text.to_owned());
                hunk.new.push(text.to_owned());
            }
            Some(("-", text)) => hunk.old.push(text.to_owned()),
            Some(("+", text)) => hunk.new.push(text.to_owned()),
            // A blank context line whose leading space was lost.
            None if line.is_empty() => {
                hunk.old.push(String::new());
                hunk.new.push(String::new());
            }
            _ => {
                return Err(format!(
                    "patch line {at}: a hunk line starts with ` ` (context), `-` (remove) or \
                     `+` (add); got `{line}`"
                ));
            }
        }
    }
    if !hunk.old.is_empty() || !hunk.new.is_empty() {
        hunks.push(hunk);
    } else if !hunk.contexts.is_empty() {
        return Err(format!(
            "patch line {}: the last `@@` has no lines under it",
            first + lines.len().saturating_sub(1)
        ));
    }
    Ok(hunks)
}

/// A hunk that did not match, with what it expected (for the model to compare with the file).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct NoMatch {
    /// 1-based.
    pub hunk: usize,
    pub message: String,
}

/// Applies `hunks` to `text` in memory, in order; each hunk is looked for after the previous.
pub(super) fn apply_hunks(text: &str, hunks: &[Hunk]) -> Result<String, NoMatch> {
    let crlf = text.contains("\r\n");
    let mut lines: Vec<String> = text
        .split('\n')
        .map(|l| {
            if crlf {
                l.strip_suffix('\r').unwrap_or(l).to_owned()
            } else {
                l.to_owned()
            }
        })
        .collect();
    // "a\nb\n" splits into a, b and an empty last piece, which is the final newline.
    if lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    let mut replacements: Vec<(usize, usize, &[String])> = Vec::new();
    let mut from = 0;
    for (n, hunk) in hunks.iter().enumerate() {
        let fail = |what: String| NoMatch {
            hunk: n + 1,
            message: what,
        };
        for context in &hunk.contexts {
            match seek(&lines, std::slice::from_ref(context), from, false) {
                Some(at) => from = at + 1,
                None => {
                    return Err(fail(format!(
                        "its context line `@@ {context}` was not found{}",
                        after(from)
                    )));
                }
            }
        }
        if hunk.old.is_empty() {
            // Pure addition: after the context line, or at the end without one.
            let at = if hunk.contexts.is_empty() {
                lines.len()
            } else {
                from
            };
            replacements.push((at, 0, &hunk.new));
            from = at;
            continue;
        }
        let mut old: &[String] = &hunk.old;
        let mut new: &[String] = &hunk.new;
        let mut found = seek(&lines, old, from, hunk.end_of_file);
        if found.is_none() && old.last().is_some_and(String::is_empty) {
            // A trailing empty context line often stands for the end of the file.
            old = &old[..old.len() - 1];
            if new.last().is_some_and(String::is_empty) {
                new = &new[..new.len() - 1];
            }
            found = seek(&lines, old, from, hunk.end_of_file);
        }
        let Some(at) = found else {
            let mut message = format!(
                "these lines (the ` ` and `-` lines of the hunk) were not found{}{}:\n",
                if hunk.end_of_file {
                    " at the end of the file"
                } else {
                    ""
                },
                after(from)
            );
            for line in &hunk.old {
                let _ = writeln!(message, "{line}");
            }
            return Err(fail(message));
        };
        replacements.push((at, old.len(), new));
        from = at + old.len();
    }
    // Later hunks first, so earlier indices stay valid; hunks were found in order.
    for &(at, len, new) in replacements.iter().rev() {
        lines.splice(at..at + len, new.iter().cloned());
    }
    let ending = if crlf { "\r\n" } else { "\n" };
    let mut out = lines.join(ending);
    out.push_str(ending);
    Ok(out)
}

fn after(from: usize) -> String {
    if from == 0 {
        String::new()
    } else {
        format!(" after line {from}")
    }
}

/// The first index at or after `from` where `pattern` occurs: exactly, else ignoring trailing
/// whitespace. With `at_end`, only the position that ends at the end of the file counts.
fn seek(lines: &[String], pattern: &[String], from: usize, at_end: bool) -> Option<usize> {
    if pattern.len() > lines.len() {
        return None;
    }
    let last = lines.len() - pattern.len();
    let starts = if at_end { last..=last } else { from..=last };
    let exact = |a: &str, b: &str| a == b;
    let loose = |a: &str, b: &str| a.trim_end() == b.trim_end();
    for same in [&exact as &dyn Fn(&str, &str) -> bool, &loose] {
        for start in starts.clone() {
            if start < from {
                continue;
            }
            if lines[start..start + pattern.len()]
                .iter()
                .zip(pattern)
                .all(|(l, p)| same(l, p))
            {
                return Some(start);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hunk(contexts: &[&str], old: &[&str], new: &[&str]) -> Hunk {
        Hunk {
            contexts: contexts.iter().map(|s| (*s).to_owned()).collect(),
            old: old.iter().map(|s| (*s).to_owned()).collect(),
            new: new.iter().map(|s| (*s).to_owned()).collect(),
            end_of_file: false,
        }
    }

    #[test]
    fn parses_every_kind_of_section() {
        let patch = "*** Begin Patch
*** Add File: new.txt
+hello
+
*** Delete File: gone.txt
*** Update File: src/lib.rs
*** Move to: src/core.rs
@@ fn main() {
     let a = 1;
-    let b = 2;
+    let b = 3;

@@
-last
+final
*** End of File
*** End Patch
";
        let ops = parse(patch).unwrap();
        assert_eq!(
            ops,
            vec![
                FileOp::Add {
                    path: "new.txt".into(),
                    text: "hello\n\n".into()
                },
                FileOp::Delete {
                    path: "gone.txt".into()
                },
                FileOp::Update {
                    path: "src/lib.rs".into(),
                    move_to: Some("src/core.rs".into()),
                    hunks: vec![
                        hunk(
                            &["fn main() {"],
                            &["    let a = 1;", "    let b = 2;", ""],
                            &["    let a = 1;", "    let b = 3;", ""]
                        ),
                        Hunk {
                            end_of_file: true,
                            ..hunk(&[], &["last"], &["final"])
                        },
                    ]
                },
            ]
        );
    }

    #[test]
    fn a_first_hunk_without_at_at_and_stacked_contexts_parse() {
        let ops = parse(
            "*** Begin Patch\n*** Update File: a\n-x\n+y\n@@ impl A\n@@ fn f\n-1\n+2\n*** End Patch",
        )
        .unwrap();
        let FileOp::Update { hunks, .. } = &ops[0] else {
            panic!("{ops:?}")
        };
        assert_eq!(
            hunks,
            &vec![
                hunk(&[], &["x"], &["y"]),
                hunk(&["impl A", "fn f"], &["1"], &["2"])
            ]
        );
    }

    #[test]
    fn malformed_patches_are_refused_with_the_line() {
        let err = |p: &str| parse(p).unwrap_err();
        assert!(err("*** Update File: a\n*** End Patch").contains("starts with the line"));
        assert!(err("*** Begin Patch\n*** Add File: a\n+x").contains("ends with the line"));
        assert!(err("*** Begin Patch\n*** End Patch").contains("changes no file"));
        let e = err("*** Begin Patch\n*** Add File: a\nx\n*** End Patch");
        assert!(e.starts_with("patch line 3:") && e.contains("`+`"), "{e}");
        let e = err("*** Begin Patch\n*** Update File: a\n@@\n x\n?y\n*** End Patch");
        assert!(e.starts_with("patch line 5:") && e.contains("`?y`"), "{e}");
        let e = err("*** Begin Patch\n*** Update File: a\n*** End Patch");
        assert!(e.contains("has no hunks"), "{e}");
        let e = err("*** Begin Patch\n*** Frobnicate: a\n*** End Patch");
        assert!(e.starts_with("patch line 2:"), "{e}");
        let e = err("*** Begin Patch\n*** Delete File:  \n*** End Patch");
        assert!(e.contains("path is missing"), "{e}");
    }

    #[test]
    fn hunks_apply_in_order_after_their_context() {
        let text = "fn a() {\n    x\n}\nfn b() {\n    x\n}\n";
        let out = apply_hunks(
            text,
            &[
                hunk(&["fn b() {"], &["    x"], &["    y"]),
                hunk(&[], &["}"], &["} // b"]),
            ],
        )
        .unwrap();
        assert_eq!(out, "fn a() {\n    x\n}\nfn b() {\n    y\n} // b\n");
    }

    #[test]
    fn a_pure_addition_goes_after_its_context_or_at_the_end() {
        let text = "use a;\n\nfn main() {}\n";
        let out = apply_hunks(text, &[hunk(&["use a;"], &[], &["use b;"])]).unwrap();
        assert_eq!(out, "use a;\nuse b;\n\nfn main() {}\n");
        let out = apply_hunks(text, &[hunk(&[], &[], &["// end"])]).unwrap();
        assert_eq!(out, "use a;\n\nfn main() {}\n// end\n");
    }

    #[test]
    fn trailing_whitespace_and_crlf_are_tolerated_and_kept() {
        let out = apply_hunks("a  \r\nb\r\nc\r\n", &[hunk(&[], &["a", "b"], &["a", "B"])]).unwrap();
        assert_eq!(out, "a\r\nB\r\nc\r\n");
        // Exact matches win over loose ones.
        let out = apply_hunks("x \nx\n", &[hunk(&[], &["x"], &["y"])]).unwrap();
        assert_eq!(out, "x \ny\n");
    }

    #[test]
    fn end_of_file_matches_only_at_the_end() {
        let text = "x\ny\nx\n";
        let eof = Hunk {
            end_of_file: true,
            ..hunk(&[], &["x"], &["z"])
        };
        assert_eq!(apply_hunks(text, &[eof]).unwrap(), "x\ny\nz\n");
        // A trailing blank context line may stand for the end of the file.
        let out = apply_hunks("a\nb\n", &[hunk(&[], &["b", ""], &["c", ""])]).unwrap();
        assert_eq!(out, "a\nc\n");
    }

    #[test]
    fn a_hunk_that_does_not_match_names_itself_and_shows_what_it_expected() {
        let text = "one\ntwo\nthree\n";
        let err = apply_hunks(
            text,
            &[
                hunk(&[], &["two"], &["2"]),
                hunk(&[], &["one", "-two"], &["1"]),
            ],
        )
        .unwrap_err();
        assert_eq!(err.hunk, 2);
        assert!(
            err.message.contains("not found after line 2"),
            "{}",
            err.message
        );
        assert!(err.message.ends_with(":\none\n-two\n"), "{}", err.message);
        let err = apply_hunks(text, &[hunk(&["fn missing"], &["one"], &["1"])]).unwrap_err();
        assert_eq!(err.hunk, 1);
        assert!(
            err.message.contains("`@@ fn missing` was not found"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_file_without_a_final_newline_gains_one() {
        assert_eq!(
            apply_hunks("a\nb", &[hunk(&[], &["b"], &["c"])]).unwrap(),
            "a\nc\n"
        );
    }
}
