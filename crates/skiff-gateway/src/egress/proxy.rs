//! [`Egress`]: serves forward-proxy requests on any listener or stream, decides each against the
//! current phase's policy, and moves the bytes. One request per client connection: a `CONNECT`
//! becomes a tunnel, an absolute-form `http://` request is forwarded in origin form with
//! `Connection: close`, and everything else gets a one-line answer from the proxy itself.
//!
//! The policy can be swapped while serving ([`Egress::set_policy`]); a swap ends every
//! connection opened under the previous one, so nothing a setup command opened lives on into
//! the agent's phase. [`Egress::stop`] ends the listener and every connection.

use super::body::{self, COPY_BUF, CopyError, Framing};
use super::counters::{Counted, Counters, HostCounters, Tally};
use super::http::{self, Head, HeadError};
use super::policy::{Policy, Refusal};
use super::resolve::{Resolve, SystemResolver};
use super::target::{Host, Target};
use super::{Decision, Phase, Verdict};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Called with every decision, on the connection's task: hand it on (a bounded channel's
/// `try_send`, an audit row) rather than block.
pub(crate) type AuditHook = Arc<dyn Fn(&Decision) + Send + Sync>;

/// The largest response head accepted from a server (cookies make them larger than requests').
const MAX_RESPONSE_HEAD: usize = 64 * 1024;
/// How long a refused client gets to finish sending before the connection closes.
const LINGER: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// A longer request head is answered 431.
    pub max_head_bytes: usize,
    /// A client that sends no complete head in this time is answered 408.
    pub head_timeout: Duration,
    /// Resolving the name, and then connecting to one of its addresses, each within this.
    pub connect_timeout: Duration,
    /// Connections served at once; past it, new ones wait to be accepted.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head_bytes: 16 * 1024,
            head_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_connections: 256,
        }
    }
}

#[derive(Clone)]
pub(crate) struct Options {
    pub resolver: Arc<dyn Resolve>,
    pub audit: Option<AuditHook>,
    pub limits: Limits,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            resolver: Arc::new(SystemResolver),
            audit: None,
            limits: Limits::default(),
        }
    }
}

