//! The peers: what a Rust user would otherwise put in front of the store. Each holds the same
//! 1,000 `User` values and answers `get(id)` with a clone, like ours.

use std::sync::Arc;

use std::time::Duration;

use super::service::UserService;
use super::store::{seed_user, StoreError, User, USERS};
use super::{run_once, Committed, Getter, Outcome};

/// How each peer is configured, printed under the table.
pub(crate) const SETTINGS: &str = "peers: map = dashmap::DashMap (default shards, foldhash); \
moka = moka::sync::Cache (capacity 10,000); quickcache = quick_cache::sync::Cache (capacity 10,000)";

pub(crate) struct Map(dashmap::DashMap<u64, User, foldhash::fast::RandomState>);
pub(crate) struct Moka(moka::sync::Cache<u64, User>);
pub(crate) struct QuickCache(quick_cache::sync::Cache<u64, User>);

impl Getter for Map {
    #[inline]
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        Ok(*self.0.get(&id).expect("prefilled"))
    }
}

impl Getter for Moka {
    #[inline]
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        Ok(self.0.get(&id).expect("prefilled"))
    }
}

impl Getter for QuickCache {
    #[inline]
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        Ok(self.0.get(&id).expect("prefilled"))
    }
}

fn users() -> impl Iterator<Item = (u64, User)> {
    (1..=USERS).map(|id| (id, seed_user(id)))
}

/// A contender of the side-by-side rounds: ours or a peer.
pub(crate) enum Peer {
    Ours(Arc<UserService>),
    Map(Arc<Map>),
    Moka(Arc<Moka>),
    QuickCache(Arc<QuickCache>),
}

impl Peer {
    /// One single-reader run.
    pub(crate) async fn run_once(&self, committed: &Arc<Committed>, duration: Duration) -> Outcome {
        match self {
            Peer::Ours(p) => run_once(p, 1, None, None, committed, duration).await,
            Peer::Map(p) => run_once(p, 1, None, None, committed, duration).await,
            Peer::Moka(p) => run_once(p, 1, None, None, committed, duration).await,
            Peer::QuickCache(p) => run_once(p, 1, None, None, committed, duration).await,
        }
    }
}

/// A peer's name and how to build it, prefilled.
pub(crate) type PeerMaker = (&'static str, fn() -> Peer);

pub(crate) fn all() -> Vec<PeerMaker> {
    vec![
        ("map", || {
            let map = dashmap::DashMap::with_hasher(foldhash::fast::RandomState::default());
            users().for_each(|(id, user)| {
                map.insert(id, user);
            });
            Peer::Map(Arc::new(Map(map)))
        }),
        ("moka", || {
            let cache = moka::sync::Cache::new(10_000);
            users().for_each(|(id, user)| cache.insert(id, user));
            Peer::Moka(Arc::new(Moka(cache)))
        }),
        ("quickcache", || {
            let cache = quick_cache::sync::Cache::new(10_000);
            users().for_each(|(id, user)| cache.insert(id, user));
            Peer::QuickCache(Arc::new(QuickCache(cache)))
        }),
    ]
}

impl Peer {
    /// `calls` calls of `get`, ids drawn from `seed`; answers the sum of the versions read.
    pub(crate) async fn call_n(&self, calls: u64, seed: u64) -> u64 {
        async fn calls_on<G: Getter>(getter: &G, calls: u64, seed: u64) -> u64 {
            let mut ids = super::Ids(seed);
            let mut sum = 0u64;
            for _ in 0..calls {
                let user = std::hint::black_box(getter.get(ids.next()).await.expect("answers"));
                sum = sum.wrapping_add(user.id ^ user.version);
            }
            sum
        }
        match self {
            Peer::Ours(p) => calls_on(&**p, calls, seed).await,
            Peer::Map(p) => calls_on(&**p, calls, seed).await,
            Peer::Moka(p) => calls_on(&**p, calls, seed).await,
            Peer::QuickCache(p) => calls_on(&**p, calls, seed).await,
        }
    }
}
