//! Wake-ups for followers of a session's events: a hint that an event was appended, and
//! [`Follower`], which reads by cursor after every hint.
//!
//! Hints are only hints. On SQLite they come from this process's own appends; on PostgreSQL
//! also from every other process on the database (`LISTEN skiff_events`, notified in each
//! append's transaction, see `pg/listen.rs`). A hint can be lost — a listener reconnecting
//! misses whatever was notified while it was away, another process's SQLite appends notify
//! nobody — so the guarantee is the cursor: a follower reads `events_after(cursor)` after
//! every hint, after every reconnect of the listener ([`Hint::Resync`]) and at least every
//! poll interval. A lost hint delays an event by at most that interval; it never loses one.

use crate::aggregates::{EventLog, EventWakeups};
use crate::{Result, Scope};
use skiff_protocol::SessionId;
use skiff_protocol::event::SessionEvent;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Why a follower should look again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hint {
    /// `session` has an event at `cursor`.
    Appended { session: SessionId, cursor: u64 },
    /// Hints may have been missed (the listener reconnected): every follower reads again.
    Resync,
}

/// A subscription: hints as they come. Dropping it unsubscribes.
pub struct EventHints {
    hints: Receiver<Hint>,
}

impl EventHints {
    /// The next hint, waiting up to `timeout`; `None` when none came (or the store is gone).
    pub fn wait(&self, timeout: Duration) -> Option<Hint> {
        match self.hints.recv_timeout(timeout) {
            Ok(hint) => Some(hint),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                // The store is gone; the caller's poll will say so. Never spin.
                std::thread::sleep(timeout);
                None
            }
        }
    }
}

/// Who wants hints: per session, and for every session.
#[derive(Default)]
pub(crate) struct Hub {
    subscribers: Mutex<Subscribers>,
}

#[derive(Default)]
struct Subscribers {
    by_session: HashMap<SessionId, Vec<Sender<Hint>>>,
    everything: Vec<Sender<Hint>>,
}

impl Hub {
    pub(crate) fn subscribe(&self, session: Option<&SessionId>) -> EventHints {
        let (tx, hints) = mpsc::channel();
        let mut subscribers = self.lock();
        match session {
            Some(session) => subscribers
                .by_session
                .entry(session.clone())
                .or_default()
                .push(tx),
            None => subscribers.everything.push(tx),
        }
        EventHints { hints }
    }

    /// Tells `session`'s subscribers (and everything's) of an event at `cursor`; forgets
    /// subscribers that went away.
    pub(crate) fn appended(&self, session: &SessionId, cursor: u64) {
        let mut subscribers = self.lock();
        let hint = || Hint::Appended {
            session: session.clone(),
            cursor,
        };
        if let Some(followers) = subscribers.by_session.get_mut(session) {
            followers.retain(|tx| tx.send(hint()).is_ok());
            if followers.is_empty() {
                subscribers.by_session.remove(session);
            }
        }
        subscribers.everything.retain(|tx| tx.send(hint()).is_ok());
    }

    /// A NOTIFY payload, `"<session id> <cursor>"`; anything else is ignored (hints only).
    pub(crate) fn notified(&self, payload: &str) {
        let parsed = payload.split_once(' ').and_then(|(session, cursor)| {
            Some((SessionId::parse(session)?, cursor.parse::<u64>().ok()?))
        });
        if let Some((session, cursor)) = parsed {
            self.appended(&session, cursor);
        }
    }

    /// Tells every subscriber to read again.
    pub(crate) fn resync(&self) {
        let mut subscribers = self.lock();
        subscribers.by_session.retain(|_, followers| {
            followers.retain(|tx| tx.send(Hint::Resync).is_ok());
            !followers.is_empty()
        });
        subscribers
            .everything
            .retain(|tx| tx.send(Hint::Resync).is_ok());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Subscribers> {
        // Sends cannot leave the lists half-changed; a poisoned lock is safe to keep using.
        self.subscribers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How many events one read returns at most.
const BATCH: usize = 500;

/// One reader of one session's events from a cursor on, woken by hints and reading by
/// cursor only: the way to follow a session across gateways without losing an event.
pub struct Follower<'s, S: EventLog + EventWakeups + ?Sized> {
    store: &'s S,
    scope: Scope,
    session: SessionId,
    cursor: u64,
    hints: EventHints,
    poll_every: Duration,
    resyncs: u64,
}

impl<'s, S: EventLog + EventWakeups + ?Sized> Follower<'s, S> {
    /// Follows `session` after `cursor`, reading at least every `poll_every` even without a
    /// hint. Subscribes before its first read, so nothing falls between the two.
    pub fn new(
        store: &'s S,
        scope: &Scope,
        session: &SessionId,
        cursor: u64,
        poll_every: Duration,
    ) -> Result<Self> {
        Ok(Self {
            hints: store.subscribe_events(Some(session))?,
            store,
            scope: scope.clone(),
            session: session.clone(),
            cursor,
            poll_every,
            resyncs: 0,
        })
    }

    /// The cursor of the last event returned.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// How many times the hints' source said hints may have been lost.
    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }

    /// The next events after the cursor, oldest first, waiting up to `wait` for some; empty
    /// when none came in time.
    pub fn next(&mut self, wait: Duration) -> Result<Vec<SessionEvent>> {
        let deadline = Instant::now() + wait;
        loop {
            let events = self
                .store
                .events_after(&self.scope, &self.session, self.cursor, BATCH)?;
            if let Some(last) = events.last() {
                self.cursor = last.cursor;
                return Ok(events);
            }
            if !self.wait_for_reason(deadline) {
                return Ok(Vec::new());
            }
        }
    }

    /// Waits for a reason to read again: a hint past the cursor, a resync, or the poll
    /// interval. `false` when `deadline` came first.
    fn wait_for_reason(&mut self, deadline: Instant) -> bool {
        let poll_at = Instant::now() + self.poll_every;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            match self.hints.wait(deadline.min(poll_at) - now) {
                Some(Hint::Appended { cursor, .. }) if cursor <= self.cursor => continue,
                Some(Hint::Appended { .. }) => return true,
                Some(Hint::Resync) => {
                    self.resyncs += 1;
                    return true;
                }
                // The poll interval (a hint may have been lost), or the deadline: one last read.
                None => return true,
            }
        }
    }
}