/// Something that hands out client connections: a unix socket (the box's forward) or, for
/// tests and local use, a TCP socket.
pub(crate) trait Listener: Send {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

impl Listener for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept(&mut self) -> io::Result<Self::Stream> {
        tokio::net::UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

impl Listener for tokio::net::TcpListener {
    type Stream = TcpStream;
    async fn accept(&mut self) -> io::Result<Self::Stream> {
        let (stream, _) = tokio::net::TcpListener::accept(self).await?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

/// One environment's egress proxy. Cheap to clone; every clone is the same proxy.
#[derive(Clone)]
pub(crate) struct Egress {
    shared: Arc<Shared>,
}

struct Shared {
    active: watch::Sender<Active>,
    counters: Counters,
    resolver: Arc<dyn Resolve>,
    audit: Option<AuditHook>,
    limits: Limits,
    stop: CancellationToken,
    slots: Arc<Semaphore>,
}

/// The policy in force and the token that ends the connections opened under it.
#[derive(Clone)]
struct Active {
    phase: Phase,
    policy: Arc<Policy>,
    cut: CancellationToken,
}

/// The proxy's own answer to a request it does not carry out.
struct Reply {
    status: u16,
    reason: std::borrow::Cow<'static, str>,
    /// `host:port` for `X-Skiff-Egress-Refused`.
    refused: Option<String>,
    body: String,
}

impl Reply {
    fn new(status: u16, reason: &'static str, body: String) -> Reply {
        Reply {
            status,
            reason: reason.into(),
            refused: None,
            body,
        }
    }
}

/// What the client asked for.
enum Request {
    Connect(Target),
    Forward {
        target: Target,
        origin_form: String,
        framing: Framing,
    },
}

impl Egress {
    /// A proxy that starts in `phase` under `policy`. It serves nothing until [`Egress::serve`]
    /// or [`Egress::serve_connection`] is called.
    pub(crate) fn new(phase: Phase, policy: Policy, options: Options) -> Egress {
        let stop = CancellationToken::new();
        let active = Active {
            phase,
            policy: Arc::new(policy),
            cut: stop.child_token(),
        };
        Egress {
            shared: Arc::new(Shared {
                active: watch::Sender::new(active),
                counters: Counters::default(),
                resolver: options.resolver,
                audit: options.audit,
                limits: options.limits,
                slots: Arc::new(Semaphore::new(options.limits.max_connections.max(1))),
                stop,
            }),
        }
    }

    /// From the next request on, `policy` decides and counts go to `phase`. Every connection
    /// opened under the previous policy is cut.
    pub(crate) fn set_policy(&self, phase: Phase, policy: Policy) {
        let next = Active {
            phase,
            policy: Arc::new(policy),
            cut: self.shared.stop.child_token(),
        };
        let previous = self.shared.active.send_replace(next);
        previous.cut.cancel();
    }

    pub(crate) fn phase(&self) -> Phase {
        self.shared.active.borrow().phase
    }

    /// Stops serving: [`Egress::serve`] stops accepting and returns once every connection is
    /// closed; open tunnels and requests are cut. Final.
    pub(crate) fn stop(&self) {
        self.shared.stop.cancel();
    }

    /// Counts so far, by phase then host.
    pub(crate) fn counters(&self) -> Vec<HostCounters> {
        self.shared.counters.snapshot()
    }

    /// Accepts and serves connections until [`Egress::stop`]; returns when every connection it
    /// accepted has ended. Accept errors are logged and retried.
    pub(crate) async fn serve<L: Listener>(&self, mut listener: L) {
        let stop = self.shared.stop.clone();
        let mut tasks = JoinSet::new();
        loop {
            let permit = tokio::select! {
                _ = stop.cancelled() => break,
                permit = self.shared.slots.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
            let accepted = tokio::select! {
                _ = stop.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok(stream) => {
                    let this = self.clone();
                    tasks.spawn(async move { this.run(stream, permit).await });
                }
                Err(error) => {
                    tracing::warn!(%error, "egress proxy: accept failed");
                    // Errors like EMFILE last until a connection closes; retrying at once
                    // would spin.
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
            }
            while tasks.try_join_next().is_some() {}
        }
        drop(listener);
        while tasks.join_next().await.is_some() {}
    }

    /// Serves one client connection (one request) from any stream, e.g. an SSH channel.
    #[cfg(test)]
    pub(crate) async fn serve_connection<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let permit = tokio::select! {
            _ = self.shared.stop.cancelled() => return,
            permit = self.shared.slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        self.run(stream, permit).await;
    }

    async fn run<S>(&self, client: S, _permit: OwnedSemaphorePermit)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        tokio::select! {
            _ = self.shared.stop.cancelled() => {}
            _ = self.handle(client) => {}
        }
    }

    /// Reads and checks the request head, then carries the request under the policy in force
    /// (and only as long as it is).
    async fn handle<S>(&self, mut client: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let limits = self.shared.limits;
        let mut buf = Vec::with_capacity(4096);
        let read = tokio::time::timeout(
            limits.head_timeout,
            http::read_head(&mut client, &mut buf, limits.max_head_bytes),
        )
        .await;
        let head_len = match read {
            Ok(Ok(n)) => n,
            Ok(Err(HeadError::Closed | HeadError::Io(_))) => return,
            Ok(Err(HeadError::TooLarge)) => {
                let body = format!(
                    "skiff egress: the request head is larger than {} bytes",
                    limits.max_head_bytes
                );
                let reply = Reply::new(431, "Request Header Fields Too Large", body);
                return send_reply(&mut client, reply).await;
            }
            Err(_) => {
                let body = format!(
                    "skiff egress: no complete request head within {}s",
                    limits.head_timeout.as_secs()
                );
                return send_reply(&mut client, Reply::new(408, "Request Timeout", body)).await;
            }
        };
        let parsed = Head::parse_request(&buf[..head_len])
            .and_then(|head| classify(&head).map(|request| (head, request)));
        let (head, request) = match parsed {
            Ok(parsed) => parsed,
            Err(why) => {
                let body = format!("skiff egress: bad request: {why}");
                return send_reply(&mut client, Reply::new(400, "Bad Request", body)).await;
            }
        };
        let active = self.shared.active.borrow().clone();
        tokio::select! {
            _ = active.cut.cancelled() => {}
            _ = self.carry(&active, &mut client, &head, &buf[head_len..], request) => {}
        }
    }

    /// Decides, connects and moves the bytes of one request.
    async fn carry<S>(
        &self,
        active: &Active,
        client: &mut S,
        head: &Head<'_>,
        already: &[u8],
        request: Request,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let target = match &request {
            Request::Connect(target) | Request::Forward { target, .. } => target,
        };
        let tally = self
            .shared
            .counters
            .tally(active.phase, &target.host.to_string());
        let upstream = match self.open(active, target, &tally).await {
            Ok(upstream) => upstream,
            Err(reply) => return send_reply(client, reply).await,
        };
        let outcome = match &request {
            Request::Connect(_) => tunnel(client, upstream, already, tally).await,
            Request::Forward {
                target,
                origin_form,
                framing,
            } => {
                let rewritten = request_head(head, target, origin_form);
                let head_method = head.start[0] == "HEAD";
                forward(
                    client,
                    upstream,
                    &rewritten,
                    already,
                    *framing,
                    head_method,
                    tally,
                )
                .await
            }
        };
        if let Err(error) = outcome {
            tracing::debug!(%target, %error, "egress proxy: connection ended with an error");
        }
    }

    /// The decision and the upstream connection: the name on the list, its addresses
    /// resolved once and checked, a connection to one of exactly those addresses.
    async fn open(
        &self,
        active: &Active,
        target: &Target,
        tally: &Tally,
    ) -> Result<TcpStream, Reply> {
        let timeout = self.shared.limits.connect_timeout;
        let policy = &active.policy;
        let listed = match policy.lookup(target) {
            Ok(listed) => listed,
            Err(refusal) => return Err(self.refuse(active, target, tally, refusal)),
        };
        let addrs = match &target.host {
            Host::Ip(ip) => vec![*ip],
            Host::Name(name) => {
                let unresolved = |why: String| {
                    Reply::new(
                        502,
                        "Bad Gateway",
                        format!("skiff egress: cannot resolve {name}: {why}"),
                    )
                };
                match tokio::time::timeout(timeout, self.shared.resolver.resolve(name)).await {
                    Ok(Ok(addrs)) if !addrs.is_empty() => addrs,
                    Ok(Ok(_)) => return Err(unresolved("no addresses".into())),
                    Ok(Err(e)) => return Err(unresolved(e.to_string())),
                    Err(_) => return Err(unresolved(format!("no answer within {timeout:?}"))),
                }
            }
        };
        if let Err(refusal) = policy.check_addresses(&listed, target.port, &addrs) {
            return Err(self.refuse(active, target, tally, refusal));
        }
        self.audit(active, target, Verdict::Allowed { rule: listed.rule });
        let upstream = match tokio::time::timeout(timeout, connect_any(&addrs, target.port)).await {
            Ok(Ok(upstream)) => upstream,
            Ok(Err(e)) => {
                let body = format!("skiff egress: cannot reach {target}: {e}");
                return Err(Reply::new(502, "Bad Gateway", body));
            }
            Err(_) => {
                let body =
                    format!("skiff egress: cannot reach {target}: no answer within {timeout:?}");
                return Err(Reply::new(502, "Bad Gateway", body));
            }
        };
        tally.connected();
        Ok(upstream)
    }

    fn refuse(&self, active: &Active, target: &Target, tally: &Tally, refusal: Refusal) -> Reply {
        tally.refused();
        let body = active.policy.refusal_message(target, &refusal);
        tracing::info!(phase = ?active.phase, key = active.policy.key(), %target, "egress refused");
        self.audit(active, target, Verdict::Refused { reason: refusal });
        // Clients of a CONNECT tunnel (pip, curl, npm) show the status line, never the body:
        // the reason phrase carries the same sentence, so whoever reads the log can act on it.
        let reason = format!("Forbidden: {}", phrase(&body)).into();
        Reply {
            status: 403,
            reason,
            refused: Some(target.to_string()),
            body,
        }
    }

    fn audit(&self, active: &Active, target: &Target, verdict: Verdict) {
        if let Some(hook) = &self.shared.audit {
            hook(&Decision {
                phase: active.phase,
                key: active.policy.key().to_owned(),
                host: target.host.to_string(),
                port: target.port,
                verdict,
            });
        }
    }
}

/// `text` as a status line's reason phrase may hold it: visible ASCII and spaces only.
fn phrase(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// CONNECT (authority form) or an absolute-form `http://` request.
fn classify(head: &Head<'_>) -> Result<Request, &'static str> {
    let [method, target, _] = head.start;
    if method == "CONNECT" {
        return Target::parse(target, None)
            .map(Request::Connect)
            .map_err(|_| "CONNECT needs host:port");
    }
    let rest = match target.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => {
            return Err(
                "https:// URLs go through CONNECT (set https_proxy), not as a plain request",
            );
        }
        Some(_) => return Err("only http:// URLs and CONNECT are proxied"),
        None => {
            return Err("this is a proxy: send an absolute URL (GET http://host/path) or CONNECT");
        }
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.contains('@') {
        return Err("a URL with credentials in it is not forwarded");
    }
    let path = path.split('#').next().unwrap_or("");
    if path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err("the URL holds a control character");
    }
    let origin_form = match path.as_bytes().first() {
        None => "/".to_owned(),
        Some(b'?') => format!("/{path}"),
        Some(_) => path.to_owned(),
    };
    let target = Target::parse(authority, Some(80)).map_err(|_| "the URL's host is not valid")?;
    Ok(Request::Forward {
        target,
        origin_form,
        framing: body::request_framing(head)?,
    })
}

/// The request as the server gets it: origin form, `Host` from the URL, no hop-by-hop or
/// `Proxy-*` fields, and `Connection: close`.
fn request_head(head: &Head<'_>, target: &Target, origin_form: &str) -> Vec<u8> {
    let authority = if target.port == 80 {
        target.host.to_string()
    } else {
        target.to_string()
    };
    let mut out = format!(
        "{} {origin_form} HTTP/1.1\r\nHost: {authority}\r\n",
        head.start[0]
    );
    for (name, value) in head.end_to_end(&["host"]) {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

async fn connect_any(addrs: &[IpAddr], port: u16) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address to connect to");
    for &ip in addrs {
        match TcpStream::connect(SocketAddr::new(ip, port)).await {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

async fn tunnel<S>(
    client: &mut S,
    upstream: TcpStream,
    already: &[u8],
    tally: Arc<Tally>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    client
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await?;
    client.flush().await?;
    let mut upstream = Counted::new(upstream, tally);
    if !already.is_empty() {
        upstream.write_all(already).await?;
    }
    tokio::io::copy_bidirectional_with_sizes(client, &mut upstream, COPY_BUF, COPY_BUF).await?;
    Ok(())
}

/// Sends the rewritten request and its body while relaying the response; done when the
/// response is (a server may answer before it has read the whole body).
async fn forward<S>(
    client: &mut S,
    mut upstream: TcpStream,
    request_head: &[u8],
    already: &[u8],
    framing: Framing,
    head_method: bool,
    tally: Arc<Tally>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (up_read, up_write) = upstream.split();
    let mut up_read = Counted::new(up_read, tally.clone());
    let mut up_write = Counted::new(up_write, tally);
    up_write.write_all(request_head).await?;
    let (mut client_read, mut client_write) = tokio::io::split(client);
    {
        let request_body = body::copy_body(already, &mut client_read, &mut up_write, framing);
        let response = relay_response(&mut up_read, &mut client_write, head_method);
        tokio::pin!(request_body, response);
        let mut body_done = false;
        loop {
            tokio::select! {
                sent = &mut request_body, if !body_done => match sent {
                    Ok(()) => body_done = true,
                    // The client went away or broke its framing: the server would wait forever.
                    Err(CopyError::Source(e)) => return Err(e),
                    // The server stopped reading; it may still answer (413, 401…).
                    Err(CopyError::Sink(_)) => body_done = true,
                },
                relayed = &mut response => {
                    relayed?;
                    break;
                }
            }
        }
    }
    client_write.shutdown().await
}

/// Relays interim (1xx) heads as they are, then the final head rewritten (`Connection:
/// close`, no hop-by-hop fields) and its body. A server that does not answer in HTTP/1.x gets
/// the client a 502, if nothing has been relayed yet.
async fn relay_response<R, W>(up: &mut R, client: &mut W, head_method: bool) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = Vec::with_capacity(4096);
    let mut relayed = false;
    loop {
        let bad = |why: &str| -> io::Error {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the server's response: {why}"),
            )
        };
        let head_len = match http::read_head(up, &mut buf, MAX_RESPONSE_HEAD).await {
            Ok(n) => n,
            Err(e) => {
                let why = match e {
                    HeadError::Closed => {
                        "the server closed the connection without a response".to_owned()
                    }
                    HeadError::TooLarge => {
                        format!("the response head is larger than {MAX_RESPONSE_HEAD} bytes")
                    }
                    HeadError::Io(e) => e.to_string(),
                };
                if !relayed {
                    let body = format!("skiff egress: bad response from the server: {why}");
                    client
                        .write_all(&http::response(502, "Bad Gateway", &[], &body))
                        .await?;
                }
                return Err(bad(&why));
            }
        };
        let head = Head::parse(&buf[..head_len]).ok();
        let Some((head, status)) = head.and_then(|h| h.status().map(|s| (h, s))) else {
            if !relayed {
                let body = "skiff egress: bad response from the server: not HTTP/1.x";
                client
                    .write_all(&http::response(502, "Bad Gateway", &[], body))
                    .await?;
            }
            return Err(bad("not HTTP/1.x"));
        };
        if (100..200).contains(&status) && status != 101 {
            client.write_all(&buf[..head_len]).await?;
            client.flush().await?;
            relayed = true;
            buf.drain(..head_len);
            continue;
        }
        let framing = body::response_framing(status, head_method, &head).map_err(bad)?;
        let mut out = format!("HTTP/1.1 {status} {}\r\n", head.start[2]);
        for (name, value) in head.end_to_end(&[]) {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str("Connection: close\r\n\r\n");
        client.write_all(out.as_bytes()).await?;
        return match body::copy_body(&buf[head_len..], up, client, framing).await {
            Ok(()) => Ok(()),
            Err(CopyError::Source(e) | CopyError::Sink(e)) => Err(e),
        };
    }
}

/// Writes the proxy's own answer and closes, reading (and dropping) what the client still
/// sends for a moment: closing a socket with unread bytes resets it, and the client could
/// lose the answer.
async fn send_reply<S>(client: &mut S, reply: Reply)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let extra: Vec<(&str, &str)> = reply
        .refused
        .as_deref()
        .map(|target| ("X-Skiff-Egress-Refused", target))
        .into_iter()
        .collect();
    let bytes = http::response(reply.status, &reply.reason, &extra, &reply.body);
    if client.write_all(&bytes).await.is_err() || client.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut total = 0;
        while total < 64 * 1024 {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    };
    // Best effort by design: the answer is written; the drain only keeps it from being reset.
    let _ = tokio::time::timeout(LINGER, drain).await;
}
