//! The vault as an operator uses it: `skiff secret set` from stdin, a provider configured with
//! `api_key = "vault:NAME"` sending it as its key, rotation, and the value nowhere else — not
//! in the gateway's log (at debug level), the audit rows, the state dir's files or a message.

use crate::harness::{SKIFF, TestStore, stderr, stdout};
use skiff_test_support::{FakeProvider, FakeResponse, TempGitRepo, openai_sse};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const VALUE: &str = "sk-vault-test-7f3a9c1e5b2d4068";

/// A gateway whose stderr (its log, at debug level) goes to a file the test reads.
struct LoggedGateway {
    child: Child,
    store: TestStore,
    dir: tempfile::TempDir,
}

impl LoggedGateway {
    fn start(provider_url: &str, env: &[(&str, &str)]) -> LoggedGateway {
        Self::start_on(TestStore::from_env(), provider_url, env)
    }

    fn start_on(store: TestStore, provider_url: &str, env: &[(&str, &str)]) -> LoggedGateway {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("skiff.toml"),
            format!(
                "[providers.openai]\napi = \"openai-completions\"\nbase_url = \"{provider_url}/v1\"\napi_key = \"vault:openai\"\n{}",
                store.config()
            ),
        )
        .unwrap();
        let child = spawn(dir.path(), env);
        LoggedGateway { child, store, dir }
    }

    fn restart(&mut self, env: &[(&str, &str)]) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.child = spawn(self.dir.path(), env);
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn log(&self) -> Vec<u8> {
        std::fs::read(self.dir.path().join("gateway.log")).unwrap()
    }

    fn cli(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = Command::new(SKIFF)
            .arg("--state-dir")
            .arg(self.state())
            .args(args)
            .env_remove("SKIFF_URL")
            .env_remove("SKIFF_TOKEN")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            pipe.write_all(text.as_bytes()).unwrap();
        }
        drop(pipe);
        child.wait_with_output().unwrap()
    }

    fn session(&self, repo: &Path) -> Output {
        self.cli(
            &[
                "session",
                "new",
                "--workspace",
                repo.to_str().unwrap(),
                "--model",
                "openai/gpt-fake",
                "say hi",
            ],
            None,
        )
    }
}

impl Drop for LoggedGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(dir: &Path, env: &[(&str, &str)]) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("gateway.log"))
        .unwrap();
    let mut child = Command::new(SKIFF)
        .envs(env.iter().copied())
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["gateway", "--listen", "127.0.0.1:0", "--config"])
        .arg(dir.join("skiff.toml"))
        .env("RUST_LOG", "debug")
        .env("HOME", dir)
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("skiff gateway listening on "), "{line:?}");
    child
}

fn provider() -> (tokio::runtime::Runtime, FakeProvider) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let fake = rt.block_on(FakeProvider::start_with(|_| {
        let mut events = openai_sse::text_chunks(&["Hi."]);
        events.extend(openai_sse::finish("stop"));
        events.extend(openai_sse::done());
        FakeResponse::sse(events)
    }));
    (rt, fake)
}

/// Every file under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let bytes = std::fs::read(entry.path()).unwrap_or_default();
                if bytes.windows(needle.len()).any(|w| w == needle) {
                    found.push(entry.path());
                }
            }
        }
    }
    found
}

fn said(out: &Output) -> String {
    format!("{}{}", stdout(out), stderr(out))
}

