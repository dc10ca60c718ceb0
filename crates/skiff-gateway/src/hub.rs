//! Live event fan-out. Publishing appends the event to the session's log in the store (which
//! assigns the cursor) and broadcasts it. Subscribers replay from the store after their cursor,
//! then follow the broadcast; a subscriber that falls behind the broadcast buffer re-reads the
//! store. Events are shared (`Arc`) rather than copied per subscriber. So a slow client never
//! blocks the publisher, and a client that reconnects with its
//! last cursor misses nothing and sees nothing twice.

use crate::telemetry::{self, Telemetry};
use futures_util::Stream;
use skiff_protocol::event::{EventKind, SessionEvent};
use skiff_protocol::{RunId, SessionId};
use skiff_store::{Backend, Scope};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// Events buffered per session for live subscribers; beyond it they catch up from the store.
const BROADCAST_CAPACITY: usize = 4096;
const REPLAY_BATCH: usize = 512;
/// Session-change notices buffered for list followers; a follower that lags re-reads the list.
const CHANGES_CAPACITY: usize = 1024;
/// Locks that order each session's publishing (a session always takes the same one).
const ORDER_STRIPES: usize = 64;

pub struct Hub {
    store: Arc<dyn Backend>,
    telemetry: Arc<Telemetry>,
    /// INVARIANT: a session's stripe is held across append + send, so its broadcast order
    /// equals its cursor order. Striped rather than one lock, so sessions write side by side;
    /// rather than one per session, so nothing grows with the sessions a gateway ever saw.
    order: [Mutex<()>; ORDER_STRIPES],
    /// The live channel of each session someone follows. Held to find, add, drop or send on
    /// a channel, never across a database write.
    channels: Mutex<HashMap<SessionId, broadcast::Sender<Arc<SessionEvent>>>>,
    /// "This session's runs or transcript changed": what a session list follows (ids only;
    /// followers filter by scope and read the session themselves).
    changes: broadcast::Sender<(Scope, SessionId)>,
    /// The session leases this gateway holds: a session's events are appended under its
    /// lease's fence while the lease is (or was, until its work ends) this gateway's.
    leases: Arc<crate::cluster::SessionLeases>,
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
        Self {
            leases,
            store,
            telemetry,
            order: std::array::from_fn(|_| Mutex::new(())),
            channels: Mutex::new(HashMap::new()),
            changes: broadcast::channel(CHANGES_CAPACITY).0,
        }
    }

    /// Notices of sessions whose runs or transcript changed, from now on, for every scope
    /// (the receiver filters). A lagged receiver should re-read the whole list.
    pub fn session_changes(&self) -> broadcast::Receiver<(Scope, SessionId)> {
        self.changes.subscribe()
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<SessionId, broadcast::Sender<Arc<SessionEvent>>>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
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
        let fence = self.leases.fence(session);
        self.publish_with(scope, session, || match &fence {
            Some(fence) => self.store.append_event_fenced(fence, scope, run, kind),
            None => self.store.append_event(scope, session, run, kind),
        })
    }

    /// The fence on `session`'s writes while its live work is this gateway's.
    pub(crate) fn fence(&self, session: &SessionId) -> Option<skiff_store::Fence> {
        self.leases.fence(session)
    }

    /// Persists an event with `append` (which may record more in the same transaction) and
    /// broadcasts it.
    pub fn publish_with(
        &self,
        scope: &Scope,
        session: &SessionId,
        append: impl FnOnce() -> Result<SessionEvent, skiff_store::Error>,
    ) -> Result<Arc<SessionEvent>, skiff_store::Error> {
        let stripe = {
            use std::hash::{BuildHasher, BuildHasherDefault};
            let hasher = BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
            hasher.hash_one(session) as usize % ORDER_STRIPES
        };
        let order = self.order[stripe].lock().unwrap_or_else(|p| p.into_inner());
        let started = std::time::Instant::now();
        let event = Arc::new(append()?);
        self.telemetry
            .observe(telemetry::EVENT_APPEND, Vec::new(), started.elapsed());
        {
            // A subscriber joins under this lock too: one that joined before this point gets
            // the event here, one that joins after reads it from the store.
            let mut channels = self.lock();
            if let Some(tx) = channels.get(session)
                && tx.send(event.clone()).is_err()
            {
                // Nobody listens any more; drop the channel until someone subscribes again.
                channels.remove(session);
            }
        }
        drop(order);
        if let EventKind::Placement { state, .. } = &event.kind {
            self.telemetry.placement(session, *state);
        }
        self.telemetry.traces.event(&event);
        // Streamed text and tool progress do not change what a session list shows; run
        // statuses and committed entries (which move `updated_at_ms`) do.
        if matches!(
            event.kind,
            EventKind::RunStatus { .. } | EventKind::Entry { .. }
        ) {
            // An error only means nobody follows the list right now.
            let _ = self.changes.send((scope.clone(), session.clone()));
        }
        Ok(event)
    }

    /// Every event of the session after `cursor`, then live ones, forever. Fails with "not
    /// found" when the session is not the caller's.
    pub fn subscribe(
        self: &Arc<Self>,
        scope: Scope,
        session: SessionId,
        cursor: u64,
    ) -> Result<
        impl Stream<Item = Result<Arc<SessionEvent>, skiff_store::Error>> + Send + 'static,
        skiff_store::Error,
    > {
        // INVARIANT: the live channel is per session, so checking the session's scope here is
        // what keeps one tenant's events away from another.
        self.store.session(&scope, &session)?;
        // Subscribe before the first store read: anything appended after this point is in the
        // channel, anything before it is in the store.
        let rx = self
            .lock()
            .entry(session.clone())
            .or_insert_with(|| broadcast::channel(BROADCAST_CAPACITY).0)
            .subscribe();
        let state = Follow {
            store: self.store.clone(),
            telemetry: self.telemetry.clone(),
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
}

struct Follow {
    store: Arc<dyn Backend>,
    telemetry: Arc<Telemetry>,
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
                match self
                    .store
                    .events_after(&self.scope, &self.session, self.cursor, REPLAY_BATCH)
                {
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
                    self.telemetry.observe(
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
}
