//! Schema migrations, applied in order and tracked with `PRAGMA user_version`.

use crate::{Error, Result};
use rusqlite::{Connection, OptionalExtension};

const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE tokens (
    hash          TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    label         TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL
);

CREATE TABLE sessions (
    id                 TEXT PRIMARY KEY,
    owner_id           TEXT NOT NULL,
    tenant_id          TEXT NOT NULL,
    title              TEXT NOT NULL,
    workspace          TEXT NOT NULL,  -- JSON WorkspaceView
    model_ref          TEXT NOT NULL,
    placement          TEXT NOT NULL DEFAULT 'local',
    lifecycle_revision INTEGER NOT NULL DEFAULT 0,
    leaf_entry_id      TEXT,
    created_at_ms      INTEGER NOT NULL,
    updated_at_ms      INTEGER NOT NULL
);
CREATE INDEX sessions_by_scope ON sessions(owner_id, tenant_id, updated_at_ms);

CREATE TABLE entries (
    id            TEXT PRIMARY KEY,
    session_id    TEXT NOT NULL REFERENCES sessions(id),
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    parent_id     TEXT REFERENCES entries(id),
    run_id        TEXT,
    kind          TEXT NOT NULL,
    body          TEXT NOT NULL,  -- JSON EntryBody
    created_at_ms INTEGER NOT NULL
);
CREATE INDEX entries_by_session ON entries(session_id);

CREATE TABLE runs (
    id             TEXT PRIMARY KEY,
    session_id     TEXT NOT NULL REFERENCES sessions(id),
    owner_id       TEXT NOT NULL,
    tenant_id      TEXT NOT NULL,
    status         TEXT NOT NULL,
    model_ref      TEXT NOT NULL,
    error          TEXT,
    input_tokens   INTEGER NOT NULL DEFAULT 0,
    output_tokens  INTEGER NOT NULL DEFAULT 0,
    created_at_ms  INTEGER NOT NULL,
    finished_at_ms INTEGER
);
CREATE INDEX runs_by_session ON runs(session_id, created_at_ms);
-- Turn admission: at most one unfinished run per session.
CREATE UNIQUE INDEX runs_one_open_per_session ON runs(session_id)
    WHERE status IN ('queued','starting','running','waiting_input','waiting_approval','cancelling');

CREATE TABLE attempts (
    id                     TEXT PRIMARY KEY,
    run_id                 TEXT NOT NULL REFERENCES runs(id),
    session_id             TEXT NOT NULL REFERENCES sessions(id),
    owner_id               TEXT NOT NULL,
    tenant_id              TEXT NOT NULL,
    runtime_node           TEXT NOT NULL,
    owner_epoch            INTEGER NOT NULL,
    status                 TEXT NOT NULL,
    resume_from_attempt_id TEXT REFERENCES attempts(id),
    checkpoint_artifact_id TEXT,
    started_at_ms          INTEGER NOT NULL,
    finished_at_ms         INTEGER
);
-- At most one active attempt per run, enforced by the schema rather than by callers.
CREATE UNIQUE INDEX attempts_one_active_per_run ON attempts(run_id)
    WHERE status IN ('starting','running');

