//! Workspace sync on the wire: the manifest a box and the gateway exchange (what a workspace
//! holds, path by path), checkpoints as the API lists them, publishing a session branch, and a
//! session's result coming home (its diff, applying or exporting it).
//!
//! Types only. Building, diffing and checking manifests is `skiff-sync`'s job.

use crate::ids::{ArtifactId, RunId, SessionId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The manifest format this build writes and reads.
pub const MANIFEST_VERSION: u32 = 1;

/// What a workspace holds: one entry per file or symlink, keyed by its `/`-separated path
/// relative to the workspace root. Directories are implied by the paths under them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub version: u32,
    /// Git mode: the commit the workspace was laid over. `None` in plain mode.
    #[serde(default)]
    pub base_commit: Option<String>,
    pub entries: BTreeMap<String, ManifestEntry>,
}

/// One path of a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ManifestEntry {
    /// A regular file: blake3 of its bytes (hex), its size and its permission bits.
    File {
        blake3: String,
        size: u64,
        mode: u32,
    },
    /// A symbolic link and the target it names (never followed).
    Symlink { target: String },
}

/// `POST /v1/sessions/{id}/restore`: put the session's workspace back to checkpoint
/// `checkpoint` (its transcript stays whole; a notice says what happened).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    /// The checkpoint's number (`seq`), as `GET …/checkpoints` lists it.
    pub checkpoint: u64,
}

/// What a restore changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreResult {
    pub session_id: SessionId,
    pub checkpoint: u64,
    /// Paths written (added or changed) and deleted in the workspace.
    pub written: Vec<String>,
    pub deleted: Vec<String>,
    /// Git mode: the commit made on the session branch to record the restore, when the
    /// branch's tree differed from the checkpoint's.
    #[serde(default)]
    pub commit: Option<String>,
    /// The checkpoints after this one: kept, and restorable.
    pub later: Vec<u64>,
}

/// `POST /v1/sessions/{id}/fork`: a new session whose transcript is this one's up to the end
/// of turn `at` and whose workspace starts at checkpoint `at`. Answered with the new
/// session's `SessionView`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    pub at: u64,
    /// [default: "<the session's title> (fork at N)"]
    #[serde(default)]
    pub title: Option<String>,
}

/// `GET /v1/sessions/{id}/checkpoints`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointList {
    pub checkpoints: Vec<CheckpointView>,
}

/// One checkpoint: the state of a session's workspace at the end of a turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointView {
    pub id: ArtifactId,
    pub session_id: SessionId,
    #[serde(default)]
    pub run_id: Option<RunId>,
    /// 1, 2, 3… in the order the session took them.
    pub seq: u64,
    /// `git` (a commit under `git_ref`) or `plain` (a manifest of content-addressed blobs).
    pub mode: String,
    /// Git mode: `refs/skiff/checkpoints/<session>/<seq>` in the user's repository.
    #[serde(default)]
    pub git_ref: Option<String>,
    #[serde(default)]
    pub commit: Option<String>,
    /// Blake3 of a manifest in the gateway's content store: plain mode, of every file; git
    /// mode, of the large untracked files the checkpoint kept outside git (if any).
    #[serde(default)]
    pub manifest: Option<String>,
    pub files: u64,
    pub bytes: u64,
    pub created_at_ms: i64,
}

/// `POST /v1/sessions/{id}/publish`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// A remote configured in the user's repository [default: `origin`].
    #[serde(default)]
    pub remote: Option<String>,
    /// The branch to create or update there [default: `skiff/<session-id>`].
    #[serde(default)]
    pub branch: Option<String>,
}

/// What a publish pushed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishResult {
    pub session_id: SessionId,
    pub remote: String,
    pub branch: String,
    pub commit: String,
}

/// A path of a box's work that reconciliation did not adopt, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Refusal {
    /// Workspace-relative for a path; for the other kinds a label for people (`(commits)`,
    /// `(all)`), never a file name.
    pub path: String,
    pub reason: String,
    #[serde(default)]
    pub kind: RefusalKind,
}

/// What a refusal is about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    /// One path of the workspace.
    #[default]
    Path,
    /// The box's commits as a whole (they are in the quarantine's bundle).
    Commits,
    /// Nothing could be adopted; the whole turn's work is kept.
    Everything,
}

