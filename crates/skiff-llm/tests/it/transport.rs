//! Transport behaviour the HTTP adapters share (HTTP errors, retries, timeouts, dropped and
//! refused connections, cancellation, API keys, request bodies), written once and run for each
//! wire format through `transport_tests!`.

use crate::{catalog, error, request, run, text};
use skiff_llm::Catalog;
use skiff_protocol::model::{ModelErrorKind, ModelEvent, StopReason};
use skiff_test_support::{FakeProvider, FakeResponse};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// What differs between the wire formats, as far as the transport tests care.
pub struct Wire {
    /// The provider's name in the configuration, and the `api` it uses.
    pub provider: &'static str,
    pub api: &'static str,
    pub model: &'static str,
    /// A complete response streaming `Hello world`.
    pub hello: fn() -> Vec<String>,
    /// The start of a response, streaming `Hello` and no end.
    pub partial: fn() -> Vec<String>,
    /// An error body as this provider writes it, with `message`.
    pub error_body: fn(&str) -> String,
    /// The request header carrying the API key, and its value for a key.
    pub key_header: &'static str,
    pub key_value: fn(&str) -> String,
}

impl Wire {
    pub fn catalog(&self, base_url: &str, extra: &str) -> Catalog {
        catalog(&format!(
            "[{}]\napi = \"{}\"\nbase_url = \"{base_url}\"\n{extra}\n",
            self.provider, self.api
        ))
    }
}

/// The test process's own `PATH` doubles as an API key: reading a variable that is already set
/// avoids mutating the environment, which is unsafe while other test threads run.
pub fn env_key() -> String {
    std::env::var("PATH").unwrap()
}

pub async fn rejected_names_status_and_message(wire: &Wire) {
    let body = (wire.error_body)("max_tokens: must be at most 8192");
    let fake = FakeProvider::start(vec![FakeResponse::status(400, &[], &body)]).await;
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Rejected);
    assert!(
        message.contains(&format!("provider `{}`", wire.provider)),
        "{message}"
    );
    assert!(message.contains("400"), "{message}");
    assert!(
        message.contains("max_tokens: must be at most 8192"),
        "{message}"
    );
}

pub async fn server_error_is_provider_failed(wire: &Wire) {
    let body = (wire.error_body)("internal failure");
    let fake = FakeProvider::start(vec![FakeResponse::status(500, &[], &body)]).await;
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::ProviderFailed);
    assert!(
        message.contains("500") && message.contains("internal failure"),
        "{message}"
    );
}

pub async fn short_retry_after_is_retried(wire: &Wire) {
    let busy = FakeResponse::status(
        429,
        &[("retry-after", "0")],
        &(wire.error_body)("slow down"),
    );
    let fake = FakeProvider::start(vec![busy, FakeResponse::sse((wire.hello)())]).await;
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    assert_eq!(text(&events), "Hello world");
    assert!(matches!(events.last(), Some(ModelEvent::Done { .. })));
    assert_eq!(fake.requests().len(), 2);
}

pub async fn retries_stop_at_max_retries(wire: &Wire) {
    let busy = || FakeResponse::status(529, &[("retry-after", "0")], "");
    let fake = FakeProvider::start(vec![busy(), busy(), FakeResponse::sse((wire.hello)())]).await;
    let catalog = wire.catalog(&fake.base_url(), "max_retries = 1");
    let events = run(&catalog, request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::RateLimited);
    assert!(
        message.contains("529") && message.contains("after 1 retry"),
        "{message}"
    );
    assert_eq!(fake.requests().len(), 2);
}

pub async fn long_retry_after_is_reported_at_once(wire: &Wire) {
    let busy = FakeResponse::status(
        429,
        &[("retry-after", "120")],
        &(wire.error_body)("slow down"),
    );
    let fake = FakeProvider::start(vec![busy]).await;
    let started = Instant::now();
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::RateLimited);
    assert!(message.contains("120"), "{message}");
    assert_eq!(fake.requests().len(), 1);
}

pub async fn malformed_event_is_reported(wire: &Wire) {
    let events = vec!["data: {this is not json\n\n".to_owned()];
    let fake = FakeProvider::start(vec![FakeResponse::sse(events)]).await;
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::MalformedResponse);
    assert!(
        message.contains(&format!("provider `{}`", wire.provider)),
        "{message}"
    );
    assert!(message.contains("{this is not json"), "{message}");
}

pub async fn dropped_connection_is_a_connection_error(wire: &Wire) {
    let fake = FakeProvider::start(vec![FakeResponse::sse_then_drop((wire.partial)())]).await;
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    assert_eq!(text(&events), "Hello");
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Connection);
    assert!(
        message.contains("connection closed before the response finished"),
        "{message}"
    );
}

pub async fn clean_close_before_the_end_is_a_connection_error(wire: &Wire) {
    let fake = FakeProvider::start(vec![FakeResponse::sse((wire.partial)())]).await;
    let events = run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Connection);
    assert!(
        message.contains("connection closed before the response finished"),
        "{message}"
    );
}

