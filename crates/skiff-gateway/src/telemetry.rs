//! What the gateway measures as it works, for `GET /metrics`: histograms of placement steps,
//! model calls, event-log writes and live-event fan-out, and counters of model calls and
//! tokens. Kept in memory since the process started (Prometheus computes rates), observed at
//! the few places every such event passes through: the hub (placement events, event appends,
//! followers) and the model streams of both placements.
//!
//! Every family is printed on every scrape, with its help and type even before its first
//! sample, so a dashboard's queries name series that exist from the start.
//!
//! Deliberately absent: session, run or environment ids as labels (unbounded, and ids are
//! the tenant's business), and anything a prompt or a reply said.

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use skiff_protocol::SessionId;
use skiff_protocol::environment::PlacementState;
use skiff_protocol::model::{ModelEvent, StopReason};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Upper bounds of the histograms' buckets, in seconds: from a millisecond (an event fanned
/// out, a row written) to five minutes (a cold box, a long model answer).
const BUCKETS: [f64; 15] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// One family of series: its name, help text and kind.
pub(crate) struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub histogram: bool,
}

pub(crate) const PLACEMENT_STEP: &str = "skiff_placement_step_seconds";
pub(crate) const MODEL_REQUEST: &str = "skiff_model_request_seconds";
pub(crate) const MODEL_FIRST_TOKEN: &str = "skiff_model_first_token_seconds";
pub(crate) const MODEL_REQUESTS: &str = "skiff_model_requests_total";
pub(crate) const MODEL_TOKENS: &str = "skiff_model_tokens_total";
pub(crate) const EVENT_APPEND: &str = "skiff_event_append_seconds";
pub(crate) const EVENT_FANOUT: &str = "skiff_event_fanout_lag_seconds";
pub(crate) const LEASE_RENEWALS: &str = "skiff_lease_renewals_total";
pub(crate) const LEASE_TAKEOVERS: &str = "skiff_lease_takeovers_total";
pub(crate) const LEASE_LOST: &str = "skiff_lease_lost_total";

/// Every family this module keeps, in the order `/metrics` prints them.
pub(crate) const FAMILIES: [Family; 10] = [
    Family {
        name: PLACEMENT_STEP,
        help: "Time a worker placement spent in each step (provisioning, syncing, setup, starting, reconciling, draining), by step.",
        histogram: true,
    },
    Family {
        name: MODEL_REQUEST,
        help: "Model calls from start to their last event, by placement (gateway or worker) and outcome.",
        histogram: true,
    },
    Family {
        name: MODEL_FIRST_TOKEN,
        help: "Model calls from start to their first streamed event, by placement.",
        histogram: true,
    },
    Family {
        name: MODEL_REQUESTS,
        help: "Model calls, by placement and outcome (ok, error, cancelled).",
        histogram: false,
    },
    Family {
        name: MODEL_TOKENS,
        help: "Tokens of model calls as the provider reported them, by placement and direction (input, output).",
        histogram: false,
    },
    Family {
        name: EVENT_APPEND,
        help: "Writing one live event to the session's event log in the database (SQL latency of the busiest write).",
        histogram: true,
    },
    Family {
        name: EVENT_FANOUT,
        help: "From a live event's write to its delivery to a follower's stream (millisecond resolution).",
        histogram: true,
    },
    Family {
        name: LEASE_RENEWALS,
        help: "Session leases this gateway renewed (each lease, each round of its lease loop).",
        histogram: false,
    },
    Family {
        name: LEASE_TAKEOVERS,
        help: "Sessions this gateway took over from a gateway that stopped renewing their lease.",
        histogram: false,
    },
    Family {
        name: LEASE_LOST,
        help: "Session leases this gateway lost to another gateway; their work here was stopped.",
        histogram: false,
    },
];

type Labels = Vec<(&'static str, String)>;

#[derive(Default)]
struct Histogram {
    /// Per bucket of [`BUCKETS`], not cumulative (made cumulative when printed).
    counts: [u64; BUCKETS.len()],
    /// Observations past the last bucket.
    over: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        match BUCKETS.iter().position(|bound| seconds <= *bound) {
            Some(i) => self.counts[i] += 1,
            None => self.over += 1,
        }
        self.sum += seconds;
    }

    fn count(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.over
    }
}

