//! What people read: the real `skiff` binary's exit code, stdout and stderr together, as inline
//! snapshots (the way uv's `uv_snapshot!` does it), with ids, paths, times, ports and hashes
//! redacted so that a snapshot changes only when what a user sees changes.

use crate::harness::{Gateway, SKIFF};
use skiff_test_support::TempGitRepo;
use std::process::{Command, Output};

/// Exit code, stdout and stderr of `cmd`, redacted by [`settings`] at assertion time.
fn run(cmd: &mut Command) -> String {
    render(&cmd.output().unwrap())
}

fn render(out: &Output) -> String {
    format!(
        "success: {}\nexit_code: {}\n----- stdout -----\n{}\n----- stderr -----\n{}",
        out.status.success(),
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Filters for everything that differs between runs. `paths` are this test's temp dirs, most
/// specific first.
fn settings(paths: &[(&std::path::Path, &str)]) -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    for (path, name) in paths {
        s.add_filter(&regex_escape(&path.display().to_string()), *name);
    }
    s.add_filter(r"/tmp/\.tmp[A-Za-z0-9]+", "[TMP]");
    s.add_filter(r"/tmp/skiff-demo-[A-Za-z0-9]+", "[DEMO]");
    s.add_filter(&regex_escape(SKIFF), "skiff");
    // Ids and ages keep their width, so that a table's alignment shows in its snapshot.
    for n in (4..=32).rev() {
        s.add_filter(
            &format!(r"\b(ses|run|env|ent|art|snap|att|cbx|lbx|ckp)_[0-9A-Za-z]{{{n}}}\b"),
            format!("${{1}}_{}", "x".repeat(n)),
        );
    }
    s.add_filter(r"\b\d[smhd] ago\b", "Ns ago");
    s.add_filter(r"\b\d\d[smhd] ago\b", "NNs ago");
    s.add_filter(r"\bin \d+ / out \d+ tokens\b", "in [N] / out [N] tokens");
    s.add_filter(r"\b\d+(\.\d+)? ?(ms|s)\b", "[DURATION]");
    s.add_filter(r"127\.0\.0\.1:\d+", "127.0.0.1:[PORT]");
    s.add_filter(r"\b[0-9a-f]{7,64}\b", "[HASH]");
    s
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .map(|c| {
            if "\\.+*?()|[]{}^$".contains(c) {
                format!("\\{c}")
            } else {
                c.to_string()
            }
        })
        .collect()
}

const FIX_TYPO: &str = r#"
[[turns]]
text = "Checking the file."
[[turns.tool_calls]]
name = "exec"
arguments = { command = "cat notes.txt" }

[[turns]]
text = "The notes are fine."
"#;

#[test]
fn session_new_list_and_show_read_well() {
    let gw = Gateway::start(FIX_TYPO);
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n")]);
    let tmp = gw.state_dir.parent().unwrap().to_owned();
    let _guard = settings(&[(repo.path(), "[REPO]"), (&tmp, "[GW]")]).bind_to_scope();

    let new = run(gw.cli().args([
        "session",
        "new",
        "--workspace",
        repo.path().to_str().unwrap(),
        "--model",
        "fake/any",
        "look at the notes",
    ]));
    insta::assert_snapshot!(new, @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        Checking the file.
          ▸ exec cat notes.txt  ✓ exit 0 · [DURATION]
              draft notes
        The notes are fine.

        ----- stderr -----
        session ses_xxxxxxxxxxxxxxxx · fake/any (scripted) · [GW]/state/worktrees/ses_xxxxxxxxxxxxxxxx
        ✓ run succeeded
    "#);

    insta::assert_snapshot!(run(gw.cli().args(["session", "list"])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        ID                    STATE  PLACEMENT  MODEL                UPDATED  TITLE
        ses_xxxxxxxxxxxxxxxx  idle   local      fake/any (scripted)  Ns ago   look at the notes

        ----- stderr -----
    "#);

    let id = gw.json(&["session", "list", "--json"])["sessions"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    insta::assert_snapshot!(run(gw.cli().args(["session", "show", &id])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        session    ses_xxxxxxxxxxxxxxxx
        title      look at the notes
        state      idle
        placement  local
        model      fake/any (scripted)
        workspace  [GW]/state/worktrees/ses_xxxxxxxxxxxxxxxx (git worktree of [REPO])
        branch     skiff/ses_xxxxxxxxxxxxxxxx (from [HASH])
        runs       1
          run_xxxxxxxxxxxxxxxx  succeeded  in [N] / out [N] tokens

        you    look at the notes
        agent  Checking the file.
          ▸ exec cat notes.txt  ✓ exit 0
              draft notes
        agent  The notes are fine.

        ----- stderr -----
    "#);
}

#[test]
fn env_list_without_environments_says_how_to_make_one() {
    let gw = Gateway::start("");
    let tmp = gw.state_dir.parent().unwrap().to_owned();
    let _guard = settings(&[(&tmp, "[GW]")]).bind_to_scope();
    insta::assert_snapshot!(run(gw.cli().args(["env", "list"])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        no environments; lease one with `skiff env create --profile local`

        ----- stderr -----
    "#);
}

#[test]
fn top_level_help() {
    let _guard = settings(&[]).bind_to_scope();
    insta::assert_snapshot!(run(Command::new(SKIFF).arg("--help")), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        Run AI coding-agent sessions on machines you own, with the conversation, keys and policy kept at home.

        Usage: skiff [OPTIONS] [COMMAND]

        Commands:
          gateway      Start the control plane (API, sessions, runs)
          session      Create, follow and control sessions
          env          Lease, inspect and tear down worker boxes
          box          This machine's local boxes behind the lease-CLI contract (what `command` providers run)
          demo         Run the whole flow offline: a gateway, a sample repository, a session that edits, tests and commits
          secret       Keep provider keys and tokens sealed in the gateway's vault (`api_key = "vault:NAME"`)
          agent        Agent specs and their versions (`[agents.NAME]` or `agents/NAME.toml`)
          approve      Let a tool call that waits for approval run (`skiff approve apr_…`)
          deny         Refuse a tool call that waits for approval; the agent reads the reason
          approvals    Tool calls that waited or wait for approval, newest first
          ui           Print a one-use login link for the Control UI in a browser
          login        Sign in to a gateway with single sign-on (a code to confirm at its identity provider); later commands use the token
          logout       Forget the `skiff login` sign-in and revoke its token
          admin        The gateway's administration: users, tokens, usage against budgets, moving to PostgreSQL
          audit        Read and take away the audit trail (metadata only)
          doctor       Check this machine for what worker boxes need (root, sshd, rsync, namespaces…)
          completions  Print a shell completion script: `skiff completions bash > /etc/bash_completion.d/skiff`
          worker       Worker mode: run a session's agent loop on a box (the gateway starts this over SSH)
          help         Print this message or the help of the given subcommand(s)

        Options:
              --state-dir <DIR>  State directory [default: $XDG_STATE_HOME/skiff, else ~/.local/state/skiff]
              --json             Print JSON for scripts (one document, or JSON lines for streams)
              --build-hash       Print the build hash of this executable (what a box's installed bundle is checked against)
          -h, --help             Print help
          -V, --version          Print version

        Exit codes:
          0  success
          1  the thing failed (a run failed or was cancelled, an apply or export was refused)
          2  usage error, or a request the gateway refused as bad (input, token, model, profile)
          3  the gateway is unreachable, at capacity or unavailable: try again later
          4  not found
          5  conflict: the session is busy, or its state does not allow it now
          6  a box, its provider or a git remote failed
          7  the gateway's own fault (its log has the cause)

        Environment:
          SKIFF_URL, SKIFF_TOKEN   the gateway to talk to (win over <state-dir>/login.json from `skiff login`,
                                   which wins over <state-dir>/gateway.json)
          SKIFF_VAULT_KEY          the gateway's vault key (base64 of 32 bytes) instead of <state-dir>/vault.key
          SKIFF_GRANT_KEY          the gateway's governed-action grant key (base64 of 32 bytes) instead of <state-dir>/grant.key

        ----- stderr -----
    "#);
}

#[test]
fn admin_migrate_help() {
    let _guard = settings(&[]).bind_to_scope();
    insta::assert_snapshot!(run(Command::new(SKIFF).args(["admin", "migrate", "--help"])), @r"
        success: true
        exit_code: 0
        ----- stdout -----
        Copy this state's database into an empty PostgreSQL database and verify it, with the gateway stopped: `skiff admin migrate --to postgres://skiff@db.example/skiff`

        Usage: skiff admin migrate [OPTIONS] --to <URL>

        Options:
              --state-dir <DIR>  State directory [default: $XDG_STATE_HOME/skiff, else ~/.local/state/skiff]
              --to <URL>         The empty PostgreSQL database: `postgres://USER@HOST[:PORT]/DB` (a Unix socket as `%2Frun%2Fpostgresql` for HOST). Give the password in `PGPASSWORD` rather than the url, where every user of the machine could read it in the process list; it is never printed
              --json             Print JSON for scripts (one document, or JSON lines for streams)
          -h, --help             Print help

        ----- stderr -----
    ");
}

#[test]
fn doctor_json_shape() {
    let mut s = settings(&[]);
    // Details, verdicts and fixes depend on the machine (its paths, kernel, cgroups, python);
    // the shape is what scripts rely on. `newcomer.rs` checks the verdicts.
    s.add_filter(r#""detail": "[^"]*""#, r#""detail": "[DETAIL]""#);
    s.add_filter(r#""ok": (true|false)"#, r#""ok": [BOOL]"#);
    s.add_filter(r#""fix": (null|"[^"]*")"#, r#""fix": [FIX]"#);
    let _guard = s.bind_to_scope();
    insta::assert_snapshot!(run(Command::new(SKIFF).args(["doctor", "--json"])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        [
          {
            "check": "root",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "sshd",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "ssh",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "rsync",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "git",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "ip",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "useradd",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "unshare",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "setpriv",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "user namespaces",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": true
          },
          {
            "check": "cgroup v2",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": false
          },
          {
            "check": "python3",
            "detail": "[DETAIL]",
            "fix": [FIX],
            "ok": [BOOL],
            "required": false
          }
        ]

        ----- stderr -----
    "#);
}

#[test]
fn demo_fixes_the_typo_on_a_local_box() {
    let dir = tempfile::tempdir().unwrap();
    let _guard = settings(&[(dir.path(), "[STATE]")]).bind_to_scope();
    insta::assert_snapshot!(
        run(Command::new(SKIFF)
            .arg("--state-dir")
            .arg(dir.path())
            .arg("demo")
            .env_remove("SKIFF_URL")
            .env_remove("SKIFF_TOKEN")),
        @r#"
            success: true
            exit_code: 0
            ----- stdout -----
            I'm the scripted demo model. Let me look at the repository first.
              ▸ ls .  ✓ 4 entries · [DURATION]
              ▸ read README.md  ✓ 3 lines · [DURATION]
            The README says greet.sh prints the greeting. Let me read it.
              ▸ read greet.sh  ✓ 2 lines · [DURATION]
            There it is: "Helo" should be "Hello". Fixing it.
              ▸ edit greet.sh  ✓ 1 edit · [DURATION]
            Now let me run the test.
              ▸ exec ./test.sh  ✓ exit 0 · [DURATION]
                  ok: Hello, Skiff!
            The test passes. Committing the fix.
              ▸ exec git add greet.sh && git commit -q -m 'Fix the greeting typo' && git log --oneline -1  ✓ exit 0 · [DURATION]
                  [HASH] Fix the greeting typo
            Done. I fixed the typo in greet.sh ("Helo" → "Hello"), ran ./test.sh, which passes, and committed the fix on this session's branch.

            What changed (on branch skiff/ses_xxxxxxxxxxxxxxxx, commit [HASH]):
             greet.sh | 2 +-
             1 file changed, 1 insertion(+), 1 deletion(-)
            Your checkout at [DEMO]/greeter is untouched (git status is clean).

            Look at it:
              git -C [DEMO]/greeter log -p main..skiff/ses_xxxxxxxxxxxxxxxx
              skiff --state-dir [DEMO]/state gateway --listen 127.0.0.1:[PORT] &
              skiff --state-dir [DEMO]/state session show ses_xxxxxxxxxxxxxxxx

            ----- stderr -----
            › creating a sample git repository at [DEMO]/greeter
            › starting a gateway with state dir [DEMO]/state
            › session ses_xxxxxxxxxxxxxxxx on scripted/demo (scripted), running on a worker box (profile local)
            › its own worktree [DEMO]/state/worktrees/ses_xxxxxxxxxxxxxxxx on branch skiff/ses_xxxxxxxxxxxxxxxx

            you    greet.sh prints "Helo" instead of "Hello". Fix the typo, run ./test.sh to check, and commit the fix.

            ◦ provisioning leasing a box from profile local
            ◦ syncing      laying the workspace onto env_xxxxxxxxxxxxxxxx
            ◦ starting     3 files (314 B) going onto the box, nothing left out; the worker starts meanwhile and its tools wait for them; starting the worker
            ◦ active       worker ready on env_xxxxxxxxxxxxxxxx (epoch 1)
            ◦ reconciling  bringing the box's work back
            ◦ active       the box's work is in the session's workspace
            ✓ run succeeded
            › tearing down worker box env_xxxxxxxxxxxxxxxx

            demo finished in [DURATION]
        "#
    );
}

#[test]
fn env_list_lines_its_columns_up() {
    let root = crate::env::BoxRoot::new();
    let gw = Gateway::start_with("", &crate::env::profiles(&root));
    let env = crate::env::create(&gw, "local", &[]);
    let tmp = gw.state_dir.parent().unwrap().to_owned();
    let _guard = settings(&[(&tmp, "[GW]")]).bind_to_scope();
    insta::assert_snapshot!(run(gw.cli().args(["env", "list"])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        ID                    STATE  PROFILE  PROVIDER  LEASE             AGE     NOTE
        env_xxxxxxxxxxxxxxxx  idle   local    local     lbx_xxxxxxxxxxxx  Ns ago

        ----- stderr -----
    "#);
    crate::env::destroy(&gw, env["id"].as_str().unwrap());
}

#[test]
fn env_create_and_show_read_well() {
    let root = crate::env::BoxRoot::new();
    let gw = Gateway::start_with("", &crate::env::profiles(&root));
    let tmp = gw.state_dir.parent().unwrap().to_owned();
    let _guard = settings(&[(root.path(), "[BOXES]"), (&tmp, "[GW]")]).bind_to_scope();
    let created = gw.run(&["env", "create", "--profile", "local"]);
    let id = String::from_utf8_lossy(&created.stdout)
        .split_whitespace()
        .find(|w| w.starts_with("env_"))
        .unwrap()
        .to_owned();
    // The CLI prints the states it sees; `ready` lasts an instant on the way to `idle`, so
    // whether it is seen depends on timing, not on the CLI.
    let shown: String = render(&created)
        .lines()
        .filter(|line| !line.trim_end().ends_with("  ready"))
        .map(|line| format!("{line}\n"))
        .collect();
    insta::assert_snapshot!(shown, @r"
    success: true
    exit_code: 0
    ----- stdout -----
    environment  env_xxxxxxxxxxxxxxxx
    state        idle
    profile      local · provider local
    lease        lbx_xxxxxxxxxxxx
    ssh          skf-[HASH]@127.0.0.1:[PORT]
    bundle       [HASH]
    age          Ns ago · idle since Ns ago
    sessions     -
    tunnel       none
    egress       0 model requests · tokens 0 in / 0 out · bytes 0 in / 0 out · 0 gateway-tool calls

    ----- stderr -----
       [DURATION]  env_xxxxxxxxxxxxxxxx  requested
       [DURATION]  env_xxxxxxxxxxxxxxxx  provisioning
       [DURATION]  env_xxxxxxxxxxxxxxxx  bootstrapping
       [DURATION]  env_xxxxxxxxxxxxxxxx  idle
    ");
    insta::assert_snapshot!(run(gw.cli().args(["env", "show", &id])), @r"
    success: true
    exit_code: 0
    ----- stdout -----
    environment  env_xxxxxxxxxxxxxxxx
    state        idle
    profile      local · provider local
    lease        lbx_xxxxxxxxxxxx
    ssh          skf-[HASH]@127.0.0.1:[PORT]
    bundle       [HASH]
    age          Ns ago · idle since Ns ago
    sessions     -
    tunnel       none
    egress       0 model requests · tokens 0 in / 0 out · bytes 0 in / 0 out · 0 gateway-tool calls

    ----- stderr -----
    ");
    crate::env::destroy(&gw, &id);
}

#[test]
fn session_watch_of_a_finished_session_reads_well() {
    let gw = Gateway::start(FIX_TYPO);
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n")]);
    let tmp = gw.state_dir.parent().unwrap().to_owned();
    let _guard = settings(&[(repo.path(), "[REPO]"), (&tmp, "[GW]")]).bind_to_scope();
    let id = gw.new_session(repo.path(), "fake/x", "check the notes");
    insta::assert_snapshot!(run(gw.cli().args(["session", "watch", &id])), @r"
    success: true
    exit_code: 0
    ----- stdout -----
    Checking the file.
      ▸ exec cat notes.txt  ✓ exit 0 · [DURATION]
          draft notes
    The notes are fine.

    ----- stderr -----
    ✓ run succeeded
    ");
}

#[test]
fn session_compact_says_what_it_replaced_and_show_marks_the_point() {
    let gw = Gateway::start(FIX_TYPO);
    let repo = TempGitRepo::new(&[("notes.txt", "draft notes\n")]);
    let tmp = gw.state_dir.parent().unwrap().to_owned();
    let mut settings = settings(&[(repo.path(), "[REPO]"), (&tmp, "[GW]")]);
    // The sizes follow the system prompt and the tool specs, which change for other reasons.
    settings.add_filter(r"≈\d+ tokens", "≈[N] tokens");
    settings.add_filter(r"summary of \d+ tokens", "summary of [N] tokens");
    let _guard = settings.bind_to_scope();
    let id = gw.new_session(repo.path(), "fake/any", "look at the notes");

    insta::assert_snapshot!(run(gw.cli().args(["session", "compact", &id])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        compacted 4 entries (≈[N] tokens) into a summary of [N] tokens

        ----- stderr -----
    "#);
    // The scripted model replays its first turn as the summary.
    insta::assert_snapshot!(run(gw.cli().args(["session", "show", &id])), @r#"
        success: true
        exit_code: 0
        ----- stdout -----
        session    ses_xxxxxxxxxxxxxxxx
        title      look at the notes
        state      idle
        placement  local
        model      fake/any (scripted)
        workspace  [GW]/state/worktrees/ses_xxxxxxxxxxxxxxxx (git worktree of [REPO])
        branch     skiff/ses_xxxxxxxxxxxxxxxx (from [HASH])
        runs       1
          run_xxxxxxxxxxxxxxxx  succeeded  in [N] / out [N] tokens

        you    look at the notes
        agent  Checking the file.
          ▸ exec cat notes.txt  ✓ exit 0
              draft notes
        agent  The notes are fine.
          ── conversation compacted: 4 entries (≈[N] tokens) summarised ──
          Checking the file.

        ----- stderr -----
    "#);
}
