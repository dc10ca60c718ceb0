//! `apply_patch` against a real workspace: many files at once, all or nothing, contained.

use crate::tools::{call, workspace};
use serde_json::json;
use std::os::unix::fs::PermissionsExt;

#[tokio::test]
async fn a_patch_adds_updates_deletes_and_moves_files_in_one_call() {
    let (dir, tools) = workspace();
    let root = dir.path();
    std::fs::write(
        root.join("src/main.rs"),
        "fn main() {\n    let a = 1;\n    println!(\"{a}\");\n}\n\nfn helper() {\n    let a = 1;\n}\n",
    )
    .unwrap();
    std::fs::write(root.join("run.sh"), "#!/bin/sh\necho old\n").unwrap();
    std::fs::set_permissions(root.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let patch = "*** Begin Patch
*** Add File: docs/notes.md
+# Notes
+
+Written by a patch.
*** Update File: src/main.rs
@@ fn main() {
-    let a = 1;
+    let a = 2;
     println!(\"{a}\");
@@ fn helper() {
-    let a = 1;
+    let b = 1;
 }
*** Delete File: a.txt
*** Update File: run.sh
*** Move to: scripts/run.sh
@@
 #!/bin/sh
-echo old
+echo new
*** End of File
*** End Patch";
    let out = call(&tools, "apply_patch", json!({ "patch": patch })).await;
    assert!(!out.is_error, "{}", out.content);
    assert_eq!(
        out.content,
        "applied the patch:\nA docs/notes.md\nM src/main.rs\nD a.txt\nR run.sh -> scripts/run.sh"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("docs/notes.md")).unwrap(),
        "# Notes\n\nWritten by a patch.\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("src/main.rs")).unwrap(),
        "fn main() {\n    let a = 2;\n    println!(\"{a}\");\n}\n\nfn helper() {\n    let b = 1;\n}\n"
    );
    assert!(!root.join("a.txt").exists());
    assert!(!root.join("run.sh").exists());
    let moved = root.join("scripts/run.sh");
    assert_eq!(
        std::fs::read_to_string(&moved).unwrap(),
        "#!/bin/sh\necho new\n"
    );
    assert_eq!(
        std::fs::metadata(&moved).unwrap().permissions().mode() & 0o777,
        0o755,
        "a moved script stays executable"
    );
    // Nothing was left behind beside the files (temporary or set-aside copies).
    let mut names: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, [".gitignore", "docs", "ignored", "scripts", "src"]);
}

#[tokio::test]
async fn a_hunk_that_does_not_match_changes_no_file_and_shows_what_it_expected() {
    let (dir, tools) = workspace();
    let root = dir.path();
    let patch = "*** Begin Patch
*** Update File: a.txt
@@
 one
-two
+TWO
*** Add File: new.txt
+new
*** Delete File: src/lib.rs
*** Update File: src/lib2.rs
@@
-x
+y
*** End Patch";
    // The last section names a file that does not exist.
    let out = call(&tools, "apply_patch", json!({ "patch": patch })).await;
    assert!(out.is_error);
    assert!(
        out.content.contains("nothing was changed"),
        "{}",
        out.content
    );
    assert!(
        out.content
            .contains("cannot update src/lib2.rs: No such file"),
        "{}",
        out.content
    );
    assert_eq!(
        std::fs::read_to_string(root.join("a.txt")).unwrap(),
        "one\ntwo\nthree\n"
    );

    let patch = "*** Begin Patch
*** Update File: a.txt
@@
 one
-two
+TWO
*** Update File: src/lib.rs
@@ fn main() {}
-// TODO: more
+// DONE
@@
-fn missing() {}
+fn found() {}
*** End Patch";
    let out = call(&tools, "apply_patch", json!({ "patch": patch })).await;
    assert!(out.is_error);
    assert_eq!(
        out.content,
        "patch not applied, nothing was changed: src/lib.rs: hunk 2 of 2 did not match: these \
         lines (the ` ` and `-` lines of the hunk) were not found after line 2:\nfn missing() {}\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("a.txt")).unwrap(),
        "one\ntwo\nthree\n",
        "the first file was changed although the second did not match"
    );
    assert!(!root.join("new.txt").exists());
    assert!(root.join("src/lib.rs").exists());
}

#[tokio::test]
async fn a_patch_cannot_reach_outside_the_workspace() {
    let (dir, tools) = workspace();
    let root = dir.path();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "secret\n").unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("out")).unwrap();
    for (patch, says) in [
        ("*** Add File: ../escaped.txt\n+x", "escapes the workspace"),
        ("*** Add File: out/planted\n+x", "outside the workspace"),
        (
            "*** Update File: out/secret\n@@\n-secret\n+mine",
            "outside the workspace",
        ),
        ("*** Delete File: /etc/hostname", "outside the workspace"),
        (
            "*** Update File: a.txt\n*** Move to: ../../moved.txt\n@@\n-one\n+1",
            "escapes the workspace",
        ),
    ] {
        let patch = format!("*** Begin Patch\n*** Add File: first.txt\n+1\n{patch}\n*** End Patch");
        let out = call(&tools, "apply_patch", json!({ "patch": patch })).await;
        assert!(
            out.is_error && out.content.contains(says),
            "{patch}\n→ {}",
            out.content
        );
        assert!(
            !root.join("first.txt").exists(),
            "{patch}: first.txt was written"
        );
    }
    assert!(!dir.path().parent().unwrap().join("escaped.txt").exists());
    assert!(!outside.path().join("planted").exists());
    assert_eq!(
        std::fs::read_to_string(outside.path().join("secret")).unwrap(),
        "secret\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("a.txt")).unwrap(),
        "one\ntwo\nthree\n"
    );
}
