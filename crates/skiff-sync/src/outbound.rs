//! Laying a session's workspace onto a box, and recording the immutable base manifest.
//!
//! Git mode: the box gets a real repository — a pack of the base commit's objects (the whole
//! session branch with [`History::Full`]) and its index, made here and dropped into the box's
//! fresh repository, so the box neither re-indexes nor re-hashes it. The box checks the base
//! commit out (every file written once) in a staging directory while the workspace here is
//! still being written, checked and hashed (it needs only the repository's objects); once every
//! check passed, only the files that differ from the base commit (edits, untracked files that
//! are not ignored) travel into the staged repository, the tracked files the user deleted are
//! deleted there, and it is renamed into place: the session's directory appears whole, and
//! `git status` on the box shows the user's uncommitted changes. A check that fails removes
//! the staging directory: the session's directory on the box is never made. When a checkout
//! could write other bytes than the files here (attributes, line-ending or symlink settings),
//! every listed file travels instead. Plain mode: the listed files are copied into a fresh
//! directory.
//!
//! Limits (and, for a plain copy, that no file is private to its owner) are checked before
//! anything reaches the session's directory on the box (git mode's staged base commit is all
//! that may have moved, and is removed); a box directory that exists and is not empty is
//! refused, never overwritten. Deliberately absent: git credentials and remotes on the box (objects arrive as
//! a pack, never by fetch from a URL).

use crate::filelist::{self, Limits, Mode};
use crate::git::{git, split_z};
use crate::rules::Rules;
use crate::transfer::{Method, Remote};
use crate::{Manifest, Result, Scratch, contain, manifest};
use skiff_ssh::shell_quote;
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// What to lay onto a box.
#[derive(Clone, Copy, Debug)]
pub struct Outbound<'a> {
    /// The session's own workspace on the gateway (managed worktree or plain copy).
    pub local: &'a Path,
    pub mode: Mode,
    /// Git mode: the session id; the branch is `skiff/<session>`.
    pub session: &'a str,
    pub rules: &'a Rules,
    pub limits: &'a Limits,
    /// A private directory of the gateway for temporary files (the bundle).
    pub scratch: &'a Path,
    /// Author identity for commits made on the box (`user.name`, `user.email` of the box's
    /// repository); projected from gateway config.
    pub identity: Option<(&'a str, &'a str)>,
    /// Git mode: how much of the session branch's history the box gets.
    pub history: History,
}

/// How much of the session branch's history a box's repository gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum History {
    /// The base commit alone: a shallow repository.
    #[default]
    Shallow,
    /// Every commit reachable from the session branch.
    Full,
}

/// What was laid onto the box.
#[derive(Clone, Debug)]
pub struct Dispatched {
    /// The base manifest: keep it (it is what inbound sync diffs against).
    pub manifest: Manifest,
    pub method: Method,
    pub files: usize,
    pub bytes: u64,
    /// What the rules left behind (said to the user, never silent).
    pub left_out: filelist::LeftOut,
}

/// Lays `out.local` onto `remote` and returns the base manifest.
pub async fn push(
    out: &Outbound<'_>,
    remote: &Remote,
    cancel: &CancellationToken,
) -> Result<Dispatched> {
    push_when_ready(out, remote, std::future::ready(Ok(())), cancel).await
}

/// [`push`] of a workspace whose files are still being written: `ready` resolves once they
/// are (or says why they cannot be). Git mode makes the pack of the base commit and has the
/// box check it out in its staging directory meanwhile (it needs only the repository's
/// objects); nothing is listed or hashed before `ready`, and nothing reaches the session's
/// directory on the box before the listing passed its checks.
pub async fn push_when_ready(
    out: &Outbound<'_>,
    remote: &Remote,
    ready: impl std::future::Future<Output = std::result::Result<(), String>>,
    cancel: &CancellationToken,
) -> Result<Dispatched> {
    push_after(out, remote, "true", ready, None, cancel).await
}

/// What a git-mode lay-down will have put on the box, known here before the box holds it:
/// everything passed its checks, and the base manifest is made.
#[derive(Clone, Debug)]
pub struct Planned {
    pub manifest: Manifest,
    pub files: usize,
    pub bytes: u64,
    pub left_out: filelist::LeftOut,
}

