//! The PostgreSQL schema: its own list of migrations (the SQLite one in `crate::migrations`
//! is not portable SQL), applied in order and tracked in `skiff_schema`.
//!
//! It holds the aggregates both backends implement so far: sessions and their transcript,
//! runs and attempts, the event log (version 1), placements, the worker protocol's rows,
//! environments and snapshots (version 2), and the people and governance aggregates with
//! artifact rows (version 3), fan-out groups (version 4), gateways and leases (version 5), the
//! tenant-wide session list's index (version 6). Columns keep the SQLite names and meanings (JSON as
//! text, times as Unix milliseconds) so rows copy across unchanged.

use super::conn::PgConn;
use crate::Result;

const MIGRATIONS: &[&str] = &[
    // 1: sessions and transcript, runs and attempts, the event log.
    r#"
CREATE TABLE sessions (
    id                 TEXT PRIMARY KEY,
    owner_id           TEXT NOT NULL,
    tenant_id          TEXT NOT NULL,
    title              TEXT NOT NULL,
    workspace          TEXT NOT NULL,  -- JSON WorkspaceView
    model_ref          TEXT NOT NULL,
    placement          TEXT NOT NULL DEFAULT 'local',
    lifecycle_revision BIGINT NOT NULL DEFAULT 0,
    leaf_entry_id      TEXT,
    created_at_ms      BIGINT NOT NULL,
    updated_at_ms      BIGINT NOT NULL,
    parent_id          TEXT REFERENCES sessions(id),
    reasoning          TEXT,
    group_id           TEXT,           -- session_groups (version 4)
    approval           TEXT,           -- JSON ApprovalPolicy
    -- Creation order, where SQLite breaks ties by rowid.
    ord                BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX sessions_by_scope ON sessions(owner_id, tenant_id, updated_at_ms);
CREATE INDEX sessions_by_parent ON sessions(parent_id) WHERE parent_id IS NOT NULL;

CREATE TABLE entries (
    id            TEXT PRIMARY KEY,
    session_id    TEXT NOT NULL REFERENCES sessions(id),
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    parent_id     TEXT REFERENCES entries(id),
    run_id        TEXT,
    kind          TEXT NOT NULL,
    body          TEXT NOT NULL,  -- JSON EntryBody
    created_at_ms BIGINT NOT NULL
);
CREATE INDEX entries_by_session ON entries(session_id);

CREATE TABLE runs (
    id                 TEXT PRIMARY KEY,
    session_id         TEXT NOT NULL REFERENCES sessions(id),
    owner_id           TEXT NOT NULL,
    tenant_id          TEXT NOT NULL,
    status             TEXT NOT NULL,
    model_ref          TEXT NOT NULL,
    error              TEXT,
    input_tokens       BIGINT NOT NULL DEFAULT 0,
    output_tokens      BIGINT NOT NULL DEFAULT 0,
    created_at_ms      BIGINT NOT NULL,
    finished_at_ms     BIGINT,
    cache_read_tokens  BIGINT NOT NULL DEFAULT 0,
    cache_write_tokens BIGINT NOT NULL DEFAULT 0,
    ord                BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX runs_by_session ON runs(session_id, created_at_ms);
-- Turn admission: at most one unfinished run per session, whichever gateway admits it.
CREATE UNIQUE INDEX runs_one_open_per_session ON runs(session_id)
    WHERE status IN ('queued','starting','running','waiting_input','waiting_approval','cancelling');

CREATE TABLE attempts (
    id                     TEXT PRIMARY KEY,
    run_id                 TEXT NOT NULL REFERENCES runs(id),
    session_id             TEXT NOT NULL REFERENCES sessions(id),
    owner_id               TEXT NOT NULL,
    tenant_id              TEXT NOT NULL,
    runtime_node           TEXT NOT NULL,
    owner_epoch            BIGINT NOT NULL,
    status                 TEXT NOT NULL,
    resume_from_attempt_id TEXT REFERENCES attempts(id),
    checkpoint_artifact_id TEXT,
    started_at_ms          BIGINT NOT NULL,
    finished_at_ms         BIGINT,
    error                  TEXT,
    ord                    BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX attempts_by_session ON attempts(session_id);
-- At most one active attempt per run, enforced by the schema rather than by callers.
CREATE UNIQUE INDEX attempts_one_active_per_run ON attempts(run_id)
    WHERE status IN ('starting','running');

-- Each session's newest event cursor. An append increments it and holds the row's lock until
-- it commits, so a session's cursors are gapless and become visible in order: a follower
-- reading "after cursor N" never skips an event that commits late. (A sequence would hand
-- out numbers whose commits can land out of order.)
CREATE TABLE event_cursors (
    session_id TEXT PRIMARY KEY,
    last_seq   BIGINT NOT NULL
);

CREATE TABLE events (
    session_id TEXT NOT NULL,
    seq        BIGINT NOT NULL,
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    run_id     TEXT,
    at_ms      BIGINT NOT NULL,
    body       TEXT NOT NULL,  -- JSON EventKind
    PRIMARY KEY (session_id, seq)
);
"#,
    // 2: the live-work aggregates — placements, the worker protocol's rows, environments and
    // snapshots.
    r#"
CREATE TABLE environments (
    id                 TEXT PRIMARY KEY,
    owner_id           TEXT NOT NULL,
    tenant_id          TEXT NOT NULL,
    profile            TEXT NOT NULL,
    provider           TEXT NOT NULL,
    state              TEXT NOT NULL,
    -- Written before the provider is called; the lease id derives from it.
    op_id              TEXT NOT NULL UNIQUE,
    lease_id           TEXT,
    lease              TEXT,            -- JSON: how to reach and trust the box
    bundle_hash        TEXT,
    error              TEXT,
    created_at_ms      BIGINT NOT NULL,
    updated_at_ms      BIGINT NOT NULL,
    last_used_at_ms    BIGINT NOT NULL,
    expires_at_ms      BIGINT,
    model_requests     BIGINT NOT NULL DEFAULT 0,
    input_tokens       BIGINT NOT NULL DEFAULT 0,
    output_tokens      BIGINT NOT NULL DEFAULT 0,
    bytes_in           BIGINT NOT NULL DEFAULT 0,
    bytes_out          BIGINT NOT NULL DEFAULT 0,
    gateway_tool_calls BIGINT NOT NULL DEFAULT 0,
    snapshot_id        TEXT,
    prepared_key       TEXT
);
CREATE INDEX environments_by_scope ON environments(owner_id, tenant_id, created_at_ms);
CREATE INDEX environments_live ON environments(created_at_ms) WHERE state <> 'destroyed';

-- Sessions placed on workers; `sessions.placement` mirrors `state`. A change locks the
-- session's row first (then this one), so claims, transitions and turn admission on one
-- session are ordered whichever gateway makes them.
CREATE TABLE placements (
    session_id     TEXT PRIMARY KEY REFERENCES sessions(id),
    owner_id       TEXT NOT NULL,
    tenant_id      TEXT NOT NULL,
    state          TEXT NOT NULL,
    profile        TEXT NOT NULL,
    generation     BIGINT NOT NULL DEFAULT 0,
    environment_id TEXT,
    owner_epoch    BIGINT NOT NULL DEFAULT 0,
    base_manifest  TEXT,
    bundle_hash    TEXT,
    worker_pid     BIGINT,
    error          TEXT,
    updated_at_ms  BIGINT NOT NULL,
    left_out       TEXT,
    box_in_step    BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX placements_by_environment ON placements(environment_id);
CREATE INDEX placements_live ON placements(state)
    WHERE state NOT IN ('local','parked','reclaimed','failed');

-- Terminal replies of worker operations: a duplicate gets the same answer.
CREATE TABLE worker_ops (
    session_id  TEXT NOT NULL,
    owner_epoch BIGINT NOT NULL,
    stream      TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    method      TEXT NOT NULL,
    call_hash   TEXT NOT NULL,  -- blake3 of the call: a sequence number is not reusable
    reply       TEXT NOT NULL,  -- JSON Reply or model events; never credentials
    at_ms       BIGINT NOT NULL,
    PRIMARY KEY (session_id, owner_epoch, stream, seq)
);

-- ACK cursors: the last applied sequence number per stream and epoch.
CREATE TABLE worker_cursors (
    session_id  TEXT NOT NULL,
    owner_epoch BIGINT NOT NULL,
    stream      TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    PRIMARY KEY (session_id, owner_epoch, stream)
);

-- Admitted credentials (by id only): the primary key admits each once.
CREATE TABLE worker_credentials (
    credential_id  TEXT PRIMARY KEY,
    session_id     TEXT NOT NULL,
    environment_id TEXT NOT NULL,
    used_at_ms     BIGINT NOT NULL
);

-- Snapshots of prepared boxes (the copy lives with the provider).
CREATE TABLE snapshots (
    id              TEXT PRIMARY KEY,
    owner_id        TEXT NOT NULL,
    tenant_id       TEXT NOT NULL,
    profile         TEXT NOT NULL,
    key             TEXT NOT NULL,
    environment_id  TEXT NOT NULL,
    lease_id        TEXT NOT NULL,
    size_bytes      BIGINT NOT NULL DEFAULT 0,
    state           TEXT NOT NULL,    -- capturing | ready | deleting
    created_at_ms   BIGINT NOT NULL,
    last_used_at_ms BIGINT NOT NULL
);
CREATE INDEX snapshots_by_key ON snapshots(owner_id, tenant_id, profile, key, state);
CREATE INDEX snapshots_by_profile ON snapshots(profile, state, last_used_at_ms);
"#,
    // 3: the people and governance aggregates and artifact rows.
    PEOPLE,
    // 4: fan-out groups (the last table SQLite had alone).
    r#"
CREATE TABLE session_groups (
    id                TEXT PRIMARY KEY,
    owner_id          TEXT NOT NULL,
    tenant_id         TEXT NOT NULL,
    title             TEXT NOT NULL,
    picked_session_id TEXT,
    picked_at_ms      BIGINT,
    created_at_ms     BIGINT NOT NULL
);
ALTER TABLE sessions
    ADD CONSTRAINT sessions_group_fk FOREIGN KEY (group_id) REFERENCES session_groups(id);
CREATE INDEX sessions_by_group ON sessions(group_id) WHERE group_id IS NOT NULL;
"#,
    // 5: gateways sharing the database, and leases
    // (`aggregates/leases.rs`). Every lease time is the database's clock, `skiff_now_ms()`.
    LEASES,
    // 6: the session list of a whole tenant (what admins, operators and viewers see) in its
    // order, ids bytewise as the list compares them, so a page reads its own rows instead of
    // sorting every session.
    r#"
CREATE INDEX sessions_by_tenant ON sessions(tenant_id, updated_at_ms DESC, id COLLATE "C");
"#,
];

/// Version 5: the gateway registry and leases. A lease row stays when released (holder NULL)
/// so its epoch only ever grows.
const LEASES: &str = r#"
CREATE FUNCTION skiff_now_ms() RETURNS BIGINT LANGUAGE sql VOLATILE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;
CREATE TABLE gateways (
    id              TEXT PRIMARY KEY,
    address         TEXT NOT NULL,
    started_at_ms   BIGINT NOT NULL,
    heartbeat_at_ms BIGINT NOT NULL
);
CREATE TABLE leases (
    kind           TEXT NOT NULL CHECK (kind IN ('session','singleton')),
    name           TEXT NOT NULL,
    holder         TEXT,
    epoch          BIGINT NOT NULL,
    acquired_at_ms BIGINT NOT NULL,
    expires_at_ms  BIGINT NOT NULL,
    PRIMARY KEY (kind, name)
);
CREATE INDEX leases_by_expiry ON leases(expires_at_ms) WHERE holder IS NOT NULL;
"#;

/// Version 3: the people and governance aggregates (`aggregates::people`) and artifact rows.
const PEOPLE: &str = r#"
-- Emails are compared without case by SQLite's lower(), which folds ASCII letters only; the
-- "C" collation makes PostgreSQL's lower() do exactly that, so a database copied across
-- holds the same people and refuses the same duplicates.
CREATE TABLE users (
    id            TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    email         TEXT NOT NULL,
    role          TEXT NOT NULL CHECK (role IN ('admin','operator','member','viewer')),
    created_at_ms BIGINT NOT NULL
);
CREATE UNIQUE INDEX users_by_folded_email ON users ((lower(email COLLATE "C")));
INSERT INTO users (id, owner_id, tenant_id, email, role, created_at_ms)
    VALUES ('usr_admin', 'usr_admin', 'ten_default', 'admin', 'admin',
            (EXTRACT(EPOCH FROM now()) * 1000)::BIGINT);

CREATE TABLE tokens (
    hash          TEXT PRIMARY KEY,
    id            TEXT NOT NULL UNIQUE,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    label         TEXT NOT NULL,
    scope         TEXT NOT NULL DEFAULT 'admin' CHECK (scope IN ('read','write','admin')),
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT
);

CREATE TABLE ui_revoked_cookies (
    nonce_hash    TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    revoked_at_ms BIGINT NOT NULL
);

-- Audit ids come from a counter row, incremented by each write and locked until it commits
-- (as event cursors are): ids become visible in order, so `audit tail --follow`, resuming
-- after the last id it saw, never skips a row that committed late on another gateway.
CREATE TABLE audit_next (
    one  BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    last BIGINT NOT NULL
);
INSERT INTO audit_next (last) VALUES (0);
CREATE TABLE audit (
    id        BIGINT PRIMARY KEY,
    at_ms     BIGINT NOT NULL,
    owner_id  TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    actor     TEXT NOT NULL,
    action    TEXT NOT NULL,
    target    TEXT NOT NULL,
    decision  TEXT NOT NULL,
    detail    TEXT NOT NULL  -- JSON metadata only: never prompts, completions or secrets
);
CREATE INDEX audit_by_time ON audit(at_ms);

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
    created_at_ms  BIGINT NOT NULL,
    expires_at_ms  BIGINT NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('pending','approved','denied','expired','revoked')),
    decided_by     TEXT,
    decided_at_ms  BIGINT,
    reason         TEXT,
    ord            BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX approvals_by_session ON approvals(session_id, created_at_ms);
CREATE INDEX approvals_pending ON approvals(state) WHERE state = 'pending';

CREATE TABLE grants (
    id              TEXT PRIMARY KEY,
    owner_id        TEXT NOT NULL,
    tenant_id       TEXT NOT NULL,
    session_id      TEXT NOT NULL,
    capability      TEXT NOT NULL,
    target          TEXT NOT NULL,
    policy_revision TEXT NOT NULL,
    issued_at_ms    BIGINT NOT NULL,
    expires_at_ms   BIGINT NOT NULL,
    consumed_at_ms  BIGINT
);
CREATE INDEX grants_by_session ON grants(session_id, issued_at_ms);

CREATE TABLE secrets (
    name          TEXT PRIMARY KEY,
    ciphertext    BYTEA NOT NULL,
    nonce         BYTEA NOT NULL,
    key_id        TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

CREATE TABLE agent_specs (
    name          TEXT NOT NULL,
    digest        TEXT NOT NULL,
    content       TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    seen_at_ms    BIGINT NOT NULL,
    PRIMARY KEY (name, digest)
);
CREATE TABLE session_agents (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id),
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    name       TEXT NOT NULL,
    digest     TEXT NOT NULL
);
CREATE TABLE ingress_events (
    event_id   TEXT PRIMARY KEY,
    seen_at_ms BIGINT NOT NULL
);
CREATE TABLE ingress_threads (
    channel    TEXT NOT NULL,
    thread_ts  TEXT NOT NULL,
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    PRIMARY KEY (channel, thread_ts)
);

CREATE TABLE usage (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at_ms      BIGINT NOT NULL,
    owner_id   TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    session_id TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    tokens     BIGINT NOT NULL,
    cost_usd   DOUBLE PRECISION NOT NULL
);
CREATE INDEX usage_by_owner ON usage(tenant_id, owner_id, at_ms);
CREATE INDEX usage_by_session ON usage(session_id);

-- Metadata rows of content-addressed blobs. A checkpoint's `seq` is its session's next, taken
-- under the session row's lock, so two gateways checkpointing one session never collide.
CREATE TABLE artifacts (
    id            TEXT PRIMARY KEY,
    owner_id      TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    session_id    TEXT,
    run_id        TEXT,
    role          TEXT NOT NULL,   -- checkpoint | manifest | result | log
    retention     TEXT NOT NULL,   -- while_retryable | session | transient
    hash          TEXT NOT NULL,   -- blake3 (hex) of the stored blob
    size          BIGINT NOT NULL,
    seq           BIGINT,          -- checkpoints: 1, 2, 3… per session
    meta          TEXT NOT NULL DEFAULT '{}',  -- JSON metadata only (refs, counts), never content
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT
);
CREATE INDEX artifacts_by_session ON artifacts(owner_id, tenant_id, session_id, role, seq);
CREATE INDEX artifacts_by_hash ON artifacts(hash);
CREATE UNIQUE INDEX artifacts_one_checkpoint_per_seq ON artifacts(session_id, seq)
    WHERE role = 'checkpoint';
"#;

/// An arbitrary constant: the advisory lock two gateways starting at once take, so only one
/// migrates and the other sees the result.
const MIGRATION_LOCK: i64 = 0x736b_6966_665f_6d67;

pub(super) fn migrate(conn: &mut PgConn) -> Result<()> {
    let mut tx = conn.client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS skiff_schema (
             one     BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
             version INTEGER NOT NULL
         );
         INSERT INTO skiff_schema (version) VALUES (0) ON CONFLICT DO NOTHING;",
    )?;
    let current: i32 = tx
        .query_one("SELECT version FROM skiff_schema", &[])?
        .try_get(0)?;
    let current = usize::try_from(current).unwrap_or(0);
    if current > MIGRATIONS.len() {
        return Err(crate::Error::PgSchemaNewer {
            found: current,
            known: MIGRATIONS.len(),
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(current) {
        tx.batch_execute(sql)?;
        let version = i32::try_from(i + 1).unwrap_or(i32::MAX);
        tx.execute("UPDATE skiff_schema SET version = $1", &[&version])?;
    }
    tx.commit()?;
    Ok(())
}
