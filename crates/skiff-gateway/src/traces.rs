//! Optional OpenTelemetry traces of turns (`[telemetry] otlp_endpoint`), exported over
//! OTLP/HTTP as JSON (`ExportTraceServiceRequest` to `POST {endpoint}/v1/traces`) by hand over
//! reqwest and serde, without the OpenTelemetry crates.
//!
//! A turn is one trace: its root span is the run (`skiff.turn`, from its first status to its
//! terminal one), and under it each model request (`skiff.model_request`: provider, model,
//! tokens, placement), each tool call (`skiff.tool_call`: the tool's name only, never its
//! arguments or output) and each placement step (`skiff.placement.<step>`). Spans are made
//! from what every turn's work passes through on the gateway, whichever side runs the loop: the
//! hub's events (run statuses, tool lifecycle events — a worker's come through its ops —,
//! placement moves) and the model streams of both placements (the local loop's and the
//! inference proxy's, which carries a worker's model calls). So a worker's side of a turn is in
//! the same trace without a trace id crossing the worker protocol.
//!
//! Finished spans go into a bounded queue (`QUEUE` spans; when it is full a span is dropped
//! and counted) that one background task drains in batches: nothing on a turn's path waits on
//! the collector. `/metrics` prints spans exported, dropped and failed exports.

use serde_json::{Value, json};
use skiff_protocol::api::RunStatus;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Spans waiting for export at most; past it new ones are dropped (and counted).
const QUEUE: usize = 4096;
/// Spans in one export request at most.
const BATCH: usize = 512;
/// How long a batch waits for more spans after its first.
const LINGER: Duration = Duration::from_millis(200);

/// A span attribute's value.
#[derive(Clone, Debug)]
enum Attr {
    Str(String),
    Int(i64),
    Bool(bool),
}

/// A finished span.
#[derive(Clone, Debug)]
struct Span {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    name: String,
    start_ns: u64,
    end_ns: u64,
    attributes: Vec<(&'static str, Attr)>,
    /// An error's message, when the span failed.
    error: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn random<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    if getrandom::fill(&mut bytes).is_err() {
        // No randomness from the OS: ids from the clock and a counter, unique in this process.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let seed = format!("{}:{}", now_ns(), NEXT.fetch_add(1, Ordering::Relaxed));
        let hash = blake3::hash(seed.as_bytes());
        bytes.copy_from_slice(&hash.as_bytes()[..N]);
    }
    bytes
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default()
}

impl Span {
    fn to_json(&self) -> Value {
        let attributes: Vec<Value> = self
            .attributes
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    Attr::Str(s) => json!({ "stringValue": s }),
                    Attr::Int(n) => json!({ "intValue": n.to_string() }),
                    Attr::Bool(b) => json!({ "boolValue": b }),
                };
                json!({ "key": key, "value": value })
            })
            .collect();
        let mut span = json!({
            "traceId": hex(&self.trace_id),
            "spanId": hex(&self.span_id),
            "name": self.name,
            // SPAN_KIND_INTERNAL
            "kind": 1,
            "startTimeUnixNano": self.start_ns.to_string(),
            "endTimeUnixNano": self.end_ns.max(self.start_ns).to_string(),
            "attributes": attributes,
            "status": match &self.error {
                // STATUS_CODE_ERROR
                Some(message) => json!({ "code": 2, "message": message }),
                // STATUS_CODE_OK
                None => json!({ "code": 1 }),
            },
        });
        if let Some(parent) = &self.parent {
            span["parentSpanId"] = json!(hex(parent));
        }
        span
    }
}

/// The body of one export: `ExportTraceServiceRequest` in OTLP's JSON encoding.
fn export_body(service: &str, spans: &[Span]) -> Value {
    json!({
        "resourceSpans": [{
            "resource": {
                "attributes": [
                    { "key": "service.name", "value": { "stringValue": service } },
                    { "key": "service.version", "value": { "stringValue": env!("CARGO_PKG_VERSION") } },
                ]
            },
            "scopeSpans": [{
                "scope": { "name": "skiff-gateway", "version": env!("CARGO_PKG_VERSION") },
                "spans": spans.iter().map(Span::to_json).collect::<Vec<_>>(),
            }]
        }]
    })
}

/// A turn's trace while it runs.
struct RunTrace {
    run: RunId,
    trace_id: [u8; 16],
    root: [u8; 8],
    start_ns: u64,
    /// The placement step under way: its state, start and span id.
    step: Option<(PlacementState, u64)>,
    /// Tool calls started and not yet finished, by call id: name and start.
    tools: HashMap<String, (String, u64)>,
}