/// Who hears a git-mode lay-down's early word ([`push_after`]), and what the lay-down waits
/// for after it, before the session's directory appears on the box.
pub struct Early {
    pub to: tokio::sync::oneshot::Sender<Planned>,
    /// `None`: nothing. The fault tests hold a lay-down here, so a gateway can be killed
    /// while its worker runs and the box lacks the workspace (`[gateway] barrier_fault`).
    pub hold: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
}

impl From<tokio::sync::oneshot::Sender<Planned>> for Early {
    fn from(to: tokio::sync::oneshot::Sender<Planned>) -> Early {
        Early { to, hold: None }
    }
}

/// [`push_when_ready`] that first runs `before` (a shell command line that must succeed,
/// run in a subshell from the box user's home) on the box, in the same round trip as the
/// box's directory (git mode: its staged repository) is made.
///
/// `early` (git mode) gets the [`Planned`] result as soon as every check passed and the base
/// manifest is made, while the box is still laying the workspace down: the caller may start
/// using the box meanwhile, as long as nothing reads the session's directory before this
/// returns. The directory appears whole, in one rename of the staging directory: the base
/// commit checked out, the tracked files the user deleted deleted, the files that differ
/// copied. Not sent when the workspace has a top-level `AGENTS.md` (a turn reads it before
/// its first model call), nor in plain mode.
pub async fn push_after(
    out: &Outbound<'_>,
    remote: &Remote,
    before: &str,
    ready: impl std::future::Future<Output = std::result::Result<(), String>>,
    early: Option<Early>,
    cancel: &CancellationToken,
) -> Result<Dispatched> {
    let before =
        format!("( {before} ) || {{ echo 'the preparation of the box failed' >&2; exit 1; }}; ");
    let started = std::time::Instant::now();
    let ms = |at: std::time::Instant| at.elapsed().as_millis() as u64;
    let base_commit = match out.mode {
        Mode::Git => Some(session_head(out.local, out.session, cancel).await?),
        Mode::Plain => None,
    };
    // Git mode: the pack of the base commit is made here and laid down by the box in a
    // staging directory of its own (its checkout is most of a lay-down) while the workspace
    // here is still being written and is checked; it becomes the session's directory only
    // once every check passed and the files that differ are in it, and is removed when one
    // fails.
    let staging = Remote::new(remote.ssh().clone(), &format!("{}.incoming", remote.dir()))?;
    let seeding = async {
        match &base_commit {
            Some(commit) => {
                let pack = make_pack(out, commit, cancel).await?;
                tracing::debug!(ms = ms(started), "outbound: packed");
                let method =
                    seed_repository(out, remote, &staging, &before, &pack, commit, cancel).await?;
                tracing::debug!(
                    ms = ms(started),
                    "outbound: the box checked the base commit out"
                );
                Ok::<_, crate::Error>(Some(method))
            }
            None => Ok(None),
        }
    };
    // What is checked before anything reaches the session's directory on the box: the
    // listing (limits, and that a plain copy holds no private file) and the paths of the
    // tracked files the user deleted. Then the base manifest (hashing) and the files that
    // differ from the base commit, still while the box checks the base commit out.
    let preparing = async {
        ready.await.map_err(|detail| crate::Error::Invalid {
            what: format!("the workspace {}", out.local.display()),
            detail,
        })?;
        let deleted = async {
            match out.mode {
                Mode::Git => deleted_files(out.local, cancel).await,
                Mode::Plain => Ok(Vec::new()),
            }
        };
        let (list, deleted) = tokio::try_join!(
            filelist::list(out.local, out.mode, out.rules, out.limits, cancel),
            deleted
        )?;
        if out.mode == Mode::Plain {
            filelist::check_shareable(out.local, &list)?;
        }
        tracing::debug!(
            ms = ms(started),
            files = list.files.len(),
            "outbound: listed"
        );
        let hashing = async {
            let (root, list, commit) = (out.local.to_path_buf(), list.clone(), base_commit.clone());
            tokio::task::spawn_blocking(move || manifest::build(&root, &list, commit))
                .await
                .map_err(|e| crate::Error::Invalid {
                    what: format!("hashing {}", out.local.display()),
                    detail: e.to_string(),
                })?
        };
        let finding = async {
            match &base_commit {
                Some(commit) => differing(out.local, commit, &list, cancel).await,
                None => Ok(list.paths().into_iter().collect()),
            }
        };
        let (base, mut sent) = tokio::try_join!(hashing, finding)?;
        if base_commit.is_some() {
            // A checkout (umask 022 on the box) makes 0644 and 0755 files; others travel.
            for (path, entry) in &base.entries {
                if let crate::ManifestEntry::File { mode, .. } = entry
                    && !matches!(mode, 0o644 | 0o755)
                {
                    sent.insert(path.clone());
                }
            }
        }
        tracing::debug!(ms = ms(started), "outbound: hashed");
        Ok::<_, crate::Error>((list, deleted, base, sent))
    };
    // The early word goes out as soon as this side is done, not when the box is.
    let preparing = async {
        let prepared = preparing.await?;
        let (list, _, base, _) = &prepared;
        if let Some(early) = early
            && base_commit.is_some()
            && !base.entries.contains_key(INSTRUCTIONS)
        {
            let planned = Planned {
                manifest: base.clone(),
                files: list.files.len(),
                bytes: list.total_bytes,
                left_out: list.left_out.clone(),
            };
            // A caller that stopped listening just waits for the end.
            let _ = early.to.send(planned);
            if let Some(hold) = early.hold {
                hold.await;
            }
        }
        Ok(prepared)
    };
    let (seeded, prepared) = tokio::join!(seeding, preparing);
    let (seeded, (list, deleted, base, sent)) = match (seeded, prepared) {
        (Ok(seeded), Ok(prepared)) => (seeded, prepared),
        // The workspace's own refusal says most (the box's, when it is the only one).
        (Err(e), Ok(_)) | (_, Err(e)) => {
            if base_commit.is_some() {
                discard_staging(&staging, cancel).await;
            }
            return Err(e);
        }
    };
    let sent: Vec<String> = sent.into_iter().collect();
    let method = match seeded {
        Some(method) => {
            // Git: the files that differ go into the staged repository, then it moves into
            // place minus the tracked files the user deleted: the session's directory
            // appears whole or not at all.
            let placed = async {
                staging
                    .push_files_by(out.local, &sent, method, cancel)
                    .await?;
                move_into_place(remote, &staging, deleted, cancel).await
            };
            if let Err(e) = placed.await {
                discard_staging(&staging, cancel).await;
                return Err(e);
            }
            method
        }
        None => {
            let method = make_dir(remote, &before, cancel).await?;
            remote
                .push_files_by(out.local, &sent, method, cancel)
                .await?;
            method
        }
    };
    tracing::debug!(ms = ms(started), files = sent.len(), "outbound: files sent");
    Ok(Dispatched {
        manifest: base,
        method,
        files: list.files.len(),
        bytes: list.total_bytes,
        left_out: list.left_out,
    })
}

