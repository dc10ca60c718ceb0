//! A gateway process for one test, and helpers to run the CLI against it.
//!
//! `SKIFF_TEST_STORE=postgres` runs every gateway of the suite on PostgreSQL (a fresh
//! database each, [`TestStore`]); unset or `sqlite`, on the state dir's SQLite file.

use skiff_test_support::postgres::TestDatabase;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, OnceLock};

pub const SKIFF: &str = env!("CARGO_BIN_EXE_skiff");

/// Which store the suite's gateways run on: `SKIFF_TEST_STORE` (`sqlite`, the default, or
/// `postgres`). Anything else fails the test naming the choices.
pub fn on_postgres() -> bool {
    match std::env::var("SKIFF_TEST_STORE").as_deref() {
        Err(_) | Ok("" | "sqlite") => false,
        Ok("postgres") => true,
        Ok(other) => panic!("SKIFF_TEST_STORE={other:?}: use `sqlite` or `postgres`"),
    }
}

/// The database one test's gateway runs on: the state dir's SQLite `skiff.db`, or a fresh
/// PostgreSQL database (in the run's shared cluster under `skiff-test-pg`, else in one of the
/// test's own), dropped with it.
pub enum TestStore {
    Sqlite,
    Postgres(TestDatabase),
}

impl TestStore {
    /// What `SKIFF_TEST_STORE` asks for.
    pub fn from_env() -> TestStore {
        if on_postgres() {
            TestStore::Postgres(TestDatabase::new())
        } else {
            TestStore::Sqlite
        }
    }

    /// The `[store]` table to put in the gateway's skiff.toml (none for SQLite).
    pub fn config(&self) -> String {
        match self {
            TestStore::Sqlite => String::new(),
            TestStore::Postgres(db) => format!("[store]\nurl = \"{}\"\n", db.url()),
        }
    }

    /// `extra_config` with this store's `url` added (into its `[store]` table when it has one).
    fn with_config(&self, extra_config: &str) -> String {
        let table = self.config();
        if table.is_empty() {
            return extra_config.to_owned();
        }
        if extra_config.contains("[store]\n") {
            extra_config.replacen("[store]\n", &table, 1)
        } else {
            format!("{extra_config}\n{table}")
        }
    }

    /// Opens the store the gateway on `state_dir` runs on, as the gateway does.
    pub fn open(&self, state_dir: &Path) -> Arc<dyn skiff_store::Backend> {
        let at = match self {
            TestStore::Sqlite => {
                return skiff_store::open_backend(skiff_store::Location::Sqlite(
                    &state_dir.join("skiff.db"),
                ))
                .unwrap();
            }
            TestStore::Postgres(db) => db.url(),
        };
        skiff_store::open_backend(skiff_store::Location::Postgres {
            url: &at,
            password: None,
        })
        .unwrap()
    }

    /// Every byte the database keeps: the SQLite file and its WAL, or a `pg_dump` of the
    /// PostgreSQL database — for tests that a value is never stored in the clear.
    pub fn raw_bytes(&self, state_dir: &Path) -> Vec<u8> {
        match self {
            TestStore::Sqlite => {
                let mut bytes = std::fs::read(state_dir.join("skiff.db")).unwrap();
                bytes.extend(std::fs::read(state_dir.join("skiff.db-wal")).unwrap_or_default());
                bytes
            }
            TestStore::Postgres(db) => db.dump(),
        }
    }
}

pub struct Gateway {
    pub state_dir: PathBuf,
    pub url: String,
    pub token: String,
    config: PathBuf,
    env: Vec<(String, String)>,
    child: Child,
    /// The test's own connection to the store ([`Gateway::store`]); closed before the
    /// database is dropped (fields drop in order).
    opened: OnceLock<Arc<dyn skiff_store::Backend>>,
    store: TestStore,
    _dir: tempfile::TempDir,
}

impl Gateway {
    /// Starts `skiff gateway` with a config holding a scripted provider `fake` that replays
    /// `script` (TOML), and waits for its "listening" line.
    pub fn start(script: &str) -> Gateway {
        Self::start_with(script, "")
    }

