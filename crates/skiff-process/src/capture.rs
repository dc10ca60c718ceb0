//! Bounded capture of a child's output: the first and last half of the cap are kept, the middle
//! is replaced by a marker that says how much was dropped.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::task::JoinHandle;

/// Captured output of one stream.
#[derive(Debug, Default, Clone)]
pub struct CappedOutput {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    dropped: u64,
    cap: usize,
}

impl CappedOutput {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let head_cap = self.cap / 2;
        let tail_cap = self.cap - head_cap;
        let take = head_cap.saturating_sub(self.head.len()).min(bytes.len());
        self.head.extend_from_slice(&bytes[..take]);
        for &b in &bytes[take..] {
            if self.tail.len() == tail_cap {
                self.tail.pop_front();
                self.dropped += 1;
            }
            self.tail.push_back(b);
        }
    }

    /// How many bytes were dropped from the middle.
    pub fn truncated_bytes(&self) -> u64 {
        self.dropped
    }

    /// The kept bytes as text, with a visible marker where bytes were dropped.
    pub fn into_string(self) -> String {
        let mut s = String::from_utf8_lossy(&self.head).into_owned();
        if self.dropped > 0 {
            s.push_str(&format!(
                "\n[… {} bytes of output truncated …]\n",
                self.dropped
            ));
        }
        let tail: Vec<u8> = self.tail.into_iter().collect();
        s.push_str(&String::from_utf8_lossy(&tail));
        s
    }
}

pub(crate) struct Readers {
    stdout: JoinHandle<()>,
    stderr: JoinHandle<()>,
    out: Arc<Mutex<CappedOutput>>,
    err: Arc<Mutex<CappedOutput>>,
}

impl Readers {
    /// Waits for both pipes to reach EOF (the caller has killed the process group, so every
    /// writer is gone) and returns what was captured.
    pub(crate) async fn collect(self) -> (CappedOutput, CappedOutput) {
        let _ = self.stdout.await;
        let _ = self.stderr.await;
        let take = |m: &Arc<Mutex<CappedOutput>>| {
            m.lock()
                .map(|mut g| std::mem::take(&mut *g))
                .unwrap_or_default()
        };
        (take(&self.out), take(&self.err))
    }
}

pub(crate) fn spawn_readers(
    stdout: Option<impl AsyncRead + Unpin + Send + 'static>,
    stderr: Option<impl AsyncRead + Unpin + Send + 'static>,
    cap: usize,
    merge: bool,
    tee: Option<crate::Tee>,
) -> Readers {
    let out = Arc::new(Mutex::new(CappedOutput::new(cap)));
    let err = Arc::new(Mutex::new(CappedOutput::new(cap)));
    let err_sink = if merge { out.clone() } else { err.clone() };
    Readers {
        stdout: tokio::spawn(pump(stdout, out.clone(), tee.clone())),
        stderr: tokio::spawn(pump(stderr, err_sink, tee)),
        out,
        err,
    }
}

async fn pump(
    pipe: Option<impl AsyncRead + Unpin>,
    sink: Arc<Mutex<CappedOutput>>,
    tee: Option<crate::Tee>,
) {
    let Some(mut pipe) = pipe else { return };
    let mut buf = [0u8; 8192];
    while let Ok(n) = pipe.read(&mut buf).await {
        if n == 0 {
            break;
        }
        if let Ok(mut s) = sink.lock() {
            s.push(&buf[..n]);
        }
        if let Some(tee) = &tee {
            // A receiver that went away only stops the copy, never the command.
            let _ = tee.send(buf[..n].to_vec());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_head_and_tail_with_marker() {
        let mut c = CappedOutput::new(10);
        c.push(b"0123456789abcdefghij");
        assert_eq!(c.truncated_bytes(), 10);
        let s = c.into_string();
        assert!(s.starts_with("01234"));
        assert!(s.ends_with("fghij"));
        assert!(s.contains("10 bytes of output truncated"));
    }

    #[test]
    fn small_output_is_untouched() {
        let mut c = CappedOutput::new(100);
        c.push(b"hello ");
        c.push(b"world");
        assert_eq!(c.into_string(), "hello world");
    }
}
