//! Dependency capture. While the body of a compute method is polled, the computed it produces is
//! "current" on that thread; every compute method or state read during the poll records itself
//! as a dependency of it. The context travels with the future, not the task, so it survives
//! `.await` points and nests: an inner compute sets its own context for its own polls.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::node::{record_use, AnyComputed};
use crate::sync::Arc;

thread_local! {
    static CURRENT: Cell<Option<Arc<dyn AnyComputed>>> = const { Cell::new(None) };
}

/// Records `dependency` as used by the computed whose body is being polled on this thread, if
/// any. Cheap when there is none: a thread-local read.
#[inline]
pub(crate) fn record(dependency: impl FnOnce() -> Arc<dyn AnyComputed>) {
    CURRENT.with(|current| {
        let dependant = current.take();
        if let Some(dependant) = &dependant {
            record_use(dependant, dependency());
        }
        current.set(dependant);
    });
}

/// Whether a compute body is being polled on this thread.
#[inline]
pub(crate) fn is_capturing() -> bool {
    CURRENT.with(|current| {
        // SAFETY: a read of this thread's own cell, with no reference into it kept: nothing can
        // write the cell while this expression runs. (A `take` and `set` would write it twice on
        // every cache hit.)
        unsafe { (*current.as_ptr()).is_some() }
    })
}

/// Polls `inner` with `node` as the current computed.
pub(crate) struct Capture<F> {
    node: Option<Arc<dyn AnyComputed>>,
    inner: F,
}

impl<F> Capture<F> {
    pub(crate) fn new(node: Option<Arc<dyn AnyComputed>>, inner: F) -> Self {
        Self { node, inner }
    }
}

/// Puts the outer context back even if the inner poll panics.
struct Restore<'a> {
    slot: &'a mut Option<Arc<dyn AnyComputed>>,
    outer: Option<Arc<dyn AnyComputed>>,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        let outer = self.outer.take();
        *self.slot = CURRENT.with(|current| current.replace(outer));
    }
}

impl<F: Future> Future for Capture<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `inner` is structurally pinned: it is never moved out of `self`, and `node` is
        // an ordinary field that is only swapped, never pinned.
        let this = unsafe { self.get_unchecked_mut() };
        let outer = CURRENT.with(|current| current.replace(this.node.take()));
        let _restore = Restore {
            slot: &mut this.node,
            outer,
        };
        // SAFETY: see above; `inner` stays in place for the whole life of `self`.
        let inner = unsafe { Pin::new_unchecked(&mut this.inner) };
        inner.poll(cx)
    }
}

/// Runs `future` with dependency capture suspended: what it reads is not recorded as a
/// dependency of the enclosing compute method.
pub fn untracked<F: Future>(future: F) -> impl Future<Output = F::Output> {
    Capture::new(None, future)
}
