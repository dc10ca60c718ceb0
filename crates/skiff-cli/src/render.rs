//! Showing a session to a person: live events as they stream (text to stdout, a spinner on
//! stderr while the model thinks), session lists and transcripts.
//!
//! A tool call is one row, printed once its result is known, with the result under it: for
//! `exec` the exit code and the last [`TAIL_LINES`] lines of its output, for the file tools one
//! line (what was read or written, how much), for a failing tool its error, bounded unless
//! `--full`. Tool output is someone else's bytes: escape sequences and control characters are
//! dropped before they reach the terminal. `--json` is untouched by all of this.

use indicatif::{ProgressBar, ProgressStyle};
use skiff_protocol::api::{RunStatus, SessionView};
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::model::{Image, Reasoning};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::Duration;
/// How much of a tool's result to show, and how.
#[derive(Clone, Copy, Debug)]
pub struct Detail {
    /// All of `exec`'s output and of an error (`--full`), instead of the tail and a bound.
    pub full: bool,
    /// The command has `--full`, so a note about cut output can point to it.
    pub full_flag: bool,
    /// Dim tool output (stdout is a terminal and `NO_COLOR` is unset).
    pub dim: bool,
}

impl Detail {
    /// For a command with `--full`; dims only when stdout is a terminal.
    pub fn with_full_flag(full: bool) -> Self {
        Self {
            full,
            full_flag: true,
            dim: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
        }
    }
}

/// A tool call as its row names it.
struct Call {
    name: String,
    summary: String,
}

/// A tool that finished and whose result has not arrived yet.
struct Finished {
    call_id: String,
    name: String,
    is_error: bool,
    duration_ms: u64,
    /// Its row was printed without the result, because something else came first.
    printed: bool,
}

/// Renders a live event stream.
pub struct Live {
    json: bool,
    detail: Detail,
    spinner: Option<ProgressBar>,
    /// Whether the cursor is mid-line on stdout (text was streamed without a newline).
    mid_line: bool,
    /// The run's tool calls by call id, for their rows.
    calls: HashMap<String, Call>,
    /// Finished tools waiting for their result (a transcript entry committed after them).
    finished: Vec<Finished>,
    /// Calls whose result was shown; a finish event that arrives after it changes nothing.
    shown: HashSet<String>,
    /// When the model started streaming reasoning (the event's `at_ms`), while it still is.
    thinking_since: Option<i64>,
    /// The newest event's `at_ms`, to end a thinking line when the stream ends.
    last_at_ms: i64,
}

impl Live {
    /// Without `--full` (`skiff demo`).
    pub fn new(json: bool) -> Self {
        Self::with_detail(
            json,
            Detail {
                full_flag: false,
                ..Detail::with_full_flag(false)
            },
        )
    }

    pub fn with_detail(json: bool, detail: Detail) -> Self {
        Self {
            json,
            detail,
            spinner: None,
            mid_line: false,
            calls: HashMap::new(),
            finished: Vec::new(),
            shown: HashSet::new(),
            thinking_since: None,
            last_at_ms: 0,
        }
    }

    /// Whether events are printed as JSON lines.
    pub fn json(&self) -> bool {
        self.json
    }

