//! The two writes every part of the gateway shares: appending entries to a session's
//! transcript and announcing them, and moving a run and announcing its status. One place each,
//! so every caller gets the same compare-and-swap handling and the same fan-out.
//!
//! Deliberately absent: what to append or when — the callers decide (a user's message, a
//! worker's commit, a notice of lost work).

use crate::{Core, Hub, Result};
use serde_json::json;
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::EventKind;
use skiff_protocol::transcript::{EntryBody, TranscriptEntry};
use skiff_protocol::{EntryId, RunId, SessionId};
use skiff_store::Backend;
use skiff_store::{RunRow, Scope};

/// How often an append at the leaf re-reads a leaf that moved under it.
const LEAF_RETRIES: usize = 3;

impl Core {
    /// The transcript writes, on the core's store and hub.
    pub(crate) fn transcript(&self) -> Transcript<'_> {
        Transcript {
            store: &*self.store,
            hub: &self.hub,
        }
    }

    /// See [`Transcript::append_entries_published`].
    pub(crate) fn append_entries_published(
        &self,
        scope: &Scope,
        session: &SessionId,
        base: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> std::result::Result<Vec<TranscriptEntry>, skiff_store::Error> {
        self.transcript()
            .append_entries_published(scope, session, base, run, bodies)
    }

    /// See [`Transcript::append_at_leaf`].
    pub(crate) fn append_at_leaf(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> std::result::Result<Vec<TranscriptEntry>, skiff_store::Error> {
        self.transcript()
            .append_at_leaf(scope, session, run, bodies)
    }

    /// See [`Transcript::notify`].
    pub(crate) fn notify(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        text: &str,
    ) {
        self.transcript().notify(scope, session, run, text);
    }

    /// See [`Transcript::set_run_status`].
    pub(crate) fn set_run_status(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        status: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        self.transcript()
            .set_run_status(scope, session, run, status, error)
    }
}

/// The transcript and run-status writes on a store and a hub: what the core and the worker
/// side (which holds no core) both write through.
#[derive(Clone, Copy)]
pub(crate) struct Transcript<'a> {
    pub(crate) store: &'a dyn Backend,
    pub(crate) hub: &'a Hub,
}

impl Transcript<'_> {
    /// Appends `bodies` after `base` (compare-and-swap: the store refuses a base that is not
    /// the session's leaf) and publishes each new entry. The entries are durable once this
    /// returns `Ok`; an entry that could not be announced live is logged, and followers get
    /// it from the transcript.
    pub(crate) fn append_entries_published(
        &self,
        scope: &Scope,
        session: &SessionId,
        base: Option<&EntryId>,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> std::result::Result<Vec<TranscriptEntry>, skiff_store::Error> {
        // Fenced while this gateway holds the session's lease: a gateway that lost it
        // appends nothing more.
        let entries = self.hub.fenced_write(session, |fence| match fence {
            Some(fence) => self
                .store
                .append_entries_fenced(fence, scope, base, run, bodies),
            None => self.store.append_entries(scope, session, base, run, bodies),
        })?;
        for entry in &entries {
            let event = EventKind::Entry {
                entry: entry.clone(),
            };
            if let Err(e) = self.hub.publish(scope, session, run, event) {
                tracing::warn!(%session, entry = %entry.id, error = %e, "could not publish a transcript entry");
            }
        }
        Ok(entries)
    }

    /// Appends `bodies` at the session's current leaf, reading it again when another writer
    /// moved it in between, and publishes them.
    pub(crate) fn append_at_leaf(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        bodies: &[EntryBody],
    ) -> std::result::Result<Vec<TranscriptEntry>, skiff_store::Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let leaf = self.store.leaf(scope, session)?;
            match self.append_entries_published(scope, session, leaf.as_ref(), run, bodies) {
                Err(skiff_store::Error::LeafConflict { .. }) if attempt < LEAF_RETRIES => {}
                other => return other,
            }
        }
    }

    /// Appends a notice to the session's transcript (re-reading the leaf when it moved) and
    /// publishes it. A notice that cannot be written never undoes the work it describes; it
    /// is logged and audited, so what the user was not told can be found.
    pub(crate) fn notify(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        text: &str,
    ) {
        let body = [EntryBody::Notice {
            text: text.to_owned(),
        }];
        if let Err(e) = self.append_at_leaf(scope, session, run, &body) {
            tracing::warn!(%session, error = %e, notice = text, "could not write a notice");
            crate::sessions::audit_row(
                self.store,
                scope,
                "session.notice",
                session.as_str(),
                "lost",
                json!({ "reason": e.to_string(), "run": run.map(RunId::as_str) }),
            );
        }
    }

    /// Moves a run through the store's checked state machine, fenced by the session's lease
    /// while this gateway holds it; announces nothing.
    pub(crate) fn transition_run(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        status: RunStatus,
        error: Option<&str>,
    ) -> std::result::Result<RunRow, skiff_store::Error> {
        self.hub.fenced_write(session, |fence| match fence {
            Some(fence) => self
                .store
                .transition_run_fenced(fence, scope, run, status, error),
            None => self.store.transition_run(scope, run, status, error),
        })
    }

    /// Moves a run to `status` through the store's checked state machine and announces the
    /// new status to the session's followers.
    pub(crate) fn set_run_status(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        status: RunStatus,
        error: Option<&str>,
    ) -> Result<RunRow> {
        let row = self.transition_run(scope, session, run, status, error)?;
        self.hub.publish(
            scope,
            session,
            Some(run),
            EventKind::RunStatus {
                status,
                error: error.map(str::to_owned),
            },
        )?;
        Ok(row)
    }
}
