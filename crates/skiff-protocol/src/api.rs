//! JSON payloads of the client API (`/v1/...`), shared by the gateway and the CLI.

use crate::ids::{AttemptId, GroupId, RunId, SessionId};
use crate::model::ReasoningEffort;
use crate::transcript::TranscriptEntry;
use serde::{Deserialize, Serialize};

/// Status of a run. Terminal: succeeded, failed, cancelled, timed_out, orphaned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Starting,
    Running,
    WaitingInput,
    WaitingApproval,
    Cancelling,
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
    Orphaned,
}

impl RunStatus {
    pub const ALL: [RunStatus; 11] = [
        RunStatus::Queued,
        RunStatus::Starting,
        RunStatus::Running,
        RunStatus::WaitingInput,
        RunStatus::WaitingApproval,
        RunStatus::Cancelling,
        RunStatus::Succeeded,
        RunStatus::Failed,
        RunStatus::Cancelled,
        RunStatus::TimedOut,
        RunStatus::Orphaned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Queued => "queued",
            RunStatus::Starting => "starting",
            RunStatus::Running => "running",
            RunStatus::WaitingInput => "waiting_input",
            RunStatus::WaitingApproval => "waiting_approval",
            RunStatus::Cancelling => "cancelling",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::TimedOut => "timed_out",
            RunStatus::Orphaned => "orphaned",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Succeeded
                | RunStatus::Failed
                | RunStatus::Cancelled
                | RunStatus::TimedOut
                | RunStatus::Orphaned
        )
    }
}

impl std::fmt::Display for RunStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `POST /v1/sessions`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    pub prompt: String,
    /// Absolute path of a git repository or plain directory on the gateway host; empty when
    /// the session starts from `repo`.
    #[serde(default)]
    pub workspace: String,
    /// A remote repository the gateway clones (with its own git credentials) instead of a
    /// directory on its host; exactly one of `workspace` and `repo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<RepoSource>,
    /// `provider/model-id`; the configured default when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// A worker profile to run on; the gateway itself when absent.
    #[serde(default)]
    pub profile: Option<String>,
    /// How hard the model reasons in this session; the model's setting when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningEffort>,
    /// Which tool calls wait for a person; the profile's (or the gateway's) policy when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::approval::ApprovalPolicy>,
    /// An agent spec, `NAME` (its current version) or `NAME@DIGEST` (a digest or a prefix of
    /// one); the profile's `agent` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Fan-out: start this many sibling sessions (2 to [`MAX_ATTEMPTS`]) on as many boxes of
    /// `profile`, with the same prompt and base, as one group. The answer is then a
    /// [`FanOutStarted`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
}

/// A session's remote repository: what `skiff session new --repo URL [--ref REF]` sends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepoSource {
    /// `https://`, `http://`, `ssh://`, `git://` or `file://` (never with a password in it).
    pub url: String,
    /// A branch, tag or commit of the remote; its default branch when absent.
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub git_ref: Option<String>,
}

/// The most sibling sessions one fan-out starts.
pub const MAX_ATTEMPTS: u32 = 8;

/// `POST /v1/sessions` with `attempts`: the group and each attempt's session and first run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FanOutStarted {
    pub group_id: GroupId,
    pub attempts: Vec<RunStarted>,
}

/// `GET /v1/groups/{id}` (what `skiff session compare` shows): a fan-out group's attempts
/// side by side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupView {
    pub id: GroupId,
    pub title: String,
    pub created_at_ms: i64,
    /// The attempt picked as the group's result, once one is.
    #[serde(default)]
    pub picked: Option<SessionId>,
    /// The picked attempt's branch (git workspaces): the group's result.
    #[serde(default)]
    pub result_branch: Option<String>,
    /// Oldest first (the order they were started in).
    pub attempts: Vec<GroupAttemptView>,
}

/// One attempt of a fan-out group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupAttemptView {
    pub session: SessionView,
    /// Its newest run's status (absent before its first run exists).
    #[serde(default)]
    pub status: Option<RunStatus>,
    /// Its changes against the group's base; absent when they could not be read (`diff_error`).
    #[serde(default)]
    pub diff: Option<DiffStat>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff_error: Option<String>,
    /// The exit code of the last `exec` it ran, when it ran one (how its tests went, when the
    /// last command was its tests).
    #[serde(default)]
    pub last_exec_exit: Option<i64>,
    /// The first line of its final message.
    #[serde(default)]
    pub final_line: Option<String>,
    pub picked: bool,
}