#[derive(Default)]
struct Series {
    histograms: BTreeMap<(&'static str, Labels), Histogram>,
    counters: BTreeMap<(&'static str, Labels), u64>,
}

/// The gateway's measurements since it started.
#[derive(Default)]
pub(crate) struct Telemetry {
    series: Mutex<Series>,
    /// Each placement's current step and since when, to time it when the next one comes.
    steps: Mutex<HashMap<SessionId, (PlacementState, Instant)>>,
    /// `[telemetry] otlp_endpoint`: spans of turns (disabled without one).
    pub(crate) traces: crate::traces::Traces,
}

impl Telemetry {
    /// Measurements that also export spans of turns.
    pub(crate) fn with_traces(traces: crate::traces::Traces) -> Telemetry {
        Telemetry {
            traces,
            ..Telemetry::default()
        }
    }

    fn series(&self) -> std::sync::MutexGuard<'_, Series> {
        self.series.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn observe(&self, family: &'static str, labels: Labels, took: Duration) {
        self.series()
            .histograms
            .entry((family, labels))
            .or_default()
            .observe(took.as_secs_f64());
    }

    pub(crate) fn add(&self, family: &'static str, labels: Labels, n: u64) {
        *self.series().counters.entry((family, labels)).or_default() += n;
    }

    /// A placement event: times the step it leaves. Resting states (local, active, parked,
    /// reclaimed, failed) are not steps: a session idles in them for as long as it likes.
    pub(crate) fn placement(&self, session: &SessionId, state: PlacementState) {
        let now = Instant::now();
        let mut steps = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        let left = if is_resting(state) {
            steps.remove(session)
        } else {
            steps.insert(session.clone(), (state, now))
        };
        drop(steps);
        if let Some((step, since)) = left
            && !is_resting(step)
            && step != state
        {
            self.observe(
                PLACEMENT_STEP,
                vec![("step", step.as_str().to_owned())],
                now - since,
            );
        }
    }

    /// Wraps a model call's stream so its duration, time to first event, outcome and tokens
    /// are counted under `placement` ("gateway" or "worker") when it ends.
    /// With `traced` (the session and model ref), the call is a span of the session's
    /// running turn too.
    pub(crate) fn model_stream(
        self: &std::sync::Arc<Self>,
        placement: &'static str,
        traced: Option<(SessionId, String)>,
        stream: BoxStream<'static, ModelEvent>,
    ) -> BoxStream<'static, ModelEvent> {
        let call = ModelCall {
            telemetry: self.clone(),
            placement,
            traced,
            started: Instant::now(),
            first: None,
            outcome: None,
            tokens: (0, 0),
        };
        stream
            .scan(call, |call, event| {
                call.saw(&event);
                futures_util::future::ready(Some(event))
            })
            .boxed()
    }

    /// The families in Prometheus' text format, histograms with cumulative buckets.
    pub(crate) fn render(&self, out: &mut String) {
        let series = self.series();
        for family in &FAMILIES {
            let kind = if family.histogram {
                "histogram"
            } else {
                "counter"
            };
            let _ = writeln!(
                out,
                "# HELP {0} {1}\n# TYPE {0} {kind}",
                family.name, family.help
            );
            if family.histogram {
                for ((_, labels), h) in of(&series.histograms, family.name) {
                    let mut cumulative = 0;
                    for (bound, n) in BUCKETS.iter().zip(h.counts) {
                        cumulative += n;
                        let le = format!("{bound}");
                        line(out, family.name, "_bucket", labels, Some(&le), cumulative);
                    }
                    line(out, family.name, "_bucket", labels, Some("+Inf"), h.count());
                    let _ = writeln!(
                        out,
                        "{}_sum{} {}",
                        family.name,
                        label_text(labels, None),
                        h.sum
                    );
                    line(out, family.name, "_count", labels, None, h.count());
                }
            } else {
                for ((_, labels), n) in of(&series.counters, family.name) {
                    line(out, family.name, "", labels, None, *n);
                }
            }
        }
        drop(series);
        self.traces.render(out);
    }
}

pub(crate) fn is_resting(state: PlacementState) -> bool {
    matches!(
        state,
        PlacementState::Local
            | PlacementState::Active
            | PlacementState::Parked
            | PlacementState::Reclaimed
            | PlacementState::Failed
    )
}

/// One family's series, in label order.
fn of<'a, V>(
    series: &'a BTreeMap<(&'static str, Labels), V>,
    family: &'static str,
) -> impl Iterator<Item = (&'a (&'static str, Labels), &'a V)> {
    series.iter().filter(move |((name, _), _)| *name == family)
}

fn line(out: &mut String, name: &str, suffix: &str, labels: &Labels, le: Option<&str>, n: u64) {
    let _ = writeln!(out, "{name}{suffix}{} {n}", label_text(labels, le));
}

