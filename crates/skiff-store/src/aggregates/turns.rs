//! What a turn's admission and the session's choices write, a worker's acknowledged events,
//! and the restart's reconciliation, on both backends: the SQLite [`Store`] delegates to its
//! own methods, [`PgStore`](crate::PgStore) is `pg/turns.rs`.

use crate::{Admission, Result, RunRow, Scope, SessionChoices, SessionRow, Store};
use skiff_protocol::approval::ApprovalPolicy;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};

pub trait Turns: Send + Sync {
    /// Admits a turn: its run (refused with `SessionBusy` while another is open) and what the
    /// admission carries — the session's new choices, the worker slot it claims — in one
    /// transaction; a refusal leaves the session, its placement and the slots as they were.
    fn admit_run(
        &self,
        scope: &Scope,
        session: &SessionId,
        model_ref: &str,
        admission: &Admission<'_>,
    ) -> Result<RunRow>;
    /// Sets what `choices` carries, whole or not at all.
    fn set_session_choices(
        &self,
        scope: &Scope,
        id: &SessionId,
        choices: &SessionChoices<'_>,
    ) -> Result<SessionRow>;
    /// How hard the session's model reasons from its next turn on (`None`: as the model's
    /// setting says).
    fn set_session_reasoning(
        &self,
        scope: &Scope,
        id: &SessionId,
        reasoning: Option<&str>,
    ) -> Result<SessionRow>;
    /// The session's own approval policy from its next tool call on.
    fn set_session_approval(
        &self,
        scope: &Scope,
        id: &SessionId,
        approval: &ApprovalPolicy,
    ) -> Result<SessionRow>;
    /// A worker's live event and its ACK cursor (`epoch`, `seq`, never moved back) in one
    /// transaction: applied and acknowledged are one fact.
    fn append_worker_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
        epoch: u64,
        seq: u64,
    ) -> Result<SessionEvent>;
    /// At gateway start, before anything runs: every attempt still active and every open run
    /// belonged to a process that is gone, so they become `orphaned` (never `succeeded`);
    /// returns the runs with their scopes so the caller can tell their sessions.
    fn orphan_active_on_start(&self, reason: &str) -> Result<Vec<(Scope, RunRow)>>;
}

impl Turns for Store {
    fn admit_run(
        &self,
        scope: &Scope,
        session: &SessionId,
        model_ref: &str,
        admission: &Admission<'_>,
    ) -> Result<RunRow> {
        Store::admit_run(self, scope, session, model_ref, admission)
    }
    fn set_session_choices(
        &self,
        scope: &Scope,
        id: &SessionId,
        choices: &SessionChoices<'_>,
    ) -> Result<SessionRow> {
        Store::set_session_choices(self, scope, id, choices)
    }
    fn set_session_reasoning(
        &self,
        scope: &Scope,
        id: &SessionId,
        reasoning: Option<&str>,
    ) -> Result<SessionRow> {
        Store::set_session_reasoning(self, scope, id, reasoning)
    }
    fn set_session_approval(
        &self,
        scope: &Scope,
        id: &SessionId,
        approval: &ApprovalPolicy,
    ) -> Result<SessionRow> {
        Store::set_session_approval(self, scope, id, approval)
    }
    fn append_worker_event(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
        epoch: u64,
        seq: u64,
    ) -> Result<SessionEvent> {
        Store::append_worker_event(self, scope, session, run, kind, epoch, seq)
    }
    fn orphan_active_on_start(&self, reason: &str) -> Result<Vec<(Scope, RunRow)>> {
        Store::orphan_active_on_start(self, reason)
    }
}
