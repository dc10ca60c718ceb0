//! Live event fan-out. Publishing appends the event to the session's log in the store (which
//! assigns the cursor) and broadcasts it. Subscribers replay from the store after their cursor,
//! then follow the broadcast; a subscriber that falls behind the broadcast buffer, or sees a
//! gap in the cursors, re-reads the store. Events are shared (`Arc`) rather than copied per
//! subscriber. So a slow client never blocks the publisher, and a client that reconnects with
//! its last cursor misses nothing and sees nothing twice.
//!
//! **Events another gateway appended** (several gateways on one database) reach this
//! gateway's subscribers through the same broadcast: a pump thread takes the store's wake-ups
//! (`EventWakeups`: NOTIFY on PostgreSQL, with a resync after the listener reconnects) and,
//! for each session someone here follows, reads the store **once** after the last cursor it
//! broadcast and sends what it found to every subscriber of that session — one read per
//! session per wake-up, never one per subscriber. It also reads every followed session each
//! [`POLL_EVERY`], so a lost notification only delays an event. Events this gateway
//! published itself go out at once from `publish` (the fast path); their wake-ups find
//! nothing new and cost the pump a comparison.

use crate::telemetry::{self, Telemetry};
use futures_util::Stream;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};
use skiff_store::{Backend, Hint, Scope};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::broadcast;

/// Events buffered per session for live subscribers; beyond it they catch up from the store.
const BROADCAST_CAPACITY: usize = 4096;
const REPLAY_BATCH: usize = 512;
/// Session-change notices buffered for list followers; a follower that lags re-reads the list.
const CHANGES_CAPACITY: usize = 1024;
/// Locks that order each session's publishing (a session always takes the same one).
const ORDER_STRIPES: usize = 64;
/// How often the pump reads every followed session without a wake-up: the longest a lost
/// notification delays an event from another gateway.
const POLL_EVERY: Duration = Duration::from_secs(2);

pub struct Hub {
    shared: Arc<Shared>,
    /// The session leases this gateway holds: a session's events are appended under its
    /// lease's fence while the lease is (or was, until its work ends) this gateway's.
    leases: Arc<crate::cluster::SessionLeases>,
}

struct Shared {
    store: Arc<dyn Backend>,
    telemetry: Arc<Telemetry>,
    /// INVARIANT: a session's stripe is held across append + send (and across the pump's
    /// read + send), so its broadcast order equals its cursor order. Striped rather than one
    /// lock, so sessions write side by side; rather than one per session, so nothing grows
    /// with the sessions a gateway ever saw.
    order: [Mutex<()>; ORDER_STRIPES],
    /// The live channel of each session someone follows. Held to find, add, drop or send on
    /// a channel, never across a database read or write.
    channels: Mutex<HashMap<SessionId, Channel>>,
    /// "This session's runs or transcript changed": what a session list follows (ids only;
    /// followers filter by scope and read the session themselves).
    changes: broadcast::Sender<(Scope, SessionId)>,
    /// Store reads made by the pump, and by subscribers catching up on their own (counted
    /// for the tests that hold the fan-out to one read per session).
    pump_reads: AtomicU64,
    follower_reads: AtomicU64,
}

/// One followed session's broadcast.
struct Channel {
    tx: broadcast::Sender<Arc<SessionEvent>>,
    /// The scope of the subscriber that opened it (it was checked to see the session): what
    /// the pump reads the session's events under.
    scope: Scope,
    /// The newest cursor broadcast (or, for a new channel, the session's newest when it was
    /// opened): the pump reads after it.
    sent: u64,
}

impl Hub {
    /// A hub whose measurements nobody reads (benchmarks and tests).
    pub fn new(store: Arc<dyn Backend>) -> Self {
        Self::with_telemetry(store, Arc::default(), Arc::default())
    }

    pub(crate) fn with_telemetry(
        store: Arc<dyn Backend>,
        telemetry: Arc<Telemetry>,
        leases: Arc<crate::cluster::SessionLeases>,
    ) -> Self {
        let shared = Arc::new(Shared {
            store,
            telemetry,
            order: std::array::from_fn(|_| Mutex::new(())),
            channels: Mutex::new(HashMap::new()),
            changes: broadcast::channel(CHANGES_CAPACITY).0,
            pump_reads: AtomicU64::new(0),
            follower_reads: AtomicU64::new(0),
        });
        spawn_pump(&shared);
        Self { shared, leases }
    }

