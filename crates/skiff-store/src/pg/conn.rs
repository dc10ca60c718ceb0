//! One PostgreSQL connection, owned by a thread of its own.
//!
//! The `postgres` client is synchronous: it drives `tokio-postgres` on a private current-thread
//! runtime and panics if called from a thread that is already inside a tokio runtime — which
//! is every thread of the gateway. So the client lives on a dedicated thread, and callers send
//! it work over a channel and wait for the answer: callable from anywhere, async code included,
//! and blocking its caller exactly as long as the SQLite store's mutex and query do today.

use crate::{Error, Result};
use postgres::{Client, NoTls, Statement};
use std::collections::HashMap;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

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

type Job = Box<dyn FnOnce(&mut PgConn) + Send>;

pub(crate) struct Connection {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// How long connecting may take when the url does not say (`connect_timeout`).
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl Connection {
    /// Connects to `url` (a `postgres://` url or a `key=value` string) on a new thread.
    pub(crate) fn open(url: &str) -> Result<Self> {
        let mut config: postgres::Config = url.parse().map_err(Error::PgUrl)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("skiff");
        }
        let target = describe(&config);
        let (jobs, queue) = mpsc::channel::<Job>();
        let (connected, outcome) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("skiff-store-pg".into())
            .spawn(move || {
                let client = match config.connect(NoTls) {
                    Ok(client) => {
                        let _ = connected.send(Ok(()));
                        client
                    }
                    Err(e) => {
                        let _ = connected.send(Err(e));
                        return;
                    }
                };
                let mut conn = PgConn {
                    client,
                    prepared: HashMap::new(),
                };
                // Until the store is dropped (the sender goes away).
                while let Ok(job) = queue.recv() {
                    job(&mut conn);
                }
            })
            .map_err(Error::PgThread)?;
        match outcome.recv() {
            Ok(Ok(())) => Ok(Self {
                jobs: Some(jobs),
                thread: Some(thread),
            }),
            Ok(Err(source)) => Err(Error::PgConnect { target, source }),
            Err(_) => Err(Error::PgGone),
        }
    }

    /// Runs `work` on the connection's thread and waits for its answer.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut PgConn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        let jobs = self.jobs.as_ref().ok_or(Error::PgGone)?;
        jobs.send(Box::new(move |conn: &mut PgConn| {
            let _ = reply.send(work(conn));
        }))
        .map_err(|_| Error::PgGone)?;
        // A job that panicked dropped `reply` with the thread: the connection is gone.
        answer.recv().map_err(|_| Error::PgGone)?
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

impl Drop for Connection {
    fn drop(&mut self) {
        // Closing the queue ends the thread's loop, which closes the connection.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
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
