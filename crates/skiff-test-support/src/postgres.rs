//! A throwaway PostgreSQL cluster: Debian's server programs, a data directory in a temporary
//! directory, the server listening only on a Unix socket in that directory, stopped (and the
//! directory removed) when the [`PgCluster`] is dropped. Each [`PgCluster::fresh_database`] is
//! a new, empty database.
//!
//! `initdb` refuses to run as root, and CI runs as root: then the server runs as a dedicated
//! system user (`skiff-pgtest`, created on first use), through `setpriv`. `initdb` runs once per
//! machine and PostgreSQL version into a template kept in the temporary directory; each cluster
//! starts from a copy of it, which is faster than `initdb` (see [`Startup`]).
//! The server gets a parent-death signal, so a test process killed outright does not leave it
//! running. Linux sends it when the *thread* that started the server ends: keep a cluster on
//! the thread that started it (a test's own), never in a static another test's thread uses.
//!
//! A whole test run can share one cluster instead: `skiff-test-pg COMMAND…` (this crate's
//! binary) starts one and runs the command with [`SHARED_HOST_ENV`] naming its socket
//! directory; each [`TestDatabase`] is then a database in it, made and dropped by its test.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The system user the server runs as when the tests run as root.
const SERVER_USER: &str = "skiff-pgtest";
/// The cluster's superuser (trust authentication on its private socket).
const SUPERUSER: &str = "skiff";
/// How long a server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections a cluster of one test's own accepts.
const OWN_CONNECTIONS: u32 = 40;
/// Connections the run's shared cluster accepts: every gateway of the tests running at once
/// (a pool of a few each, and its listener), and their tests' own stores.
const SHARED_CONNECTIONS: u32 = 300;
/// The socket directory of a cluster shared by a whole test run (set by `skiff-test-pg`).
pub const SHARED_HOST_ENV: &str = "SKIFF_TEST_PG_HOST";

/// How long starting took: `initdb` (only when this process made the template) and the copy
/// and start of the server.
#[derive(Clone, Copy, Debug)]
pub struct Startup {
    pub initdb: Option<Duration>,
    pub copy_and_start: Duration,
}

/// How the server trades durability for speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// `fsync = off`: for tests, where a crashed machine loses nothing that matters.
    Tests,
    /// `fsync = on` and the server's default `synchronous_commit = on`, as a production server
    /// is configured — for benchmarks. `PgStore` sets `synchronous_commit = off` on its own
    /// sessions, which is what SQLite's WAL with `synchronous = NORMAL` promises (an OS crash
    /// may lose the last commits, never corrupt): the two compare like with like. The server
    /// also loads `pg_stat_statements` (planning tracked too), so a benchmark can print where
    /// the server's time went (`CREATE EXTENSION pg_stat_statements` to read it).
    LikeSqliteNormal,
}

pub struct PgCluster {
    dir: tempfile::TempDir,
    server: Child,
    bin: PathBuf,
    databases: AtomicUsize,
    durability: Durability,
    max_connections: u32,
    startup: Startup,
}

impl PgCluster {
    /// A cluster for tests (`fsync = off`).
    pub fn start() -> Self {
        Self::start_with(Durability::Tests)
    }

    pub fn start_with(durability: Durability) -> Self {
        Self::start_full(durability, OWN_CONNECTIONS)
    }

    /// A cluster for a whole test run's processes (`skiff-test-pg`): as [`PgCluster::start`],
    /// with room for the connections of every test running at once.
    pub fn start_shared() -> Self {
        Self::start_full(Durability::Tests, SHARED_CONNECTIONS)
    }

    fn start_full(durability: Durability, max_connections: u32) -> Self {
        let bin = bin_dir();
        let user = server_user();
        let (template, initdb) = template(&bin, user.as_ref());
        let started = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("skiff-pg-")
            .tempdir()
            .unwrap();
        if let Some(user) = &user {
            std::os::unix::fs::chown(dir.path(), Some(user.uid), Some(user.gid)).unwrap();
        }
        let data = dir.path().join("data");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(&template)
            .arg(&data)
            .status()
            .unwrap();
        assert!(copied.success(), "could not copy the PostgreSQL template");
        let server = spawn_server(&bin, user.as_ref(), dir.path(), durability, max_connections);
        let mut cluster = Self {
            dir,
            server,
            bin,
            databases: AtomicUsize::new(0),
            durability,
            max_connections,
            startup: Startup {
                initdb,
                copy_and_start: Duration::ZERO,
            },
        };
        cluster.wait_ready();
        cluster.startup.copy_and_start = started.elapsed();
        cluster
    }

