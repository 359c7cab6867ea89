//! A cached hit of a method returning an `Arc<T>` or a `Copy` type allocates nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};

/// Counts allocations made by the thread that enabled counting.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: defers every operation to the system allocator; only counts on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNTING.try_with(|on| {
            if on.get() {
                ALLOCATIONS.with(|n| n.set(n.get() + 1));
            }
        });
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations_during(f: impl FnOnce()) -> usize {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|on| on.set(true));
    f();
    COUNTING.with(|on| on.set(false));
    ALLOCATIONS.with(Cell::get)
}

/// Polls a future that must complete at once (a cache hit), without any runtime.
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("a cache hit completed without waiting"),
    }
}

#[derive(Debug, PartialEq)]
struct User {
    id: u64,
    name: String,
}

#[derive(Clone, ComputeService)]
struct Users {
    handle: ServiceHandle,
}

#[compute_service]
impl Users {
    #[compute]
    async fn get(&self, id: u64) -> Arc<User> {
        Arc::new(User {
            id,
            name: format!("user {id}"),
        })
    }

    #[compute]
    async fn age(&self, id: u64) -> u32 {
        id as u32 % 90
    }

    #[compute]
    async fn find(&self, id: u64) -> Result<Arc<User>, Arc<str>> {
        Ok(self.get(id).await)
    }
}

#[tokio::test]
async fn a_cache_hit_allocates_nothing() {
    let users = Users {
        handle: ServiceHandle::with_registry(&Registry::new()),
    };
    for id in 0..100 {
        users.get(id).await;
        users.age(id).await;
        users.find(id).await.unwrap();
    }
    let allocations = allocations_during(|| {
        for _ in 0..10 {
            for id in 0..100 {
                assert_eq!(ready(users.get(id)).id, id);
                assert_eq!(ready(users.age(id)), id as u32 % 90);
                assert_eq!(ready(users.find(id)).unwrap().id, id);
            }
        }
    });
    assert_eq!(allocations, 0);
}
