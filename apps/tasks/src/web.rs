//! The live page's files: a Vite build in a directory (`apps/tasks/web/dist` by default),
//! served as they are, with `index.html` for the page's own paths; while the page is not
//! built, `/` answers a page that says how to build it.

use std::path::{Path, PathBuf};

use axum::handler::HandlerWithoutStateExt;
use axum::http::{header, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::Router;
use tower_http::services::ServeDir;

/// The command that builds the live page, from the repository's root.
pub const BUILD_COMMAND: &str = "npm ci && npm run build -w apps/tasks/web";

/// The live page's directory, relative to the repository's root.
pub const DEFAULT_DIR: &str = "apps/tasks/web/dist";

/// The directory of the live page's files: `configured` when given; otherwise
/// [`DEFAULT_DIR`] under the current directory, or else `web/dist` of this crate's
/// sources (so that `cargo run` from anywhere in a checkout finds the build). Answers the
/// former when neither holds an `index.html` yet.
pub fn dir(configured: Option<PathBuf>) -> PathBuf {
    if let Some(dir) = configured {
        return dir;
    }
    let here = PathBuf::from(DEFAULT_DIR);
    let sources = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("web")
        .join("dist");
    if !here.join("index.html").is_file() && sources.join("index.html").is_file() {
        return sources;
    }
    here
}

/// A router with no routes whose fallback serves the files of `dir`: a file as it is, the
/// page's `index.html` for a path that names no file and has no extension (the page's own
/// routes), 404 for other missing files and for anything under `/api`, `/gateway` and
/// `/rpc`. Whether the page is built is checked at each request: a build made while the
/// server runs is served at once.
pub fn files(dir: PathBuf) -> Router {
    let index = dir.join("index.html");
    let fallback = move |uri: Uri| {
        let index = index.clone();
        async move { page_or_not_found(&index, uri.path()).await }
    };
    Router::new().fallback_service(
        ServeDir::new(dir)
            .append_index_html_on_directories(true)
            .fallback(fallback.into_service()),
    )
}

/// Not a file of the build: the page itself, the build instructions, or 404.
async fn page_or_not_found(index: &Path, path: &str) -> Response {
    let reserved = ["/api", "/gateway", "/rpc"]
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}/")));
    let last = path.rsplit('/').next().unwrap_or_default();
    if reserved || last.contains('.') {
        return StatusCode::NOT_FOUND.into_response();
    }
    match tokio::fs::read(index).await {
        Ok(page) => (
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            page,
        )
            .into_response(),
        Err(_) if path == "/" => Html(not_built(index)).into_response(),
        Err(_) => StatusCode::NOT_FOUND.into_response(),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The page that says how to build the live page. It does not show where the server looked
/// (a path of the server's disk is not a visitor's business): the log says it.
fn not_built(index: &Path) -> String {
    tracing::warn!(index = %index.display(), "the live page is not built");
    let build = escape(BUILD_COMMAND);
    format!(
        r#"<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Tasks</title></head>
<body>
<h1>Tasks</h1>
<p>The live page is not built: there is no <code>index.html</code> in the directory this
server serves it from (its log says which). Build it from the repository's root, then
reload:</p>
<pre>{build}</pre>
<p>(or point <code>tasks serve --web DIR</code> at a build). Meanwhile the API answers at
<a href="/api/tasks">/api/tasks</a> (<a href="/api/openapi.json">OpenAPI</a>), the compute
methods at <code>/gateway/TasksService.&lt;method&gt;?args=[...]</code>, and the protocol
over WebSocket at <code>/rpc</code>.</p>
</body>
</html>
"#
    )
}
