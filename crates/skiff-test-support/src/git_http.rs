//! A git server on loopback over smart HTTP: the system's real `git http-backend` run as CGI
//! behind a tiny HTTP/1.1 server that requires basic auth (one user and password), as a forge
//! does. Every request without the right `Authorization` is answered 401 with a
//! `WWW-Authenticate` challenge; the rest go to `http-backend` with `REMOTE_USER` set, so
//! pushes are allowed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running server; it stops when dropped.
pub struct GitHttpServer {
    port: u16,
    refused: Arc<AtomicUsize>,
    served: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GitHttpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl GitHttpServer {
    /// Serves the bare repositories under `root` (`http://127.0.0.1:PORT/NAME.git`) to `user`
    /// with `password`.
    pub async fn start(root: &Path, user: &str, password: &str) -> GitHttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let expected = format!("Basic {}", base64(format!("{user}:{password}").as_bytes()));
        let refused = Arc::new(AtomicUsize::new(0));
        let served = Arc::new(AtomicUsize::new(0));
        let (root, user) = (root.to_path_buf(), user.to_owned());
        let (r, s) = (refused.clone(), served.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (root, user, expected) = (root.clone(), user.clone(), expected.clone());
                let (r, s) = (r.clone(), s.clone());
                tokio::spawn(async move {
                    let _ = serve(stream, &root, &user, &expected, &r, &s).await;
                });
            }
        });
        GitHttpServer {
            port,
            refused,
            served,
            task,
        }
    }

    /// `http://127.0.0.1:PORT/`
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/", self.port)
    }

    /// Requests answered 401 (no or wrong credentials).
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// Requests handed to `git http-backend`.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn serve(
    mut stream: TcpStream,
    root: &Path,
    user: &str,
    expected: &str,
    refused: &AtomicUsize,
    served: &AtomicUsize,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() > 1 << 20 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut rest = buf[head_end + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let mut request = lines.next().unwrap_or_default().split(' ');
    let method = request.next().unwrap_or_default().to_owned();
    let target = request.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    if header("authorization").as_deref() != Some(expected) {
        refused.fetch_add(1, Ordering::SeqCst);
        stream
            .write_all(
                b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\n\
                  Content-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await?;
        return stream.shutdown().await;
    }
    let body = if header("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        read_chunked(&mut stream, rest).await?
    } else {
        let len: usize = header("content-length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        while rest.len() < len {
            let mut chunk = [0u8; 65536];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        rest
    };
    served.fetch_add(1, Ordering::SeqCst);
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut cmd = tokio::process::Command::new("git");
    cmd.arg("http-backend")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("REMOTE_USER", user)
        .env("REMOTE_ADDR", "127.0.0.1")
        .env("CONTENT_LENGTH", body.len().to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    if let Some(t) = header("content-type") {
        cmd.env("CONTENT_TYPE", t);
    }
    if let Some(e) = header("content-encoding") {
        cmd.env("HTTP_CONTENT_ENCODING", e);
    }
    if let Some(p) = header("git-protocol") {
        cmd.env("GIT_PROTOCOL", p);
    }
    let mut child = cmd.spawn()?;
    let mut stdin = child.stdin.take().unwrap();
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&body).await;
    });
    let output = child.wait_with_output().await?;
    let _ = writer.await;
    let out = output.stdout;
    let (cgi_head, cgi_body) = match out.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(at) => (&out[..at], &out[at + 4..]),
        None => match out.windows(2).position(|w| w == b"\n\n") {
            Some(at) => (&out[..at], &out[at + 2..]),
            None => (&out[..0], &out[..]),
        },
    };
    let mut status = "200 OK".to_owned();
    let mut response = Vec::new();
    for line in String::from_utf8_lossy(cgi_head).lines() {
        match line.split_once(':') {
            Some((k, v)) if k.eq_ignore_ascii_case("status") => status = v.trim().to_owned(),
            Some(_) => {
                response.extend_from_slice(line.trim_end().as_bytes());
                response.extend_from_slice(b"\r\n");
            }
            None => {}
        }
    }
    let mut all = format!("HTTP/1.1 {status}\r\n").into_bytes();
    all.extend_from_slice(&response);
    all.extend_from_slice(
        format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            cgi_body.len()
        )
        .as_bytes(),
    );
    all.extend_from_slice(cgi_body);
    stream.write_all(&all).await?;
    stream.shutdown().await
}

/// Reads a chunked body; `rest` is what came after the head.
async fn read_chunked(stream: &mut TcpStream, mut rest: Vec<u8>) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(at) = rest.windows(2).position(|w| w == b"\r\n") {
                break at;
            }
            fill(stream, &mut rest).await?;
        };
        let size_text = String::from_utf8_lossy(&rest[..line_end]).into_owned();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        rest.drain(..line_end + 2);
        if size == 0 {
            return Ok(body);
        }
        while rest.len() < size + 2 {
            fill(stream, &mut rest).await?;
        }
        body.extend_from_slice(&rest[..size]);
        rest.drain(..size + 2);
    }
}

async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut chunk = [0u8; 65536];
    let n = stream.read(&mut chunk).await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// A bare repository `NAME.git` under `root`, holding `files` in one commit on `main`, and
/// its path.
pub fn bare_repo(root: &Path, name: &str, files: &[(&str, &str)]) -> PathBuf {
    let work = crate::TempGitRepo::new(files);
    let bare = root.join(format!("{name}.git"));
    std::fs::create_dir_all(root).unwrap();
    let out = std::process::Command::new("git")
        .args(["clone", "-q", "--bare"])
        .arg(work.path())
        .arg(&bare)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "git clone --bare: {out:?}");
    bare
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_the_rfc_examples() {
        assert_eq!(super::base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(super::base64(b"fooba"), "Zm9vYmE=");
        assert_eq!(super::base64(b"foob"), "Zm9vYg==");
        assert_eq!(super::base64(b"f"), "Zg==");
    }
}
