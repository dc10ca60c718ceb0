//! Egress proxy throughput (printed, never asserted): a 64 MiB file from a loopback HTTP
//! server, downloaded directly and through the proxy — as a plain-HTTP request and through a
//! CONNECT tunnel — with the proxy on a unix socket as boxes reach it. A bare relay (accept,
//! connect, `copy_bidirectional` with the proxy's buffer size; no parsing, policy or counting)
//! on the same path shows what the extra hop itself costs on this machine. Runs are
//! interleaved so a busy machine slows all alike; medians, and the ratio proxy/direct (goal
//! >= 0.8) and proxy/bare relay.
//!
//! `cargo bench -p skiff-gateway --bench egress`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// The proxy is internal to the gateway (`pub(crate)`, wired in by placements); the bench
// compiles the module itself rather than widening the crate's public API for it.
#[allow(dead_code, unused_imports)]
#[path = "../src/egress/mod.rs"]
mod egress;

use egress::{Egress, Options, Phase, Policy};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

const FILE: usize = 64 * 1024 * 1024;
/// The proxy's copy buffer (`egress::http::COPY_BUF`), for the bare relay.
const RELAY_BUF: usize = 128 * 1024;
const RUNS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Serves `GET` of the whole file on every connection, then closes.
async fn origin() -> SocketAddr {
    let file: Arc<Vec<u8>> = Arc::new((0..FILE).map(|i| (i % 251) as u8).collect());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            stream.set_nodelay(true).unwrap();
            let file = file.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1024];
                while !head.ends_with(b"\r\n\r\n") {
                    let n = stream.read(&mut byte).await.unwrap();
                    assert!(n > 0, "client closed before its request");
                    head.extend_from_slice(&byte[..n]);
                }
                let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {FILE}\r\n\r\n");
                stream.write_all(reply.as_bytes()).await.unwrap();
                stream.write_all(&file).await.unwrap();
                stream.shutdown().await.unwrap();
            });
        }
    });
    addr
}

/// Sends `request` and reads to the end; returns the body's bytes per second.
async fn download(mut stream: impl AsyncRead + AsyncWrite + Unpin, request: &[u8]) -> f64 {
    let start = Instant::now();
    stream.write_all(request).await.unwrap();
    let total = drain(&mut stream).await;
    let body = total - head_len(total);
    assert_eq!(body, FILE, "short download");
    FILE as f64 / start.elapsed().as_secs_f64()
}

async fn drain(stream: &mut (impl AsyncRead + Unpin)) -> usize {
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0;
    loop {
        let n = stream.read(&mut buf).await.unwrap();
        if n == 0 {
            return total;
        }
        total += n;
    }
}

/// The response head's length, from the total: everything beyond the file.
fn head_len(total: usize) -> usize {
    total.saturating_sub(FILE)
}

async fn direct(origin: SocketAddr) -> f64 {
    let stream = TcpStream::connect(origin).await.unwrap();
    stream.set_nodelay(true).unwrap();
    download(
        stream,
        b"GET /file HTTP/1.1\r\nHost: o\r\nConnection: close\r\n\r\n",
    )
    .await
}

async fn plain(proxy: &Path, origin: SocketAddr) -> f64 {
    let stream = UnixStream::connect(proxy).await.unwrap();
    let request = format!("GET http://{origin}/file HTTP/1.1\r\nHost: {origin}\r\n\r\n");
    download(stream, request.as_bytes()).await
}

async fn tunnelled(proxy: &Path, origin: SocketAddr) -> f64 {
    let start = Instant::now();
    let mut stream = UnixStream::connect(proxy).await.unwrap();
    let connect = format!("CONNECT {origin} HTTP/1.1\r\nHost: {origin}\r\n\r\n");
    stream.write_all(connect.as_bytes()).await.unwrap();
    let established = b"HTTP/1.1 200 Connection established\r\n\r\n";
    let mut head = vec![0u8; established.len()];
    stream.read_exact(&mut head).await.unwrap();
    assert_eq!(head, established);
    stream
        .write_all(b"GET /file HTTP/1.1\r\nHost: o\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let total = drain(&mut stream).await;
    assert_eq!(total - head_len(total), FILE, "short download");
    FILE as f64 / start.elapsed().as_secs_f64()
}

/// The floor any user-space relay pays: a unix socket whose every connection is spliced to
/// the origin by tokio's `copy_bidirectional`.
async fn bare_relay(origin: SocketAddr, socket: &Path) {
    let listener = tokio::net::UnixListener::bind(socket).unwrap();
    tokio::spawn(async move {
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut upstream = TcpStream::connect(origin).await.unwrap();
                upstream.set_nodelay(true).unwrap();
                let _ = tokio::io::copy_bidirectional_with_sizes(
                    &mut client,
                    &mut upstream,
                    RELAY_BUF,
                    RELAY_BUF,
                )
                .await;
            });
        }
    });
}

async fn relayed(relay: &Path) -> f64 {
    let stream = UnixStream::connect(relay).await.unwrap();
    download(
        stream,
        b"GET /file HTTP/1.1\r\nHost: o\r\nConnection: close\r\n\r\n",
    )
    .await
}

fn mb(bytes_per_s: f64) -> f64 {
    bytes_per_s / 1e6
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let origin = origin().await;
        let dir = tempfile::tempdir().unwrap();
        let socket: PathBuf = dir.path().join("egress.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let policy = Policy::parse("profiles.bench.egress.setup", &["127.0.0.1"]).unwrap();
        let proxy = Egress::new(Phase::Setup, policy, Options::default());
        let serving = tokio::spawn({
            let proxy = proxy.clone();
            async move { proxy.serve(listener).await }
        });

        let relay = dir.path().join("relay.sock");
        bare_relay(origin, &relay).await;

        // One of each first: page in the file and warm the allocator.
        direct(origin).await;
        relayed(&relay).await;
        plain(&socket, origin).await;
        tunnelled(&socket, origin).await;

        let (mut d, mut r, mut p, mut t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..RUNS {
            d.push(direct(origin).await);
            r.push(relayed(&relay).await);
            p.push(plain(&socket, origin).await);
            t.push(tunnelled(&socket, origin).await);
        }
        let (d, r, p, t) = (median(d), median(r), median(p), median(t));
        println!("egress proxy: {RUNS} interleaved downloads of a 64 MiB file over loopback");
        println!("  direct (TCP)                 median {:>8.0} MB/s", mb(d));
        println!(
            "  bare relay (unix -> TCP)     median {:>8.0} MB/s   ratio relay/direct {:.2}",
            mb(r),
            r / d
        );
        for (name, v) in [("plain HTTP", p), ("CONNECT   ", t)] {
            println!(
                "  proxy, {name} (unix)     median {:>8.0} MB/s   ratio proxy/direct {:.2} (goal >= 0.80)   proxy/relay {:.2}",
                mb(v),
                v / d,
                v / r
            );
        }
        let counted: u64 = proxy.counters().iter().map(|c| c.bytes_in).sum();
        println!(
            "  bytes counted from the host  {:.1} MiB over {} downloads",
            counted as f64 / (1024.0 * 1024.0),
            2 * (RUNS + 1)
        );
        proxy.stop();
        serving.await.unwrap();
    });
}
