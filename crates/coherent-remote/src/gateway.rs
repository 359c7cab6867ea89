//! The HTTP gateway: exposed compute methods as JSON `GET` endpoints answered from the
//! server's cache, with ETags, and a Server-Sent Events feed per result that reports its
//! invalidation and sends the new value. For clients without the SDK (browsers, curl).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, ETAG, IF_NONE_MATCH};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures::Stream;
use serde::Deserialize;

use crate::server::{Counters, Method, Watched};
use crate::wire::Failure;
use crate::RemoteServer;

/// The default of [`RemoteServer::max_sse_feeds`].
pub const MAX_SSE_FEEDS: usize = 10_000;

/// The default of [`RemoteServer::max_gateway_args_len`], in bytes.
pub const MAX_GATEWAY_ARGS_LEN: usize = 16 * 1024;

/// The default of [`RemoteServer::max_sse_lifetime`]: an hour.
pub const MAX_SSE_LIFETIME: std::time::Duration = std::time::Duration::from_secs(3600);

/// What one gateway lets its clients make the server hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    max_sse_feeds: usize,
    max_args_len: usize,
    max_sse_lifetime: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_sse_feeds: MAX_SSE_FEEDS,
            max_args_len: MAX_GATEWAY_ARGS_LEN,
            max_sse_lifetime: MAX_SSE_LIFETIME,
        }
    }
}

impl RemoteServer {
    /// An axum router over the exposed methods, to nest in an app (e.g. under `/api`):
    ///
    /// - `GET /<name>?args=<JSON array>` (e.g. `/Users.get?args=[42]`; no `args` means `[]`)
    ///   answers the value as JSON from the server's cache, with an `ETag` (a hash of the
    ///   JSON); a request whose `If-None-Match` names it gets `304 Not Modified`.
    /// - `GET /<name>/events?args=...` is a Server-Sent Events stream: a `value` event (its
    ///   `id` is the ETag), then, when that result is invalidated, an `invalidated` event,
    ///   then the new `value`, and so on.
    ///
    /// Unknown names answer 404, arguments that do not decode 400, arguments longer than
    /// [`max_gateway_args_len`](Self::max_gateway_args_len) 414, a feed beyond
    /// [`max_sse_feeds`](Self::max_sse_feeds) 503; error bodies are `{"error": "..."}`.
    /// No route reads a request body. Each open feed holds the result it reports on (so
    /// that it stays cached), which is why their number is bounded.
    pub fn gateway(&self) -> Router {
        let gateway = Arc::new(Gateway {
            methods: self.methods_by_name(),
            limits: self.gateway_limits,
            counters: self.counters.clone(),
        });
        Router::new()
            .route("/{method}", get(value))
            .route("/{method}/events", get(events))
            .with_state(gateway)
    }

    /// How many Server-Sent Events feeds the gateways made from this server may have open
    /// at once, together (default [`MAX_SSE_FEEDS`], 10,000). A request for one more is
    /// answered `503 Service Unavailable` and counted in
    /// [`ServerStats::sse_feeds_refused`](crate::ServerStats::sse_feeds_refused).
    pub fn max_sse_feeds(mut self, n: usize) -> Self {
        self.gateway_limits.max_sse_feeds = n;
        self
    }

    /// How long a Server-Sent Events feed stays open (default [`MAX_SSE_LIFETIME`], an
    /// hour): then the server ends it (between two events: a value being sent is sent
    /// whole), and a browser's `EventSource` opens it again, taking a place under
    /// [`max_sse_feeds`](Self::max_sse_feeds) again. So a feed cannot hold its place,
    /// the result it watches and the HTTP connection under it for ever; ended feeds are
    /// counted in [`ServerStats::sse_feeds_expired`](crate::ServerStats::sse_feeds_expired).
    pub fn max_sse_lifetime(mut self, lifetime: std::time::Duration) -> Self {
        self.gateway_limits.max_sse_lifetime = lifetime;
        self
    }

    /// The longest `args` a gateway request may carry, in bytes of JSON (default
    /// [`MAX_GATEWAY_ARGS_LEN`], 16 KiB); a longer one is answered `414 URI Too Long`
    /// before it is decoded.
    pub fn max_gateway_args_len(mut self, bytes: usize) -> Self {
        self.gateway_limits.max_args_len = bytes;
        self
    }
}

/// What the gateway's handlers share.
struct Gateway {
    methods: HashMap<&'static str, Method>,
    limits: Limits,
    counters: Arc<Counters>,
}

type Methods = Arc<Gateway>;

/// One open feed's place under [`RemoteServer::max_sse_feeds`], given back when the feed
/// is dropped (its client went away, or it ended).
struct FeedSlot(Arc<Counters>);