/// Files changed, lines added and removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiffStat {
    pub files: u64,
    pub insertions: u64,
    pub deletions: u64,
}

/// `POST /v1/sessions/{id}/pick`: the group with this attempt picked, and the siblings parked
/// (their boxes given back; they stay readable).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickResult {
    pub group: GroupView,
    pub parked: Vec<SessionId>,
}

/// `POST /v1/sessions/{id}/messages`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendMessageRequest {
    pub prompt: String,
    /// Run this turn (and the session from now on) on a worker of this profile. A local
    /// session is dispatched at the turn boundary; a reclaimed one gets a fresh box.
    #[serde(default)]
    pub profile: Option<String>,
    /// How hard the model reasons from this turn on (the session keeps the choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningEffort>,
    /// The session's approval policy from this turn on (the session keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::approval::ApprovalPolicy>,
    /// Switch the session to this agent spec from this turn on: `NAME` (its current version)
    /// or `NAME@DIGEST`. Refused while a turn runs; the session keeps its model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
}

/// `POST /v1/sessions/{id}/agent`: switch a session's agent spec between turns, with no turn
/// (`session send --agent` without a prompt). Answered with the session; refused (409) while
/// a turn runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchAgentRequest {
    /// `NAME` (its current version) or `NAME@DIGEST`.
    pub agent: String,
}

/// `POST /v1/sessions/{id}/pull-back`: bring a worker session home at a turn boundary.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullBackRequest {
    /// Cancel the running turn first; without it a session with a turn running is refused.
    #[serde(default)]
    pub cancel: bool,
    /// Move a running turn with the session: its current model step and tool calls finish
    /// on the box, and the same run goes on at home (ignored when no turn runs).
    #[serde(default)]
    pub live: bool,
}

/// `POST /v1/sessions/{id}/dispatch`: place a session on a worker profile now, without a
/// message (the next message runs there).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchRequest {
    pub profile: String,
    /// Move a running turn with the session: its current model step and tool calls finish
    /// on the gateway, and the same run goes on on the box (ignored when no turn runs).
    #[serde(default)]
    pub live: bool,
}

/// The answer to a pull-back or a dispatch. The move itself goes on after the answer: each
/// of its steps is a `placement` event on the session's stream, from `after_cursor` on, until
/// one with a settled state (`local`, `active`, `failed`, `reclaimed`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementMove {
    pub session: SessionView,
    /// False when there was nothing to do (already home, already on that profile).
    pub moved: bool,
    /// What happens (or why nothing does), for people.
    pub message: String,
    /// Follow the session's events after this cursor to see the move's steps.
    pub after_cursor: u64,
}

/// How a session's workspace is held.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkspaceView {
    /// A managed worktree of the user's repository, on its own branch.
    Git {
        source: String,
        path: String,
        branch: String,
        base_commit: String,
        /// The URL a `--repo` session was cloned from (`source` is then the gateway's mirror).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        remote: Option<String>,
    },
    /// A gateway-owned copy of a plain directory.
    Plain { source: String, path: String },
}

impl WorkspaceView {
    pub fn path(&self) -> &str {
        match self {
            WorkspaceView::Git { path, .. } | WorkspaceView::Plain { path, .. } => path,
        }
    }
}

/// The model a session uses, labelled so that a scripted stand-in is never mistaken for a
/// real model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelView {
    #[serde(rename = "ref")]
    pub model_ref: String,
    pub scripted: bool,
    /// What to show a person: `anthropic/claude-sonnet-4-5`, or `scripted/demo (scripted)`.
    pub label: String,
    /// What the model costs, when the gateway's configuration says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<ModelPrices>,
}

/// A model's prices in US dollars per million tokens, from `[providers.NAME.prices."MODEL"]`.
/// Cache prices left out of the configuration are the input price.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrices {
    pub input: f64,
    pub output: f64,
    pub cache_read: f64,
    pub cache_write: f64,
}

