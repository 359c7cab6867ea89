//! The Tasks API over HTTP: one table of expectations run against every backend, on SQLite
//! and (with `DATABASE_URL`) PostgreSQL; pagination under concurrent inserts; a write
//! through one tier seen by the next read on another; the live page's routes (`web`).

mod harness;
mod hostile;
mod metrics;
mod web;

use std::collections::HashSet;

use coherent_tasks::app::DbConfig;
use harness::{start, Db, Kind, Server, KINDS};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};

/// Every route, the happy paths and the errors, the same on every backend.
async fn routes(s: &Server) {
    let kind = s.kind;
    let project = s.project("Routes").await;
    let other = s.project("Other").await;

    // Create, with defaults.
    let t = s.task(&project, "Write the tests").await;
    let id = t["id"].as_str().unwrap().to_owned();
    assert_eq!(t["priority"], "medium", "{kind:?}");
    assert_eq!(t["status"], "todo");
    assert_eq!(t["assignee"], Value::Null);
    assert_eq!(t["description"], "");
    assert_eq!(t["created_at"], t["updated_at"]);
    assert_eq!(uuid::Uuid::parse_str(&id).unwrap().get_version_num(), 7);

    // Read it back.
    let r = s.get(&format!("/api/tasks/{id}")).await;
    assert_eq!(r.status, StatusCode::OK, "{kind:?} {r:?}");
    assert_eq!(r.json(), t);
    assert_eq!(r.headers["content-type"], "application/json");

    // Entity tags: the coherent backend keeps one with each cached answer.
    match r.headers.get("etag") {
        Some(tag) => {
            let tag = tag.to_str().unwrap();
            let r = s
                .get_with(&format!("/api/tasks/{id}"), &[("if-none-match", tag)])
                .await;
            assert_eq!(r.status, StatusCode::NOT_MODIFIED, "{kind:?}");
            assert!(r.body.is_empty());
            let r = s
                .get_with(
                    &format!("/api/tasks/{id}"),
                    &[("if-none-match", "\"other\"")],
                )
                .await;
            assert_eq!(r.status, StatusCode::OK);
        }
        None => assert_ne!(kind, Kind::Coherent, "the coherent backend answers ETags"),
    }

    // Change it: a field, the status, and clear-vs-keep of the assignee.
    let r = s
        .send_json(
            Method::PATCH,
            &format!("/api/tasks/{id}"),
            &json!({"title": "Write more tests", "status": "in_progress", "assignee": "ada", "priority": "high"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{kind:?} {r:?}");
    let changed = r.json();
    assert_eq!(changed["title"], "Write more tests");
    assert_eq!(changed["status"], "in_progress");
    assert_eq!(changed["assignee"], "ada");
    assert_eq!(changed["priority"], "high");
    assert_eq!(changed["created_at"], t["created_at"]);
    assert!(changed["updated_at"].as_i64() >= t["updated_at"].as_i64());
    assert_eq!(s.get(&format!("/api/tasks/{id}")).await.json(), changed);
    let r = s
        .send_json(
            Method::PATCH,
            &format!("/api/tasks/{id}"),
            &json!({"description": "d"}),
        )
        .await;
    assert_eq!(r.json()["assignee"], "ada", "an absent field stays");
    let r = s
        .send_json(
            Method::PATCH,
            &format!("/api/tasks/{id}"),
            &json!({"assignee": null}),
        )
        .await;
    assert_eq!(r.json()["assignee"], Value::Null, "null clears");
    assert_eq!(r.json()["description"], "d");

    // Lists: filters, newest first.
    let second = s.task(&project, "Second").await;
    let elsewhere = s.task(&other, "Elsewhere").await;
    let page = s.get(&format!("/api/tasks?project={project}")).await.json();
    let ids: Vec<_> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].clone())
        .collect();
    assert_eq!(ids, vec![second["id"].clone(), json!(id)], "{kind:?}");
    assert_eq!(page["next"], Value::Null);
    let page = s
        .get(&format!("/api/tasks?project={project}&status=in_progress"))
        .await
        .json();
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["id"], json!(id));
    let all = s.get("/api/tasks?limit=100").await.json();
    let all_ids: HashSet<_> = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].clone())
        .collect();
    assert!(all_ids.contains(&elsewhere["id"]) && all_ids.contains(&json!(id)));

    // Summary: counts per status, updated by writes.
    let sum = s.get(&format!("/api/projects/{project}/summary")).await;
    assert_eq!(sum.status, StatusCode::OK, "{kind:?} {sum:?}");
    let sum = sum.json();
    assert_eq!(
        (
            sum["total"].as_u64(),
            sum["todo"].as_u64(),
            sum["in_progress"].as_u64()
        ),
        (Some(2), Some(1), Some(1))
    );
    s.send_json(
        Method::PATCH,
        &format!("/api/tasks/{id}"),
        &json!({"status": "done"}),
    )
    .await;
    let sum = s
        .get(&format!("/api/projects/{project}/summary"))
        .await
        .json();
    assert_eq!(
        (sum["in_progress"].as_u64(), sum["done"].as_u64()),
        (Some(0), Some(1)),
        "{kind:?}"
    );

    // Projects.
    let projects = s.get("/api/projects").await.json();
    let names: Vec<_> = projects
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].clone())
        .collect();
    assert!(names.contains(&json!("Routes")) && names.contains(&json!("Other")));

    // Delete.
    let r = s.delete(&format!("/api/tasks/{id}")).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{kind:?} {r:?}");
    assert_eq!(
        s.get(&format!("/api/tasks/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        s.delete(&format!("/api/tasks/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
    let r = s
        .send_json(
            Method::PATCH,
            &format!("/api/tasks/{id}"),
            &json!({"title": "x"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.json()["error"].as_str().unwrap().contains("not found"));
    let sum = s
        .get(&format!("/api/projects/{project}/summary"))
        .await
        .json();
    assert_eq!(
        (sum["total"].as_u64(), sum["done"].as_u64()),
        (Some(1), Some(0)),
        "{kind:?}"
    );
    let page = s.get(&format!("/api/tasks?project={project}")).await.json();
    assert_eq!(page["items"].as_array().unwrap().len(), 1);

    // Unknown ids.
    let nobody = uuid::Uuid::now_v7();
    assert_eq!(
        s.get(&format!("/api/tasks/{nobody}")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        s.get(&format!("/api/projects/{nobody}/summary"))
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    // Bad input: a 400 naming the field.
    let post = |body: Value| async move { s.send_json(Method::POST, "/api/tasks", &body).await };
    assert_eq!(post(json!({"project": project})).await.field(), "title");
    assert_eq!(post(json!({"title": "x"})).await.field(), "project");
    assert_eq!(
        post(json!({"project": project, "title": ""})).await.field(),
        "title"
    );
    assert_eq!(
        post(json!({"project": project, "title": "x", "priority": "huge"}))
            .await
            .field(),
        "priority"
    );
    assert_eq!(
        post(json!({"project": project, "title": "x", "status": 3}))
            .await
            .field(),
        "status"
    );
    assert_eq!(
        post(json!({"project": project, "title": "x", "colour": "red"}))
            .await
            .field(),
        "colour"
    );
    assert_eq!(
        post(json!({"project": "nope", "title": "x"})).await.field(),
        "project"
    );
    let r = post(json!({"project": nobody, "title": "x"})).await;
    assert_eq!(
        r.status,
        StatusCode::NOT_FOUND,
        "{kind:?}: an unknown project"
    );
    assert_eq!(r.json()["field"], "project");
    let second_path = format!("/api/tasks/{}", second["id"].as_str().unwrap());
    assert_eq!(
        s.send_raw(Method::PATCH, &second_path, "[null]")
            .await
            .field(),
        "body"
    );
    assert_eq!(
        post(json!({"project": project, "title": "x", "assignee": "a".repeat(101)}))
            .await
            .field(),
        "assignee"
    );
    assert_eq!(
        s.send_raw(Method::POST, "/api/tasks", "{\"title\":")
            .await
            .field(),
        "body"
    );
    assert_eq!(
        s.send_raw(Method::POST, "/api/tasks", "").await.field(),
        "body"
    );
    assert_eq!(s.get("/api/tasks/not-a-uuid").await.field(), "id");
    assert_eq!(s.get("/api/tasks?limit=0").await.field(), "limit");
    assert_eq!(s.get("/api/tasks?limit=1000").await.field(), "limit");
    assert_eq!(s.get("/api/tasks?status=open").await.field(), "status");
    assert_eq!(s.get("/api/tasks?after=x").await.field(), "after");
    assert_eq!(s.get("/api/projects/x/summary").await.field(), "id");
    let r = s
        .send_json(
            Method::PATCH,
            &format!("/api/tasks/{}", second["id"].as_str().unwrap()),
            &json!({"title": "  "}),
        )
        .await;
    assert_eq!(r.field(), "title");
    let r = s
        .send_json(Method::POST, "/api/projects", &json!({"name": ""}))
        .await;
    assert_eq!(r.field(), "name");

    // A body over the limit.
    let big = format!(
        "{{\"project\":\"{project}\",\"title\":\"{}\"}}",
        "x".repeat(70_000)
    );
    let r = s.send_raw(Method::POST, "/api/tasks", big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{kind:?}");
    assert!(r.json()["error"].is_string());

    // Nothing above changed the second task.
    assert_eq!(
        s.get(&format!("/api/tasks/{}", second["id"].as_str().unwrap()))
            .await
            .json(),
        second
    );

    // The OpenAPI document names every route.
    let doc = s.get("/api/openapi.json").await;
    assert_eq!(doc.status, StatusCode::OK);
    let doc = doc.json();
    for path in [
        "/api/tasks",
        "/api/tasks/{id}",
        "/api/projects",
        "/api/projects/{id}/summary",
    ] {
        assert!(
            doc["paths"][path].is_object(),
            "{path} missing from the OpenAPI document"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_on_every_backend() {
    for db in Db::all("routes") {
        for kind in KINDS {
            let server = start(kind, &db.config).await;
            routes(&server).await;
        }
    }
}

/// Walks a project's pages while another client inserts into it: every task that existed
/// before the walk is seen exactly once, ids strictly decrease, no page repeats a task.
async fn pagination_under_inserts(s: &Server) {
    let project = s.project("Paging").await;
    let mut before = HashSet::new();
    for i in 0..45 {
        before.insert(s.task(&project, &format!("t{i}")).await["id"].clone());
    }
    let writer = {
        let s2 = harness::Http::new();
        let base = s.base.clone();
        let project = project.clone();
        tokio::spawn(async move {
            for i in 0..40 {
                let body =
                    serde_json::to_vec(&json!({"project": project, "title": format!("new{i}")}))
                        .unwrap();
                let r = s2
                    .send(
                        Method::POST,
                        &format!("{base}/api/tasks"),
                        Some(body.into()),
                        &[],
                    )
                    .await;
                assert_eq!(r.status, StatusCode::CREATED);
            }
        })
    };
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(a) => format!("/api/tasks?project={project}&limit=7&after={a}"),
            None => format!("/api/tasks?project={project}&limit=7"),
        };
        let page = s.get(&path).await.json();
        for t in page["items"].as_array().unwrap() {
            seen.push(t["id"].clone());
        }
        match page["next"].as_str() {
            Some(n) => after = Some(n.to_owned()),
            None => break,
        }
        tokio::task::yield_now().await;
    }
    writer.await.unwrap();
    let ids: Vec<uuid::Uuid> = seen
        .iter()
        .map(|v| v.as_str().unwrap().parse().unwrap())
        .collect();
    assert!(
        ids.windows(2).all(|w| w[0] > w[1]),
        "{:?}: not strictly newest first",
        s.kind
    );
    let unique: HashSet<_> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "a task seen twice");
    assert!(
        before.is_subset(&unique),
        "{:?}: a task that existed before the walk was missed",
        s.kind
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pagination_is_stable_under_concurrent_inserts() {
    for db in Db::all("paging") {
        for kind in KINDS {
            pagination_under_inserts(&start(kind, &db.config).await).await;
        }
    }
}

/// Writes through `a`, and after each returns, reads the same task, its list page and its
/// project's summary through `b`, which had them cached: each read must show the write.
async fn read_after_write(a: &Server, b: &Server, sync: impl Fn() -> futures_like::Wait) {
    let project = a.project("Across").await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            a.task(&project, &format!("t{i}")).await["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    sync().await;
    for round in 0..30 {
        let id = &ids[round % ids.len()];
        // Warm b's cache.
        let _ = b.get(&format!("/api/tasks/{id}")).await;
        let _ = b
            .get(&format!("/api/tasks?project={project}&status=done"))
            .await;
        let _ = b.get(&format!("/api/projects/{project}/summary")).await;
        let status = if round % 2 == 0 { "done" } else { "todo" };
        let title = format!("round {round}");
        let r = a
            .send_json(
                Method::PATCH,
                &format!("/api/tasks/{id}"),
                &json!({"title": title, "status": status}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        sync().await;
        let t = b.get(&format!("/api/tasks/{id}")).await.json();
        assert_eq!(
            t["title"],
            json!(title),
            "round {round}: b served a stale task"
        );
        let done = b
            .get(&format!("/api/tasks?project={project}&status=done"))
            .await
            .json();
        let listed = done["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["id"] == json!(id));
        assert_eq!(
            listed,
            status == "done",
            "round {round}: b served a stale list"
        );
        let sum = b
            .get(&format!("/api/projects/{project}/summary"))
            .await
            .json();
        let expected_done = done["items"].as_array().unwrap().len() as u64;
        assert_eq!(
            sum["done"].as_u64(),
            Some(expected_done),
            "round {round}: b served a stale summary"
        );
    }
}

/// A stand-in for a boxed future type, so that the sync step can be a closure.
mod futures_like {
    pub(crate) type Wait = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_one_tier_is_read_through_another() {
    for db in Db::all("tiers") {
        let backend = harness::live_backend(&db.config).await;
        let a = harness::live_tier(&[backend.addr]).await;
        let b = harness::live_tier(&[backend.addr]).await;
        // One backend: its commands answer after every tier applied their invalidation.
        read_after_write(&a, &b, || Box::pin(async {})).await;
        backend.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_one_backend_is_read_through_another() {
    for db in Db::all("backends") {
        let one = harness::live_backend(&db.config).await;
        let two = harness::live_backend(&db.config).await;
        let a = harness::live_tier(&[one.addr]).await;
        let b = harness::live_tier(&[two.addr]).await;
        if matches!(db.config, DbConfig::Postgres { .. }) {
            // On PostgreSQL a command answers after the other backend acknowledged it,
            // which that backend does once its tiers have applied the invalidation: no
            // wait at all. It waits for the backends it knows of: first, until the first
            // has heard of the second (its row, read each second), and both listen (an
            // acknowledgement sent before its host listens is lost).
            while one.host.stats().peers < 1
                || !one.host.notifier_connected()
                || !two.host.notifier_connected()
            {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            read_after_write(&a, &b, || Box::pin(async {})).await;
            assert_eq!(one.host.stats().ack_timeouts, 0);
        } else {
            // SQLite's hosts poll the log (no channel for acknowledgements): the second
            // applies the first's operations at its next read of the log; once it has
            // caught up, its tiers have applied them too.
            let host = two.host.clone();
            read_after_write(&a, &b, move || {
                let host = host.clone();
                Box::pin(async move { host.catch_up().await.unwrap() })
            })
            .await;
        }
        one.stop().await;
        two.stop().await;
    }
}
