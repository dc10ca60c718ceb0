//! The Control UI's static files, compiled into the binary (no front-end build step: plain
//! HTML, CSS and JavaScript modules), and the security headers every response carries.

use axum::extract::{Path, Request};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Every file the UI is made of, by name under `/assets/`.
const FILES: &[(&str, &str, &str)] = &[
    (
        "app.css",
        "text/css; charset=utf-8",
        include_str!("../../ui/app.css"),
    ),
    ("app.js", JS, include_str!("../../ui/app.js")),
    ("api.js", JS, include_str!("../../ui/api.js")),
    ("dom.js", JS, include_str!("../../ui/dom.js")),
    ("markdown.js", JS, include_str!("../../ui/markdown.js")),
    ("sidebar.js", JS, include_str!("../../ui/sidebar.js")),
    ("chat.js", JS, include_str!("../../ui/chat.js")),
    ("changes.js", JS, include_str!("../../ui/changes.js")),
    ("newsession.js", JS, include_str!("../../ui/newsession.js")),
    ("groups.js", JS, include_str!("../../ui/groups.js")),
    (
        "environments.js",
        JS,
        include_str!("../../ui/environments.js"),
    ),
    (
        "icon.svg",
        "image/svg+xml",
        include_str!("../../ui/icon.svg"),
    ),
];
const JS: &str = "text/javascript; charset=utf-8";
const INDEX: &str = include_str!("../../ui/index.html");

/// Scripts, styles, images and connections from this origin only (and images a tool returned,
/// shown from `data:` URLs); no inline script or style, no framing, no plugins, forms post only
/// here.
const CSP: &str = "default-src 'self'; img-src 'self' data:; base-uri 'none'; object-src 'none'; \
                   frame-ancestors 'none'; form-action 'self'";

pub(crate) async fn index() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Always revalidate: a new binary brings new files under the same names.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX,
    )
        .into_response()
}

pub(crate) async fn asset(Path(name): Path<String>) -> Response {
    match FILES.iter().find(|(n, _, _)| *n == name) {
        Some((_, content_type, body)) => (
            [
                (header::CONTENT_TYPE, *content_type),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            *body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no such asset").into_response(),
    }
}

/// Adds the security headers to every response of the gateway (API answers included: a JSON
/// error opened in a tab gets the same policy as the UI).
pub(crate) async fn security_headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let headers = resp.headers_mut();
    let set: [(HeaderName, &str); 5] = [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // Keeps a login link's ticket out of any Referer, should one ever be followed onward.
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (
            HeaderName::from_static("cross-origin-opener-policy"),
            "same-origin",
        ),
    ];
    for (name, value) in set {
        headers
            .entry(name)
            .or_insert(HeaderValue::from_static(value));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_asset_holds_inline_script_or_style() {
        // The CSP would block them; catching it here is kinder than a blank page.
        assert!(!INDEX.contains("<style"), "inline <style> in index.html");
        assert!(
            !INDEX.contains(" style="),
            "inline style attribute in index.html"
        );
        assert!(!INDEX.contains("<script>"), "inline <script> in index.html");
        for (name, _, body) in FILES {
            assert!(!body.contains("innerHTML"), "{name} assigns innerHTML");
        }
    }
}
