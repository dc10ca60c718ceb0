//! A small pool of PostgreSQL connections, each owned by a thread of its own, that reconnect
//! after the server restarts or a connection drops.
//!
//! The `postgres` client is synchronous: it drives `tokio-postgres` on a private current-thread
//! runtime and panics if called from a thread that is already inside a tokio runtime — which
//! is every thread of the gateway. So each client lives on a dedicated thread, and callers send
//! it work over a channel and wait for the answer: callable from anywhere, async code included.
//! A caller takes the most recently used idle connection (so one caller at a time keeps using
//! one warm connection) and waits only when all [`POOL_SIZE`] are busy: concurrent sessions do
//! not queue behind one connection. A caller outside any tokio runtime, or on a multi-threaded
//! one (the gateway's, left for the call with `block_in_place`), runs its work on that
//! connection itself instead: the hop to the connection's thread and back is two thread
//! wake-ups, each of which waits for a free core on a busy machine (`benches/backends.rs`
//! prints the difference). Only a single-threaded runtime's callers (tests) keep the hop.
//!
//! **A lost connection** (the server restarted, the socket dropped) is noticed by the call that
//! meets it, which fails with [`Error::PgConnectionLost`] — or, for work that may run twice
//! ([`Connection::retry`]: reads, and writes whose second run changes nothing), runs once more
//! on a new connection. The next call reconnects. Reconnecting is bounded: after a failed
//! attempt, calls fail at once with [`Error::PgUnavailable`] until a backoff (100 ms doubling to
//! 5 s) has passed, so a server that is down costs callers no waiting. A connection idle for
//! more than [`IDLE_CHECK`] is checked (an empty query) before a write is sent on it, so a
//! server restarted between calls costs no write its outcome.

use crate::{Error, Result};
use postgres::{Client, NoTls, Statement};
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections per store. A gateway serves many sessions at once; four lets their writes
/// overlap in the server without holding many backends per gateway.
pub(crate) const POOL_SIZE: usize = 4;
/// How long connecting may take when the url does not say (`connect_timeout`).
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection idle this long is checked before a write is sent on it.
const IDLE_CHECK: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What a job gets: the client and the statements prepared on it so far.
pub(crate) struct PgConn {
    pub(crate) client: Client,
    prepared: HashMap<&'static str, Statement>,
}

impl PgConn {
    /// `sql` prepared once per connection (a statement is parsed and planned once, then only
    /// executed).
    pub(crate) fn statement(&mut self, sql: &'static str) -> Result<Statement> {
        if let Some(statement) = self.prepared.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(sql)?;
        self.prepared.insert(sql, statement.clone());
        Ok(statement)
    }
}

/// One connection's thread's state: the connection when there is one.
struct Link {
    shared: Arc<Shared>,
    conn: Option<PgConn>,
    last_used: Instant,
}

/// What the pool's threads share: where to connect and the reconnect backoff.
struct Shared {
    config: postgres::Config,
    target: String,
    backoff: Mutex<Backoff>,
}

#[derive(Default)]
struct Backoff {
    failures: u32,
    not_before: Option<Instant>,
    last_error: String,
}

/// How a job may be run: once, or again on a new connection after a lost one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rerun {
    Never,
    Once,
}

impl Link {
    /// The connection, connecting first when there is none (or it has closed); a write on a
    /// connection idle for a while is preceded by a check that it still works.
    fn conn(&mut self, rerun: Rerun) -> Result<&mut PgConn> {
        let stale = match &mut self.conn {
            Some(conn) if conn.client.is_closed() => true,
            Some(conn) if rerun == Rerun::Never && self.last_used.elapsed() > IDLE_CHECK => {
                conn.client.is_valid(CONNECT_TIMEOUT).is_err()
            }
            Some(_) => false,
            None => true,
        };
        if stale {
            self.conn = None;
            self.conn = Some(self.shared.connect()?);
        }
        self.last_used = Instant::now();
        self.conn.as_mut().ok_or(Error::PgGone)
    }

