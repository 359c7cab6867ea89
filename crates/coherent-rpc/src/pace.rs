//! Rates of calls: how many a stranger's connection (or every connection from one address)
//! may start per second, and a [`Pacer`] that holds them to it.
//!
//! A paced connection is not refused anything: its reader waits before it starts a call
//! over the rate, and reads nothing meanwhile, so that the client's next frames wait in
//! its own socket buffer. A client within its rate never waits; one that sends calls in a
//! closed loop as fast as the server answers is held to the rate, and what it costs the
//! server is bounded by the rate, not by how fast it can send. See
//! [`Config::untrusted_call_rate`](crate::Config::untrusted_call_rate) and
//! [`Pacer`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// A rate: `per_second` on average, with up to `burst` at once after a quiet spell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    per_second: f64,
    burst: u32,
}

impl Rate {
    /// 100 a second, 200 at once: the default of
    /// [`Config::untrusted_call_rate`](crate::Config::untrusted_call_rate).
    pub const DEFAULT_UNTRUSTED: Rate = Rate {
        per_second: 100.0,
        burst: 200,
    };

    /// `n` per second (at least 1), with a burst of `2 * n`.
    pub fn per_second(n: u32) -> Self {
        let n = n.max(1);
        Self {
            per_second: f64::from(n),
            burst: n.saturating_mul(2),
        }
    }

    /// The most taken at once after a quiet spell (at least 1).
    pub fn burst(mut self, n: u32) -> Self {
        self.burst = n.max(1);
        self
    }

    /// `n` times the rate and the burst (`n` at least 1): what `n` clients of this rate
    /// take together.
    pub fn times(self, n: u32) -> Self {
        let n = n.max(1);
        Self {
            per_second: self.per_second * f64::from(n),
            burst: self.burst.saturating_mul(n),
        }
    }

    /// The average per second.
    pub fn average(&self) -> f64 {
        self.per_second
    }

    /// The burst.
    pub fn max_burst(&self) -> u32 {
        self.burst
    }

    /// Time between two takes at the average rate.
    fn interval(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.per_second)
    }
}

/// A token bucket over a [`Rate`] (kept as the generic cell rate algorithm: one instant,
/// the time at which the bucket is full again), shared by its clones: one per connection,
/// or one for every connection of one address, given to the endpoint by the HTTP server
/// that accepted the address's WebSockets (see
/// [`Endpoint::websocket_handler`](crate::Endpoint::websocket_handler)).
///
/// ```
/// use coherent_rpc::pace::{Pacer, Rate};
/// use std::time::Duration;
///
/// let pacer = Pacer::new(Rate::per_second(10).burst(2));
/// assert_eq!(pacer.delay(), Duration::ZERO);
/// assert_eq!(pacer.delay(), Duration::ZERO);
/// // The third within the same instant waits for its tenth of a second.
/// assert!(pacer.delay() > Duration::from_millis(90));
/// // And one that may wait at most 50 ms is not taken, and told how long it would be.
/// assert!(pacer.take_within(Duration::from_millis(50)).is_err());
/// ```
#[derive(Clone, Debug)]
pub struct Pacer(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    rate: Rate,
    /// A wider bucket every take also takes from (see [`Pacer::within`]).
    parent: Option<Pacer>,
    interval: Duration,
    /// `(burst - 1) * interval`: how far ahead of now `full_at` may be with no wait.
    tolerance: Duration,
    /// When the bucket is full again: every take moves it one interval on.
    full_at: Mutex<Option<Instant>>,
    delayed: AtomicU64,
    refused: AtomicU64,
}

/// What a [`Pacer`] counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PaceStats {
    /// Takes that had to wait.
    pub delayed: u64,
    /// Takes refused by [`Pacer::take_within`].
    pub refused: u64,
}

impl Pacer {
    /// A full bucket.
    pub fn new(rate: Rate) -> Self {
        Self::with_parent(rate, None)
    }

    /// A full bucket whose takes also take from `parent` and wait for the longer of the
    /// two: the pacer of one client within the pacer of the group it belongs to (an IPv6
    /// address within its provider's network), so that the group as a whole is held to
    /// the parent's rate however many clients it has. A take looks at both at one instant
    /// (both locked, the parent first): refused by either, it takes from neither.
    /// [`is_full`](Self::is_full) and [`stats`](Self::stats) are this bucket's own.
    pub fn within(rate: Rate, parent: &Pacer) -> Self {
        Self::with_parent(rate, Some(parent.clone()))
    }