pub async fn stall_times_out(wire: &Wire) {
    let fake = FakeProvider::start(vec![FakeResponse::stall()]).await;
    let started = Instant::now();
    let catalog = wire.catalog(&fake.base_url(), "idle_timeout_s = 1");
    let events = run(&catalog, request(wire.model)).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Timeout);
    assert!(
        message.contains("1s") && message.contains("idle_timeout_s"),
        "{message}"
    );
}

pub async fn refused_connection_is_a_connection_error(wire: &Wire) {
    // A port that was just free: nothing listens there once the listener is dropped.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let catalog = wire.catalog(&format!("http://127.0.0.1:{port}"), "");
    let events = run(&catalog, request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Connection);
    assert!(message.contains("could not reach provider"), "{message}");
    assert!(message.contains(&port.to_string()), "{message}");
}

pub async fn cancellation_ends_the_stream_promptly(wire: &Wire) {
    // Two seconds between events: a stream that ignored the cancel would still deliver the
    // whole "Hello world" (asserted against below).
    let slow = FakeResponse::sse((wire.hello)()).with_delay(Duration::from_secs(2));
    let fake = FakeProvider::start(vec![slow]).await;
    let catalog = wire.catalog(&fake.base_url(), "");
    let cancel = CancellationToken::new();
    let stream = catalog.stream(request(wire.model), None, cancel.clone());
    let events = crate::collect_cancelling_after_first(stream, cancel).await;
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Done {
            stop_reason: StopReason::Cancelled
        })
    );
    assert_ne!(text(&events), "Hello world");
}

pub async fn api_key_is_sent_and_never_leaked(wire: &Wire) {
    let key = env_key();
    let body = (wire.error_body)(&format!("invalid x-api-key {key}"));
    let fake = FakeProvider::start(vec![FakeResponse::status(401, &[], &body)]).await;
    let catalog = wire.catalog(&fake.base_url(), "api_key_env = \"PATH\"");
    let events = run(&catalog, request(wire.model)).await;
    let requests = fake.requests();
    assert_eq!(
        requests[0].header(wire.key_header),
        Some((wire.key_value)(&key).as_str())
    );
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Rejected);
    assert!(!message.contains(&key), "{message}");
    assert!(
        message.contains("[redacted]") && message.contains("PATH"),
        "{message}"
    );
}

pub async fn no_key_header_without_api_key_env(wire: &Wire) {
    let fake = FakeProvider::start(vec![FakeResponse::sse((wire.hello)())]).await;
    run(&wire.catalog(&fake.base_url(), ""), request(wire.model)).await;
    assert_eq!(fake.requests()[0].header(wire.key_header), None);
}

pub async fn missing_key_is_a_configuration_error(wire: &Wire) {
    let var = "SKIFF_TEST_KEY_THAT_IS_NEVER_SET";
    assert!(std::env::var_os(var).is_none());
    let fake = FakeProvider::start(vec![]).await;
    let catalog = wire.catalog(&fake.base_url(), &format!("api_key_env = \"{var}\""));
    let events = run(&catalog, request(wire.model)).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Configuration);
    assert_eq!(
        message,
        format!(
            "provider `{}` needs an API key: set {var} in the gateway's environment",
            wire.provider
        )
    );
    assert!(fake.requests().is_empty());
}

pub async fn identical_requests_send_identical_bodies(wire: &Wire) {
    let fake = FakeProvider::start(vec![
        FakeResponse::sse((wire.hello)()),
        FakeResponse::sse((wire.hello)()),
    ])
    .await;
    let catalog = wire.catalog(&fake.base_url(), "");
    run(&catalog, request(wire.model)).await;
    run(&catalog, request(wire.model)).await;
    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].body, requests[1].body);
    assert_eq!(requests[0].method, "POST");
    assert_eq!(requests[0].header("content-type"), Some("application/json"));
}

/// Generates one `#[tokio::test]` per shared transport scenario for `$wire`.
#[macro_export]
macro_rules! transport_tests {
    ($wire:expr) => {
        $crate::transport_tests!(@tests $wire;
            rejected_names_status_and_message,
            server_error_is_provider_failed,
            short_retry_after_is_retried,
            retries_stop_at_max_retries,
            long_retry_after_is_reported_at_once,
            malformed_event_is_reported,
            dropped_connection_is_a_connection_error,
            clean_close_before_the_end_is_a_connection_error,
            stall_times_out,
            refused_connection_is_a_connection_error,
            cancellation_ends_the_stream_promptly,
            api_key_is_sent_and_never_leaked,
            no_key_header_without_api_key_env,
            missing_key_is_a_configuration_error,
            identical_requests_send_identical_bodies,
        );
    };
    (@tests $wire:expr; $($name:ident,)*) => {
        $(
            #[tokio::test]
            async fn $name() {
                $crate::transport::$name(&$wire).await;
            }
        )*
    };
}
