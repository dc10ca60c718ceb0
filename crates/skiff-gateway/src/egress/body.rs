//! Message bodies: how one ends (no body, a length, chunked, or the connection's close), and
//! a copy that moves exactly one body, as it came (framing included), so nothing is smuggled
//! behind it. Ambiguous request framing is refused rather than guessed.

use super::http::Head;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes moved per read while forwarding a body or a tunnel. Large enough that a loopback
/// download is not bound by syscalls.
pub(crate) const COPY_BUF: usize = 128 * 1024;

/// How a message's body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    Empty,
    Length(u64),
    Chunked,
    /// A response without length: it ends when the server closes.
    UntilClose,
}

/// A request's body framing; ambiguity (both fields, conflicting lengths, an unknown coding)
/// is refused, since a proxy and a server that disagree on it are how requests get smuggled.
pub(crate) fn request_framing(head: &Head<'_>) -> Result<Framing, &'static str> {
    let te: Vec<&str> = head.get("transfer-encoding").collect();
    let cl: Vec<&str> = head.get("content-length").collect();
    if !te.is_empty() {
        if !cl.is_empty() {
            return Err("the request has both Transfer-Encoding and Content-Length");
        }
        return if last_coding_is_chunked(&te) {
            Ok(Framing::Chunked)
        } else {
            Err("the request's Transfer-Encoding does not end in chunked")
        };
    }
    match content_length(&cl)? {
        None | Some(0) => Ok(Framing::Empty),
        Some(n) => Ok(Framing::Length(n)),
    }
}

/// A response's body framing (RFC 9112 §6.3).
pub(crate) fn response_framing(
    status: u16,
    head_request: bool,
    head: &Head<'_>,
) -> Result<Framing, &'static str> {
    if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok(Framing::Empty);
    }
    let te: Vec<&str> = head.get("transfer-encoding").collect();
    if !te.is_empty() {
        return Ok(if last_coding_is_chunked(&te) {
            Framing::Chunked
        } else {
            Framing::UntilClose
        });
    }
    let cl: Vec<&str> = head.get("content-length").collect();
    Ok(match content_length(&cl)? {
        None => Framing::UntilClose,
        Some(0) => Framing::Empty,
        Some(n) => Framing::Length(n),
    })
}

fn last_coding_is_chunked(values: &[&str]) -> bool {
    values
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .rfind(|c| !c.is_empty())
        .is_some_and(|c| c.eq_ignore_ascii_case("chunked"))
}

fn content_length(values: &[&str]) -> Result<Option<u64>, &'static str> {
    let mut length = None;
    for value in values.iter().flat_map(|v| v.split(',')).map(str::trim) {
        if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
            return Err("Content-Length is not a number");
        }
        let n = value
            .parse::<u64>()
            .map_err(|_| "Content-Length is too large")?;
        if length.is_some_and(|l| l != n) {
            return Err("Content-Length values disagree");
        }
        length = Some(n);
    }
    Ok(length)
}

/// Finds the end of a chunked body in a stream of bytes, without buffering it.
#[derive(Debug)]
pub(crate) struct ChunkedEnd {
    state: Chunk,
}

#[derive(Debug, Clone, Copy)]
enum Chunk {
    Size { value: u64, digits: u8 },
    Extension { value: u64 },
    Data { left: u64 },
    DataCr,
    DataLf,
    Trailer { line_start: bool },
    Done,
}

impl Default for ChunkedEnd {
    fn default() -> Self {
        ChunkedEnd {
            state: Chunk::Size {
                value: 0,
                digits: 0,
            },
        }
    }
}

impl ChunkedEnd {
    /// Feeds the next bytes; `Some(n)`: the body ends after `n` of them.
    pub(crate) fn feed(&mut self, data: &[u8]) -> Result<Option<usize>, &'static str> {
        let mut i = 0;
        while i < data.len() {
            let b = data[i];
            self.state = match self.state {
                Chunk::Size { value, digits } => match (b as char).to_digit(16) {
                    Some(d) if digits < 16 => Chunk::Size {
                        value: value << 4 | u64::from(d),
                        digits: digits + 1,
                    },
                    Some(_) => return Err("a chunk size is too large"),
                    None if digits == 0 => return Err("a chunk size is not hexadecimal"),
                    None if b == b'\n' => end_of_size(value),
                    None if matches!(b, b';' | b' ' | b'\t' | b'\r') => Chunk::Extension { value },
                    None => return Err("a chunk size is not hexadecimal"),
                },
                Chunk::Extension { value } if b == b'\n' => end_of_size(value),
                Chunk::Extension { value } => Chunk::Extension { value },
                Chunk::Data { left } => {
                    let take = (data.len() - i).min(usize::try_from(left).unwrap_or(usize::MAX));
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        Chunk::DataCr
                    } else {
                        Chunk::Data { left }
                    };
                    continue;
                }
                Chunk::DataCr if b == b'\r' => Chunk::DataLf,
                Chunk::DataCr | Chunk::DataLf if b == b'\n' => Chunk::Size {
                    value: 0,
                    digits: 0,
                },
                Chunk::DataCr | Chunk::DataLf => return Err("a chunk does not end in CRLF"),
                Chunk::Trailer { line_start } if b == b'\n' => {
                    if line_start {
                        self.state = Chunk::Done;
                        return Ok(Some(i + 1));
                    }
                    Chunk::Trailer { line_start: true }
                }
                Chunk::Trailer { line_start } if b == b'\r' => Chunk::Trailer { line_start },
                Chunk::Trailer { .. } => Chunk::Trailer { line_start: false },
                Chunk::Done => return Ok(Some(i)),
            };
            i += 1;
        }
        Ok(matches!(self.state, Chunk::Done).then_some(data.len()))
    }
}