    fn attempt<T>(
        &mut self,
        rerun: Rerun,
        work: impl FnOnce(&mut PgConn) -> Result<T>,
    ) -> Result<T> {
        let conn = self.conn(rerun)?;
        let outcome = work(conn);
        if let Err(error) = &outcome
            && lost(conn, error)
        {
            // Dropped: the next call on this thread connects afresh.
            self.conn = None;
            return Err(Error::PgConnectionLost {
                target: self.shared.target.clone(),
                detail: error.to_string(),
            });
        }
        outcome
    }
}

/// Whether `error` means the connection is gone (rather than the statement failing on it).
fn lost(conn: &PgConn, error: &Error) -> bool {
    if conn.client.is_closed() {
        return true;
    }
    let Error::Postgres(error) = error else {
        return false;
    };
    if error.is_closed() {
        return true;
    }
    // Class 08 (connection exception) and 57P01–57P03 (the server shutting down or
    // restarting, or not accepting connections yet).
    error.code().is_some_and(|code| {
        let code = code.code();
        code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03")
    })
}

impl Shared {
    /// A new connection, unless the last attempt failed less than its backoff ago.
    fn connect(&self) -> Result<PgConn> {
        {
            let backoff = lock(&self.backoff);
            if let Some(not_before) = backoff.not_before
                && let Some(wait) = not_before.checked_duration_since(Instant::now())
            {
                return Err(Error::PgUnavailable {
                    target: self.target.clone(),
                    detail: backoff.last_error.clone(),
                    retry_in_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                });
            }
        }
        match self.config.connect(NoTls) {
            Ok(client) => {
                *lock(&self.backoff) = Backoff::default();
                Ok(PgConn {
                    client,
                    prepared: HashMap::new(),
                })
            }
            Err(source) => {
                let mut backoff = lock(&self.backoff);
                backoff.failures = backoff.failures.saturating_add(1);
                let delay = FIRST_BACKOFF
                    .saturating_mul(1 << backoff.failures.saturating_sub(1).min(16))
                    .min(MAX_BACKOFF);
                backoff.not_before = Some(Instant::now() + delay);
                backoff.last_error = source.to_string();
                Err(Error::PgConnect {
                    target: self.target.clone(),
                    source,
                })
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing held under these locks can be left half-changed by a panic.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

type Job = Box<dyn FnOnce(&mut Link) + Send>;

/// The pool's connections, by index: locked by the connection's thread for a job sent to it,
/// or by a caller running its work inline. Only the caller that took the index from the idle
/// list uses it, so the lock is never contended.
type Links = Arc<Vec<Mutex<Link>>>;

pub(crate) struct Connection {
    links: Links,
    /// One queue per connection thread.
    queues: Vec<mpsc::Sender<Job>>,
    /// The indexes of idle threads, the most recently used last.
    idle: Idle,
    threads: Vec<JoinHandle<()>>,
}

impl Connection {
    /// Connects to `url` (a `postgres://` url or a `key=value` string): the first connection
    /// now (so a wrong url or an unreachable server is an error here), the others on first
    /// use.
    pub(crate) fn open(url: &str) -> Result<Self> {
        let mut config: postgres::Config = url.parse().map_err(Error::PgUrl)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("skiff");
        }
        with_durability(&mut config);
        let shared = Arc::new(Shared {
            target: describe(&config),
            config,
            backoff: Mutex::new(Backoff::default()),
        });
        // On a thread of its own: the sync client runs a runtime of its own to connect, which
        // panics on a thread that is already inside the gateway's tokio runtime.
        let first = std::thread::scope(|scope| {
            scope
                .spawn(|| shared.connect())
                .join()
                .map_err(|_| Error::PgGone)
        })??;
        let idle = Arc::new((Mutex::new(Vec::with_capacity(POOL_SIZE)), Condvar::new()));
        let mut first = Some(first);
        let links: Links = Arc::new(
            (0..POOL_SIZE)
                .map(|index| {
                    Mutex::new(Link {
                        shared: shared.clone(),
                        conn: if index == 0 { first.take() } else { None },
                        last_used: Instant::now(),
                    })
                })
                .collect(),
        );
        let mut queues = Vec::with_capacity(POOL_SIZE);
        let mut threads = Vec::with_capacity(POOL_SIZE);
        // Pushed in reverse so that the connected link (0) is the first one taken.
        for index in (0..POOL_SIZE).rev() {
            let (jobs, queue) = mpsc::channel::<Job>();
            let links = links.clone();
            let thread = std::thread::Builder::new()
                .name(format!("skiff-store-pg-{index}"))
                .spawn(move || {
                    // Until the store is dropped (the sender goes away).
                    while let Ok(job) = queue.recv() {
                        if let Some(link) = links.get(index) {
                            job(&mut lock(link));
                        }
                    }
                })
                .map_err(Error::PgThread)?;
            queues.push(jobs);
            threads.push(thread);
            lock(&idle.0).push(index);
        }
        queues.reverse();
        threads.reverse();
        Ok(Self {
            links,
            queues,
            idle,
            threads,
        })
    }

    /// Runs `work` once on a connection and waits for its answer. A connection lost during it
    /// is [`Error::PgConnectionLost`]: whether a write took effect is then unknown.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut PgConn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.submit(move |link| link.attempt(Rerun::Never, work))
    }

    /// Runs `work`, and once more on a new connection if the connection was lost during it:
    /// for reads, and for writes whose second run changes nothing (a compare-and-swap that
    /// recognises its own earlier success).
    pub(crate) fn retry<T: Send + 'static>(
        &self,
        mut work: impl FnMut(&mut PgConn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.submit(move |link| match link.attempt(Rerun::Once, &mut work) {
            Err(Error::PgConnectionLost { .. }) => link.attempt(Rerun::Once, &mut work),
            outcome => outcome,
        })
    }

    fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Link) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let index = {
            let (list, freed) = &*self.idle;
            let mut idle = lock(list);
            loop {
                if let Some(index) = idle.pop() {
                    break index;
                }
                idle = freed.wait(idle).unwrap_or_else(|p| p.into_inner());
            }
        };
        let inline = |job| {
            let link = self.links.get(index).ok_or(Error::PgGone)?;
            let outcome = guarded(&mut lock(link), job);
            release(&self.idle, index);
            outcome
        };
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            // No runtime here, so the client's own may run on this thread.
            Err(_) => return inline(job),
            // The gateway's: this thread leaves the runtime for the call (its other tasks go
            // on on another thread meanwhile), as when it waited for a connection thread.
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                return tokio::task::block_in_place(|| inline(job));
            }
            // A single-threaded runtime cannot be left: its thread waits for the hop.
            Ok(_) => {}
        }
        let (reply, answer) = mpsc::sync_channel(1);
        let idle = self.idle.clone();
        self.queues
            .get(index)
            .ok_or(Error::PgGone)?
            .send(Box::new(move |link: &mut Link| {
                let outcome = guarded(link, job);
                // Idle again before the caller hears back, so its next call finds this
                // (warm) connection first.
                release(&idle, index);
                let _ = reply.send(outcome);
            }))
            .map_err(|_| Error::PgGone)?;
        answer.recv().map_err(|_| Error::PgGone)?
    }
}