    /// Notices of sessions whose runs or transcript changed, from now on, for every scope
    /// (the receiver filters). A lagged receiver should re-read the whole list.
    pub fn session_changes(&self) -> broadcast::Receiver<(Scope, SessionId)> {
        self.shared.changes.subscribe()
    }

    /// Persists and broadcasts an event — fenced by the session's lease while this gateway
    /// holds it, so a gateway that lost the session writes nothing more
    /// ([`skiff_store::Error::LeaseLost`]).
    pub fn publish(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: Option<&RunId>,
        kind: EventKind,
    ) -> Result<Arc<SessionEvent>, skiff_store::Error> {
        let store = &self.shared.store;
        self.publish_with(scope, session, || {
            self.leases.write(session, |fence| match fence {
                Some(fence) => store.append_event_fenced(fence, scope, run, kind.clone()),
                None => store.append_event(scope, session, run, kind.clone()),
            })
        })
    }

    /// The fence on `session`'s writes while its live work is this gateway's.
    pub(crate) fn fence(&self, session: &SessionId) -> Option<skiff_store::Fence> {
        self.leases.fence(session)
    }

    /// Makes one of `session`'s writes, fenced while its live work is this gateway's
    /// ([`crate::cluster::SessionLeases::write`]).
    pub(crate) fn fenced_write<T>(
        &self,
        session: &SessionId,
        write: impl FnMut(Option<&skiff_store::Fence>) -> Result<T, skiff_store::Error>,
    ) -> Result<T, skiff_store::Error> {
        self.leases.write(session, write)
    }

    /// Persists an event with `append` (which may record more in the same transaction) and
    /// broadcasts it.
    pub fn publish_with(
        &self,
        scope: &Scope,
        session: &SessionId,
        append: impl FnOnce() -> Result<SessionEvent, skiff_store::Error>,
    ) -> Result<Arc<SessionEvent>, skiff_store::Error> {
        let shared = &self.shared;
        let order = shared.stripe(session);
        let started = std::time::Instant::now();
        let event = Arc::new(append()?);
        shared
            .telemetry
            .observe(telemetry::EVENT_APPEND, Vec::new(), started.elapsed());
        // A subscriber joins under the stripe too: one that joined before this point gets
        // the event here, one that joins after reads it from the store.
        shared.send(session, std::slice::from_ref(&event));
        drop(order);
        if let EventKind::Placement { state, .. } = &event.kind {
            shared.telemetry.placement(session, *state);
        }
        shared.telemetry.traces.event(&event);
        shared.changed(scope, session, &event);
        Ok(event)
    }

    /// Every event of the session after `cursor`, then live ones (this gateway's and every
    /// other gateway's on the database), forever. Fails with "not found" when the session is
    /// not the caller's.
    pub fn subscribe(
        self: &Arc<Self>,
        scope: Scope,
        session: SessionId,
        cursor: u64,
    ) -> Result<
        impl Stream<Item = Result<Arc<SessionEvent>, skiff_store::Error>> + Send + 'static,
        skiff_store::Error,
    > {
        let shared = &self.shared;
        // INVARIANT: the live channel is per session, so checking the session's scope here is
        // what keeps one tenant's events away from another.
        shared.store.session(&scope, &session)?;
        // Subscribe before the first store read: anything appended after this point is in the
        // channel, anything before it is in the store.
        let rx = shared.join(&scope, &session)?;
        let state = Follow {
            shared: shared.clone(),
            scope,
            session,
            cursor,
            backlog: VecDeque::new(),
            rx,
            needs_replay: true,
        };
        Ok(futures_util::stream::unfold(state, |mut s| async move {
            let next = s.next().await?;
            Some((next, s))
        }))
    }

    /// Store reads the pump made for events it did not publish itself, and reads subscribers
    /// made on their own (replays), so far.
    #[cfg(test)]
    fn reads(&self) -> (u64, u64) {
        (
            self.shared.pump_reads.load(Ordering::Relaxed),
            self.shared.follower_reads.load(Ordering::Relaxed),
        )
    }
}