fn end_of_size(value: u64) -> Chunk {
    if value == 0 {
        Chunk::Trailer { line_start: true }
    } else {
        Chunk::Data { left: value }
    }
}

/// Which side of a copy failed.
#[derive(Debug)]
pub(crate) enum CopyError {
    /// Reading, or what was read (early end, broken chunking).
    Source(io::Error),
    Sink(io::Error),
}

/// Copies one body of `framing` from `already` (bytes read with the head) then `r` to `w`.
/// Returns once the body has ended; bytes past it are not read.
pub(crate) async fn copy_body<R, W>(
    already: &[u8],
    r: &mut R,
    w: &mut W,
    framing: Framing,
) -> Result<(), CopyError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut body = Body {
        r,
        w,
        buf: Vec::new(),
    };
    match framing {
        Framing::Empty => {}
        Framing::Length(total) => {
            let first = already
                .len()
                .min(usize::try_from(total).unwrap_or(usize::MAX));
            body.write(&already[..first]).await?;
            let mut left = total - first as u64;
            while left > 0 {
                let want = usize::try_from(left).unwrap_or(usize::MAX);
                let n = body.read(want).await?;
                if n == 0 {
                    return Err(early_end("the body ended before its Content-Length"));
                }
                body.write_buf(n).await?;
                left -= n as u64;
            }
        }
        Framing::Chunked => {
            let mut end = ChunkedEnd::default();
            let bad =
                |e: &'static str| CopyError::Source(io::Error::new(io::ErrorKind::InvalidData, e));
            if let Some(n) = end.feed(already).map_err(bad)? {
                body.write(&already[..n]).await?;
                return body.flush().await;
            }
            body.write(already).await?;
            loop {
                let n = body.read(usize::MAX).await?;
                if n == 0 {
                    return Err(early_end("the chunked body ended before its last chunk"));
                }
                match end.feed(&body.buf[..n]).map_err(bad)? {
                    Some(stop) => {
                        body.write_buf(stop).await?;
                        break;
                    }
                    None => body.write_buf(n).await?,
                }
            }
        }
        Framing::UntilClose => {
            body.write(already).await?;
            loop {
                let n = body.read(usize::MAX).await?;
                if n == 0 {
                    break;
                }
                body.write_buf(n).await?;
            }
        }
    }
    body.flush().await
}

fn early_end(what: &'static str) -> CopyError {
    CopyError::Source(io::Error::new(io::ErrorKind::UnexpectedEof, what))
}

/// The two ends of a body copy and the buffer between them, each error sorted by side.
struct Body<'a, R, W> {
    r: &'a mut R,
    w: &'a mut W,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Body<'_, R, W> {
    /// Reads at most `max` bytes into the buffer.
    async fn read(&mut self, max: usize) -> Result<usize, CopyError> {
        if self.buf.is_empty() {
            self.buf.resize(COPY_BUF, 0);
        }
        let want = self.buf.len().min(max);
        self.r
            .read(&mut self.buf[..want])
            .await
            .map_err(CopyError::Source)
    }

    async fn write_buf(&mut self, n: usize) -> Result<(), CopyError> {
        self.w
            .write_all(&self.buf[..n])
            .await
            .map_err(CopyError::Sink)
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), CopyError> {
        self.w.write_all(bytes).await.map_err(CopyError::Sink)
    }

    async fn flush(&mut self) -> Result<(), CopyError> {
        self.w.flush().await.map_err(CopyError::Sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(body: &[u8], step: usize) -> Result<Option<usize>, &'static str> {
        let mut end = ChunkedEnd::default();
        let mut off = 0;
        for piece in body.chunks(step) {
            if let Some(n) = end.feed(piece)? {
                return Ok(Some(off + n));
            }
            off += piece.len();
        }
        Ok(None)
    }

    #[test]
    fn the_end_of_a_chunked_body_is_found_however_it_is_cut() {
        let body = b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-T: 1\r\n\r\nGET /smuggled";
        let end = body.len() - b"GET /smuggled".len();
        for step in 1..body.len() {
            assert_eq!(feed_all(body, step), Ok(Some(end)), "step {step}");
        }
        assert_eq!(feed_all(b"0\r\n\r\n", 1), Ok(Some(5)));
        assert_eq!(feed_all(b"5\r\nhel", 2), Ok(None));
        assert!(feed_all(b"zz\r\n", 4).is_err());
        assert!(feed_all(b"2\r\nabX", 8).is_err());
    }

    #[test]
    fn ambiguous_request_framing_is_refused() {
        let framing = |h: &[u8]| request_framing(&Head::parse(h).unwrap());
        assert_eq!(
            framing(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n"),
            Ok(Framing::Length(5))
        );
        assert_eq!(
            framing(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            Ok(Framing::Chunked)
        );
        assert!(
            framing(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
                .is_err()
        );
        assert!(
            framing(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n").is_err()
        );
        assert!(framing(b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n").is_err());
        assert!(framing(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n").is_err());
    }
}