    /// The directory the server's socket is in (its `host`).
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn startup(&self) -> Startup {
        self.startup
    }

    /// A new, empty database; returns its connection string (`host=… user=… dbname=…`).
    pub fn fresh_database(&self) -> String {
        let name = format!("db{}", self.databases.fetch_add(1, Ordering::Relaxed) + 1);
        createdb(&self.bin, self.socket_dir(), &name);
        connection_string(self.socket_dir(), &name)
    }

    /// A login role `role` that must give `password` over the socket (SCRAM; everyone else
    /// keeps trust authentication), owning a new database of its name; returns that
    /// database's name. For tests of a password kept out of a url.
    pub fn role_with_password(&self, role: &str, password: &str) -> String {
        let sql = format!("CREATE ROLE {role} LOGIN PASSWORD '{password}'");
        let out = Command::new(self.bin.join("psql"))
            .arg("-h")
            .arg(self.socket_dir())
            .args([
                "-U",
                SUPERUSER,
                "-d",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                &sql,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "creating role {role} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = Command::new(self.bin.join("createdb"))
            .arg("-h")
            .arg(self.socket_dir())
            .args(["-U", SUPERUSER, "-O", role, role])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The first matching line wins: the role's own line goes in front of trust.
        let hba = self.dir.path().join("data").join("pg_hba.conf");
        let rest = std::fs::read_to_string(&hba).unwrap();
        std::fs::write(&hba, format!("local all {role} scram-sha-256\n{rest}")).unwrap();
        let pid = rustix::process::Pid::from_child(&self.server);
        rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
        // The reload is done once a connection without the password is refused.
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let out = Command::new(self.bin.join("psql"))
                .arg("-h")
                .arg(self.socket_dir())
                .args(["-U", role, "-d", role, "-w", "-c", "SELECT 1"])
                .output()
                .unwrap();
            if !out.status.success() {
                return role.to_owned();
            }
            assert!(Instant::now() < deadline, "pg_hba.conf was not reloaded");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server the way an operator's restart does (a fast shutdown: open sessions
    /// are ended, the data kept) and waits for it to exit. Its databases are back after
    /// [`PgCluster::start_again`].
    pub fn stop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.server);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        let _ = self.server.wait();
    }

    /// Starts the stopped server again on the same data and socket.
    pub fn start_again(&mut self) {
        let user = server_user();
        self.server = spawn_server(
            &self.bin,
            user.as_ref(),
            self.dir.path(),
            self.durability,
            self.max_connections,
        );
        self.wait_ready();
    }

    /// A restart: [`PgCluster::stop`], then [`PgCluster::start_again`].
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// The server's log so far, for a test's failure message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Waits for the server to say "ready" in its `postmaster.pid` (PostgreSQL writes its
    /// status there); a server that exits first fails the test with its log.
    fn wait_ready(&mut self) {
        let pid_file = self.dir.path().join("data").join("postmaster.pid");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(&pid_file)
                && text.lines().nth(7).map(str::trim) == Some("ready")
            {
                return;
            }
            if let Some(status) = self.server.try_wait().unwrap() {
                panic!(
                    "PostgreSQL exited ({status}) before it was ready:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "PostgreSQL was not ready within {START_TIMEOUT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// `createdb NAME` on the server whose socket is in `host`.
fn createdb(bin: &Path, host: &Path, name: &str) {
    let out = Command::new(bin.join("createdb"))
        .arg("-h")
        .arg(host)
        .args(["-U", SUPERUSER, name])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "createdb {name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn connection_string(host: &Path, name: &str) -> String {
    format!("host={} user={SUPERUSER} dbname={name}", host.display())
}

/// A fresh, empty database for one test: in the run's shared cluster when [`SHARED_HOST_ENV`]
/// names one, else in a cluster of the test's own (keep it on the test's thread, as a
/// [`PgCluster`]). Dropped at the end (`dropdb --force`, ending the connections left), or
/// with its own cluster.
pub struct TestDatabase {
    host: PathBuf,
    name: String,
    bin: PathBuf,
    /// The cluster of this database alone, when no shared one was named.
    own: Option<PgCluster>,
}

impl TestDatabase {
    pub fn new() -> Self {
        let bin = bin_dir();
        match std::env::var_os(SHARED_HOST_ENV).filter(|h| !h.is_empty()) {
            Some(host) => {
                let host = PathBuf::from(host);
                // Unique across the run's test processes, and across runs sharing a cluster
                // whose earlier test was killed before it dropped its database.
                static MADE: AtomicUsize = AtomicUsize::new(0);
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos());
                let name = format!(
                    "t{}_{}_{nanos}",
                    std::process::id(),
                    MADE.fetch_add(1, Ordering::Relaxed)
                );
                createdb(&bin, &host, &name);
                Self {
                    host,
                    name,
                    bin,
                    own: None,
                }
            }
            None => {
                let cluster = PgCluster::start();
                let name = "db1".to_owned();
                createdb(&bin, cluster.socket_dir(), &name);
                Self {
                    host: cluster.socket_dir().to_path_buf(),
                    name,
                    bin,
                    own: Some(cluster),
                }
            }
        }
    }

    /// Its connection string (`host=… user=… dbname=…`), as `[store] url` takes it.
    pub fn url(&self) -> String {
        connection_string(&self.host, &self.name)
    }

    /// The directory the server's socket is in.
    pub fn host(&self) -> &Path {
        &self.host
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its server's log so far, for a test's failure message.
    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.host.join("server.log")).unwrap_or_default()
    }

    /// Every row of the database as `pg_dump` writes it (data only, as text): what a test
    /// searches for a value that must never be stored in the clear.
    pub fn dump(&self) -> Vec<u8> {
        let out = Command::new(self.bin.join("pg_dump"))
            .arg("-h")
            .arg(&self.host)
            .args(["-U", SUPERUSER, "--data-only", &self.name])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_dump {} failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }
}

impl Default for TestDatabase {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if self.own.is_none() {
            // Best effort: the shared cluster goes away with its run anyway.
            let _ = Command::new(self.bin.join("dropdb"))
                .arg("-h")
                .arg(&self.host)
                .args(["-U", SUPERUSER, "--force", &self.name])
                .output();
        }
    }
}

/// The server on the data directory in `dir`, listening on a socket there, logging to
/// `server.log` there (appended to, so a restart keeps the earlier log).
fn spawn_server(
    bin: &Path,
    user: Option<&ServerUser>,
    dir: &Path,
    durability: Durability,
    max_connections: u32,
) -> Child {
    let log = File::options()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .unwrap();
    if let Some(user) = user {
        std::os::unix::fs::chown(dir.join("server.log"), Some(user.uid), None).unwrap();
    }
    let (fsync, synchronous_commit) = match durability {
        Durability::Tests => ("off", "off"),
        Durability::LikeSqliteNormal => ("on", "on"),
    };
    let mut server = as_server_user(user, &bin.join("postgres"));
    server
        .arg("-D")
        .arg(dir.join("data"))
        .arg("-k")
        .arg(dir)
        .args(["-c", "listen_addresses="])
        .args(["-c", &format!("fsync={fsync}")])
        .args(["-c", &format!("synchronous_commit={synchronous_commit}")])
        .args(["-c", "shared_buffers=32MB"])
        .args(["-c", &format!("max_connections={max_connections}")])
        .args(match durability {
            Durability::Tests => &[][..],
            Durability::LikeSqliteNormal => &[
                "-c",
                "shared_preload_libraries=pg_stat_statements",
                "-c",
                "pg_stat_statements.track_planning=on",
            ][..],
        })
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    server.spawn().unwrap()
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        // SIGQUIT: immediate shutdown — the data is thrown away with the directory.
        let pid = rustix::process::Pid::from_child(&self.server);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::QUIT);
        let _ = self.server.wait();
    }
}

struct ServerUser {
    uid: u32,
    gid: u32,
}

/// `None` when the tests do not run as root: the server then runs as whoever runs them.
fn server_user() -> Option<ServerUser> {
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let _lock = machine_lock();
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id")
            .args([flag, SERVER_USER])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    if id("-u").is_none() {
        // Another program adding a user at the same moment holds /etc/passwd's lock
        // (useradd exits 10): try again briefly.
        for _ in 0..50 {
            let status = Command::new("useradd")
                .args([
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    SERVER_USER,
                ])
                .status()
                .expect("useradd (package passwd) is needed to run PostgreSQL as root");
            if status.success() || id("-u").is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Some(ServerUser {
        uid: id("-u").unwrap_or_else(|| panic!("could not create the user {SERVER_USER}")),
        gid: id("-g").unwrap_or_else(|| panic!("user {SERVER_USER} has no group")),
    })
}

/// `program` as the server user (when root), dying with the thread that started it.
fn as_server_user(user: Option<&ServerUser>, program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    if let Some(user) = user {
        cmd.arg(format!("--reuid={}", user.uid))
            .arg(format!("--regid={}", user.gid))
            .arg("--init-groups");
    }
    cmd.arg("--pdeathsig=KILL").arg(program);
    cmd
}

/// Serializes the machine-wide set-up (the user, the template) between test processes.
fn machine_lock() -> File {
    let path = std::env::temp_dir().join("skiff-pgtest.lock");
    let file = File::options()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).unwrap();
    file
}

/// The data directory `initdb` made for this PostgreSQL version and user, making it first if
/// needed (and then how long `initdb` took).
fn template(bin: &Path, user: Option<&ServerUser>) -> (PathBuf, Option<Duration>) {
    let version = bin
        .parent()
        .and_then(Path::file_name)
        .map(|v| v.to_string_lossy().into_owned())
        .unwrap_or_else(|| "pg".into());
    let owner = user.map_or_else(|| rustix::process::geteuid().as_raw(), |u| u.uid);
    let root = std::env::temp_dir().join(format!("skiff-pg-template-{version}-{owner}"));
    let data = root.join("data");
    let _lock = machine_lock();
    // A template is complete once renamed into place; its owner must be the server's user.
    if data.join("PG_VERSION").exists() && std::fs::metadata(&data).is_ok_and(|m| m.uid() == owner)
    {
        return (data, None);
    }
    let _ = std::fs::remove_dir_all(&root);
    let partial = std::env::temp_dir().join(format!(
        "skiff-pg-template-{version}-{owner}.partial-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir(&partial).unwrap();
    if let Some(user) = user {
        std::os::unix::fs::chown(&partial, Some(user.uid), Some(user.gid)).unwrap();
    }
    let took = initdb(bin, user, &partial.join("data"));
    std::fs::rename(&partial, &root).unwrap();
    (data, Some(took))
}

/// Runs `initdb` into `data` (a directory the server user may create); returns how long it
/// took.
fn initdb(bin: &Path, user: Option<&ServerUser>, data: &Path) -> Duration {
    let started = Instant::now();
    let out = as_server_user(user, &bin.join("initdb"))
        .arg("-D")
        .arg(data)
        .args(["-U", SUPERUSER, "--auth=trust", "--no-sync"])
        .args(["--encoding=UTF8", "--locale=C"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "initdb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    started.elapsed()
}

/// How long `initdb` takes here, measured afresh (into a directory thrown away after), for
/// benchmarks to print: what a cluster per test would cost without the template.
pub fn time_initdb() -> Duration {
    let bin = bin_dir();
    let user = server_user();
    let dir = tempfile::Builder::new()
        .prefix("skiff-pg-initdb-")
        .tempdir()
        .unwrap();
    if let Some(user) = &user {
        std::os::unix::fs::chown(dir.path(), Some(user.uid), Some(user.gid)).unwrap();
    }
    initdb(&bin, user.as_ref(), &dir.path().join("data"))
}

/// Where Debian keeps the server's programs (`/usr/lib/postgresql/<N>/bin`, the newest N),
/// or `SKIFF_PG_BIN`.
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SKIFF_PG_BIN") {
        return PathBuf::from(dir);
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let major: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((major, bin))
        })
        .max_by_key(|(major, _)| *major);
    match newest {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL's server is not installed (no /usr/lib/postgresql/<N>/bin/initdb): \
             scripts/test installs it, or run `apt-get install postgresql`"
        ),
    }
}
