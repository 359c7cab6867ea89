//! A tier inside a host process: a [`RemoteClient`] that reads the host's registers as
//! replicas (as an application's HTTP tier reads its backend's), through a [`Proxy`] the
//! parent can cut or turn half-open.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use coherent::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The registers as a tier sees them: each key's value a replica of the host's
/// `Registers.value`, invalidated by the host's push.
#[derive(Clone, ComputeService)]
pub struct Tier {
    handle: ServiceHandle,
    client: RemoteClient,
}

#[compute_service]
impl Tier {
    /// A register's version, from the tier's replica of the host's.
    #[compute]
    pub async fn value(&self, key: i64) -> Result<i64, String> {
        match self
            .client
            .replica::<_, Result<i64, String>>("Registers.value", (key,))
            .await
        {
            Ok(answer) => answer,
            Err(e) => Err(e.to_string()),
        }
    }
}

/// The tier's runtime: one thread of its own, so that the run can freeze the tier whole
/// (its readers, its client's reader and its liveness task) as a paused tier process would
/// be, while its host runs on.
pub struct TierRuntime {
    handle: tokio::runtime::Handle,
}

impl TierRuntime {
    /// Starts the thread and its runtime (which lives as long as the process).
    pub fn start() -> anyhow::Result<TierRuntime> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("checker-tier".to_owned())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the tier's runtime");
                let _ = tx.send(runtime.handle().clone());
                runtime.block_on(std::future::pending::<()>());
            })?;
        Ok(TierRuntime { handle: rx.recv()? })
    }

    /// Where the tier's tasks run.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }

    /// Freezes the tier for `d`: its thread sleeps, nothing of it runs (no timer either),
    /// then everything it missed is there at once, as after SIGCONT.
    pub fn freeze(&self, d: std::time::Duration) {
        self.handle.spawn(async move { std::thread::sleep(d) });
    }
}

impl Tier {
    /// A tier of its own registry, connected to `addr`.
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Tier> {
        let registry = Registry::new();
        let client = RemoteClient::builder()
            .registry(&registry)
            .connect_tcp(addr)
            .await?;
        Ok(Tier {
            handle: ServiceHandle::with_registry(&registry),
            client,
        })
    }

    /// How many times the client connected.
    pub fn connections(&self) -> u64 {
        self.client.connections()
    }

    /// Reads of the tier answered from its cache, and those that computed (a fetch from
    /// the host): without enough of the first, a run without stale reads shows nothing.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        let m = self.handle.registry().metrics();
        (m.hits, m.misses)
    }

    /// How many times the client's lease was renewed after it ran out.
    pub fn leases_lost(&self) -> u64 {
        self.client.leases_lost()
    }
}

/// One proxied connection: its two copying tasks, and whether it is dead (half-open:
/// whatever either side sends is dropped, and neither learns of it from here).
struct Link {
    dead: Arc<AtomicBool>,
    tasks: [JoinHandle<()>; 2],
}

/// A TCP proxy in front of a server: a link can be cut (both sockets closed) or left
/// half-open (bytes dropped both ways, sockets kept: what a NAT that forgot a connection
/// or a vanished host leaves behind), and the server made unreachable for a while (every
/// link cut, new connections closed at once: what clients see of a restart).
pub struct Proxy {
    addr: SocketAddr,
    links: Arc<Mutex<Vec<Link>>>,
    accept: JoinHandle<()>,
    /// Until when (`now_ns`) connections are refused.
    refuse_until: Arc<std::sync::atomic::AtomicU64>,
}

impl Proxy {
    /// Listens on a port of its own; each connection is forwarded to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let links: Arc<Mutex<Vec<Link>>> = Arc::default();
        let refuse_until = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let accept = {
            let (links, refuse_until) = (links.clone(), refuse_until.clone());
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    if crate::history::now_ns() < refuse_until.load(Ordering::SeqCst) {
                        // Down: closed at once, as a refused connection would be.
                        drop(inbound);
                        continue;
                    }
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        continue;
                    };
                    // Down since the connect began (an outage's `cut` found no link yet).
                    if crate::history::now_ns() < refuse_until.load(Ordering::SeqCst) {
                        continue;
                    }
                    let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
                    let dead = Arc::new(AtomicBool::new(false));
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    let tasks = [
                        tokio::spawn(copy(ir, ow, dead.clone())),
                        tokio::spawn(copy(or, iw, dead.clone())),
                    ];
                    let mut links = links.lock().unwrap();
                    links.retain(|l| !l.tasks.iter().all(JoinHandle::is_finished));
                    links.push(Link { dead, tasks });
                }
            })
        };
        Ok(Proxy {
            addr,
            links,
            accept,
            refuse_until,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection now (both sockets): the client knows at once.
    pub fn cut(&self) {
        for link in self.links.lock().unwrap().drain(..) {
            for t in link.tasks {
                t.abort();
            }
        }
    }

    /// Cuts every connection and closes new ones at once for `d`: the server is down for
    /// its clients.
    pub fn outage(&self, d: std::time::Duration) {
        let until = crate::history::now_ns() + d.as_nanos() as u64;
        self.refuse_until.store(until, Ordering::SeqCst);
        self.cut();
    }

    /// Leaves every connection open now half-open for good: nothing goes through either
    /// way, and neither side is told. New connections work.
    pub fn half_open(&self) {
        for link in self.links.lock().unwrap().iter() {
            link.dead.store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copies `from` to `to` while the link lives; once it is dead, reads and drops. An end
/// of `from` is passed on only while it lives.
async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    dead: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if dead.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    if dead.load(Ordering::SeqCst) {
        // Half-open: the other side never hears of this end. Hold the socket until the
        // link is cut.
        std::future::pending::<()>().await;
    }
    let _ = to.shutdown().await;
}
