//! The worker protocol's framing, the one codec both ends use: a frame is one JSON object on
//! one line, at most [`MAX_FRAME_BYTES`] long (DESIGN §6). The gateway's endpoint and the
//! worker read and write through these functions, so the two sides cannot drift apart on the
//! limit, the terminator or what counts as a broken frame.
//!
//! Deliberately absent: the frame types (they are `skiff-protocol`'s, which stays free of I/O)
//! and what a side does with a bad frame (the gateway refuses and audits it, the worker logs
//! it): this crate only finds the frames in a byte stream.

use serde::Serialize;
pub use skiff_protocol::worker::MAX_FRAME_BYTES;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("a frame is larger than {MAX_FRAME_BYTES} bytes")]
    TooLarge,
    #[error("a frame is not UTF-8")]
    NotUtf8,
    #[error("a frame could not be encoded: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("the connection failed: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Reads one frame's line (without its newline); `None` at the end of the stream. Never
/// buffers more than [`MAX_FRAME_BYTES`] and a newline, whatever the peer sends.
pub async fn read_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> Result<Option<String>> {
    let mut buf = Vec::new();
    let limit = u64::try_from(MAX_FRAME_BYTES).unwrap_or(u64::MAX) + 1;
    let n = (&mut *reader)
        .take(limit)
        .read_until(b'\n', &mut buf)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        // Either over the limit, or the stream ended inside a frame: neither is a frame.
        return Err(if n as u64 >= limit {
            Error::TooLarge
        } else {
            Error::Io(std::io::ErrorKind::UnexpectedEof.into())
        });
    }
    buf.pop();
    String::from_utf8(buf).map(Some).map_err(|_| Error::NotUtf8)
}

/// A frame as the line that carries it (JSON, no newline).
pub fn encode<T: Serialize>(frame: &T) -> Result<String> {
    Ok(serde_json::to_string(frame)?)
}

/// Writes an encoded frame and its newline in one write: a frame split in two makes two
/// small SSH packets, and the second can wait for the first's acknowledgement (Nagle) on the
/// box's sshd.
pub async fn write_line<W: AsyncWrite + Unpin>(write: &mut W, mut line: String) -> Result<()> {
    line.push('\n');
    write.write_all(line.as_bytes()).await?;
    Ok(())
}

/// Encodes and writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    write: &mut W,
    frame: &T,
) -> Result<()> {
    write_line(write, encode(frame)?).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::BufReader;

    #[tokio::test]
    async fn frames_round_trip_one_per_line() {
        let mut out = Vec::new();
        write_frame(&mut out, &serde_json::json!({"a": 1}))
            .await
            .unwrap();
        write_frame(&mut out, &serde_json::json!({"b": "x\ny"}))
            .await
            .unwrap();
        let mut r = BufReader::new(out.as_slice());
        assert_eq!(
            read_line(&mut r).await.unwrap().as_deref(),
            Some(r#"{"a":1}"#)
        );
        assert_eq!(
            read_line(&mut r).await.unwrap().as_deref(),
            Some(r#"{"b":"x\ny"}"#)
        );
        assert!(read_line(&mut r).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_frame_over_the_limit_is_refused_by_size_without_reading_it_all() {
        let mut huge = vec![b'x'; MAX_FRAME_BYTES + 10];
        huge.push(b'\n');
        let mut r = BufReader::new(huge.as_slice());
        let err = read_line(&mut r).await.unwrap_err();
        assert!(matches!(err, Error::TooLarge), "{err}");
        assert!(
            err.to_string().contains(&MAX_FRAME_BYTES.to_string()),
            "{err}"
        );
        let mut exact = vec![b'x'; MAX_FRAME_BYTES];
        exact.push(b'\n');
        let mut r = BufReader::new(exact.as_slice());
        assert_eq!(
            read_line(&mut r).await.unwrap().map(|l| l.len()),
            Some(MAX_FRAME_BYTES)
        );
    }

    #[tokio::test]
    async fn a_frame_that_is_not_utf8_or_is_cut_off_is_an_error() {
        let mut r = BufReader::new(&b"\xff\xfe\n"[..]);
        assert!(matches!(read_line(&mut r).await, Err(Error::NotUtf8)));
        let mut r = BufReader::new(&b"{\"cut\":"[..]);
        assert!(matches!(read_line(&mut r).await, Err(Error::Io(_))));
    }
}