fn label_text(labels: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", crate::metrics::escape(v)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// One model call as its stream goes by; counted once, when the stream ends or is dropped.
struct ModelCall {
    telemetry: std::sync::Arc<Telemetry>,
    placement: &'static str,
    traced: Option<(SessionId, String)>,
    started: Instant,
    first: Option<Instant>,
    outcome: Option<&'static str>,
    tokens: (u64, u64),
}

impl ModelCall {
    fn saw(&mut self, event: &ModelEvent) {
        self.first.get_or_insert_with(Instant::now);
        match event {
            ModelEvent::Usage { usage } => {
                self.tokens.0 += usage.input_tokens;
                self.tokens.1 += usage.output_tokens;
            }
            ModelEvent::Done { stop_reason } => {
                self.outcome = Some(if *stop_reason == StopReason::Cancelled {
                    "cancelled"
                } else {
                    "ok"
                });
            }
            ModelEvent::Error { .. } => self.outcome = Some("error"),
            _ => {}
        }
    }
}

impl Drop for ModelCall {
    fn drop(&mut self) {
        // A stream dropped before its end was abandoned by its caller: a cancel.
        let outcome = self.outcome.unwrap_or("cancelled");
        let placement = || ("placement", self.placement.to_owned());
        let t = &self.telemetry;
        if let Some((session, model)) = &self.traced {
            t.traces.model_call(
                session,
                model,
                self.placement,
                self.started.elapsed(),
                self.tokens,
                outcome,
            );
        }
        t.observe(
            MODEL_REQUEST,
            vec![placement(), ("outcome", outcome.to_owned())],
            self.started.elapsed(),
        );
        if let Some(first) = self.first {
            t.observe(MODEL_FIRST_TOKEN, vec![placement()], first - self.started);
        }
        t.add(
            MODEL_REQUESTS,
            vec![placement(), ("outcome", outcome.to_owned())],
            1,
        );
        for (direction, n) in [("input", self.tokens.0), ("output", self.tokens.1)] {
            if n > 0 {
                t.add(
                    MODEL_TOKENS,
                    vec![placement(), ("direction", direction.to_owned())],
                    n,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_prints_cumulative_buckets_a_sum_and_a_count() {
        let t = Telemetry::default();
        t.observe(EVENT_APPEND, vec![], Duration::from_micros(500));
        t.observe(EVENT_APPEND, vec![], Duration::from_millis(30));
        t.observe(EVENT_APPEND, vec![], Duration::from_secs(400));
        let mut out = String::new();
        t.render(&mut out);
        assert!(
            out.contains("skiff_event_append_seconds_bucket{le=\"0.001\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains("skiff_event_append_seconds_bucket{le=\"0.025\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains("skiff_event_append_seconds_bucket{le=\"0.05\"} 2\n"),
            "{out}"
        );
        assert!(
            out.contains("skiff_event_append_seconds_bucket{le=\"300\"} 2\n"),
            "{out}"
        );
        assert!(
            out.contains("skiff_event_append_seconds_bucket{le=\"+Inf\"} 3\n"),
            "{out}"
        );
        assert!(
            out.contains("skiff_event_append_seconds_count 3\n"),
            "{out}"
        );
        assert!(
            out.contains("skiff_event_append_seconds_sum 400.0305\n"),
            "{out}"
        );
    }

    #[test]
    fn a_placement_step_is_timed_when_the_next_one_comes_and_resting_states_are_not() {
        let t = Telemetry::default();
        let s = SessionId::from_suffix("a");
        for state in [
            PlacementState::Requested,
            PlacementState::Provisioning,
            PlacementState::Syncing,
            PlacementState::Starting,
            PlacementState::Active,
            PlacementState::Reconciling,
            PlacementState::Active,
        ] {
            t.placement(&s, state);
        }
        let mut out = String::new();
        t.render(&mut out);
        for step in [
            "requested",
            "provisioning",
            "syncing",
            "starting",
            "reconciling",
        ] {
            assert!(
                out.contains(&format!(
                    "skiff_placement_step_seconds_count{{step=\"{step}\"}} 1\n"
                )),
                "{step}: {out}"
            );
        }
        assert!(!out.contains("step=\"active\""), "{out}");
        assert!(
            t.steps.lock().unwrap().is_empty(),
            "a resting session is forgotten"
        );
    }

    #[tokio::test]
    async fn a_model_stream_counts_its_outcome_and_tokens_once() {
        let t = std::sync::Arc::new(Telemetry::default());
        let events = vec![
            ModelEvent::TextDelta { text: "hi".into() },
            ModelEvent::Usage {
                usage: skiff_protocol::model::Usage {
                    input_tokens: 120,
                    output_tokens: 7,
                    ..Default::default()
                },
            },
            ModelEvent::Done {
                stop_reason: StopReason::EndTurn,
            },
        ];
        let stream = t.model_stream("worker", None, futures_util::stream::iter(events).boxed());
        assert_eq!(stream.collect::<Vec<_>>().await.len(), 3);
        let mut out = String::new();
        t.render(&mut out);
        assert!(
            out.contains("skiff_model_requests_total{placement=\"worker\",outcome=\"ok\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains(
                "skiff_model_tokens_total{placement=\"worker\",direction=\"input\"} 120\n"
            ),
            "{out}"
        );
        assert!(
            out.contains("skiff_model_first_token_seconds_count{placement=\"worker\"} 1\n"),
            "{out}"
        );
    }

    #[tokio::test]
    async fn a_model_stream_dropped_before_its_end_counts_as_cancelled() {
        let t = std::sync::Arc::new(Telemetry::default());
        let mut stream = t.model_stream(
            "gateway",
            None,
            futures_util::stream::iter(vec![ModelEvent::TextDelta { text: "a".into() }])
                .chain(futures_util::stream::pending())
                .boxed(),
        );
        stream.next().await;
        drop(stream);
        let mut out = String::new();
        t.render(&mut out);
        assert!(
            out.contains(
                "skiff_model_requests_total{placement=\"gateway\",outcome=\"cancelled\"} 1\n"
            ),
            "{out}"
        );
    }
}
