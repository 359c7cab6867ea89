//! The generator and the wrk runner against a small axum server started in the test.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use hyper::Method;
use serde_json::{json, Value};

use super::wrk::{run_wrk, WrkScript};
use super::{run, LoadConfig, Request, Response, Workload};

/// How many `PATCH`es the test servers answered (only the wrk test sends them).
static PATCHES: AtomicU64 = AtomicU64::new(0);

/// A server on 127.0.0.1 with the routes the tests use, on a runtime of its own (dropped, and
/// the server with it, when the returned runtime is).
fn server() -> (tokio::runtime::Runtime, SocketAddr) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("server runtime");
    let app = Router::new()
        .route("/hello", get(|| async { "hello" }))
        .route(
            "/items/{id}",
            get(|Path(id): Path<u64>| async move { Json(json!({ "id": id })) }).patch(
                |Path(id): Path<u64>, Json(patch): Json<Value>| async move {
                    PATCHES.fetch_add(1, Ordering::Relaxed);
                    Json(json!({ "id": id, "patch": patch }))
                },
            ),
        )
        .route(
            "/echo",
            axum::routing::post(|Json(body): Json<Value>| async move { Json(body) }),
        )
        .route(
            "/chunked",
            get(|| async {
                let parts = ["chunked ", "body ", "in parts"].map(Ok::<_, std::io::Error>);
                axum::body::Body::from_stream(futures::stream::iter(parts))
            }),
        )
        .route(
            "/close",
            get(|| async { ([(header::CONNECTION, "close")], "bye") }),
        )
        .route(
            "/cached",
            get(|| async { StatusCode::NOT_MODIFIED.into_response() }),
        )
        .route(
            "/missing",
            get(|| async { StatusCode::NOT_FOUND.into_response() }),
        );
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    runtime.spawn(async move { axum::serve(listener, app).await });
    (runtime, addr)
}

/// A short run: 2 threads × 8 connections for half a second after a 0.1 s warm-up.
fn short() -> LoadConfig {
    LoadConfig {
        threads: 2,
        connections: 8,
        duration: Duration::from_millis(500),
        warmup: Duration::from_millis(100),
        // The test server runs in this process: what it spends is this process less the
        // load threads.
        cost: Some(crate::cpu::Servers::default()),
    }
}

/// Each connection cycles through a GET of an item, a POST of a JSON body to `/echo` and a GET
/// of a chunked body, and checks every answer exactly.
struct Mix;

impl Workload for Mix {
    type Conn = (usize, u64);

    fn connection(&self, index: usize) -> Self::Conn {
        (index, 0)
    }

    fn next(&self, conn: &mut Self::Conn) -> Request {
        conn.1 += 1;
        match conn.1 % 3 {
            0 => Request::get(format!("/items/{}", conn.0)),
            1 => Request::json(
                Method::POST,
                "/echo",
                serde_json::to_vec(&json!({ "conn": conn.0, "n": conn.1 })).expect("json"),
            ),
            _ => Request::get("/chunked").with_header("accept", "text/plain"),
        }
    }

    fn check(
        &self,
        conn: &mut Self::Conn,
        req: &Request,
        resp: &Response<'_>,
        sent: Instant,
        done: Instant,
    ) -> Result<(), String> {
        if done < sent {
            return Err("done before sent".into());
        }
        if resp.status != 200 {
            return Err(format!(
                "{} {}: status {}",
                req.method, req.path, resp.status
            ));
        }
        let expected = match conn.1 % 3 {
            0 => json!({ "id": conn.0 }),
            1 => json!({ "conn": conn.0, "n": conn.1 }),
            _ if resp.body == b"chunked body in parts" => return Ok(()),
            _ => {
                return Err(format!(
                    "chunked body {:?}",
                    String::from_utf8_lossy(resp.body)
                ))
            }
        };
        if resp.header("Content-Type") != Some(b"application/json".as_slice()) {
            return Err(format!("content type {:?}", resp.header("content-type")));
        }
        let body: Value = serde_json::from_slice(resp.body).map_err(|e| e.to_string())?;
        if body != expected {
            return Err(format!("{} {}: body {body}", req.method, req.path));
        }
        Ok(())
    }
}