    fn with_parent(rate: Rate, parent: Option<Pacer>) -> Self {
        let interval = rate.interval();
        Self(Arc::new(Inner {
            rate,
            parent,
            interval,
            tolerance: interval.saturating_mul(rate.burst.saturating_sub(1)),
            full_at: Mutex::new(None),
            delayed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }))
    }

    /// Its rate.
    pub fn rate(&self) -> Rate {
        self.0.rate
    }

    /// Takes one, and answers how long the taker must wait before it goes on (zero within
    /// the rate). The wait is owed whether or not the taker waits it.
    pub fn delay(&self) -> Duration {
        match self.take(None) {
            Ok(wait) | Err(wait) => wait,
        }
    }

    /// Takes one if the wait it would owe is at most `max`, answering the wait; else takes
    /// nothing and answers, as an error, how long until it would be within `max`.
    pub fn take_within(&self, max: Duration) -> Result<Duration, Duration> {
        self.take(Some(max))
    }

    /// The wait that a take now would owe, taking nothing (the longest of this bucket's
    /// and those it is within).
    pub fn due(&self) -> Duration {
        let own = self.owed(*self.0.full_at.lock(), Instant::now()).1;
        self.0.parent.as_ref().map_or(own, |p| own.max(p.due()))
    }

    /// Where the bucket stands at `now` given `full_at` (the later of the two), and the
    /// wait a take then owes: none while that is within the tolerance of `now`.
    fn owed(&self, full_at: Option<Instant>, now: Instant) -> (Instant, Duration) {
        let at = full_at.map_or(now, |t| t.max(now));
        (at, (at - now).saturating_sub(self.0.tolerance))
    }

