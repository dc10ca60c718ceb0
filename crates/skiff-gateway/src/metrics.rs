//! The operator's endpoints: `GET /healthz` (the process answers), `GET /readyz` (and its
//! database does), both without a token for load balancers and orchestrators; and
//! `GET /metrics`, in Prometheus' text format, behind the admin token: gauges read from the
//! store and the live worker table at scrape time, then what the gateway measured as it
//! worked (`telemetry.rs`: placement steps, model calls and tokens, event writes and fan-out).
//! `ops/grafana/skiff.json` is a dashboard of them.
//!
//! Deliberately absent for now: traces, and lease renewals (one gateway per database).

use crate::Core;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::fmt::Write as _;
use std::sync::Arc;

pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

pub(crate) async fn readyz(State(core): State<Arc<Core>>) -> Response {
    // Load balancers stop sending here; what still arrives is forwarded (`drain.rs`).
    if core.cluster.is_draining() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "draining: this gateway is handing its sessions to the others and exits\n",
        )
            .into_response();
    }
    if !core.cluster.lease_loop_healthy() {
        tracing::error!(lease_ttl = ?core.cluster.lease_ttl(), "readiness check failed: the lease loop has not finished a round within the lease's life");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the gateway has not renewed its session leases within [gateway] lease_ttl (see the gateway's log)\n",
        )
            .into_response();
    }
    match core.store.ready() {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => {
            // The database's own words stay in the log: this route answers anyone.
            tracing::error!(error = %e, "readiness check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: the gateway's database does not answer (see the gateway's log)\n",
            )
                .into_response()
        }
    }
}

pub(crate) async fn metrics(State(core): State<Arc<Core>>) -> crate::error::Result<Response> {
    let gauges = core.store.gauges()?;
    let mut out = Text::default();
    out.family("skiff_build_info", "The gateway's version.", "gauge");
    out.sample(
        "skiff_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1,
    );
    out.family("skiff_sessions", "Sessions by placement.", "gauge");
    for (placement, n) in &gauges.sessions {
        out.sample("skiff_sessions", &[("placement", placement)], *n);
    }
    out.family("skiff_runs", "Runs (turns) by status.", "gauge");
    for (status, n) in &gauges.runs {
        out.sample("skiff_runs", &[("status", status)], *n);
    }
    out.family(
        "skiff_environments",
        "Environments (boxes) by state and provider.",
        "gauge",
    );
    for (state, provider, n) in &gauges.environments {
        out.sample(
            "skiff_environments",
            &[("state", state), ("provider", provider)],
            *n,
        );
    }
    out.family(
        "skiff_workers_connected",
        "Workers connected to this gateway now.",
        "gauge",
    );
    out.sample("skiff_workers_connected", &[], core.workers.connected());
    out.family(
        "skiff_workers_max",
        "How many worker sessions may hold a box at once ([gateway] max_workers).",
        "gauge",
    );
    out.sample("skiff_workers_max", &[], core.workers.max_workers);
    let e = &gauges.egress;
    for (name, help, value) in [
        (
            "skiff_box_model_requests_total",
            "Model requests boxes made through the gateway.",
            e.model_requests,
        ),
        (
            "skiff_box_input_tokens_total",
            "Input tokens of boxes' model requests.",
            e.input_tokens,
        ),
        (
            "skiff_box_output_tokens_total",
            "Output tokens of boxes' model requests.",
            e.output_tokens,
        ),
        (
            "skiff_box_bytes_in_total",
            "Bytes boxes sent through the gateway.",
            e.bytes_in,
        ),
        (
            "skiff_box_bytes_out_total",
            "Bytes the gateway sent to boxes.",
            e.bytes_out,
        ),
        (
            "skiff_box_gateway_tool_calls_total",
            "Gateway-resident tool calls boxes made.",
            e.gateway_tool_calls,
        ),
    ] {
        out.family(name, help, "counter");
        out.sample(name, &[], value);
    }
    core.telemetry.render(&mut out.0);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out.0,
    )
        .into_response())
}

/// Prometheus' text exposition format.
#[derive(Default)]
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: u64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            let labels: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = write!(self.0, "{{{}}}", labels.join(","));
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// A label value as the format wants it: backslash, double quote and newline escaped.
pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn label_values_are_escaped() {
        assert_eq!(super::escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