impl FeedSlot {
    fn take(gateway: &Gateway) -> Option<Self> {
        let open = &gateway.counters.sse_feeds_open;
        let max = gateway.limits.max_sse_feeds;
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| FeedSlot(gateway.counters.clone()))
    }
}

impl Drop for FeedSlot {
    fn drop(&mut self) {
        self.0.sse_feeds_open.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Deserialize)]
struct Args {
    args: Option<String>,
}

/// A strong validator: 64-bit FNV-1a of the JSON text.
fn etag(json: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in json.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("\"{h:016x}\"")
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "error": message }).to_string();
    (status, [(CONTENT_TYPE, "application/json")], body).into_response()
}

async fn fetch(
    gateway: &Gateway,
    name: &str,
    args: Option<String>,
) -> Result<(String, Box<dyn Watched>), Response> {
    if let Some(args) = args
        .as_ref()
        .filter(|a| a.len() > gateway.limits.max_args_len)
    {
        return Err(error(
            StatusCode::URI_TOO_LONG,
            &format!(
                "args is {} bytes long; at most {} are accepted",
                args.len(),
                gateway.limits.max_args_len
            ),
        ));
    }
    let Some(method) = gateway.methods.get(name) else {
        return Err(error(
            StatusCode::NOT_FOUND,
            &format!("no compute method is exposed as {name}"),
        ));
    };
    (method.json)(args.unwrap_or_else(|| "[]".to_owned()))
        .await
        .map_err(|f| match f {
            Failure::BadArguments(e) => error(StatusCode::BAD_REQUEST, &e),
            other => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                &coherent_rpc::RpcError::from(other).to_string(),
            ),
        })
}

async fn value(
    State(methods): State<Methods>,
    Path(name): Path<String>,
    Query(args): Query<Args>,
    headers: HeaderMap,
) -> Response {
    let (json, _) = match fetch(&methods, &name, args.args).await {
        Ok(v) => v,
        Err(response) => return response,
    };
    let tag = etag(&json);
    let matches = headers
        .get_all(IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            let t = t.trim();
            t == "*" || t.trim_start_matches("W/") == tag
        });
    let tag = HeaderValue::from_str(&tag).expect("hex in quotes is a valid header");
    let cache = (CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if matches {
        return (StatusCode::NOT_MODIFIED, [(ETAG, tag), cache]).into_response();
    }
    let content_type = (CONTENT_TYPE, HeaderValue::from_static("application/json"));
    ([(ETAG, tag), cache, content_type], json).into_response()
}

async fn events(
    State(methods): State<Methods>,
    Path(name): Path<String>,
    Query(args): Query<Args>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, Response> {
    let Some(slot) = FeedSlot::take(&methods) else {
        methods
            .counters
            .sse_feeds_refused
            .fetch_add(1, Ordering::Relaxed);
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many event feeds are open on this server; try again later",
        ));
    };
    // The first value is read now, so that a bad request gets an HTTP error, not a stream.
    let first = fetch(&methods, &name, args.args.clone()).await?;
    let state = Feed {
        // `Duration::MAX` (no end) would overflow an instant: a century is as good.
        ends_at: tokio::time::Instant::now()
            + methods
                .limits
                .max_sse_lifetime
                .min(std::time::Duration::from_secs(100 * 365 * 86_400)),
        _slot: slot,
        methods,
        name,
        args: args.args,
        next: Next::Send(first),
    };
    let stream = futures::stream::unfold(state, |mut feed| async move {
        let event = match std::mem::replace(&mut feed.next, Next::Done) {
            Next::Send((json, held)) => {
                let event = Event::default().event("value").id(etag(&json)).data(json);
                feed.next = Next::Watch(held);
                event
            }
            Next::Watch(held) => {
                tokio::select! {
                    () = held.invalidated() => {}
                    () = tokio::time::sleep_until(feed.ends_at) => {
                        feed.methods
                            .counters
                            .sse_feeds_expired
                            .fetch_add(1, Ordering::Relaxed);
                        return None;
                    }
                }
                feed.next = Next::Refetch;
                Event::default().event("invalidated").data("")
            }
            Next::Refetch => match fetch(&feed.methods, &feed.name, feed.args.clone()).await {
                Ok((json, held)) => {
                    let event = Event::default().event("value").id(etag(&json)).data(json);
                    feed.next = Next::Watch(held);
                    event
                }
                Err(_) => Event::default()
                    .event("error")
                    .data("the value could not be read again"),
            },
            Next::Done => return None,
        };
        Some((Ok(event), feed))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

struct Feed {
    /// When the feed ends ([`RemoteServer::max_sse_lifetime`]).
    ends_at: tokio::time::Instant,
    _slot: FeedSlot,
    methods: Methods,
    name: String,
    args: Option<String>,
    next: Next,
}

enum Next {
    Send((String, Box<dyn Watched>)),
    Watch(Box<dyn Watched>),
    Refetch,
    Done,
}