/// The file a turn reads before its first model call (`skiff_agent::INSTRUCTIONS_FILE`).
const INSTRUCTIONS: &str = "AGENTS.md";

/// The commit of `refs/heads/skiff/<session>`, which must be what the worktree has checked out.
pub(crate) async fn session_head(
    worktree: &Path,
    session: &str,
    cancel: &CancellationToken,
) -> Result<String> {
    let branch = format!("refs/heads/skiff/{session}");
    // Both in one git call (a lay-down's and a resume's first step).
    let revs = git(worktree)
        .args(["rev-parse", "--quiet", "HEAD^{commit}"])
        .arg(format!("{branch}^{{commit}}"))
        .run_checked(cancel)
        .await?;
    let mut revs = revs.lines().map(str::trim);
    let (head, tip) = match (revs.next(), revs.next(), revs.next()) {
        (Some(head), Some(tip), None) => (head.to_owned(), tip.to_owned()),
        _ => {
            return Err(crate::Error::Invalid {
                what: format!("the managed worktree {}", worktree.display()),
                detail: format!("cannot read HEAD and the session branch {branch}"),
            });
        }
    };
    if head != tip {
        return Err(crate::Error::Invalid {
            what: format!("the managed worktree {}", worktree.display()),
            detail: format!("HEAD is {head}, not the session branch {branch} ({tip})"),
        });
    }
    Ok(head)
}

/// The tracked files the worktree deleted, checked and NUL-separated.
async fn deleted_files(local: &Path, cancel: &CancellationToken) -> Result<Vec<u8>> {
    let listed = git(local)
        .args(["ls-files", "-z", "--deleted"])
        .run_checked(cancel)
        .await?;
    let mut deleted = Vec::new();
    for path in split_z(&listed) {
        contain::check_path(path)?;
        deleted.extend_from_slice(path.as_bytes());
        deleted.push(0);
    }
    Ok(deleted)
}

