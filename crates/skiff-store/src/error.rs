use skiff_protocol::api::RunStatus;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not open the database at {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },
    #[error(
        "transcript of session {session} moved: expected leaf {expected}, found {actual}; reload and retry"
    )]
    LeafConflict {
        session: String,
        expected: String,
        actual: String,
    },
    #[error("session {session} is busy with run {run}; wait for it to finish or cancel it")]
    SessionBusy { session: String, run: String },
    #[error("run {run} has already ended; there is no turn to move with --live")]
    RunEnded { run: String },
    #[error("run {run} already has an active attempt")]
    AttemptActive { run: String },
    #[error("run {run} cannot move from {from} to {to}")]
    IllegalRunTransition {
        run: String,
        from: RunStatus,
        to: RunStatus,
    },
    #[error("environment {env} cannot move from {from} to {to}")]
    IllegalEnvironmentTransition {
        env: String,
        from: skiff_protocol::environment::EnvironmentState,
        to: skiff_protocol::environment::EnvironmentState,
    },
    #[error("snapshot {snapshot} cannot move from {from} to {to}")]
    IllegalSnapshotTransition {
        snapshot: String,
        from: skiff_protocol::environment::SnapshotState,
        to: skiff_protocol::environment::SnapshotState,
    },
    #[error("session {session}'s placement cannot move from {from} to {to}")]
    IllegalPlacementTransition {
        session: String,
        from: skiff_protocol::environment::PlacementState,
        to: skiff_protocol::environment::PlacementState,
    },
    /// Every worker slot is held by a session that cannot give its box back now: one running
    /// a turn (or being placed for one), or `other` (its worker is being started or repaired,
    /// or its box holds work not brought back yet). Sessions merely idle on a box are parked
    /// to make room first.
    #[error("{}", capacity_message(*running_turns, *other, *max))]
    WorkersAtCapacity {
        running_turns: u64,
        other: u64,
        max: u64,
    },
    /// The session's agent has started as many child sessions as `[gateway] max_children`
    /// allows.
    #[error(
        "session {parent} has already started {max} child sessions, the most `[gateway] max_children` allows; finish with the children it has"
    )]
    TooManyChildren { parent: String, max: u64 },
    /// A fan-out needs more free worker slots than there are: all its sessions are admitted
    /// together or none is.
    #[error(
        "a fan-out of {needs} attempts needs {needs} workers, {free} free (of [gateway] max_workers = {max}); try fewer attempts, or again when turns finish"
    )]
    GroupAtCapacity { needs: u64, free: u64, max: u64 },
    /// Another attempt of the group was picked already.
    #[error("group {group} already has attempt {picked} picked as its result")]
    AlreadyPicked { group: String, picked: String },
    #[error("artifact {id} is retained: {reason}")]
    Retained { id: String, reason: String },
    /// `user add` with an email some user already has (in any tenant), compared without case:
    /// `existing` is that user's email as it was given.
    #[error("{}", user_exists_message(email, existing))]
    UserExists { email: String, existing: String },
    /// The database holds two users whose emails differ only in case, which the schema no
    /// longer allows (emails are compared without case).
    #[error(
        "cannot upgrade the database: users {first} and {second} have emails that differ only in case ({first_email} and {second_email}), and emails are now one person's whatever their case; remove one of them with the Skiff version that added them (`skiff admin user remove EMAIL`), then start again"
    )]
    EmailsCollide {
        first: String,
        first_email: String,
        second: String,
        second_email: String,
    },
    /// A rotation found a secret written by another gateway after it had read them: nothing
    /// was resealed.
    #[error(
        "the vault's secrets changed while they were being resealed (another gateway wrote one); nothing was resealed, run the rotation again"
    )]
    VaultChanged,
    /// A gateway wrote, renewed or released under a lease it no longer holds at that epoch
    /// (another gateway took the session over): nothing was written.
    #[error(
        "gateway {gateway} no longer holds the lease on {lease} at epoch {epoch} (it is {now}); nothing was written — this gateway must stop that work"
    )]
    LeaseLost {
        lease: String,
        gateway: String,
        epoch: i64,
        now: String,
    },
    #[error("stored {what} is unreadable: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("could not start the database checkpoint thread: {0}")]
    Checkpointer(std::io::Error),
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The PostgreSQL url did not parse. The url itself is not repeated: it may hold a password.
    #[error("the PostgreSQL url is malformed: {0}")]
    PgUrl(#[source] postgres::Error),
    /// `target` names the user, host and database, never the password.
    #[error("could not connect to PostgreSQL ({target}): {}", pg_connect_message(.source))]
    PgConnect {
        target: String,
        #[source]
        source: postgres::Error,
    },
    #[error("could not start the PostgreSQL connection thread: {0}")]
    PgThread(std::io::Error),
    /// The store was dropped, or a call panicked on its connection's thread.
    #[error("the PostgreSQL connection's thread ended during this call")]
    PgGone,
    /// The database was migrated by a newer Skiff: this one would misread it.
    #[error(
        "the PostgreSQL database is at schema version {found}, newer than this Skiff knows ({known}); run a newer Skiff"
    )]
    PgSchemaNewer { found: usize, known: usize },
    /// The connection broke during the call (the server restarted, the socket dropped). A
    /// write's outcome is unknown; the next call reconnects.
    #[error(
        "the connection to PostgreSQL ({target}) was lost during this call ({detail}); a change it made may or may not have been saved — check before repeating it; the next call reconnects"
    )]
    PgConnectionLost { target: String, detail: String },
    /// Reconnecting failed a moment ago; calls fail at once until the backoff has passed.
    #[error(
        "PostgreSQL ({target}) is unreachable: {detail}; the next attempt to reconnect is in {retry_in_ms} ms"
    )]
    PgUnavailable {
        target: String,
        detail: String,
        retry_in_ms: u64,
    },
    #[error("PostgreSQL error: {}", pg_message(.0))]
    Postgres(#[from] postgres::Error),
}

