//! Showing a session to a person: live events as they stream (text to stdout, a spinner on
//! stderr while the model thinks), session lists and transcripts.

use indicatif::{ProgressBar, ProgressStyle};
use skiff_protocol::api::{RunStatus, SessionView};
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use std::io::IsTerminal;
use std::time::Duration;

/// Renders a live event stream.
pub struct Live {
    json: bool,
    spinner: Option<ProgressBar>,
    /// Whether the cursor is mid-line on stdout (text was streamed without a newline).
    mid_line: bool,
    /// The tool rows waiting for their finish event: (call_id, "name summary").
    pending_tools: Vec<(String, String)>,
}

impl Live {
    pub fn new(json: bool) -> Self {
        Self {
            json,
            spinner: None,
            mid_line: false,
            pending_tools: Vec::new(),
        }
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

    /// Shows one event. Fails only when stdout cannot be written (its reader went away).
    pub fn show(&mut self, event: &SessionEvent) -> anyhow::Result<()> {
        if self.json {
            if let Ok(line) = serde_json::to_string(event) {
                outln!("{line}")?;
            }
            return Ok(());
        }
        match &event.kind {
            EventKind::ModelRequest { model } => self.spin(format!("thinking ({model})")),
            EventKind::TextDelta { text } => {
                self.stop_spinner();
                out!("{text}")?;
                self.mid_line = !text.ends_with('\n');
            }
            EventKind::ToolStarted {
                call_id,
                name,
                summary,
            } => {
                self.line_break()?;
                let row = format!("{name} {summary}");
                self.spin(format!("running {row}"));
                self.pending_tools.push((call_id.clone(), row));
            }
            EventKind::ToolFinished {
                call_id,
                is_error,
                duration_ms,
                ..
            } => {
                self.stop_spinner();
                let row = self
                    .pending_tools
                    .iter()
                    .position(|(id, _)| id == call_id)
                    .map(|i| self.pending_tools.remove(i).1)
                    .unwrap_or_default();
                let mark = if *is_error { "✗" } else { "✓" };
                outln!("  ▸ {row}  {mark} {}", format_duration(*duration_ms))?;
            }
            EventKind::Entry { entry } => {
                if let EntryBody::Notice { text } = &entry.body {
                    self.stop_spinner();
                    self.line_break()?;
                    eprintln!("! {text}");
                }
            }
            EventKind::RunStatus { status, error } if status.is_terminal() => {
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
                self.stop_spinner();
                self.line_break()?;
                eprintln!("◦ {:<13}{detail}", state.as_str());
            }
        }
        Ok(())
    }

    pub fn finish(&mut self) -> anyhow::Result<()> {
        self.stop_spinner();
        self.line_break()
    }
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

pub fn session_table(sessions: &[SessionView]) -> String {
    if sessions.is_empty() {
        return "no sessions yet; start one with `skiff session new \"PROMPT\"`\n".to_owned();
    }
    let now = now_ms();
    let rows: Vec<[String; 6]> = sessions
        .iter()
        .map(|s| {
            [
                s.id.to_string(),
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
                s.title.clone(),
            ]
        })
        .collect();
    table(
        &["ID", "STATE", "PLACEMENT", "MODEL", "UPDATED", "TITLE"],
        &rows,
    )
}

fn table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
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

/// A transcript as a person reads it.
pub fn transcript(entries: &[TranscriptEntry]) -> String {
    let mut out = String::new();
    for entry in entries {
        match &entry.body {
            EntryBody::UserMessage { text } => out.push_str(&format!("you    {}\n", indent(text))),
            EntryBody::AssistantMessage {
                text, tool_calls, ..
            } => {
                if !text.is_empty() {
                    out.push_str(&format!("agent  {}\n", indent(text)));
                }
                for call in tool_calls {
                    let args = serde_json::to_string(&call.arguments).unwrap_or_default();
                    let args: String = args.chars().take(100).collect();
                    out.push_str(&format!("  ▸ {} {args}\n", call.name));
                }
            }
            EntryBody::ToolResult {
                name,
                content,
                is_error,
                ..
            } => {
                let first = content.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                let first = first.split_whitespace().collect::<Vec<_>>().join(" ");
                let mark = if *is_error { "✗" } else { "✓" };
                out.push_str(&format!("    {mark} {name}: {first}\n"));
            }
            EntryBody::Notice { text } => out.push_str(&format!("  ! {text}\n")),
            EntryBody::Compaction { summary } => {
                out.push_str(&format!("  (compacted) {}\n", indent(summary)))
            }
        }
    }
    out
}

fn indent(text: &str) -> String {
    text.trim_end().replace('\n', "\n       ")
}