impl Shared {
    fn stripe(&self, session: &SessionId) -> std::sync::MutexGuard<'_, ()> {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let hasher = BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
        let stripe = hasher.hash_one(session) as usize % ORDER_STRIPES;
        self.order[stripe].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Channel>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver on the session's channel, opening it when nobody here follows the session
    /// yet (its `sent` is then the session's newest cursor, read under the stripe so no
    /// publish of this gateway falls between).
    fn join(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> Result<broadcast::Receiver<Arc<SessionEvent>>, skiff_store::Error> {
        if let Some(channel) = self.lock().get(session) {
            return Ok(channel.tx.subscribe());
        }
        let _order = self.stripe(session);
        let newest = self.store.last_event_cursor(scope, session)?;
        let mut channels = self.lock();
        let channel = channels.entry(session.clone()).or_insert_with(|| Channel {
            tx: broadcast::channel(BROADCAST_CAPACITY).0,
            scope: scope.clone(),
            sent: newest,
        });
        Ok(channel.tx.subscribe())
    }

    /// Broadcasts `events` (in cursor order) to the session's subscribers here. Call with the
    /// session's stripe held.
    fn send(&self, session: &SessionId, events: &[Arc<SessionEvent>]) {
        let mut channels = self.lock();
        let Some(channel) = channels.get_mut(session) else {
            return;
        };
        for event in events {
            channel.sent = channel.sent.max(event.cursor);
            if channel.tx.send(event.clone()).is_err() {
                // Nobody listens any more; drop the channel until someone subscribes again.
                channels.remove(session);
                return;
            }
        }
    }

    /// Tells session-list followers when `event` changes what a list shows. Streamed text
    /// and tool progress do not; run statuses and committed entries (which move
    /// `updated_at_ms`) do.
    fn changed(&self, scope: &Scope, session: &SessionId, event: &SessionEvent) {
        if matches!(
            event.kind,
            EventKind::RunStatus { .. } | EventKind::Entry { .. }
        ) {
            // An error only means nobody follows the list right now.
            let _ = self.changes.send((scope.clone(), session.clone()));
        }
    }

    /// Reads the session's events after the last one broadcast here — once, for every
    /// subscriber — and broadcasts them; nothing when nobody here follows the session or
    /// `hinted` (the cursor a wake-up named) was broadcast already.
    fn catch_up(&self, session: &SessionId, hinted: Option<u64>) {
        let _order = self.stripe(session);
        loop {
            let (scope, sent) = {
                let mut channels = self.lock();
                let Some(channel) = channels.get(session) else {
                    return;
                };
                if channel.tx.receiver_count() == 0 {
                    channels.remove(session);
                    return;
                }
                if hinted.is_some_and(|cursor| cursor <= channel.sent) {
                    return;
                }
                (channel.scope.clone(), channel.sent)
            };
            self.pump_reads.fetch_add(1, Ordering::Relaxed);
            let batch = match self.store.events_after(&scope, session, sent, REPLAY_BATCH) {
                Ok(batch) => batch,
                Err(e) => {
                    // The next wake-up or poll reads again; subscribers lose nothing.
                    tracing::warn!(%session, error = %e, "cannot read events another gateway appended");
                    return;
                }
            };
            let full = batch.len() == REPLAY_BATCH;
            let events: Vec<_> = batch.into_iter().map(Arc::new).collect();
            self.send(session, &events);
            for event in &events {
                self.changed(&scope, session, event);
            }
            if !full {
                return;
            }
        }
    }

    /// The sessions someone here follows.
    fn followed(&self) -> Vec<SessionId> {
        self.lock().keys().cloned().collect()
    }
}

/// Starts the thread that turns the store's wake-ups into broadcasts (see the module docs).
/// It holds the hub weakly and ends within [`POLL_EVERY`] of the hub's end.
fn spawn_pump(shared: &Arc<Shared>) {
    let hints = match shared.store.subscribe_events(None) {
        Ok(hints) => hints,
        Err(e) => {
            // Then only this gateway's own events are live; say so rather than fail a start.
            tracing::warn!(error = %e, "cannot follow events other gateways append; only this gateway's are live");
            return;
        }
    };
    let weak: Weak<Shared> = Arc::downgrade(shared);
    let spawned = std::thread::Builder::new()
        .name("skiff-event-pump".into())
        .spawn(move || {
            loop {
                let first = hints.wait(POLL_EVERY);
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                // Every hint waiting now, folded to one read per session.
                let mut hinted: HashMap<SessionId, u64> = HashMap::new();
                let mut everything = first.is_none();
                let mut next = first;
                while let Some(hint) = next {
                    match hint {
                        Hint::Appended { session, cursor } => {
                            let newest = hinted.entry(session).or_default();
                            *newest = (*newest).max(cursor);
                        }
                        Hint::Resync => everything = true,
                    }
                    next = hints.wait(Duration::ZERO);
                }
                if everything {
                    for session in shared.followed() {
                        shared.catch_up(&session, None);
                    }
                } else {
                    for (session, cursor) in hinted {
                        shared.catch_up(&session, Some(cursor));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the event pump; only this gateway's events are live");
    }
}

struct Follow {
    shared: Arc<Shared>,
    scope: Scope,
    session: SessionId,
    cursor: u64,
    backlog: VecDeque<Arc<SessionEvent>>,
    rx: broadcast::Receiver<Arc<SessionEvent>>,
    needs_replay: bool,
}

impl Follow {
    async fn next(&mut self) -> Option<Result<Arc<SessionEvent>, skiff_store::Error>> {
        loop {
            if let Some(event) = self.backlog.pop_front() {
                self.cursor = event.cursor;
                return Some(Ok(event));
            }
            if self.needs_replay {
                self.shared.follower_reads.fetch_add(1, Ordering::Relaxed);
                match self.shared.store.events_after(
                    &self.scope,
                    &self.session,
                    self.cursor,
                    REPLAY_BATCH,
                ) {
                    Ok(batch) if batch.is_empty() => self.needs_replay = false,
                    Ok(batch) => self.backlog.extend(batch.into_iter().map(Arc::new)),
                    Err(e) => return Some(Err(e)),
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(event) if event.cursor <= self.cursor => {}
                Ok(event) if event.cursor == self.cursor + 1 => {
                    self.cursor = event.cursor;
                    let lag_ms = skiff_store::now_ms().saturating_sub(event.at_ms).max(0);
                    self.shared.telemetry.observe(
                        telemetry::EVENT_FANOUT,
                        Vec::new(),
                        std::time::Duration::from_millis(lag_ms as u64),
                    );
                    return Some(Ok(event));
                }
                // A gap (or a lagged receiver): the store has what we missed.
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => self.needs_replay = true,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use skiff_protocol::api::WorkspaceView;
    use skiff_store::NewSession;
    use skiff_store::Store;

    fn new_session(store: &Store, scope: &Scope, suffix: &str) -> SessionId {
        let id = SessionId::from_suffix(suffix);
        store
            .create_session(
                scope,
                &NewSession {
                    id: id.clone(),
                    title: "t".into(),
                    workspace: WorkspaceView::Plain {
                        source: "/s".into(),
                        path: "/p".into(),
                    },
                    model_ref: "scripted/demo".into(),
                },
            )
            .unwrap();
        id
    }

    fn hub_with_session() -> (Arc<Hub>, Scope, SessionId) {
        let store = Arc::new(Store::open_in_memory().unwrap());
        let scope = Scope::new("usr_a", "ten_a");
        let id = new_session(&store, &scope, "test");
        (Arc::new(Hub::new(store)), scope, id)
    }

    fn delta(i: usize) -> EventKind {
        EventKind::TextDelta {
            text: i.to_string(),
        }
    }

    #[tokio::test]
    async fn a_subscriber_far_behind_the_buffer_still_gets_everything_once_in_order() {
        let (hub, scope, id) = hub_with_session();
        let mut stream = std::pin::pin!(hub.subscribe(scope.clone(), id.clone(), 0).unwrap());
        let total = BROADCAST_CAPACITY * 3;
        for i in 0..total {
            hub.publish(&scope, &id, None, delta(i)).unwrap();
        }
        for expected in 1..=total as u64 {
            let event = stream.next().await.unwrap().unwrap();
            assert_eq!(event.cursor, expected);
        }
    }

    #[tokio::test]
    async fn resuming_from_a_cursor_replays_the_rest_then_follows_live() {
        let (hub, scope, id) = hub_with_session();
        for i in 0..10 {
            hub.publish(&scope, &id, None, delta(i)).unwrap();
        }
        let mut stream = std::pin::pin!(hub.subscribe(scope.clone(), id.clone(), 7).unwrap());
        for expected in 8..=10 {
            assert_eq!(stream.next().await.unwrap().unwrap().cursor, expected);
        }
        hub.publish(&scope, &id, None, delta(10)).unwrap();
        assert_eq!(stream.next().await.unwrap().unwrap().cursor, 11);
    }

    #[tokio::test]
    async fn another_tenant_cannot_subscribe() {
        let (hub, _scope, id) = hub_with_session();
        let err = hub
            .subscribe(Scope::new("usr_a", "ten_b"), id, 0)
            .err()
            .unwrap();
        assert!(matches!(err, skiff_store::Error::NotFound { .. }));
    }

    /// Many sessions publishing at once while followers come and go: each follower sees its
    /// session's events once, in cursor order, with none missing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sessions_publishing_side_by_side_each_reach_their_followers_in_order() {
        let store = Arc::new(Store::open_in_memory().unwrap());
        let scope = Scope::new("usr_a", "ten_a");
        let hub = Arc::new(Hub::new(store.clone()));
        let sessions: Vec<SessionId> = (0..8)
            .map(|i| new_session(&store, &scope, &format!("s{i}")))
            .collect();
        const EACH: u64 = 300;
        let mut followers = Vec::new();
        let mut publishers = Vec::new();
        for id in &sessions {
            for _ in 0..2 {
                let stream = hub.subscribe(scope.clone(), id.clone(), 0).unwrap();
                followers.push(tokio::spawn(async move {
                    let mut stream = std::pin::pin!(stream);
                    let mut cursors = Vec::new();
                    while cursors.len() < EACH as usize {
                        cursors.push(stream.next().await.unwrap().unwrap().cursor);
                    }
                    cursors
                }));
            }
            let (hub, scope, id) = (hub.clone(), scope.clone(), id.clone());
            publishers.push(tokio::task::spawn_blocking(move || {
                for i in 0..EACH {
                    hub.publish(&scope, &id, None, delta(i as usize)).unwrap();
                }
            }));
        }
        for p in publishers {
            p.await.unwrap();
        }
        for f in followers {
            assert_eq!(f.await.unwrap(), (1..=EACH).collect::<Vec<_>>());
        }
    }

    /// Events another gateway appends (here: straight to the store, past this hub) reach
    /// 100 subscribers in order, read from the store once per wake-up for all of them, never
    /// once per subscriber.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_appended_elsewhere_are_read_once_per_wake_up_and_fanned_out_in_order() {
        use futures_util::FutureExt;
        let (hub, scope, id) = hub_with_session();
        let store = hub.shared.store.clone();
        const FOLLOWERS: usize = 100;
        const EVENTS: u64 = 50;
        let mut streams = Vec::new();
        for _ in 0..FOLLOWERS {
            let mut stream = Box::pin(hub.subscribe(scope.clone(), id.clone(), 0).unwrap());
            // Its replay finds nothing; it now follows the broadcast.
            assert!(stream.next().now_or_never().is_none());
            streams.push(stream);
        }
        assert_eq!(hub.reads(), (0, FOLLOWERS as u64));
        for i in 0..EVENTS {
            store
                .append_event(&scope, &id, None, delta(i as usize))
                .unwrap();
        }
        for stream in &mut streams {
            for expected in 1..=EVENTS {
                assert_eq!(stream.next().await.unwrap().unwrap().cursor, expected);
            }
            assert!(stream.next().now_or_never().is_none(), "nothing doubled");
        }
        let (pump, followers) = hub.reads();
        assert_eq!(followers, FOLLOWERS as u64, "no subscriber read on its own");
        // One per wake-up at most (a poll may add one); per subscriber it would be 5,000.
        assert!((1..=EVENTS + 1).contains(&pump), "{pump} reads");
    }

    /// This gateway's publishes and another gateway's appends, interleaved on one session:
    /// every subscriber sees each event once, in cursor order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn own_and_elsewhere_events_interleaved_reach_each_subscriber_once_in_order() {
        let (hub, scope, id) = hub_with_session();
        let store = hub.shared.store.clone();
        const EVENTS: u64 = 400;
        let followers: Vec<_> = (0..4)
            .map(|_| {
                let stream = hub.subscribe(scope.clone(), id.clone(), 0).unwrap();
                tokio::spawn(async move {
                    let mut stream = std::pin::pin!(stream);
                    let mut cursors = Vec::new();
                    while cursors.len() < EVENTS as usize {
                        cursors.push(stream.next().await.unwrap().unwrap().cursor);
                    }
                    cursors
                })
            })
            .collect();
        let (hub2, scope2, id2) = (hub.clone(), scope.clone(), id.clone());
        tokio::task::spawn_blocking(move || {
            for i in 0..EVENTS {
                if i % 3 == 0 {
                    store
                        .append_event(&scope2, &id2, None, delta(i as usize))
                        .unwrap();
                } else {
                    hub2.publish(&scope2, &id2, None, delta(i as usize))
                        .unwrap();
                }
            }
        })
        .await
        .unwrap();
        for f in followers {
            assert_eq!(f.await.unwrap(), (1..=EVENTS).collect::<Vec<_>>());
        }
    }
}