impl ModelPrices {
    /// What `usage` cost: uncached input at the input price, cache reads and writes at theirs
    /// (they are parts of `input_tokens`), output at the output price.
    pub fn cost_usd(&self, usage: &crate::model::Usage) -> f64 {
        let cached = usage.cache_read_tokens + usage.cache_write_tokens;
        let uncached = usage.input_tokens.saturating_sub(cached);
        let per_million = uncached as f64 * self.input
            + usage.cache_read_tokens as f64 * self.cache_read
            + usage.cache_write_tokens as f64 * self.cache_write
            + usage.output_tokens as f64 * self.output;
        per_million / 1_000_000.0
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunView {
    pub id: RunId,
    pub session_id: SessionId,
    pub status: RunStatus,
    pub model: String,
    #[serde(default)]
    pub error: Option<String>,
    pub created_at_ms: i64,
    #[serde(default)]
    pub finished_at_ms: Option<i64>,
    /// Every prompt token of the turn's model calls, cached or not.
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Of `input_tokens`, those the provider read from its prompt cache.
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// Of `input_tokens`, those the provider wrote to its prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// In US dollars at the model's configured prices; absent when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionView {
    pub id: SessionId,
    pub title: String,
    pub workspace: WorkspaceView,
    pub model: ModelView,
    /// Where the loop runs: `local`, or a worker placement state (`provisioning`, `active`,
    /// `reclaimed`, …).
    pub placement: String,
    /// Worker sessions: the profile and the environment (box) they run on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerPlacementView>,
    /// The session whose agent started this one with its `dispatch` tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<SessionId>,
    /// The fan-out group this session is one attempt of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_id: Option<GroupId>,
    /// The session's `--reasoning` choice; absent: the model's setting in skiff.toml.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningEffort>,
    /// The session's own `--approval` policy; absent: its profile's or the gateway's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::approval::ApprovalPolicy>,
    /// The agent spec version the session runs with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<crate::agent::AgentPin>,
    /// The email of the user whose session it is (lists of a whole tenant mix people).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// The newest run, if any.
    #[serde(default)]
    pub last_run: Option<RunView>,
}

/// Where a worker session runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerPlacementView {
    pub profile: String,
    #[serde(default)]
    pub environment_id: Option<crate::EnvironmentId>,
    pub owner_epoch: u64,
    /// Why the placement failed or was reclaimed.
    #[serde(default)]
    pub error: Option<String>,
    /// What sync left behind when it laid the workspace onto the box, by folder and rule.
    #[serde(default)]
    pub left_out: Option<String>,
}

/// `POST /v1/sessions` and `POST /v1/sessions/{id}/messages` answer with the session and the
/// run they started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunStarted {
    pub session: SessionView,
    pub run: RunView,
}

/// `GET /v1/sessions/{id}`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionDetail {
    pub session: SessionView,
    pub runs: Vec<RunView>,
    /// The runs' tokens and cost added up.
    #[serde(default)]
    pub totals: UsageTotals,
    /// The transcript from the root to the leaf.
    pub transcript: Vec<TranscriptEntry>,
    /// Every attempt of every run, oldest first: where each ran, under which owner epoch,
    /// and how it ended. A run that failed over has more than one.
    #[serde(default)]
    pub attempts: Vec<AttemptView>,
    /// The session's, its user's and its tenant's usage against the budgets in force for it
    /// (`[budgets]`; a line without limits when none is configured).
    #[serde(default)]
    pub usage: Vec<crate::budget::UsageLine>,
    /// The fan-out group the session belongs to, and which attempt was picked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupPick>,
}

/// A session's fan-out group as its detail shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupPick {
    pub id: GroupId,
    #[serde(default)]
    pub picked: Option<SessionId>,
}

/// `POST /v1/sessions/{id}/compact`: the compaction entry written at the session's leaf.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactResult {
    /// How many entries the summary replaced in the model context (they stay in the
    /// transcript).
    pub entries: u64,
    /// The estimated size of the context it replaced, in tokens.
    pub tokens_before: u64,
    /// The summary's size in tokens.
    pub summary_tokens: u64,
    /// The compaction entry itself.
    pub entry: TranscriptEntry,
}

