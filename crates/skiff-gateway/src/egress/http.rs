//! Just enough HTTP/1.1 heads for a forward proxy: read a bounded head, parse a request or
//! response head strictly, pick the fields that go on to the next hop, and write the proxy's
//! own answers. Bodies are [`super::body`]'s.
//!
//! Not here: keep-alive (one request per connection, `Connection: close` both ways), HTTP/2,
//! TLS.

use std::io;
use tokio::io::{AsyncRead, AsyncReadExt};

#[derive(Debug)]
pub(crate) enum HeadError {
    /// The peer closed before a complete head.
    Closed,
    TooLarge,
    Io(io::Error),
}

/// Reads into `buf` until a blank line ends the head; returns the head's length (the bytes
/// after it, already read, are the start of the body).
pub(crate) async fn read_head<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<usize, HeadError> {
    let mut scanned = 0;
    loop {
        if let Some(end) = find_head_end(buf, scanned) {
            return Ok(end);
        }
        if buf.len() >= max {
            return Err(HeadError::TooLarge);
        }
        scanned = buf.len().saturating_sub(3);
        let want = (max - buf.len()).min(8 * 1024);
        let start = buf.len();
        buf.resize(start + want, 0);
        let n = match r.read(&mut buf[start..]).await {
            Ok(n) => n,
            Err(e) => {
                buf.truncate(start);
                return Err(HeadError::Io(e));
            }
        };
        buf.truncate(start + n);
        if n == 0 {
            return Err(HeadError::Closed);
        }
    }
}

/// The end of `\r\n\r\n` (or a bare `\n\n`) at or after `from`.
fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some(i + 2);
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

/// A parsed head: the three parts of the start line and the header fields in order.
#[derive(Debug)]
pub(crate) struct Head<'a> {
    pub start: [&'a str; 3],
    pub headers: Vec<(&'a str, &'a str)>,
}

impl<'a> Head<'a> {
    /// Strict: UTF-8, `token SP text SP text`, `name: value` fields with token names, no
    /// folded lines and no stray CR.
    pub(crate) fn parse(head: &'a [u8]) -> Result<Head<'a>, &'static str> {
        let text = std::str::from_utf8(head).map_err(|_| "the head is not UTF-8")?;
        let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
        let start_line = lines.next().ok_or("the head is empty")?;
        let mut parts = start_line.splitn(3, ' ');
        let start = [
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
        ];
        if start[..2].iter().any(|p| p.is_empty() || p.contains('\t')) {
            return Err("the first line is not \"METHOD target HTTP/1.1\"");
        }
        let mut headers = Vec::new();
        for line in lines {
            if line.is_empty() {
                continue;
            }
            if line.contains('\r') {
                return Err("a header line holds a bare CR");
            }
            let (name, value) = line.split_once(':').ok_or("a header line has no \":\"")?;
            if !is_token(name) {
                return Err("a header name is not a token (folded lines are not accepted)");
            }
            headers.push((name, value.trim_matches([' ', '\t'])));
        }
        Ok(Head { start, headers })
    }

    pub(crate) fn get<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'a str> + 's {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    }

    /// A request head: a token method and HTTP/1.0 or HTTP/1.1.
    pub(crate) fn parse_request(head: &'a [u8]) -> Result<Head<'a>, &'static str> {
        let parsed = Head::parse(head)?;
        if !is_token(parsed.start[0]) || !matches!(parsed.start[2], "HTTP/1.1" | "HTTP/1.0") {
            return Err("the first line is not \"METHOD target HTTP/1.1\"");
        }
        Ok(parsed)
    }

    /// A response head's status code, when the start line is `HTTP/1.x NNN reason`.
    pub(crate) fn status(&self) -> Option<u16> {
        let [version, code, _] = self.start;
        if !matches!(version, "HTTP/1.1" | "HTTP/1.0") || code.len() != 3 {
            return None;
        }
        code.parse().ok()
    }

    /// Header fields to pass on: without hop-by-hop fields, `Proxy-*`, the ones `Connection`
    /// names, and those in `also_drop`.
    pub(crate) fn end_to_end(&self, also_drop: &[&str]) -> Vec<(&'a str, &'a str)> {
        let named: Vec<&str> = self
            .get("connection")
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect();
        self.headers
            .iter()
            .copied()
            .filter(|(n, _)| {
                let hop = HOP_BY_HOP.iter().any(|h| n.eq_ignore_ascii_case(h))
                    || n.len() >= 6 && n[..6].eq_ignore_ascii_case("proxy-")
                    || named.iter().any(|c| n.eq_ignore_ascii_case(c))
                    || also_drop.iter().any(|d| n.eq_ignore_ascii_case(d));
                !hop
            })
            .collect()
    }
}

/// RFC 9110 §7.6.1, less `Transfer-Encoding`: bodies are forwarded with their framing as
/// they came, so the field that describes it stays.
const HOP_BY_HOP: &[&str] = &["connection", "keep-alive", "te", "trailer", "upgrade"];

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A complete response the proxy itself gives (an error): plain text, closing the connection.
pub(crate) fn response(status: u16, reason: &str, extra: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n",
        body.len() + 1
    );
    for (name, value) in extra {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(body);
    out.push('\n');
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_parse_strictly() {
        let head =
            Head::parse_request(b"GET http://a/ HTTP/1.1\r\nHost: a\r\nX-A:  b \r\n\r\n").unwrap();
        assert_eq!(head.start, ["GET", "http://a/", "HTTP/1.1"]);
        assert_eq!(head.get("x-a").collect::<Vec<_>>(), ["b"]);
        for bad in [
            &b"GET http://a/\r\n\r\n"[..],
            b"GET  http://a/ HTTP/1.1\r\n\r\n",
            b"GET http://a/ HTTP/1.1\r\n folded: x\r\n\r\n",
            b"GET http://a/ HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET http://a/ HTTP/1.1\r\nA: b\rc\r\n\r\n",
            b"\xff\xfe\r\n\r\n",
            b"GET http://a/ HTTP/2.0\r\n\r\n",
            b"G(T http://a/ HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                Head::parse_request(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