/// `job` on `link`; a job that panics is [`Error::PgGone`], and whatever it left half-done on
/// the connection goes with the connection.
fn guarded<T>(link: &mut Link, job: impl FnOnce(&mut Link) -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(link))) {
        Ok(outcome) => outcome,
        Err(_) => {
            link.conn = None;
            Err(Error::PgGone)
        }
    }
}

impl Connection {
    /// `run`, inside a transaction that first checks `fence` (issue 17) under the lease row's
    /// lock when there is one: the work commits only if the fence holds, and a refused fence
    /// ([`Error::LeaseLost`]) writes nothing. For work that opens no transaction of its own
    /// (a single statement, or a few); work with its own transaction calls
    /// `leases::check_fence` in it instead.
    pub(crate) fn run_fenced<T: Send + 'static>(
        &self,
        fence: Option<crate::Fence>,
        work: impl FnOnce(&mut PgConn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let Some(fence) = fence else {
            return self.run(work);
        };
        self.run(move |conn| {
            conn.client.batch_execute("BEGIN")?;
            match super::leases::check_fence(&mut conn.client, &fence).and_then(|()| work(conn)) {
                Ok(answer) => {
                    conn.client.batch_execute("COMMIT")?;
                    Ok(answer)
                }
                Err(refused) => {
                    // A connection that cannot roll back is broken: say that instead.
                    conn.client.batch_execute("ROLLBACK")?;
                    Err(refused)
                }
            }
        })
    }
}

