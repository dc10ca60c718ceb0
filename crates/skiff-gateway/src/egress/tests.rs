//! The proxy end to end on loopback: real origin servers started here, real sockets, a fake
//! resolver where a name must point somewhere it could not on this machine, and the real
//! `curl` (and `openssl s_server` for HTTPS) to prove the wire format is what clients speak.

use super::address::AddressClass;
use super::body::{self, Framing};
use super::http::{self, Head};
use super::proxy::Limits;
use super::resolve::{Resolve, SystemResolver};
use super::*;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const SETUP: &str = "profiles.local.egress.setup";
const AGENT: &str = "profiles.local.egress.agent";

/// A bound on every wait, so a broken proxy fails the test instead of hanging it.
async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("gave up after 20 s")
}

fn file_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

// ---------------------------------------------------------------- origin servers

/// What an origin server saw: each request head, and how many bytes it answered with.
#[derive(Default)]
struct Seen {
    heads: Vec<String>,
    bytes_written: usize,
}

struct Origin {
    addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
}

/// A tiny HTTP/1.1 server: `GET /file` serves `file`, `POST /echo` answers with the body it
/// got (either framing). It keeps a connection open unless the request says `close`.
async fn origin(file: Vec<u8>) -> Origin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let file = Arc::new(file);
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let (file, seen) = (file.clone(), record.clone());
            tokio::spawn(async move {
                let _ = serve_origin(stream, &file, &seen).await;
            });
        }
    });
    Origin { addr, seen }
}

async fn serve_origin(mut stream: TcpStream, file: &[u8], seen: &Mutex<Seen>) -> io::Result<()> {
    loop {
        let mut buf = Vec::new();
        let Ok(n) = http::read_head(&mut stream, &mut buf, 64 * 1024).await else {
            return Ok(());
        };
        let head = Head::parse_request(&buf[..n]).unwrap();
        let framing = body::request_framing(&head).unwrap();
        let mut received = Vec::new();
        if framing != Framing::Empty {
            body::copy_body(&buf[n..], &mut stream, &mut received, framing)
                .await
                .map_err(|_| io::Error::other("bad body"))?;
        }
        let close = head
            .get("connection")
            .any(|v| v.eq_ignore_ascii_case("close"));
        let payload: &[u8] = match head.start[1] {
            "/file" => file,
            "/echo" => &received,
            _ => b"not found",
        };
        let mut out = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nKeep-Alive: timeout=5\r\n\r\n",
            payload.len()
        )
        .into_bytes();
        out.extend_from_slice(payload);
        {
            let mut seen = seen.lock().unwrap();
            seen.heads
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            seen.bytes_written += out.len();
        }
        stream.write_all(&out).await?;
        if close {
            return Ok(());
        }
    }
}

/// A raw TCP echo server (for tunnels).
async fn echo() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

// ---------------------------------------------------------------- the proxy under test

/// Answers from a table, and remembers what it was asked.
struct FakeResolver {
    names: HashMap<String, Vec<IpAddr>>,
    asked: Mutex<Vec<String>>,
}

impl Resolve for FakeResolver {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
    ) -> futures_util::future::BoxFuture<'a, io::Result<Vec<IpAddr>>> {
        self.asked.lock().unwrap().push(host.to_owned());
        let answer = self
            .names
            .get(host)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such host (fake)"));
        Box::pin(async move { answer })
    }
}

struct Proxy {
    egress: Egress,
    addr: SocketAddr,
    serving: JoinHandle<()>,
    decisions: Arc<Mutex<Vec<Decision>>>,
    resolver: Option<Arc<FakeResolver>>,
}

impl Proxy {
    fn decisions(&self) -> Vec<Decision> {
        self.decisions.lock().unwrap().clone()
    }

    fn asked(&self) -> Vec<String> {
        self.resolver
            .as_ref()
            .map(|r| r.asked.lock().unwrap().clone())
            .unwrap_or_default()
    }