/// How one attempt at a run went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptStatus {
    Starting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Orphaned,
    /// A live move ended it between two model steps; the run goes on as the next attempt.
    HandedOff,
}

impl AttemptStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptStatus::Starting => "starting",
            AttemptStatus::Running => "running",
            AttemptStatus::Succeeded => "succeeded",
            AttemptStatus::Failed => "failed",
            AttemptStatus::Cancelled => "cancelled",
            AttemptStatus::Orphaned => "orphaned",
            AttemptStatus::HandedOff => "handed_off",
        }
    }

    pub fn parse(s: &str) -> Option<AttemptStatus> {
        [
            AttemptStatus::Starting,
            AttemptStatus::Running,
            AttemptStatus::Succeeded,
            AttemptStatus::Failed,
            AttemptStatus::Cancelled,
            AttemptStatus::Orphaned,
            AttemptStatus::HandedOff,
        ]
        .into_iter()
        .find(|a| a.as_str() == s)
    }

    pub fn is_active(self) -> bool {
        matches!(self, AttemptStatus::Starting | AttemptStatus::Running)
    }
}

impl std::fmt::Display for AttemptStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One try at running a turn: on the gateway, or on a worker box under an owner epoch. When a
/// box dies mid-turn, its attempt ends `failed` with the evidence and the next one starts on a
/// fresh box from the last checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptView {
    pub id: AttemptId,
    pub run_id: RunId,
    /// `gateway`, or the environment (box) it ran on.
    pub node: String,
    pub owner_epoch: u64,
    pub status: AttemptStatus,
    /// The attempt this one took the run over from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<AttemptId>,
    /// The checkpoint its workspace started from, for an attempt that took a run over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_checkpoint: Option<u64>,
    /// Why it ended, for one that did not succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub started_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<i64>,
}

/// A session's token counts and cost over all its runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageTotals {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    /// In US dollars; absent unless every run's model has prices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

/// How many sessions a page of `GET /v1/sessions` holds unless `limit` says.
pub const SESSION_PAGE_DEFAULT: usize = 100;
/// The most sessions one page may hold.
pub const SESSION_PAGE_MAX: usize = 1000;

/// `GET /v1/sessions[?limit=N][&before=ID]`: a page of sessions, most recently active first
/// (at most [`SESSION_PAGE_DEFAULT`] unless `limit` says otherwise, up to
/// [`SESSION_PAGE_MAX`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionList {
    pub sessions: Vec<SessionView>,
    /// When more sessions follow: the last one of this page, to pass as `?before=` for the
    /// next. Absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<SessionId>,
}

/// `POST /v1/ui/tickets`: a one-use Control UI login link (`GET <gateway><login_path>`),
/// valid until `expires_at_ms`. Trading it sets an HttpOnly session cookie.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UiTicket {
    pub ticket: String,
    /// `/ui/login?ticket=…`, relative to the gateway's URL.
    pub login_path: String,
    pub expires_at_ms: i64,
}

/// `POST /ui/login` (JSON, or the same field form-encoded): log a browser in with a token.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UiLoginRequest {
    pub token: String,
}

/// Every error answer of the API. `code` is a stable string scripts may match on (one of
/// [`ErrorCode`]); `message` is written for the person reading it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiError {
    pub code: String,
    pub message: String,
}

impl ApiError {
    /// The code as a known kind; `None` for one this build does not know (a newer gateway, or
    /// an answer that was not the gateway's JSON).
    pub fn kind(&self) -> Option<ErrorCode> {
        ErrorCode::parse(&self.code)
    }
}