    /// Like [`Gateway::start`], with more configuration (worker profiles) appended.
    pub fn start_with(script: &str, extra_config: &str) -> Gateway {
        Self::start_full(script, extra_config, &[])
    }

    /// Like [`Gateway::start_with`], with environment variables for the gateway process
    /// (provider keys), kept across restarts.
    pub fn start_full(script: &str, extra_config: &str, env: &[(&str, &str)]) -> Gateway {
        // A test that names its own database keeps it.
        let store = if extra_config.contains("[store]\nurl") {
            TestStore::Sqlite
        } else {
            TestStore::from_env()
        };
        Self::start_on(store, script, extra_config, env)
    }

    /// Another gateway on `first`'s shared database (an `extra_config` naming its `[store]
    /// url`), joined the way the README says: `first`'s `gateway.json` copied into the new
    /// state dir before it starts, so both hold the deployment's one admin token.
    pub fn join(first: &Gateway, script: &str, extra_config: &str) -> Gateway {
        Self::join_full(first, script, extra_config, &[])
    }

    /// [`Gateway::join`] with environment variables for the gateway process (the deployment's
    /// `SKIFF_VAULT_KEY`), kept across restarts.
    pub fn join_full(
        first: &Gateway,
        script: &str,
        extra_config: &str,
        env: &[(&str, &str)],
    ) -> Gateway {
        assert!(
            extra_config.contains("[store]\nurl"),
            "a gateway joins a shared database only"
        );
        let joined = Self::start_seeded(
            TestStore::Sqlite,
            script,
            extra_config,
            env,
            Some(&first.state_dir.join("gateway.json")),
        );
        assert_eq!(joined.token, first.token, "the admin token is shared");
        joined
    }

    /// Like [`Gateway::start`], on the state dir's SQLite file whatever `SKIFF_TEST_STORE`
    /// says: for tests about that file itself.
    pub fn start_sqlite(script: &str) -> Gateway {
        Self::start_on(TestStore::Sqlite, script, "", &[])
    }

    fn start_on(
        store: TestStore,
        script: &str,
        extra_config: &str,
        env: &[(&str, &str)],
    ) -> Gateway {
        Self::start_seeded(store, script, extra_config, env, None)
    }

