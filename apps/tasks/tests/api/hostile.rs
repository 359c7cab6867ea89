//! What an untrusted client can send the Tasks app around its HTTP forms: writes that are
//! not JSON (cross-site request forgery), commands over RPC that skip the HTTP layer's
//! checks, pages of any size through RPC and the gateway.

use coherent::ops::{CommandClient, ErrorKind};
use coherent::remote::RemoteClient;
use coherent_tasks::live::{
    CreateProject, CreateTask, TasksService, TasksServiceClient, UpdateTask,
};
use coherent_tasks::model::{Invalid, ListQuery, NewProject, NewTask, TaskPatch};
use hyper::{Method, StatusCode};

use crate::harness::{live_backend, live_with_web, start, Db, KINDS};

#[tokio::test]
async fn writes_that_do_not_say_json_are_refused_before_they_run() {
    let db = Db::sqlite();
    for kind in KINDS {
        let s = start(kind, &db.config).await;
        let project = s.project("p").await;
        let body = format!(r#"{{"project":"{project}","title":"forged"}}"#);
        // What a form or `fetch(..., {mode: "no-cors"})` on another site can send.
        for content_type in ["text/plain", "application/x-www-form-urlencoded", ""] {
            let mut headers = vec![];
            if !content_type.is_empty() {
                headers.push(("content-type", content_type));
            }
            let r = s
                .client
                .send_untyped(
                    Method::POST,
                    &format!("{}/api/tasks", s.base),
                    &body,
                    &headers,
                )
                .await;
            assert_eq!(
                r.status,
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "{kind:?} {r:?}"
            );
            assert_eq!(r.json()["field"], "content-type");
        }
        // Nothing was created.
        let page = s.get(&format!("/api/tasks?project={project}")).await;
        assert_eq!(
            page.json()["items"].as_array().unwrap().len(),
            0,
            "{kind:?}"
        );
        // The same body as JSON (any case, with a charset) goes through.
        let r = s
            .client
            .send_untyped(
                Method::POST,
                &format!("{}/api/tasks", s.base),
                &body,
                &[("content-type", "Application/JSON; charset=utf-8")],
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{kind:?} {r:?}");
    }
}

#[tokio::test]
async fn commands_sent_over_rpc_are_validated_and_stamped_by_the_host() {
    let db = Db::sqlite();
    let backend = live_backend(&db.config).await;
    let client = RemoteClient::connect_tcp_any(vec![backend.addr])
        .await
        .unwrap();
    let commands = CommandClient::new(client.caller());
    let rejected_field = |e: coherent::ops::CommandError| {
        assert_eq!(e.kind(), ErrorKind::Rejected, "{e}");
        e.detail::<Invalid>()
            .expect("the field at fault, typed")
            .field
    };

    let e = commands
        .run(&CreateProject {
            new: NewProject { name: " ".into() },
        })
        .await
        .unwrap_err();
    assert_eq!(rejected_field(e), "name");
    let project = commands
        .run(&CreateProject {
            new: NewProject { name: "p".into() },
        })
        .await
        .unwrap();

    // A title of megabytes (4 MiB would push every page showing it over the message limit).
    let huge = NewTask {
        project: project.id,
        title: "x".repeat(1 << 20),
        description: String::new(),
        priority: None,
        status: None,
        assignee: None,
    };
    let e = commands.run(&CreateTask { new: huge }).await.unwrap_err();
    assert_eq!(rejected_field(e), "title");

    let before = coherent_tasks::model::now_micros();
    let task = commands
        .run(&CreateTask {
            new: NewTask {
                project: project.id,
                title: "t".into(),
                description: String::new(),
                priority: None,
                status: None,
                assignee: None,
            },
        })
        .await
        .unwrap();
    // The id and the times are the host's.
    assert!(task.created_at >= before && task.updated_at == task.created_at);

    let e = commands
        .run(&UpdateTask {
            id: task.id,
            patch: TaskPatch {
                assignee: Some(Some("\0".into())),
                ..TaskPatch::default()
            },
        })
        .await
        .unwrap_err();
    assert_eq!(rejected_field(e), "assignee");
    backend.stop().await;
}

#[tokio::test]
async fn a_page_over_the_limit_is_refused_over_rpc_and_the_gateway() {
    let db = Db::sqlite();
    let dir = tempfile::tempdir().unwrap();
    let s = live_with_web(&db.config, dir.path()).await;
    let addr = s.backend.as_ref().unwrap().addr;
    let client = RemoteClient::connect_tcp_any(vec![addr]).await.unwrap();
    let api = TasksServiceClient::new(client);
    for limit in [0, coherent_tasks::model::MAX_LIMIT + 1, u32::MAX] {
        let q = ListQuery {
            project: None,
            status: None,
            limit,
            after: None,
        };
        match api.page(q).await {
            Err(coherent_tasks::api::ApiError::Invalid(i)) => assert_eq!(i.field, "limit"),
            other => panic!("limit {limit}: {other:?}"),
        }
        let r = s
            .get(&format!(
                "/gateway/TasksService.page?args=%5B%7B%22limit%22%3A{limit}%7D%5D"
            ))
            .await;
        // The gateway answers the method's value, here its `Err`.
        assert_eq!(r.json()["Err"]["Invalid"]["field"], "limit", "{r:?}");
    }
}

/// A client that opens connections and sends its request's head a byte at a time, or
/// nothing at all, loses the connection once the head is late; a client beside it is served.
#[tokio::test]
async fn a_slow_or_silent_request_head_loses_its_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = coherent_tasks::app::HttpLimits {
        header_read_timeout: std::time::Duration::from_millis(300),
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits).await;

    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    let dripping = tokio::spawn(async move {
        // One byte every 100 ms: the head never ends in time.
        for b in b"GET /api/projects HTTP/1.1\r\nHost: x\r\nX-Pad: "
            .iter()
            .cycle()
        {
            if slow.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        slow
    });
    // Meanwhile an honest client is served.
    let base = format!("http://{addr}");
    let honest = crate::harness::Http::new()
        .send(Method::GET, &format!("{base}/api/projects"), None, &[])
        .await;
    assert_eq!(honest.status, StatusCode::OK);

    // Both are closed by the server (a bound for the test, not a measure: 30 s).
    // `read_to_end` ends only when the server closes (or resets) the connection.
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        silent.read_to_end(&mut buf),
    )
    .await
    .expect("the silent connection is closed");
    let mut slow = tokio::time::timeout(std::time::Duration::from_secs(30), dripping)
        .await
        .expect("the slow connection is cut")
        .unwrap();
    let mut rest = Vec::new();
    let _ = slow.read_to_end(&mut rest).await;
    serving.abort();
}

/// Logins: writes need one, reads need one only when anonymous reads are off, a forged or
/// foreign cookie is no login, and `/rpc` and `/gateway` follow the reads.
#[tokio::test]
async fn writes_need_a_login_and_reads_one_when_anonymous_reads_are_off() {
    use coherent_tasks::session::{Auth, AuthConfig, COOKIE};
    let db = Db::sqlite();
    let dir = tempfile::tempdir().unwrap();
    let backend = live_backend(&db.config).await;
    for anonymous_reads in [true, false] {
        let mut config =
            AuthConfig::new(*b"a secret of 32 bytes, not random").user("alice", "password1");
        config.anonymous_reads = anonymous_reads;
        let auth = Auth::new(config).unwrap();
        let router = auth.protect(backend.http_router(dir.path().to_owned()).await.unwrap());
        let (base, serving) = crate::harness::serve(router).await;
        let http = crate::harness::Http::new();
        let url = |p: &str| format!("{base}{p}");
        let json = [("content-type", "application/json")];

        // Not logged in: no writes; reads as configured; the page and the document open.
        let r = http
            .send_untyped(
                Method::POST,
                &url("/api/projects"),
                r#"{"name":"p"}"#,
                &json,
            )
            .await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{r:?}");
        let reads = if anonymous_reads {
            StatusCode::OK
        } else {
            StatusCode::UNAUTHORIZED
        };
        let r = http
            .send(Method::GET, &url("/api/projects"), None, &[])
            .await;
        assert_eq!(r.status, reads);
        let r = http
            .send(
                Method::GET,
                &url("/gateway/TasksService.projects"),
                None,
                &[],
            )
            .await;
        assert_eq!(r.status, reads);
        if !anonymous_reads {
            let e = coherent::rpc::Endpoint::builder()
                .build()
                .connect_websocket(&format!("ws{}/rpc", base.trim_start_matches("http")))
                .await
                .unwrap_err();
            assert!(e.message().contains("401"), "{e}");
        }
        let r = http
            .send(Method::GET, &url("/api/openapi.json"), None, &[])
            .await;
        assert_eq!(r.status, StatusCode::OK);
        // A method a route does not have is a 405, logged in or not; a path no route has
        // gets what the router answers it (the page's files: 405 to a POST), not a 401.
        let r = http
            .send_untyped(Method::PUT, &url("/api/projects"), "{}", &json)
            .await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
        let r = http
            .send_untyped(Method::POST, &url("/api/nothing"), "{}", &json)
            .await;
        assert!(
            r.status.is_client_error() && r.status != StatusCode::UNAUTHORIZED,
            "{r:?}"
        );

        // A wrong password, an unknown user, a body that is not JSON.
        for body in [
            r#"{"name":"alice","password":"no"}"#,
            r#"{"name":"bob","password":"password1"}"#,
        ] {
            let r = http
                .send_untyped(Method::POST, &url("/api/session"), body, &json)
                .await;
            assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{body}");
            assert!(r.headers.get("set-cookie").is_none());
        }
        let r = http
            .send_untyped(
                Method::POST,
                &url("/api/session"),
                r#"{"name":"alice","password":"password1"}"#,
                &[],
            )
            .await;
        assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);

        // Logged in: the cookie is HttpOnly and SameSite=Strict, and it lets the writes in.
        let r = http
            .send_untyped(
                Method::POST,
                &url("/api/session"),
                r#"{"name":"alice","password":"password1"}"#,
                &json,
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{r:?}");
        let set = r.headers["set-cookie"].to_str().unwrap().to_owned();
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
        let cookie = set.split(';').next().unwrap().to_owned();
        assert!(cookie.starts_with(&format!("{COOKIE}=")));
        let with = [
            ("content-type", "application/json"),
            ("cookie", cookie.as_str()),
        ];
        let r = http
            .send_untyped(
                Method::POST,
                &url("/api/projects"),
                r#"{"name":"p"}"#,
                &with,
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        let r = http
            .send(
                Method::GET,
                &url("/api/session"),
                None,
                &[("cookie", &cookie)],
            )
            .await;
        assert_eq!(r.json()["name"], "alice");
        let r = http
            .send(
                Method::GET,
                &url("/api/projects"),
                None,
                &[("cookie", &cookie)],
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);

        // Another name under alice's signature is no login.
        let (_, rest) = cookie.split_once('=').unwrap();
        let (_, signed) = rest.split_once('.').unwrap();
        let forged = format!("{COOKIE}=61646d696e.{signed}");
        let with = [
            ("content-type", "application/json"),
            ("cookie", forged.as_str()),
        ];
        let r = http
            .send_untyped(
                Method::POST,
                &url("/api/projects"),
                r#"{"name":"p"}"#,
                &with,
            )
            .await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);

        // Logging out clears the cookie.
        let r = http
            .send(Method::DELETE, &url("/api/session"), None, &[])
            .await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
        assert!(r.headers["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0"));
        serving.abort();
    }
    backend.stop().await;
}

/// Over `/rpc`, a browser's login cookie makes its connection its user's (its
/// `coherent::rpc::Identity`): it may run commands; without one (or with a forged one) the
/// connection is anonymous and may only read.
#[tokio::test]
async fn a_websocket_with_a_login_cookie_runs_commands_as_its_user() {
    use coherent_tasks::session::{AuthConfig, COOKIE};
    let (_db, backend, serving, url, cookie) =
        live_with_alice(AuthConfig::new(*b"a secret of 32 bytes, not random")).await;
    let create = CreateProject {
        new: NewProject { name: "p".into() },
    };

    let client = coherent::rpc::Endpoint::builder().build();
    for headers in [
        vec![],
        vec![("cookie", format!("{COOKIE}=61646d696e.1.00"))],
    ] {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let anonymous = client
            .connect_websocket_with_headers(&url, &headers)
            .await
            .unwrap();
        let e = CommandClient::new(anonymous)
            .run(&create)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    }
    let alice = client
        .connect_websocket_with_headers(&url, &[("cookie", &cookie)])
        .await
        .unwrap();
    let project = CommandClient::new(alice).run(&create).await.unwrap();
    assert_eq!(project.name, "p");
    serving.abort();
    backend.stop().await;
}

/// A logged-in browser's commands over `/rpc` are held to its user's rate: past the wait
/// allowed, refused with `RateLimited` and not run; a tier's trusted connection is not held
/// to it.
#[tokio::test]
async fn a_users_commands_over_rpc_are_held_to_its_rate() {
    use coherent_tasks::session::AuthConfig;
    let mut config = AuthConfig::new(*b"a secret of 32 bytes, not random");
    config.commands_per_user = Some(coherent::rpc::pace::Rate::per_second(1).burst(2));
    config.max_command_wait = std::time::Duration::ZERO;
    let (db, backend, serving, url, cookie) = live_with_alice(config).await;
    let client = coherent::rpc::Endpoint::builder().build();
    let store = db.config.open(1).await.unwrap();
    let projects = || async { store.projects().await.unwrap().len() };
    let alice = CommandClient::new(
        client
            .connect_websocket_with_headers(&url, &[("cookie", &cookie)])
            .await
            .unwrap(),
    );
    let create = |n: u32| CreateProject {
        new: NewProject {
            name: format!("p{n}"),
        },
    };
    // The burst of 2, then a refusal that runs nothing; a round that took a second (the
    // rate may have given one back) proves nothing and is done again.
    let mut proved = false;
    for round in 0..5 {
        if round > 0 {
            // The bucket full again.
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
        let before = projects().await;
        let start = std::time::Instant::now();
        let mut outcomes = Vec::new();
        for n in 0..3 {
            outcomes.push(
                alice
                    .run(&create(10 * round + n))
                    .await
                    .map_err(|e| e.kind()),
            );
        }
        if start.elapsed() < std::time::Duration::from_millis(900) {
            assert!(outcomes[0].is_ok() && outcomes[1].is_ok(), "{outcomes:?}");
            assert_eq!(outcomes[2].clone().unwrap_err(), ErrorKind::RateLimited);
            assert_eq!(projects().await, before + 2);
            proved = true;
            break;
        }
    }
    assert!(proved, "no round ran within a second");
    // A tier (trusted TCP) runs commands at whatever rate.
    let tier = CommandClient::new(client.connect_tcp(backend.addr).await.unwrap());
    for n in 100..105 {
        tier.run(&create(n)).await.unwrap();
    }
    serving.abort();
    backend.stop().await;
}

/// The server holds at most `max_connections` at once, whoever opens them (here from an
/// exempt address, held to no per-address limit): the next waits, unserved, until one
/// closes, and is then served.
#[tokio::test]
async fn the_server_holds_at_most_its_connections() {
    use std::sync::atomic::Ordering;
    let limits = coherent_tasks::app::HttpLimits {
        max_connections: 2,
        // The idle two are not closed for idling while the test looks.
        header_read_timeout: std::time::Duration::from_secs(3600),
        ..Default::default()
    };
    let (_db, addr, stats, serving) = serve_direct(limits).await;
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while stats.connections_open.load(Ordering::Relaxed) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the two were not served"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // A third is left in the kernel's backlog: not accepted, its request unanswered.
    let third = tokio::spawn(get_from("127.0.0.1", addr));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(!third.is_finished());
    assert_eq!(stats.connections_open.load(Ordering::Relaxed), 2);
    // One closes: the third is served.
    drop(idle.pop());
    let answered = tokio::time::timeout(std::time::Duration::from_secs(30), third)
        .await
        .expect("the third was not served once a place was free")
        .unwrap();
    assert_eq!(answered.0, 200);
    serving.abort();
}

/// One address cannot hold every connection: past its limit, its new connections are
/// closed at once while other addresses are served; a place frees when one closes.
#[tokio::test]
async fn one_address_holds_at_most_its_share_of_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = coherent_tasks::app::HttpLimits {
        max_connections_per_ip: 2,
        // 127.0.0.1 is exempt by default (a proxy on this host): not here.
        exempt_ips: vec![],
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits).await;
    let held_1 = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _held_2 = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The third from 127.0.0.1: closed without an answer.
    let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = third
        .write_all(b"GET /api/projects HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let _ = third.read_to_end(&mut buf).await;
    assert!(buf.is_empty(), "{}", String::from_utf8_lossy(&buf));
    // Another address (127.0.0.2, loopback too on Linux) is served meanwhile.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = other.connect(addr).await.unwrap();
    other
        .write_all(b"GET /api/projects HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    other.read_to_end(&mut answer).await.unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    // One closes: the address gets a place again (retried: the server sees the close a
    // moment later).
    drop(held_1);
    let mut served = false;
    for _ in 0..100 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = s
            .write_all(b"GET /api/projects HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await;
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer).await;
        if answer.starts_with(b"HTTP/1.1 200") {
            served = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(served, "a place never freed");
    serving.abort();
}

/// A body dripped a byte at a time, each within the pause allowed, still ends at the
/// request's deadline.
#[tokio::test]
async fn a_body_dripped_slowly_ends_at_the_request_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = coherent_tasks::app::HttpLimits {
        request_timeout: std::time::Duration::from_millis(500),
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        b"POST /api/projects HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
    )
    .await
    .unwrap();
    let (mut rd, mut wr) = s.into_split();
    let drip = tokio::spawn(async move {
        for _ in 0..1000 {
            if wr.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    });
    // A bound for the test, not a measure: 30 s.
    let mut answer = vec![0; 64];
    let n = tokio::time::timeout(std::time::Duration::from_secs(30), rd.read(&mut answer))
        .await
        .expect("an answer before the body ends")
        .unwrap();
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    drip.abort();
    serving.abort();
}

/// The projects are all listed in one answer, so their number is bounded where they are
/// made: past it, a new one is refused naming `name`, on every path (here the store, which
/// the commands, `direct` and gRPC all write through).
#[tokio::test]
async fn projects_are_bounded_in_number() {
    for db in Db::all("projects_bounded") {
        let store = db.config.open(2).await.unwrap();
        fill_to_the_bound(&store).await;
    }
}

async fn fill_to_the_bound(store: &coherent_tasks::store::Store) {
    use coherent_tasks::model::{new_id, now_micros, Project};
    use coherent_tasks::store::{StoreError, MAX_PROJECTS};
    let project = || {
        let now = now_micros();
        Project {
            id: new_id(now),
            name: "p".into(),
            created_at: now,
        }
    };
    for _ in 0..MAX_PROJECTS {
        store.insert_project(project()).await.unwrap();
    }
    match store.insert_project(project()).await {
        Err(StoreError::Invalid(i)) => assert_eq!(i.field, "name"),
        other => panic!("{other:?}"),
    }
    assert_eq!(store.projects().await.unwrap().len() as i64, MAX_PROJECTS);
}

/// Sends `GET /api/projects` on a new connection from `from` (a loopback address: Linux
/// routes all of 127.0.0.0/8 to itself); the answer's status and `Retry-After`.
async fn get_from(from: &str, addr: std::net::SocketAddr) -> (u16, Option<String>) {
    send_from(
        from,
        addr,
        "GET /api/projects HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await
}

/// Sends `request` on a new connection from `from`; the answer's status and `Retry-After`.
async fn send_from(from: &str, addr: std::net::SocketAddr, request: &str) -> (u16, Option<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let retry_after = text
        .lines()
        .find_map(|l| l.strip_prefix("retry-after: "))
        .map(str::to_owned);
    (status, retry_after)
}

/// An address that sends requests as fast as it can is held to its rate: a burst at once,
/// then the rate; a request that would wait longer than the limit's wait is answered 429
/// with a `Retry-After`. Another address, and an exempt one, are served meanwhile.
#[tokio::test]
async fn one_address_is_held_to_its_request_rate_and_answered_429_past_the_wait() {
    use coherent::rpc::pace::Rate;
    use std::sync::atomic::Ordering;
    let limits = coherent_tasks::app::HttpLimits {
        requests_per_ip: Some(Rate::per_second(20).burst(5)),
        max_pace_wait: std::time::Duration::from_millis(200),
        ..Default::default()
    };
    let (_db, addr, stats, serving) = serve_direct(limits).await;

    // 60 requests at once from 127.0.0.2, each on a connection of its own (closing one
    // does not give the address its burst back).
    let start = std::time::Instant::now();
    let flood: Vec<_> = (0..60)
        .map(|_| tokio::spawn(get_from("127.0.0.2", addr)))
        .collect();
    // Meanwhile 127.0.0.3 and the exempt 127.0.0.1 are served, the latter 30 times in a row.
    assert_eq!(get_from("127.0.0.3", addr).await.0, 200);
    for _ in 0..30 {
        assert_eq!(get_from("127.0.0.1", addr).await.0, 200);
    }
    let mut ok = 0u64;
    let mut refused = 0u64;
    for f in flood {
        match f.await.unwrap() {
            (200, _) => ok += 1,
            (429, Some(after)) => {
                assert!(after.parse::<u64>().unwrap() >= 1, "Retry-After {after}");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    let took = start.elapsed().as_secs_f64();
    // At most the burst, what the rate allowed while the flood lasted, and what could wait
    // the 200 ms: the rest refused.
    let allowed = 5.0 + 20.0 * (took + 0.2);
    assert!(
        (ok as f64) <= allowed,
        "{ok} served of 60 in {took:.2} s (at most {allowed:.0})"
    );
    assert!(ok >= 5, "{ok} served");
    assert_eq!(ok + refused, 60);
    assert_eq!(stats.requests_refused.load(Ordering::Relaxed), refused);
    serving.abort();
}

/// Calls over `/rpc` count toward their address's rate with its requests: the HTTP server
/// hands the address's pacer to the RPC endpoint with the upgrade.
#[tokio::test]
async fn calls_over_rpc_share_their_address_rate() {
    use coherent::rpc::pace::Rate;
    let db = Db::sqlite();
    let dir = tempfile::tempdir().unwrap();
    let backend = live_backend(&db.config).await;
    let router = backend.http_router(dir.path().to_owned()).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = coherent_tasks::app::HttpLimits {
        requests_per_ip: Some(Rate::per_second(20).burst(5)),
        exempt_ips: vec![],
        ..Default::default()
    };
    let serving = tokio::spawn(coherent_tasks::app::serve_http_with(
        listener, router, limits,
    ));
    let url = format!("ws://{addr}/rpc");
    let client = coherent::rpc::Endpoint::builder().build();
    let (a, b) = (
        CommandClient::new(client.connect_websocket(&url).await.unwrap()),
        CommandClient::new(client.connect_websocket(&url).await.unwrap()),
    );
    let create = CreateProject {
        new: NewProject { name: "p".into() },
    };
    // 2 x 15 calls (refused: no login; a call all the same). Each connection alone is well
    // within the endpoint's own rate (100 a second, 200 at once); their address is not.
    let calls = |c| {
        let create = &create;
        async move {
            let c: &CommandClient<_> = c;
            for _ in 0..15 {
                let e = c.run(create).await.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
            }
        }
    };
    tokio::join!(calls(&a), calls(&b));
    // Without the address's pacer none would wait (each connection is far within its own
    // burst of 200).
    let paced = backend.endpoint().stats().calls_paced;
    assert!(paced > 0, "no call of 30 was paced");
    serving.abort();
    backend.stop().await;
}

/// A client that asks for a large answer and reads none of it loses its connection once a
/// write has waited the stall limit, instead of holding it (and the answer) for ever.
#[tokio::test]
async fn a_client_that_stops_reading_loses_its_connection() {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = coherent_tasks::app::HttpLimits {
        write_stall_timeout: std::time::Duration::from_millis(300),
        ..Default::default()
    };
    // 64 MiB: more than the socket buffers of both ends hold.
    let router =
        axum::Router::new().route("/big", axum::routing::get(|| async { vec![7u8; 64 << 20] }));
    let (addr, stats, serving) = serve_counted(router, limits).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // A bound for the test, not a measure.
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while stats.writes_stalled.load(Ordering::Relaxed) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the stalled write was not cut");
    // The connection is closed: what was sent before ends short of the answer.
    let mut got = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(30), s.read_to_end(&mut got))
        .await
        .expect("the connection stays open");
    assert!(got.len() < 64 << 20, "{} bytes", got.len());
    // Another client is served meanwhile.
    let mut other = tokio::net::TcpStream::connect(addr).await.unwrap();
    other
        .write_all(b"HEAD /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    other.read_to_end(&mut answer).await.unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200"));
    serving.abort();
}

/// Writes have a rate of their own per address, within its rate of requests: past it they
/// are answered 429 while the address's reads are served.
#[tokio::test]
async fn one_address_writes_at_most_at_its_write_rate() {
    use coherent::rpc::pace::Rate;
    let limits = coherent_tasks::app::HttpLimits {
        writes_per_ip: Some(Rate::per_second(1).burst(3)),
        max_pace_wait: std::time::Duration::ZERO,
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits).await;
    let body = r#"{"name":"p"}"#;
    let post = format!(
        "POST /api/projects HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let start = std::time::Instant::now();
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(send_from("127.0.0.2", addr, &post).await.0);
    }
    let took = start.elapsed().as_secs_f64();
    // The burst of 3 goes through, and one more per second the six took; the rest wait a
    // second they may not: 429.
    let created = statuses.iter().filter(|s| **s == 201).count();
    assert!(
        created >= 3 && created as f64 <= 3.0 + took.ceil(),
        "{statuses:?} in {took:.2} s"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 6 - created);
    // Reads of the same address are served meanwhile.
    assert_eq!(get_from("127.0.0.2", addr).await.0, 200);
    serving.abort();
}

/// Behind a trusted reverse proxy each client is held to its own rate, named by the
/// `X-Forwarded-For` the proxy appended to; entries a client wrote in front of it, and the
/// header from an address that is not a trusted proxy, are not believed.
#[tokio::test]
async fn behind_a_trusted_proxy_each_forwarded_client_has_its_own_rate() {
    use coherent::rpc::pace::Rate;
    let limits = coherent_tasks::app::HttpLimits {
        writes_per_ip: Some(Rate::per_second(1).burst(2)),
        max_pace_wait: std::time::Duration::ZERO,
        // Two connections at most from one address: the proxy's are not counted.
        max_connections_per_ip: 2,
        // 127.0.0.1, a second proxy, is also exempt (the default): that applies to its own
        // address, not to the clients it names.
        trusted_proxies: vec!["127.0.0.9".parse().unwrap(), "127.0.0.1".parse().unwrap()],
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits).await;
    let post = |forwarded: &str| {
        let body = r#"{"name":"p"}"#;
        format!(
            "POST /api/projects HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             {forwarded}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let via = |client: &str| format!("X-Forwarded-For: {client}\r\n");
    // The proxy holds more connections than one address may (the connects succeed either
    // way: what shows they are not refused is that its requests below are served).
    let mut held = Vec::new();
    for _ in 0..4 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.9:0".parse().unwrap()).unwrap();
        held.push(socket.connect(addr).await.unwrap());
    }
    // Each round with addresses of its own; a round that took a second or more (a bucket
    // may have gained a write meanwhile) proves nothing and is done again.
    let mut proved = false;
    for round in 0..5u8 {
        let start = std::time::Instant::now();
        let mut statuses = Vec::new();
        // One client behind the proxy writes its burst of 2; its third write is refused,
        // its own address's rate spent, and so is one where it wrote another address in
        // front of what the proxy appended.
        let a = via(&format!("203.0.113.{}", 10 * round + 1));
        for _ in 0..3 {
            statuses.push(send_from("127.0.0.9", addr, &post(&a)).await.0);
        }
        let forged = via(&format!("198.51.100.7, 203.0.113.{}", 10 * round + 1));
        statuses.push(send_from("127.0.0.9", addr, &post(&forged)).await.0);
        // Through the exempt proxy the same client is held to the same rate.
        statuses.push(send_from("127.0.0.1", addr, &post(&a)).await.0);
        // Another client behind the same proxy has a rate of its own.
        let b = via(&format!("203.0.113.{}", 10 * round + 2));
        statuses.push(send_from("127.0.0.9", addr, &post(&b)).await.0);
        // From an address that is not a trusted proxy the header is ignored: it spends its
        // own burst, whoever it says it forwards.
        let peer = format!("127.0.0.{}", 20 + round);
        for k in 3..6 {
            let c = via(&format!("203.0.113.{}", 10 * round + k));
            statuses.push(send_from(&peer, addr, &post(&c)).await.0);
        }
        if start.elapsed() < std::time::Duration::from_millis(900) {
            assert_eq!(statuses, [201, 201, 429, 429, 429, 201, 201, 201, 429]);
            proved = true;
            break;
        }
    }
    assert!(proved, "no round ran within a second");
    // The proxy's own requests (without the header) are its address's.
    assert_eq!(send_from("127.0.0.9", addr, &post("")).await.0, 201);
    drop(held);
    serving.abort();
}

/// A live backend over a fresh SQLite database with logins by `config` and a user `alice`
/// (password `password1`), its HTTP router served on a loopback port: the database, the
/// backend, the server's task, the URL of `/rpc` and alice's login cookie.
async fn live_with_alice(
    config: coherent_tasks::session::AuthConfig,
) -> (
    Db,
    coherent_tasks::app::LiveBackend,
    tokio::task::JoinHandle<()>,
    String,
    String,
) {
    use coherent_tasks::session::{Auth, COOKIE};
    let db = Db::sqlite();
    let auth = Auth::new(config.user("alice", "password1")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend = coherent_tasks::app::LiveBackend::start_with(
        &db.config,
        listener,
        None,
        Some(auth.clone()),
    )
    .await
    .unwrap();
    // No page's files: the tests here use `/rpc` and the API.
    let no_page = std::env::temp_dir().join("coherent-tasks-no-page");
    let router = auth.protect(backend.http_router(no_page).await.unwrap());
    let (base, serving) = crate::harness::serve(router).await;
    let url = format!("ws{}/rpc", base.trim_start_matches("http"));
    let cookie = format!("{COOKIE}={}", auth.login("alice", "password1").unwrap());
    (db, backend, serving, url, cookie)
}

/// The `direct` backend's router over a fresh SQLite database, served on a loopback port
/// with `limits`: the database (keep it), the address, what the limits counted, the task.
async fn serve_direct(
    limits: coherent_tasks::app::HttpLimits,
) -> (
    Db,
    std::net::SocketAddr,
    std::sync::Arc<coherent_tasks::app::HttpStats>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let db = Db::sqlite();
    let router = coherent_tasks::app::direct_router(&db.config)
        .await
        .unwrap();
    let (addr, stats, serving) = serve_counted(router, limits).await;
    (db, addr, stats, serving)
}

/// `router` served on a loopback port with `limits`: the address, what the limits counted,
/// the task.
async fn serve_counted(
    router: axum::Router,
    limits: coherent_tasks::app::HttpLimits,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<coherent_tasks::app::HttpStats>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = std::sync::Arc::new(coherent_tasks::app::HttpStats::default());
    let serving = tokio::spawn(coherent_tasks::app::serve_http_counted(
        listener,
        router,
        limits,
        stats.clone(),
    ));
    (addr, stats, serving)
}

/// A head larger than `max_header_bytes` is answered 431 and its connection closed; a
/// client beside it is served.
#[tokio::test]
async fn a_request_head_over_its_limit_is_answered_431() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_db, addr, _, serving) = serve_direct(Default::default()).await;
    let limit = coherent_tasks::app::HttpLimits::default().max_header_bytes;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "GET /api/projects HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(limit + 1024)
    );
    // The server may close before it has read all of it: a failed write is its answer too.
    let _ = s.write_all(head.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        s.read_to_end(&mut answer),
    )
    .await
    .expect("the connection is closed");
    assert!(
        answer.starts_with(b"HTTP/1.1 431"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let honest = crate::harness::Http::new()
        .send(
            Method::GET,
            &format!("http://{addr}/api/projects"),
            None,
            &[],
        )
        .await;
    assert_eq!(honest.status, StatusCode::OK);
    serving.abort();
}

/// A body that stops coming, long before the request's deadline, ends at the pause allowed
/// between its pieces: the request is refused and the connection freed. An API write's body
/// and a login's alike.
#[tokio::test]
async fn a_body_that_goes_silent_ends_at_the_body_timeout() {
    let limits = || coherent_tasks::app::HttpLimits {
        body_read_timeout: std::time::Duration::from_millis(300),
        // Far beyond the test's bound: only the body's own timeout can end it.
        request_timeout: std::time::Duration::from_secs(3600),
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits()).await;
    let text = answer_to_a_body_owed(addr, "/api/projects").await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    // The API's own answer (the request's deadline would answer with no body).
    assert!(text.contains("stopped arriving"), "{text}");
    serving.abort();

    let auth = coherent_tasks::session::Auth::new(
        coherent_tasks::session::AuthConfig::new(*b"a secret of 32 bytes, not random")
            .user("alice", "password1"),
    )
    .unwrap();
    let db = Db::sqlite();
    let router = auth.protect(
        coherent_tasks::app::direct_router(&db.config)
            .await
            .unwrap(),
    );
    let (addr, _, serving) = serve_counted(router, limits()).await;
    let text = answer_to_a_body_owed(addr, "/api/session").await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("stopped arriving"), "{text}");
    serving.abort();
}

/// Sends a JSON `POST` to `path` whose body stops after a few of its 1,000 bytes; the
/// answer's first read (within 30 s: a bound for the test, not a measure).
async fn answer_to_a_body_owed(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 1000\r\n\r\n{{\"name\":"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0; 256];
    let n = tokio::time::timeout(std::time::Duration::from_secs(30), s.read(&mut answer))
        .await
        .expect("an answer while the body is still owed")
        .unwrap();
    String::from_utf8_lossy(&answer[..n]).into_owned()
}

/// A kept-alive connection that sends nothing after its answer is closed once its next head
/// is late (`header_read_timeout` counts from the end of the previous answer).
#[tokio::test]
async fn a_kept_alive_connection_left_idle_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = coherent_tasks::app::HttpLimits {
        header_read_timeout: std::time::Duration::from_millis(300),
        ..Default::default()
    };
    let (_db, addr, _, serving) = serve_direct(limits).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = b"GET /api/projects HTTP/1.1\r\nHost: x\r\n\r\n";
    s.write_all(request).await.unwrap();
    // The connection is kept alive: a second request on it at once is served.
    let mut first = vec![0; 4096];
    let n = s.read(&mut first).await.unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"));
    s.write_all(request).await.unwrap();
    // `read_to_end` ends only when the server closes: the second answer, then nothing more.
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        s.read_to_end(&mut answer),
    )
    .await
    .expect("the idle connection is closed")
    .unwrap();
    let text =
        String::from_utf8_lossy(&first[..n]).into_owned() + &String::from_utf8_lossy(&answer);
    assert_eq!(text.matches("HTTP/1.1 200").count(), 2, "{text}");
    assert_eq!(text.matches("HTTP/1.1").count(), 2, "{text}");
    serving.abort();
}

/// When the database fails under a request (here its tables are gone), the client is told
/// the kind of failure and a reference to the server's log, never the database's text or a
/// path on the server: over HTTP and over `/rpc` alike.
#[tokio::test]
async fn a_database_failure_reaches_clients_as_a_reference_only() {
    use coherent_tasks::session::AuthConfig;
    let drop_tables = |db: &Db| {
        let coherent_tasks::app::DbConfig::Sqlite(path) = &db.config else {
            unreachable!("a SQLite database")
        };
        let c = rusqlite::Connection::open(path).unwrap();
        c.execute_batch("DROP TABLE tasks; DROP TABLE projects;")
            .unwrap();
        path.parent().unwrap().to_string_lossy().into_owned()
    };
    let leaks = |text: &str, dir: &str| {
        text.contains("no such table") || text.contains(dir) || text.contains("tasks.db")
    };

    let (db, addr, _, serving) = serve_direct(Default::default()).await;
    let dir = drop_tables(&db);
    let r = crate::harness::Http::new()
        .send(
            Method::GET,
            &format!("http://{addr}/api/projects"),
            None,
            &[],
        )
        .await;
    let body = String::from_utf8_lossy(&r.body).into_owned();
    assert!(r.status.is_server_error(), "{} {body}", r.status);
    assert!(body.contains("reference "), "{body}");
    assert!(!leaks(&body, &dir), "{body}");
    serving.abort();

    let (db, backend, serving, url, cookie) =
        live_with_alice(AuthConfig::new(*b"a secret of 32 bytes, not random")).await;
    let dir = drop_tables(&db);
    let alice = coherent::rpc::Endpoint::builder()
        .build()
        .connect_websocket_with_headers(&url, &[("cookie", &cookie)])
        .await
        .unwrap();
    let create = CreateProject {
        new: NewProject { name: "p".into() },
    };
    // A bound for the test, not a measure: 30 s.
    let e = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        CommandClient::new(alice).run(&create),
    )
    .await
    .expect("the command's answer")
    .unwrap_err();
    let text = e.to_string();
    assert!(
        !matches!(
            e.kind(),
            ErrorKind::Rejected | ErrorKind::NotFound | ErrorKind::Unauthorized
        ),
        "{e}"
    );
    assert!(text.contains("reference "), "{text}");
    assert!(!leaks(&text, &dir), "{text}");
    serving.abort();
    backend.stop().await;
}

/// A backend given a tier token refuses a TCP connection that does not present it (every
/// connection there is trusted as a tier: its commands run unchecked), and serves a tier
/// that does; `/rpc` (browsers) is not asked for it.
#[tokio::test]
async fn a_backend_with_a_tier_token_refuses_tcp_connections_without_it() {
    let token = "the tiers' token, for this test only";
    let db = Db::sqlite();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend = coherent_tasks::app::LiveBackend::start_with_options(
        &db.config,
        listener,
        None,
        None,
        coherent_tasks::app::BackendOptions {
            tier_token: Some(token.into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let q = ListQuery {
        project: None,
        status: None,
        limit: 10,
        after: None,
    };
    for wrong in ["", "the tiers' token, for this test onlY", "x"] {
        // A bound for the test, not a measure: 30 s.
        let refused = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            RemoteClient::builder()
                .token(wrong)
                .connect_tcp(backend.addr),
        )
        .await
        .expect("an answer to the handshake");
        let e = refused.err().expect("refused");
        assert_eq!(e.code(), coherent::rpc::ErrorCode::Unauthenticated, "{e}");
    }
    let tier = RemoteClient::builder()
        .token(token)
        .connect_tcp(backend.addr)
        .await
        .unwrap();
    let page = TasksServiceClient::new(tier).page(q).await.unwrap();
    assert!(page.items.is_empty());

    // The HTTP tier of another process, as `serve --connect --tier-token-file` makes it.
    assert!(coherent_tasks::app::live_router_with(&[backend.addr], None)
        .await
        .is_err());
    let router = coherent_tasks::app::live_router_with(&[backend.addr], Some(token.into()))
        .await
        .unwrap();
    let (base, serving) = crate::harness::serve(router).await;
    let r = crate::harness::Http::new()
        .send(Method::GET, &format!("{base}/api/tasks"), None, &[])
        .await;
    assert_eq!(r.status, StatusCode::OK);

    // A browser's WebSocket carries no tier token and is not asked for one.
    let no_page = std::env::temp_dir().join("coherent-tasks-no-page");
    let (web, web_serving) =
        crate::harness::serve(backend.http_router(no_page).await.unwrap()).await;
    let url = format!("ws{}/rpc", web.trim_start_matches("http"));
    // (A refusal would fail the handshake, and so the connect.)
    let browser = coherent::rpc::Endpoint::builder()
        .build()
        .connect_websocket_with_headers(&url, &[])
        .await
        .unwrap();
    drop(browser);
    serving.abort();
    web_serving.abort();
    backend.stop().await;
}
