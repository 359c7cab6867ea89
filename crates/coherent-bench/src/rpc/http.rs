//! The HTTP JSON peer: an axum server, a hyper client with a connection pool (HTTP/1.1:
//! one request in flight per connection, so connections = callers).

use std::net::SocketAddr;

use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde::{de::DeserializeOwned, Serialize};

use super::model::{self, Hello, User};
use super::peer::Peer;

pub(crate) async fn start() -> anyhow::Result<SocketAddr> {
    let app = Router::new()
        .route(
            "/sum",
            post(|Json((a, b)): Json<(i32, i32)>| async move { Json(a.wrapping_add(b)) }),
        )
        .route(
            "/getuser",
            post(|Json(id): Json<i64>| async move { Json(model::user(id)) }),
        )
        .route(
            "/sayhello",
            post(|Json(h): Json<Hello>| async move { Json(h) }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

#[derive(Clone)]
pub(crate) struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Http {
    async fn post<A: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &A,
    ) -> anyhow::Result<R> {
        let request = hyper::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
        let response = self.client.request(request).await?;
        anyhow::ensure!(response.status().is_success(), "HTTP {}", response.status());
        let body = response.into_body().collect().await?.to_bytes();
        Ok(serde_json::from_slice(&body)?)
    }
}

impl Peer for Http {
    const NAME: &'static str = "http";

    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: format!("http://{addr}"),
        })
    }

    async fn sum(&self, a: i32, b: i32) -> anyhow::Result<i32> {
        self.post("/sum", &(a, b)).await
    }

    async fn get_user(&self, id: i64) -> anyhow::Result<User> {
        self.post("/getuser", &id).await
    }

    async fn say_hello(&self, hello: Hello) -> anyhow::Result<Hello> {
        self.post("/sayhello", &hello).await
    }
}
