//! The gateway's error type, and the one place that maps errors to API status codes and stable
//! wire codes ([`ErrorCode`] lists the codes and their statuses).
//!
//! A variant says whose fault a failure is, not what its message says: the client's (bad
//! request, not found, conflict), the moment's (at capacity, unavailable), a box's or a
//! provider's, or the gateway's own. Every mapping below is an exhaustive `match`, so a variant
//! added here or in a nested crate's error must be given its kind.

use axum::http::StatusCode;
use skiff_protocol::api::{ApiError, ErrorCode};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] skiff_store::Error),
    #[error(transparent)]
    Workspace(#[from] crate::workspace::WorkspaceError),
    #[error(transparent)]
    Model(#[from] skiff_llm::Error),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    StateDir(#[from] crate::state_dir::StateDirError),
    #[error(transparent)]
    StateDirLocked(#[from] crate::state_dir::LockError),
    #[error(transparent)]
    Provider(#[from] skiff_providers::Error),
    #[error(transparent)]
    Ssh(#[from] skiff_ssh::Error),
    #[error(transparent)]
    Sync(#[from] skiff_sync::Error),
    /// The ledger of running tool commands (`<state>/procs/`) could not be read or cleared.
    #[error(transparent)]
    Process(#[from] skiff_process::Error),
    #[error(transparent)]
    Vault(#[from] crate::vault::VaultError),
    /// A remote repository could not be cloned, fetched or resolved.
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    #[error(transparent)]
    Agent(#[from] crate::agents::AgentError),
    /// The request is malformed, or asks for what can never be done: the client's to fix.
    #[error("{0}")]
    BadRequest(String),
    /// No valid credential: a token or sign-in that is missing, unknown or expired.
    #[error("{0}")]
    Unauthorized(String),
    /// The token may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// The request names something that does not exist (outside the store's own lookups).
    #[error("{0}")]
    NotFound(String),
    /// What the request names is in a state that does not allow it now.
    #[error("{0}")]
    Conflict(String),
    /// A worker profile's configuration does not allow it (the operator's to fix).
    #[error("{0}")]
    BadProfile(String),
    /// The gateway cannot do it at the moment (shutting down, still starting); trying again
    /// may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// A box did not come up: its bundle, setup, worker or readiness canary failed.
    #[error("{0}")]
    BoxNotReady(String),
    /// A box that was up misbehaved.
    #[error("{0}")]
    BoxFailed(String),
    /// Pushing a session's branch to its git remote failed.
    #[error("{0}")]
    Publish(String),
    /// A fault of the gateway itself (a task it started died, a file of its own it cannot
    /// write, a socket that would not bind).
    #[error("{0}")]
    Internal(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The stable wire code: whose fault this is.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::Store(e) => store_code(e),
            Error::Workspace(e) => workspace_code(e),
            Error::Model(e) => model_code(e),
            // The gateway's own configuration and state dir: read at start, not per request.
            Error::Config(_) | Error::StateDir(_) | Error::StateDirLocked(_) => ErrorCode::Internal,
            Error::Provider(e) => provider_code(e),
            Error::Ssh(e) => ssh_code(e),
            Error::Sync(e) => sync_code(e),
            Error::Process(e) => process_code(e),
            Error::Vault(e) => vault_code(e),
            Error::Remote(e) => remote_code(e),
            Error::Agent(e) => agent_code(e),
            Error::BadRequest(_) => ErrorCode::BadRequest,
            Error::Unauthorized(_) => ErrorCode::Unauthorized,
            Error::Forbidden(_) => ErrorCode::Forbidden,
            Error::NotFound(_) => ErrorCode::NotFound,
            Error::Conflict(_) => ErrorCode::Conflict,
            Error::BadProfile(_) => ErrorCode::BadProfile,
            Error::Unavailable(_) => ErrorCode::Unavailable,
            Error::BoxNotReady(_) => ErrorCode::BoxNotReady,
            Error::BoxFailed(_) => ErrorCode::BoxFailed,
            Error::Publish(_) => ErrorCode::PublishFailed,
            Error::Internal(_) | Error::Listen { .. } => ErrorCode::Internal,
        }
    }

    /// HTTP status, stable code and the message a client may read. A raw database failure's
    /// text stays in the gateway's log (see `IntoResponse for Error`): it names tables and
    /// SQL, which say nothing to a client and something to an attacker.
    pub fn to_api(&self) -> (StatusCode, ApiError) {
        let code = self.code();
        let status = http_status(code);
        let message = match self {
            Error::Store(e) if raw_store_failure(e) => {
                if e.is_retryable() {
                    "the gateway's database is busy; try again in a moment".to_owned()
                } else {
                    "the gateway's database failed; the cause is in the gateway's log (its \
                     stderr). Try again; if it keeps failing, check the disk that holds the \
                     gateway's state dir"
                        .to_owned()
                }
            }
            _ => self.to_string(),
        };
        (
            status,
            ApiError {
                code: code.as_str().to_owned(),
                message,
            },
        )
    }
}

/// The HTTP status of a code, as axum spells it.
pub(crate) fn http_status(code: ErrorCode) -> StatusCode {
    // Every status `ErrorCode` names is a valid one; 500 is only the type system's fallback.
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A failure of the database itself, whose text is SQLite's (or PostgreSQL's) rather than ours.
fn raw_store_failure(e: &skiff_store::Error) -> bool {
    use skiff_store::Error as S;
    match e {
        S::Open { .. } | S::Checkpointer(_) | S::Sqlite(_) => true,
        S::PgUrl(_) | S::PgConnect { .. } | S::PgThread(_) | S::PgGone | S::Postgres(_) => true,
        S::PgConnectionLost { .. } | S::PgUnavailable { .. } => true,
        S::NotFound { .. }
        | S::LeafConflict { .. }
        | S::SessionBusy { .. }
        | S::RunEnded { .. }
        | S::AttemptActive { .. }
        | S::IllegalRunTransition { .. }
        | S::IllegalEnvironmentTransition { .. }
        | S::IllegalSnapshotTransition { .. }
        | S::IllegalPlacementTransition { .. }
        | S::WorkersAtCapacity { .. }
        | S::TooManyChildren { .. }
        | S::GroupAtCapacity { .. }
        | S::AlreadyPicked { .. }
        | S::Retained { .. }
        | S::UserExists { .. }
        | S::VaultChanged
        | S::LeaseLost { .. }
        | S::EmailsCollide { .. }
        | S::PgSchemaNewer { .. }
        | S::Corrupt { .. } => false,
    }
}

fn store_code(e: &skiff_store::Error) -> ErrorCode {
    use skiff_store::Error as S;
    match e {
        S::NotFound { .. } => ErrorCode::NotFound,
        S::LeafConflict { .. } => ErrorCode::TranscriptConflict,
        S::SessionBusy { .. } => ErrorCode::SessionBusy,
        S::AttemptActive { .. }
        | S::RunEnded { .. }
        | S::IllegalRunTransition { .. }
        | S::IllegalEnvironmentTransition { .. }
        | S::IllegalSnapshotTransition { .. }
        | S::IllegalPlacementTransition { .. }
        | S::TooManyChildren { .. }
        | S::AlreadyPicked { .. }
        | S::Retained { .. }
        | S::UserExists { .. }
        | S::VaultChanged
        // Another gateway owns the session now: the request may be retried there.
        | S::LeaseLost { .. } => ErrorCode::Conflict,
        S::WorkersAtCapacity { .. } | S::GroupAtCapacity { .. } => ErrorCode::AtCapacity,
        S::Open { .. } | S::Checkpointer(_) | S::Sqlite(_) | S::Postgres(_) if e.is_retryable() => {
            ErrorCode::Unavailable
        }
        // The database cannot be reached now: a load balancer may send the request elsewhere.
        S::PgConnect { .. } | S::PgGone | S::PgConnectionLost { .. } | S::PgUnavailable { .. } => {
            ErrorCode::Unavailable
        }
        S::Open { .. }
        | S::Checkpointer(_)
        | S::Sqlite(_)
        | S::Corrupt { .. }
        | S::EmailsCollide { .. }
        | S::PgUrl(_)
        | S::PgThread(_)
        | S::PgSchemaNewer { .. }
        | S::Postgres(_) => ErrorCode::Internal,
    }
}

fn workspace_code(e: &crate::workspace::WorkspaceError) -> ErrorCode {
    use crate::workspace::WorkspaceError as W;
    match e {
        W::Missing(_) | W::ContainsStateDir { .. } | W::NoCommits(_) | W::Prepare { .. } => {
            ErrorCode::BadWorkspace
        }
        // Creating the session's own directories under the state dir.
        W::Io { .. } => ErrorCode::Internal,
    }
}

fn remote_code(e: &crate::remote::RemoteError) -> ErrorCode {
    use crate::remote::RemoteError as R;
    match e {
        R::BadUrl { .. }
        | R::BadRef { .. }
        | R::Unreachable { .. }
        | R::AuthFailed { .. }
        | R::UnknownRef { .. }
        | R::Empty { .. }
        | R::Credential { .. }
        | R::Git { .. } => ErrorCode::BadWorkspace,
        // Writing the clone under the workspaces directory.
        R::Io { .. } => ErrorCode::Internal,
    }
}

fn model_code(e: &skiff_llm::Error) -> ErrorCode {
    use skiff_llm::Error as L;
    match e {
        L::InvalidProvider { .. }
        | L::InvalidScript { .. }
        | L::MalformedModelRef { .. }
        | L::UnknownProvider { .. }
        | L::UnknownScriptedModel { .. }
        | L::InvalidPrice { .. }
        | L::InvalidModelSetting { .. }
        | L::InvalidDefaultModel(_) => ErrorCode::BadModel,
        L::HttpClient(_) => ErrorCode::Internal,
    }
}

fn provider_code(e: &skiff_providers::Error) -> ErrorCode {
    use skiff_providers::Error as P;
    match e {
        P::Config { .. } | P::SnapshotsUnsupported { .. } => ErrorCode::BadProfile,
        P::Provider { .. }
        | P::UnknownLease { .. }
        | P::UnknownSnapshot { .. }
        | P::NoEvidence { .. }
        | P::Sandbox { .. }
        | P::Process(_)
        | P::Io { .. } => ErrorCode::ProviderFailed,
    }
}

fn ssh_code(e: &skiff_ssh::Error) -> ErrorCode {
    use skiff_process::Error as X;
    use skiff_ssh::Error as H;
    match e {
        H::HostKeyChanged { .. } | H::Unreachable { .. } => ErrorCode::BoxUnreachable,
        H::Process(X::TimedOut { .. }) => ErrorCode::BoxUnreachable,
        H::Remote { .. } | H::Process(X::Failed { .. }) => ErrorCode::BoxFailed,
        // Writing the pin file, or starting `ssh` itself: this host's side.
        H::Pin { .. } => ErrorCode::Internal,
        H::Process(p) => process_code(p),
    }
}

fn sync_code(e: &skiff_sync::Error) -> ErrorCode {
    use skiff_sync::Error as Y;
    match e {
        Y::Rule { .. }
        | Y::TooLarge { .. }
        | Y::FileTooLarge { .. }
        | Y::OverCheckpointCap { .. }
        | Y::Private { .. }
        | Y::Special { .. }
        | Y::NotUtf8 { .. }
        | Y::Unsafe { .. }
        | Y::ForeignRef { .. }
        | Y::Diverged { .. }
        | Y::Drift { .. }
        | Y::Mismatch { .. }
        | Y::RemoteNotEmpty { .. } => ErrorCode::SyncRefused,
        Y::ApplyConflict { .. } => ErrorCode::ApplyConflict,
        Y::TargetNotEmpty { .. } => ErrorCode::TargetNotEmpty,
        Y::PartlyApplied { source, .. } => sync_code(source),
        // A file the gateway could not read or write, or one of its own invariants broken.
        Y::Io { .. } | Y::Invalid { .. } => ErrorCode::Internal,
        Y::Process(p) => process_code(p),
        Y::Ssh(e) => ssh_code(e),
    }
}

fn agent_code(e: &crate::agents::AgentError) -> ErrorCode {
    use crate::agents::AgentError as A;
    match e {
        A::Invalid { .. } | A::Read { .. } | A::Ambiguous { .. } => ErrorCode::BadRequest,
        A::Unknown { .. } | A::NoSuchVersion { .. } => ErrorCode::NotFound,
        // A stored version changed under its digest: refused until another version is named.
        A::Corrupt { .. } => ErrorCode::Conflict,
    }
}

fn vault_code(e: &crate::vault::VaultError) -> ErrorCode {
    use crate::vault::VaultError as V;
    match e {
        V::InvalidName { .. } | V::EmptyValue { .. } => ErrorCode::BadRequest,
        V::NotFound { .. } => ErrorCode::NotFound,
        // The gateway's key (its file, its environment) or its sealed rows: the operator's to
        // fix on the gateway's side, and the message says how.
        V::TwoKeys { .. }
        | V::KeyFileMode { .. }
        | V::BadKey { .. }
        | V::KeyFile { .. }
        | V::WrongKey { .. }
        | V::NoKey { .. }
        | V::NotTheDatabasesKey { .. }
        | V::NoKeyForDatabase { .. }
        | V::WouldSplitKeys { .. }
        | V::Tampered { .. }
        | V::Seal { .. } => ErrorCode::Internal,
    }
}

fn process_code(e: &skiff_process::Error) -> ErrorCode {
    use skiff_process::Error as X;
    match e {
        X::TimedOut { .. } | X::Cancelled { .. } => ErrorCode::Unavailable,
        X::Spawn { .. }
        | X::Failed { .. }
        | X::Contain { .. }
        | X::Sandbox { .. }
        | X::Ledger { .. }
        | X::Io { .. } => ErrorCode::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_protocol::api::RunStatus;

    fn io() -> std::io::Error {
        std::io::Error::other("disk on fire")
    }

    fn api(e: Error) -> (u16, String) {
        let (status, body) = e.to_api();
        (status.as_u16(), body.code)
    }

    #[test]
    fn each_kind_of_failure_answers_with_its_own_status_and_code() {
        use skiff_providers::Error as P;
        use skiff_store::Error as S;
        let s = String::from;
        let cases: Vec<(Error, u16, &str)> = vec![
            (Error::BadRequest(s("empty prompt")), 400, "bad_request"),
            (
                Error::Unauthorized(s("expired sign-in")),
                401,
                "unauthorized",
            ),
            (Error::Forbidden(s("admin only")), 403, "forbidden"),
            (Error::NotFound(s("no such path")), 404, "not_found"),
            (Error::Conflict(s("no running turn")), 409, "conflict"),
            (Error::BadProfile(s("bad egress rule")), 422, "bad_profile"),
            (Error::Unavailable(s("shutting down")), 503, "unavailable"),
            (
                Error::BoxNotReady(s("no canary answer")),
                502,
                "box_not_ready",
            ),
            (Error::BoxFailed(s("listing failed")), 502, "box_failed"),
            (Error::Publish(s("push failed")), 502, "publish_failed"),
            (Error::Internal(s("a task died")), 500, "internal"),
            (
                Error::Listen {
                    addr: s("127.0.0.1:1"),
                    source: io(),
                },
                500,
                "internal",
            ),
            (
                S::NotFound {
                    what: "session",
                    id: s("ses_x"),
                }
                .into(),
                404,
                "not_found",
            ),
            (
                S::SessionBusy {
                    session: s("ses_x"),
                    run: s("run_x"),
                }
                .into(),
                409,
                "session_busy",
            ),
            (
                S::LeafConflict {
                    session: s("ses_x"),
                    expected: s("a"),
                    actual: s("b"),
                }
                .into(),
                409,
                "transcript_conflict",
            ),
            (
                S::IllegalRunTransition {
                    run: s("run_x"),
                    from: RunStatus::Succeeded,
                    to: RunStatus::Running,
                }
                .into(),
                409,
                "conflict",
            ),
            (
                S::WorkersAtCapacity {
                    running_turns: 2,
                    other: 0,
                    max: 2,
                }
                .into(),
                503,
                "at_capacity",
            ),
            (
                S::Corrupt {
                    what: "quarantine",
                    detail: s("not JSON"),
                }
                .into(),
                500,
                "internal",
            ),
            (
                crate::workspace::WorkspaceError::Missing(s("/nope")).into(),
                422,
                "bad_workspace",
            ),
            (
                crate::workspace::WorkspaceError::Io {
                    path: s("/state/ws"),
                    source: io(),
                }
                .into(),
                500,
                "internal",
            ),
            (
                skiff_llm::Error::UnknownScriptedModel { model: s("x") }.into(),
                422,
                "bad_model",
            ),
            (
                P::Config {
                    profile: s("cloud"),
                    problem: s("no command"),
                }
                .into(),
                422,
                "bad_profile",
            ),
            (
                P::SnapshotsUnsupported { provider: "local" }.into(),
                422,
                "bad_profile",
            ),
            (
                P::Provider {
                    provider: "command",
                    message: s("quota"),
                }
                .into(),
                502,
                "provider_failed",
            ),
            (
                skiff_ssh::Error::Unreachable {
                    alias: s("env_x"),
                    detail: s("refused"),
                }
                .into(),
                502,
                "box_unreachable",
            ),
            (
                skiff_ssh::Error::Remote {
                    alias: s("env_x"),
                    command: s("true"),
                    code: 1,
                    stderr: String::new(),
                }
                .into(),
                502,
                "box_failed",
            ),
            (
                skiff_sync::Error::TooLarge {
                    root: s("/w"),
                    detail: s("big"),
                    largest: s("a"),
                }
                .into(),
                422,
                "sync_refused",
            ),
            (
                skiff_sync::Error::ApplyConflict {
                    target: s("/w"),
                    conflicts: Vec::new(),
                }
                .into(),
                409,
                "apply_conflict",
            ),
            (
                skiff_sync::Error::TargetNotEmpty { path: s("/w") }.into(),
                409,
                "target_not_empty",
            ),
            (
                skiff_sync::Error::Io {
                    path: s("/state/tmp"),
                    source: io(),
                }
                .into(),
                500,
                "internal",
            ),
            (
                skiff_process::Error::Ledger {
                    path: s("/state/procs"),
                    source: io(),
                }
                .into(),
                500,
                "internal",
            ),
            (
                crate::vault::VaultError::InvalidName { name: s("a/b") }.into(),
                400,
                "bad_request",
            ),
            (
                crate::vault::VaultError::NotFound { name: s("openai") }.into(),
                404,
                "not_found",
            ),
            (
                crate::vault::VaultError::WrongKey {
                    name: s("openai"),
                    sealed_with: s("a"),
                    source_name: s("SKIFF_VAULT_KEY"),
                    current: s("b"),
                }
                .into(),
                500,
                "internal",
            ),
        ];
        for (error, status, code) in cases {
            let shown = format!("{error:?}");
            assert_eq!(api(error), (status, code.to_owned()), "{shown}");
        }
    }

    #[test]
    fn every_code_the_gateway_answers_with_has_the_status_the_protocol_lists() {
        for code in ErrorCode::ALL {
            assert_eq!(http_status(code).as_u16(), code.http_status(), "{code:?}");
        }
    }

    /// A database that breaks under the gateway (here: a table renamed by a second
    /// connection) is the gateway's fault, and SQLite's words stay in its log.
    #[tokio::test]
    async fn a_broken_database_is_an_internal_error_that_keeps_sqlite_text_from_the_client()
    -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (core, _, _) = crate::open_core(&crate::Options {
            state_dir: dir.path().join("state"),
            listen: "127.0.0.1:0".into(),
            config: None,
        })
        .await?;
        let conn = rusqlite::Connection::open(core.state.database())?;
        conn.execute_batch("ALTER TABLE sessions RENAME TO sessions_gone")?;

        let sight = skiff_store::Sight::own(skiff_store::Scope::new("usr_test", "ten_test"));
        let Err(e) = core.list_page(&sight, 10, None) else {
            anyhow::bail!("listing sessions worked on a database without its sessions table");
        };
        assert!(
            e.to_string().contains("sessions"),
            "the log keeps the cause: {e}"
        );
        let (status, body) = e.to_api();
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body.code, "internal");
        assert!(
            body.message.contains("the gateway's database failed")
                && body.message.contains("gateway's log"),
            "{}",
            body.message
        );
        for raw in ["sessions", "no such table", "SQL", "database error"] {
            assert!(
                !body.message.contains(raw),
                "{raw:?} reached the client: {}",
                body.message
            );
        }
        Ok(())
    }
}