    fn spin(&mut self, message: String) {
        if self.json || !std::io::stderr().is_terminal() {
            return;
        }
        let bar = self.spinner.get_or_insert_with(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.enable_steady_tick(Duration::from_millis(100));
            bar
        });
        bar.set_message(message);
    }

    fn stop_spinner(&mut self) {
        if let Some(bar) = self.spinner.take() {
            bar.finish_and_clear();
        }
    }

    fn line_break(&mut self) -> anyhow::Result<()> {
        if self.mid_line {
            outln!()?;
            self.mid_line = false;
        }
        Ok(())
    }

    fn call(&self, call_id: &str, name: &str) -> (String, String) {
        match self.calls.get(call_id) {
            Some(call) => (call.name.clone(), call.summary.clone()),
            None => (name.to_owned(), String::new()),
        }
    }

    /// Prints the rows of finished tools whose results are still to come, before something
    /// else is printed (their results follow, each under a line that names its tool).
    fn flush_finished(&mut self) -> anyhow::Result<()> {
        let mut rows = String::new();
        for f in self.finished.iter_mut().filter(|f| !f.printed) {
            f.printed = true;
            let (name, summary) = match self.calls.get(&f.call_id) {
                Some(call) => (call.name.as_str(), call.summary.as_str()),
                None => (f.name.as_str(), ""),
            };
            let status = Status {
                is_error: Some(f.is_error),
                note: None,
                duration_ms: Some(f.duration_ms),
            };
            rows.push_str(&tool_row("▸", name, summary, &status));
        }
        if !rows.is_empty() {
            self.stop_spinner();
            self.line_break()?;
            out!("{rows}")?;
        }
        Ok(())
    }

    fn show_result(
        &mut self,
        call_id: &str,
        name: &str,
        content: &str,
        is_error: bool,
        images: &[Image],
    ) -> anyhow::Result<()> {
        self.stop_spinner();
        self.line_break()?;
        self.shown.insert(call_id.to_owned());
        let finished = self
            .finished
            .iter()
            .position(|f| f.call_id == call_id)
            .map(|i| self.finished.remove(i));
        let (name, summary) = self.call(call_id, name);
        let view = view_result(&name, content, is_error, self.detail).with_images(images);
        let status = Status {
            is_error: Some(is_error),
            note: view.note.as_deref(),
            duration_ms: finished.as_ref().map(|f| f.duration_ms),
        };
        let printed = finished.as_ref().is_some_and(|f| f.printed);
        // A row printed before its result came gets a line naming its tool above the result.
        let marker = if printed { "↳" } else { "▸" };
        let mut text = tool_row(marker, &name, &summary, &status);
        push_body(&mut text, &view.body, self.detail);
        out!("{text}")
    }

    /// Shows one event. Fails only when stdout cannot be written (its reader went away).
    pub fn show(&mut self, event: &SessionEvent) -> anyhow::Result<()> {
        if self.json {
            if let Ok(line) = serde_json::to_string(event) {
                outln!("{line}")?;
            }
            return Ok(());
        }
        self.last_at_ms = event.at_ms;
        if !matches!(event.kind, EventKind::ReasoningDelta { .. }) {
            self.end_thinking(event.at_ms);
        }
        match &event.kind {
            EventKind::ReasoningDelta { .. } => {
                if self.thinking_since.is_none() {
                    self.thinking_since = Some(event.at_ms);
                    self.flush_finished()?;
                    self.line_break()?;
                    self.spin("thinking…".to_owned());
                }
            }
            EventKind::ModelRequest { model } => {
                self.flush_finished()?;
                self.spin(format!("thinking ({model})"));
            }
            EventKind::TextDelta { text } => {
                self.flush_finished()?;
                self.stop_spinner();
                out!("{text}")?;
                self.mid_line = !text.ends_with('\n');
            }
            EventKind::ToolStarted {
                call_id,
                name,
                summary,
            } => {
                // Not a reason to print the rows of the tools before it in this step: their
                // results come with this one's (the loop commits a step's results together),
                // and a row reads best with its result under it.
                self.line_break()?;
                self.spin(format!("running {name} {summary}"));
                self.calls.insert(
                    call_id.clone(),
                    Call {
                        name: name.clone(),
                        summary: summary.clone(),
                    },
                );
            }
            EventKind::ToolFinished {
                call_id,
                name,
                is_error,
                duration_ms,
            } => {
                self.stop_spinner();
                // A worker's result can be committed before its finish event arrives.
                if !self.shown.contains(call_id) {
                    self.finished.push(Finished {
                        call_id: call_id.clone(),
                        name: name.clone(),
                        is_error: *is_error,
                        duration_ms: *duration_ms,
                        printed: false,
                    });
                }
            }
            EventKind::Entry { entry } => match &entry.body {
                EntryBody::ToolResult {
                    call_id,
                    name,
                    content,
                    is_error,
                    images,
                } => self.show_result(call_id, name, content, *is_error, images)?,
                EntryBody::AssistantMessage { tool_calls, .. } => {
                    for call in tool_calls {
                        self.calls.entry(call.id.clone()).or_insert_with(|| Call {
                            name: call.name.clone(),
                            summary: skiff_agent::tools::summary(call),
                        });
                    }
                }
                EntryBody::Notice { text } => {
                    self.flush_finished()?;
                    self.stop_spinner();
                    self.line_break()?;
                    eprintln!("! {text}");
                }
                EntryBody::Compaction {
                    entries,
                    tokens_before,
                    ..
                } => {
                    self.flush_finished()?;
                    self.stop_spinner();
                    self.line_break()?;
                    eprintln!(
                        "── conversation compacted: {entries} entries (≈{tokens_before} tokens) summarised; `skiff session show` has the summary"
                    );
                }
                EntryBody::UserMessage { .. } => {}
            },
            EventKind::RunStatus { status, error } if status.is_terminal() => {
                self.flush_finished()?;
                self.stop_spinner();
                self.line_break()?;
                match (status, error) {
                    (RunStatus::Succeeded, _) => eprintln!("✓ run succeeded"),
                    (status, Some(error)) => eprintln!("✗ run {status}: {error}"),
                    (status, None) => eprintln!("✗ run {status}"),
                }
            }
            EventKind::RunStatus { .. } => {}
            EventKind::Placement { state, detail, .. } => {
                self.flush_finished()?;
                self.stop_spinner();
                self.line_break()?;
                eprintln!("◦ {:<13}{detail}", state.as_str());
            }
            EventKind::SetupOutput { text } => self.setup_output(text),
            EventKind::Approval { approval } => {
                self.flush_finished()?;
                self.stop_spinner();
                self.line_break()?;
                show_approval(approval, self.detail);
            }
        }
        Ok(())
    }

    /// Reasoning stopped streaming at `at_ms`: one line saying for how long (the text itself
    /// is in the transcript; `--json` streams it).
    fn end_thinking(&mut self, at_ms: i64) {
        if let Some(since) = self.thinking_since.take() {
            self.stop_spinner();
            let ms = u64::try_from(at_ms.saturating_sub(since)).unwrap_or(0);
            // On stderr like the spinner it replaces; stdout stays the answer.
            eprintln!("thinking… {}", format_duration(ms));
        }
    }

    /// Setup output: on a terminal, its newest line beside a spinner (the failure message
    /// carries the last lines, `session setup-log` all of them); otherwise every line.
    fn setup_output(&mut self, text: &str) {
        let mut lines = text.lines().map(printable).filter(|l| !l.trim().is_empty());
        if std::io::stderr().is_terminal() {
            if let Some(last) = lines.next_back() {
                let last: String = last.chars().take(LINE_CHARS.min(120)).collect();
                self.spin(format!("setup │ {last}"));
            }
        } else {
            for line in lines {
                eprintln!("  │ {line}");
            }
        }
    }

    pub fn finish(&mut self) -> anyhow::Result<()> {
        self.end_thinking(self.last_at_ms);
        self.flush_finished()?;
        self.stop_spinner();
        self.line_break()
    }
}