/// Plain mode's box directory: made, unless it exists and is not empty (refused). Returns how
/// files reach the box.
async fn make_dir(remote: &Remote, before: &str, cancel: &CancellationToken) -> Result<Method> {
    let dir = remote.quoted_dir();
    let probe = remote
        .run(
            &format!(
                "set -e; {before}if [ -e {dir} ] && [ -n \"$(ls -A {dir})\" ]; then echo taken; exit 0; fi; \
                 mkdir -p {dir}; {}",
                remote.method_probe()
            ),
            Vec::new(),
            cancel,
        )
        .await?;
    if probe.lines().any(|l| l.trim() == "taken") {
        return Err(crate::Error::RemoteNotEmpty {
            dir: remote.dir().to_owned(),
        });
    }
    let method = Method::from_probe(&probe);
    remote.remember(method);
    Ok(method)
}

/// The listed paths that differ from `commit` (edits, mode changes, untracked files); all of
/// them when a checkout may convert bytes (attributes, `core.autocrlf`/`core.eol`,
/// `core.symlinks=false`): then only a copy is exact.
async fn differing(
    local: &Path,
    commit: &str,
    list: &filelist::FileList,
    cancel: &CancellationToken,
) -> Result<std::collections::BTreeSet<String>> {
    if checkout_may_convert(local, commit, list, cancel).await? {
        return Ok(list.paths().into_iter().collect());
    }
    let listed: std::collections::BTreeSet<&str> =
        list.files.iter().map(|f| f.path.as_str()).collect();
    let mut out = std::collections::BTreeSet::new();
    let changed = git(local)
        .args([
            "-c",
            "core.fileMode=true",
            "diff",
            "--name-only",
            "--no-renames",
        ])
        .args(["--ignore-submodules", "-z", commit, "--"])
        .run_checked(cancel)
        .await?;
    let untracked = git(local)
        .args(["ls-files", "-z", "--others", "--exclude-standard"])
        .run_checked(cancel)
        .await?;
    for path in split_z(&changed).chain(split_z(&untracked)) {
        if listed.contains(path) {
            out.insert(path.to_owned());
        }
    }
    Ok(out)
}

/// Whether checking `commit` out on a box (git without config) could write bytes other than
/// the files of `local`: an attributes file that sets a converting attribute (or defines a
/// macro), or settings that convert line endings or symlinks.
async fn checkout_may_convert(
    local: &Path,
    commit: &str,
    list: &filelist::FileList,
    cancel: &CancellationToken,
) -> Result<bool> {
    let is_attributes = |p: &str| p == ".gitattributes" || p.ends_with("/.gitattributes");
    for file in list.files.iter().filter(|f| is_attributes(&f.path)) {
        // A symlink is not read (a checkout writes it as a link, whatever it points to).
        if file.symlink || converts_at(&crate::join(local, &file.path)) {
            return Ok(true);
        }
    }
    let tree = git(local)
        .args(["ls-tree", "-r", "-z", "--name-only", commit])
        .run_checked(cancel)
        .await?;
    // The checkout reads the commit's copies (a workspace that changed one has both).
    for path in split_z(&tree).filter(|p| is_attributes(p)) {
        let committed = git(local)
            .args(["cat-file", "blob"])
            .arg(format!("{commit}:{path}"))
            .run(cancel)
            .await?;
        if !committed.status.success() || attributes_convert(&committed.stdout.into_string()) {
            return Ok(true);
        }
    }
    let info = git(local)
        .args(["rev-parse", "--git-path", "info/attributes"])
        .run_checked(cancel)
        .await?;
    // Relative to `local` unless absolute.
    if converts_at(&local.join(info.trim())) {
        return Ok(true);
    }
    // The user's own attributes file, read when `core.attributesFile` is not set.
    if let Some(home) = std::env::var_os("HOME")
        && converts_at(&Path::new(&home).join(".config/git/attributes"))
    {
        return Ok(true);
    }
    // Every scope the worktree's checkout read, the system's included.
    let settings = git(local)
        .env("GIT_CONFIG_NOSYSTEM", "0")
        .args([
            "config",
            "--get-regexp",
            r"^core\.(autocrlf|eol|attributesfile|symlinks)$",
        ])
        .run(cancel)
        .await?;
    Ok(settings
        .stdout
        .into_string()
        .lines()
        .any(|line| !matches!(line.trim(), "core.autocrlf false" | "core.symlinks true")))
}