    /// [`Gateway::start_on`], with `gateway_file` copied into the state dir first.
    fn start_seeded(
        store: TestStore,
        script: &str,
        extra_config: &str,
        env: &[(&str, &str)],
        gateway_file: Option<&Path>,
    ) -> Gateway {
        let extra_config = store.with_config(extra_config);
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        std::fs::write(dir.path().join("script.toml"), script).unwrap();
        if let Some(file) = gateway_file {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&state_dir)
                .unwrap();
            std::fs::copy(file, state_dir.join("gateway.json")).unwrap();
        }
        let config = dir.path().join("skiff.toml");
        std::fs::write(
            &config,
            format!(
                "[providers.fake]\napi = \"scripted\"\nscript = \"script.toml\"\n{extra_config}"
            ),
        )
        .unwrap();
        let (child, url) = spawn(&state_dir, &config, &env);
        let token = read_token(&state_dir);
        if let TestStore::Postgres(_) = store {
            assert!(
                !state_dir.join("skiff.db").exists(),
                "a gateway started on PostgreSQL wrote SQLite's skiff.db"
            );
        }
        Gateway {
            state_dir,
            url,
            token,
            config,
            env,
            child,
            opened: OnceLock::new(),
            store,
            _dir: dir,
        }
    }

    /// The store this gateway runs on, opened by the test (once, then shared): what the
    /// gateway wrote, read through the same aggregates, on SQLite or PostgreSQL alike.
    pub fn store(&self) -> Arc<dyn skiff_store::Backend> {
        self.opened
            .get_or_init(|| self.store.open(&self.state_dir))
            .clone()
    }

    /// Every byte the gateway's database keeps ([`TestStore::raw_bytes`]).
    pub fn database_bytes(&self) -> Vec<u8> {
        self.store.raw_bytes(&self.state_dir)
    }

    /// Kills the gateway without warning (no shutdown path runs) and starts a new one on the
    /// same state dir.
    pub fn crash_and_restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let (child, url) = spawn(&self.state_dir, &self.config, &self.env);
        self.child = child;
        self.url = url;
        assert_eq!(
            read_token(&self.state_dir),
            self.token,
            "the admin token changed across a restart"
        );
    }

    /// Waits (up to a minute) for the gateway to die by itself — a fault it was configured to
    /// inject killed it — then removes `drop_line` from its config and starts a new one on the
    /// same state dir. Panics when it does not die.
    pub fn await_death_and_restart(&mut self, drop_line: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        // A child's exit has no event to await here but its reaping.
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the gateway did not die at its injected fault"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let config = std::fs::read_to_string(&self.config).unwrap();
        assert!(config.contains(drop_line), "{drop_line:?} not in {config}");
        std::fs::write(&self.config, config.replace(drop_line, "")).unwrap();
        let (child, url) = spawn(&self.state_dir, &self.config, &self.env);
        self.child = child;
        self.url = url;
    }

    /// The config file this gateway was started with.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// A `skiff` command that finds this gateway through its state dir.
    pub fn cli(&self) -> Command {
        let mut cmd = Command::new(SKIFF);
        cmd.arg("--state-dir")
            .arg(&self.state_dir)
            .env_remove("SKIFF_URL")
            .env_remove("SKIFF_TOKEN");
        cmd
    }

    /// Stops the gateway (killed, then reaped) and keeps its state dir for what comes next.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        self.child.wait().unwrap();
    }

    /// Waits for the gateway process to exit on its own (a drain) and reaps it.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }

    /// The gateway process's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.cli().args(args).output().unwrap()
    }

    /// Runs `session new` to completion (it must succeed) and returns the session id.
    pub fn new_session(&self, workspace: &Path, model: &str, prompt: &str) -> String {
        let out = self.run(&[
            "session",
            "new",
            "--json",
            "--workspace",
            workspace.to_str().unwrap(),
            "--model",
            model,
            prompt,
        ]);
        assert!(out.status.success(), "session new: {}", stderr(&out));
        let first: serde_json::Value =
            serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
        first["session_id"].as_str().unwrap().to_owned()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "skiff {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

fn spawn(state_dir: &Path, config: &Path, env: &[(String, String)]) -> (Child, String) {
    let mut child = Command::new(SKIFF)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .arg("--state-dir")
        .arg(state_dir)
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .env("RUST_LOG", "warn")
        // A home of the test's own: the machine's login profile stays out of `exec`'s `bash -l`.
        .env("HOME", state_dir.parent().unwrap_or(state_dir))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("skiff gateway listening on ")
        .unwrap_or_else(|| panic!("unexpected first line from the gateway: {line:?}"))
        .to_owned();
    (child, url)
}

/// `skiff --state-dir DIR gateway --listen ADDR`: its exit status, its first stdout line (when it
/// started, after which it is stopped) and its stderr.
pub fn gateway_once(state_dir: &Path, listen: &str) -> (Option<i32>, String, String) {
    use std::io::Read;
    let mut child = Command::new(SKIFF)
        .arg("--state-dir")
        .arg(state_dir)
        .args(["gateway", "--listen", listen])
        .env("RUST_LOG", "warn")
        .env_remove("SKIFF_URL")
        .env_remove("SKIFF_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    if !first.is_empty() {
        child.kill().unwrap();
    }
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code(), first, err)
}

/// The admin token in the state dir's `gateway.json`; empty when the gateway joined a shared
/// database without one.
fn read_token(state_dir: &Path) -> String {
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(state_dir.join("gateway.json")).unwrap())
            .unwrap();
    file["token"].as_str().unwrap_or_default().to_owned()
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Live processes whose command line contains `needle`, as "pid: command line".
pub fn processes_containing(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            let line = String::from_utf8_lossy(&raw).replace('\0', " ");
            line.contains(needle).then(|| format!("{pid}: {line}"))
        })
        .collect()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn git(repo: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", stderr(&out));
    stdout(&out)
}

/// Configuration that shows `dir` (outside any workspace: a test's FIFOs) to the sandbox of
/// gateway-placed sessions, read-write.
pub fn sandbox_shares(dir: &Path) -> String {
    format!("[gateway]\nlocal_sandbox_paths = [\"{}\"]\n", dir.display())
}
