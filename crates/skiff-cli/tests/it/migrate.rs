//! `skiff admin migrate --to postgres://…` on a real gateway's state: the copy reads the same
//! through the store on PostgreSQL, new writes continue after it, and the refusals (a gateway
//! running, a target with rows, a bad url, a row PostgreSQL refuses mid-copy) leave the target
//! as it was. The url's password is never printed.

use crate::harness::{Gateway, stderr, stdout};
use skiff_protocol::SessionId;
use skiff_protocol::event::EventKind;
use skiff_protocol::migration::MigrationReport;
use skiff_store::{Backend, PgStore, Scope, Store};
use skiff_test_support::TempGitRepo;
use skiff_test_support::postgres::TestDatabase;

const PASSWORD: &str = "hunter2-pg-Secret";

const SCRIPT: &str = r#"
[[turns]]
text = "Checking the file."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "cat notes.txt" }

[[turns]]
text = "The notes are fine."
"#;

/// A url with a password for `db` (trust authentication ignores it).
fn url_of(db: &TestDatabase) -> String {
    let host = url_encode(&db.host().display().to_string());
    format!("postgres://skiff:{PASSWORD}@{host}/{}", db.name())
}

/// A gateway's state with two sessions that ran turns (transcripts, runs, attempts, events,
/// audit), a child user and their token; the gateway still running. On SQLite whatever
/// `SKIFF_TEST_STORE` says: the migration's source is the state dir's SQLite file.
fn populated() -> (Gateway, Vec<String>) {
    let gw = Gateway::start_sqlite(SCRIPT);
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n")]);
    let sessions = vec![
        gw.new_session(repo.path(), "fake/model", "look at the notes"),
        gw.new_session(repo.path(), "fake/model", "and again"),
    ];
    let out = gw.run(&[
        "admin",
        "user",
        "add",
        "ada@example.com",
        "--role",
        "member",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = gw.run(&[
        "admin",
        "token",
        "create",
        "--user",
        "ada@example.com",
        "--scope",
        "write",
        "--expires",
        "1d",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    (gw, sessions)
}

fn migrate(gw: &Gateway, url: &str, json: bool) -> std::process::Output {
    let mut args = vec!["admin", "migrate", "--to", url];
    if json {
        args.push("--json");
    }
    let out = gw.run(&args);
    for text in [stdout(&out), stderr(&out)] {
        assert!(
            !text.contains(PASSWORD),
            "the password was printed:\n{text}"
        );
    }
    out
}

/// Rows in the target's tables (but its bookkeeping), counted by a plain client.
fn target_rows(url: &str) -> i64 {
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
    let tables: Vec<String> = client
        .query(
            "SELECT table_name::text FROM information_schema.tables
             WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'
             AND table_name NOT IN ('skiff_schema', 'audit_next', 'users')",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    tables
        .iter()
        .map(|t| -> i64 {
            client
                .query_one(&format!("SELECT count(*) FROM \"{t}\""), &[])
                .unwrap()
                .get(0)
        })
        .sum()
}

#[test]
fn a_stopped_gateways_state_moves_to_postgres_verified_and_reads_the_same() {
    let (mut gw, sessions) = populated();
    let db = TestDatabase::new();
    let url = url_of(&db);

    // While the gateway runs: refused, and the target is not touched.
    let out = migrate(&gw, &url, false);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("stop the gateway first"),
        "{}",
        stderr(&out)
    );
    assert!(
        postgres::Client::connect(&url, postgres::NoTls)
            .unwrap()
            .query(
                "SELECT 1 FROM information_schema.tables WHERE table_name = 'sessions'",
                &[]
            )
            .unwrap()
            .is_empty(),
        "the refused migration created tables"
    );

    gw.stop();
    let out = migrate(&gw, &url, false);
    assert!(
        out.status.success(),
        "{}\n{}",
        stderr(&out),
        db.server_log()
    );
    let shown = stdout(&out);
    assert!(shown.contains("counts and checksums match"), "{shown}");
    assert!(shown.contains("postgres://skiff:***@"), "{shown}");
    let entries = shown
        .lines()
        .find(|l| l.starts_with("entries "))
        .unwrap_or_else(|| panic!("no entries row:\n{shown}"));
    assert!(entries.ends_with("ok"), "{entries}");
    assert!(stderr(&out).contains("copied entries:"), "{}", stderr(&out));
    // The loaded tables have planner statistics (ANALYZE ran): `reltuples` is -1 until then.
    let planned: f32 = postgres::Client::connect(&url, postgres::NoTls)
        .unwrap()
        .query_one(
            "SELECT reltuples FROM pg_class WHERE relname = 'entries'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(planned > 0.0, "entries has no statistics: {planned}");

    // Through the store: the same sessions, transcripts, runs, attempts, events and audit.
    let sqlite = Store::open(&gw.state_dir.join("skiff.db")).unwrap();
    let pg = PgStore::connect(&url).unwrap();
    let (sqlite, pg): (&dyn Backend, &dyn Backend) = (&sqlite, &pg);
    let admin = Scope::new("usr_admin", "ten_default");
    assert_eq!(
        sqlite.sessions(&admin).unwrap(),
        pg.sessions(&admin).unwrap()
    );
    let mut last = 0;
    for id in &sessions {
        let id = SessionId::parse(id).unwrap();
        let transcript = pg.transcript(&admin, &id).unwrap();
        assert!(transcript.len() >= 3, "{transcript:?}");
        assert_eq!(sqlite.transcript(&admin, &id).unwrap(), transcript);
        assert_eq!(
            sqlite.runs(&admin, &id).unwrap(),
            pg.runs(&admin, &id).unwrap()
        );
        assert_eq!(
            sqlite.attempts(&admin, &id).unwrap(),
            pg.attempts(&admin, &id).unwrap()
        );
        let events = pg.events_after(&admin, &id, 2, 10_000).unwrap();
        assert!(!events.is_empty());
        assert_eq!(sqlite.events_after(&admin, &id, 2, 10_000).unwrap(), events);
        last = sqlite.last_event_cursor(&admin, &id).unwrap();
    }
    assert_eq!(sqlite.audit_rows().unwrap(), pg.audit_rows().unwrap());
    assert_eq!(
        sqlite.audit_last(10_000).unwrap(),
        pg.audit_last(10_000).unwrap()
    );
    assert_eq!(sqlite.users(None).unwrap(), pg.users(None).unwrap());
    assert_eq!(sqlite.token_rows().unwrap(), pg.token_rows().unwrap());

    // New writes on PostgreSQL continue after the copied ones.
    let id = SessionId::parse(sessions.last().unwrap()).unwrap();
    let next = pg
        .append_event(
            &admin,
            &id,
            None,
            EventKind::TextDelta {
                text: "more".into(),
            },
        )
        .unwrap();
    assert_eq!(next.cursor, last + 1);
    let newest = pg.audit_last(1).unwrap()[0].id;
    pg.audit(
        &admin,
        "usr_admin",
        "session.show",
        id.as_str(),
        "allowed",
        &serde_json::json!({}),
    )
    .unwrap();
    assert_eq!(pg.audit_last(1).unwrap()[0].id, newest + 1);

    // Again into the same database: refused (it has rows), in JSON too.
    let out = migrate(&gw, &url, true);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the target database is not empty"),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&out).is_empty(), "{}", stdout(&out));

    // Into a fresh one with --json: the report, every table verified.
    let fresh_db = TestDatabase::new();
    let fresh = url_of(&fresh_db);
    let out = migrate(&gw, &fresh, true);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: MigrationReport = serde_json::from_str(&stdout(&out)).unwrap();
    assert!(report.committed);
    assert!(report.target.contains(":***@"), "{}", report.target);
    assert!(report.tables.iter().all(|t| t.matches()), "{report:?}");
    assert!(report.rows() > 0);
}

#[test]
fn a_bad_url_is_refused_without_echoing_its_password() {
    let (mut gw, _) = populated();
    gw.stop();
    let out = migrate(
        &gw,
        &format!("postgres://skiff:{PASSWORD}@host:notaport/db"),
        false,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("malformed"), "{}", stderr(&out));
    assert!(stderr(&out).contains("port"), "{}", stderr(&out));
    let out = migrate(&gw, &format!("mysql://skiff:{PASSWORD}@host/db"), false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--to takes a PostgreSQL url"),
        "{}",
        stderr(&out)
    );
    // Unreachable: exit 3, naming the host but not the password.
    let out = migrate(
        &gw,
        &format!("postgres://skiff:{PASSWORD}@%2Fnonexistent-skiff-socket/db"),
        false,
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nonexistent-skiff-socket"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_row_postgres_refuses_mid_copy_leaves_the_target_empty() {
    let (mut gw, _) = populated();
    gw.stop();
    // A chat thread naming no session (with SQLite's foreign keys off on this connection):
    // PostgreSQL's constraint refuses it, after every table before it was copied.
    let raw = rusqlite::Connection::open(gw.state_dir.join("skiff.db")).unwrap();
    raw.pragma_update(None, "foreign_keys", "OFF").unwrap();
    raw.execute(
        "INSERT INTO ingress_threads VALUES ('C1', '1.2', 'usr_admin', 'ten_default', 'ses_gone')",
        [],
    )
    .unwrap();
    let db = TestDatabase::new();
    let url = url_of(&db);
    let out = migrate(&gw, &url, false);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let said = stderr(&out);
    assert!(said.contains("table ingress_threads"), "{said}");
    assert!(said.contains("nothing was copied"), "{said}");
    assert!(
        said.contains("copied entries:"),
        "earlier tables were copied first: {said}"
    );
    assert_eq!(target_rows(&url), 0, "the failed copy left rows behind");
}

#[test]
fn the_password_can_stay_out_of_the_url_and_the_process_list() {
    let (mut gw, _) = populated();
    gw.stop();
    let cluster = skiff_test_support::postgres::PgCluster::start();
    let db = cluster.role_with_password("migrator", PASSWORD);
    let host = url_encode(&cluster.socket_dir().display().to_string());
    let url = format!("postgres://migrator@{host}/{db}");

    // Without the password the server refuses, and the error says so.
    let out = gw
        .cli()
        .args(["admin", "migrate", "--to", &url])
        .env_remove("PGPASSWORD")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("password"), "{}", stderr(&out));

    // `PGPASSWORD` gives it, as to `psql`; the copy is verified and nothing prints it.
    let out = gw
        .cli()
        .args(["admin", "migrate", "--to", &url])
        .env("PGPASSWORD", PASSWORD)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    for text in [stdout(&out), stderr(&out)] {
        assert!(
            !text.contains(PASSWORD),
            "the password was printed:\n{text}"
        );
    }
    assert!(
        stdout(&out).contains("counts and checksums match"),
        "{}",
        stdout(&out)
    );
}

/// `text` percent-encoded for a url's host part (a socket directory).
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