/// The last lines of `exec` output shown without `--full`.
pub const TAIL_LINES: usize = 10;
/// The lines of an error shown without `--full`.
const ERROR_LINES: usize = 40;
/// The characters of one output line shown without `--full`.
const LINE_CHARS: usize = 400;
/// The characters of a one-line note (an unknown tool's first line).
const NOTE_CHARS: usize = 100;

/// What a row says after its name: ✓ or ✗, a short note, how long it took.
struct Status<'a> {
    /// `None`: the call has no result (its turn ended before it ran or was recorded).
    is_error: Option<bool>,
    note: Option<&'a str>,
    duration_ms: Option<u64>,
}

impl Status<'static> {
    fn no_result() -> Self {
        Self {
            is_error: None,
            note: Some("no result"),
            duration_ms: None,
        }
    }
}

/// `  ▸ exec cargo test  ✗ exit 101 · 8.1 s`
fn tool_row(marker: &str, name: &str, summary: &str, status: &Status<'_>) -> String {
    let mark = match status.is_error {
        Some(true) => "✗",
        Some(false) => "✓",
        None => "·",
    };
    let mut parts: Vec<String> = Vec::new();
    if let Some(note) = status.note {
        parts.push(note.to_owned());
    }
    if let Some(ms) = status.duration_ms {
        parts.push(format_duration(ms));
    }
    let call = if summary.is_empty() {
        printable(name)
    } else {
        format!("{} {}", printable(name), printable(summary))
    };
    let tail = if parts.is_empty() {
        String::new()
    } else {
        format!(" {}", parts.join(" · "))
    };
    format!("  {marker} {call}  {mark}{tail}\n")
}

/// The lines under a row, indented (and dimmed on a terminal).
fn push_body(out: &mut String, body: &[String], detail: Detail) {
    for line in body {
        if detail.dim {
            let _ = writeln!(out, "      \x1b[2m{line}\x1b[0m");
        } else {
            let _ = writeln!(out, "      {line}");
        }
    }
}

/// A tool's result as a row shows it: a note on the row, and lines under it.
#[derive(Debug, Default, PartialEq)]
struct ResultView {
    note: Option<String>,
    body: Vec<String>,
}

impl ResultView {
    /// A result with images shows each as `[image 1280×720 png]` on its row, never its data.
    fn with_images(mut self, images: &[Image]) -> Self {
        if !images.is_empty() {
            let labels: Vec<String> = images
                .iter()
                .map(|image| format!("[{}]", skiff_agent::tools::image_label(image)))
                .collect();
            self.note = Some(labels.join(" "));
        }
        self
    }
}

fn view_result(name: &str, content: &str, is_error: bool, detail: Detail) -> ResultView {
    if name == "exec"
        && let Some((code, output)) = exit_code(content)
    {
        return ResultView {
            note: Some(format!("exit {code}")),
            body: tail(output, detail),
        };
    }
    if is_error {
        // Timeouts, cancels, refusals and bad arguments: the reason, whole but bounded.
        return ResultView {
            note: None,
            body: head(content, ERROR_LINES, detail),
        };
    }
    if name == "apply_patch"
        && let Some(files) = content.strip_prefix("applied the patch:\n")
    {
        // One `A|M|D|R path` line per file: short, and what a reviewer wants to see.
        return ResultView {
            note: Some(plural(files.lines().count(), "file", "files")),
            body: head(files, ERROR_LINES, detail),
        };
    }
    let note = match name {
        "read" => read_note(content),
        "ls" => count_note(content, "entry", "entries", "more entries"),
        "find" if content.starts_with("no files match") => None,
        "find" => count_note(content, "file", "files", "more files"),
        "grep" if content.starts_with("no matches for") => Some("no matches".to_owned()),
        "grep" => count_note(content, "match", "matches", "more matches"),
        "write" => number_after(content, "wrote ").map(|n| plural(n, "byte", "bytes")),
        "edit" => number_after(content, "applied ").map(|n| plural(n, "edit", "edits")),
        _ => None,
    };
    ResultView {
        note: note.or_else(|| first_line(content)),
        body: Vec::new(),
    }
}

