//! Per-method options: how long a result is kept, when it invalidates itself, and how long
//! errors are cached.

use std::time::Duration;

/// How a compute method's results are cached. Set per method with `#[compute(...)]`.
///
/// ```
/// use std::time::Duration;
/// use coherent_core::ComputeOptions;
///
/// const OPTIONS: ComputeOptions = ComputeOptions::DEFAULT
///     .with_keep_alive(Duration::from_secs(10))
///     .with_auto_invalidate(Duration::from_secs(60));
/// assert_eq!(OPTIONS.auto_invalidate, Some(Duration::from_secs(60)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ComputeOptions {
    /// Minimum cache duration: an unused result is kept at least this long after its last use
    /// before pruning may evict it. Results that a live computed depends on are never evicted.
    pub keep_alive: Duration,
    /// Time-to-live: a consistent result invalidates itself this long after it was computed.
    pub auto_invalidate: Option<Duration>,
    /// How long an error result is cached before it invalidates itself.
    pub error_invalidate: Duration,
    /// How long an error whose type says it is transient (see
    /// [`TransientError`](crate::TransientError)) is cached.
    pub transient_error_invalidate: Duration,
}

impl ComputeOptions {
    /// Keep-alive 1 s, no time-to-live, errors cached 10 s, transient errors 1 s.
    pub const DEFAULT: Self = Self {
        keep_alive: Duration::from_secs(1),
        auto_invalidate: None,
        error_invalidate: Duration::from_secs(10),
        transient_error_invalidate: Duration::from_secs(1),
    };

    /// Sets [`keep_alive`](Self::keep_alive).
    #[must_use]
    pub const fn with_keep_alive(mut self, keep_alive: Duration) -> Self {
        self.keep_alive = keep_alive;
        self
    }

    /// Sets [`auto_invalidate`](Self::auto_invalidate).
    #[must_use]
    pub const fn with_auto_invalidate(mut self, ttl: Duration) -> Self {
        self.auto_invalidate = Some(ttl);
        self
    }

    /// Sets [`error_invalidate`](Self::error_invalidate).
    #[must_use]
    pub const fn with_error_invalidate(mut self, delay: Duration) -> Self {
        self.error_invalidate = delay;
        self
    }

    /// Sets [`transient_error_invalidate`](Self::transient_error_invalidate).
    #[must_use]
    pub const fn with_transient_error_invalidate(mut self, delay: Duration) -> Self {
        self.transient_error_invalidate = delay;
        self
    }

    /// How long a result of this kind stays consistent before it invalidates itself.
    pub(crate) fn expiry(&self, kind: OutputKind) -> Option<Duration> {
        match kind {
            OutputKind::Value => self.auto_invalidate,
            OutputKind::Error => Some(self.error_invalidate),
            OutputKind::TransientError => Some(self.transient_error_invalidate),
        }
    }
}

impl Default for ComputeOptions {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// What a compute method returned, as far as caching is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// A value (or `Ok`): cached until invalidated or its time-to-live passes.
    Value,
    /// An error: cached for [`ComputeOptions::error_invalidate`].
    Error,
    /// A transient error: cached for [`ComputeOptions::transient_error_invalidate`].
    TransientError,
}

/// Implemented by error types that can tell a transient failure (a timeout, a lost connection)
/// from a lasting one. Compute methods returning `Result<_, E>` with `E: TransientError` cache
/// transient errors for the shorter [`ComputeOptions::transient_error_invalidate`].
pub trait TransientError {
    /// Whether retrying soon may succeed.
    fn is_transient(&self) -> bool;
}