/// Whether the attributes file at `path` could make a checkout convert bytes: it sets (or
/// leaves to configuration) `text`, `eol`, `crlf`, `ident`, `filter` or
/// `working-tree-encoding`, or defines a macro. A file that cannot be read counts as
/// converting; a missing one does not.
pub(crate) fn converts_at(path: &Path) -> bool {
    match std::fs::read(path) {
        Ok(bytes) => attributes_convert(&String::from_utf8_lossy(&bytes)),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// [`converts_at`] of an attributes file's text.
pub(crate) fn attributes_convert(text: &str) -> bool {
    const CONVERTING: [&str; 6] = [
        "text",
        "eol",
        "crlf",
        "ident",
        "filter",
        "working-tree-encoding",
    ];
    text.lines().map(str::trim).any(|line| {
        if line.is_empty() || line.starts_with('#') {
            return false;
        }
        if line.starts_with("[attr]") {
            return true;
        }
        line.split_whitespace().skip(1).any(|attr| {
            // `-text`: unset, nothing converts. `!text` leaves it to configuration and
            // `text`, `text=…` set it: either may convert.
            let name = attr.trim_start_matches('!');
            let name = name.split('=').next().unwrap_or(name);
            !attr.starts_with('-') && CONVERTING.contains(&name)
        })
    })
}

/// A pack (and its index) of what the box's repository gets: the base commit's objects, or
/// the whole session branch with [`History::Full`]. Made here, so the box neither re-indexes
/// nor re-hashes it.
async fn make_pack(
    out: &Outbound<'_>,
    commit: &str,
    cancel: &CancellationToken,
) -> Result<(Scratch, String)> {
    let scratch = Scratch::new(out.scratch, "pack")?;
    // Existing deltas are reused; no new delta search (it costs more than it saves here).
    let pack = git(out.local)
        .args(["pack-objects", "-q", "--window=0"])
        .arg(scratch.path().join("pack"));
    let hash = match out.history {
        History::Shallow => {
            let objects = git(out.local)
                .args(["rev-list", "--objects", "--no-object-names", "-1", commit])
                .run_checked(cancel)
                .await?;
            pack.stdin(objects.into_bytes()).run_checked(cancel).await?
        }
        History::Full => {
            pack.arg("--revs")
                .stdin(format!("{commit}\n").into_bytes())
                .run_checked(cancel)
                .await?
        }
    };
    let hash = hash.trim().to_owned();
    if hash.is_empty() || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(crate::Error::Invalid {
            what: "git pack-objects' output".into(),
            detail: format!("{hash:?} is not a pack name"),
        });
    }
    Ok((scratch, hash))
}

/// Makes the box's repository in its staging directory `staging`, in one round trip:
/// refuses a box directory (`remote`'s) that exists and is not empty, then a fresh `git init`
/// in `staging` gets the pack (streamed in a tar), the session branch at the base commit, and
/// that commit checked out. Returns how files reach the box.
async fn seed_repository(
    out: &Outbound<'_>,
    remote: &Remote,
    staging: &Remote,
    before: &str,
    (pack, hash): &(Scratch, String),
    commit: &str,
    cancel: &CancellationToken,
) -> Result<Method> {
    let branch = format!("refs/heads/skiff/{}", out.session);
    let (dir, stage) = (remote.quoted_dir(), staging.quoted_dir());
    let (q, c) = (shell_quote(&branch), shell_quote(commit));
    let shallow = match out.history {
        History::Shallow => format!("printf '%s\\n' {c} > .git/shallow; "),
        History::Full => String::new(),
    };
    let identity = match out.identity {
        Some((name, email)) => format!(
            "git config user.name {}; git config user.email {}; ",
            shell_quote(name),
            shell_quote(email)
        ),
        None => String::new(),
    };
    // The pack goes in before its index: git ignores a pack until its index is there. The
    // checkout reads no configuration or attributes of the box user's (a reused box may have
    // some): it must write the commit's bytes as they are. Its writes wait on the file system
    // more than on the CPU: more parallel workers than cores. It yields the CPU (`nice`): the
    // first model request waits for the gateway's side of a lay-down, not for this one, and a
    // box on the gateway's machine shares its CPU. Whatever a failed lay-down left in the
    // staging directory goes first.
    let script = format!(
        "set -e; export GIT_TERMINAL_PROMPT=0; {before}\
         if [ -e {dir} ] && [ -n \"$(ls -A {dir})\" ]; then echo taken; exit 0; fi; \
         rm -rf {stage}; mkdir -p {stage}; cd {stage}; git init -q; in=.git/skiff-incoming; \
         mkdir -p \"$in\" .git/objects/pack; tar -C \"$in\" -xf -; \
         mv \"$in\"/pack-{hash}.pack .git/objects/pack/; mv \"$in\"/pack-{hash}.idx .git/objects/pack/; \
         {shallow}git update-ref {q} {c}; git symbolic-ref HEAD {q}; umask 022; \
         GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 nice -n 10 git -c core.hooksPath=/dev/null \
         -c core.attributesFile=/dev/null -c checkout.workers=8 reset -q --hard {c}; \
         rm -rf \"$in\"; {identity}{}",
        remote.method_probe()
    );
    let done = remote.run_with_tar(&script, pack.path(), cancel).await?;
    let stdout = done.stdout.into_string();
    if stdout.lines().any(|l| l.trim() == "taken") {
        return Err(crate::Error::RemoteNotEmpty {
            dir: remote.dir().to_owned(),
        });
    }
    if !done.status.success() {
        return Err(skiff_process::Error::Failed {
            command: format!(
                "laying the base commit {commit} into {} on the box",
                staging.dir()
            ),
            status: done.status.to_string(),
            stderr: done.stderr.into_string().trim().to_owned(),
        }
        .into());
    }
    let method = Method::from_probe(&stdout);
    remote.remember(method);
    Ok(method)
}

/// Moves the repository [`seed_repository`] made in `staging` into place as `remote`'s
/// directory (refused when that exists and is not empty, or is a symlink) and deletes the
/// tracked files the user deleted (`deleted`, NUL-separated and checked), in one round trip.
async fn move_into_place(
    remote: &Remote,
    staging: &Remote,
    deleted: Vec<u8>,
    cancel: &CancellationToken,
) -> Result<()> {
    let (dir, stage) = (remote.quoted_dir(), staging.quoted_dir());
    // The deletions are made in the staging directory, and the rename is the last step. A
    // worker waiting for the workspace may have made its directory, empty: the rename
    // replaces it (`-T`: never into it), and refuses one that is not empty.
    let script = format!(
        "set -e; if [ -L {dir} ] || {{ [ -e {dir} ] && [ ! -d {dir} ]; }} || \
         {{ [ -d {dir} ] && [ -n \"$(ls -A {dir})\" ]; }}; then echo taken; exit 0; fi; \
         (cd {stage} && xargs -0 -r rm -f --); mv -T {stage} {dir} || {{ echo taken; exit 0; }}; echo placed"
    );
    let done = remote.run(&script, deleted, cancel).await?;
    if done.lines().any(|l| l.trim() == "taken") {
        return Err(crate::Error::RemoteNotEmpty {
            dir: remote.dir().to_owned(),
        });
    }
    Ok(())
}

/// Removes a staging directory of the box after a lay-down that stopped (best effort: a
/// placement that fails gives its box up).
async fn discard_staging(staging: &Remote, cancel: &CancellationToken) {
    let stage = staging.quoted_dir();
    if let Err(e) = staging
        .run(&format!("rm -rf {stage}"), Vec::new(), cancel)
        .await
    {
        tracing::debug!(dir = staging.dir(), error = %e, "outbound: the staging directory stays");
    }
}

/// Where a kept workspace is, and where it goes back to.
#[derive(Clone, Copy, Debug)]
pub struct Kept<'a> {
    /// The box directory (relative to the box user's home) the workspace was moved to when
    /// its session was parked.
    pub dir: &'a str,
    /// What the box held when it was kept: the base manifest of its last turn.
    pub manifest: &'a Manifest,
}

