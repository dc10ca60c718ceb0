//! The workspace gate: a turn handed over while its workspace is still being laid onto the box
//! (`wait_for_workspace`) makes its first model call at once, but no tool runs and the turn's
//! end is not scanned before the gateway says the lay-down ended (`workspace_laid`). Tools are
//! held by holding the model's events that lead to them: everything but streamed text and
//! reasoning waits at the gate, so the loop sees no tool call (and no end of its step) before
//! the workspace is whole. A lay-down that failed turns the held event into an error: nothing
//! runs on, or is brought back from, a workspace that is not whole.

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use skiff_protocol::model::{ModelErrorKind, ModelEvent};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::watch;

/// How the lay-down ended: `None` while it runs.
pub(crate) type Laid = Option<Result<(), String>>;

/// The gate of one worker (one placement: a worker serves one owner epoch, and the lay-down it
/// waits for is that placement's). It opens (or fails) once and stays so.
#[derive(Clone)]
pub(crate) struct Gate {
    laid: watch::Sender<Laid>,
    /// A turn was told to wait: every later turn of this worker waits too, even one handed
    /// over by a gateway that no longer knows of the lay-down (it restarted meanwhile).
    expected: Arc<AtomicBool>,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            laid: watch::Sender::new(None),
            expected: Arc::default(),
        }
    }
}

impl Gate {
    /// Whether a turn handed over now waits at the gate: it was told to, or an earlier one was.
    pub(crate) fn applies(&self, told: bool) -> bool {
        if told {
            self.expected.store(true, Ordering::SeqCst);
        }
        self.expected.load(Ordering::SeqCst)
    }

    /// Records how the lay-down ended; the first word is kept.
    pub(crate) fn laid(&self, outcome: Result<(), String>) {
        self.laid.send_if_modified(|now| {
            if now.is_some() {
                return false;
            }
            *now = Some(outcome);
            true
        });
    }

    /// Waits until the lay-down ended; `Err` says why the workspace is not whole.
    pub(crate) async fn wait(&self) -> Result<(), String> {
        let mut rx = self.laid.subscribe();
        let outcome = match rx.wait_for(Option::is_some).await {
            Ok(laid) => laid.clone(),
            // The sender lives as long as the gate: unreachable, but never a guess.
            Err(_) => None,
        };
        outcome.unwrap_or_else(|| Err("the worker stopped waiting for the workspace".into()))
    }

    /// `inner` with every event but streamed text and reasoning held until the lay-down
    /// ended; a failed lay-down ends the stream with an error that says why.
    pub(crate) fn hold(
        &self,
        inner: BoxStream<'static, ModelEvent>,
    ) -> BoxStream<'static, ModelEvent> {
        let gate = self.clone();
        futures_util::stream::unfold(Some((inner, gate, false)), |state| async move {
            let (mut inner, gate, mut open) = state?;
            let event = inner.next().await?;
            let shown = matches!(
                event,
                ModelEvent::TextDelta { .. } | ModelEvent::ReasoningDelta { .. }
            );
            if !open && !shown {
                match gate.wait().await {
                    Ok(()) => open = true,
                    Err(why) => {
                        let error = ModelEvent::Error {
                            kind: ModelErrorKind::Configuration,
                            message: format!(
                                "the workspace could not be laid onto the box, so no tool can run: {why}"
                            ),
                        };
                        return Some((error, None));
                    }
                }
            }
            Some((event, Some((inner, gate, open))))
        })
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::model::{StopReason, ToolCall};
    use std::time::Duration;

    fn events() -> Vec<ModelEvent> {
        vec![
            ModelEvent::TextDelta {
                text: "looking".into(),
            },
            ModelEvent::ToolCall {
                call: ToolCall {
                    id: "c1".into(),
                    name: "read".into(),
                    arguments: serde_json::json!({ "path": "a" }),
                },
            },
            ModelEvent::Done {
                stop_reason: StopReason::ToolUse,
            },
        ]
    }

    #[tokio::test]
    async fn text_passes_and_the_tool_call_waits_for_the_workspace() {
        let gate = Gate::default();
        let mut held = gate.hold(futures_util::stream::iter(events()).boxed());
        assert!(matches!(
            held.next().await,
            Some(ModelEvent::TextDelta { .. })
        ));
        // The lay-down has not ended: the tool call stays held.
        let waiting = tokio::time::timeout(Duration::from_millis(100), held.next()).await;
        assert!(waiting.is_err(), "a tool call went past a closed gate");
        gate.laid(Ok(()));
        assert!(matches!(
            held.next().await,
            Some(ModelEvent::ToolCall { .. })
        ));
        assert!(matches!(held.next().await, Some(ModelEvent::Done { .. })));
        assert!(held.next().await.is_none());
    }

    #[tokio::test]
    async fn a_failed_lay_down_ends_the_step_with_its_reason() {
        let gate = Gate::default();
        gate.laid(Err("rsync died".into()));
        // A later word does not reopen it.
        gate.laid(Ok(()));
        let got: Vec<ModelEvent> = gate
            .hold(futures_util::stream::iter(events()).boxed())
            .collect()
            .await;
        assert_eq!(got.len(), 2, "{got:?}");
        let ModelEvent::Error { message, .. } = &got[1] else {
            panic!("{got:?}");
        };
        assert!(message.contains("rsync died"), "{message}");
        assert_eq!(gate.wait().await, Err("rsync died".into()));
    }
}
