//! What the processes of the `cluster` suite share to count stale reads: the board (per user,
//! the latest version whose command returned to the mutator, and when), in a file mapped
//! into every process; and, per host process, the floors (per user, the latest version whose
//! operation that host applied).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use memmap2::MmapMut;

use crate::local::store::USERS;

/// A read that starts this long after a write returned must see it (the `stale_reads` rule).
pub(crate) const GRACE_US: u64 = 10_000;

/// A slot packs the version (high 24 bits) and the time the command returned (low 40 bits,
/// µs since the run's base: 12 days), so that a reader loads both with one atomic load and
/// never pairs a new version with an old time.
const TIME_BITS: u32 = 40;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;

/// Microseconds since the Unix epoch, by the wall clock (the clock `Applied` events use).
pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Per user, the latest version whose command returned to the mutator, and when (µs after
/// the run's base), shared by the parent (which writes it after each command returns) and
/// the hosts' readers (which read it as each read starts).
pub(crate) struct Board {
    map: MmapMut,
    path: PathBuf,
    /// The file, removed when the parent's board is dropped.
    _file: Option<tempfile::NamedTempFile>,
}

impl Board {
    fn len() -> u64 {
        (USERS + 1) * 8
    }

    /// A fresh board (every user at version 0), in /dev/shm where there is one.
    pub(crate) fn create() -> anyhow::Result<Self> {
        let dir = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let file = tempfile::Builder::new()
            .prefix("coherent-bench-board-")
            .tempfile_in(dir)?;
        file.as_file().set_len(Self::len())?;
        // SAFETY: the file is ours (a fresh temporary file); the other processes that map it
        // only touch it through the atomics below.
        let map = unsafe { MmapMut::map_mut(file.as_file())? };
        Ok(Self {
            map,
            path: file.path().to_owned(),
            _file: Some(file),
        })
    }

    /// The board the parent created at `path`.
    pub(crate) fn open(path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        anyhow::ensure!(
            file.metadata()?.len() >= Self::len(),
            "board file too short"
        );
        // SAFETY: the file is the parent's board; every process touches it only through the
        // atomics below.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Self {
            map,
            path: path.to_owned(),
            _file: None,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    #[inline]
    fn slot(&self, id: u64) -> &AtomicU64 {
        assert!(id <= USERS);
        // SAFETY: the map is page-aligned and at least `len()` bytes long (checked at open),
        // so slot `id` is an aligned u64 inside it; it is only ever accessed atomically, by
        // every process, and it lives as long as `self`.
        unsafe { &*self.map.as_ptr().cast::<AtomicU64>().add(id as usize) }
    }

    /// Records that the command writing `version` of user `id` returned at `at_us` (µs after
    /// the base).
    pub(crate) fn publish(&self, id: u64, version: u64, at_us: u64) {
        assert!(version < 1 << (64 - TIME_BITS), "version out of range");
        self.slot(id).store(
            (version << TIME_BITS) | (at_us & TIME_MASK),
            Ordering::Release,
        );
    }

    /// The latest returned version of user `id`, and when it returned (µs after the base).
    #[inline]
    pub(crate) fn read(&self, id: u64) -> (u64, u64) {
        let packed = self.slot(id).load(Ordering::Acquire);
        (packed >> TIME_BITS, packed & TIME_MASK)
    }
}

/// Per user, the latest version whose operation this host applied (its invalidation ran
/// here, for our hosts).
pub(crate) struct Floors(Vec<AtomicU64>);

impl Floors {
    pub(crate) fn new() -> Self {
        Self((0..=USERS).map(|_| AtomicU64::new(0)).collect())
    }

    /// Called after the invalidation of `version` of user `id` ran on this host.
    pub(crate) fn raise(&self, id: u64, version: u64) {
        if let Some(slot) = self.0.get(id as usize) {
            slot.fetch_max(version, Ordering::Release);
        }
    }

    #[inline]
    pub(crate) fn get(&self, id: u64) -> u64 {
        self.0[id as usize].load(Ordering::Acquire)
    }
}
