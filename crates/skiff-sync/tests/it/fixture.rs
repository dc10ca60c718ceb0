//! A real box per test, torn down on drop (also when the test panics), and helpers to look at
//! both sides.

use skiff_providers::Isolation;
use skiff_providers::local::Boxes;
use skiff_ssh::{Ssh, Target};
use skiff_sync::filelist::{Limits, Mode};
use skiff_sync::{Manifest, Remote, Rules, manifest};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub fn cancel() -> CancellationToken {
    CancellationToken::new()
}

pub struct TestBox {
    boxes: Boxes,
    id: String,
    pub ssh: Ssh,
    /// The box user's home, as this (root) process sees it.
    pub home: PathBuf,
    _root: tempfile::TempDir,
    _ssh_dir: tempfile::TempDir,
}

fn box_id() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let seed = format!(
        "{}-{:?}-{}",
        std::process::id(),
        std::time::SystemTime::now(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    format!("lbx_{}", &blake3::hash(seed.as_bytes()).to_hex()[..12])
}

impl TestBox {
    pub async fn new() -> TestBox {
        let root = tempfile::Builder::new()
            .prefix("skiff-sync-boxes-")
            .tempdir_in("/tmp")
            .unwrap();
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        // No `skiff` executable here to run a sandbox with; sync needs only sshd and a user.
        let boxes =
            Boxes::new(root.path().to_path_buf(), PathBuf::from("/bin/false")).without_sandbox();
        let id = box_id();
        let status = boxes
            .create(&id, Isolation::None, Duration::from_secs(3600))
            .await
            .unwrap();
        let ssh_dir = tempfile::tempdir().unwrap();
        let ssh = Ssh::pin(
            Target {
                alias: status.id.clone(),
                host: status.ssh_host.clone(),
                port: status.ssh_port,
                user: status.ssh_user.clone(),
                identity_file: PathBuf::from(&status.ssh_key),
                host_key: status.ssh_host_key.clone(),
                proxy_command: status.proxy_command.clone(),
            },
            ssh_dir.path(),
        )
        .unwrap();
        let home = root.path().join(&id).join("home");
        TestBox {
            boxes,
            id,
            ssh,
            home,
            _root: root,
            _ssh_dir: ssh_dir,
        }
    }

    pub fn remote(&self, dir: &str) -> Remote {
        Remote::new(self.ssh.clone(), dir).unwrap()
    }

    /// A path on the box, as this process sees it.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.home.join(rel)
    }

    /// Runs a shell command line on the box, as the box user.
    pub async fn sh(&self, script: &str) -> String {
        self.ssh
            .run(script, &cancel())
            .await
            .unwrap_or_else(|e| panic!("on the box: {script}: {e}"))
    }

    /// The manifest a worker on the box would report for `dir` (git listing done on the box, as
    /// the box user; hashing done here).
    pub async fn manifest(&self, dir: &str, mode: Mode) -> Manifest {
        self.try_manifest(dir, mode).await.unwrap()
    }

    pub async fn try_manifest(&self, dir: &str, mode: Mode) -> skiff_sync::Result<Manifest> {
        let root = self.path(dir);
        let rules = Rules::load(&root)?;
        match mode {
            Mode::Plain => {
                manifest::scan(&root, Mode::Plain, &rules, &Limits::default(), &cancel()).await
            }
            Mode::Git => {
                let out = self
                    .sh(&format!(
                        "cd {dir} && git ls-files -z --cached --others --exclude-standard"
                    ))
                    .await;
                let mut list = skiff_sync::FileList::default();
                for path in out.split('\0').filter(|p| !p.is_empty()) {
                    if rules.excluded(path, false) {
                        continue;
                    }
                    let Ok(meta) = std::fs::symlink_metadata(root.join(path)) else {
                        continue;
                    };
                    list.files.push(skiff_sync::filelist::ListedFile {
                        path: path.to_owned(),
                        size: meta.len(),
                        symlink: meta.file_type().is_symlink(),
                    });
                }
                manifest::build(&root, &list, None)
            }
        }
    }
}

impl Drop for TestBox {
    fn drop(&mut self) {
        let (boxes, id) = (self.boxes.clone(), self.id.clone());
        let ssh = self.ssh.clone();
        // Drop may run inside the test's runtime: tear down on a thread of our own.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                ssh.close().await;
                boxes.destroy(&id).await
            })
        })
        .join();
        if let Ok(Err(e)) = done {
            eprintln!("could not destroy box {}: {e}", self.id);
        }
    }
}

/// Runs git in `dir` with no user or system configuration.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?} in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Sorted `git status --porcelain` lines with every untracked file listed.
pub fn status_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// Everything under `dir` (files, symlinks and their contents), to prove nothing changed.
pub fn snapshot(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                out.push((
                    rel,
                    format!("-> {}", std::fs::read_link(&p).unwrap().display()),
                ));
            } else if ft.is_dir() {
                out.push((rel, "dir".into()));
                stack.push(p);
            } else {
                out.push((
                    rel,
                    blake3::hash(&std::fs::read(&p).unwrap())
                        .to_hex()
                        .to_string(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// A user repository and the session's managed worktree on `skiff/<session>`, as the gateway
/// makes them.
pub struct Workspace {
    pub repo: skiff_test_support::TempGitRepo,
    pub worktree: PathBuf,
    pub session: String,
    pub scratch: tempfile::TempDir,
    _dir: tempfile::TempDir,
}

impl Workspace {
    pub fn git(files: &[(&str, &str)]) -> Workspace {
        let repo = skiff_test_support::TempGitRepo::new(files);
        let dir = tempfile::tempdir().unwrap();
        let session = format!("ses_{}", &box_id()[4..]);
        let worktree = dir.path().join("worktree");
        git(
            repo.path(),
            &[
                "worktree",
                "add",
                "-q",
                "-b",
                &format!("skiff/{session}"),
                worktree.to_str().unwrap(),
                "HEAD",
            ],
        );
        Workspace {
            repo,
            worktree,
            session,
            scratch: tempfile::tempdir().unwrap(),
            _dir: dir,
        }
    }

    pub fn write(&self, rel: &str, text: &str) {
        let p = self.worktree.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    pub fn head(&self) -> String {
        git(&self.worktree, &["rev-parse", "HEAD"])
            .trim()
            .to_owned()
    }
}
