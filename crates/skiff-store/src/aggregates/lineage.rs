//! Sessions made from other sessions or together with them — placed on a worker as they are
//! created, a parent's children, a fork, a fan-out group — on both backends: the SQLite
//! [`Store`] delegates to its own methods, [`PgStore`](crate::PgStore) is `pg/lineage.rs`.
//!
//! Each creation is one transaction: a session refused (no free worker slot, a parent with
//! its children's cap reached, a group that does not fit) leaves no row behind.

use crate::{GroupRow, NewArtifact, NewSession, Result, Scope, SessionRow, Store};
use skiff_protocol::transcript::TranscriptEntry;
use skiff_protocol::{GroupId, SessionId};

pub trait Lineage: Send + Sync {
    /// Creates a session and, when `placement` names a worker profile and the gateway's
    /// worker limit, places it there claiming a worker slot.
    fn create_session_placed(
        &self,
        scope: &Scope,
        new: &NewSession,
        placement: Option<(&str, u64)>,
    ) -> Result<SessionRow>;
    /// Creates `parent`'s child placed on `placement` (profile, worker limit), unless
    /// `parent` has started `max_children` children already (`TooManyChildren`): two
    /// dispatches at once never both pass the cap.
    fn create_child_session(
        &self,
        scope: &Scope,
        new: &NewSession,
        parent: &SessionId,
        placement: (&str, u64),
        max_children: u64,
    ) -> Result<SessionRow>;
    /// The sessions `parent`'s agent dispatched, oldest first.
    fn children(&self, scope: &Scope, parent: &SessionId) -> Result<Vec<SessionRow>>;
    /// Creates session `new` with copies of `entries` as its transcript (a chain with new
    /// ids, each keeping its run, body and time) and of `artifacts` as its records
    /// (checkpoints numbered in the order given).
    fn create_fork(
        &self,
        scope: &Scope,
        new: &NewSession,
        entries: &[TranscriptEntry],
        artifacts: &[NewArtifact],
    ) -> Result<SessionRow>;
    /// Creates group `id` and its sessions, each placed on `placement` with a worker slot of
    /// its own; when fewer slots are free than sessions given, nothing is written
    /// (`GroupAtCapacity`, saying how many are).
    fn create_group(
        &self,
        scope: &Scope,
        id: &GroupId,
        title: &str,
        sessions: &[NewSession],
        placement: (&str, u64),
    ) -> Result<Vec<SessionRow>>;
    fn group(&self, scope: &Scope, id: &GroupId) -> Result<GroupRow>;
    /// The group's sessions, in the order they were started.
    fn group_sessions(&self, scope: &Scope, id: &GroupId) -> Result<Vec<SessionRow>>;
    /// Marks `session` as its group's result; picking it again changes nothing, another
    /// attempt once one is picked is refused (`AlreadyPicked`).
    fn pick(&self, scope: &Scope, group: &GroupId, session: &SessionId) -> Result<GroupRow>;
}

impl Lineage for Store {
    fn create_session_placed(
        &self,
        scope: &Scope,
        new: &NewSession,
        placement: Option<(&str, u64)>,
    ) -> Result<SessionRow> {
        Store::create_session_placed(self, scope, new, placement)
    }
    fn create_child_session(
        &self,
        scope: &Scope,
        new: &NewSession,
        parent: &SessionId,
        placement: (&str, u64),
        max_children: u64,
    ) -> Result<SessionRow> {
        Store::create_child_session(self, scope, new, parent, placement, max_children)
    }
    fn children(&self, scope: &Scope, parent: &SessionId) -> Result<Vec<SessionRow>> {
        Store::children(self, scope, parent)
    }
    fn create_fork(
        &self,
        scope: &Scope,
        new: &NewSession,
        entries: &[TranscriptEntry],
        artifacts: &[NewArtifact],
    ) -> Result<SessionRow> {
        Store::create_fork(self, scope, new, entries, artifacts)
    }
    fn create_group(
        &self,
        scope: &Scope,
        id: &GroupId,
        title: &str,
        sessions: &[NewSession],
        placement: (&str, u64),
    ) -> Result<Vec<SessionRow>> {
        Store::create_group(self, scope, id, title, sessions, placement)
    }
    fn group(&self, scope: &Scope, id: &GroupId) -> Result<GroupRow> {
        Store::group(self, scope, id)
    }
    fn group_sessions(&self, scope: &Scope, id: &GroupId) -> Result<Vec<SessionRow>> {
        Store::group_sessions(self, scope, id)
    }
    fn pick(&self, scope: &Scope, group: &GroupId, session: &SessionId) -> Result<GroupRow> {
        Store::pick(self, scope, group, session)
    }
}