#[test]
fn a_secret_piped_in_is_the_providers_key_survives_rotation_and_appears_nowhere_else() {
    let (_rt, fake) = provider();
    let gw = LoggedGateway::start(&fake.base_url(), &[]);
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);

    let out = gw.cli(&["secret", "set", "openai"], Some(&format!("{VALUE}\n")));
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        stdout(&out).contains("stored secret openai"),
        "{}",
        said(&out)
    );
    let key_file = gw.state().join("vault.key");
    let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the key file is created private");

    let out = gw.session(repo.path());
    assert!(out.status.success(), "{}", said(&out));
    let requests = fake.requests();
    assert_eq!(
        requests[0].header("authorization"),
        Some(format!("Bearer {VALUE}").as_str()),
        "the vault's value (without echo's newline) is the provider's key"
    );

    let list = gw.cli(&["secret", "list", "--json"], None);
    assert!(list.status.success(), "{}", said(&list));
    let listed: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(listed["secrets"][0]["name"], "openai");
    let table = gw.cli(&["secret", "list"], None);
    assert!(stdout(&table).starts_with("NAME"), "{}", said(&table));

    let old_key = std::fs::read(&key_file).unwrap();
    let out = gw.cli(&["secret", "rotate-key"], None);
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        stdout(&out).contains("sealed 1 secret(s)"),
        "{}",
        said(&out)
    );
    assert_ne!(std::fs::read(&key_file).unwrap(), old_key);
    assert!(!gw.state().join("vault.key.previous").exists());
    let out = gw.session(repo.path());
    assert!(out.status.success(), "after rotation: {}", said(&out));
    assert_eq!(
        fake.requests().last().unwrap().header("authorization"),
        Some(format!("Bearer {VALUE}").as_str())
    );

    // Refusals say why without the value.
    let mut messages = Vec::new();
    for (args, stdin) in [
        (vec!["secret", "set", "a/b"], Some(VALUE)),
        (vec!["secret", "set", "openai"], Some("")),
        (vec!["secret", "rm", "nothing-here"], None),
    ] {
        let out = gw.cli(&args, stdin);
        assert!(!out.status.success(), "{args:?}");
        messages.push(said(&out));
    }
    assert!(
        messages[2].contains("no secret `nothing-here`"),
        "{messages:?}"
    );
    assert!(messages.iter().all(|m| !m.contains(VALUE)), "{messages:?}");

    let store = gw.store.open(&gw.state());
    let audit = store.audit_rows().unwrap();
    let actions: Vec<(&str, &str)> = audit
        .iter()
        .filter(|r| r.action.starts_with("secret."))
        .map(|r| (r.action.as_str(), r.target.as_str()))
        .collect();
    assert_eq!(
        actions,
        [("secret.set", "openai"), ("secret.rotate_key", "-")],
        "{audit:?}"
    );
    assert!(
        audit.iter().all(|r| !format!("{r:?}").contains(VALUE)),
        "{audit:?}"
    );
    drop(store);

    let log = gw.log();
    assert!(!log.is_empty(), "the gateway logged nothing at debug level");
    assert!(
        !log.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
        "the value reached the gateway's log"
    );
    // The database holds the value only sealed; no other file of the state dir holds it.
    let database = gw.store.raw_bytes(&gw.state());
    assert!(
        database
            .windows(b"secret.set".len())
            .any(|w| w == b"secret.set"),
        "the database's bytes were read"
    );
    assert!(
        !database.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
        "the database holds the value in the clear"
    );
    assert_eq!(
        files_containing(&gw.state(), VALUE.as_bytes()),
        Vec::<PathBuf>::new()
    );
    assert_eq!(
        files_containing(repo.path(), VALUE.as_bytes()),
        Vec::<PathBuf>::new()
    );

    let out = gw.cli(&["secret", "rm", "openai"], None);
    assert!(out.status.success(), "{}", said(&out));
    let sent = fake.requests().len();
    let out = gw.session(repo.path());
    let text = said(&out);
    assert!(
        text.contains("providers.openai.api_key = \"vault:openai\"")
            && text.contains("no secret `openai`"),
        "a missing secret names the config key and the secret: {text}\n{:?}\n{}",
        &fake.requests()[sent..],
        String::from_utf8_lossy(&gw.log())
    );
}

#[test]
fn a_wrong_vault_key_or_one_others_can_read_is_refused_with_a_clear_error() {
    let (_rt, fake) = provider();
    let key_a = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";
    let key_b = "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkI=";
    // On its own database a gateway with the wrong key starts and says so when a secret is
    // used; on a shared one it refuses to start (`gateway_trust.rs`).
    let mut gw = LoggedGateway::start_on(
        TestStore::Sqlite,
        &fake.base_url(),
        &[("SKIFF_VAULT_KEY", key_a)],
    );
    let repo = TempGitRepo::new(&[("README.md", "a repo\n")]);
    let out = gw.cli(&["secret", "set", "openai"], Some(VALUE));
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        !gw.state().join("vault.key").exists(),
        "with SKIFF_VAULT_KEY no key file is written"
    );

    gw.restart(&[("SKIFF_VAULT_KEY", key_b)]);
    let out = gw.session(repo.path());
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("sealed with another key") && text.contains("SKIFF_VAULT_KEY"),
        "{text}"
    );
    assert!(
        fake.requests().is_empty(),
        "no request went out without its key"
    );

    let out = gw.cli(&["secret", "rotate-key"], None);
    assert_eq!(out.status.code(), Some(7), "{}", said(&out));
    assert!(stdout(&out).is_empty(), "no partial output: {}", said(&out));
    assert!(stderr(&out).contains("SKIFF_VAULT_KEY"), "{}", said(&out));

    // The right key again: everything opens, and a rotation prints the new key once.
    gw.restart(&[("SKIFF_VAULT_KEY", key_a)]);
    let out = gw.cli(&["secret", "rotate-key", "--json"], None);
    assert!(out.status.success(), "{}", said(&out));
    let rotated: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let new_key = rotated["new_key"].as_str().unwrap().to_owned();
    gw.restart(&[("SKIFF_VAULT_KEY", &new_key)]);
    let out = gw.session(repo.path());
    assert!(out.status.success(), "{}", said(&out));

    // A key file that others may read is refused, naming the fix.
    let mut gw = LoggedGateway::start_on(TestStore::Sqlite, &fake.base_url(), &[]);
    let out = gw.cli(&["secret", "set", "openai"], Some(VALUE));
    assert!(out.status.success(), "{}", said(&out));
    let key_file = gw.state().join("vault.key");
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    gw.restart(&[]);
    let out = gw.cli(&["secret", "set", "other"], Some("x-value"));
    assert_eq!(out.status.code(), Some(7), "{}", said(&out));
    assert!(
        stderr(&out).contains("chmod 600") && stderr(&out).contains("vault.key"),
        "{}",
        said(&out)
    );
}
