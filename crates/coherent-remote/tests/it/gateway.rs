//! The HTTP gateway: JSON values from the server's cache, ETags and 304s, and the
//! Server-Sent Events feed that reports invalidations.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use crate::support::*;

async fn serve_gateway(users: &Users) -> SocketAddr {
    let app = axum_router(users);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn axum_router(users: &Users) -> axum::Router {
    axum::Router::new().nest("/api", remote_server(users).gateway())
}

fn client() -> Client<HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

async fn get(addr: SocketAddr, path: &str, if_none_match: Option<&str>) -> Response<Incoming> {
    let mut request = Request::get(format!("http://{addr}{path}"));
    if let Some(tag) = if_none_match {
        request = request.header("if-none-match", tag);
    }
    client()
        .request(request.body(Empty::new()).unwrap())
        .await
        .unwrap()
}

async fn text(response: Response<Incoming>) -> String {
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

#[tokio::test]
async fn a_value_is_served_as_json_with_an_etag_and_a_304_while_it_is_unchanged() {
    let users = Users::new();
    let addr = serve_gateway(&users).await;
    let response = get(addr, "/api/Users.name?args=%5B1%5D", None).await;
    assert_eq!(response.status(), StatusCode::OK);
    let tag = response.headers()["etag"].to_str().unwrap().to_owned();
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(text(response).await, "\"ann\"");

    let again = get(addr, "/api/Users.name?args=%5B1%5D", Some(&tag)).await;
    assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(again.headers()["etag"].to_str().unwrap(), tag);
    assert_eq!(users.runs(), 1, "both answers came from the server's cache");

    users.rename(1, "anna");
    let changed = get(addr, "/api/Users.name?args=%5B1%5D", Some(&tag)).await;
    assert_eq!(changed.status(), StatusCode::OK);
    assert_ne!(changed.headers()["etag"].to_str().unwrap(), tag);
    assert_eq!(text(changed).await, "\"anna\"");
}

#[tokio::test]
async fn unknown_methods_are_404_and_bad_arguments_400() {
    let users = Users::new();
    let addr = serve_gateway(&users).await;
    let missing = get(addr, "/api/Users.nope?args=%5B1%5D", None).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    assert!(text(missing).await.contains("Users.nope"));
    let bad = get(addr, "/api/Users.name?args=%5B%22x%22%5D", None).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert!(text(bad).await.contains("error"));
}

#[tokio::test]
async fn the_event_feed_reports_an_invalidation_then_the_new_value() {
    let users = Users::new();
    let addr = serve_gateway(&users).await;
    let response = get(addr, "/api/Users.name/events?args=%5B2%5D", None).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let mut seen = String::new();
    // Reads events until `pattern` has arrived.
    async fn until(body: &mut Incoming, seen: &mut String, pattern: &str) {
        while !seen.contains(pattern) {
            let frame = within("the next event", body.frame())
                .await
                .expect("the feed stays open")
                .unwrap();
            if let Ok(data) = frame.into_data() {
                seen.push_str(std::str::from_utf8(&data).unwrap());
            }
        }
    }
    until(&mut body, &mut seen, "data: \"bob\"").await;
    assert!(seen.contains("event: value"), "{seen}");
    users.rename(2, "bobby");
    until(&mut body, &mut seen, "data: \"bobby\"").await;
    let invalidated = seen
        .find("event: invalidated")
        .expect("an invalidated event");
    assert!(invalidated < seen.find("\"bobby\"").unwrap(), "{seen}");
}

#[tokio::test]
async fn a_method_without_arguments_is_served_with_or_without_an_empty_list() {
    let users = Users::new();
    let server = coherent_remote::RemoteServer::new().expose(
        "Users.count",
        users.clone(),
        |u, (): ()| async move { u.count_computed().await },
    );
    let app = axum::Router::new().nest("/api", server.gateway());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    for path in [
        "/api/Users.count",
        "/api/Users.count?args=%5B%5D",
        "/api/Users.count?args=null",
    ] {
        let response = get(addr, path, None).await;
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert_eq!(text(response).await, "2", "{path}");
    }
    let response = get(addr, "/api/Users.count?args=%5B1%5D", None).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}

async fn serve_router(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test]
async fn event_feeds_beyond_the_servers_limit_are_refused_until_one_closes() {
    let users = Users::new();
    let server = remote_server(&users).max_sse_feeds(2);
    // Two gateways of one server share its limit.
    let app = axum::Router::new()
        .nest("/a", server.gateway())
        .nest("/b", server.gateway());
    let addr = serve_router(app).await;
    let one = get(addr, "/a/Users.name/events?args=%5B1%5D", None).await;
    assert_eq!(one.status(), StatusCode::OK);
    let two = get(addr, "/b/Users.name/events?args=%5B2%5D", None).await;
    assert_eq!(two.status(), StatusCode::OK);
    let three = get(addr, "/a/Users.name/events?args=%5B1%5D", None).await;
    assert_eq!(three.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(text(three).await.contains("too many event feeds"));
    assert_eq!(server.stats().sse_feeds_open, 2);
    assert_eq!(server.stats().sse_feeds_refused, 1);

    drop(one);
    within("the closed feed's release", async {
        while server.stats().sse_feeds_open > 1 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    // A feed refused for its arguments gives its place back at once.
    let bad = get(addr, "/a/Users.name/events?args=%5B%22x%22%5D", None).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    let again = get(addr, "/a/Users.name/events?args=%5B1%5D", None).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(server.stats().sse_feeds_open, 2);
}

#[tokio::test]
async fn arguments_longer_than_the_limit_are_refused_before_they_are_decoded() {
    let users = Users::new();
    let server = remote_server(&users).max_gateway_args_len(8);
    let addr = serve_router(axum::Router::new().nest("/api", server.gateway())).await;
    let short = get(addr, "/api/Users.name?args=%5B1%5D", None).await;
    assert_eq!(short.status(), StatusCode::OK);
    for path in [
        "/api/Users.name?args=%5B123456789%5D",
        "/api/Users.name/events?args=%5B123456789%5D",
    ] {
        let long = get(addr, path, None).await;
        assert_eq!(long.status(), StatusCode::URI_TOO_LONG, "{path}");
        assert!(text(long).await.contains("at most 8"), "{path}");
    }
    assert_eq!(users.runs(), 1, "the long ones ran nothing");
    assert_eq!(server.stats().sse_feeds_open, 0);
}

#[tokio::test]
async fn an_event_feed_ends_after_its_lifetime_and_gives_its_place_back() {
    let users = Users::new();
    let server = remote_server(&users)
        .max_sse_feeds(1)
        .max_sse_lifetime(std::time::Duration::from_millis(300));
    let addr = serve_router(axum::Router::new().nest("/api", server.gateway())).await;
    let feed = get(addr, "/api/Users.name/events?args=%5B1%5D", None).await;
    assert_eq!(feed.status(), StatusCode::OK);
    // The body ends (the server closed the feed) with the first value and nothing else:
    // nothing was invalidated.
    let body = within("the feed's end", text(feed)).await;
    assert!(body.contains("event: value"), "{body}");
    assert!(!body.contains("invalidated"), "{body}");
    assert_eq!(server.stats().sse_feeds_expired, 1);
    // Its place is free again.
    within("the ended feed's release", async {
        while server.stats().sse_feeds_open > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    let again = get(addr, "/api/Users.name/events?args=%5B1%5D", None).await;
    assert_eq!(again.status(), StatusCode::OK);
}
