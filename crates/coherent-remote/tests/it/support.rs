//! What the tests share: the server's compute service and how to serve it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::RemoteServer;
use coherent_rpc::Endpoint;
use parking_lot::Mutex;

/// The server's compute service: names in memory, counting how often `name` runs.
#[derive(Clone, ComputeService)]
pub(crate) struct Users {
    handle: ServiceHandle,
    names: Arc<Mutex<HashMap<u64, String>>>,
    runs: Arc<AtomicUsize>,
}

#[compute_service]
impl Users {
    #[compute]
    pub(crate) async fn name(&self, id: u64) -> Option<String> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.names.lock().get(&id).cloned()
    }

    /// How many names there are: a method without arguments.
    #[compute]
    pub(crate) async fn count(&self) -> usize {
        self.names.lock().len()
    }
}

impl Users {
    pub(crate) fn new() -> Self {
        let names = [(1, "ann".to_owned()), (2, "bob".to_owned())];
        Self {
            handle: ServiceHandle::new(),
            names: Arc::new(Mutex::new(names.into_iter().collect())),
            runs: Arc::default(),
        }
    }

    /// The same, its results in `registry`.
    pub(crate) fn in_registry(registry: &coherent::Registry) -> Self {
        Self {
            handle: ServiceHandle::with_registry(registry),
            ..Self::new()
        }
    }

    /// A write this server does not hear of (made elsewhere): nothing is invalidated.
    pub(crate) fn rename_unheard(&self, id: u64, name: &str) {
        self.names.lock().insert(id, name.to_owned());
    }

    /// Another instance over the same names, with a cache of its own: what a second server
    /// over the same database runs. Its writes invalidate its own cache only.
    pub(crate) fn sharing_data(&self) -> Self {
        Self {
            handle: ServiceHandle::new(),
            names: self.names.clone(),
            runs: Arc::default(),
        }
    }

    /// A write, and the invalidation that goes with it.
    pub(crate) fn rename(&self, id: u64, name: &str) {
        self.names.lock().insert(id, name.to_owned());
        self.invalidate_name(id);
    }

    /// Renames everyone; their invalidations happen back to back.
    pub(crate) fn rename_all(&self, name: &str) {
        let ids: Vec<u64> = {
            let mut names = self.names.lock();
            for n in names.values_mut() {
                *n = name.to_owned();
            }
            names.keys().copied().collect()
        };
        for id in ids {
            self.invalidate_name(id);
        }
    }

    pub(crate) fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// The server's exposed methods.
pub(crate) fn remote_server(users: &Users) -> RemoteServer {
    RemoteServer::new().expose("Users.name", users.clone(), |u, (id,): (u64,)| async move {
        u.name_computed(id).await
    })
}

pub(crate) fn server_endpoint(users: &Users) -> Endpoint {
    Endpoint::builder()
        .service(remote_server(users).service())
        .build()
}

pub(crate) async fn serve(users: &Users) -> SocketAddr {
    let endpoint = server_endpoint(users);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    addr
}

/// Waits for something that must happen; fails the test instead of hanging.
pub(crate) async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen"))
}
