//! The tools of a gateway-placed session are sandboxed: `exec` sees the workspace and the
//! system, never the gateway's state dir, another session's workspace or the gateway's `/proc`
//! entries; the file tools, which run in the gateway itself, cannot be walked out of the
//! workspace through a planted symlink or `..`, nor rewrite the worktree's `.git`. Git, a Python test suite and a shell script
//! still work in the workspace.

use crate::harness::{TestGateway, session_request};
use skiff_protocol::transcript::EntryBody;
use skiff_test_support::TempGitRepo;

/// Turn 0 attacks with `exec` and plants symlinks; turn 1 tries the file tools through them.
/// `targets.sh` (written by the test) names the gateway's state dir, the other session's
/// workspace and the gateway's pid.
const SCRIPT: &str = r#"
[[turns]]
text = "Looking around."
[[turns.tool_calls]]
name = "exec"
arguments = { command = '''
. ./targets.sh
for f in "$STATE/gateway.json" "$STATE/skiff.db" "$STATE/vault.key" "$OTHER/secret.txt" "/proc/$GATEWAY_PID/environ" /etc/shadow; do
  if cat "$f" 2>/dev/null; then echo "READ $f"; else echo "DENIED $f"; fi
done
echo "users: $(grep -c '^root:' /etc/passwd)"
ls "$STATE/worktrees" 2>/dev/null; echo "processes: $(ls /proc | grep -c '^[0-9]')"
''' }
[[turns.tool_calls]]
name = "exec"
arguments = { command = '''
set -e
echo work > made.txt
git add made.txt
git commit -qm "made in the sandbox"
git log --format=%s -1
python3 -m unittest -q 2>&1 | tail -1
sh ./test.sh
''' }
[[turns.tool_calls]]
name = "exec"
arguments = { command = '''
. ./targets.sh
ln -s "$STATE/gateway.json" token-link
ln -s "$STATE/skiff.db" db-link
ln -s "$STATE" state-link
ln -s "$OTHER" other-link
echo planted
''' }

[[turns]]
text = "Trying the file tools."
[[turns.tool_calls]]
name = "read"
arguments = { path = "token-link" }
[[turns.tool_calls]]
name = "read"
arguments = { path = "db-link" }
[[turns.tool_calls]]
name = "read"
arguments = { path = "state-link/gateway.json" }
[[turns.tool_calls]]
name = "read"
arguments = { path = "other-link/secret.txt" }
[[turns.tool_calls]]
name = "read"
arguments = { path = "../../gateway.json" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "token-link", content = "overwritten" }
[[turns.tool_calls]]
name = "write"
arguments = { path = "state-link/planted.txt", content = "planted" }
[[turns.tool_calls]]
name = "edit"
arguments = { path = "token-link", edits = [{ old_text = "url", new_text = "lru" }] }
[[turns.tool_calls]]
name = "apply_patch"
arguments = { patch = "*** Begin Patch\n*** Add File: state-link/patched.txt\n+x\n*** End Patch" }
[[turns.tool_calls]]
name = "write"
arguments = { path = ".git", content = "gitdir: ./my-own-git-dir" }
[[turns.tool_calls]]
name = "ls"
arguments = { path = "state-link" }
[[turns.tool_calls]]
name = "find"
arguments = { pattern = "*", path = "other-link" }
[[turns.tool_calls]]
name = "grep"
arguments = { pattern = "url", path = "token-link" }
[[turns.tool_calls]]
name = "grep"
arguments = { pattern = "url|secret" }
[[turns.tool_calls]]
name = "find"
arguments = { pattern = "**/*.json" }

[[turns]]
text = "Done."
"#;

const TEST_PY: &str = "import unittest\n\n\nclass Sums(unittest.TestCase):\n    def test_sum(self):\n        self.assertEqual(sum([1, 2]), 3)\n";