/// The stable `code` of every error the API answers with: the one list of them. A code says
/// whose fault a failure is, so a script (or the CLI's exit code) can decide what to do.
///
/// | code | status | kind |
/// |---|---|---|
/// | `bad_request` | 400 | the request is malformed or asks for what can never be done |
/// | `unauthorized` | 401 | no token, or not a valid one |
/// | `forbidden` | 403 | the token may not do this |
/// | `not_found` | 404 | the named thing does not exist (for this token) |
/// | `conflict` | 409 | the thing's state does not allow it now |
/// | `session_busy` | 409 | the session is running a turn |
/// | `transcript_conflict` | 409 | the transcript moved meanwhile; reload and retry |
/// | `apply_conflict` | 409 | the target changed where the session changed it too |
/// | `target_not_empty` | 409 | an export's target directory is not empty |
/// | `bad_workspace` | 422 | the workspace cannot be used |
/// | `bad_model` | 422 | the model is unknown or misconfigured |
/// | `bad_profile` | 422 | the worker profile's configuration does not allow it |
/// | `sync_refused` | 422 | the workspace's content cannot be synced as it is |
/// | `internal` | 500 | the gateway's own fault; its log has the cause |
/// | `provider_failed` | 502 | the box provider failed |
/// | `box_unreachable` | 502 | the box cannot be reached over SSH |
/// | `box_not_ready` | 502 | the box did not come up: bootstrap, setup or readiness failed |
/// | `box_failed` | 502 | a box that was up misbehaved or a command on it failed |
/// | `publish_failed` | 502 | pushing to the git remote failed |
/// | `at_capacity` | 503 | every worker slot is taken; try again later |
/// | `unavailable` | 503 | the gateway cannot do it right now; try again |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    Conflict,
    SessionBusy,
    TranscriptConflict,
    ApplyConflict,
    TargetNotEmpty,
    BadWorkspace,
    BadModel,
    BadProfile,
    SyncRefused,
    Internal,
    ProviderFailed,
    BoxUnreachable,
    BoxNotReady,
    BoxFailed,
    PublishFailed,
    AtCapacity,
    Unavailable,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::SessionBusy,
        ErrorCode::TranscriptConflict,
        ErrorCode::ApplyConflict,
        ErrorCode::TargetNotEmpty,
        ErrorCode::BadWorkspace,
        ErrorCode::BadModel,
        ErrorCode::BadProfile,
        ErrorCode::SyncRefused,
        ErrorCode::Internal,
        ErrorCode::ProviderFailed,
        ErrorCode::BoxUnreachable,
        ErrorCode::BoxNotReady,
        ErrorCode::BoxFailed,
        ErrorCode::PublishFailed,
        ErrorCode::AtCapacity,
        ErrorCode::Unavailable,
    ];

    /// The string on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::SessionBusy => "session_busy",
            ErrorCode::TranscriptConflict => "transcript_conflict",
            ErrorCode::ApplyConflict => "apply_conflict",
            ErrorCode::TargetNotEmpty => "target_not_empty",
            ErrorCode::BadWorkspace => "bad_workspace",
            ErrorCode::BadModel => "bad_model",
            ErrorCode::BadProfile => "bad_profile",
            ErrorCode::SyncRefused => "sync_refused",
            ErrorCode::Internal => "internal",
            ErrorCode::ProviderFailed => "provider_failed",
            ErrorCode::BoxUnreachable => "box_unreachable",
            ErrorCode::BoxNotReady => "box_not_ready",
            ErrorCode::BoxFailed => "box_failed",
            ErrorCode::PublishFailed => "publish_failed",
            ErrorCode::AtCapacity => "at_capacity",
            ErrorCode::Unavailable => "unavailable",
        }
    }

    /// The HTTP status the gateway answers with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict
            | ErrorCode::SessionBusy
            | ErrorCode::TranscriptConflict
            | ErrorCode::ApplyConflict
            | ErrorCode::TargetNotEmpty => 409,
            ErrorCode::BadWorkspace
            | ErrorCode::BadModel
            | ErrorCode::BadProfile
            | ErrorCode::SyncRefused => 422,
            ErrorCode::Internal => 500,
            ErrorCode::ProviderFailed
            | ErrorCode::BoxUnreachable
            | ErrorCode::BoxNotReady
            | ErrorCode::BoxFailed
            | ErrorCode::PublishFailed => 502,
            ErrorCode::AtCapacity | ErrorCode::Unavailable => 503,
        }
    }

    pub fn parse(code: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == code)
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;

    #[test]
    fn every_error_code_reads_back_as_itself_and_no_two_share_a_string() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
            assert!(seen.insert(code.as_str()), "{code:?} shares its string");
            assert!((400..600).contains(&code.http_status()), "{code:?}");
        }
        assert_eq!(ErrorCode::parse("no_such_code"), None);
    }
}
