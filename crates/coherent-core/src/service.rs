//! Compute services: a `ServiceHandle` inside the user's struct owns the tables of its compute
//! methods, one per method, found by the method's process-wide index without a map lookup.

use std::any::{Any, TypeId};
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::options::{ComputeOptions, OutputKind};
use crate::registry::{Prunable, Registry};
use crate::sync::Arc;
use crate::table::Table;

/// A struct whose `#[compute]` methods are memoized. Usually derived:
///
/// ```
/// use coherent_core::{ComputeService, ServiceHandle};
///
/// #[derive(Clone)]
/// struct Greeter {
///     handle: ServiceHandle,
/// }
///
/// impl ComputeService for Greeter {
///     fn compute_handle(&self) -> &ServiceHandle {
///         &self.handle
///     }
/// }
/// ```
///
/// A clone of a service is the same service: it shares the handle, hence the cached results.
pub trait ComputeService: Clone + Send + Sync + 'static {
    /// The handle that owns this service's cached results.
    fn compute_handle(&self) -> &ServiceHandle;
}

/// A compute method, as the macro describes it: its name, options, and a process-wide index.
pub struct MethodDescriptor {
    name: &'static str,
    options: ComputeOptions,
    index: AtomicUsize,
    /// Handles that made a table for this method, each with that table's slot: a method is
    /// usually served by one service instance, or a few, whose calls then reach their table
    /// from this static with no chain of loads through the handle. The first [`HOMES`] handles
    /// take the places in order; a handle that makes its table after the handle in a place was
    /// dropped takes that place, at most [`HOME_MOVES`] times in all. A replaced `Home` is
    /// leaked (a hit may be reading it), so the moves are bounded: services created and
    /// dropped over and over keep the chain of loads.
    homes: [AtomicPtr<Home>; HOMES],
    home_moves: AtomicUsize,
}

/// How many handles per method reach their table from the method's static.
const HOMES: usize = 4;
/// How many times, in all, a method's home places may go to another handle.
const HOME_MOVES: usize = 16;

/// See [`MethodDescriptor::homes`]. The `Weak` keeps the handle's allocation (not its tables)
/// alive, so that no other handle can be allocated at its address: a handle whose address
/// equals `handle`'s is that handle, alive, and `slot` is its slot.
struct Home {
    handle: std::sync::Weak<HandleInner>,
    slot: *const Slot,
}

// SAFETY: `slot` is only dereferenced while its handle is proven alive (see `Home`), and a
// `Slot` is `Send + Sync`.
unsafe impl Send for Home {}
// SAFETY: as above.
unsafe impl Sync for Home {}

const UNASSIGNED: usize = usize::MAX;
const CHUNK: usize = 64;
const CHUNKS: usize = 64;
/// The most compute methods one process may declare.
pub const MAX_METHODS: usize = CHUNK * CHUNKS;

static NEXT_INDEX: AtomicUsize = AtomicUsize::new(0);

impl MethodDescriptor {
    /// Describes a method; used in a `static` by generated code.
    pub const fn new(name: &'static str, options: ComputeOptions) -> Self {
        Self {
            name,
            options,
            index: AtomicUsize::new(UNASSIGNED),
            homes: [const { AtomicPtr::new(std::ptr::null_mut()) }; HOMES],
            home_moves: AtomicUsize::new(0),
        }
    }

    /// The method's name, e.g. `"UserService::get"`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The method's options.
    pub fn options(&self) -> &ComputeOptions {
        &self.options
    }

    /// Gives `handle` a home place of this method: an empty one, or one whose handle was
    /// dropped while places may still move.
    fn offer_home(&self, handle: &Arc<HandleInner>, slot: *const Slot) {
        let fresh = Box::into_raw(Box::new(Home {
            handle: Arc::downgrade(handle),
            slot,
        }));
        for place in &self.homes {
            let current = place.load(Ordering::Acquire);
            if !current.is_null() {
                // SAFETY: a published `Home` is never freed.
                if unsafe { &*current }.handle.strong_count() > 0
                    || self.home_moves.fetch_add(1, Ordering::Relaxed) >= HOME_MOVES
                {
                    continue;
                }
            }
            if place
                .compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // The replaced `Home`, if any, is leaked on purpose: a hit may be reading it.
                return;
            }
        }
        // No place: this handle keeps the chain of loads.
        // SAFETY: `fresh` came from `Box::into_raw` above and was never published.
        drop(unsafe { Box::from_raw(fresh) });
    }

    #[inline]
    fn index(&self) -> usize {
        let index = self.index.load(Ordering::Relaxed);
        if index != UNASSIGNED {
            return index;
        }
        self.assign_index()
    }

    #[cold]
    fn assign_index(&self) -> usize {
        let fresh = NEXT_INDEX.fetch_add(1, Ordering::Relaxed);
        match self
            .index
            .compare_exchange(UNASSIGNED, fresh, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => fresh,
            Err(taken) => taken,
        }
    }
}

impl fmt::Debug for MethodDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MethodDescriptor")
            .field("name", &self.name)
            .field("options", &self.options)
            .finish()
    }
}

/// A method's table: its type id and a thin pointer to it beside the owning `Arc`, so that the
/// hit path checks the type with a compare (`downcast_ref` would make a virtual call) and
/// reaches the table with one load (`Arc::as_ptr` on a `dyn` reads the vtable's alignment).
struct Slot {
    type_id: TypeId,
    table: *const (),
    _owner: Arc<dyn Any + Send + Sync>,
}

