use crate::procs::{assert_gone, started};
use serde_json::json;
use skiff_agent::tools::{ToolOutput, Tools};
use skiff_protocol::model::ToolCall;
use tokio_util::sync::CancellationToken;

pub(crate) fn workspace() -> (tempfile::TempDir, Tools) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), "one\ntwo\nthree\n").unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(
        dir.path().join("src/lib.rs"),
        "fn main() {}\n// TODO: more\n",
    )
    .unwrap();
    std::fs::write(dir.path().join(".gitignore"), "ignored/\n").unwrap();
    std::fs::create_dir(dir.path().join("ignored")).unwrap();
    std::fs::write(dir.path().join("ignored/x.rs"), "// TODO: hidden\n").unwrap();
    let tools = Tools::new(dir.path().to_path_buf(), hermetic_home(dir.path())).unwrap();
    (dir, tools)
}

/// A home of the test's own for `bash -l`: this machine's login profile (pyenv and the like)
/// stays out of the tests, and a command killed mid-profile cannot leave its lock files behind.
pub(crate) fn hermetic_home(dir: &std::path::Path) -> Vec<(String, String)> {
    vec![("HOME".to_owned(), dir.display().to_string())]
}

pub(crate) async fn call(tools: &Tools, name: &str, args: serde_json::Value) -> ToolOutput {
    let call = ToolCall {
        id: "c1".into(),
        name: name.into(),
        arguments: args,
    };
    tools.call(&call, &CancellationToken::new()).await
}

#[tokio::test]
async fn read_numbers_lines_and_pages() {
    let (_d, tools) = workspace();
    let out = call(
        &tools,
        "read",
        json!({"path": "a.txt", "offset": 2, "limit": 1}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    assert!(out.content.contains("2\ttwo"), "{}", out.content);
    assert!(!out.content.contains("one"));
    assert!(
        out.content.contains("1 more lines; read with offset=3"),
        "{}",
        out.content
    );
}

#[tokio::test]
async fn arguments_of_the_wrong_type_are_a_tool_error() {
    let (_d, tools) = workspace();
    let out = call(&tools, "read", json!({"path": "a.txt", "offset": "two"})).await;
    assert!(out.is_error);
    assert!(
        out.content.contains("invalid arguments for `read`"),
        "{}",
        out.content
    );
    let out = call(&tools, "read", json!({"file": "a.txt"})).await;
    assert!(out.is_error);
    assert!(
        out.content.contains("unknown field `file`"),
        "{}",
        out.content
    );
    let out = call(&tools, "read", json!("{not json")).await;
    assert!(out.is_error);
    assert!(out.content.contains("not a JSON object"), "{}", out.content);
    let out = call(&tools, "rm", json!({})).await;
    assert!(out.is_error);
    assert!(out.content.contains("unknown tool `rm`"), "{}", out.content);
}

#[tokio::test]
async fn paths_that_escape_are_refused_and_nothing_is_written() {
    let (dir, tools) = workspace();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).unwrap();
    for path in [
        "../escape.txt",
        "/etc/passwd",
        "out/evil.txt",
        "src/../../x",
    ] {
        let out = call(&tools, "write", json!({"path": path, "content": "x"})).await;
        assert!(out.is_error, "{path} was accepted");
        let out = call(&tools, "read", json!({"path": path})).await;
        assert!(out.is_error, "{path} was readable");
    }
    assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none());
    assert!(!dir.path().parent().unwrap().join("escape.txt").exists());
}

#[tokio::test]
async fn write_creates_parents_and_keeps_modes() {
    let (dir, tools) = workspace();
    let out = call(
        &tools,
        "write",
        json!({"path": "new/dir/f.txt", "content": "hi"}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("new/dir/f.txt")).unwrap(),
        "hi"
    );
}