type Idle = Arc<(Mutex<Vec<usize>>, Condvar)>;

/// Thread `index` is idle: the most recently used, so the first taken.
fn release(idle: &Idle, index: usize) {
    let (list, freed) = &**idle;
    lock(list).push(index);
    freed.notify_one();
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Closing the queues ends the threads' loops, which closes the connections.
        self.queues.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        // A client closes through a runtime of its own, which cannot start on a thread of the
        // gateway's runtime — where the store may well be dropped (a refused start, a drain's
        // exit): the clients are closed on a plain thread.
        let clients: Vec<PgConn> = self
            .links
            .iter()
            .filter_map(|link| lock(link).conn.take())
            .collect();
        if !clients.is_empty() {
            let _ = std::thread::spawn(move || drop(clients)).join();
        }
    }
}

/// `synchronous_commit = off` for Skiff's own sessions, unless the url's `options` already
/// set it: a commit returns once it is in the server's WAL buffers, and the WAL writer makes
/// it durable within a fraction of a second — what SQLite's WAL with `synchronous = NORMAL`
/// promises (see ARCHITECTURE.md, "Durability"). Never a corrupt or reordered database; the
/// server or its machine crashing may lose the last moments of commits.
fn with_durability(config: &mut postgres::Config) {
    let options = config.get_options().unwrap_or_default().to_string();
    if !options.contains("synchronous_commit") {
        let joined = format!("{options} -c synchronous_commit=off");
        config.options(joined.trim());
    }
}

/// "user skiff, database app on /run/pg": where a connection goes, without the password.
fn describe(config: &postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            postgres::config::Host::Tcp(name) => name.clone(),
            postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    format!(
        "user {}, database {} on {}",
        config.get_user().unwrap_or("(default)"),
        config.get_dbname().unwrap_or("(default)"),
        if hosts.is_empty() {
            "(default host)".to_string()
        } else {
            hosts.join(",")
        }
    )
}

#[cfg(test)]
mod tests {
    use super::{Connection, POOL_SIZE};
    use skiff_test_support::postgres::{Durability, PgCluster};
    use std::sync::{Arc, Barrier};

    /// `SHOW synchronous_commit` on every connection of the pool at once (so each thread
    /// answers, not just the warm one).
    fn settings(conn: &Arc<Connection>) -> Vec<String> {
        let together = Arc::new(Barrier::new(POOL_SIZE));
        let askers: Vec<_> = (0..POOL_SIZE)
            .map(|_| {
                let (conn, together) = (Arc::clone(conn), Arc::clone(&together));
                std::thread::spawn(move || {
                    conn.retry(move |pg| {
                        // Every connection holds its job until all four are busy.
                        together.wait();
                        let row = pg.client.query_one("SHOW synchronous_commit", &[])?;
                        let pid: i32 = pg.client.query_one("SELECT pg_backend_pid()", &[])?.get(0);
                        Ok((row.get::<_, String>(0), pid))
                    })
                    .unwrap()
                })
            })
            .collect();
        let answers: Vec<(String, i32)> = askers.into_iter().map(|a| a.join().unwrap()).collect();
        let mut pids: Vec<i32> = answers.iter().map(|a| a.1).collect();
        pids.sort_unstable();
        pids.dedup();
        assert_eq!(pids.len(), POOL_SIZE, "each answer from its own backend");
        answers.into_iter().map(|a| a.0).collect()
    }

