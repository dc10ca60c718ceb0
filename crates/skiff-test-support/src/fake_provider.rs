//! A fake model provider: an HTTP/1.1 server on a raw `TcpListener`, so that it can misbehave in
//! ways a real framework would not allow (drop a response halfway, stall after the headers).
//!
//! One canned response per request, in order, or a response computed from the request
//! ([`FakeProvider::start_with`]); every request is recorded. No keep-alive: each response says
//! `Connection: close`.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

/// What the fake answers to one request.
#[derive(Clone, Debug)]
pub enum FakeResponse {
    /// `200` with a `text/event-stream` body, each event written and flushed on its own,
    /// `delay` apart.
    Sse {
        events: Vec<String>,
        delay: Duration,
    },
    /// Like `Sse`, then the socket is closed without finishing the chunked body.
    SseThenDrop {
        events: Vec<String>,
        delay: Duration,
    },
    /// A complete response with this status, extra headers and body.
    Status {
        code: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// `200` event-stream headers, then silence until the fake is dropped.
    Stall,
}

impl FakeResponse {
    /// Each element is one raw SSE event (see `openai_sse` and `anthropic_sse`).
    pub fn sse(events: Vec<String>) -> Self {
        FakeResponse::Sse {
            events,
            delay: Duration::ZERO,
        }
    }

    pub fn sse_then_drop(events: Vec<String>) -> Self {
        FakeResponse::SseThenDrop {
            events,
            delay: Duration::ZERO,
        }
    }

    pub fn status(code: u16, headers: &[(&str, &str)], body: &str) -> Self {
        FakeResponse::Status {
            code,
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.to_owned(),
        }
    }

    pub fn stall() -> Self {
        FakeResponse::Stall
    }

    /// Pauses `delay` between streamed events (no effect on other responses).
    pub fn with_delay(mut self, new_delay: Duration) -> Self {
        if let FakeResponse::Sse { delay, .. } | FakeResponse::SseThenDrop { delay, .. } = &mut self
        {
            *delay = new_delay;
        }
        self
    }
}

/// A request as the fake received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// Names lowercased.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl RecordedRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

/// The running fake; it stops (and drops every open connection) when dropped.
pub struct FakeProvider {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Told each time a request has been received in full.
    arrived: Arc<Notify>,
    server: JoinHandle<()>,
}

/// Computes the answer to a request (given every request so far, the newest last).
type Responder = Box<dyn FnMut(&[RecordedRequest]) -> FakeResponse + Send>;

#[derive(Default)]
struct State {
    requests: Vec<RecordedRequest>,
    responses: VecDeque<FakeResponse>,
    responder: Option<Responder>,
}

impl FakeProvider {
    pub async fn start(responses: Vec<FakeResponse>) -> FakeProvider {
        Self::serve_state(State {
            requests: Vec::new(),
            responses: responses.into(),
            responder: None,
        })
        .await
    }

    /// A fake whose answers `responder` computes from the requests received so far (the one
    /// to answer last), for servers whose answer depends on what was asked.
    pub async fn start_with(
        responder: impl FnMut(&[RecordedRequest]) -> FakeResponse + Send + 'static,
    ) -> FakeProvider {
        Self::serve_state(State {
            responder: Some(Box::new(responder)),
            ..State::default()
        })
        .await
    }

    async fn serve_state(state: State) -> FakeProvider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(state));
        let arrived = Arc::new(Notify::new());
        let server = tokio::spawn(serve(listener, Arc::clone(&state), Arc::clone(&arrived)));
        FakeProvider {
            addr,
            state,
            arrived,
            server,
        }
    }

    /// `http://127.0.0.1:<port>`, without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Waits until `count` requests have been received in full (and so are being answered):
    /// the event a test awaits before it acts on a call in flight.
    pub async fn wait_for_requests(&self, count: usize) {
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            // Registered before the count is read, so a request that lands in between wakes us.
            arrived.as_mut().enable();
            if self.state.lock().unwrap().requests.len() >= count {
                return;
            }
            arrived.await;
        }
    }
}

impl Drop for FakeProvider {
    fn drop(&mut self) {
        // Aborting the server drops its JoinSet, which aborts every connection task.
        self.server.abort();
    }
}

async fn serve(listener: TcpListener, state: Arc<Mutex<State>>, arrived: Arc<Notify>) {
    let mut connections = JoinSet::new();
    while let Ok((socket, _)) = listener.accept().await {
        while connections.try_join_next().is_some() {}
        connections.spawn(handle(socket, Arc::clone(&state), Arc::clone(&arrived)));
    }
}

async fn handle(mut socket: TcpStream, state: Arc<Mutex<State>>, arrived: Arc<Notify>) {
    let Some(request) = read_request(&mut socket).await else {
        return;
    };
    // Responses go to requests in the order they were received in full.
    let response = {
        let mut state = state.lock().unwrap();
        state.requests.push(request);
        let number = state.requests.len();
        let state = &mut *state;
        if let Some(responder) = &mut state.responder {
            responder(&state.requests)
        } else {
            state.responses.pop_front().unwrap_or_else(|| {
                let body = format!("FakeProvider: no response left for request {number}");
                FakeResponse::status(500, &[], &body)
            })
        }
    };
    arrived.notify_waiters();
    respond(socket, response).await;
}

async fn read_request(socket: &mut TcpStream) -> Option<RecordedRequest> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let method = request_line.next()?.to_owned();
    let path = request_line.next()?.to_owned();
    let headers: BTreeMap<String, String> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    let length: usize = headers
        .get("content-length")
        .map_or(0, |v| v.parse().unwrap());
    let mut body = buf.split_off(head_end + 4);
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(RecordedRequest {
        method,
        path,
        headers,
        body,
    })
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";

/// Write errors are ignored: the client hanging up early (cancellation tests) is expected.
async fn respond(mut socket: TcpStream, response: FakeResponse) {
    match response {
        FakeResponse::Sse { events, delay } => {
            if stream_events(&mut socket, &events, delay).await {
                let _ = socket.write_all(b"0\r\n\r\n").await;
                let _ = socket.shutdown().await;
            }
        }
        FakeResponse::SseThenDrop { events, delay } => {
            stream_events(&mut socket, &events, delay).await;
        }
        FakeResponse::Status {
            code,
            headers,
            body,
        } => {
            let mut head = format!(
                "HTTP/1.1 {code} Fake\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
            head.push_str("\r\n");
            head.push_str(&body);
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.shutdown().await;
        }
        FakeResponse::Stall => {
            let _ = socket.write_all(SSE_HEAD.as_bytes()).await;
            std::future::pending::<()>().await;
        }
    }
}

/// Writes the head and each event as one chunk; false once the client is gone.
async fn stream_events(socket: &mut TcpStream, events: &[String], delay: Duration) -> bool {
    if socket.write_all(SSE_HEAD.as_bytes()).await.is_err() {
        return false;
    }
    for (i, event) in events.iter().enumerate() {
        if i > 0 && !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let chunk = format!("{:x}\r\n{event}\r\n", event.len());
        if socket.write_all(chunk.as_bytes()).await.is_err() || socket.flush().await.is_err() {
            return false;
        }
    }
    true
}