/// Puts a kept workspace back in place on the box (`kept.dir` → `remote`'s directory) and
/// brings it up to date with `out.local`: only the files that differ from `kept.manifest`
/// travel, and files gone here are deleted there. When nothing changed, that is one round
/// trip, made while the workspace here is listed and hashed. Returns `None`, with the box
/// untouched, when the kept workspace cannot serve: it is not on the box (any more), the box's
/// directory is taken, or (git mode) the session branch moved to another commit since; the
/// caller clears what is kept and lays the workspace down afresh with [`push`]. An error
/// after the move (the workspace here cannot be listed) leaves the box holding the session's
/// workspace where it belongs, for the failed placement to give up.
pub async fn resume(
    out: &Outbound<'_>,
    remote: &Remote,
    kept: &Kept<'_>,
    cancel: &CancellationToken,
) -> Result<Option<Dispatched>> {
    let started = std::time::Instant::now();
    let kept_dir = Remote::new(remote.ssh().clone(), kept.dir)?;
    let base_commit = match out.mode {
        Mode::Git => Some(session_head(out.local, out.session, cancel).await?),
        Mode::Plain => None,
    };
    if base_commit != kept.manifest.base_commit {
        return Ok(None);
    }
    // The kept directory moves back (only into a free place) while this side lists and
    // hashes: when nothing changed, the move is the only round trip and costs no time of its
    // own. The box's directory is only the session's again: a failure below fails the
    // placement, which gives the box up.
    let (from, to) = (kept_dir.quoted_dir(), remote.quoted_dir());
    let parent = match remote.dir().rsplit_once('/') {
        Some((parent, _)) => format!("mkdir -p {}; ", shell_quote(parent)),
        None => String::new(),
    };
    let restore = format!(
        "set -e; if [ -d {from} ] && [ ! -L {from} ] && [ ! -e {to} ]; then \
         {parent}mv {from} {to}; echo restored; else echo absent; fi; {}",
        remote.method_probe()
    );
    let restoring = remote.run(&restore, Vec::new(), cancel);
    let scanning = async {
        let list = filelist::list(out.local, out.mode, out.rules, out.limits, cancel).await?;
        if out.mode == Mode::Plain {
            filelist::check_shareable(out.local, &list)?;
        }
        let base = {
            let (root, list, commit) = (out.local.to_path_buf(), list.clone(), base_commit.clone());
            tokio::task::spawn_blocking(move || manifest::build(&root, &list, commit))
                .await
                .map_err(|e| crate::Error::Invalid {
                    what: format!("hashing {}", out.local.display()),
                    detail: e.to_string(),
                })??
        };
        let diff = manifest::diff(kept.manifest, &base);
        let mut deleted = Vec::new();
        for path in &diff.deleted {
            contain::check_path(path)?;
            deleted.extend_from_slice(path.as_bytes());
            deleted.push(0);
        }
        Ok::<_, crate::Error>((list, base, diff, deleted))
    };
    let (restored, scanned) = tokio::join!(restoring, scanning);
    let restored = restored?;
    if restored.lines().next().map(str::trim) != Some("restored") {
        // Nothing moved: the box is as it was.
        return Ok(None);
    }
    let (list, base, diff, deleted) = scanned?;
    let method = Method::from_probe(&restored);
    remote.remember(method);
    if !deleted.is_empty() {
        remote
            .run(&format!("cd {to} && xargs -0 -r rm -f --"), deleted, cancel)
            .await?;
    }
    let sent: Vec<String> = diff.changed.into_keys().collect();
    remote
        .push_files_by(out.local, &sent, method, cancel)
        .await?;
    tracing::debug!(
        ms = started.elapsed().as_millis() as u64,
        files = sent.len(),
        deleted = diff.deleted.len(),
        "outbound: a kept workspace resumed"
    );
    Ok(Some(Dispatched {
        manifest: base,
        method,
        files: list.files.len(),
        bytes: list.total_bytes,
        left_out: list.left_out,
    }))
}

#[cfg(test)]
mod tests {
    use super::attributes_convert;

    #[test]
    fn only_converting_attributes_make_a_checkout_convert() {
        assert!(!attributes_convert(
            "# nothing\n\n*.png binary\n*.rs diff=rust linguist-vendored\n"
        ));
        assert!(!attributes_convert("*.bin -text -diff\n"));
        assert!(attributes_convert("*.txt text\n"));
        assert!(attributes_convert("* text=auto\n"));
        assert!(attributes_convert("*.sh eol=lf\n"));
        assert!(attributes_convert("*.c ident\n"));
        assert!(attributes_convert("*.txt filter=up\n"));
        assert!(attributes_convert("*.txt !text\n"));
        assert!(attributes_convert("*.x working-tree-encoding=UTF-16\n"));
        assert!(attributes_convert("[attr]mine text\n"));
    }
}