/// The counters `/metrics` prints.
#[derive(Default)]
struct Counts {
    exported: AtomicU64,
    dropped: AtomicU64,
    failed_exports: AtomicU64,
}

/// Traces of turns; without an endpoint, every call returns at once.
#[derive(Default)]
pub(crate) struct Traces {
    queue: Option<tokio::sync::mpsc::Sender<Span>>,
    runs: Mutex<HashMap<SessionId, RunTrace>>,
    counts: std::sync::Arc<Counts>,
}

/// Why `[telemetry]` cannot be used.
pub(crate) fn endpoint_url(endpoint: &str) -> Result<String, String> {
    let trimmed = endpoint.trim_end_matches('/');
    if !(trimmed.starts_with("http://") || trimmed.starts_with("https://"))
        || trimmed.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "at `telemetry.otlp_endpoint`: \"{endpoint}\" is not an http:// or https:// URL like \"http://127.0.0.1:4318\""
        ));
    }
    Ok(if trimmed.ends_with("/v1/traces") {
        trimmed.to_owned()
    } else {
        format!("{trimmed}/v1/traces")
    })
}

impl Traces {
    /// Exports to `endpoint` (checked with [`endpoint_url`]) from a background task.
    pub(crate) fn exporting(url: String, service: String) -> Traces {
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
        let counts = std::sync::Arc::new(Counts::default());
        tokio::spawn(export_loop(rx, url, service, counts.clone()));
        Traces {
            queue: Some(tx),
            runs: Mutex::default(),
            counts,
        }
    }

