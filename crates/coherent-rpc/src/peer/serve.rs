//! Running the other side's calls: [`start_call`] checks the method, the endpoint's queue
//! budget, the `inbound` limit (every kind of call: unary, one-way, streams, uploads) and
//! the call id, polls a unary handler inline first (only one that waits is spawned as
//! a task), spawns a streaming handler (its items go out through `streams`), and records
//! each running call in `inbound`; [`answer`] sends a unary call's reply.
//!
//! Invariants: only the reader inserts into `inbound`, and a call's task is spawned under
//! the table's lock, so that it finds its own entry; whoever removes the entry (the task
//! when done, a `Cancel`, the close) owns the answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;

use futures::FutureExt;
use tokio::sync::{mpsc, Semaphore};
use tracing::Instrument;

use crate::codec::Message;
use crate::error::{ErrorCode, RpcError};
use crate::frame::{Header, Kind};
use crate::service::{CallContext, MethodKind, Response, CONTEXT};

use super::streams::produce;
use super::{Inbound, Peer, Shared};

pub(super) fn start_call(shared: &Arc<Shared>, h: Header, args: Bytes, lone: bool) {
    let s = &**shared;
    let id = h.call_id;
    let reply = h.kind == Kind::Call;
    let fail = |e: RpcError| {
        if reply {
            let _ = s.send_lone(Kind::Error, id, 0, Bytes::from(e.to_payload()), lone);
        }
    };
    let Some(entry) = s.registry.get(h.method_id) else {
        return fail(RpcError::new(
            ErrorCode::UnknownMethod,
            format!("no method with id {:#010x}", h.method_id),
        ));
    };
    // Most connections have nothing queued: the endpoint-wide sum is read only by those
    // that do.
    let queued = s.queued.load(Ordering::Relaxed);
    if queued > 0 && s.totals.over_fair_share(queued) {
        s.totals
            .refusals()
            .calls_refused
            .fetch_add(1, Ordering::Relaxed);
        return fail(RpcError::new(
            ErrorCode::Overloaded,
            "the endpoint's send queues are over their budget, and this connection holds \
             more than its share: read the answers before making more calls",
        ));
    }
    let inbound = s.inbound.lock();
    if inbound.len() >= s.settings.max_inbound as usize {
        drop(inbound);
        s.totals
            .refusals()
            .calls_refused
            .fetch_add(1, Ordering::Relaxed);
        return fail(RpcError::new(
            ErrorCode::Overloaded,
            format!(
                "{} calls already running on this connection",
                s.settings.max_inbound
            ),
        ));
    }
    if inbound.contains_key(&id) {
        drop(inbound);
        return fail(RpcError::protocol(format!(
            "call id {id} is already running"
        )));
    }
    s.counters.calls_in.fetch_add(1, Ordering::Relaxed);
    // A method that takes an upload reads it through its call context.
    let (upload, upload_rx) = if entry.kind == MethodKind::Upload {
        let (tx, rx) = mpsc::unbounded_channel();
        let buffered = Arc::new(std::sync::atomic::AtomicU32::new(0));
        (Some((tx, buffered.clone())), Some((rx, buffered)))
    } else {
        (None, None)
    };
    // Shared by the contexts made below (inline poll, then the task if it waits).
    let upload_slot = upload_rx.map(|u| Arc::new(parking_lot::Mutex::new(Some(u))));
    let context = || CallContext {
        peer: Peer::unowned(shared.clone()),
        call_id: id,
        method_id: h.method_id,
        upload: upload_slot.clone(),
    };
    // Skipped where no subscriber takes debug anywhere (tracing's own hint: the span would
    // be disabled); otherwise the macro decides, by the span's own callsite. A disabled
    // span made, entered and dropped cost about 190 instructions a call (of some 6,000,
    // both ends) in `tracing`'s fallback to `log`, on wherever a crate of the build
    // enables `tracing`'s `log` feature (that fallback's span lines are what is lost).
    let span = if tracing::Level::DEBUG <= tracing::level_filters::LevelFilter::current() {
        tracing::debug_span!("rpc.serve", call_id = id, method_id = h.method_id)
    } else {
        tracing::Span::none()
    };
    // Unlocked while the handler runs inline: a handler may look at this connection.
    drop(inbound);
    let response = entry.service.call(entry.index, args, s.settings.format);
    let (credits, task) = match response {
        Response::Unary(fut) => {
            // Most handlers finish without waiting: answering inline saves a task spawn and
            // a wake-up per call (and, polled here in a synchronous scope, an allocation).
            // One that waits is polled again by its task, which registers the real waker.
            let mut fut = Some(fut);
            let polled = {
                let _entered = span.enter();
                let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
                CONTEXT.sync_scope(context(), || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        fut.as_mut()
                            .expect("not yet dropped")
                            .as_mut()
                            .poll(&mut cx)
                    }));
                    if !matches!(r, Ok(std::task::Poll::Pending)) {
                        // Finished or panicked: dropped here, where its `Drop` still sees
                        // the call's context.
                        let done = fut.take();
                        let _ =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(done)));
                    }
                    r
                })
            };
            match polled {
                Ok(std::task::Poll::Ready(r)) => return answer(s, id, reply, Ok(r), lone),
                Err(panic) => return answer(s, id, reply, Err(panic), lone),
                Ok(std::task::Poll::Pending) => {}
            }
            let fut = fut.expect("pending, so not dropped");
            let fut = CONTEXT.scope(context(), std::panic::AssertUnwindSafe(fut).catch_unwind());
            let sh = shared.clone();
            let task = async move {
                let r = fut.await;
                // Whoever removes the entry owns the answer: if `Cancel` got it first,
                // the caller no longer waits.
                if sh.inbound.lock().remove(&id).is_some() {
                    answer(&sh, id, reply, r, false);
                }
            };
            (None, task.boxed())
        }
        Response::Stream(fut) => {
            let credits = Arc::new(Semaphore::new(
                s.remote.window.load(Ordering::Relaxed) as usize
            ));
            let c = credits.clone();
            let sh = shared.clone();
            let task = async move {
                let end = std::panic::AssertUnwindSafe(produce(&sh, id, fut, &c))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| {
                        Err(RpcError::new(ErrorCode::Internal, "the handler panicked"))
                    });
                if sh.inbound.lock().remove(&id).is_some() {
                    let _ = match end {
                        Ok(()) => sh.send(Kind::StreamEnd, id, 0, Bytes::new()),
                        Err(e) => sh.send(Kind::Error, id, 0, Bytes::from(e.to_payload())),
                    };
                }
            };
            (Some(credits), CONTEXT.scope(context(), task).boxed())
        }
    };
    debug_assert!(entry.kind != MethodKind::Stream || credits.is_some());
    // Spawned while holding the table's lock so that the task, which removes its own
    // entry when done, always finds it there. Only this reader inserts, so the checks
    // made above still hold.
    let mut inbound = s.inbound.lock();
    let handle = tokio::spawn(task.instrument(span));
    inbound.insert(
        id,
        Inbound {
            abort: handle.abort_handle(),
            credits,
            upload,
        },
    );
}

/// Sends a unary call's answer (nothing for a one-way call).
/// `lone`: see [`route`].
///
/// [`route`]: super::reader::route
fn answer(
    s: &Shared,
    id: u64,
    reply: bool,
    r: std::thread::Result<Result<Message, RpcError>>,
    lone: bool,
) {
    if !reply {
        return;
    }
    let r = r.unwrap_or_else(|_| Err(RpcError::new(ErrorCode::Internal, "the handler panicked")));
    let sent = match r {
        Ok(bytes) => s.send_lone(Kind::Ok, id, 0, bytes, lone),
        Err(e) => s.send_lone(Kind::Error, id, 0, Bytes::from(e.to_payload()), lone),
    };
    if let Err(e) = sent {
        let _ = s.send(Kind::Error, id, 0, Bytes::from(e.to_payload()));
    }
}
