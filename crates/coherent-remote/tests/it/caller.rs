//! A compute method that takes a `Caller`: the server fills it in from the connection (a
//! browser's identity over WebSocket, whatever it sent; a trusted tier's own choice), and
//! the result is computed, cached and invalidated per caller.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::{Caller, RemoteClient, RemoteServer};
use coherent_rpc::{Endpoint, Identity, RpcError};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum InboxError {
    LogInFirst,
    Unavailable(String),
}

impl From<RpcError> for InboxError {
    fn from(e: RpcError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

#[compute_service]
pub(crate) trait Inbox {
    /// The caller's unread count; an anonymous caller is refused.
    async fn unread(&self, caller: Caller) -> Result<u32, InboxError>;
    /// Who asks, with the caller inside another argument.
    async fn hello(&self, to: Option<Caller>) -> Result<String, InboxError>;
}

#[derive(Clone, ComputeService)]
struct Mail {
    handle: ServiceHandle,
    unread: Arc<Mutex<HashMap<String, u32>>>,
    runs: Arc<AtomicUsize>,
}

#[compute_service]
impl Inbox for Mail {
    async fn unread(&self, caller: Caller) -> Result<u32, InboxError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let name = caller.name().ok_or(InboxError::LogInFirst)?;
        Ok(self.unread.lock().get(name).copied().unwrap_or(0))
    }

    async fn hello(&self, to: Option<Caller>) -> Result<String, InboxError> {
        Ok(format!("hello {}", to.unwrap_or_default()))
    }
}

impl Mail {
    fn deliver(&self, to: &str) {
        *self.unread.lock().entry(to.to_owned()).or_default() += 1;
        self.invalidate_unread(Caller::named(to));
    }
}

/// The endpoint on TCP (trusted) and WebSocket (untrusted; the `authorization` header
/// names the connection's identity): their addresses.
async fn serve(mail: Mail) -> (SocketAddr, String) {
    let remote = RemoteServer::new().expose_service(InboxServer::new(mail));
    let endpoint = Endpoint::builder()
        .service(remote.service())
        .authenticate_with(|c| std::future::ready(Ok(c.header("authorization").map(Identity::new))))
        .build();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = tcp.local_addr().unwrap();
    tokio::spawn({
        let endpoint = endpoint.clone();
        async move { endpoint.serve_tcp(tcp).await }
    });
    let app = axum::Router::new()
        .route("/rpc", axum::routing::get(endpoint.websocket_handler()))
        .nest("/api", remote.gateway());
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}/rpc", http.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(http, app).await });
    (tcp_addr, url)
}

/// A browser-like client over WebSocket, logged in as `name` (or not).
async fn browser(url: &str, name: Option<&str>) -> InboxClient {
    let (url, name) = (url.to_owned(), name.map(str::to_owned));
    let remote = RemoteClient::builder()
        .connect_with(move |e| {
            let (url, name) = (url.clone(), name.clone());
            async move {
                let headers: Vec<(&str, &str)> =
                    name.iter().map(|n| ("authorization", n.as_str())).collect();
                e.connect_websocket_with_headers(&url, &headers).await
            }
        })
        .await
        .unwrap();
    InboxClient::new(remote)
}

/// The body of a `GET` of `url` (`http://host:port/path`), whatever its status.
async fn http_get(url: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = tokio::net::TcpStream::connect(host).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.unwrap();
    answer
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within 10 s"))
}

#[tokio::test]
async fn a_browser_asks_as_its_identity_whatever_it_sends() {
    let mail = Mail {
        handle: ServiceHandle::new(),
        unread: Arc::default(),
        runs: Arc::default(),
    };
    mail.deliver("ann");
    mail.deliver("ann");
    mail.deliver("bob");
    let (tcp, url) = serve(mail.clone()).await;

    let ann = browser(&url, Some("ann")).await;
    let anonymous = browser(&url, None).await;
    // Ann asking as bob gets her own count; no one asking as bob gets refused.
    assert_eq!(ann.unread(Caller::named("bob")).await, Ok(2));
    assert_eq!(ann.unread(Caller::anonymous()).await, Ok(2));
    assert_eq!(
        anonymous.unread(Caller::named("bob")).await,
        Err(InboxError::LogInFirst)
    );
    // Inside another argument too.
    let as_bob = Some(Caller::named("bob"));
    assert_eq!(ann.hello(as_bob.clone()).await, Ok("hello ann".to_owned()));
    assert_eq!(
        anonymous.hello(as_bob).await,
        Ok("hello (anonymous)".to_owned())
    );
    // A trusted tier asks for whom it says.
    let tier = InboxClient::new(RemoteClient::connect_tcp(tcp).await.unwrap());
    assert_eq!(tier.unread(Caller::named("bob")).await, Ok(1));
    // The HTTP gateway asks as no one.
    let gateway = url
        .replace("ws://", "http://")
        .replace("/rpc", "/api/Inbox.unread");
    let body = http_get(&format!("{gateway}?args=%5B%22bob%22%5D")).await;
    assert!(body.contains("LogInFirst"), "{body}");

    // Cached per caller on the server: ann's second browser is a hit there.
    let runs = mail.runs.load(Ordering::SeqCst);
    let ann_again = browser(&url, Some("ann")).await;
    assert_eq!(ann_again.unread(Caller::anonymous()).await, Ok(2));
    assert_eq!(mail.runs.load(Ordering::SeqCst), runs);

    // Invalidated per caller: mail for bob reaches the tier's replica of bob's count, not
    // ann's.
    let anns = ann.unread_computed(Caller::anonymous()).await;
    let bobs = tier.unread_computed(Caller::named("bob")).await;
    mail.deliver("bob");
    within("bob's invalidation", bobs.when_invalidated()).await;
    assert_eq!(tier.unread(Caller::named("bob")).await, Ok(2));
    // A round trip on ann's connection first: a push to it would have come before.
    assert_eq!(
        ann.hello(Some(Caller::anonymous())).await,
        Ok("hello ann".to_owned())
    );
    assert!(anns.is_consistent());
    assert_eq!(ann.unread(Caller::anonymous()).await, Ok(2));
}