    fn enabled(&self) -> bool {
        self.queue.is_some()
    }

    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, RunTrace>> {
        self.runs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands a finished span to the exporter; never waits.
    fn emit(&self, span: Span) {
        if let Some(queue) = &self.queue
            && queue.try_send(span).is_err()
        {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A child span of `trace`'s root.
    fn child(
        trace: &RunTrace,
        name: String,
        start_ns: u64,
        end_ns: u64,
        attributes: Vec<(&'static str, Attr)>,
        error: Option<String>,
    ) -> Span {
        Span {
            trace_id: trace.trace_id,
            span_id: random(),
            parent: Some(trace.root),
            name,
            start_ns,
            end_ns,
            attributes,
            error,
        }
    }

    /// An event the hub published: starts or ends a turn's trace, a tool call's or a
    /// placement step's span.
    pub(crate) fn event(&self, event: &SessionEvent) {
        if !self.enabled() {
            return;
        }
        let now = now_ns();
        let session = &event.session_id;
        let mut out = Vec::new();
        {
            let mut runs = self.runs();
            match &event.kind {
                EventKind::RunStatus { status, error } => {
                    let Some(run) = &event.run_id else { return };
                    if !status.is_terminal() {
                        if runs.get(session).is_none_or(|t| &t.run != run) {
                            runs.insert(
                                session.clone(),
                                RunTrace {
                                    run: run.clone(),
                                    trace_id: random(),
                                    root: random(),
                                    start_ns: now,
                                    step: None,
                                    tools: HashMap::new(),
                                },
                            );
                        }
                        return;
                    }
                    let Some(trace) = runs.remove(session).filter(|t| &t.run == run) else {
                        return;
                    };
                    for (name, start) in trace.tools.values() {
                        out.push(Self::child(
                            &trace,
                            "skiff.tool_call".into(),
                            *start,
                            now,
                            vec![("tool.name", Attr::Str(name.clone()))],
                            Some("the turn ended before the call finished".into()),
                        ));
                    }
                    if let Some((step, start)) = trace.step {
                        out.push(step_span(&trace, step, start, now));
                    }
                    out.push(Span {
                        trace_id: trace.trace_id,
                        span_id: trace.root,
                        parent: None,
                        name: "skiff.turn".into(),
                        start_ns: trace.start_ns,
                        end_ns: now,
                        attributes: vec![
                            ("skiff.session_id", Attr::Str(session.to_string())),
                            ("skiff.run_id", Attr::Str(run.to_string())),
                            ("skiff.run.status", Attr::Str(status.as_str().to_owned())),
                        ],
                        error: (*status != RunStatus::Succeeded).then(|| {
                            error
                                .clone()
                                .unwrap_or_else(|| format!("the run ended {status}"))
                        }),
                    });
                }
                EventKind::ToolStarted { call_id, name, .. } => {
                    if let Some(trace) = runs.get_mut(session) {
                        trace.tools.insert(call_id.clone(), (name.clone(), now));
                    }
                }
                EventKind::ToolFinished {
                    call_id,
                    name,
                    is_error,
                    duration_ms,
                } => {
                    if let Some(trace) = runs.get_mut(session) {
                        let start = trace
                            .tools
                            .remove(call_id)
                            .map(|(_, start)| start)
                            .unwrap_or_else(|| now.saturating_sub(duration_ms * 1_000_000));
                        out.push(Self::child(
                            trace,
                            "skiff.tool_call".into(),
                            start,
                            now,
                            vec![
                                ("tool.name", Attr::Str(name.clone())),
                                ("skiff.tool.is_error", Attr::Bool(*is_error)),
                            ],
                            None,
                        ));
                    }
                }
                EventKind::Placement { state, .. } => {
                    if let Some(trace) = runs.get_mut(session) {
                        if let Some((step, start)) = trace.step.take() {
                            if step == *state {
                                trace.step = Some((step, start));
                                return;
                            }
                            out.push(step_span(trace, step, start, now));
                        }
                        if !crate::telemetry::is_resting(*state) {
                            trace.step = Some((*state, now));
                        }
                    }
                }
                _ => return,
            }
        }
        for span in out {
            self.emit(span);
        }
    }

    /// A model call of `session`'s running turn ended (or was dropped).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn model_call(
        &self,
        session: &SessionId,
        model: &str,
        placement: &'static str,
        took: Duration,
        tokens: (u64, u64),
        outcome: &'static str,
    ) {
        if !self.enabled() {
            return;
        }
        let end = now_ns();
        let start = end.saturating_sub(took.as_nanos() as u64);
        let span = {
            let runs = self.runs();
            let Some(trace) = runs.get(session) else {
                return;
            };
            let (provider, model_id) = model.split_once('/').unwrap_or(("", model));
            Self::child(
                trace,
                "skiff.model_request".into(),
                start,
                end,
                vec![
                    ("gen_ai.system", Attr::Str(provider.to_owned())),
                    ("gen_ai.request.model", Attr::Str(model_id.to_owned())),
                    ("gen_ai.usage.input_tokens", Attr::Int(tokens.0 as i64)),
                    ("gen_ai.usage.output_tokens", Attr::Int(tokens.1 as i64)),
                    ("skiff.placement", Attr::Str(placement.to_owned())),
                    ("skiff.model.outcome", Attr::Str(outcome.to_owned())),
                ],
                (outcome == "error").then(|| "the model call failed".to_owned()),
            )
        };
        self.emit(span);
    }

    /// The exporter's counters in Prometheus' text format.
    pub(crate) fn render(&self, out: &mut String) {
        for (name, help, n) in [
            (
                "skiff_trace_spans_exported_total",
                "Spans the OTLP exporter delivered to the collector.",
                &self.counts.exported,
            ),
            (
                "skiff_trace_spans_dropped_total",
                "Spans dropped because the export queue was full or the collector refused them.",
                &self.counts.dropped,
            ),
            (
                "skiff_trace_export_failures_total",
                "OTLP export requests that failed (their spans are dropped).",
                &self.counts.failed_exports,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }
}

fn step_span(trace: &RunTrace, step: PlacementState, start: u64, end: u64) -> Span {
    Traces::child(
        trace,
        format!("skiff.placement.{}", step.as_str()),
        start,
        end,
        vec![("skiff.placement.step", Attr::Str(step.as_str().to_owned()))],
        None,
    )
}

/// Drains the queue in batches (the first span, then whatever comes within [`LINGER`], up to
/// [`BATCH`]) and posts each; a failed post drops its batch, counted.
async fn export_loop(
    mut rx: tokio::sync::mpsc::Receiver<Span>,
    url: String,
    service: String,
    counts: std::sync::Arc<Counts>,
) {
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .build()
    {
        Ok(client) => client,
        Err(e) => {
            tracing::warn!(error = %e, "traces: cannot build the OTLP client; no traces will be exported");
            return;
        }
    };
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + LINGER;
        while batch.len() < BATCH {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(span)) => batch.push(span),
                Ok(None) | Err(_) => break,
            }
        }
        let body = export_body(&service, &batch);
        let sent = client.post(&url).json(&body).send().await;
        match sent {
            Ok(resp) if resp.status().is_success() => {
                counts
                    .exported
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
            Ok(resp) => {
                counts.failed_exports.fetch_add(1, Ordering::Relaxed);
                counts
                    .dropped
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                tracing::warn!(status = %resp.status(), spans = batch.len(), "traces: the collector refused a batch");
            }
            Err(e) => {
                counts.failed_exports.fetch_add(1, Ordering::Relaxed);
                counts
                    .dropped
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                tracing::warn!(error = %e, spans = batch.len(), "traces: cannot reach the collector");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(session: &SessionId, run: &RunId, kind: EventKind) -> SessionEvent {
        SessionEvent {
            session_id: session.clone(),
            cursor: 1,
            at_ms: 0,
            run_id: Some(run.clone()),
            kind,
        }
    }

    fn queued(capacity: usize) -> (Traces, tokio::sync::mpsc::Receiver<Span>) {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity);
        let traces = Traces {
            queue: Some(tx),
            ..Traces::default()
        };
        (traces, rx)
    }

    /// A worker turn as the gateway sees it: placement moves, the inference proxy's model
    /// call and the worker's tool events all land under the run's root.
    #[test]
    fn a_worker_turn_has_its_placement_steps_model_call_and_tool_call_under_the_run() {
        let (traces, mut rx) = queued(64);
        let session = SessionId::from_suffix("tracetest0001");
        let run = RunId::from_suffix("tracetest0001");
        let status = |status| EventKind::RunStatus {
            status,
            error: None,
        };
        let placement = |state| EventKind::Placement {
            state,
            environment_id: None,
            detail: String::new(),
        };
        for kind in [
            status(RunStatus::Queued),
            status(RunStatus::Running),
            placement(PlacementState::Requested),
            placement(PlacementState::Provisioning),
            placement(PlacementState::Syncing),
            placement(PlacementState::Starting),
            placement(PlacementState::Active),
            EventKind::ToolStarted {
                call_id: "c1".into(),
                name: "exec".into(),
                summary: "cargo test --secret-flag".into(),
            },
            EventKind::ToolFinished {
                call_id: "c1".into(),
                name: "exec".into(),
                is_error: false,
                duration_ms: 5,
            },
        ] {
            traces.event(&event(&session, &run, kind));
        }
        traces.model_call(
            &session,
            "openai/gpt-x",
            "worker",
            Duration::from_millis(3),
            (10, 2),
            "ok",
        );
        traces.event(&event(&session, &run, status(RunStatus::Succeeded)));
        let mut spans = Vec::new();
        while let Ok(span) = rx.try_recv() {
            spans.push(span);
        }
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "skiff.placement.requested",
                "skiff.placement.provisioning",
                "skiff.placement.syncing",
                "skiff.placement.starting",
                "skiff.tool_call",
                "skiff.model_request",
                "skiff.turn",
            ]
        );
        let root = spans.last().unwrap();
        assert!(root.parent.is_none());
        for span in &spans[..spans.len() - 1] {
            assert_eq!(span.trace_id, root.trace_id);
            assert_eq!(span.parent, Some(root.span_id));
        }
        let json = serde_json::to_string(&export_body("s", &spans)).unwrap();
        assert!(!json.contains("secret-flag"), "a tool's arguments stay out");
        assert!(json.contains(r#""stringValue":"worker""#), "{json}");
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let (traces, _rx) = queued(1);
        let session = SessionId::from_suffix("tracetest0002");
        let run = RunId::from_suffix("tracetest0002");
        traces.event(&event(
            &session,
            &run,
            EventKind::RunStatus {
                status: RunStatus::Running,
                error: None,
            },
        ));
        for _ in 0..3 {
            traces.model_call(&session, "p/m", "gateway", Duration::ZERO, (0, 0), "ok");
        }
        assert_eq!(traces.counts.dropped.load(Ordering::Relaxed), 2);
        let mut text = String::new();
        traces.render(&mut text);
        assert!(text.contains("skiff_trace_spans_dropped_total 2"), "{text}");
    }

    #[test]
    fn an_endpoint_gets_the_traces_path_once() {
        assert_eq!(
            endpoint_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            endpoint_url("http://c:4318/v1/traces/").unwrap(),
            "http://c:4318/v1/traces"
        );
        assert!(endpoint_url("127.0.0.1:4318").is_err());
    }

    #[test]
    fn ids_are_lowercase_hex_of_their_otlp_width() {
        let span = Span {
            trace_id: random(),
            span_id: random(),
            parent: None,
            name: "x".into(),
            start_ns: 5,
            end_ns: 7,
            attributes: vec![("n", Attr::Int(3))],
            error: None,
        };
        let json = span.to_json();
        assert_eq!(json["traceId"].as_str().unwrap().len(), 32);
        assert_eq!(json["spanId"].as_str().unwrap().len(), 16);
        assert_eq!(json["startTimeUnixNano"], "5");
        assert_eq!(json["attributes"][0]["value"]["intValue"], "3");
        assert!(json.get("parentSpanId").is_none());
    }
}