/// `exec`'s "exit code: N" first line, and the output after it.
fn exit_code(content: &str) -> Option<(i64, &str)> {
    let rest = content.strip_prefix("exit code: ")?;
    let (code, output) = rest.split_once('\n').unwrap_or((rest, ""));
    Some((code.trim().parse().ok()?, output))
}

/// The last [`TAIL_LINES`] lines of `output` (all with `--full`), after a note of how many
/// came before them.
fn tail(output: &str, detail: Detail) -> Vec<String> {
    let lines = trimmed_lines(output);
    let keep = if detail.full { lines.len() } else { TAIL_LINES };
    let skipped = lines.len().saturating_sub(keep);
    let mut body = Vec::with_capacity(keep + 1);
    if skipped > 0 {
        body.push(format!(
            "… {}{}",
            plural(skipped, "earlier line", "earlier lines"),
            full_hint(detail)
        ));
    }
    body.extend(lines[skipped..].iter().map(|l| shown_line(l, detail)));
    body
}

/// The first `limit` lines of `text` (all with `--full`), then a note of how many follow.
fn head(text: &str, limit: usize, detail: Detail) -> Vec<String> {
    let lines = trimmed_lines(text);
    let keep = if detail.full {
        lines.len()
    } else {
        limit.min(lines.len())
    };
    let mut body: Vec<String> = lines[..keep]
        .iter()
        .map(|l| shown_line(l, detail))
        .collect();
    if keep < lines.len() {
        body.push(format!(
            "… {}{}",
            plural(lines.len() - keep, "more line", "more lines"),
            full_hint(detail)
        ));
    }
    body
}

fn full_hint(detail: Detail) -> &'static str {
    if detail.full_flag {
        " (--full shows all)"
    } else {
        ""
    }
}

/// The lines of `text` without the blank ones at its end.
fn trimmed_lines(text: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = text.lines().collect();
    while lines.last().is_some_and(|l| l.trim().is_empty()) {
        lines.pop();
    }
    lines
}

fn shown_line(line: &str, detail: Detail) -> String {
    let line = printable(line);
    if detail.full || line.chars().count() <= LINE_CHARS {
        return line;
    }
    let cut: String = line.chars().take(LINE_CHARS).collect();
    format!("{cut} …")
}

/// `line` as a terminal should show it: what a carriage return would leave visible, without
/// escape sequences (colors, titles, cursor moves) or other control characters.
fn printable(line: &str) -> String {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let line = line.rsplit('\r').next().unwrap_or(line);
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => match chars.next() {
                // CSI: parameters and intermediates up to a final byte in @..~.
                Some('[') => {
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                }
                // OSC, DCS and the like: up to BEL or ESC \.
                Some(']' | 'P' | 'X' | '^' | '_') => {
                    while let Some(c) = chars.next() {
                        if c == '\x07' {
                            break;
                        }
                        if c == '\x1b' && chars.peek() == Some(&'\\') {
                            chars.next();
                            break;
                        }
                    }
                }
                _ => {}
            },
            '\t' => out.push_str("    "),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// `read`'s numbered lines ("     1\tfn main() {") as "12 lines" or "lines 40–80 of 300".
fn read_note(content: &str) -> Option<String> {
    let numbers: Vec<usize> = content
        .lines()
        .filter_map(|l| l.split_once('\t')?.0.trim().parse().ok())
        .collect();
    let (first, last) = (*numbers.first()?, *numbers.last()?);
    let trailer = content.lines().last().unwrap_or("");
    let more = number_after(trailer, "[… ").filter(|_| trailer.contains(" more lines"));
    let cut = trailer.starts_with("[output cut") || trailer.starts_with("[… more lines follow");
    Some(match (more, cut) {
        (Some(more), _) => format!("lines {first}–{last} of {}", last + more),
        (None, true) => format!("lines {first}–{last}, more follow"),
        (None, false) if first == 1 => plural(numbers.len(), "line", "lines"),
        (None, false) => format!("lines {first}–{last}"),
    })
}

/// "12 entries" for a listing of one item per line, plus a "[… N more entries]" trailer.
fn count_note(content: &str, one: &str, many: &str, more_marker: &str) -> Option<String> {
    let mut count = 0;
    let mut more = 0;
    for line in content.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('[') {
            if line.contains(more_marker) {
                more += number_after(line, "[… ").unwrap_or(0);
            }
        } else if !line.starts_with('(') {
            count += 1;
        }
    }
    (count + more > 0).then(|| plural(count + more, one, many))
}