    /// How many times the server has flushed its WAL to disk so far, after `commits` one-row
    /// commits through the pool.
    fn wal_flushes_after(conn: &Connection, commits: usize) -> i64 {
        conn.run(move |pg| {
            for n in 0..commits {
                let n = i64::try_from(n).unwrap_or_default();
                pg.client
                    .execute("INSERT INTO written (n) VALUES ($1)", &[&n])?;
            }
            // This backend's counts reach the shared statistics once it is idle again.
            pg.client
                .batch_execute("SELECT pg_stat_force_next_flush()")?;
            Ok(())
        })
        .unwrap();
        conn.run(|pg| {
            Ok(pg
                .client
                .query_one("SELECT wal_sync FROM pg_stat_wal", &[])?
                .get(0))
        })
        .unwrap()
    }

    fn backend_pid(conn: &Connection) -> i32 {
        conn.run(|pg| Ok(pg.client.query_one("SELECT pg_backend_pid()", &[])?.get(0)))
            .unwrap()
    }

    #[test]
    fn a_call_works_from_a_plain_thread_and_from_either_kind_of_runtime_and_survives_a_panic() {
        let cluster = PgCluster::start();
        let conn = Arc::new(Connection::open(&cluster.fresh_database()).unwrap());
        let plain = backend_pid(&conn);
        // The gateway's: a task of a multi-threaded runtime (the call leaves the runtime).
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let shared = Arc::clone(&conn);
        let from_task = multi
            .block_on(async move { tokio::spawn(async move { backend_pid(&shared) }).await })
            .unwrap();
        // A test's: a single-threaded runtime, which cannot be left (the call hops).
        let single = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let from_single = single.block_on(async { backend_pid(&conn) });
        // One caller at a time keeps the warm connection, whichever way it was reached.
        assert_eq!((from_task, from_single), (plain, plain));

        // A job that panics on the caller's thread costs its connection, not the pool.
        let panicked = conn.run(|_| -> crate::Result<()> { panic!("a bug in a job") });
        assert!(
            matches!(panicked, Err(crate::Error::PgGone)),
            "{panicked:?}"
        );
        assert_ne!(
            backend_pid(&conn),
            plain,
            "a fresh connection after the panic"
        );
    }

    #[test]
    fn every_pooled_connection_commits_asynchronously_also_after_a_restart() {
        // A server whose own default is `on`, as in production.
        let mut cluster = PgCluster::start_with(Durability::LikeSqliteNormal);
        let conn = Arc::new(Connection::open(&cluster.fresh_database()).unwrap());
        assert_eq!(settings(&conn), vec!["off"; POOL_SIZE]);
        cluster.restart();
        assert_eq!(
            settings(&conn),
            vec!["off"; POOL_SIZE],
            "after reconnecting"
        );

        // And it takes effect: a hundred commits do not wait for a hundred flushes (with
        // `synchronous_commit = on` each would; off, the WAL writer flushes a few times a
        // second whatever the number of commits).
        conn.run(|pg| Ok(pg.client.batch_execute("CREATE TABLE written (n BIGINT)")?))
            .unwrap();
        let before = wal_flushes_after(&conn, 0);
        let after = wal_flushes_after(&conn, 100);
        assert!(
            after - before < 50,
            "100 commits flushed the WAL {} times",
            after - before
        );
    }
}
