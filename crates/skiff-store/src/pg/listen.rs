//! The wake-up listener: one extra connection per store, on a thread of its own, that
//! `LISTEN`s on `skiff_events` (each event append notifies `"<session> <cursor>"` in its own
//! transaction, `pg/events.rs`) and passes every notification to this process's followers
//! as a hint.
//!
//! Notifications sent while the listener is not connected are lost for good, so after every
//! (re)connect — once `LISTEN` is in effect, so nothing falls between — it tells every
//! follower to read by cursor again ([`Hint::Resync`](crate::Hint::Resync)). A dropped
//! connection is retried with a growing pause (up to `MAX_PAUSE`) until the store is dropped.

use super::conn::CONNECT_TIMEOUT;
use crate::wakeups::Hub;
use crate::{Error, Result};
use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, NoTls};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// The channel every event append notifies.
pub(super) const CHANNEL: &str = "skiff_events";
/// What the listener's connection is called in `pg_stat_activity`.
pub(crate) const APPLICATION_NAME: &str = "skiff-listen";
/// How often the thread looks up from waiting, to notice the store is gone.
const TICK: Duration = Duration::from_millis(100);
const FIRST_PAUSE: Duration = Duration::from_millis(20);
const MAX_PAUSE: Duration = Duration::from_secs(2);

pub(super) struct Listener {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    pub(super) fn start(mut config: postgres::Config, hub: Arc<Hub>) -> Result<Self> {
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        config.application_name(APPLICATION_NAME);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("skiff-store-listen".into())
            .spawn(move || listen(&config, &hub, &stopping))
            .map_err(Error::PgThread)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Connects, listens and passes notifications on, reconnecting, until `stop`.
fn listen(config: &postgres::Config, hub: &Hub, stop: &AtomicBool) {
    let mut pause = FIRST_PAUSE;
    while !stop.load(Ordering::Relaxed) {
        if let Ok(mut client) = config.connect(NoTls)
            && client.batch_execute(&format!("LISTEN {CHANNEL}")).is_ok()
        {
            pause = FIRST_PAUSE;
            // Listening from here on; whatever came before is read by cursor.
            hub.resync();
            pass_on(&mut client, hub, stop);
            // The connection dropped: reconnect at once.
            continue;
        }
        // Unreachable, or gone before it listened: try again shortly. Followers poll by
        // cursor meanwhile.
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// Passes notifications on until the connection drops or `stop`.
fn pass_on(client: &mut Client, hub: &Hub, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        {
            let mut notifications = client.notifications();
            let mut waiting = notifications.timeout_iter(TICK);
            loop {
                match waiting.next() {
                    Ok(Some(note)) => {
                        hub.notified(note.payload());
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                    }
                    Err(_) => return,
                    Ok(None) => break,
                }
            }
        }
        // Nothing within a tick, or the connection ended (which also answers "nothing").
        if client.is_closed() {
            return;
        }
    }
}
