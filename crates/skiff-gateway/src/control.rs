//! Control across gateways (issue 17): a cancel or an approval decided through one gateway
//! reaches the turn another gateway runs.
//!
//! Both are written to the store first — the run's `cancelling` status, the approval's settled
//! row — and announced as the session's events. The gateway running the turn follows the
//! session's events through the hub (which carries every gateway's, woken by the store and
//! read by cursor) and acts on what it sees; a cancel recorded before it began to follow is
//! read from the run's status, so nothing falls between. A decision made on the gateway that
//! waits still wakes its call in-process first (the fast path); the event is the same
//! decision arriving a moment later.

use crate::Core;
use crate::hub::Hub;
use futures_util::StreamExt;
use skiff_protocol::api::RunStatus;
use skiff_protocol::approval::ApprovalState;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{ApprovalId, RunId, SessionId};
use skiff_store::Scope;
use std::sync::Arc;
use tokio_util::sync::{CancellationToken, DropGuard};

impl Hub {
    /// The first event of `session` after `cursor` that `wanted` picks, whichever gateway
    /// appended it; `None` when the stream ends or cannot be read.
    pub(crate) async fn first_event(
        self: &Arc<Self>,
        scope: Scope,
        session: SessionId,
        cursor: u64,
        mut wanted: impl FnMut(&SessionEvent) -> bool,
    ) -> Option<Arc<SessionEvent>> {
        let stream = match self.subscribe(scope, session.clone(), cursor) {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(%session, error = %e, "cannot follow the session's events");
                return None;
            }
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(next) = stream.next().await {
            match next {
                Ok(event) if wanted(&event) => return Some(event),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(%session, error = %e, "cannot follow the session's events");
                    return None;
                }
            }
        }
        None
    }
}

impl Core {
    /// Cancels `cancel` once `run` is recorded cancelling — by this gateway or any other —
    /// until the run ends or the returned guard is dropped.
    pub(crate) fn watch_for_cancel(
        self: &Arc<Self>,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        cancel: &CancellationToken,
    ) -> DropGuard {
        let stop = CancellationToken::new();
        let (core, scope, session, run) =
            (self.clone(), scope.clone(), session.clone(), run.clone());
        let (watching, cancel) = (stop.clone(), cancel.clone());
        tokio::spawn(async move {
            let watch = async {
                // The cursor first, then the status: a cancel recorded after the status was
                // read is announced after this cursor.
                let from = match core.store.last_event_cursor(&scope, &session) {
                    Ok(from) => from,
                    Err(e) => {
                        tracing::warn!(%run, error = %e, "cannot watch the run for a cancel from another gateway");
                        return;
                    }
                };
                if core.store.run(&scope, &run).is_ok_and(|r| stops(r.status)) {
                    cancel.cancel();
                    return;
                }
                let ended = core
                    .hub
                    .first_event(scope.clone(), session.clone(), from, |event| {
                        event.run_id.as_ref() == Some(&run)
                            && matches!(&event.kind, EventKind::RunStatus { status, .. }
                                if stops(*status) || status.is_terminal())
                    })
                    .await;
                if let Some(event) = ended
                    && let EventKind::RunStatus { status, .. } = &event.kind
                    && stops(*status)
                {
                    tracing::info!(%run, "the turn was cancelled through another gateway or this one");
                    cancel.cancel();
                }
            };
            tokio::select! {
                () = watching.cancelled() => {}
                () = watch => {}
            }
        });
        stop.drop_guard()
    }

    /// Resolves once approval `id` of `session` is settled, as announced after `cursor` by
    /// whichever gateway settled it; never, when the session's events cannot be followed
    /// (then the in-process wake-up, the timeout or the cancel ends the wait).
    pub(crate) async fn approval_settled(
        &self,
        scope: &Scope,
        session: &SessionId,
        id: &ApprovalId,
        cursor: u64,
    ) {
        let settled = self
            .hub
            .first_event(scope.clone(), session.clone(), cursor, |event| {
                matches!(&event.kind, EventKind::Approval { approval }
                    if approval.id == *id && approval.state != ApprovalState::Pending)
            })
            .await;
        if settled.is_none() {
            std::future::pending::<()>().await;
        }
    }
}

/// Whether a run in `status` is being (or was) cancelled: its work must stop.
fn stops(status: RunStatus) -> bool {
    matches!(status, RunStatus::Cancelling | RunStatus::Cancelled)
}
