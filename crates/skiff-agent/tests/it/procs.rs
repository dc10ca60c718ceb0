//! Looking for processes by their exact command line, to prove that none survived.

/// Live processes whose command line is exactly `argv` (its words joined by spaces).
pub(crate) fn running(argv: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            let words: Vec<_> = raw
                .split(|&b| b == 0)
                .filter(|w| !w.is_empty())
                .map(String::from_utf8_lossy)
                .collect();
            (words.join(" ") == argv).then_some(pid)
        })
        .collect()
}

/// Waits until a process with each of these command lines runs.
pub(crate) async fn started(argvs: &[&str]) {
    while argvs.iter().any(|argv| running(argv).is_empty()) {
        tokio::task::yield_now().await;
    }
}

pub(crate) fn assert_gone(argvs: &[&str]) {
    for argv in argvs {
        let left = running(argv);
        assert!(left.is_empty(), "`{argv}` survived: pids {left:?}");
    }
}