/// Every tool result of the session's transcript, in order: (tool, content, is_error).
async fn results(gw: &TestGateway, id: &skiff_protocol::SessionId) -> Vec<(String, String, bool)> {
    gw.client
        .session(id)
        .await
        .unwrap()
        .transcript
        .into_iter()
        .filter_map(|e| match e.body {
            EntryBody::ToolResult {
                name,
                content,
                is_error,
                ..
            } => Some((name, content, is_error)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_gateway_session_reaches_nothing_of_the_gateway_and_still_works_in_its_workspace() {
    let gw = TestGateway::start(SCRIPT).await;
    let repo = TempGitRepo::new(&[
        ("test_sums.py", TEST_PY),
        (
            "test.sh",
            "grep -q work made.txt && echo 'shell suite passed'\n",
        ),
    ]);
    // The other session: its workspace is what the first one must not reach.
    std::fs::write(repo.path().join("targets.sh"), "STATE=/nonexistent\n").unwrap();
    let other = gw
        .client
        .create_session(&session_request(repo.path(), "fake/x", "other"))
        .await
        .unwrap();
    gw.client.follow_until_run_end(&other.session.id, 0).await;
    let other_ws = other.session.workspace.path().to_owned();
    std::fs::write(
        std::path::Path::new(&other_ws).join("secret.txt"),
        "other-session-secret\n",
    )
    .unwrap();
    let state = gw.state_dir.canonicalize().unwrap();
    let gateway_json = std::fs::read_to_string(state.join("gateway.json")).unwrap();
    let token = gw.client.token().to_owned();
    assert!(gateway_json.contains(&token));
    // A vault key exists once a secret has been set.
    let (status, _) = gw
        .client
        .raw(
            reqwest::Method::PUT,
            "/v1/secrets/forge",
            r#"{"value":"v"}"#,
        )
        .await;
    assert!(status < 300, "setting a secret: {status}");
    let vault_key = std::fs::read_to_string(state.join("vault.key")).unwrap();
    std::fs::write(
        repo.path().join("targets.sh"),
        format!(
            "STATE={}\nOTHER={other_ws}\nGATEWAY_PID={}\n",
            state.display(),
            std::process::id()
        ),
    )
    .unwrap();

    let started = gw
        .client
        .create_session(&session_request(repo.path(), "fake/x", "attack"))
        .await
        .unwrap();
    let id = started.session.id.clone();
    gw.client.follow_until_run_end(&id, 0).await;
    let results = results(&gw, &id).await;
    let leaked = |text: &str| {
        text.contains(&token)
            || text.contains("other-session-secret")
            || text.contains(vault_key.trim())
            || text.contains("SQLite format")
    };
    for (tool, content, _) in &results {
        assert!(!leaked(content), "{tool} leaked a secret: {content}");
    }

    let (_, probe, _) = &results[0];
    for target in [
        "gateway.json",
        "skiff.db",
        "vault.key",
        "secret.txt",
        "environ",
        "/etc/shadow",
    ] {
        assert!(
            probe
                .lines()
                .any(|l| l.starts_with("DENIED") && l.ends_with(target)),
            "exec could read {target}: {probe}"
        );
    }
    assert!(!probe.contains("READ "), "{probe}");
    // What every user may read of `/etc` is there.
    assert!(probe.contains("users: 1"), "{probe}");
    // Of the state dir's worktrees, only its own is there.
    assert!(
        probe
            .lines()
            .filter(|l| !l.starts_with("DENIED"))
            .all(|l| !l.contains(other.session.id.as_str())),
        "{probe}"
    );
    let processes: u32 = probe
        .lines()
        .find_map(|l| l.strip_prefix("processes: "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{probe}"));
    assert!(processes < 8, "exec sees processes beyond its own: {probe}");

    let (_, work, is_error) = &results[1];
    assert!(!is_error, "git or the tests failed in the sandbox: {work}");
    assert!(work.contains("made in the sandbox"), "{work}");
    assert!(work.contains("OK"), "the Python suite did not pass: {work}");
    assert!(work.contains("shell suite passed"), "{work}");
    let ws = std::path::Path::new(started.session.workspace.path());
    assert_eq!(
        std::fs::read_to_string(ws.join("made.txt")).unwrap(),
        "work\n"
    );
    assert!(results[2].1.contains("planted"), "{:?}", results[2]);

    // Every file tool aimed through a planted link or `..` was refused; the walks at the
    // root did not follow the links.
    let file_tools = &results[3..];
    assert_eq!(file_tools.len(), 15, "{file_tools:#?}");
    for (tool, content, is_error) in &file_tools[..13] {
        assert!(is_error, "{tool} reached outside the workspace: {content}");
    }
    for (tool, content, _) in &file_tools[13..] {
        assert!(
            !content.contains("-link/") && !content.contains("token-link:"),
            "{tool} followed a planted link: {content}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(state.join("gateway.json")).unwrap(),
        gateway_json
    );
    assert!(!state.join("planted.txt").exists());
    assert!(!state.join("patched.txt").exists());
    gw.shutdown().await;
}