/// The number right after `prefix` at the start of `text` ("wrote 12 bytes" → 12).
fn number_after(text: &str, prefix: &str) -> Option<usize> {
    let rest = text.strip_prefix(prefix)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The first non-blank line, whitespace collapsed, cut to [`NOTE_CHARS`].
fn first_line(content: &str) -> Option<String> {
    let line = content.lines().find(|l| !l.trim().is_empty())?;
    let line = printable(line)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    Some(if line.chars().count() > NOTE_CHARS {
        format!("{}…", line.chars().take(NOTE_CHARS - 1).collect::<String>())
    } else {
        line
    })
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// `532 B`, `14.2 KiB`, `3.1 MiB`, `1.0 GiB`.
/// A turn's (or a session's) token counts, as `session show` prints them:
/// `in 1200 (1000 read from cache, 150 written) / out 80 tokens · $0.0123`. The cache part
/// only when the provider reported one, the cost only when the model has prices.
pub fn tokens(
    input: u64,
    output: u64,
    cache_read: u64,
    cache_write: u64,
    cost_usd: Option<f64>,
) -> String {
    let cache = match (cache_read, cache_write) {
        (0, 0) => String::new(),
        (read, 0) => format!(" ({read} read from cache)"),
        (0, written) => format!(" ({written} written to cache)"),
        (read, written) => format!(" ({read} read from cache, {written} written)"),
    };
    let cost = cost_usd
        .map(|c| format!(" · {}", dollars(c)))
        .unwrap_or_default();
    format!("in {input}{cache} / out {output} tokens{cost}")
}

/// Cents are too coarse for one turn of a cheap model, so four decimals below a dollar.
pub fn dollars(amount: f64) -> String {
    if amount >= 1.0 {
        format!("${amount:.2}")
    } else {
        format!("${amount:.4}")
    }
}

pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

pub fn format_duration(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else {
        format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

/// "1.5 GiB", "812 KiB", "0 B": binary multiples, for sizes people scan.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value < 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.0} {}", UNITS[unit])
    }
}

/// "3m ago", for times people scan.
pub fn ago(at_ms: i64, now_ms: i64) -> String {
    let secs = (now_ms - at_ms).max(0) / 1000;
    match secs {
        0..=59 => format!("{secs}s ago"),
        60..=3599 => format!("{}m ago", secs / 60),
        3600..=86_399 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86_400),
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The state a person cares about: the last run's status, or idle.
pub fn state(session: &SessionView) -> String {
    match &session.last_run {
        Some(run) if !run.status.is_terminal() => run.status.to_string(),
        Some(run) if run.status != RunStatus::Succeeded => run.status.to_string(),
        _ => "idle".to_owned(),
    }
}

/// The session list; with an OWNER column when some session is not `me`'s.
pub fn session_table(sessions: &[SessionView], me: &str) -> String {
    let rows: Vec<(&SessionView, usize)> = sessions.iter().map(|s| (s, 0)).collect();
    session_rows(&rows, me)
}

/// Like [`session_table`], with every dispatched session right under its parent, indented
/// (a child whose parent is not in the list stands on its own).
pub fn session_tree(sessions: &[SessionView], me: &str) -> String {
    let listed: std::collections::HashSet<&str> = sessions.iter().map(|s| s.id.as_str()).collect();
    let is_root = |s: &SessionView| {
        s.parent_id
            .as_ref()
            .is_none_or(|p| !listed.contains(p.as_str()))
    };
    fn add<'a>(
        s: &'a SessionView,
        depth: usize,
        all: &'a [SessionView],
        rows: &mut Vec<(&'a SessionView, usize)>,
    ) {
        rows.push((s, depth));
        for child in all.iter().filter(|c| c.parent_id.as_ref() == Some(&s.id)) {
            add(child, depth + 1, all, rows);
        }
    }
    let mut rows = Vec::new();
    for root in sessions.iter().filter(|s| is_root(s)) {
        add(root, 0, sessions, &mut rows);
    }
    session_rows(&rows, me)
}

fn session_rows(sessions: &[(&SessionView, usize)], me: &str) -> String {
    if sessions.is_empty() {
        return "no sessions yet; start one with `skiff session new \"PROMPT\"`\n".to_owned();
    }
    let now = now_ms();
    let rows: Vec<[String; 6]> = sessions
        .iter()
        .map(|&(s, depth)| {
            [
                match depth {
                    0 => s.id.to_string(),
                    d => format!("{}└ {}", "  ".repeat(d - 1), s.id),
                },
                state(s),
                match &s.worker {
                    Some(w) => match &w.environment_id {
                        Some(env) => format!("{} {env}", s.placement),
                        None => format!("{} ({})", s.placement, w.profile),
                    },
                    None => s.placement.clone(),
                },
                s.model.label.clone(),
                ago(s.updated_at_ms, now),
                match &s.group_id {
                    Some(group) => format!("{} (attempt of {group})", s.title),
                    None => s.title.clone(),
                },
            ]
        })
        .collect();
    let owner = |s: &SessionView| s.owner.clone().filter(|o| o != me);
    if sessions.iter().all(|&(s, _)| owner(s).is_none()) {
        return table(
            &["ID", "STATE", "PLACEMENT", "MODEL", "UPDATED", "TITLE"],
            &rows,
        );
    }
    let rows: Vec<[String; 7]> = rows
        .into_iter()
        .zip(sessions)
        .map(|([id, st, pl, model, updated, title], &(s, _))| {
            let whose = owner(s).unwrap_or_else(|| "you".to_owned());
            [id, st, pl, model, updated, whose, title]
        })
        .collect();
    table(
        &[
            "ID",
            "STATE",
            "PLACEMENT",
            "MODEL",
            "UPDATED",
            "OWNER",
            "TITLE",
        ],
        &rows,
    )
}

/// Columns as wide as their widest cell (header included), two spaces apart, the last one
/// unpadded: fixed widths misalign as soon as one id or state is longer than guessed.
pub fn table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let parts: Vec<String> = cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i + 1 == N {
                    (*c).to_owned()
                } else {
                    format!("{c:<w$}")
                }
            })
            .collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

/// `  · thinking (1234 chars)`: that the model reasoned and how much, never what (it can be
/// long, and `--json` has it whole); a redacted block is only counted.
fn thinking_marker(reasoning: &[Reasoning]) -> String {
    let chars: usize = reasoning
        .iter()
        .map(|r| r.readable_text().chars().count())
        .sum();
    let redacted = reasoning
        .iter()
        .filter(|r| matches!(r, Reasoning::RedactedThinking { .. }))
        .count();
    let mut parts = vec![plural(chars, "char", "chars")];
    if redacted > 0 {
        parts.push(format!("{redacted} redacted"));
    }
    format!("  · thinking ({})\n", parts.join(", "))
}

/// A transcript as a person reads it: each tool call a row with its result under it (as the
/// live stream shows them, without durations, which the transcript does not keep).
pub fn transcript(entries: &[TranscriptEntry], detail: Detail) -> String {
    let mut out = String::new();
    // Calls of the last assistant message still waiting for their result: (id, name, summary).
    let mut open: Vec<(String, String, String)> = Vec::new();
    let flush_open = |out: &mut String, open: &mut Vec<(String, String, String)>| {
        for (_, name, summary) in open.drain(..) {
            out.push_str(&tool_row("▸", &name, &summary, &Status::no_result()));
        }
    };
    for entry in entries {
        if !matches!(entry.body, EntryBody::ToolResult { .. }) {
            flush_open(&mut out, &mut open);
        }
        match &entry.body {
            EntryBody::UserMessage { text } => out.push_str(&format!("you    {}\n", indent(text))),
            EntryBody::AssistantMessage {
                text,
                tool_calls,
                reasoning,
                ..
            } => {
                if !reasoning.is_empty() {
                    out.push_str(&thinking_marker(reasoning));
                }
                if !text.is_empty() {
                    out.push_str(&format!("agent  {}\n", indent(text)));
                }
                open.extend(tool_calls.iter().map(|call| {
                    (
                        call.id.clone(),
                        call.name.clone(),
                        skiff_agent::tools::summary(call),
                    )
                }));
            }
            EntryBody::ToolResult {
                call_id,
                name,
                content,
                is_error,
                images,
            } => {
                let summary = open
                    .iter()
                    .position(|(id, _, _)| id == call_id)
                    .map(|i| open.remove(i).2)
                    .unwrap_or_default();
                let view = view_result(name, content, *is_error, detail).with_images(images);
                let status = Status {
                    is_error: Some(*is_error),
                    note: view.note.as_deref(),
                    duration_ms: None,
                };
                out.push_str(&tool_row("▸", name, &summary, &status));
                push_body(&mut out, &view.body, detail);
            }
            EntryBody::Notice { text } => out.push_str(&format!("  ! {text}\n")),
            EntryBody::Compaction {
                summary,
                entries,
                tokens_before,
                ..
            } => {
                out.push_str(&format!(
                    "  ── conversation compacted: {entries} entries (≈{tokens_before} tokens) summarised ──\n  {}\n",
                    indent(summary)
                ));
            }
        }
    }
    flush_open(&mut out, &mut open);
    out
}

fn indent(text: &str) -> String {
    text.trim_end().replace('\n', "\n       ")
}

/// An approval event, on stderr like the other progress lines: a pending one says how to
/// decide it (a write shows its diff), a settled one how it ended.
fn show_approval(a: &skiff_protocol::approval::ApprovalView, detail: Detail) {
    use skiff_protocol::approval::{ApprovalKind, ApprovalState};
    let headline = crate::approvals::headline(a);
    match a.state {
        ApprovalState::Pending => {
            eprintln!(
                "approval needed: {} {headline} — skiff approve {} / skiff deny {} [--reason]",
                a.id, a.id, a.id
            );
            if let Some(reason) = &a.request_reason {
                eprintln!("  why: {reason}");
            }
            if matches!(a.kind, ApprovalKind::Write | ApprovalKind::Request) {
                let lines: Vec<&str> = a.subject.lines().collect();
                let shown = if detail.full {
                    lines.len()
                } else {
                    lines.len().min(40)
                };
                for line in &lines[..shown] {
                    eprintln!("  {}", printable(line));
                }
                if shown < lines.len() {
                    eprintln!(
                        "  … {} more lines (`skiff approvals --json` has all)",
                        lines.len() - shown
                    );
                }
            }
        }
        state => {
            let by = a
                .decided_by
                .as_deref()
                .map(|by| format!(" by {by}"))
                .unwrap_or_default();
            let why = a
                .reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            eprintln!("◦ approval {} {state}{by}{why}", a.id);
        }
    }
}

/// One budget line for people: `session ses_… 3100 of 3000 tokens · $0.0100 (exhausted)`;
/// the cost only when it is limited or not zero.
pub fn usage_line(line: &skiff_protocol::budget::UsageLine) -> String {
    let window = if line.window == "session" {
        String::new()
    } else {
        format!(" on {}", line.window)
    };
    let tokens = match line.tokens_limit {
        Some(limit) => format!("{} of {limit} tokens", line.tokens),
        None => format!("{} tokens", line.tokens),
    };
    let cost = match line.cost_usd_limit {
        Some(limit) => format!(" · ${:.4} of ${limit:.4}", line.cost_usd),
        None if line.cost_usd > 0.0 => format!(" · ${:.4}", line.cost_usd),
        None => String::new(),
    };
    let exhausted = if line.exhausted { " (exhausted)" } else { "" };
    format!(
        "{} {}{window}: {tokens}{cost}{exhausted}",
        line.subject.as_str(),
        line.id
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_the_cache_and_the_cost_only_when_known() {
        assert_eq!(tokens(120, 30, 0, 0, None), "in 120 / out 30 tokens");
        assert_eq!(
            tokens(5000, 80, 4000, 900, Some(0.00291)),
            "in 5000 (4000 read from cache, 900 written) / out 80 tokens · $0.0029"
        );
        assert_eq!(
            tokens(5000, 80, 4000, 0, Some(12.5)),
            "in 5000 (4000 read from cache) / out 80 tokens · $12.50"
        );
        assert_eq!(
            tokens(9, 1, 0, 9, None),
            "in 9 (9 written to cache) / out 1 tokens"
        );
    }

    const PLAIN: Detail = Detail {
        full: false,
        full_flag: true,
        dim: false,
    };

    fn numbered(range: std::ops::RangeInclusive<usize>) -> String {
        range.map(|n| format!("{n:>6}\tline {n}\n")).collect()
    }

    #[test]
    fn exec_shows_its_exit_code_and_the_last_lines_after_a_count_of_the_rest() {
        let output: String = (1..=30).map(|n| format!("line {n}\n")).collect();
        let content = format!("exit code: 1\n{output}assertion failed: x == 2\n\n");
        let view = view_result("exec", &content, true, PLAIN);
        assert_eq!(view.note.as_deref(), Some("exit 1"));
        assert_eq!(view.body.len(), TAIL_LINES + 1);
        assert_eq!(view.body[0], "… 21 earlier lines (--full shows all)");
        assert_eq!(view.body[1], "line 22");
        assert_eq!(view.body[10], "assertion failed: x == 2");

        let full = view_result(
            "exec",
            &content,
            true,
            Detail {
                full: true,
                ..PLAIN
            },
        );
        assert_eq!(full.body.len(), 31);
        assert_eq!(full.body[0], "line 1");

        let demo = view_result(
            "exec",
            &content,
            true,
            Detail {
                full_flag: false,
                ..PLAIN
            },
        );
        assert_eq!(demo.body[0], "… 21 earlier lines");
    }

    #[test]
    fn exec_without_output_or_exit_code() {
        let quiet = view_result("exec", "exit code: 0\n", false, PLAIN);
        assert_eq!(
            quiet,
            ResultView {
                note: Some("exit 0".into()),
                body: vec![]
            }
        );
        let timed_out = "timed out after 5 s; the command and everything it started were killed";
        let view = view_result("exec", timed_out, true, PLAIN);
        assert_eq!(
            view,
            ResultView {
                note: None,
                body: vec![timed_out.into()]
            }
        );
    }

    #[test]
    fn a_tool_error_is_shown_whole_up_to_a_bound() {
        let short = view_result("read", "cannot read a.txt: No such file", true, PLAIN);
        assert_eq!(short.body, ["cannot read a.txt: No such file"]);
        let long: String = (1..=50).map(|n| format!("reason {n}\n")).collect();
        let view = view_result("web_fetch", &long, true, PLAIN);
        assert_eq!(view.body.len(), ERROR_LINES + 1);
        assert_eq!(view.body[0], "reason 1");
        assert_eq!(view.body[ERROR_LINES], "… 10 more lines (--full shows all)");
        let full = view_result(
            "web_fetch",
            &long,
            true,
            Detail {
                full: true,
                ..PLAIN
            },
        );
        assert_eq!(full.body.len(), 50);
    }

    #[test]
    fn file_tools_collapse_to_one_line() {
        let note = |name: &str, content: &str| view_result(name, content, false, PLAIN).note;
        assert_eq!(note("read", &numbered(1..=1)).as_deref(), Some("1 line"));
        assert_eq!(note("read", &numbered(1..=12)).as_deref(), Some("12 lines"));
        let more = format!(
            "{}[… 300 more lines; read with offset=201 to continue]",
            numbered(1..=200)
        );
        assert_eq!(note("read", &more).as_deref(), Some("lines 1–200 of 500"));
        assert_eq!(
            note("read", &numbered(40..=80)).as_deref(),
            Some("lines 40–80")
        );
        assert_eq!(
            note("read", "(a.txt is empty)").as_deref(),
            Some("(a.txt is empty)")
        );
        assert_eq!(note("ls", "a/\nb.txt\nc@").as_deref(), Some("3 entries"));
        assert_eq!(
            note("ls", "a\nb\n[… 8 more entries]").as_deref(),
            Some("10 entries")
        );
        assert_eq!(
            note("ls", "(empty directory)").as_deref(),
            Some("(empty directory)")
        );
        assert_eq!(
            note("find", "src/a.rs\nsrc/b.rs").as_deref(),
            Some("2 files")
        );
        assert_eq!(
            note("find", "no files match *.go").as_deref(),
            Some("no files match *.go")
        );
        assert_eq!(
            note("grep", "a.rs:3: x\nb.rs:9: x\n").as_deref(),
            Some("2 matches")
        );
        assert_eq!(
            note("write", "wrote 1234 bytes to out.txt").as_deref(),
            Some("1234 bytes")
        );
        assert_eq!(
            note("edit", "applied 1 edit(s) to a.rs").as_deref(),
            Some("1 edit")
        );
        assert_eq!(
            view_result(
                "apply_patch",
                "applied the patch:\nA new.rs\nM src/lib.rs",
                false,
                PLAIN
            ),
            ResultView {
                note: Some("2 files".to_owned()),
                body: vec!["A new.rs".to_owned(), "M src/lib.rs".to_owned()],
            }
        );
        for name in ["read", "ls", "find", "grep", "write", "edit"] {
            assert!(
                view_result(name, &numbered(1..=30), false, PLAIN)
                    .body
                    .is_empty()
            );
        }
    }

    #[test]
    fn tool_output_cannot_drive_the_terminal() {
        assert_eq!(printable("\x1b[31mred\x1b[0m plain"), "red plain");
        assert_eq!(printable("\x1b]0;pwned title\x07after"), "after");
        assert_eq!(printable("\x1b]8;;http://x\x1b\\link"), "link");
        assert_eq!(printable("10%\r50%\r100%"), "100%");
        assert_eq!(printable("crlf\r"), "crlf");
        assert_eq!(printable("bell\x07 nul\0"), "bell\u{fffd} nul\u{fffd}");
        let long = "x".repeat(LINE_CHARS + 50);
        assert_eq!(shown_line(&long, PLAIN).chars().count(), LINE_CHARS + 2);
        assert_eq!(
            shown_line(
                &long,
                Detail {
                    full: true,
                    ..PLAIN
                }
            ),
            long
        );
    }

    #[test]
    fn rows_say_how_a_call_ended() {
        let status = Status {
            is_error: Some(true),
            note: Some("exit 1"),
            duration_ms: Some(1200),
        };
        assert_eq!(
            tool_row("▸", "exec", "make test", &status),
            "  ▸ exec make test  ✗ exit 1 · 1.2 s\n"
        );
        let status = Status {
            is_error: Some(false),
            note: None,
            duration_ms: None,
        };
        assert_eq!(tool_row("▸", "ls", ".", &status), "  ▸ ls .  ✓\n");
        assert_eq!(
            tool_row("▸", "ls", "", &Status::no_result()),
            "  ▸ ls  · no result\n"
        );
        let mut dimmed = String::new();
        push_body(
            &mut dimmed,
            &["out".to_owned()],
            Detail { dim: true, ..PLAIN },
        );
        assert_eq!(dimmed, "      \x1b[2mout\x1b[0m\n");
    }

    #[test]
    fn an_image_result_shows_its_size_and_kind_never_its_data() {
        use skiff_protocol::EntryId;
        use skiff_protocol::model::{StopReason, ToolCall, Usage};
        // The start of a 1280×720 PNG, as `read` encodes one.
        let data = "iVBORw0KGgoAAAANSUhEUgAABQAAAALQCAIAAAA=";
        let entry = |n: usize, body: EntryBody| TranscriptEntry {
            id: EntryId::from_suffix(&format!("e{n}")),
            parent_id: None,
            run_id: None,
            created_at_ms: 0,
            body,
        };
        let entries = [
            entry(
                0,
                EntryBody::AssistantMessage {
                    reasoning: Vec::new(),
                    text: "Looking at the screenshot.".into(),
                    tool_calls: vec![ToolCall {
                        id: "c1".into(),
                        name: "read".into(),
                        arguments: serde_json::json!({"path": "shot.png"}),
                    }],
                    model: "m".into(),
                    usage: Usage::default(),
                    stop_reason: StopReason::ToolUse,
                },
            ),
            entry(
                1,
                EntryBody::ToolResult {
                    call_id: "c1".into(),
                    name: "read".into(),
                    content: "image: shot.png, 1280×720 PNG, 84 KiB".into(),
                    is_error: false,
                    images: vec![Image {
                        media_type: "image/png".into(),
                        data_base64: data.into(),
                    }],
                },
            ),
        ];
        let shown = transcript(
            &entries,
            Detail {
                full: true,
                ..PLAIN
            },
        );
        assert_eq!(
            shown,
            "agent  Looking at the screenshot.\n  ▸ read shot.png  ✓ [image 1280×720 png]\n"
        );
        assert!(!shown.contains("iVBOR"));
    }
}