/// One quarantined path: what the box had there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantinedPath {
    pub path: String,
    pub reason: String,
    #[serde(default)]
    pub kind: RefusalKind,
    /// The box's entry, when it had one (a file with its hash, or a symlink with its target).
    #[serde(default)]
    pub entry: Option<ManifestEntry>,
    /// Whether the bytes were kept (a file within the size limit; a symlink needs none).
    pub kept: bool,
}

/// A session's quarantine: what the box produced that was not adopted, kept until an
/// operator accepts or discards it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantineView {
    pub id: ArtifactId,
    pub session_id: SessionId,
    #[serde(default)]
    pub run_id: Option<RunId>,
    pub paths: Vec<QuarantinedPath>,
    /// Git mode: the box's session branch as a bundle file the user can fetch from, when the
    /// box had commits.
    #[serde(default)]
    pub bundle: Option<String>,
    pub created_at_ms: i64,
}

/// `GET /v1/sessions/{id}/quarantine`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantineList {
    pub quarantines: Vec<QuarantineView>,
}

/// `POST /v1/sessions/{id}/quarantine/accept`: write these quarantined paths into the
/// session's workspace (an operator's decision, audited).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcceptRequest {
    pub paths: Vec<String>,
}

/// `GET /v1/sessions/{id}/diff?stat=true`: leave the patches out (files and counts only).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiffQuery {
    #[serde(default)]
    pub stat: bool,
}

/// How one path changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeStatus {
    Added,
    Modified,
    Deleted,
    /// A file became a symlink or the other way round.
    TypeChanged,
}

impl ChangeStatus {
    /// One letter, as `git status --short` shows it.
    pub fn letter(self) -> char {
        match self {
            ChangeStatus::Added => 'A',
            ChangeStatus::Modified => 'M',
            ChangeStatus::Deleted => 'D',
            ChangeStatus::TypeChanged => 'T',
        }
    }
}

/// One changed path of a diff.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileChange {
    /// Workspace-relative, `/`-separated.
    pub path: String,
    pub status: ChangeStatus,
    /// Binary content: named, never shown as text, and not counted in lines.
    pub binary: bool,
    /// Lines added and removed (0 for binary files).
    pub insertions: u64,
    pub deletions: u64,
    /// The path's unified diff, in git's format (`diff --git a/… b/…`). Absent with `stat`,
    /// and when `omitted` says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// Why the patch is left out although one was asked for (too large, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub omitted: Option<String>,
}

/// A commit of a session's branch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitView {
    pub commit: String,
    /// The first line of its message.
    pub summary: String,
    pub author: String,
    pub authored_at_ms: i64,
}

/// `GET /v1/sessions/{id}/diff` (the session's changes against what it started from) and
/// `GET /v1/sessions/{id}/runs/{run}/changes` (one turn's: its checkpoint against the one
/// before).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionDiff {
    pub session_id: SessionId,
    /// Set for one turn's changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// `git` or `plain`.
    pub mode: String,
    /// What the changes are against: a commit (git), or the blake3 of a manifest in the
    /// gateway's content store (plain: the session's base, or the previous checkpoint).
    pub base: String,
    /// Git mode: the commits made since `base`, oldest first.
    pub commits: Vec<CommitView>,
    /// Sorted by path.
    pub files: Vec<FileChange>,
    pub insertions: u64,
    pub deletions: u64,
}

/// `POST /v1/sessions/{id}/apply`: write a plain session's changes back to its directory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    /// An absolute directory on the gateway host [default: the directory the session was
    /// created from].
    #[serde(default)]
    pub to: Option<String>,
}

/// What an apply wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyResult {
    pub session_id: SessionId,
    pub to: String,
    /// Files and symlinks written (added or replaced), sorted.
    pub written: Vec<String>,
    pub deleted: Vec<String>,
    /// Changed paths the directory already had exactly as the session has them.
    pub unchanged: Vec<String>,
}

/// `POST /v1/sessions/{id}/export`: write the session's whole result to a new directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportRequest {
    /// An absolute directory on the gateway host that does not exist or is empty.
    pub to: String,
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportResult {
    pub session_id: SessionId,
    pub to: String,
    pub files: u64,
    pub bytes: u64,
}
