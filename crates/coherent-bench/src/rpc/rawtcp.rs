//! `rawtcp`: the least an RPC must do, as a practical limit. Frames are
//! `[u32 len][u64 id][u8 method][postcard payload]`; per connection one writer task drains
//! its queue into one buffer and one socket write (yielding once when the batch is small,
//! as ours does), one reader task completes callers' replies. The server answers inline
//! in its reader: no task per call, no cancellation, no limits, no handshake.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use super::model::{self, Hello, User};
use super::peer::Peer;

/// A std mutex: held only for a map insert or remove, never across an `.await`.
type Mutex<T> = std::sync::Mutex<T>;

const SUM: u8 = 1;
const GET_USER: u8 = 2;
const SAY_HELLO: u8 = 3;

fn frame(id: u64, method: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(13 + payload.len());
    out.put_u32_le(9 + payload.len() as u32);
    out.put_u64_le(id);
    out.put_u8(method);
    out.extend_from_slice(payload);
    out
}

/// Drains the queue into batches; one write per batch.
async fn write_loop(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
) {
    let mut buf = Vec::with_capacity(64 * 1024);
    while let Some(first) = rx.recv().await {
        buf.extend_from_slice(&first);
        let mut yielded = false;
        loop {
            match rx.try_recv() {
                Ok(f) => buf.extend_from_slice(&f),
                Err(_) if !yielded && buf.len() < 4096 => {
                    yielded = true;
                    tokio::task::yield_now().await;
                }
                Err(_) => break,
            }
            if buf.len() >= 64 * 1024 {
                break;
            }
        }
        if wr.write_all(&buf).await.is_err() {
            return;
        }
        buf.clear();
    }
}

/// Reads frames; calls `on_frame(id, method, payload)` for each.
async fn read_loop(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    mut on_frame: impl FnMut(u64, u8, Bytes),
) {
    let mut buf = BytesMut::with_capacity(64 * 1024);
    loop {
        while buf.len() >= 4 {
            let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
            if buf.len() < 4 + len {
                buf.reserve(4 + len - buf.len());
                break;
            }
            buf.advance(4);
            let mut f = buf.split_to(len);
            let id = f.get_u64_le();
            let method = f.get_u8();
            on_frame(id, method, f.freeze());
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn answer(method: u8, payload: &[u8]) -> Option<Vec<u8>> {
    Some(match method {
        SUM => {
            let (a, b): (i32, i32) = postcard::from_bytes(payload).ok()?;
            postcard::to_stdvec(&a.wrapping_add(b)).ok()?
        }
        GET_USER => {
            let (id,): (i64,) = postcard::from_bytes(payload).ok()?;
            postcard::to_stdvec(&model::user(id)).ok()?
        }
        SAY_HELLO => {
            let (h,): (Hello,) = postcard::from_bytes(payload).ok()?;
            postcard::to_stdvec(&h).ok()?
        }
        _ => return None,
    })
}

pub(crate) async fn start() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let (rd, wr) = stream.into_split();
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(write_loop(wr, rx));
            tokio::spawn(read_loop(rd, move |id, method, payload| {
                if let Some(reply) = answer(method, &payload) {
                    let _ = tx.send(frame(id, method, &reply));
                }
            }));
        }
    });
    Ok(addr)
}

struct Inner {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    pending: Arc<Mutex<HashMap<u64, oneshot::Sender<Bytes>>>>,
    next: AtomicU64,
}

#[derive(Clone)]
pub(crate) struct RawTcp(Arc<Inner>);

impl RawTcp {
    async fn call<A: Serialize, R: DeserializeOwned>(
        &self,
        method: u8,
        args: A,
    ) -> anyhow::Result<R> {
        let id = self.0.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.0.pending.lock().expect("not poisoned").insert(id, tx);
        self.0
            .tx
            .send(frame(id, method, &postcard::to_stdvec(&args)?))?;
        let reply = rx.await?;
        Ok(postcard::from_bytes(&reply)?)
    }
}

impl Peer for RawTcp {
    const NAME: &'static str = "rawtcp";

    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(write_loop(wr, rx));
        let pending: Arc<Mutex<HashMap<u64, oneshot::Sender<Bytes>>>> = Arc::default();
        let p = pending.clone();
        tokio::spawn(read_loop(rd, move |id, _, payload| {
            if let Some(tx) = p.lock().expect("not poisoned").remove(&id) {
                let _ = tx.send(payload);
            }
        }));
        Ok(Self(Arc::new(Inner {
            tx,
            pending,
            next: AtomicU64::new(0),
        })))
    }

    async fn sum(&self, a: i32, b: i32) -> anyhow::Result<i32> {
        self.call(SUM, (a, b)).await
    }

    async fn get_user(&self, id: i64) -> anyhow::Result<User> {
        self.call(GET_USER, (id,)).await
    }

    async fn say_hello(&self, hello: Hello) -> anyhow::Result<Hello> {
        self.call(SAY_HELLO, (hello,)).await
    }
}