/// GETs of one path, with a check that holds when the status is `expect`.
struct Fixed {
    /// The path requested.
    path: &'static str,
    /// The status the check accepts.
    expect: u16,
}

impl Workload for Fixed {
    type Conn = ();

    fn connection(&self, _index: usize) -> Self::Conn {}

    fn next(&self, _conn: &mut Self::Conn) -> Request {
        Request::get(self.path)
    }

    fn check(
        &self,
        _conn: &mut Self::Conn,
        _req: &Request,
        resp: &Response<'_>,
        _sent: Instant,
        _done: Instant,
    ) -> Result<(), String> {
        if resp.status == self.expect {
            Ok(())
        } else {
            Err(format!(
                "status {} (headers {:?})",
                resp.status,
                resp.headers().count()
            ))
        }
    }
}

#[test]
fn load_mixed_workload_checks_every_response() {
    let (_server, addr) = server();
    let result = run(addr, &short(), Arc::new(Mix)).expect("run");
    assert!(result.requests > 0, "{result:?}");
    assert_eq!(result.errors, 0, "{:?}", result.first_errors);
    assert_eq!(result.non_2xx, 0);
    assert_eq!(result.reconnects, 0);
    assert_eq!(result.latency.len(), result.requests);
    assert!(result.rps() > 0.0);
    assert!(result.p50_ms() > 0.0 && result.p50_ms() <= result.p99_ms());
    assert!(result.p99_ms() <= result.p999_ms());
    // The server is in this process: it spent processor time on the requests, the load
    // threads' own excluded.
    let cost = result
        .cpu_us_per_req()
        .expect("a cost with LoadConfig::cost");
    assert!(cost > 0.0, "{:?}", result.spent);
}

#[test]
fn load_failed_checks_count_as_errors() {
    let (_server, addr) = server();
    let workload = Fixed {
        path: "/hello",
        expect: 201,
    };
    let result = run(addr, &short(), Arc::new(workload)).expect("run");
    assert!(result.requests > 0);
    assert_eq!(result.errors, result.requests);
    assert_eq!(result.first_errors.len(), super::KEPT_ERRORS);
    assert!(result.first_errors[0].starts_with("status 200"));
}

#[test]
fn load_counts_statuses_and_reconnects() {
    let (_server, addr) = server();
    let config = short();
    let missing = run(
        addr,
        &config,
        Arc::new(Fixed {
            path: "/missing",
            expect: 404,
        }),
    )
    .expect("run");
    assert_eq!((missing.errors, missing.non_2xx), (0, missing.requests));
    let cached = run(
        addr,
        &config,
        Arc::new(Fixed {
            path: "/cached",
            expect: 304,
        }),
    )
    .expect("run");
    assert!(cached.requests > 0);
    assert_eq!((cached.errors, cached.non_2xx), (0, 0));
    assert_eq!(cached.not_modified, cached.requests);
    let closed = run(
        addr,
        &config,
        Arc::new(Fixed {
            path: "/close",
            expect: 200,
        }),
    )
    .expect("run");
    assert!(closed.requests > 0);
    assert_eq!(closed.errors, 0, "{:?}", closed.first_errors);
    assert!(closed.reconnects > 0);
}

