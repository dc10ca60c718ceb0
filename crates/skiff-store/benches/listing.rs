//! Session-list figures (printed, never asserted), on a store of 10,000 sessions with a run
//! each: the newest page (`session_page`, one query) and the whole list read page by page,
//! against the baseline of the same run — the list as it was read before pages, every session
//! then its runs and its placement (two queries per session).
//!
//! `cargo bench -p skiff-store --bench listing`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use skiff_protocol::SessionId;
use skiff_protocol::api::WorkspaceView;
use skiff_store::{NewSession, Scope, Store};
use std::time::{Duration, Instant};

const SESSIONS: usize = 10_000;
const PAGE: usize = 100;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn timed(rounds: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .collect();
    times.sort();
    (percentile(&times, 0.5), percentile(&times, 0.99))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("bench.db")).unwrap();
    let scope = Scope::new("usr_bench", "ten_bench");
    for n in 0..SESSIONS {
        let id = SessionId::from_suffix(&skiff_store::mint().unwrap());
        store
            .create_session(
                &scope,
                &NewSession {
                    id: id.clone(),
                    title: format!("session {n}"),
                    workspace: WorkspaceView::Plain {
                        source: "/s".into(),
                        path: "/p".into(),
                    },
                    model_ref: "scripted/demo".into(),
                },
            )
            .unwrap();
        store.create_run(&scope, &id, "scripted/demo").unwrap();
    }

    let sight = skiff_store::Sight::own(scope.clone());
    let page = timed(200, || {
        assert_eq!(store.session_page(&sight, PAGE, None).unwrap().len(), PAGE);
    });
    let paged_all = timed(10, || {
        let mut after: Option<SessionId> = None;
        let mut seen = 0;
        loop {
            let rows = store.session_page(&sight, PAGE, after.as_ref()).unwrap();
            seen += rows.len();
            match rows.last() {
                Some(last) if rows.len() == PAGE => after = Some(last.session.id.clone()),
                _ => break,
            }
        }
        assert_eq!(seen, SESSIONS);
    });
    let baseline_all = timed(10, || {
        let sessions = store.sessions(&scope).unwrap();
        for s in &sessions {
            let _ = store.runs(&scope, &s.id).unwrap().pop();
            let _ = store.placement(&scope, &s.id).unwrap();
        }
        assert_eq!(sessions.len(), SESSIONS);
    });

    println!("session list, {SESSIONS} sessions with a run each (SQLite, WAL):");
    println!(
        "  newest page of {PAGE} (one query):          p50 {:8.2} ms   p99 {:8.2} ms",
        ms(page.0),
        ms(page.1)
    );
    println!(
        "  every session, {} pages:                 p50 {:8.2} ms   p99 {:8.2} ms",
        SESSIONS / PAGE,
        ms(paged_all.0),
        ms(paged_all.1)
    );
    println!(
        "  baseline: every session, 2 queries each:  p50 {:8.2} ms   p99 {:8.2} ms",
        ms(baseline_all.0),
        ms(baseline_all.1)
    );
    println!(
        "  ratios (p50): newest page / baseline {:.4}   paged whole list / baseline {:.3}",
        ms(page.0) / ms(baseline_all.0),
        ms(paged_all.0) / ms(baseline_all.0)
    );
}
