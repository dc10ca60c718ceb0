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
    #[error(
        "the gateway is at capacity: {live} of {max} workers are in use; try again when a worker session finishes, or raise [gateway] max_workers"
    )]
    WorkersAtCapacity { live: u64, max: u64 },
    #[error("artifact {id} is retained: {reason}")]
    Retained { id: String, reason: String },
    #[error("stored {what} is unreadable: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("could not start the database checkpoint thread: {0}")]
    Checkpointer(std::io::Error),
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
}