/// A server on 127.0.0.1 that answers every request on a connection with `response` (written
/// at once), and closes the connection after it when `close` is set. Its thread is left
/// behind, blocked in `accept`, when the test ends.
fn raw_server(response: &'static [u8], close: bool) -> SocketAddr {
    use std::io::{Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local addr");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut request = Vec::new();
                let mut buf = [0; 4096];
                while let Ok(read @ 1..) = stream.read(&mut buf) {
                    request.extend_from_slice(&buf[..read]);
                    // The tests send GETs: a request ends with its head.
                    while let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        request.drain(..end + 4);
                        if stream.write_all(response).is_err() || close {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

/// GETs of `/`, with a check that the body is `body`.
struct Body(&'static [u8]);

impl Workload for Body {
    type Conn = ();

    fn connection(&self, _index: usize) -> Self::Conn {}

    fn next(&self, _conn: &mut Self::Conn) -> Request {
        Request::get("/")
    }

    fn check(
        &self,
        _conn: &mut Self::Conn,
        _req: &Request,
        resp: &Response<'_>,
        _sent: Instant,
        _done: Instant,
    ) -> Result<(), String> {
        if resp.status == 200 && resp.body == self.0 {
            Ok(())
        } else {
            Err(format!(
                "{} {:?}",
                resp.status,
                String::from_utf8_lossy(resp.body)
            ))
        }
    }
}

#[test]
fn load_reads_interim_responses_bodies_until_close_and_trailers() {
    let config = LoadConfig {
        threads: 1,
        connections: 2,
        duration: Duration::from_millis(200),
        warmup: Duration::ZERO,
        cost: None,
    };
    let cases: [(&[u8], bool, &[u8]); 3] = [
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            false,
            b"ok",
        ),
        (b"HTTP/1.0 200 OK\r\n\r\nuntil close", true, b"until close"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nwith\r\n9\r\n trailers\r\n0\r\nx-sum: 1\r\n\r\n",
            false,
            b"with trailers",
        ),
    ];
    for (response, close, body) in cases {
        let addr = raw_server(response, close);
        let result = run(addr, &config, Arc::new(Body(body))).expect("run");
        assert!(result.requests > 0, "{result:?}");
        assert_eq!(result.errors, 0, "{:?}", result.first_errors);
        assert_eq!(result.reconnects > 0, close);
    }
}

#[test]
fn load_fails_when_nothing_listens() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local addr");
    drop(listener);
    assert!(run(addr, &short(), Arc::new(Mix)).is_err());
}

#[test]
fn load_encodes_requests() {
    let mut out = Vec::new();
    Request::json(Method::PATCH, "/items/3", &b"{\"a\":1}"[..]).encode("h:1", &mut out);
    assert_eq!(
        out,
        b"PATCH /items/3 HTTP/1.1\r\nhost: h:1\r\ncontent-type: application/json\r\n\
          content-length: 7\r\n\r\n{\"a\":1}"
    );
    out.clear();
    Request::get("/x")
        .with_header("if-none-match", "\"v1\"")
        .encode("h:1", &mut out);
    assert_eq!(
        out,
        b"GET /x HTTP/1.1\r\nhost: h:1\r\nif-none-match: \"v1\"\r\n\r\n"
    );
}

#[test]
fn load_decodes_chunks() {
    let mut out = Vec::new();
    let body = b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\nNEXT";
    assert_eq!(
        super::decode_chunked(body, &mut out),
        Ok(Some(body.len() - 4))
    );
    assert_eq!(out, b"abcde");
    for cut in 0..body.len() - 4 {
        assert_eq!(
            super::decode_chunked(&body[..cut], &mut out),
            Ok(None),
            "{cut}"
        );
    }
    assert!(super::decode_chunked(b"3\r\nabcX\r\n", &mut out).is_err());
    assert!(super::decode_chunked(b"zz\r\n", &mut out).is_err());
}

#[test]
fn load_wrk_runs_every_script() {
    let (_server, addr) = server();
    let config = LoadConfig {
        threads: 2,
        connections: 4,
        duration: Duration::from_secs(1),
        warmup: Duration::ZERO,
        cost: None,
    };
    let paths: Vec<String> = (1..=5).map(|id| format!("/items/{id}")).collect();
    let scripts = [
        WrkScript::Get {
            path: "/hello".into(),
        },
        WrkScript::GetRotating {
            paths: paths.clone(),
        },
        WrkScript::Post {
            path: "/echo".into(),
            body: r#"{"title":"a \"quoted\" title"}"#.into(),
        },
        WrkScript::Mixed {
            paths,
            patch_body: r#"{"done":true}"#.into(),
            patch_percent: 5,
        },
    ];
    for script in &scripts {
        let Some(result) = run_wrk(addr, &config, script).expect("wrk") else {
            eprintln!("skipped: {}", super::wrk::WRK_MISSING);
            return;
        };
        assert!(result.requests > 0, "{script:?}: {result:?}");
        assert_eq!((result.errors, result.bad_status), (0, 0), "{script:?}");
        assert!(result.rps > 0.0 && result.p50_ms <= result.p99_ms);
    }
    assert!(
        PATCHES.load(Ordering::Relaxed) > 0,
        "the mixed script sent no PATCH"
    );
}
