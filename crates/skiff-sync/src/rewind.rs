//! Putting a workspace back to one of its checkpoints, in place (`skiff session restore`).
//!
//! The order is the safety: the checkpoint is rebuilt whole into a private staging directory
//! first ([`checkpoint::restore_git`] or [`checkpoint::restore_plain`], which check the
//! manifest and refuse anything that would escape), the workspace is listed, every write is
//! checked against symlinks and directories in the way, and only then are files deleted and
//! renamed into place. A checkpoint that cannot be rebuilt (a blob missing from the content
//! store, a commit gone) leaves the workspace as it was.
//!
//! What takes part is what a checkpoint holds: the files that sync, under the checkpoint's own
//! `.skiffignore`. Files the rules leave out (build output, git-ignored files) are left alone,
//! in both directions.
//!
//! Git mode also moves the branch, without rewriting it: when the branch's tree differs from
//! the one the checkpoint was taken on, a new commit with that tree is made on top of the
//! branch (history, and every later checkpoint, stays), and the worktree's index is reset to
//! it. Uncommitted and untracked files of the checkpoint come back uncommitted and untracked.
//!
//! Deliberately absent: merging. Whatever the workspace holds that the checkpoint does not
//! (and that the rules list) is deleted; the later checkpoints keep it.

use crate::cas::Cas;
use crate::checkpoint::{self, GitStores};
use crate::filelist::Mode;
use crate::git::git;
use crate::inbound_plain::{self, Staged};
use crate::rules::Rules;
use crate::{Error, Manifest, ManifestEntry, Result, Scratch, io_err, manifest};
use skiff_protocol::sync::MANIFEST_VERSION;
use std::collections::BTreeMap;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// What a rewind changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rewound {
    pub written: Vec<String>,
    pub deleted: Vec<String>,
    /// Git mode: the commit that now heads the branch, when one had to be made.
    pub commit: Option<String>,
}

/// Makes the plain directory `target` hold what the plain checkpoint `manifest_hash` holds.
pub async fn rewind_plain(
    target: &Path,
    cas: &Cas,
    manifest_hash: &str,
    scratch: &Path,
    cancel: &CancellationToken,
) -> Result<Rewound> {
    let staged = Scratch::new(scratch, "rewind")?;
    let want = checkpoint::restore_plain(cas, manifest_hash, staged.path())?;
    let (written, deleted) = mirror(target, Mode::Plain, staged, &want, cancel).await?;
    Ok(Rewound {
        written,
        deleted,
        commit: None,
    })
}

/// Makes the git worktree `worktree` hold what git checkpoint `commit` holds (with the large
/// untracked files `outside_git` kept in the content store), and records it on the branch
/// with a commit saying `message` when the branch's tree differs from the checkpoint's.
pub async fn rewind_git(
    worktree: &Path,
    commit: &str,
    outside_git: Option<&str>,
    message: &str,
    stores: &GitStores<'_>,
    cancel: &CancellationToken,
) -> Result<Rewound> {
    let staged = Scratch::new(stores.scratch, "rewind")?;
    checkpoint::restore_git(worktree, commit, outside_git, stores, staged.path(), cancel).await?;
    let want = walk(staged.path())?;
    let rev = |spec: String| async move {
        Ok::<_, Error>(
            git(worktree)
                .args(["rev-parse", "--verify", "--quiet"])
                .arg(spec)
                .run_checked(cancel)
                .await?
                .trim()
                .to_owned(),
        )
    };
    // A checkpoint commit's parent is the branch head it was taken on.
    let tree_then = rev(format!("{commit}^^{{tree}}")).await?;
    let head = rev("HEAD^{commit}".to_owned()).await?;
    let head_tree = rev(format!("{head}^{{tree}}")).await?;
    // The commit object first: it only adds to the object store, so a failure here leaves
    // everything as it was.
    let recorded = if head_tree == tree_then {
        None
    } else {
        Some(
            git(worktree)
                .args(["commit-tree", &tree_then, "-p", &head, "-m", message])
                .env("GIT_AUTHOR_NAME", "Skiff")
                .env("GIT_AUTHOR_EMAIL", "skiff@localhost")
                .env("GIT_COMMITTER_NAME", "Skiff")
                .env("GIT_COMMITTER_EMAIL", "skiff@localhost")
                .run_checked(cancel)
                .await?
                .trim()
                .to_owned(),
        )
    };
    let (written, deleted) = mirror(worktree, Mode::Git, staged, &want, cancel).await?;
    if let Some(new) = &recorded {
        // Compare-and-swap on the head read above; `HEAD` is followed to the branch it names.
        git(worktree)
            .args(["update-ref", "-m", message, "HEAD", new, &head])
            .run_checked(cancel)
            .await?;
    }
    // The index as the branch has it: the checkpoint's uncommitted work shows as changes.
    git(worktree)
        .args(["-c", "core.splitIndex=false", "read-tree", "HEAD"])
        .run_checked(cancel)
        .await?;
    Ok(Rewound {
        written,
        deleted,
        commit: recorded,
    })
}

/// Deletes what `target` lists that `want` does not, and writes what differs, from `staged`
/// (which holds `want`'s files), after checking every write.
async fn mirror(
    target: &Path,
    mode: Mode,
    staged: Scratch,
    want: &Manifest,
    cancel: &CancellationToken,
) -> Result<(Vec<String>, Vec<String>)> {
    // The checkpoint's own rules decide what takes part: a path it left out is left alone.
    let rules = Rules::load(staged.path())?;
    let now = manifest::scan(target, mode, &rules, &checkpoint::unlimited(), cancel).await?;
    let diff = manifest::diff(&now, want);
    inbound_plain::precheck_writes(target, &diff.changed, &diff.deleted)?;
    let staged = Staged::local(staged);
    let applied = inbound_plain::apply(target, &staged, &diff.changed, &diff.deleted)?;
    Ok((applied.written, applied.deleted))
}

/// Every file and symlink under `root` (a staging directory a checkpoint was rebuilt into),
/// rules or not: all of it is the checkpoint.
fn walk(root: &Path) -> Result<Manifest> {
    let mut entries = BTreeMap::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            let name = entry.file_name();
            let name = name.to_str().ok_or_else(|| Error::NotUtf8 {
                path: entry.path().display().to_string(),
            })?;
            let path = if rel.is_empty() {
                name.to_owned()
            } else {
                format!("{rel}/{name}")
            };
            let ft = entry.file_type().map_err(io_err(&entry.path()))?;
            if ft.is_dir() {
                stack.push((entry.path(), path));
                continue;
            }
            let got: ManifestEntry = manifest::entry_of(root, &path)?;
            entries.insert(path, got);
        }
    }
    Ok(Manifest {
        version: MANIFEST_VERSION,
        base_commit: None,
        entries,
    })
}