    fn counters_for(&self, phase: Phase, host: &str) -> HostCounters {
        self.egress
            .counters()
            .into_iter()
            .find(|c| c.phase == phase && c.host == host)
            .unwrap_or_else(|| panic!("no counters for {host} in {phase:?}"))
    }
}

/// A proxy on a loopback TCP port in the setup phase under `rules`, resolving `names` with a
/// fake resolver.
async fn start_proxy(rules: &[&str], names: &[(&str, &str)]) -> Proxy {
    let fake = Arc::new(FakeResolver {
        names: names.iter().fold(HashMap::new(), |mut m, (n, ip)| {
            m.entry(n.to_string())
                .or_insert_with(Vec::new)
                .push(ip.parse().unwrap());
            m
        }),
        asked: Mutex::new(Vec::new()),
    });
    let mut p = proxy_with(rules, fake.clone()).await;
    p.resolver = Some(fake);
    p
}

async fn proxy_with(rules: &[&str], resolver: Arc<dyn Resolve>) -> Proxy {
    let decisions = Arc::new(Mutex::new(Vec::new()));
    let record = decisions.clone();
    let options = Options {
        resolver,
        audit: Some(Arc::new(move |d: &Decision| {
            record.lock().unwrap().push(d.clone())
        })),
        limits: Limits::default(),
    };
    let egress = Egress::new(Phase::Setup, Policy::parse(SETUP, rules).unwrap(), options);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tokio::spawn({
        let egress = egress.clone();
        async move { egress.serve(listener).await }
    });
    Proxy {
        egress,
        addr,
        serving,
        decisions,
        resolver: None,
    }
}

// ---------------------------------------------------------------- clients

#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    raw_head: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `request` as is and reads the answer until the proxy closes.
async fn exchange(stream: &mut (impl AsyncRead + AsyncWrite + Unpin), request: &[u8]) -> Response {
    stream.write_all(request).await.unwrap();
    let mut all = Vec::new();
    within(stream.read_to_end(&mut all)).await.unwrap();
    parse_response(&all)
}

async fn send(proxy: SocketAddr, request: &[u8]) -> Response {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    exchange(&mut stream, request).await
}

fn parse_response(all: &[u8]) -> Response {
    let end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(all)))
        + 4;
    let head = Head::parse(&all[..end]).unwrap();
    Response {
        status: head.status().unwrap(),
        headers: head
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        body: all[end..].to_vec(),
        raw_head: String::from_utf8_lossy(&all[..end]).into_owned(),
    }
}

/// CONNECTs and reads exactly the proxy's 200 head; returns the tunnel.
async fn tunnel(proxy: SocketAddr, target: &str) -> TcpStream {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8];
        let n = within(stream.read(&mut byte)).await.unwrap();
        assert_eq!(
            n,
            1,
            "proxy closed during CONNECT: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    assert_eq!(head, b"HTTP/1.1 200 Connection established\r\n\r\n");
    stream
}

/// Writes `data` through an echo tunnel while reading it back.
async fn echo_through(stream: &mut TcpStream, data: &[u8]) -> Vec<u8> {
    let (mut r, mut w) = stream.split();
    let mut back = vec![0u8; data.len()];
    let (wrote, read) =
        within(async { tokio::join!(w.write_all(data), r.read_exact(&mut back)) }).await;
    wrote.unwrap();
    read.unwrap();
    back
}

