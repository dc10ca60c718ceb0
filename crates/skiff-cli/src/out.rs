//! Everything the CLI prints on stdout goes through [`write`] (the `outln!`/`out!` macros), so a
//! reader that went away (`skiff env show ID | head -0`) ends the command quietly instead of
//! panicking the way `println!` does on a closed pipe. Deliberately absent: stderr, which
//! carries progress and errors and stays with `eprintln!`.

use std::io::Write;

/// Stdout's reader is gone. `main` turns it into a quiet exit.
#[derive(Debug)]
pub struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes to stdout and flushes (so a closed pipe shows at once, not at exit).
pub fn write(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot write to stdout")),
    }
}

/// Whether `e` is (or wraps) [`StdoutClosed`].
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<StdoutClosed>())
}

/// `println!` that returns an error instead of panicking.
macro_rules! outln {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` that returns an error instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}