impl Error {
    /// Whether another connection held the database busy or locked: the same call may succeed
    /// if tried again.
    pub fn is_retryable(&self) -> bool {
        let sqlite = match self {
            Error::Sqlite(e) | Error::Open { source: e, .. } => e,
            // PostgreSQL gives up one side of a serialization conflict or a deadlock; the
            // same call, tried again, sees the winner's write.
            Error::Postgres(e) => {
                use postgres::error::SqlState;
                return e.code().is_some_and(|code| {
                    *code == SqlState::T_R_SERIALIZATION_FAILURE
                        || *code == SqlState::T_R_DEADLOCK_DETECTED
                });
            }
            _ => return false,
        };
        matches!(
            sqlite.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        )
    }
}

/// What PostgreSQL said, not the client library's bare "db error": the server's message and
/// its SQLSTATE. The server's detail line is left out: it can quote the row's values.
fn pg_message(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

/// Why a connection failed; a server that wants a password not given says where to give it.
fn pg_connect_message(e: &postgres::Error) -> String {
    let said = pg_message(e);
    if said.contains("password missing") {
        format!(
            "{said}: the server asks for a password (the gateway takes it from `[store] password = \"env:VAR\"`, `skiff admin migrate` from PGPASSWORD)"
        )
    } else {
        said
    }
}

/// "user ana@x already exists…", naming the stored spelling when only the case differs.
fn user_exists_message(email: &str, existing: &str) -> String {
    let spelled = if email == existing {
        String::new()
    } else {
        format!(" as {existing} (emails are compared without case)")
    };
    format!("user {email} already exists{spelled}; remove them first or pick another email")
}

/// "the gateway is at capacity: 2 of 2 workers are running turns; …" — what holds the slots,
/// so the advice to wait is true.
fn capacity_message(running_turns: u64, other: u64, max: u64) -> String {
    let turns = match running_turns {
        1 => "is running a turn",
        _ => "are running turns",
    };
    let held = if other == 0 {
        format!("{running_turns} of {max} workers {turns}")
    } else {
        let holds = if other == 1 {
            "cannot give its box back yet"
        } else {
            "cannot give their boxes back yet"
        };
        format!("{running_turns} of {max} workers {turns} and {other} more {holds}")
    };
    format!(
        "the gateway is at capacity: {held}; try again when one finishes, or raise [gateway] max_workers"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capacity_message_says_what_holds_the_slots() {
        let at = |running_turns, other, max| {
            Error::WorkersAtCapacity {
                running_turns,
                other,
                max,
            }
            .to_string()
        };
        assert_eq!(
            at(2, 0, 2),
            "the gateway is at capacity: 2 of 2 workers are running turns; try again when one finishes, or raise [gateway] max_workers"
        );
        assert!(at(1, 0, 1).contains("1 of 1 workers is running a turn;"));
        assert!(
            at(1, 1, 2).contains(
                "1 of 2 workers is running a turn and 1 more cannot give its box back yet;"
            )
        );
    }
}
