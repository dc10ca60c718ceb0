//! The gateway's error type, and the one place that maps errors to API status codes and stable
//! wire codes.

use axum::http::StatusCode;
use skiff_protocol::api::ApiError;

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
    #[error("{0}")]
    Publish(String),
    #[error("{0}")]
    BadRequest(String),
    /// A fault of the gateway itself (a task it started died).
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
    /// HTTP status and stable code for the API.
    pub fn to_api(&self) -> (StatusCode, ApiError) {
        use skiff_store::Error as S;
        let (status, code) = match self {
            Error::Store(S::NotFound { .. }) => (StatusCode::NOT_FOUND, "not_found"),
            Error::Store(S::WorkersAtCapacity { .. }) => {
                (StatusCode::SERVICE_UNAVAILABLE, "at_capacity")
            }
            Error::Store(S::SessionBusy { .. }) => (StatusCode::CONFLICT, "session_busy"),
            Error::Store(S::LeafConflict { .. }) => (StatusCode::CONFLICT, "transcript_conflict"),
            Error::Store(S::IllegalRunTransition { .. } | S::AttemptActive { .. }) => {
                (StatusCode::CONFLICT, "conflict")
            }
            Error::Workspace(_) => (StatusCode::UNPROCESSABLE_ENTITY, "bad_workspace"),
            Error::Model(_) => (StatusCode::UNPROCESSABLE_ENTITY, "bad_model"),
            Error::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            Error::Store(
                S::IllegalEnvironmentTransition { .. } | S::IllegalPlacementTransition { .. },
            ) => (StatusCode::CONFLICT, "conflict"),
            Error::Provider(skiff_providers::Error::Config { .. }) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "bad_profile")
            }
            Error::Provider(_) => (StatusCode::BAD_GATEWAY, "provider_failed"),
            Error::Ssh(_) => (StatusCode::BAD_GATEWAY, "box_unreachable"),
            Error::Sync(skiff_sync::Error::ApplyConflict { .. }) => {
                (StatusCode::CONFLICT, "apply_conflict")
            }
            Error::Sync(skiff_sync::Error::TargetNotEmpty { .. }) => {
                (StatusCode::CONFLICT, "target_not_empty")
            }
            Error::Sync(_) => (StatusCode::UNPROCESSABLE_ENTITY, "sync_refused"),
            Error::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            Error::Publish(_) => (StatusCode::BAD_GATEWAY, "publish_failed"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        (
            status,
            ApiError {
                code: code.to_owned(),
                message: self.to_string(),
            },
        )
    }
}