CREATE TABLE events (
    session_id TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    run_id     TEXT,
    at_ms      INTEGER NOT NULL,
    body       TEXT NOT NULL,  -- JSON EventKind
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;

CREATE TABLE audit (
    id        INTEGER PRIMARY KEY,
    at_ms     INTEGER NOT NULL,
    owner_id  TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    actor     TEXT NOT NULL,
    action    TEXT NOT NULL,
    target    TEXT NOT NULL,
    decision  TEXT NOT NULL,
    detail    TEXT NOT NULL  -- JSON metadata only: never prompts, completions or secrets
);
"#,
    r#"
CREATE TABLE environments (
    id              TEXT PRIMARY KEY,
    owner_id        TEXT NOT NULL,
    tenant_id       TEXT NOT NULL,
    profile         TEXT NOT NULL,
    provider        TEXT NOT NULL,
    state           TEXT NOT NULL,
    -- Written before the provider is called; the lease id derives from it.
    op_id           TEXT NOT NULL UNIQUE,
    lease_id        TEXT,
    lease           TEXT,            -- JSON: how to reach and trust the box
    bundle_hash     TEXT,
    error           TEXT,
    created_at_ms   INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL,
    last_used_at_ms INTEGER NOT NULL,
    expires_at_ms   INTEGER,
    model_requests     INTEGER NOT NULL DEFAULT 0,
    input_tokens       INTEGER NOT NULL DEFAULT 0,
    output_tokens      INTEGER NOT NULL DEFAULT 0,
    bytes_in           INTEGER NOT NULL DEFAULT 0,
    bytes_out          INTEGER NOT NULL DEFAULT 0,
    gateway_tool_calls INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX environments_by_scope ON environments(owner_id, tenant_id, created_at_ms);
"#,
    r#"
-- Content-addressed blobs live in <state>/artifacts/<blake3>; these are their metadata rows.
-- Two tenants may hold rows for the same hash: a blob goes only when no row names it.
CREATE TABLE artifacts (
    id            TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    session_id    TEXT,
    run_id        TEXT,
    role          TEXT NOT NULL,   -- checkpoint | manifest | result | log
    retention     TEXT NOT NULL,   -- while_retryable | session | transient
    hash          TEXT NOT NULL,   -- blake3 (hex) of the stored blob
    size          INTEGER NOT NULL,
    seq           INTEGER,         -- checkpoints: 1, 2, 3… per session
    meta          TEXT NOT NULL DEFAULT '{}',  -- JSON metadata only (refs, counts), never content
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER
);
CREATE INDEX artifacts_by_session ON artifacts(owner_id, tenant_id, session_id, role, seq);
CREATE INDEX artifacts_by_hash ON artifacts(hash);
CREATE UNIQUE INDEX artifacts_one_checkpoint_per_seq ON artifacts(session_id, seq)
    WHERE role = 'checkpoint';
"#,
    r#"
-- Sessions placed on workers; `sessions.placement` mirrors `state`.
CREATE TABLE placements (
    session_id     TEXT PRIMARY KEY REFERENCES sessions(id),
    owner_id       TEXT NOT NULL,
    tenant_id      TEXT NOT NULL,
    state          TEXT NOT NULL,
    profile        TEXT NOT NULL,
    generation     INTEGER NOT NULL DEFAULT 0,
    environment_id TEXT,
    owner_epoch    INTEGER NOT NULL DEFAULT 0,
    base_manifest  TEXT,
    bundle_hash    TEXT,
    worker_pid     INTEGER,
    error          TEXT,
    updated_at_ms  INTEGER NOT NULL
);
CREATE INDEX placements_by_environment ON placements(environment_id);

-- Terminal replies of worker operations: a duplicate gets the same answer.
CREATE TABLE worker_ops (
    session_id  TEXT NOT NULL,
    owner_epoch INTEGER NOT NULL,
    stream      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    method      TEXT NOT NULL,
    call_hash   TEXT NOT NULL,  -- blake3 of the call: a sequence number is not reusable
    reply       TEXT NOT NULL,  -- JSON Reply or model events; never credentials
    at_ms       INTEGER NOT NULL,
    PRIMARY KEY (session_id, owner_epoch, stream, seq)
) WITHOUT ROWID;

-- ACK cursors: the last applied sequence number per stream and epoch.
CREATE TABLE worker_cursors (
    session_id  TEXT NOT NULL,
    owner_epoch INTEGER NOT NULL,
    stream      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    PRIMARY KEY (session_id, owner_epoch, stream)
) WITHOUT ROWID;

-- Admitted credentials (by id only): each is admitted once.
CREATE TABLE worker_credentials (
    credential_id  TEXT PRIMARY KEY,
    session_id     TEXT NOT NULL,
    environment_id TEXT NOT NULL,
    used_at_ms     INTEGER NOT NULL
);
"#,
    r#"
-- Control UI cookies refused since a logout, by the blake3 of the cookie's nonce, until the
-- cookie would expire anyway (then the row is pruned).
CREATE TABLE ui_revoked_cookies (
    nonce_hash    TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    revoked_at_ms INTEGER NOT NULL
);
"#,
    r#"
-- What the rules left behind when the workspace was laid onto the box (for people to read).
ALTER TABLE placements ADD COLUMN left_out TEXT;
"#,
    r#"
-- Snapshots of prepared boxes (the copy lives with the provider). The row is written
-- (`capturing`) before the provider is called, so a capture a crash interrupted is found and
-- removed; only `ready` rows start boxes.
CREATE TABLE snapshots (
    id              TEXT PRIMARY KEY,
    owner_id        TEXT NOT NULL,
    tenant_id       TEXT NOT NULL,
    profile         TEXT NOT NULL,
    key             TEXT NOT NULL,    -- hex: setup script, profile, bundle hash, key files
    environment_id  TEXT NOT NULL,    -- the environment it was taken from
    lease_id        TEXT NOT NULL,    -- the provider's lease it was taken from
    size_bytes      INTEGER NOT NULL DEFAULT 0,
    state           TEXT NOT NULL,    -- capturing | ready | deleting
    created_at_ms   INTEGER NOT NULL,
    last_used_at_ms INTEGER NOT NULL
);
CREATE INDEX snapshots_by_key ON snapshots(owner_id, tenant_id, profile, key, state);
CREATE INDEX snapshots_by_profile ON snapshots(profile, state, last_used_at_ms);

-- The snapshot a box's home started from: a restarted gateway adopting a provision in flight
-- must ask for the same kind of box.
ALTER TABLE environments ADD COLUMN snapshot_id TEXT;

-- 1 while the box holds nothing the gateway lacks (the workspace was just laid down, or the
-- last turn's work was brought back); 0 from the moment a turn is handed to the worker. Only
-- a box in step is given back when its session is parked.
ALTER TABLE placements ADD COLUMN box_in_step INTEGER NOT NULL DEFAULT 0;

-- The key of the setup whose result a box's home holds (NULL: none known). A warm box with the
-- key a session's setup has skips that setup.
ALTER TABLE environments ADD COLUMN prepared_key TEXT;
"#,
    r#"
-- Of a run's input tokens, how many the provider read from its prompt cache and how many it
-- wrote to it (each part of input_tokens).
ALTER TABLE runs ADD COLUMN cache_read_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN cache_write_tokens INTEGER NOT NULL DEFAULT 0;
"#,
    r#"
-- Why an attempt ended, for one that did not succeed (a failover's evidence: the box stopped).
ALTER TABLE attempts ADD COLUMN error TEXT;
"#,
    r#"
-- The session whose agent started this one with its `dispatch` tool (NULL: a person did).
ALTER TABLE sessions ADD COLUMN parent_id TEXT REFERENCES sessions(id);
CREATE INDEX sessions_by_parent ON sessions(parent_id) WHERE parent_id IS NOT NULL;
"#,
    r#"
-- The vault: each secret sealed with AES-256-GCM under a key kept outside the database (a key
-- file or SKIFF_VAULT_KEY); the secret's name is the AAD, so a ciphertext moved to another name
-- does not open. `key_id` names the key that sealed it (a hash of the key, never the key), so
-- a rotation cut short still finds the right key. The gateway's own, like its configuration:
-- no owner or tenant, and only the admin reaches it.
CREATE TABLE secrets (
    name          TEXT PRIMARY KEY,
    ciphertext    BLOB NOT NULL,
    nonce         BLOB NOT NULL,
    key_id        TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
"#,
    r#"
-- How hard the session's model reasons (`off`, `low`, `medium`, `high`); NULL leaves it to the
-- model's setting in skiff.toml. `skiff session send --reasoning` changes it from then on.
ALTER TABLE sessions ADD COLUMN reasoning TEXT;
"#,
    r#"
-- Fan-out groups: sibling sessions started together with the same prompt and base, on as
-- many boxes. `picked_session_id` is the attempt chosen as the group's result (NULL: none yet).
CREATE TABLE session_groups (
    id                TEXT PRIMARY KEY,
    owner_id          TEXT NOT NULL,
    tenant_id         TEXT NOT NULL,
    title             TEXT NOT NULL,
    picked_session_id TEXT,
    picked_at_ms      INTEGER,
    created_at_ms     INTEGER NOT NULL
);
ALTER TABLE sessions ADD COLUMN group_id TEXT REFERENCES session_groups(id);
CREATE INDEX sessions_by_group ON sessions(group_id) WHERE group_id IS NOT NULL;
-- The session's own approval policy (JSON: "never", "on-request" or a rules table); NULL leaves
-- it to its worker profile's or the gateway's `approval`.
ALTER TABLE sessions ADD COLUMN approval TEXT;

-- Tool calls that waited for a person. The subject (a command, a diff) is kept here for the
-- person deciding; the audit rows of the decisions carry only ids and states.
CREATE TABLE approvals (
    id             TEXT PRIMARY KEY,
    owner_id       TEXT NOT NULL,
    tenant_id      TEXT NOT NULL,
    session_id     TEXT NOT NULL REFERENCES sessions(id),
    run_id         TEXT NOT NULL,
    tool           TEXT NOT NULL,
    kind           TEXT NOT NULL,
    subject        TEXT NOT NULL,
    requested_by   TEXT NOT NULL,
    request_reason TEXT,
    created_at_ms  INTEGER NOT NULL,
    expires_at_ms  INTEGER NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('pending','approved','denied','expired','revoked')),
    decided_by     TEXT,
    decided_at_ms  INTEGER,
    reason         TEXT
);
CREATE INDEX approvals_by_session ON approvals(session_id, created_at_ms);
CREATE INDEX approvals_pending ON approvals(state) WHERE state = 'pending';
-- Every model call's usage, one row per recorded model response, for token and cost budgets
-- per session, per user (owner) and per tenant over a window. `tokens` is input (cache reads
-- included) plus output; `cost_usd` is at the prices the catalog had when it was recorded
-- (0 for a model without prices). Runs from before this table count their tokens at no cost.
CREATE TABLE usage (
    id         INTEGER PRIMARY KEY,
    at_ms      INTEGER NOT NULL,
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    session_id TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    tokens     INTEGER NOT NULL,
    cost_usd   REAL NOT NULL
);
CREATE INDEX usage_by_owner ON usage(tenant_id, owner_id, at_ms);
CREATE INDEX usage_by_session ON usage(session_id);
INSERT INTO usage (at_ms, owner_id, tenant_id, session_id, run_id, tokens, cost_usd)
    SELECT COALESCE(finished_at_ms, created_at_ms), owner_id, tenant_id, session_id, id,
           input_tokens + output_tokens, 0
    FROM runs WHERE input_tokens + output_tokens > 0;

-- The audit trail is read by time (export, the daily archive, retention).
CREATE INDEX audit_by_time ON audit(at_ms);
"#,
    // Governed actions (issue 16): one-time invocation grants. A grant is registered when it
    // is minted and consumed once, by a conditional update; what it covers is in its signed
    // claims, of which this row keeps the metadata (never an argument, never a credential).
    r#"
CREATE TABLE grants (
    id              TEXT PRIMARY KEY,
    owner_id        TEXT NOT NULL,
    tenant_id       TEXT NOT NULL,
    session_id      TEXT NOT NULL,
    capability      TEXT NOT NULL,
    target          TEXT NOT NULL,
    policy_revision TEXT NOT NULL,
    issued_at_ms    INTEGER NOT NULL,
    expires_at_ms   INTEGER NOT NULL,
    consumed_at_ms  INTEGER
);
CREATE INDEX grants_by_session ON grants(session_id, issued_at_ms);
"#,
    // wt/people: users with a role in a tenant, and tokens that name a user, cap its role and
    // expire.
    r#"
-- The people who may use the gateway. A user's rows are owned by `owner_id` (= `id`) in
-- `tenant_id`; `usr_admin` is the gateway's own first admin (the token in gateway.json).
CREATE TABLE users (
    id            TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    email         TEXT NOT NULL UNIQUE,
    role          TEXT NOT NULL CHECK (role IN ('admin','operator','member','viewer')),
    created_at_ms INTEGER NOT NULL
);
INSERT INTO users (id, owner_id, tenant_id, email, role, created_at_ms)
    VALUES ('usr_admin', 'usr_admin', 'ten_default', 'admin', 'admin',
            CAST(strftime('%s', 'now') AS INTEGER) * 1000);
-- A token's id (shown in `token list`, used by `token revoke`), the most it may do, and when it
-- stops working. The first admin's token has no expiry and the `admin` scope.
ALTER TABLE tokens ADD COLUMN id TEXT;
ALTER TABLE tokens ADD COLUMN scope TEXT NOT NULL DEFAULT 'admin'
    CHECK (scope IN ('read','write','admin'));
ALTER TABLE tokens ADD COLUMN expires_at_ms INTEGER;
UPDATE tokens SET id = 'tok_' || label WHERE id IS NULL;
CREATE UNIQUE INDEX tokens_by_id ON tokens(id);
"#,
    // wt/specs: pinned agent specs and Slack-compatible chat ingress.
    r#"
-- Agent specs, content-addressed: one row per version (name, sha256 of its canonical JSON).
-- Gateway-wide configuration (like `secrets`), so without owner or tenant. `seen_at_ms` is
-- when configuration last named this version: the newest is the name's current version.
CREATE TABLE agent_specs (
    name          TEXT NOT NULL,
    digest        TEXT NOT NULL,
    content       TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    seen_at_ms    INTEGER NOT NULL,
    PRIMARY KEY (name, digest)
);
-- The spec version a session runs with, fixed when it is created.
CREATE TABLE session_agents (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id),
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    name       TEXT NOT NULL,
    digest     TEXT NOT NULL
);
-- Slack event ids already accepted (replay refusal), gateway-wide like the signing secret.
CREATE TABLE ingress_events (
    event_id   TEXT PRIMARY KEY,
    seen_at_ms INTEGER NOT NULL
);
-- One session per chat thread.
CREATE TABLE ingress_threads (
    channel    TEXT NOT NULL,
    thread_ts  TEXT NOT NULL,
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    PRIMARY KEY (channel, thread_ts)
);
"#,
    // wtc/people: an email is one person's whatever its case. Stored as given, compared with
    // `lower()`; `migrate` first refuses, naming them, users this index would not allow.
    r#"
CREATE UNIQUE INDEX users_by_folded_email ON users(lower(email));
"#,
    // wtf/leases (issue 17): gateways sharing a database, and leases (`aggregates/leases.rs`).
    // Times are the database's own (`unixepoch('subsec')`), never a caller's.
    r#"
CREATE TABLE gateways (
    id              TEXT PRIMARY KEY,
    address         TEXT NOT NULL,
    started_at_ms   INTEGER NOT NULL,
    heartbeat_at_ms INTEGER NOT NULL
);
-- A session's live work, or a gateway-wide chore, owned by one gateway at a time. The row
-- stays when released (holder NULL) so the epoch only ever grows.
CREATE TABLE leases (
    kind           TEXT NOT NULL CHECK (kind IN ('session','singleton')),
    name           TEXT NOT NULL,
    holder         TEXT,
    epoch          INTEGER NOT NULL,
    acquired_at_ms INTEGER NOT NULL,
    expires_at_ms  INTEGER NOT NULL,
    PRIMARY KEY (kind, name)
);
CREATE INDEX leases_by_expiry ON leases(expires_at_ms) WHERE holder IS NOT NULL;
"#,
    // wth3 (issue 17): the session list of a whole tenant (what admins, operators and viewers
    // see) in its order, so a page reads its own rows instead of sorting every session.
    r#"
CREATE INDEX sessions_by_tenant ON sessions(tenant_id, updated_at_ms DESC, id);
"#,
];

/// The migration that makes emails unique without case (see `check_folded_emails`).
const FOLDED_EMAILS: usize = 16;

pub(crate) fn migrate(conn: &mut Connection) -> Result<()> {
    migrate_to(conn, MIGRATIONS.len())
}

/// Applies the migrations after the database's version up to `version`, each in its own
/// transaction.
fn migrate_to(conn: &mut Connection, version: usize) -> Result<()> {
    let current: usize = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    for (i, sql) in MIGRATIONS.iter().enumerate().take(version).skip(current) {
        let tx = conn.transaction()?;
        if i == FOLDED_EMAILS {
            check_folded_emails(&tx)?;
        }
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", i + 1)?;
        tx.commit()?;
    }
    Ok(())
}

/// Two users whose emails differ only in case cannot both stay once emails are compared
/// without case: the upgrade stops, naming them, and changes nothing.
fn check_folded_emails(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    let collision = tx
        .query_row(
            "SELECT a.id, a.email, b.id, b.email FROM users a JOIN users b
               ON lower(a.email) = lower(b.email) AND a.id < b.id
             ORDER BY a.id, b.id LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .optional()?;
    match collision {
        Some((first, first_email, second, second_email)) => Err(Error::EmailsCollide {
            first,
            first_email,
            second,
            second_email,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(conn: &Connection) -> usize {
        conn.pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn users_whose_emails_differ_only_in_case_stop_the_upgrade_naming_them() {
        assert!(MIGRATIONS[FOLDED_EMAILS].contains("users_by_folded_email"));
        let mut conn = Connection::open_in_memory().unwrap();
        migrate_to(&mut conn, FOLDED_EMAILS).unwrap();
        for (id, email) in [("usr_a", "Ana@Alpha.test"), ("usr_b", "ana@alpha.test")] {
            conn.execute(
                "INSERT INTO users (id, owner_id, tenant_id, email, role, created_at_ms)
                 VALUES (?1, ?1, 'alpha', ?2, 'member', 0)",
                rusqlite::params![id, email],
            )
            .unwrap();
        }
        let err = migrate(&mut conn).unwrap_err();
        assert!(matches!(err, Error::EmailsCollide { .. }), "{err:?}");
        let said = err.to_string();
        assert!(
            said.contains("usr_a and usr_b")
                && said.contains("Ana@Alpha.test and ana@alpha.test")
                && said.contains("skiff admin user remove"),
            "{said}"
        );
        // Nothing changed: both users are there, and the version is where it was.
        assert_eq!(version(&conn), FOLDED_EMAILS);
        let users: i64 = conn
            .query_row("SELECT COUNT(*) FROM users", [], |r| r.get(0))
            .unwrap();
        assert_eq!(users, 3);
        // With one of them gone the upgrade goes through, and the schema itself refuses a
        // second spelling.
        conn.execute("DELETE FROM users WHERE id = 'usr_b'", [])
            .unwrap();
        migrate(&mut conn).unwrap();
        assert_eq!(version(&conn), MIGRATIONS.len());
        let again = conn.execute(
            "INSERT INTO users (id, owner_id, tenant_id, email, role, created_at_ms)
             VALUES ('usr_c', 'usr_c', 'alpha', 'ANA@alpha.test', 'member', 0)",
            [],
        );
        assert!(again.is_err(), "a second spelling was stored");
    }
}
