//! The PostgreSQL schema: its own list of migrations (the SQLite one in `crate::migrations`
//! is not portable SQL), applied in order and tracked in `skiff_schema`.
//!
//! It holds the aggregates both backends implement so far: sessions and their transcript,
//! runs and attempts, the event log (version 1), and placements, the worker protocol's rows,
//! environments and snapshots (version 2). Columns keep the SQLite names and meanings (JSON as
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
    group_id           TEXT,           -- fan-out groups are SQLite-only so far
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
];

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
        return Err(crate::Error::Corrupt {
            what: "PostgreSQL schema",
            detail: format!(
                "the database is at version {current}, newer than this Skiff knows ({}); run a newer Skiff",
                MIGRATIONS.len()
            ),
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