/// Waits for the peer to close (or reset) the stream.
async fn closed(stream: &mut TcpStream) {
    let mut buf = [0u8; 1024];
    loop {
        match within(stream.read(&mut buf)).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn a_plain_http_get_is_forwarded_in_origin_form_and_counted() {
    let file = file_bytes(100_000);
    let origin = origin(file.clone()).await;
    let port = origin.addr.port();
    let proxy = start_proxy(&["files.test"], &[("files.test", "127.0.0.1")]).await;

    let request = format!(
        "GET http://Files.Test:{port}/file HTTP/1.1\r\nHost: files.test:{port}\r\n\
         User-Agent: t\r\nProxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\n\
         Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 300\r\n\r\n"
    );
    let response = send(proxy.addr, request.as_bytes()).await;

    assert_eq!(response.status, 200, "{}", response.raw_head);
    assert_eq!(response.body, file);
    assert_eq!(response.header("connection"), Some("close"));
    assert_eq!(response.header("keep-alive"), None);
    let seen = origin.seen.lock().unwrap();
    assert_eq!(
        seen.heads,
        [format!(
            "GET /file HTTP/1.1\r\nHost: files.test:{port}\r\nUser-Agent: t\r\nConnection: close\r\n\r\n"
        )],
        "the origin gets origin form, its Host, no proxy or hop-by-hop fields"
    );
    assert_eq!(
        proxy.counters_for(Phase::Setup, "files.test"),
        HostCounters {
            phase: Phase::Setup,
            host: "files.test".into(),
            connections: 1,
            bytes_out: seen.heads[0].len() as u64,
            bytes_in: seen.bytes_written as u64,
            refused: 0,
        }
    );
    assert_eq!(
        proxy.decisions(),
        [Decision {
            phase: Phase::Setup,
            key: SETUP.into(),
            host: "files.test".into(),
            port,
            verdict: Verdict::Allowed {
                rule: "files.test".into()
            },
        }]
    );
}

#[tokio::test]
async fn request_bodies_are_forwarded_with_their_framing() {
    let origin = origin(Vec::new()).await;
    let port = origin.addr.port();
    let proxy = start_proxy(&["127.0.0.1"], &[]).await;

    let body = file_bytes(50_000);
    let mut request = format!(
        "POST http://127.0.0.1:{port}/echo HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let response = send(proxy.addr, &request).await;
    assert_eq!(response.status, 200);
    assert_eq!(response.body, body);

    // Bytes after the end of a chunked body are a second request, never sent on.
    let chunked = b"POST http://127.0.0.1:PORT/echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
                    5\r\nhello\r\n6\r\n world\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n";
    let chunked = String::from_utf8_lossy(chunked).replace("PORT", &port.to_string());
    let response = send(proxy.addr, chunked.as_bytes()).await;
    assert_eq!(response.status, 200);
    assert_eq!(response.text(), "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
    {
        let seen = origin.seen.lock().unwrap();
        assert_eq!(seen.heads.len(), 2, "{:?}", seen.heads);
        assert!(seen.heads.iter().all(|h| !h.contains("smuggled")));
    }

    let response = send(
        proxy.addr,
        b"POST http://127.0.0.1:1/echo HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .await;
    assert_eq!(response.status, 400, "ambiguous framing is refused");
}

#[tokio::test]
async fn a_connect_tunnel_carries_bytes_both_ways_and_counts_them() {
    let echo = echo().await;
    let proxy = start_proxy(&["localhost"], &[("localhost", "127.0.0.1")]).await;
    let target = format!("localhost:{}", echo.port());

    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    // Bytes sent right behind the CONNECT head (as eager clients do) reach the host first.
    let mut first = format!("CONNECT {target} HTTP/1.1\r\n\r\n").into_bytes();
    first.extend_from_slice(b"early");
    stream.write_all(&first).await.unwrap();
    let mut reply = vec![0u8; "HTTP/1.1 200 Connection established\r\n\r\nearly".len()];
    within(stream.read_exact(&mut reply)).await.unwrap();
    assert!(
        reply.ends_with(b"\r\n\r\nearly"),
        "{}",
        String::from_utf8_lossy(&reply)
    );

    let data = file_bytes(64 * 1024);
    assert_eq!(echo_through(&mut stream, &data).await, data);
    // Counted as they pass: every byte that came back had been counted on its way.
    let want = (data.len() + 5) as u64;
    let c = proxy.counters_for(Phase::Setup, "localhost");
    assert_eq!((c.connections, c.bytes_out, c.bytes_in), (1, want, want));
}

#[tokio::test]
async fn a_host_not_on_the_list_gets_403_naming_the_key() {
    let proxy = start_proxy(&["pypi.org"], &[("pypi.example", "127.0.0.1")]).await;

    let response = send(proxy.addr, b"CONNECT pypi.example:443 HTTP/1.1\r\n\r\n").await;
    assert_eq!(response.status, 403);
    assert_eq!(
        response.header("x-skiff-egress-refused"),
        Some("pypi.example:443")
    );
    assert_eq!(
        response.text(),
        "skiff egress: refused pypi.example:443 (not in profiles.local.egress.setup); add \
         \"pypi.example\" to profiles.local.egress.setup to allow it\n"
    );
    // A tunnelling client shows only the status line: it says the same.
    assert!(
        response.raw_head.starts_with(
            "HTTP/1.1 403 Forbidden: skiff egress: refused pypi.example:443 (not in \
             profiles.local.egress.setup); add \"pypi.example\" to profiles.local.egress.setup"
        ),
        "{}",
        response.raw_head
    );

    let response = send(
        proxy.addr,
        b"GET http://pypi.example/simple/ HTTP/1.1\r\n\r\n",
    )
    .await;
    assert_eq!(response.status, 403);
    assert_eq!(
        response.header("x-skiff-egress-refused"),
        Some("pypi.example:80")
    );
    assert!(
        proxy.asked().is_empty(),
        "an unlisted name is never resolved"
    );
    let d = proxy.decisions();
    assert_eq!(d.len(), 2);
    assert!(d.iter().all(|d| d.verdict
        == Verdict::Refused {
            reason: Refusal::NotListed
        }));
    assert_eq!(proxy.counters_for(Phase::Setup, "pypi.example").refused, 2);
}

#[tokio::test]
async fn localhost_is_reached_only_when_named_exactly() {
    let origin = origin(b"local".to_vec()).await;
    let port = origin.addr.port();
    let get = format!("GET http://localhost:{port}/file HTTP/1.1\r\n\r\n");

    // The real resolver: localhost is 127.0.0.1 (and perhaps ::1) on this machine.
    let listed_other = proxy_with(
        &["*.localhost", "git.example.com"],
        Arc::new(SystemResolver),
    )
    .await;
    let response = send(listed_other.addr, get.as_bytes()).await;
    assert_eq!(response.status, 403);
    assert!(
        response
            .text()
            .contains("add \"localhost\" to profiles.local.egress.setup")
    );

    let named = proxy_with(&["localhost"], Arc::new(SystemResolver)).await;
    let response = send(named.addr, get.as_bytes()).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(response.body, b"local");

    // A wildcard that matches a name resolving to loopback is not enough.
    let wildcard = start_proxy(&["*.example.test"], &[("app.example.test", "127.0.0.1")]).await;
    let get = format!("GET http://app.example.test:{port}/file HTTP/1.1\r\n\r\n");
    let response = send(wildcard.addr, get.as_bytes()).await;
    assert_eq!(response.status, 403);
    assert_eq!(
        response.text(),
        format!(
            "skiff egress: refused app.example.test:{port} (app.example.test resolves to \
             127.0.0.1, a loopback address; only an exact rule naming the host or that address \
             allows it); add \"app.example.test\" to profiles.local.egress.setup to allow it\n"
        )
    );
    assert_eq!(
        origin.seen.lock().unwrap().heads.len(),
        1,
        "only the named request arrived"
    );
}

#[tokio::test]
async fn the_metadata_address_is_refused_unless_named() {
    let proxy = start_proxy(
        &["*.internal.example", "preset:python"],
        &[("meta.internal.example", "169.254.169.254")],
    )
    .await;

    let response = send(
        proxy.addr,
        b"GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\n\r\n",
    )
    .await;
    assert_eq!(response.status, 403);
    assert_eq!(
        response.header("x-skiff-egress-refused"),
        Some("169.254.169.254:80")
    );
    assert!(response.text().contains("add \"169.254.169.254\""));

    let response = send(
        proxy.addr,
        b"CONNECT meta.internal.example:80 HTTP/1.1\r\n\r\n",
    )
    .await;
    assert_eq!(response.status, 403);
    assert!(
        response.text().contains(
            "meta.internal.example resolves to 169.254.169.254, the cloud metadata address"
        ),
        "{}",
        response.text()
    );
    // Named exactly, the policy lets it through (not connected here: no traffic off loopback).
    let named = Policy::parse(SETUP, &["169.254.169.254"]).unwrap();
    let target = target::Target::parse("169.254.169.254:80", None).unwrap();
    let listed = named.lookup(&target).unwrap();
    assert_eq!(
        named.check_addresses(&listed, 80, &["169.254.169.254".parse().unwrap()]),
        Ok(())
    );
}

#[tokio::test]
async fn a_wildcard_or_preset_never_reaches_a_private_address() {
    // A server really listens where the hostile answers point, so only the check stops it.
    let origin = origin(b"private".to_vec()).await;
    let port = origin.addr.port();
    let proxy = start_proxy(
        &["preset:python", "*.internal.example"],
        &[
            ("pypi.org", "10.0.0.1"),
            ("db.internal.example", "151.101.0.223"),
            ("db.internal.example", "127.0.0.1"),
        ],
    )
    .await;

    let response = send(proxy.addr, b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n").await;
    assert_eq!(response.status, 403);
    assert!(
        response
            .text()
            .contains("pypi.org resolves to 10.0.0.1, a private address")
    );

    let get = format!("GET http://db.internal.example:{port}/file HTTP/1.1\r\n\r\n");
    let response = send(proxy.addr, get.as_bytes()).await;
    assert_eq!(
        response.status, 403,
        "one non-public address among public ones is enough"
    );
    assert!(origin.seen.lock().unwrap().heads.is_empty());
    assert_eq!(
        proxy
            .decisions()
            .iter()
            .map(|d| d.verdict.clone())
            .collect::<Vec<_>>(),
        [
            Verdict::Refused {
                reason: Refusal::NonPublic {
                    address: "10.0.0.1".parse().unwrap(),
                    class: AddressClass::Private
                }
            },
            Verdict::Refused {
                reason: Refusal::NonPublic {
                    address: "127.0.0.1".parse().unwrap(),
                    class: AddressClass::Loopback
                }
            },
        ]
    );

    // The same name as an exact rule is an operator's explicit choice.
    let exact = start_proxy(
        &["*.internal.example", "db.internal.example"],
        &[("db.internal.example", "127.0.0.1")],
    )
    .await;
    let response = send(exact.addr, get.as_bytes()).await;
    assert_eq!(response.status, 200);
    assert_eq!(response.body, b"private");
}

#[tokio::test]
async fn swapping_to_no_egress_refuses_the_next_request_and_cuts_open_tunnels() {
    let echo = echo().await;
    let proxy = start_proxy(&["127.0.0.1"], &[]).await;
    let target = format!("127.0.0.1:{}", echo.port());
    let mut open = tunnel(proxy.addr, &target).await;
    assert_eq!(echo_through(&mut open, b"setup").await, b"setup");

    proxy.egress.set_policy(Phase::Agent, Policy::none(AGENT));
    assert_eq!(proxy.egress.phase(), Phase::Agent);
    closed(&mut open).await;

    let response = send(
        proxy.addr,
        format!("CONNECT {target} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(response.status, 403);
    assert_eq!(
        response.text(),
        format!(
            "skiff egress: refused {target} (profiles.local.egress.agent allows no egress); add \
             \"127.0.0.1\" to profiles.local.egress.agent to allow it\n"
        )
    );
    let last = proxy.decisions().pop().unwrap();
    assert_eq!((last.phase, last.key.as_str()), (Phase::Agent, AGENT));
    let setup = proxy.counters_for(Phase::Setup, "127.0.0.1");
    let agent = proxy.counters_for(Phase::Agent, "127.0.0.1");
    assert_eq!((setup.connections, setup.refused), (1, 0));
    assert_eq!((agent.connections, agent.refused), (0, 1));
}

#[tokio::test]
async fn stop_cuts_an_open_tunnel_and_ends_serving() {
    let echo = echo().await;
    let proxy = start_proxy(&["127.0.0.1"], &[]).await;
    let mut open = tunnel(proxy.addr, &format!("127.0.0.1:{}", echo.port())).await;
    assert_eq!(echo_through(&mut open, b"ping").await, b"ping");
    // A client that has sent half a head is cut too.
    let mut half = TcpStream::connect(proxy.addr).await.unwrap();
    half.write_all(b"GET http://127.0.0.1/ HT").await.unwrap();

    proxy.egress.stop();
    closed(&mut open).await;
    closed(&mut half).await;
    within(proxy.serving).await.unwrap();
    assert!(
        TcpStream::connect(proxy.addr).await.is_err(),
        "the listener is closed"
    );
}

#[tokio::test]
async fn garbage_gets_400_and_the_proxy_keeps_serving() {
    let origin = origin(b"fine".to_vec()).await;
    let proxy = start_proxy(&["127.0.0.1"], &[]).await;

    for (request, status, says) in [
        (
            &b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"[..],
            400,
            "bad request",
        ),
        (
            b"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n",
            400,
            "send an absolute URL",
        ),
        (
            b"GET https://127.0.0.1/ HTTP/1.1\r\n\r\n",
            400,
            "through CONNECT",
        ),
        (
            b"GET http://user:pw@127.0.0.1/ HTTP/1.1\r\n\r\n",
            400,
            "credentials",
        ),
        (b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n", 400, "host:port"),
        (b"GET http://a b/ HTTP/1.1\r\n\r\n", 400, "bad request"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, "bad request"),
    ] {
        let response = send(proxy.addr, request).await;
        assert_eq!(
            response.status,
            status,
            "{}",
            String::from_utf8_lossy(request)
        );
        assert!(response.text().contains(says), "{}", response.text());
    }
    let mut huge = b"GET http://127.0.0.1/ HTTP/1.1\r\n".to_vec();
    huge.extend(b"X-Big: ".iter().chain(&[b'a'; 20_000]));
    let response = send(proxy.addr, &huge).await;
    assert_eq!(response.status, 431);

    let get = format!(
        "GET http://127.0.0.1:{}/file HTTP/1.1\r\n\r\n",
        origin.addr.port()
    );
    let response = send(proxy.addr, get.as_bytes()).await;
    assert_eq!(
        (response.status, response.body.as_slice()),
        (200, &b"fine"[..])
    );
    assert!(
        proxy.decisions().iter().all(Decision::allowed),
        "garbage is not a decision"
    );
}

#[tokio::test]
async fn an_unreachable_or_unresolvable_host_gets_502() {
    let closed_port = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let proxy = start_proxy(&["127.0.0.1", "gone.test"], &[]).await;
    let response = send(
        proxy.addr,
        format!("CONNECT 127.0.0.1:{closed_port} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(response.status, 502);
    assert!(
        response.text().starts_with(&format!(
            "skiff egress: cannot reach 127.0.0.1:{closed_port}: "
        )),
        "{}",
        response.text()
    );
    let response = send(proxy.addr, b"GET http://gone.test/ HTTP/1.1\r\n\r\n").await;
    assert_eq!(response.status, 502);
    assert!(
        response
            .text()
            .starts_with("skiff egress: cannot resolve gone.test: ")
    );
    assert_eq!(response.text().lines().count(), 1);
}

#[tokio::test]
async fn counters_and_decisions_agree_over_a_mixed_session() {
    let origin = origin(file_bytes(3000)).await;
    let port = origin.addr.port();
    let proxy = start_proxy(
        &["preset:python", "files.test", "127.0.0.1"],
        // (An explicit "127.0.0.1" rule would let pypi.org reach 127.0.0.1: the rule names it.)
        &[("files.test", "127.0.0.1"), ("pypi.org", "10.0.0.1")],
    )
    .await;
    let get = |host: &str| format!("GET http://{host}:{port}/file HTTP/1.1\r\n\r\n");
    for host in [
        "files.test",
        "files.test",
        "127.0.0.1",
        "pypi.org",
        "evil.test",
    ] {
        send(proxy.addr, get(host).as_bytes()).await;
    }
    proxy.egress.set_policy(Phase::Agent, Policy::none(AGENT));
    send(proxy.addr, get("files.test").as_bytes()).await;

    let decisions = proxy.decisions();
    let counters = proxy.egress.counters();
    for c in &counters {
        let mine: Vec<_> = decisions
            .iter()
            .filter(|d| d.phase == c.phase && d.host == c.host)
            .collect();
        assert_eq!(
            c.refused,
            mine.iter().filter(|d| !d.allowed()).count() as u64,
            "{c:?}"
        );
        assert_eq!(
            c.connections,
            mine.iter().filter(|d| d.allowed()).count() as u64,
            "{c:?}"
        );
    }
    let summary: Vec<_> = counters
        .iter()
        .map(|c| (c.phase, c.host.as_str(), c.connections, c.refused))
        .collect();
    assert_eq!(
        summary,
        [
            (Phase::Setup, "127.0.0.1", 1, 0),
            (Phase::Setup, "evil.test", 0, 1),
            (Phase::Setup, "files.test", 2, 0),
            (Phase::Setup, "pypi.org", 0, 1),
            (Phase::Agent, "files.test", 0, 1),
        ]
    );
    let served = origin.seen.lock().unwrap().bytes_written as u64;
    let bytes_in: u64 = counters.iter().map(|c| c.bytes_in).sum();
    assert_eq!(
        bytes_in, served,
        "every byte the origin sent is counted once"
    );
    let json = serde_json::to_value(&decisions[3]).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"phase": "setup", "key": SETUP, "host": "pypi.org", "port": port,
            "verdict": {"verdict": "refused", "reason": {"kind": "non_public", "address": "10.0.0.1", "class": "private"}}})
    );
}

#[tokio::test]
async fn it_serves_a_unix_socket_and_any_stream() {
    let origin = origin(b"over unix".to_vec()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let egress = Egress::new(
        Phase::Setup,
        Policy::parse(SETUP, &["127.0.0.1"]).unwrap(),
        Options::default(),
    );
    let serving = tokio::spawn({
        let egress = egress.clone();
        async move { egress.serve(listener).await }
    });
    let mut stream = tokio::net::UnixStream::connect(&path).await.unwrap();
    let get = format!(
        "GET http://127.0.0.1:{}/file HTTP/1.1\r\n\r\n",
        origin.addr.port()
    );
    let response = exchange(&mut stream, get.as_bytes()).await;
    assert_eq!(
        (response.status, response.body.as_slice()),
        (200, &b"over unix"[..])
    );

    // Any byte stream will do (an SSH channel, say): here an in-memory pipe.
    let (mut client, server) = tokio::io::duplex(64 * 1024);
    let one = tokio::spawn({
        let egress = egress.clone();
        async move { egress.serve_connection(server).await }
    });
    let response = exchange(&mut client, get.as_bytes()).await;
    assert_eq!(
        (response.status, response.body.as_slice()),
        (200, &b"over unix"[..])
    );
    within(one).await.unwrap();

    egress.stop();
    within(serving).await.unwrap();
}

// ---------------------------------------------------------------- real clients

/// Runs `curl` with a clean environment (no proxy variables, no curlrc).
async fn curl(args: &[&str]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new("curl");
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .arg("-q")
        .args(["-sS", "--max-time", "20"])
        .args(args)
        .kill_on_drop(true);
    within(cmd.output()).await.unwrap()
}

#[tokio::test]
async fn curl_gets_through_it_plain_and_tunnelled_and_reads_a_refusal() {
    let file = file_bytes(200_000);
    let origin = origin(file.clone()).await;
    let port = origin.addr.port();
    let proxy = start_proxy(&["files.test"], &[("files.test", "127.0.0.1")]).await;
    let via = format!("http://{}", proxy.addr);
    let url = format!("http://files.test:{port}/file");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_str().unwrap();

    let plain = curl(&["--proxy", &via, "-o", out_s, &url]).await;
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    assert_eq!(std::fs::read(&out).unwrap(), file);

    let tunnelled = curl(&["--proxytunnel", "--proxy", &via, "-o", out_s, &url]).await;
    assert!(
        tunnelled.status.success(),
        "{}",
        String::from_utf8_lossy(&tunnelled.stderr)
    );
    assert_eq!(std::fs::read(&out).unwrap(), file);

    let refused = curl(&["--proxy", &via, "-w", "%{http_code}", "http://nope.test/x"]).await;
    let stdout = String::from_utf8_lossy(&refused.stdout);
    assert!(
        stdout
            .starts_with("skiff egress: refused nope.test:80 (not in profiles.local.egress.setup)")
            && stdout.ends_with("\n403"),
        "{stdout}"
    );
    let c = proxy.counters_for(Phase::Setup, "files.test");
    assert_eq!(c.connections, 2);
    assert!(c.bytes_in > 2 * file.len() as u64);
}

#[tokio::test]
async fn curl_speaks_https_through_a_connect_tunnel_to_a_real_tls_server() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let keygen = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=tls.test"])
        .args(["-addext", "subjectAltName=DNS:tls.test"])
        .args(["-keyout", &at("key.pem"), "-out", &at("cert.pem")])
        .output()
        .unwrap();
    assert!(
        keygen.status.success(),
        "{}",
        String::from_utf8_lossy(&keygen.stderr)
    );
    std::fs::write(dir.path().join("file"), b"over tls\n").unwrap();
    // stdbuf: s_server's stdout is block-buffered into a pipe, and the test waits on a line.
    let mut server = tokio::process::Command::new("stdbuf")
        .args([
            "-oL",
            "openssl",
            "s_server",
            "-accept",
            "127.0.0.1:0",
            "-naccept",
            "1",
            "-WWW",
        ])
        .args(["-cert", &at("cert.pem"), "-key", &at("key.pem")])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // s_server says where it listens once it does: "ACCEPT 127.0.0.1:PORT".
    let mut lines = tokio::io::BufReader::new(server.stdout.take().unwrap()).lines();
    let port = within(async {
        loop {
            let line = lines.next_line().await.unwrap().expect("s_server exited");
            if let Some(addr) = line.strip_prefix("ACCEPT ") {
                break addr.rsplit(':').next().unwrap().parse::<u16>().unwrap();
            }
        }
    })
    .await;

    let proxy = start_proxy(&["tls.test"], &[("tls.test", "127.0.0.1")]).await;
    let got = curl(&[
        "--proxy",
        &format!("http://{}", proxy.addr),
        "--cacert",
        &at("cert.pem"),
        &format!("https://tls.test:{port}/file"),
    ])
    .await;
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert_eq!(got.stdout, b"over tls\n");
    drop(lines); // s_server's stdout stays open until it has served.
    let c = proxy.counters_for(Phase::Setup, "tls.test");
    assert_eq!(c.connections, 1);
    assert!(c.bytes_out > 200 && c.bytes_in > 500, "{c:?}");
}