#[tokio::test]
async fn edit_needs_unique_non_overlapping_matches_and_is_all_or_nothing() {
    let (dir, tools) = workspace();
    let path = dir.path().join("a.txt");
    let out = call(
        &tools,
        "edit",
        json!({"path": "a.txt", "edits": [{"old_text": "o", "new_text": "0"}]}),
    )
    .await;
    assert!(
        out.is_error && out.content.contains("occurs 2 times"),
        "{}",
        out.content
    );
    let out = call(
        &tools,
        "edit",
        json!({"path": "a.txt", "edits": [
        {"old_text": "two", "new_text": "2"}, {"old_text": "nine", "new_text": "9"}]}),
    )
    .await;
    assert!(
        out.is_error && out.content.contains("edit 2: old_text not found"),
        "{}",
        out.content
    );
    let out = call(
        &tools,
        "edit",
        json!({"path": "a.txt", "edits": [
        {"old_text": "one\ntwo", "new_text": "x"}, {"old_text": "two\nthree", "new_text": "y"}]}),
    )
    .await;
    assert!(
        out.is_error && out.content.contains("overlap"),
        "{}",
        out.content
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\nthree\n");
    let out = call(
        &tools,
        "edit",
        json!({"path": "a.txt", "edits": [
        {"old_text": "one", "new_text": "1"}, {"old_text": "three", "new_text": "3"}]}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "1\ntwo\n3\n");
}

#[tokio::test]
async fn ls_find_and_grep_respect_ignore_files() {
    let (_d, tools) = workspace();
    let out = call(&tools, "ls", json!({})).await;
    assert!(
        out.content.contains("src/") && out.content.contains("a.txt"),
        "{}",
        out.content
    );
    let out = call(&tools, "find", json!({"pattern": "**/*.rs"})).await;
    assert!(out.content.contains("src/lib.rs"), "{}", out.content);
    assert!(!out.content.contains("ignored/x.rs"), "{}", out.content);
    let out = call(
        &tools,
        "grep",
        json!({"pattern": "todo", "ignore_case": true}),
    )
    .await;
    assert!(out.content.contains("src/lib.rs:2:"), "{}", out.content);
    assert!(!out.content.contains("hidden"), "{}", out.content);
    let out = call(&tools, "grep", json!({"pattern": "("})).await;
    assert!(
        out.is_error && out.content.contains("invalid regex"),
        "{}",
        out.content
    );
}

#[tokio::test]
async fn exec_reports_exit_code_and_caps_huge_output() {
    let (_d, tools) = workspace();
    let out = call(&tools, "exec", json!({"command": "cat a.txt; exit 3"})).await;
    assert!(out.is_error);
    assert!(
        out.content.starts_with("exit code: 3\none"),
        "{}",
        out.content
    );
    let out = call(
        &tools,
        "exec",
        json!({"command": "head -c 5000000 /dev/zero | tr '\\0' x; echo END"}),
    )
    .await;
    assert!(!out.is_error);
    assert!(
        out.content.len() < 100_000,
        "{} bytes came back",
        out.content.len()
    );
    assert!(
        out.content.contains("bytes of output truncated"),
        "no truncation marker"
    );
    assert!(
        out.content.trim_end().ends_with("END"),
        "the tail of the output is kept"
    );
}

#[tokio::test]
async fn exec_sees_no_secrets_of_the_gateway() {
    let (_d, tools) = workspace();
    let out = call(&tools, "exec", json!({"command": "env"})).await;
    for line in out.content.lines().skip(1) {
        let name = line.split('=').next().unwrap_or("");
        assert!(
            !name.ends_with("_KEY") && !name.ends_with("TOKEN") && name != "SSH_AUTH_SOCK",
            "{line}"
        );
    }
}

#[tokio::test]
async fn exec_timeout_kills_everything_the_command_started() {
    let (_d, tools) = workspace();
    let escapees = ["sleep 31401", "sleep 31402"];
    let call = call(
        &tools,
        "exec",
        json!({"command": "setsid sleep 31401 & ( (sleep 31402 &) & ); sleep 1000", "timeout_s": 2}),
    );
    let (out, ()) = tokio::join!(call, started(&escapees));
    assert!(
        out.is_error && out.content.contains("timed out after 2 s"),
        "{}",
        out.content
    );
    assert_gone(&escapees);
}

#[tokio::test]
async fn exec_cancel_kills_everything_the_command_started() {
    let (_d, tools) = workspace();
    let escapees = ["sleep 31411", "sleep 31412"];
    let cancel = CancellationToken::new();
    let exec = ToolCall {
        id: "c1".into(),
        name: "exec".into(),
        arguments: json!({"command": "setsid sleep 31411 & ( (sleep 31412 &) & ); sleep 1000"}),
    };
    let call = tools.call(&exec, &cancel);
    let canceller = async {
        started(&escapees).await;
        cancel.cancel();
    };
    let (out, ()) = tokio::join!(call, canceller);
    assert!(
        out.is_error && out.content.contains("cancelled"),
        "{}",
        out.content
    );
    assert_gone(&escapees);
}

#[tokio::test]
async fn exec_leaves_nothing_running_when_it_ends() {
    let (_d, tools) = workspace();
    let out = call(
        &tools,
        "exec",
        // The command sees the host's /proc: it waits until its detached sleep runs.
        json!({"command": "setsid sleep 31421 >/dev/null 2>&1 & \
                           until pgrep -xf 'sleep 31421' >/dev/null; do :; done; echo started"}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    assert!(out.content.contains("started"), "{}", out.content);
    assert_gone(&["sleep 31421"]);
}

#[tokio::test]
async fn exec_runs_in_a_workdir_of_the_workspace_and_nowhere_else() {
    let (dir, tools) = workspace();
    let out = call(
        &tools,
        "exec",
        json!({"command": "pwd; ls", "workdir": "src"}),
    )
    .await;
    assert!(!out.is_error, "{}", out.content);
    let src = dir.path().canonicalize().unwrap().join("src");
    assert_eq!(
        out.content,
        format!("exit code: 0\n{}\nlib.rs\n", src.display())
    );
    for (workdir, says) in [
        ("..", "escapes the workspace"),
        ("/tmp", "outside the workspace"),
        ("a.txt", "workdir a.txt is a regular file, not a directory"),
        ("nope", "workdir nope: No such file or directory"),
    ] {
        let out = call(
            &tools,
            "exec",
            json!({"command": "touch ran", "workdir": workdir}),
        )
        .await;
        assert!(
            out.is_error && out.content.contains(says),
            "{workdir}: {}",
            out.content
        );
    }
    assert!(!dir.path().join("ran").exists());
    assert!(!dir.path().parent().unwrap().join("ran").exists());
}

#[tokio::test]
async fn exec_timeouts_outside_their_bounds_are_refused_before_running() {
    let (dir, tools) = workspace();
    for timeout_s in [0, 3601] {
        let out = call(
            &tools,
            "exec",
            json!({"command": "touch ran", "timeout_s": timeout_s}),
        )
        .await;
        assert!(
            out.is_error
                && out
                    .content
                    .contains("give 1 to 3600 seconds (the default is 120)"),
            "{}",
            out.content
        );
    }
    assert!(!dir.path().join("ran").exists());
}

/// A real PNG file (64×48, RGB), as a screenshot would be.
const PNG: &[u8] = include_bytes!("fixtures/gradient.png");

#[tokio::test]
async fn read_of_an_image_gives_the_model_the_image_itself() {
    use base64::Engine as _;
    let (dir, tools) = workspace();
    std::fs::write(dir.path().join("shot.png"), PNG).unwrap();
    let out = call(&tools, "read", json!({"path": "shot.png"})).await;
    assert!(!out.is_error, "{}", out.content);
    assert_eq!(out.content, "image: shot.png, 64×48 PNG, 6 KiB");
    assert_eq!(out.images.len(), 1);
    assert_eq!(out.images[0].media_type, "image/png");
    let data = base64::engine::general_purpose::STANDARD
        .decode(&out.images[0].data_base64)
        .unwrap();
    assert_eq!(data, PNG);
    assert_eq!(
        skiff_agent::tools::image_label(&out.images[0]),
        "image 64×48 png"
    );

    // Known by its bytes, not its name; and a file named like an image that is text is read
    // as text.
    std::fs::write(dir.path().join("capture.bin"), PNG).unwrap();
    let out = call(&tools, "read", json!({"path": "capture.bin"})).await;
    assert_eq!(out.content, "image: capture.bin, 64×48 PNG, 6 KiB");
    assert_eq!(out.images.len(), 1);
    std::fs::write(dir.path().join("notes.png"), "not an image\n").unwrap();
    let out = call(&tools, "read", json!({"path": "notes.png"})).await;
    assert_eq!(out.content, "     1\tnot an image\n");
    assert!(out.images.is_empty());
}

#[tokio::test]
async fn an_image_too_large_for_a_model_is_refused_with_its_size_and_the_limit() {
    let (dir, tools) = workspace();
    let file = std::fs::File::create(dir.path().join("huge.png")).unwrap();
    std::io::Write::write_all(&mut &file, PNG).unwrap();
    file.set_len(4 * 1024 * 1024).unwrap();
    let out = call(&tools, "read", json!({"path": "huge.png"})).await;
    assert!(out.is_error);
    assert!(out.images.is_empty());
    assert!(
        out.content.starts_with(
            "huge.png is a PNG image of 4.0 MiB; read gives the model images up to 2.25 MiB \
             (3 MiB once base64-encoded"
        ),
        "{}",
        out.content
    );

    // A header that says the image is wider than models take.
    let mut wide = PNG.to_vec();
    wide[16..20].copy_from_slice(&9000u32.to_be_bytes());
    std::fs::write(dir.path().join("wide.png"), wide).unwrap();
    let out = call(&tools, "read", json!({"path": "wide.png"})).await;
    assert!(out.is_error);
    assert!(
        out.content.starts_with(
            "wide.png is a 9000×48 PNG image; models take images up to 8000 pixels a side"
        ),
        "{}",
        out.content
    );
}