    /// Takes one and waits as long as it owes.
    pub async fn wait(&self) {
        let wait = self.delay();
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Whether its bucket is full: nothing taken lately counts any more, and a new
    /// `Pacer` of the same rate would answer the same.
    pub fn is_full(&self) -> bool {
        self.0.full_at.lock().is_none_or(|t| t <= Instant::now())
    }

    /// How many handles to this pacer there are, this one included (clones share one
    /// bucket): a table of pacers can tell whether anyone else still holds one.
    pub fn handles(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Its counts.
    pub fn stats(&self) -> PaceStats {
        PaceStats {
            delayed: self.0.delayed.load(Ordering::Relaxed),
            refused: self.0.refused.load(Ordering::Relaxed),
        }
    }

    fn take(&self, max: Option<Duration>) -> Result<Duration, Duration> {
        let i = &*self.0;
        let taken = if i.parent.is_none() {
            self.take_alone(max)
        } else {
            self.take_within_chain(max)
        };
        match taken {
            Err(_) => i.refused.fetch_add(1, Ordering::Relaxed),
            Ok(wait) if !wait.is_zero() => i.delayed.fetch_add(1, Ordering::Relaxed),
            Ok(_) => 0,
        };
        taken
    }

    /// A take from a bucket within none: the common case, without the chain's allocation.
    fn take_alone(&self, max: Option<Duration>) -> Result<Duration, Duration> {
        let mut full_at = self.0.full_at.lock();
        let (at, wait) = self.owed(*full_at, Instant::now());
        if let Some(max) = max.filter(|max| wait > *max) {
            return Err(wait - max);
        }
        *full_at = Some(at + self.0.interval);
        Ok(wait)
    }

    /// A take from this bucket and every one it is within, locked widest first (every taker
    /// locks in that order) and read at one instant: the wait owed is the longest of theirs,
    /// and either all of them take or none does.
    fn take_within_chain(&self, max: Option<Duration>) -> Result<Duration, Duration> {
        let mut chain = vec![self];
        while let Some(parent) = &chain[chain.len() - 1].0.parent {
            chain.push(parent);
        }
        let mut held: Vec<_> = chain.iter().rev().map(|p| p.0.full_at.lock()).collect();
        let now = Instant::now();
        let owed: Vec<(Instant, Duration)> = chain
            .iter()
            .rev()
            .zip(&held)
            .map(|(p, full_at)| p.owed(**full_at, now))
            .collect();
        let wait = owed.iter().map(|(_, w)| *w).max().unwrap_or_default();
        if let Some(max) = max.filter(|max| wait > *max) {
            return Err(wait - max);
        }
        for ((p, full_at), (at, _)) in chain.iter().rev().zip(&mut held).zip(owed) {
            **full_at = Some(at + p.0.interval);
        }
        Ok(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_then_the_rate() {
        let p = Pacer::new(Rate::per_second(100).burst(5));
        for _ in 0..5 {
            assert_eq!(p.delay(), Duration::ZERO);
        }
        // Each further take owes one more interval (10 ms).
        assert_eq!(p.delay(), Duration::from_millis(10));
        assert_eq!(p.delay(), Duration::from_millis(20));
        assert_eq!(p.stats().delayed, 2);
        // After a quiet spell the bucket is full again, and no fuller.
        assert!(!p.is_full());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(p.is_full());
        for _ in 0..5 {
            assert_eq!(p.delay(), Duration::ZERO);
        }
        assert_eq!(p.delay(), Duration::from_millis(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_take_takes_nothing() {
        let p = Pacer::new(Rate::per_second(10).burst(1));
        assert_eq!(p.take_within(Duration::ZERO), Ok(Duration::ZERO));
        // The next is due in 100 ms: refused by a caller that will not wait, told 100 ms.
        assert_eq!(
            p.take_within(Duration::ZERO),
            Err(Duration::from_millis(100))
        );
        assert_eq!(
            p.take_within(Duration::from_millis(30)),
            Err(Duration::from_millis(70))
        );
        assert_eq!(p.stats().refused, 2);
        assert_eq!(p.due(), Duration::from_millis(100));
        // Nothing was taken by the refusals: in 100 ms one is free again.
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(p.take_within(Duration::ZERO), Ok(Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_holds_a_closed_loop_to_the_rate() {
        let p = Pacer::new(Rate::per_second(50).burst(10));
        let start = Instant::now();
        for _ in 0..110 {
            p.wait().await;
        }
        // 10 at once, then 100 at 50 per second.
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn pacers_within_one_parent_share_its_rate() {
        let network = Pacer::new(Rate::per_second(100).burst(4));
        let a = Pacer::within(Rate::per_second(100).burst(3), &network);
        let b = Pacer::within(Rate::per_second(100).burst(3), &network);
        // Each within its own burst of 3, the two together within the parent's 4.
        for _ in 0..3 {
            assert_eq!(a.delay(), Duration::ZERO);
        }
        assert_eq!(b.delay(), Duration::ZERO);
        assert_eq!(b.delay(), Duration::from_millis(10));
        assert_eq!(b.due(), Duration::from_millis(20));
        // A take the parent would delay past the limit is refused, and takes from neither.
        assert_eq!(
            b.take_within(Duration::from_millis(5)),
            Err(Duration::from_millis(15))
        );
        assert_eq!(b.stats().refused, 1);
        assert_eq!(network.due(), Duration::from_millis(20));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(a.is_full() && b.is_full() && network.is_full());
        assert_eq!(b.take_within(Duration::ZERO), Ok(Duration::ZERO));
    }

    /// Siblings taking at once from threads: no take is answered a wait past its bound,
    /// and together they take no more than the parent's burst (and what its rate gave back
    /// meanwhile).
    #[test]
    fn siblings_racing_never_pass_their_parent() {
        let network = Pacer::new(Rate::per_second(1).burst(10));
        let start = std::time::Instant::now();
        let taken: usize = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let mine = Pacer::within(Rate::per_second(1000), &network);
                    scope.spawn(move || {
                        (0..200)
                            .filter(|_| match mine.take_within(Duration::ZERO) {
                                Ok(wait) => {
                                    assert_eq!(wait, Duration::ZERO);
                                    true
                                }
                                Err(_) => false,
                            })
                            .count()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum()
        });
        let gave_back = start.elapsed().as_secs() as usize + 1;
        assert!(
            (10..=10 + gave_back).contains(&taken),
            "{taken} taken in {:?}",
            start.elapsed()
        );
    }

    #[test]
    fn rates_are_never_zero() {
        let r = Rate::per_second(0).burst(0);
        assert_eq!(r.average(), 1.0);
        assert_eq!(r.max_burst(), 1);
    }
}