// SAFETY: `table` points into `_owner`, a `Send + Sync` value that the slot keeps alive; the
// pointer is only read, never used to mutate.
unsafe impl Send for Slot {}
// SAFETY: as above.
unsafe impl Sync for Slot {}

/// The part of a compute service that owns its cached results. Put one in the service struct;
/// clones share it.
#[derive(Clone)]
pub struct ServiceHandle {
    inner: Arc<HandleInner>,
}

/// A second-level array of slots; a null pointer is an empty slot.
struct HandleInner {
    registry: Registry,
    /// Two levels, allocated on first use, so that a handle costs a few hundred bytes until its
    /// methods are called, and the hit path finds its table with two loads and no lock. A slot
    /// never moves once set (its chunk is boxed), so a `Home` may point at it.
    chunks: [OnceLock<Box<[OnceLock<Slot>; CHUNK]>>; CHUNKS],
}

impl ServiceHandle {
    /// A handle whose results live in the [global registry](Registry::global).
    pub fn new() -> Self {
        Self::with_registry(Registry::global())
    }

    /// A handle whose results live in `registry`.
    pub fn with_registry(registry: &Registry) -> Self {
        Self {
            inner: Arc::new(HandleInner {
                registry: registry.clone(),
                chunks: [const { OnceLock::new() }; CHUNKS],
            }),
        }
    }

    /// The registry holding this service's results.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The table of `method`, created on first use.
    ///
    /// # Panics
    /// If the process declares more than [`MAX_METHODS`] compute methods, or if one handle is
    /// shared by services whose same method has different argument or output types.
    #[inline(always)]
    pub fn table<K, T>(
        &self,
        method: &'static MethodDescriptor,
        classify: fn(&T) -> OutputKind,
    ) -> &Table<K, T>
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
        T: Clone + Send + Sync + 'static,
    {
        for place in &method.homes {
            // SAFETY: a published `Home` is never freed (see `MethodDescriptor::homes`).
            let Some(home) = (unsafe { place.load(Ordering::Acquire).as_ref() }) else {
                // Places are taken in order: none further on is taken either.
                break;
            };
            if std::ptr::eq(home.handle.as_ptr(), Arc::as_ptr(&self.inner)) {
                // SAFETY: `self` is this home's handle, alive (see `Home`), so its slot is.
                let slot = unsafe { &*home.slot };
                if slot.type_id == TypeId::of::<Table<K, T>>() {
                    // SAFETY: as below.
                    return unsafe { &*slot.table.cast::<Table<K, T>>() };
                }
                break;
            }
        }
        let index = method.index();
        let slot = self
            .inner
            .chunks
            .get(index / CHUNK)
            .and_then(OnceLock::get)
            .and_then(|chunk| chunk[index % CHUNK].get());
        let slot = match slot {
            Some(slot) => slot,
            None => self.create_table::<K, T>(method, classify, index),
        };
        if slot.type_id != TypeId::of::<Table<K, T>>() {
            mismatched_types(method)
        }
        // SAFETY: the slot's table was created as a `Table<K, T>` (its type id, stored with it,
        // matches), and the slot's `Arc` keeps it alive as long as the slot, which outlives the
        // returned borrow of `self`.
        unsafe { &*slot.table.cast::<Table<K, T>>() }
    }

    /// The miss of [`table`](Self::table): creates the chunk and the table, or finds what a
    /// racing thread created.
    #[cold]
    #[inline(never)]
    fn create_table<K, T>(
        &self,
        method: &'static MethodDescriptor,
        classify: fn(&T) -> OutputKind,
        index: usize,
    ) -> &Slot
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
        T: Clone + Send + Sync + 'static,
    {
        let Some(chunk) = self.inner.chunks.get(index / CHUNK) else {
            too_many_methods()
        };
        let chunk = chunk.get_or_init(|| Box::new([const { OnceLock::new() }; CHUNK]));
        let mut created = false;
        let slot = chunk[index % CHUNK].get_or_init(|| {
            created = true;
            let table = Arc::new(Table::<K, T>::new(
                self.inner.registry.clone(),
                method,
                classify,
            ));
            let weak = Arc::downgrade(&table);
            self.inner.registry.register_table(weak as _);
            Slot {
                type_id: TypeId::of::<Table<K, T>>(),
                table: Arc::as_ptr(&table).cast(),
                _owner: table as Arc<dyn Any + Send + Sync>,
            }
        });
        if created {
            method.offer_home(&self.inner, slot);
        }
        slot
    }
}

#[cold]
#[inline(never)]
fn mismatched_types(method: &MethodDescriptor) -> ! {
    panic!(
        "coherent: one ServiceHandle is shared by services whose method {} has different types",
        method.name()
    )
}

#[cold]
#[inline(never)]
fn too_many_methods() -> ! {
    panic!("coherent: more than {MAX_METHODS} compute methods in one process")
}

// Keeps the Weak<dyn Prunable> coercion above honest: a table is prunable.
const _: fn() = || {
    fn assert_prunable<P: Prunable>() {}
    assert_prunable::<Table<u8, u8>>();
};

impl Default for ServiceHandle {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ServiceHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceHandle")
            .field("registry", &self.inner.registry)
            .finish_non_exhaustive()
    }
}
