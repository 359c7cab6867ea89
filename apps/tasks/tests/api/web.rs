//! What `tasks serve` adds for the browser: the backend's endpoint over WebSocket at `/rpc`
//! (a client there holds replicas that an HTTP write invalidates), the gateway at
//! `/gateway`, and the live page's files at `/`.

use std::time::Duration;

use coherent::remote::RemoteClient;
use coherent::rpc::{Config, Format};
use coherent::Registry;
use coherent_tasks::live::{TasksService, TasksServiceClient};
use hyper::{Method, StatusCode};
use serde_json::json;

use crate::harness::{live_with_web, Db};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_client_holds_replicas_that_an_http_write_invalidates() {
    let db = Db::sqlite();
    let web = tempfile::tempdir().unwrap();
    let s = live_with_web(&db.config, web.path()).await;
    let project = s.project("Live").await;
    let task = s.task(&project, "Watch me").await;
    let id: uuid::Uuid = task["id"].as_str().unwrap().parse().unwrap();

    // The TypeScript client's settings: MessagePack over WebSocket.
    let url = format!("{}/rpc", s.base.replacen("http://", "ws://", 1));
    let registry = Registry::new();
    let remote = RemoteClient::builder()
        .config(Config::default().format(Format::MessagePack))
        .registry(&registry)
        .connect_with(move |e| {
            let url = url.clone();
            async move { e.connect_websocket(&url).await }
        })
        .await
        .unwrap();
    assert_eq!(remote.connection().unwrap().format(), Format::MessagePack);
    let tasks = TasksServiceClient::with_registry(remote, &registry);
    let held = tasks.task(id).await.unwrap().unwrap();
    assert_eq!(held.title, "Watch me");
    let replica = tasks.task_computed(id).await;
    assert!(replica.is_consistent());

    let r = s
        .send_json(
            Method::PATCH,
            &format!("/api/tasks/{id}"),
            &json!({"title": "Watched"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    // The command answers once every client holding the task applied its invalidation:
    // the WebSocket client's replica is stale already.
    tokio::time::timeout(Duration::from_secs(5), replica.when_invalidated())
        .await
        .expect("the replica is invalidated");
    assert!(!replica.is_consistent());
    assert_eq!(tasks.task(id).await.unwrap().unwrap().title, "Watched");

    // The same method through the gateway, as JSON.
    let r = s
        .get(&format!("/gateway/TasksService.task?args=%5B%22{id}%22%5D"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json()["Ok"]["title"], "Watched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_served_once_built_and_says_how_to_build_it_before() {
    let db = Db::sqlite();
    let web = tempfile::tempdir().unwrap();
    let s = live_with_web(&db.config, web.path()).await;

    let r = s.get("/").await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    let body = String::from_utf8_lossy(&r.body);
    let build = coherent_tasks::web::BUILD_COMMAND.replace('&', "&amp;");
    assert!(body.contains(&build), "{body}");
    assert_eq!(s.get("/some/page").await.status, StatusCode::NOT_FOUND);

    // Built while the server runs: served from the next request on.
    std::fs::write(web.path().join("index.html"), "<!doctype html><p>live</p>").unwrap();
    std::fs::create_dir(web.path().join("assets")).unwrap();
    std::fs::write(web.path().join("assets/app.js"), "console.log(1)").unwrap();
    let r = s.get("/").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"<!doctype html><p>live</p>");
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let r = s.get("/assets/app.js").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"console.log(1)");
    // The page's own routes are the page; missing files and other routes are not.
    assert_eq!(
        &s.get("/projects/1").await.body[..],
        b"<!doctype html><p>live</p>"
    );
    for missing in ["/assets/gone.js", "/api/nothing", "/gateway", "/rpc/x"] {
        assert_eq!(
            s.get(missing).await.status,
            StatusCode::NOT_FOUND,
            "{missing}"
        );
    }
    // The API is still there.
    assert_eq!(s.get("/api/projects").await.status, StatusCode::OK);
}
