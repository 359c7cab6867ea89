//! A host of the cluster: runs commands through the pipeline, and replays the operations
//! of every other host.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use coherent_core::{lease_clock, Registry};
use coherent_remote::RemoteServer;
use futures::FutureExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, oneshot, watch, Notify};

use crate::changes::{
    check_identifier, default_name as default_feed_name, hold_owed, run_postgres_feed,
    settle_holds, ApplyChanges, ChangeFeed, ChangesHandler, DbChanges, FeedCounters, FeedStats,
    PgFeed, TableWatch, Watches,
};
use crate::command::{BoxFuture, Command, DynHandler, Handler, Handlers};
use crate::db::{
    now_micros, Append, Cursor, Database, Engine, Execute, Finished, Logged, Reading, Tx,
};
use crate::error::{CommandError, ErrorKind};
use crate::notify::{self, Notifier, Publisher};

/// A notice further ahead of the horizon than this is not believed (no cluster commits two
/// billion transactions between two reads of its log).
const MAX_AHEAD: u64 = 1 << 31;

/// At most this many operations ahead of the horizon are remembered as applied; past it,
/// notices only wake the log reader.
const MAX_APPLIED: usize = 1 << 20;

/// A hash of what an operation does: two records of one id that differ in it are not the
/// same operation.
fn content_hash(op: &Logged) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one((&op.kind, &op.command, &op.output))
}

/// How an operation reached the host that applied it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Via {
    /// The host ran the command itself.
    Local,
    /// A notification (PostgreSQL `NOTIFY` or NATS) carried it.
    Notification,
    /// A read of the log found it (a catch-up, a poll, or a notification too large to carry
    /// the operation).
    Log,
}

/// An operation this host has applied: its invalidation has run here, and reached this
/// host's dependants and the replicas its clients hold.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The operation's id in the log.
    pub id: i64,
    /// The host that ran the command.
    pub host: Arc<str>,
    /// The command's name.
    pub kind: Arc<str>,
    /// When the command's transaction committed (µs since the epoch): by its host's wall
    /// clock, when the notification said; otherwise by the database's clock, when the
    /// operation was appended, just before the commit.
    pub committed_at: i64,
    /// When this host finished applying it (µs since the epoch, wall clock).
    pub applied_at: i64,
    /// How it arrived.
    pub via: Via,
}

/// Counters of a host, from its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Commands run here that committed.
    pub commands: u64,
    /// Commands run here that failed (rolled back, or their outcome unknown).
    pub command_errors: u64,
    /// Operations of other hosts applied from a notification.
    pub applied_notified: u64,
    /// Operations of other hosts applied from a read of the log.
    pub applied_from_log: u64,
    /// Operations that arrived again (by the log after a notification, say) and were skipped.
    pub duplicates: u64,
    /// Operations whose command no handler here knows (their invalidation cannot run here).
    pub unknown: u64,
    /// Operations whose logged command or output did not decode.
    pub undecodable: u64,
    /// Replays (another host's invalidation run here) that panicked. Each flushed the
    /// cache, as an operation that cannot be applied does.
    pub replay_panics: u64,
    /// Notifications that did not decode, or claimed an implausible position: each only
    /// woke the log reader.
    pub implausible: u64,
    /// Messages of the notifier (notices, acknowledgements, hellos, welcomes, farewells,
    /// pings, the change feed's hints) refused unread: their seal did not check out under
    /// the cluster's key, or they had none (see [`HostBuilder::accept_unsealed`]). Someone
    /// other than this cluster's hosts writes on its channel, or a host of a release
    /// before seals (of hints: before sealed hints) runs.
    pub messages_refused: u64,
    /// Reads of the log.
    pub rounds: u64,
    /// Reads of the log that failed.
    pub round_errors: u64,
    /// Times this host invalidated its whole cache because it may have missed operations,
    /// or database changes (see [`HostBuilder::watch`]) it could not apply row by row.
    pub flushes: u64,
    /// Hints of database changes heard from the host that reads the change feed, ahead
    /// of their operation (see [`HostBuilder::change_feed`]): the first of the pair to
    /// arrive is applied, the second skipped.
    pub change_hints: u64,
    /// Hints, and operations of database changes, not applied because the other of the
    /// pair was: what the hints saved in double invalidations.
    pub change_hints_paired: u64,
    /// Times this host held its cache for a flush the change feed owed (a new slot waiting
    /// for the transactions running when it was made): every call read the database until
    /// the flush was paid.
    pub change_holds: u64,
    /// Operations this host deleted from the log.
    pub trimmed: u64,
    /// Transactions that committed commands of this host (a batch is one; see
    /// [`HostBuilder::max_batch`]).
    pub batches: u64,
    /// Batches of several commands that failed and whose commands ran again one at a time.
    pub batches_split: u64,
    /// Commands sent as one statement with their operation's row, without a transaction
    /// around them (their one write deferred with [`Tx::defer_sql`](crate::Tx::defer_sql),
    /// or sent with [`Tx::finish_sql`](crate::Tx::finish_sql)). They count in `batches` too.
    pub fused: u64,
    /// This host's own operations that it applied when it read them from the log: ones
    /// whose commit it did not see (the connection lost under it), which may have
    /// committed after the command answered, or whose invalidation panicked; and, rarely,
    /// one whose commit it saw but had not finished when the read found it.
    pub own_applied: u64,
    /// Acknowledgements of this host's operations received from other hosts.
    pub acks_received: u64,
    /// Commands that answered without every other live host's acknowledgement, when the
    /// wait ran out (see [`HostBuilder::acknowledgements`]).
    pub ack_timeouts: u64,
    /// Other live hosts that commands wait for now.
    pub peers: u64,
    /// Hosts that said they stopped ([`Host::stop`]), and were no longer waited for.
    pub peers_left: u64,
    /// Times this host fenced its registries (see [`Host::is_fenced`]): at start, and each
    /// time its notifier dropped.
    pub fences: u64,
    /// Rejoins that lifted the fence without every live host's welcome, after trying for
    /// ten seconds (hosts of a release without the handshake never answer).
    pub rejoins_incomplete: u64,
    /// Times this host's lease ran out ([`HostBuilder::lease`]): it was paused, or its
    /// pings stalled; each fenced it until it rejoined.
    pub leases_lost: u64,
    /// Transactions that lost their connection before anything ran (a terminated
    /// backend) and ran again on another: their callers did not hear of it.
    pub commits_retried: u64,
    /// Commands that waited out a lease after their notice went out, for a host they did
    /// not wait for (it missed a deadline before): see [`HostBuilder::lease`].
    pub lease_waits: u64,
    /// Commands whose notice did not go out (sending it failed for
    /// [`HostBuilder::notice_give_up`], or it could not be sent at all): each waited until
    /// every other live host had read the log past its operation instead.
    pub log_waits: u64,
    /// Of those, the ones that answered without every live host having read that far
    /// within [`HostBuilder::log_wait`]: the only commands a read on another host may not
    /// see at once (counted, and logged with the hosts behind).
    pub log_wait_timeouts: u64,
    /// This host's commands waiting for acknowledgements now (committed, their callers
    /// not answered yet). A caller that goes away takes its wait with it: this does not
    /// grow with callers that dropped [`Host::run`]'s future.
    pub acks_waiting: u64,
    /// Everything before this position is applied (see the crate's docs).
    pub horizon: u64,
    /// Notices and acknowledgements waiting for this host's notifying task now
    /// (PostgreSQL; at most [`HostBuilder::notify_queue`]).
    pub notify_queued: u64,
    /// Notices of this host's commands not sent with their operation: its notifying queue
    /// was full (the database or NATS slow or out of reach: a wake-up telling the other
    /// hosts to read the log went in their place), or one did not fit in a payload even
    /// alone. The other hosts apply those operations from the log and acknowledge them
    /// then; the command waits for them as for any other.
    pub notices_dropped: u64,
    /// Notices of this host's commands not sent because it knew no other live host (see
    /// the crate's docs, "A host alone"): a command that nobody else needs to hear of
    /// costs no `NOTIFY` (nor NATS message).
    pub notices_skipped: u64,
    /// Acknowledgements this host did not send, for the same reasons: the host whose
    /// command it was waits out its [`HostBuilder::acknowledgements`] (and counts it in
    /// its `ack_timeouts`), then does not wait for this host until it hears from it.
    pub acks_dropped: u64,
}

#[derive(Default)]
struct Counters {
    commands: AtomicU64,
    command_errors: AtomicU64,
    applied_notified: AtomicU64,
    applied_from_log: AtomicU64,
    duplicates: AtomicU64,
    unknown: AtomicU64,
    undecodable: AtomicU64,
    replay_panics: AtomicU64,
    implausible: AtomicU64,
    messages_refused: AtomicU64,
    rounds: AtomicU64,
    round_errors: AtomicU64,
    flushes: AtomicU64,
    trimmed: AtomicU64,
    batches: AtomicU64,
    batches_split: AtomicU64,
    pub(crate) fused: AtomicU64,
    own_applied: AtomicU64,
    acks_received: AtomicU64,
    ack_timeouts: AtomicU64,
    peers_left: AtomicU64,
    fences: AtomicU64,
    rejoins_incomplete: AtomicU64,
    leases_lost: AtomicU64,
    lease_waits: AtomicU64,
    log_waits: AtomicU64,
    log_wait_timeouts: AtomicU64,
    commits_retried: AtomicU64,
    notices_skipped: AtomicU64,
}

/// An acknowledgement: `from` applied these operations of the host it is sent to.
#[derive(Debug, Serialize, Deserialize, Default)]
pub(crate) struct Ack {
    pub(crate) from: String,
    #[serde(default)]
    pub(crate) ids: Vec<i64>,
    /// `from` stopped: not waited for any more.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) bye: bool,
    /// `from` asks to be counted in: answered with a welcome, after which the commands of
    /// the host that answers wait for `from` (the rejoin handshake).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) hello: bool,
    /// The answer to a hello: sent after every notice of the sender that did not wait for
    /// the host greeted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) welcome: bool,
    /// A ping a host sends itself (the time it sent it, on its lease clock): see
    /// [`HostBuilder::lease`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) ping: u64,
    /// Which rejoin a hello is of (a random number), and a welcome answers: a welcome
    /// counts only in the rejoin it answers, so that one seen before (anyone may listen
    /// on the channel) cannot be sent again to end a later rejoin early. 0 from a release
    /// before seals.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) round: u64,
}

pub(crate) fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A command of this host waiting for the other hosts to apply its operation.
struct Waiter {
    pending: HashSet<String>,
    done: Option<oneshot::Sender<()>>,
}

/// This host's commands waiting for acknowledgements, by operation id.
type Waiting = Mutex<HashMap<i64, Waiter>>;

/// Another live host, as this one knows it.
#[derive(Clone, Copy)]
struct Peer {
    /// It missed an acknowledgement's deadline: not waited for until heard from again
    /// (its lease is: see [`Inner::await_acks`]).
    suspect: bool,
    /// When this host last heard from it (a notice, an acknowledgement, a hello): a read
    /// of the hosts table that began before does not drop it.
    heard: Instant,
}

/// What [`Host::run`] awaits after the commit when other hosts must acknowledge. Dropped,
/// however that happens (answered, timed out, or with the answer of a caller that went
/// away: issue 30, hole 5), it removes its entry from the host's map.
struct AckWait {
    id: i64,
    done: oneshot::Receiver<()>,
    waiting: Weak<Waiting>,
    /// The notice's sequence number, and how far the host's notices have gone out: the
    /// deadline counts from when it is out.
    seq: u64,
    /// The operation's position in the log: where the other hosts must have read to
    /// when its notice did not go out.
    position: u64,
    sends: Arc<notify::Sends>,
    /// Some live host was not waited for (it missed a deadline before): the command
    /// answers no sooner than that host's lease from before the notice ran out.
    skipped: bool,
    /// Some host is waited for (`done` tells when all answered).
    waits: bool,
}

impl Drop for AckWait {
    fn drop(&mut self) {
        if let Some(waiting) = self.waiting.upgrade() {
            waiting.lock().remove(&self.id);
        }
    }
}

/// What a notification carries: the whole operation when it fits, so that the hosts that
/// hear it apply it without reading the log.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Notice {
    pub(crate) id: i64,
    pub(crate) position: u64,
    pub(crate) host: String,
    pub(crate) committed_at: i64,
    /// Absent when the operation is too large for the notifier: read the log.
    pub(crate) op: Option<NoticeOp>,
    /// Its number among its host's notices (NATS): the host counts it out when it hears it
    /// back from the server ([`notify::Sends`]). 0: not numbered (another release, or
    /// PostgreSQL, where the `NOTIFY`'s commit says it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) seq: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct NoticeOp {
    pub(crate) kind: String,
    pub(crate) command: String,
    pub(crate) output: String,
}

/// Settings of a [`Host`]; see [`Host::builder`].
pub struct HostBuilder {
    db: Database,
    id: Option<String>,
    notifier: Option<Notifier>,
    poll: Option<Duration>,
    retention: Duration,
    host_expiry: Duration,
    registries: Vec<Registry>,
    handlers: Handlers,
    after_invalidate: Option<AfterInvalidate>,
    /// Replica servers whose clients' lease this host's registries bound
    /// ([`serve_replicas`](Self::serve_replicas)).
    lease_to: Vec<RemoteServer>,
    transactions: usize,
    max_batch: usize,
    acknowledgements: Option<Duration>,
    /// `None`: the default (half the acknowledgement deadline).
    lease: Option<Option<Duration>>,
    notify_interval: Duration,
    notify_queue: usize,
    accept_unsealed: bool,
    notice_give_up: Duration,
    log_wait: Duration,
    clock_skew: i64,
    watches: Watches,
    feed: Option<ChangeFeed>,
}

/// What [`Host::run`] awaits after a command's local invalidation (see
/// [`HostBuilder::after_invalidate`]).
type AfterInvalidate = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

impl HostBuilder {
    /// A name for this host; its id in the log is the name and a random suffix, so that a
    /// restarted process is a new host (by default the name is the machine's name and the
    /// process id).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// How other hosts' operations reach this one. Default: [`Notifier::Postgres`] on
    /// PostgreSQL, [`Notifier::Poll`] on SQLite.
    pub fn notifier(mut self, notifier: Notifier) -> Self {
        self.notifier = Some(notifier);
        self
    }

    /// How often the log is read when no notification came (it covers a notifier that
    /// went silent without failing). Default: 500 ms with a notifier, 10 ms with
    /// [`Notifier::Poll`]. While the notifier is down the log is read at least every 50 ms.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = Some(every);
        self
    }

    /// Operations older than this are deleted once every live host has passed them.
    /// Default: one hour.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// A host not seen for this long is taken for dead: it no longer holds trimming back,
    /// and a host that finds itself silent this long (paused, cut off) invalidates its
    /// whole cache, since the log may have been trimmed past it. Default: five minutes.
    /// Seen means its row in the hosts table written, every second (a quarter of this, if
    /// shorter), by the database's clock.
    pub fn host_expiry(mut self, expiry: Duration) -> Self {
        self.host_expiry = expiry;
        self
    }

    /// A registry of this host's compute services: invalidated as a whole when the host
    /// may have missed operations (its notifier dropped). Default: the global registry;
    /// calling this replaces the default, and may be called for each registry.
    pub fn registry(mut self, registry: &Registry) -> Self {
        self.registries.push(registry.clone());
        self
    }

    /// Serves replicas of this host's compute services through `remote`: a command returns
    /// (and this host acknowledges another host's operation) only once every client of
    /// `remote` holding a replica that the invalidation reached has applied it, so that a
    /// read that starts on any such client after a command returned sees its write.
    /// Without it, a client's replica is invalidated a moment after the command returns,
    /// and a read in that moment answers the old value from the client's cache. Call it
    /// for each `RemoteServer` that exposes this host's services (untrusted connections
    /// that fall behind are not waited for: see `RemoteServer::invalidations_delivered`).
    /// The host keeps a clone: it shares the server's connections (services may be exposed
    /// on the server afterwards) but copies its settings, so set its `delivery_timeout`
    /// (the longest the wait lasts) before.
    ///
    /// The server's trusted clients also get this host's lease: a client answers from its
    /// replicas no longer than the host could answer from its registries when the client
    /// last heard from it (`RemoteServer::lease_from`), so a host that cannot tell whether
    /// its cache is current (fenced, paused, past its lease) takes its tiers' replicas
    /// with it.
    ///
    /// ```no_run
    /// # async fn wire(db: coherent_ops::Database) -> Result<(), coherent_ops::CommandError> {
    /// use coherent_ops::Host;
    /// use coherent_remote::RemoteServer;
    /// let remote = RemoteServer::new(); // .expose_service(...) for each service
    /// let host = Host::builder(db).serve_replicas(&remote).start().await?;
    /// # let _ = host; Ok(()) }
    /// ```
    pub fn serve_replicas(mut self, remote: &RemoteServer) -> Self {
        let remote = remote.clone();
        self.lease_to.push(remote.clone());
        self.after_invalidate(move || {
            let remote = remote.clone();
            async move { remote.invalidations_delivered().await }
        })
    }

    /// Something [`Host::run`] awaits after a command's invalidation ran here and before it
    /// returns, and this host awaits before it acknowledges another host's operation: a
    /// wait of your own for whatever holds copies of this host's results. Each call adds
    /// one; all are awaited, at once. For replicas served by a `RemoteServer`, use
    /// [`serve_replicas`](Self::serve_replicas).
    pub fn after_invalidate<F, Fut>(mut self, wait: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        self.after_invalidate = Some(match self.after_invalidate.take() {
            None => Arc::new(move || Box::pin(wait())),
            Some(before) => Arc::new(move || {
                let (before, now) = (before(), wait());
                Box::pin(async move {
                    futures::join!(before, now);
                })
            }),
        });
        self
    }

    /// How many transactions run this host's commands at once. Default: 8 (half the
    /// pool's connections: the log's reader, the notifier and the application's reads
    /// keep the rest). Commands that arrive while they are busy wait, and are committed
    /// together (see [`max_batch`](Self::max_batch)). A command that finds one free commits
    /// in its caller's task. On SQLite one process writes at a time whatever this says.
    ///
    /// # Panics
    /// When `n` is 0.
    pub fn transactions(mut self, n: usize) -> Self {
        assert!(
            n > 0,
            "a host needs at least one transaction for its commands"
        );
        self.transactions = n;
        self
    }

    /// At most this many waiting commands go into one transaction. Default: 64; 1 gives
    /// every command a transaction of its own.
    ///
    /// A batch runs its handlers one after the other in one transaction, appends their
    /// operations with one statement, and commits once: under load most of a command's
    /// database work (`BEGIN`, the operation's row, `COMMIT`, the flush of the WAL) is
    /// shared. Each handler still sees the writes of the commands before it, as if they
    /// had run one after the other. If a handler fails, or a lock is not granted within
    /// 100 ms (PostgreSQL), the batch rolls back and its commands run again, each in a
    /// transaction of its own: so a handler may run twice, and must not act outside its
    /// transaction.
    ///
    /// # Panics
    /// When `n` is 0.
    pub fn max_batch(mut self, n: usize) -> Self {
        assert!(n > 0, "a batch holds at least one command");
        self.max_batch = n;
        self
    }

    /// Whether a command waits, before it answers, until every other live host has applied
    /// it, and for how long at most. Default: 500 ms.
    ///
    /// With it, a read that starts on any host after the command answered sees the write
    /// (as it does on this host without it): the command's answer waits for one more trip
    /// of the notifier, from each other host back to this one. The hosts waited for are
    /// those seen in the hosts table in the last few seconds (each host writes its row
    /// every second, whatever its poll interval; the database's clock says when) or heard
    /// from since. The wait counts from when the command's notice went out (a busy or
    /// failed `NOTIFY` holds it in the queue; a failed one is sent again), not from the
    /// commit. One that does not answer in time is not waited for again until it is heard
    /// from (its acknowledgements come in again), and counted in
    /// [`HostStats::ack_timeouts`]; meanwhile each command answers no sooner than a
    /// [`lease`](Self::lease) after its notice went out, by when such a host, if it is
    /// alive but slow, has stopped answering from its cache unless it applied the
    /// operation. So a host that died costs one command this wait, and the next ones a
    /// lease each until its row expires (or until it said goodbye, if it stopped).
    ///
    /// A host that joins is waited for from the first time the others hear of it: its
    /// first heartbeat, read by each host every second, or its first acknowledgement.
    ///
    /// `None`: commands answer after their own host's invalidation only (the other hosts
    /// apply it a notification's trip later). With [`Notifier::Poll`] there is no channel
    /// for acknowledgements, and commands never wait.
    pub fn acknowledgements(mut self, timeout: Option<Duration>) -> Self {
        self.acknowledgements = timeout;
        self
    }

    /// How long this host's cache may answer after it last proved that it hears the other
    /// hosts' notices: it sends itself a ping through its notifier every fifth of this, and
    /// a ping that comes back renews the lease from the time it was sent (it came after
    /// every notice published before it). A host paused longer (SIGSTOP, a stalled VM), or
    /// whose pings stall, answers nothing from its cache (its registries are fenced by the
    /// lease, checked on every hit with a coarse clock read) until it has rejoined. Keep it
    /// well under [`acknowledgements`](Self::acknowledgements): the other hosts stop
    /// waiting for this one after that deadline. Use the same on every host: a host that
    /// stopped waiting for another waits this host's lease instead. The lease also ends
    /// 3 s after the last heartbeat that wrote the host's row began (the others stop
    /// waiting for a host whose row is 5 s old). Default: half the acknowledgement
    /// deadline (250 ms). `None`, or without acknowledgements or a notifier: no lease.
    pub fn lease(mut self, lease: Option<Duration>) -> Self {
        self.lease = Some(lease);
        self
    }

    /// On PostgreSQL, the least time between two of this host's `NOTIFY` transactions:
    /// the notices (and acknowledgements) that queue in between go out together in the
    /// next. Default: 1 ms. A host that notifies seldom sends each at once; one that runs
    /// thousands of commands a second sends one `NOTIFY` per interval instead of one per
    /// command or two. Each is a transaction that every listening connection wakes up for,
    /// and at that rate they cost the database more than the commands' own writes
    /// (`cluster.commands`: 0.42x -> 0.54x of plain writes at 1 ms, on 2 cores). The price
    /// is up to one interval more on the way to the other hosts while commands are
    /// frequent. `Duration::ZERO` sends as soon as the previous one is done.
    pub fn notify_interval(mut self, interval: Duration) -> Self {
        self.notify_interval = interval;
        self
    }

    /// How long this host tries to send a batch of notices (a failing `NOTIFY`, a NATS
    /// server out of reach) before it gives up on them. Default: 30 s. A command whose
    /// notice was given up on then waits until every other live host has read the log past
    /// its operation ([`log_wait`](Self::log_wait)): so its answer still means that a read
    /// on any host sees its write, if later than usual. A shorter time trades a longer wait
    /// on a notifier that comes back for a shorter one on a notifier that does not.
    pub fn notice_give_up(mut self, after: Duration) -> Self {
        self.notice_give_up = after.max(Duration::from_millis(1));
        self
    }

    /// How long a command whose notice did not go out ([`notice_give_up`](Self::notice_give_up))
    /// waits for every other live host to read the log past its operation: their rows
    /// record how far they read with each heartbeat (every second), and they read the log
    /// every [`poll_interval`](Self::poll_interval) without a notice. Default: 60 s; keep
    /// it above the other hosts' poll interval. `HostStats::log_waits` counts the commands
    /// that waited so, `log_wait_timeouts` those that answered without every host.
    pub fn log_wait(mut self, limit: Duration) -> Self {
        self.log_wait = limit;
        self
    }

    /// On PostgreSQL, how many notices and acknowledgements may wait for this host's
    /// notifying task (while the database is slow or out of reach). Default: 65,536.
    /// Past it, what comes is dropped and counted ([`HostStats::notices_dropped`],
    /// [`HostStats::acks_dropped`]): a notice is only a wake-up (the other hosts read the
    /// log at their next poll), and a missing acknowledgement costs the command that waits
    /// for it its [`acknowledgements`](Self::acknowledgements) timeout.
    ///
    /// # Panics
    /// When `entries` is 0.
    pub fn notify_queue(mut self, entries: usize) -> Self {
        assert!(entries > 0, "the notifying queue holds at least one entry");
        self.notify_queue = entries;
        self
    }

    /// Whether this host takes messages of the notifier that carry no seal (default
    /// `false`). Every message the hosts send each other through the notifier is sealed
    /// with a MAC under a key kept in the cluster's `coherent_secrets` table (see the
    /// crate's docs, "Who can talk to a host"): on PostgreSQL any role that can connect
    /// may `NOTIFY` on the hosts' channels, and on NATS any client the server admits may
    /// publish on their subjects, and an acknowledgement in a host's name would end a
    /// command's wait for that host before it invalidated. A refused message is counted
    /// ([`HostStats::messages_refused`]) and dropped: a notice is then read from the log
    /// at the next poll, an acknowledgement waited out as a silent host's is.
    ///
    /// Set it `true` only while hosts of a release before seals (which send none) run
    /// beside this one, during a rolling upgrade: their notices and acknowledgements
    /// count again, and so would a stranger's. A seal that does not check out is refused
    /// either way.
    pub fn accept_unsealed(mut self, accept: bool) -> Self {
        self.accept_unsealed = accept;
        self
    }

    /// A test hook: this host's wall clock reads `micros` µs ahead of the machine's
    /// (behind, when negative), as a host whose clock is off would. Not for production.
    ///
    /// What a host reads its own clock for is only reported ([`Applied::committed_at`] of
    /// its commands, [`Applied::applied_at`]); which hosts are alive, and what trimming
    /// deletes, go by the database's clock, which a skew here does not reach.
    #[doc(hidden)]
    pub fn clock_skew(mut self, micros: i64) -> Self {
        self.clock_skew = micros;
        self
    }

    /// Registers `handler` for the command `C`.
    ///
    /// # Panics
    /// When another handler is registered under `C::NAME`.
    pub fn command<C: Command>(mut self, handler: impl Handler<C>) -> Self {
        self.handlers.insert::<C, _>(handler);
        self
    }

    /// Declares what the database's changes to a table invalidate on this host (see
    /// [`watch_table`](crate::watch_table) and the [`changes`](crate::changes) module).
    /// Register the same watches on every host, as command handlers are: the changes
    /// reach every host as operations of the built-in command `coherent.db_changes`, and a
    /// host with no watches cannot apply them (it flushes its cache for each, as for any
    /// command it does not know).
    pub fn watch(mut self, table: TableWatch) -> Self {
        self.watches.tables.push(table);
        self
    }

    /// Reads the database's changes to the watched tables and logs them for every host
    /// (see [`ChangeFeed`]). Every host may run the feed: one at a time reads it, the
    /// others stand by and take over when it stops. PostgreSQL only; on SQLite, track the
    /// application's connections with [`changes::sqlite::track`](crate::changes::sqlite::track).
    pub fn change_feed(mut self, feed: ChangeFeed) -> Self {
        self.feed = Some(feed);
        self
    }

    /// Starts the host: its notifier, and the task that reads the log. Call in a tokio
    /// runtime. Returns once the notifier listens, or after 2 s (a notifier that cannot
    /// connect yet keeps trying; meanwhile the host reads the log every 50 ms): a host
    /// that does not listen yet hears no acknowledgement of its commands.
    pub async fn start(self) -> Result<Host, CommandError> {
        let notifier = self.notifier.unwrap_or(match &*self.db.inner {
            Engine::Postgres(_) => Notifier::Postgres,
            Engine::Sqlite(_) => Notifier::Poll,
        });
        let poll = self.poll.unwrap_or(match notifier {
            Notifier::Poll => Duration::from_millis(10),
            _ => Duration::from_millis(500),
        });
        let id = format!(
            "{}-{:08x}",
            self.id.unwrap_or_else(default_name),
            incarnation()
        );
        let registries = if self.registries.is_empty() {
            vec![Registry::global().clone()]
        } else {
            self.registries
        };
        for remote in &self.lease_to {
            for r in &registries {
                remote.lease_from(r);
            }
        }
        let mut handlers = self.handlers;
        let changes = if self.watches.tables.is_empty() {
            None
        } else {
            let apply = Arc::new(ApplyChanges {
                host: id.clone(),
                watches: self.watches,
                registries: registries.clone(),
                flushes: AtomicU64::new(0),
                hints: AtomicU64::new(0),
                paired: AtomicU64::new(0),
                seen: Default::default(),
                holds: parking_lot::Mutex::new(Some(Default::default())),
                held: AtomicU64::new(0),
            });
            handlers.insert::<DbChanges, _>(ChangesHandler(apply.clone()));
            Some(apply)
        };
        let feed = match (self.feed, &*self.db.inner, &changes) {
            (None, _, _) => None,
            (Some(_), _, None) => {
                return Err(CommandError::new(
                    ErrorKind::BadCommand,
                    "a change feed with no watched table (HostBuilder::watch)",
                ))
            }
            (Some(mut feed), Engine::Postgres(pg), Some(apply)) => {
                let name = default_feed_name(
                    pg.config.get_dbname().unwrap_or("postgres"),
                    &pg.schema.to_ascii_lowercase(),
                );
                if feed.slot.is_empty() {
                    feed.slot = name.clone();
                }
                if feed.publication.is_empty() {
                    feed.publication = name;
                }
                check_identifier("slot", &feed.slot)?;
                // The trigger feed owes its flush under `triggers`, and installs under the
                // lock a slot named `install` would lead under.
                if !feed.triggers && matches!(&*feed.slot, "triggers" | "install") {
                    return Err(CommandError::new(
                        ErrorKind::BadCommand,
                        format!(
                            "slot {:?}: the name is the trigger feed's; choose another",
                            feed.slot
                        ),
                    ));
                }
                check_identifier("publication", &feed.publication)?;
                Some(PgFeed {
                    feed,
                    watches: apply.watches.clone(),
                    config: pg.config.clone(),
                    tls: pg.tls.clone(),
                    // Unquoted in the statements that made it: PostgreSQL folded it.
                    schema: pg.schema.to_ascii_lowercase(),
                    counters: Arc::default(),
                })
            }
            (Some(_), Engine::Sqlite(_), _) => {
                return Err(CommandError::new(
                    ErrorKind::BadCommand,
                    "a change feed reads PostgreSQL; on SQLite, track the application's \
                     connections with coherent_ops::changes::sqlite::track",
                ))
            }
        };
        let cursor = self.db.start_cursor().await?;
        // A new slot's flush owed now (the slot waits for the transactions running when
        // it is made): held for, as the hosts running then hold, before this host answers
        // anything. Its hold was logged before this host's place in the log.
        let owed_slot = feed
            .as_ref()
            .filter(|f| !f.feed.triggers)
            .map(|f| f.feed.slot.clone());
        if let Some(apply) = &changes {
            hold_owed(&self.db, apply, owed_slot.as_deref()).await?;
        }
        // What a registry holds now (warmed before the start, or by a host stopped before
        // this one) may predate operations the cursor counts as read: dropped.
        let stale: usize = registries.iter().map(Registry::invalidate_all).sum();
        if stale > 0 {
            tracing::info!(
                invalidated = stale,
                "a host starting over a warm registry flushed it"
            );
        }
        let horizon = cursor.horizon;
        let (applied_tx, _) = broadcast::channel(4096);
        let batcher = Batcher {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                closed: false,
                free: self.transactions,
            }),
            max_batch: self.max_batch,
        };
        let work = self.db.background_handle();
        let seal = self.db.seal();
        let inner = Arc::new(Inner {
            id: id.clone(),
            db: self.db,
            handlers,
            changes,
            feed_counters: feed.as_ref().map(|f| f.counters.clone()),
            owed_slot,
            state: Mutex::new(State {
                cursor,
                applied: HashMap::new(),
                own: HashMap::new(),
            }),
            round: tokio::sync::Mutex::new(()),
            applying: Mutex::new(()),
            wake: Arc::new(Notify::new()),
            registries,
            after_invalidate: self.after_invalidate,
            batcher,
            runtime: tokio::runtime::Handle::current(),
            work,
            counters: Counters::default(),
            applied_tx,
            publisher: Mutex::new(Publisher::None),
            notifier_down: AtomicBool::new(!matches!(notifier, Notifier::Poll)),
            poll,
            retention: self.retention,
            host_expiry: self.host_expiry,
            stop: watch::Sender::new(false),
            acknowledgements: self.acknowledgements,
            lease: match (self.acknowledgements, &notifier) {
                (None, _) | (_, Notifier::Poll) => None,
                (Some(deadline), _) => match self.lease.unwrap_or(Some(deadline / 2)) {
                    // The deadline must outlast the lease: a host that missed it is past
                    // its lease by then (the ordering argument, 9).
                    Some(lease) if lease >= deadline => {
                        tracing::warn!(?lease, ?deadline,
                            "a lease as long as the acknowledgement deadline: half the deadline is used");
                        Some(deadline / 2)
                    }
                    lease => lease,
                },
            },
            lease_until: AtomicU64::new(0),
            beat_ok: AtomicU64::new(0),
            reads_owed: AtomicU64::new(0),
            reads_done: AtomicU64::new(0),
            ping_pending: AtomicU64::new(0),
            ping_latest: AtomicU64::new(0),
            notify_interval: self.notify_interval,
            notify_queue: self.notify_queue,
            seal,
            accept_unsealed: self.accept_unsealed,
            notice_give_up: self.notice_give_up,
            delivered_horizon: AtomicU64::new(horizon),
            log_floor: watch::Sender::new((None, 0)),
            log_poll: tokio::sync::Mutex::new(()),
            log_wait: self.log_wait,
            outbox: Arc::default(),
            peers: Mutex::new(HashMap::new()),
            waiting: Arc::default(),
            left: Mutex::new(HashMap::new()),
            fenced: AtomicBool::new(false),
            fence_lock: Mutex::new(()),
            losses: AtomicU64::new(0),
            rejoin: AtomicBool::new(false),
            welcomed: Mutex::new(HashSet::new()),
            // Never 0, the round of a release before seals.
            rejoin_round: AtomicU64::new(rand::random::<u64>() | 1),
            clock_skew: self.clock_skew,
            beat: tokio::sync::Mutex::new(()),
        });
        if inner.notifier_down.load(Ordering::Acquire) {
            // Until it hears notices and its peers count it in, it answers nothing from
            // its cache (the rejoin handshake lifts the fence).
            inner.fence();
        }
        inner.heartbeat(horizon).await?;
        let host = Host { inner };
        let work = host.inner.work.clone();
        {
            // The notifier's tasks and connections are made where they will run.
            let host = host.clone();
            work.spawn(async move { notify::start(&host, notifier).await })
                .await
                .map_err(|e| {
                    CommandError::new(ErrorKind::Unavailable, format!("the notifier's start: {e}"))
                })??;
        }
        host.inner.refresh_peers().await?;
        work.spawn(read_loop(
            Arc::downgrade(&host.inner),
            host.inner.wake.clone(),
            host.inner.stop.subscribe(),
        ));
        let deadline = Instant::now() + Duration::from_secs(2);
        while host.inner.fenced.load(Ordering::Acquire) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        work.spawn(lease_loop(
            Arc::downgrade(&host.inner),
            host.inner.stop.subscribe(),
        ));
        work.spawn(heartbeat_loop(
            Arc::downgrade(&host.inner),
            host.inner.stop.subscribe(),
        ));
        if host.inner.changes.is_some() && matches!(&*host.inner.db.inner, Engine::Postgres(_)) {
            work.spawn(settle_holds(
                Arc::downgrade(&host.inner),
                host.inner.stop.subscribe(),
            ));
        }
        if let Some(feed) = feed {
            // A thread of its own: a runtime whose workers are busy (readers hitting the
            // cache) would add a wait in its queue to every step of the feed, each a few
            // milliseconds of a change's propagation.
            let (weak, stop) = (Arc::downgrade(&host.inner), host.inner.stop.subscribe());
            std::thread::Builder::new()
                .name("coherent-changes".to_owned())
                .spawn(move || {
                    match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime.block_on(run_postgres_feed(weak, feed, stop)),
                        Err(e) => tracing::error!(%e, "change feed: no runtime for its thread"),
                    }
                })
                .map_err(|e| {
                    CommandError::new(ErrorKind::Unavailable, format!("change feed thread: {e}"))
                })?;
        }
        tracing::info!(host = %id, horizon, "coherent-ops host started");
        Ok(host)
    }
}

fn default_name() -> String {
    let name = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    format!("{name}-{}", std::process::id())
}

/// A random number that tells this start of a host from every other.
fn incarnation() -> u32 {
    rand::random()
}

/// A host of a cluster of processes that share one database: it runs commands through the
/// pipeline (the handler's writes and the operation in one transaction, then the
/// invalidation here) and applies every other host's operations (their invalidation, here),
/// woken by its [`Notifier`] and reading the log, which is the truth.
///
/// Cloning is cheap and shares the host. The host stops when the last clone is dropped, or
/// at [`stop`](Self::stop).
#[derive(Clone)]
pub struct Host {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) id: String,
    pub(crate) db: Database,
    handlers: Handlers,
    /// The watches of database changes (see [`HostBuilder::watch`]).
    pub(crate) changes: Option<Arc<ApplyChanges>>,
    feed_counters: Option<Arc<FeedCounters>>,
    /// This host's feed's slot (not for the trigger feed): a flush owed under its name is
    /// held for whoever leads it ([`hold_owed`]).
    owed_slot: Option<String>,
    state: Mutex<State>,
    /// One read of the log at a time.
    round: tokio::sync::Mutex<()>,
    /// Held by [`Inner::apply`] from the moment it marks an operation applied until its
    /// invalidation has run: a read of the log that finds the operation marked (and skips
    /// it) can wait on it for the invalidation to be done (see [`Host::catch_up`]).
    applying: Mutex<()>,
    /// Wakes the log reader (held apart, so that the reader waits without holding the host).
    pub(crate) wake: Arc<Notify>,
    registries: Vec<Registry>,
    after_invalidate: Option<AfterInvalidate>,
    /// The commands waiting for a transaction, and the transactions free.
    batcher: Batcher,
    /// Where a commit goes on when the command that began it is dropped.
    pub(crate) runtime: tokio::runtime::Handle,
    /// Where the host's own work runs (its notifier, listener, reads of the log, leases,
    /// heartbeats, the log of database changes): on PostgreSQL, the database's thread (see
    /// `db::background`), off the application's runtime, whose queue may be long; on
    /// SQLite, the runtime the host started on.
    pub(crate) work: tokio::runtime::Handle,
    counters: Counters,
    applied_tx: broadcast::Sender<Applied>,
    pub(crate) publisher: Mutex<Publisher>,
    notifier_down: AtomicBool,
    poll: Duration,
    retention: Duration,
    host_expiry: Duration,
    /// `true` once stopped; dropped with the host: either ends its tasks.
    pub(crate) stop: watch::Sender<bool>,
    /// How long a command waits for the other hosts' acknowledgements.
    acknowledgements: Option<Duration>,
    /// How long the cache may answer after a ping came back ([`HostBuilder::lease`]).
    lease: Option<Duration>,
    /// Until when (on [`lease_clock`]) the pings that came back give a lease; 0: none
    /// taken yet. The registries' lease may end sooner (see [`Inner::renew_lease`]).
    lease_until: AtomicU64,
    /// When (on [`lease_clock`]) the last heartbeat that wrote this host's row began.
    beat_ok: AtomicU64,
    /// Notifications that told of an operation without carrying it (too large, or not
    /// plausible): each owes a read of the log, and the lease is not renewed until one
    /// that began after it is done (`reads_done` counts those covered).
    reads_owed: AtomicU64,
    reads_done: AtomicU64,
    /// The latest ping (its `sent`) that came back while a read of the log was owed: it
    /// renews the lease once that read is done.
    ping_pending: AtomicU64,
    /// The newest ping that came back (its `sent`): one not newer is ignored.
    ping_latest: AtomicU64,
    /// The least time between two `NOTIFY` transactions.
    pub(crate) notify_interval: Duration,
    /// How long a batch of notices is tried before it is given up on.
    pub(crate) notice_give_up: Duration,
    /// The cursor's horizon as of the last time everything applied below it had reached
    /// this host's clients ([`Inner::reported_horizon`]).
    delivered_horizon: AtomicU64,
    /// The least horizon of the other live hosts' rows, and when it was read: shared by
    /// the commands waiting for the log ([`Inner::await_log_reads`]); `u64::MAX` when no
    /// other host is live.
    log_floor: watch::Sender<(Option<Instant>, u64)>,
    /// Held by the one waiting command that reads `log_floor` anew.
    log_poll: tokio::sync::Mutex<()>,
    /// How long a command whose notice did not go out waits for the other hosts to read
    /// the log past it.
    log_wait: Duration,
    /// How many entries the notifying task's queue holds at most (PostgreSQL).
    pub(crate) notify_queue: usize,
    /// What this host seals its messages with, and checks the others' with.
    pub(crate) seal: crate::seal::Seal,
    /// Whether a message without a seal counts (see [`HostBuilder::accept_unsealed`]).
    accept_unsealed: bool,
    /// What the notifying task (PostgreSQL) dropped.
    pub(crate) outbox: Arc<notify::OutboxCounts>,
    /// The other live hosts, by id: `true` for one that missed an acknowledgement's
    /// deadline (not waited for until it is heard from again).
    peers: Mutex<HashMap<String, Peer>>,
    /// This host's commands waiting for acknowledgements, by operation id; each entry is
    /// removed when its [`AckWait`] drops, if not before.
    waiting: Arc<Waiting>,
    /// Hosts that said they stopped, and when: not taken for live again (a read of the
    /// hosts table that began before one left may still list it).
    left: Mutex<HashMap<String, Instant>>,
    /// Whether this host fences its registries now (see [`Host::is_fenced`]).
    fenced: AtomicBool,
    /// Taken to raise or lift the fence, with the checks that decide it.
    fence_lock: Mutex<()>,
    /// Times the notifier dropped: a rejoin lifts the fence only if none dropped meanwhile.
    losses: AtomicU64,
    /// The notifier is up again: the log reader runs the rejoin handshake.
    rejoin: AtomicBool,
    /// The hosts that welcomed this one in its current rejoin.
    welcomed: Mutex<HashSet<String>>,
    /// The current rejoin's round (see [`Ack::round`]).
    rejoin_round: AtomicU64,
    /// How far this host's wall clock is off (a test hook, [`HostBuilder::clock_skew`]).
    clock_skew: i64,
    /// Held by the heartbeat while it writes this host's row: [`Host::stop`] takes it
    /// after the stop, so that no heartbeat writes the row again after it left.
    beat: tokio::sync::Mutex<()>,
}

/// How many times a batch's transaction runs when it loses its connection before anything
/// ran (see `Inner::transact`).
const COMMIT_TRIES: u32 = 3;

/// The default of [`HostBuilder::notify_queue`].
const NOTIFY_QUEUE: usize = 65_536;

/// How long a rejoin greets the live hosts before it lifts the fence without the
/// welcomes it lacks.
pub(crate) const REJOIN_GIVE_UP: Duration = Duration::from_secs(10);

/// What a command waits beyond a lease for a host it does not wait for: the lease clock
/// is coarse (a few milliseconds), so a lease may run that much longer than it says.
const LEASE_SLACK: Duration = Duration::from_millis(20);

/// How recently (by the database's clock) a host must have written its row to be waited
/// for. Each host writes it every second ([`heartbeat_loop`]), whatever its poll interval.
const PEER_ALIVE: Duration = Duration::from_secs(5);

/// How often a command whose notice did not go out asks how far the other hosts read.
const LOG_WAIT_POLL: Duration = Duration::from_millis(100);

/// The default of [`HostBuilder::log_wait`].
const LOG_WAIT: Duration = Duration::from_secs(60);

struct State {
    /// What the reads of the log have read: every operation it has read is applied (or
    /// predates this host).
    cursor: Cursor,
    /// Operations the cursor has not read that are applied (or being applied), by id,
    /// with their position and the hash of their content.
    applied: HashMap<i64, (u64, u64)>,
    /// This host's own operations whose commit it saw and invalidated by, by id, with their
    /// position, until the cursor has read them (a read that finds them skips them). One
    /// of its own that a read finds and that is not here may have committed without this
    /// host knowing (the connection lost under its commit): it is applied then.
    own: HashMap<i64, u64>,
}

impl Host {
    /// A host over `db`; add handlers with [`HostBuilder::command`], then
    /// [`start`](HostBuilder::start) it.
    pub fn builder(db: Database) -> HostBuilder {
        HostBuilder {
            db,
            id: None,
            notifier: None,
            poll: None,
            retention: Duration::from_secs(3600),
            host_expiry: Duration::from_secs(300),
            registries: Vec::new(),
            handlers: Handlers::default(),
            after_invalidate: None,
            lease_to: Vec::new(),
            transactions: 8,
            max_batch: 64,
            acknowledgements: Some(Duration::from_millis(500)),
            lease: None,
            notify_interval: Duration::from_millis(1),
            notify_queue: NOTIFY_QUEUE,
            accept_unsealed: false,
            notice_give_up: notify::SEND_GIVE_UP,
            log_wait: LOG_WAIT,
            clock_skew: 0,
            watches: Watches::default(),
            feed: None,
        }
    }

    /// The counters of this host's change feed ([`HostBuilder::change_feed`]); `None`
    /// without one.
    pub fn feed_stats(&self) -> Option<FeedStats> {
        self.inner.feed_counters.as_ref().map(|c| c.snapshot())
    }

    /// This host's id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.inner.db
    }

    /// Runs `command` through the pipeline: its handler's writes and the operation commit in
    /// one transaction (shared with the other commands waiting at the time, see
    /// [`HostBuilder::max_batch`]); then the handler's invalidation runs here, before this
    /// returns, and the notifier tells the other hosts. An error rolls back: nothing is
    /// written, nothing logged (except when the commit itself failed, whose outcome is
    /// unknown: then the invalidation runs here anyway, and the other hosts replay the
    /// operation if it is in the log).
    ///
    /// Dropping the future does not cancel the command: once handed to the pipeline it
    /// runs, and if it commits, its invalidation runs here all the same.
    pub async fn run<C: Command>(&self, command: C) -> Result<C::Output, CommandError> {
        // The task-local of the RPC call that runs this command, if one does: the batch may
        // run it on another task.
        let caller = coherent_rpc::CallContext::current().and_then(|c| c.identity().cloned());
        let (output, acks) = self.submit(command, caller).await?;
        let inner = &*self.inner;
        if let Some(wait) = acks {
            inner.await_acks(wait).await;
        }
        if let Some(wait) = &inner.after_invalidate {
            wait().await;
        }
        Ok(output)
    }

    /// [`run`](Self::run) without the wait for the other hosts' acknowledgements (nor
    /// [`HostBuilder::after_invalidate`]): returns once the operation committed and its
    /// invalidation ran here. For the change feed, whose operations no caller reads after:
    /// the other hosts apply them as they apply every operation, and the feed reads on.
    pub(crate) async fn run_unacknowledged<C: Command>(
        &self,
        command: C,
    ) -> Result<C::Output, CommandError> {
        Ok(self.submit(command, None).await?.0)
    }

    /// Hands `command` to the pipeline and waits for its commit and its invalidation here;
    /// answers its output and what waits for the other hosts' acknowledgements.
    async fn submit<C: Command>(
        &self,
        command: C,
        caller: Option<coherent_rpc::Identity>,
    ) -> Result<(C::Output, Option<AckWait>), CommandError> {
        let inner = &*self.inner;
        let handler = inner.handlers.typed::<C>()?;
        let command_json = serde_json::to_string(&command)?;
        let (answer, answered) = oneshot::channel();
        let batch = inner.batcher.push(Box::new(TypedJob {
            handler,
            host: inner.id.clone(),
            command,
            command_json,
            caller,
            output: None,
            answer,
        }))?;
        if let Some(batch) = batch {
            // A transaction was free: commit here, in the caller's task, rather than hand
            // the command to another task and wait to be woken with its answer.
            Committing::new(&self.inner, batch).await;
        }
        answered.await.map_err(|_| {
            CommandError::new(
                ErrorKind::Unavailable,
                "the host stopped, or the command's handler panicked, before the command's \
                 outcome was known",
            )
        })?
    }

    /// Runs a command given by name and as JSON (what remote callers send); answers the
    /// output as JSON. The built-in commands (named `coherent.*`, such as the change feed's
    /// `coherent.db_changes`) are refused: they are the host's own, and one sent by a
    /// client could flush every host or forge changes.
    pub async fn run_json(&self, kind: &str, command: String) -> Result<String, CommandError> {
        if kind.starts_with("coherent.") {
            return Err(CommandError::new(
                ErrorKind::UnknownCommand,
                format!("{kind:?} is a built-in command of the hosts: not run for a caller"),
            ));
        }
        let run = &self.inner.handlers.get(kind)?.run_json;
        run(self.clone(), command).await
    }

    /// Reads the log now and applies what is new; returns when done. Hosts do this on
    /// their own (after each notification without the operation, every poll interval,
    /// and after their notifier reconnects); call it to be sure that everything committed
    /// before the call is applied here when it returns (and, with
    /// [`HostBuilder::after_invalidate`], has reached this host's clients).
    pub async fn catch_up(&self) -> Result<(), CommandError> {
        self.inner.round().await?;
        // An operation the read skipped because a notification had marked it may still be
        // in its invalidation on the notifier's task: wait for that to end.
        drop(self.inner.applying.lock());
        if let Some(wait) = &self.inner.after_invalidate {
            wait().await;
        }
        Ok(())
    }

    /// The operations this host applies from now on, as they are applied (its own
    /// included). A receiver that falls behind by more than 4,096 loses the oldest.
    pub fn subscribe(&self) -> broadcast::Receiver<Applied> {
        self.inner.applied_tx.subscribe()
    }

    /// The counters.
    pub fn stats(&self) -> HostStats {
        let c = &self.inner.counters;
        // Acquire: a count read here comes with what was done before it was counted (a
        // failed replay is counted after its flush).
        let r = |a: &AtomicU64| a.load(Ordering::Acquire);
        // One lock at a time, each let go before the next is taken: a command's finish
        // holds the publisher while it takes the peers and the waits, so holding these
        // together (the temporaries of one expression live to its end) could deadlock.
        let peers = self
            .inner
            .peers
            .lock()
            .values()
            .filter(|p| !p.suspect)
            .count() as u64;
        let horizon = self.inner.state.lock().cursor.horizon;
        let acks_waiting = self.inner.waiting.lock().len() as u64;
        let notify_queued = match &*self.inner.publisher.lock() {
            Publisher::Postgres { queue, .. } => queue.queued() as u64,
            _ => 0,
        };
        let changes_stat = |f: fn(&ApplyChanges) -> &AtomicU64| {
            self.inner
                .changes
                .as_ref()
                .map_or(0, |a| f(a).load(Ordering::Relaxed))
        };
        HostStats {
            commands: r(&c.commands),
            command_errors: r(&c.command_errors),
            applied_notified: r(&c.applied_notified),
            applied_from_log: r(&c.applied_from_log),
            duplicates: r(&c.duplicates),
            unknown: r(&c.unknown),
            undecodable: r(&c.undecodable),
            replay_panics: r(&c.replay_panics),
            implausible: r(&c.implausible),
            messages_refused: r(&c.messages_refused),
            rounds: r(&c.rounds),
            round_errors: r(&c.round_errors),
            flushes: r(&c.flushes) + changes_stat(|a| &a.flushes),
            change_hints: changes_stat(|a| &a.hints),
            change_hints_paired: changes_stat(|a| &a.paired),
            change_holds: changes_stat(|a| &a.held),
            trimmed: r(&c.trimmed),
            batches: r(&c.batches),
            batches_split: r(&c.batches_split),
            fused: r(&c.fused),
            own_applied: r(&c.own_applied),
            acks_received: r(&c.acks_received),
            ack_timeouts: r(&c.ack_timeouts),
            peers_left: r(&c.peers_left),
            lease_waits: r(&c.lease_waits),
            log_waits: r(&c.log_waits),
            log_wait_timeouts: r(&c.log_wait_timeouts),
            commits_retried: r(&c.commits_retried),
            fences: r(&c.fences),
            rejoins_incomplete: r(&c.rejoins_incomplete),
            leases_lost: r(&c.leases_lost),
            peers,
            horizon,
            acks_waiting,
            notify_queued,
            notices_dropped: r(&self.inner.outbox.notices_dropped),
            notices_skipped: r(&c.notices_skipped),
            acks_dropped: r(&self.inner.outbox.acks_dropped),
        }
    }

    /// Where this host's notifications travel: the NATS subject or the PostgreSQL channel
    /// (`None` when it polls). Every host of a log uses the same one. Anyone may write
    /// there who can connect to the database (or publish on the NATS server): what is
    /// not sealed under the cluster's key is refused (see
    /// [`HostBuilder::accept_unsealed`]).
    pub fn notification_channel(&self) -> Option<String> {
        self.inner.publisher.lock().channel(&self.inner.db)
    }

    /// Where this host hears the other hosts' acknowledgements, hellos, welcomes and
    /// farewells: a channel (PostgreSQL) or subject (NATS) of its own, derived from
    /// [`notification_channel`](Self::notification_channel) and its id. `None` when it
    /// polls. Sealed like the notices.
    pub fn acknowledgement_channel(&self) -> Option<String> {
        self.notification_channel()
            .map(|base| notify::ack_channel(&base, &self.inner.id))
    }

    /// Where this host hears the change feed's hints (the changes it read, sent ahead of
    /// their operation): a PostgreSQL channel of the cluster's, derived from
    /// [`notification_channel`](Self::notification_channel). `None` without watches
    /// ([`HostBuilder::watch`]) or without PostgreSQL's notifier (no hints are sent then).
    /// Sealed like the notices: a hint without a seal under the cluster's key is refused.
    pub fn change_hint_channel(&self) -> Option<String> {
        self.inner.changes.as_ref()?;
        match (&*self.inner.publisher.lock(), &*self.inner.db.inner) {
            (Publisher::Postgres { .. }, Engine::Postgres(pg)) => {
                Some(notify::hint_channel(&pg.channel))
            }
            _ => None,
        }
    }

    /// Whether the notifier is connected now (always `true` for [`Notifier::Poll`]).
    pub fn notifier_connected(&self) -> bool {
        !self.inner.notifier_down.load(Ordering::Acquire)
    }

    /// Whether this host fences its registries now: no call answers from their caches
    /// (each recomputes, from the database). A host with a notifier is fenced from its
    /// start, and again whenever its notifier drops, until it has rejoined: its notifier
    /// is up, every live host has welcomed it (from then on their commands wait for it,
    /// and it has the notices of those that did not), and it has read the log. Meanwhile
    /// the other hosts' commands may return without its acknowledgement, so an entry it
    /// computed could be stale by the time it is read (issue 30: found by the checker,
    /// under a restarted NATS server). With [`Notifier::Poll`], never. A hold of the
    /// change feed (a new slot waiting: [`HostStats::change_holds`]) fences the registries
    /// too but is not counted here: ask a registry ([`Registry::is_fenced`]).
    pub fn is_fenced(&self) -> bool {
        self.inner.fenced.load(Ordering::Acquire)
    }

    /// Deletes the operations older than the retention that every live host has passed
    /// (hosts do it on their own every minute or so). Returns how many were deleted.
    pub async fn trim(&self) -> Result<u64, CommandError> {
        self.inner.trim().await
    }

    /// Stops the host: its tasks end, commands waiting for a transaction fail (those in one
    /// finish) and later ones are refused, its row leaves the hosts table (it no longer
    /// holds trimming back), and it tells the other hosts, so that their commands stop
    /// waiting for its acknowledgements at once.
    pub async fn stop(&self) {
        self.inner.stop.send_replace(true);
        self.inner.batcher.close();
        // Its registries are a local cache from now on: not left fenced.
        self.inner.release();
        if let Some(changes) = &self.inner.changes {
            changes.release_all();
        }
        // A heartbeat under way ends first (the next sees the stop): none comes after the
        // row is deleted.
        drop(self.inner.beat.lock().await);
        if let Err(e) = self.inner.db.leave(&self.inner.id).await {
            tracing::warn!(host = %self.inner.id, %e, "could not leave the hosts table");
        }
        let peers: Vec<String> = self.inner.peers.lock().keys().cloned().collect();
        if let Err(e) = notify::farewell(&self.inner, &peers).await {
            tracing::debug!(host = %self.inner.id, %e, "could not tell the other hosts it stopped");
        }
    }
}

impl Inner {
    /// Commits a batch of commands in one transaction and finishes each; if the batch
    /// fails before its commit, runs its commands again one at a time.
    async fn commit(&self, mut batch: Vec<Box<dyn Job>>) {
        let result = self.transact(&mut batch).await;
        match result {
            Ok(ids) => {
                for (job, id) in batch.into_iter().zip(ids) {
                    self.finish(job, Ok(id));
                }
            }
            Err((e, false)) if batch.len() > 1 => {
                self.counters.batches_split.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(host = %self.id, commands = batch.len(), %e,
                    "a batch failed: its commands run one at a time");
                for job in batch {
                    let mut one = [job];
                    let result = self.transact(&mut one).await;
                    let [job] = one;
                    self.finish(job, result.map(|ids| ids[0]));
                }
            }
            Err((e, commit_attempted)) => {
                for job in batch {
                    self.finish(job, Err((e.clone(), commit_attempted)));
                }
            }
        }
    }

    /// Runs a batch's transaction; one that lost its connection before anything ran
    /// (PostgreSQL ended the session: a terminated backend, a failover) runs again on
    /// another, [`COMMIT_TRIES`] times in all: the caller never hears of it (issue 30,
    /// hole 6). One whose commit may have happened is never run again.
    async fn transact(
        &self,
        batch: &mut [Box<dyn Job>],
    ) -> Result<Vec<(i64, u64)>, (CommandError, bool)> {
        let mut tries = 0;
        loop {
            tries += 1;
            let result = self.db.transact(batch, &self.counters.fused).await;
            self.counters.batches.fetch_add(1, Ordering::Relaxed);
            if let Err((e, _)) = &result {
                if e.is_connection_gone() {
                    // The pool's idle connections went the same way, most likely (a
                    // failover, a restart, every backend terminated): none is handed out.
                    self.db.drop_idle_connections();
                }
            }
            match result {
                // `false`: nothing committed (the server refused, or nothing was sent).
                Err((e, false)) if e.is_connection_gone() && tries < COMMIT_TRIES => {
                    self.counters
                        .commits_retried
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(host = %self.id, %e, tries, "a transaction lost its connection before it ran: again");
                    tokio::time::sleep(Duration::from_millis(if tries == 1 { 5 } else { 50 }))
                        .await;
                }
                result => return result,
            }
        }
    }

    /// [`commit`](Self::commit), with a panic caught: should anything but a handler or an
    /// invalidation panic (those are caught per command: `run_handler`, [`Inner::finish`]),
    /// the batch is lost (its callers hear that the outcome is unknown; an open transaction
    /// rolls back), not the transaction's slot.
    async fn commit_caught(&self, batch: Vec<Box<dyn Job>>) {
        if std::panic::AssertUnwindSafe(self.commit(batch))
            .catch_unwind()
            .await
            .is_err()
        {
            tracing::error!(host = %self.id, "committing a batch of commands panicked");
        }
    }

    /// Finishes one command of a batch. An invalidation that panics loses its own
    /// command's answer (its caller hears that the outcome is unknown), not the others'.
    fn finish(&self, job: Box<dyn Job>, result: Result<(i64, u64), (CommandError, bool)>) {
        let finished =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.finish(self, result)));
        if finished.is_err() {
            // Its invalidation may not have run, and nothing else may: the host's own
            // operations are left to it (its log reader applies only those it did not
            // see finished, `Inner::apply_own`, whenever it reads them).
            self.flush("a command's invalidation panicked");
        }
    }

    /// Applies an operation of this host's that a read of the log found and whose commit
    /// the host did not see (the connection was lost under it, and the command answered
    /// that its outcome is unknown). The host invalidated by its output then, or flushed,
    /// but the commit may have come after (a statement that committed alone, or a
    /// `COMMIT`, still running in a backend whose client was gone), and a read in between
    /// may have cached what was there before; the log reader skips nothing of it now.
    /// Found by `postgres_a_finishing_write_that_commits_after_its_cut_is_applied`. (It
    /// also applies, harmlessly, one whose commit the host saw but had not finished yet.)
    fn apply_own(&self, op: &Logged) {
        if self.replay(op).is_some() {
            self.flush("an operation of this host's, committed unseen, that does not replay");
        }
        self.counters.own_applied.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs operation `op`'s invalidation by its handler here; `None` when it ran,
    /// otherwise why it could not (a command this host does not know, one that does not
    /// decode here, an invalidation that panics: logged) and the counter of that reason.
    fn replay(&self, op: &Logged) -> Option<(&'static str, &AtomicU64)> {
        match self.handlers.get(&op.kind) {
            Ok(registered) => {
                let replay = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    (registered.replay)(&op.command, &op.output)
                }));
                match replay {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => {
                        tracing::error!(host = %self.id, op = op.id, kind = op.kind, %e,
                            "an operation that does not decode here: flushing the cache");
                        Some((
                            "an operation that does not decode here",
                            &self.counters.undecodable,
                        ))
                    }
                    Err(_) => {
                        tracing::error!(host = %self.id, op = op.id, kind = op.kind,
                            "an operation's invalidation panicked here: flushing the cache");
                        Some((
                            "an operation's invalidation panicked",
                            &self.counters.replay_panics,
                        ))
                    }
                }
            }
            Err(_) => {
                tracing::error!(host = %self.id, op = op.id, kind = op.kind,
                    "no handler for this operation's command here (a host of another \
                     release?): flushing the cache");
                Some((
                    "an operation of a command this host does not know",
                    &self.counters.unknown,
                ))
            }
        }
    }

    /// Applies another host's operation unless it is applied already.
    pub(crate) fn apply(&self, op: &Logged, committed_at: i64, via: Via) {
        let _applying = self.applying.lock();
        {
            let mut state = self.state.lock();
            if via == Via::Notification
                && (op.position > state.cursor.next.saturating_add(MAX_AHEAD)
                    || state.applied.len() >= MAX_APPLIED)
            {
                // Not a plausible operation (or a flood of them): notifications are only
                // wake-ups, the log decides.
                drop(state);
                self.counters.implausible.fetch_add(1, Ordering::Relaxed);
                self.owe_read();
                return;
            }
            // Read by the cursor: a read of the log applied it (or it predates this host).
            // Otherwise, the same id at the same position with the same content is the
            // same operation; a notice that claimed the id with anything else was not,
            // and the log's version is applied.
            let mark = (op.position, content_hash(op));
            let seen = state.cursor.has_read(op.position)
                || state.applied.insert(op.id, mark) == Some(mark);
            if seen {
                drop(state);
                self.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                self.acknowledge(&op.host, op.id);
                return;
            }
        }
        // An operation this host cannot replay (a command of another release, one that
        // does not decode here, an invalidation that panics) may have changed anything
        // this host's cache holds: the cache is flushed before the operation is
        // acknowledged, as after a lost notifier (issue 30, holes 2 and 4).
        let failed = self.replay(op);
        if let Some((why, counter)) = failed {
            // Not counted as applied (nor sent to subscribers): its own invalidation did
            // not run. The flush stands in for it, so its host need not wait. Counted
            // after the flush: whoever sees the count sees the cache flushed.
            self.flush(why);
            counter.fetch_add(1, Ordering::Release);
            self.acknowledge(&op.host, op.id);
            return;
        }
        match via {
            Via::Notification => &self.counters.applied_notified,
            _ => &self.counters.applied_from_log,
        }
        .fetch_add(1, Ordering::Relaxed);
        let _ = self.applied_tx.send(Applied {
            id: op.id,
            host: op.host.as_str().into(),
            kind: op.kind.as_str().into(),
            committed_at,
            applied_at: now_micros() + self.clock_skew,
            via,
        });
        self.acknowledge(&op.host, op.id);
    }

    /// Tells the host of operation `id` that it is applied here (after this host's
    /// clients have it, with [`HostBuilder::after_invalidate`]).
    fn acknowledge(&self, to: &str, id: i64) {
        let Some(sender) = self.publisher.lock().ack_sender(&self.id) else {
            return;
        };
        match (
            &self.after_invalidate,
            tokio::runtime::Handle::try_current(),
        ) {
            (Some(wait), Ok(runtime)) => {
                let wait = wait();
                let to = to.to_owned();
                runtime.spawn(async move {
                    wait.await;
                    sender.send(&to, id);
                });
            }
            _ => sender.send(to, id),
        }
    }

    /// Registers a command's wait for the other live hosts' acknowledgements, if it waits;
    /// and says whether the host is alone: no other host may need its notices now, since it
    /// keeps its peers (the acknowledgements are on) and knows none. Both from one look at
    /// the peers (a peer dropped between two looks would be waited for and not notified).
    /// Asked under the publisher's lock, as a hello is answered: a host that joins is fenced until every live host welcomes it,
    /// and reads the log once welcomed, so an operation whose notice was skipped before
    /// the welcome (it committed before) is in what it reads; after the welcome, the
    /// joiner is a peer and the notices go. One that lifts its fence without this host's
    /// welcome (it waited [`HostBuilder::acknowledgements`]'s rejoin time out: this host
    /// paused or cut off) was never waited for by this host's commands, notified or not;
    /// it applies what this host skipped at its next read of the log (every poll
    /// interval) instead of at the notice.
    fn expect_acks(&self, id: i64, publisher: &Publisher) -> (Option<AckWait>, bool) {
        if self.acknowledgements.is_none() || !publisher.acks() {
            return (None, false);
        }
        let Some(sends) = publisher.sends().cloned() else {
            return (None, false);
        };
        let mut pending = HashSet::new();
        let mut skipped = false;
        for (host, peer) in self.peers.lock().iter() {
            if peer.suspect {
                skipped = true;
            } else {
                pending.insert(host.clone());
            }
        }
        if pending.is_empty() && !skipped {
            return (None, true);
        }
        let (done, rx) = oneshot::channel();
        let waits = !pending.is_empty();
        if !waits {
            drop(done);
        } else {
            self.waiting.lock().insert(
                id,
                Waiter {
                    pending,
                    done: Some(done),
                },
            );
        }
        (
            Some(AckWait {
                id,
                done: rx,
                waiting: Arc::downgrade(&self.waiting),
                seq: 0,
                position: 0,
                sends,
                skipped,
                waits,
            }),
            false,
        )
    }

    /// Waits for a command's acknowledgements: first for its notice to go out (at most
    /// [`notify::SEND_GIVE_UP`]), then at most the configured time; hosts that did not
    /// answer in it are not waited for again until heard from. The ordering argument
    /// (ARCHITECTURE.md) needs both: a host whose lease is valid when a read starts got a
    /// ping back that it sent after every notice out before `lease` ago, so once a notice
    /// has been out for longer than the lease, every host that has not applied it answers
    /// nothing from its cache. Counted from the commit instead, a notice held in the queue
    /// ate the deadline (issue 30: the checker's stale reads under load). A host not
    /// waited for (a suspect) is covered the same way: the command answers no sooner than
    /// a lease after its notice went out.
    async fn await_acks(&self, mut wait: AckWait) {
        // However this ends (the caller may drop `run`'s future), `wait` drops, and with
        // it the entry.
        let waits = wait.waits;
        let sends = wait.sends.clone();
        let out = async {
            let sent = tokio::time::timeout(sends.give_up, sends.wait_out(wait.seq)).await;
            sent.is_ok() && sends.went_out(wait.seq)
        };
        let went_out = if waits && !wait.skipped {
            // Every host waited for may answer first (having read the log).
            tokio::select! {
                _ = &mut wait.done => return,
                out = out => out,
            }
        } else {
            out.await
        };
        if !went_out {
            // No other host heard of it: none answers for it, and their leases (their own
            // pings) say nothing about it. They learn of it from the log.
            self.counters.log_waits.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(host = %self.id, op = wait.id,
                "a notice did not go out: waiting for the other hosts to read it from the log");
            self.await_log_reads(wait.id, wait.position, self.log_wait)
                .await;
            return;
        }
        let out_at = Instant::now();
        if waits {
            let timeout = self.acknowledgements.unwrap_or_default();
            if tokio::time::timeout(timeout, &mut wait.done).await.is_err() {
                let waiter = self.waiting.lock().remove(&wait.id);
                if let Some(waiter) = waiter {
                    {
                        let mut peers = self.peers.lock();
                        for host in &waiter.pending {
                            if let Some(peer) = peers.get_mut(host) {
                                peer.suspect = true;
                            }
                        }
                    }
                    self.counters.ack_timeouts.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(host = %self.id, op = wait.id, missing = ?waiter.pending,
                        "hosts did not acknowledge an operation in time: not waited for until heard from again");
                }
            }
        }
        if wait.skipped {
            if let Some(lease) = self.lease {
                self.counters.lease_waits.fetch_add(1, Ordering::Relaxed);
                if let Some(until) = out_at.checked_add(lease.saturating_add(LEASE_SLACK)) {
                    tokio::time::sleep_until(until.into()).await;
                }
            }
        }
    }

    /// Waits until every other live host (by its row, the database's clock) has read the
    /// log past `position`, at most `limit`: what a command whose notice did not go out
    /// waits for instead of acknowledgements. A host's row records how far it read with
    /// each heartbeat (every second); one that stops beating is dropped from the live
    /// hosts after `PEER_ALIVE`, and stops answering from its cache before that (8). The
    /// commands waiting so share one query every `LOG_WAIT_POLL` (`log_floor`): after an
    /// outage of the notifier thousands may wait at once, on the pool the heartbeats use.
    async fn await_log_reads(&self, op: i64, position: u64, limit: Duration) {
        let deadline = Instant::now() + limit;
        let alive = PEER_ALIVE.min(self.host_expiry);
        let mut changes = self.log_floor.subscribe();
        let mut failure = None;
        loop {
            let (at, floor) = *changes.borrow_and_update();
            // Every other live host's row said it read past the operation (a fact that
            // stays true: a host's horizon only grows, a new one starts past it).
            if at.is_some() && floor > position {
                return;
            }
            if Instant::now() >= deadline {
                self.counters
                    .log_wait_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                let behind = self.db.hosts_behind(position, alive, &self.id).await;
                tracing::warn!(host = %self.id, op, ?behind, ?failure,
                    "hosts did not read the log past an operation whose notice did not go out: answering without them");
                return;
            }
            // Stale: one waiter asks the database, the others wait for its answer.
            if at.is_none_or(|t| t.elapsed() >= LOG_WAIT_POLL) {
                if let Ok(_polling) = self.log_poll.try_lock() {
                    match self.db.min_live_horizon(alive, &self.id).await {
                        Ok(floor) => {
                            self.log_floor.send_replace((Some(Instant::now()), floor));
                        }
                        Err(e) => failure = Some(e),
                    }
                    tokio::time::sleep(LOG_WAIT_POLL).await;
                    continue;
                }
            }
            let _ = tokio::time::timeout(LOG_WAIT_POLL, changes.changed()).await;
        }
    }

    /// An acknowledgement from another host.
    pub(crate) fn ack_received(&self, ack: Ack) {
        if ack.from == self.id {
            if ack.ping != 0 {
                self.ping_back(ack.ping);
            }
            return;
        }
        if ack.bye {
            self.peer_left(&ack.from);
            return;
        }
        if ack.hello {
            // Counted in, and welcomed, under the publisher's lock: a command of this host
            // either registered its wait before (and its notice is queued before the
            // welcome, so the greeting host applies it before it lifts its fence), or
            // after (and it waits for the greeting host).
            let publisher = self.publisher.lock();
            self.heard_from(&ack.from);
            publisher.send_control(
                &ack.from,
                &Ack {
                    from: self.id.clone(),
                    welcome: true,
                    round: ack.round,
                    ..Ack::default()
                },
            );
            return;
        }
        if ack.welcome {
            // Of this rejoin (or of a release before seals, when those are let in); the
            // round read under the set's lock, which a new rejoin changes it under.
            let mut welcomed = self.welcomed.lock();
            let round = self.rejoin_round.load(Ordering::Acquire);
            if ack.round != round && !(ack.round == 0 && self.accept_unsealed) {
                return;
            }
            welcomed.insert(ack.from.clone());
            drop(welcomed);
            self.heard_from(&ack.from);
            return;
        }
        self.counters
            .acks_received
            .fetch_add(ack.ids.len() as u64, Ordering::Relaxed);
        self.heard_from(&ack.from);
        let mut waiting = self.waiting.lock();
        for id in ack.ids {
            let Some(waiter) = waiting.get_mut(&id) else {
                continue;
            };
            waiter.pending.remove(&ack.from);
            if waiter.pending.is_empty() {
                if let Some(done) = waiting.remove(&id).and_then(|w| w.done) {
                    let _ = done.send(());
                }
            }
        }
    }

    /// `host` stopped: forgotten, and no command waits for it any more.
    fn peer_left(&self, host: &str) {
        self.left.lock().insert(host.to_owned(), Instant::now());
        if self.peers.lock().remove(host).is_some() {
            self.counters.peers_left.fetch_add(1, Ordering::Relaxed);
        }
        let mut waiting = self.waiting.lock();
        let done: Vec<i64> = waiting
            .iter_mut()
            .filter_map(|(id, w)| (w.pending.remove(host) && w.pending.is_empty()).then_some(*id))
            .collect();
        for id in done {
            if let Some(done) = waiting.remove(&id).and_then(|w| w.done) {
                let _ = done.send(());
            }
        }
    }

    /// `host` is alive: waited for from now on.
    fn heard_from(&self, host: &str) {
        if self.acknowledgements.is_none() {
            return;
        }
        if self.left.lock().contains_key(host) {
            return;
        }
        self.peers.lock().insert(
            host.to_owned(),
            Peer {
                suspect: false,
                heard: Instant::now(),
            },
        );
    }

    /// Reads which other hosts are alive (their rows in the hosts table).
    pub(crate) async fn refresh_peers(&self) -> Result<(), CommandError> {
        if self.acknowledgements.is_none() || !self.publisher.lock().acks() {
            return Ok(());
        }
        // A host heard from after this (its hello, say) stays, whatever the read says: it
        // may have begun before that host's row was written.
        let asked = Instant::now();
        let live = self.db.live_hosts(PEER_ALIVE.min(self.host_expiry)).await?;
        let left = {
            let mut left = self.left.lock();
            left.retain(|_, at| at.elapsed() < Duration::from_secs(60));
            left.keys().cloned().collect::<HashSet<_>>()
        };
        let mut peers = self.peers.lock();
        let mut before = std::mem::take(&mut *peers);
        for host in live {
            if host != self.id && !left.contains(&host) {
                let peer = before.remove(&host).unwrap_or(Peer {
                    suspect: false,
                    heard: asked,
                });
                peers.insert(host, peer);
            }
        }
        for (host, peer) in before {
            if peer.heard > asked && !left.contains(&host) {
                peers.insert(host, peer);
            }
        }
        Ok(())
    }

    /// [`admit`](Self::admit) for a notice. One refused still wakes the log reader, unread,
    /// as a notice without its operation does: it may be the notice of a host of a
    /// release before seals (or of one whose key is not this host's), and a ping of this
    /// host that comes back after it must not renew the lease before the log is read
    /// (`reads_owed`). A stranger's flood costs reads of the log, one at a time, as
    /// undecodable notices always have.
    pub(crate) fn admit_notice(&self, payload: &[u8]) -> bool {
        let admitted = self.admit(payload, "a notice");
        if !admitted {
            self.owe_read();
        }
        admitted
    }

    /// Whether a message of the notifier counts: sealed under the cluster's key, or
    /// unsealed where [`HostBuilder::accept_unsealed`] allows it. A refused one is counted
    /// and dropped.
    pub(crate) fn admit(&self, payload: &[u8], what: &'static str) -> bool {
        let why = match self.seal.open(payload) {
            crate::seal::Opened::Sealed => return true,
            crate::seal::Opened::Unsealed if self.accept_unsealed => return true,
            crate::seal::Opened::Unsealed => "it has no seal",
            crate::seal::Opened::Forged => "its seal does not check out",
        };
        let refused = self
            .counters
            .messages_refused
            .fetch_add(1, Ordering::Relaxed);
        // The first, then one in 1,024: a stranger's flood does not flood the log.
        if refused % 1024 == 0 {
            tracing::warn!(
                what,
                why,
                refused = refused + 1,
                "a message of the notifier refused: someone other than this cluster's hosts \
                 writes on its channel, or a host of a release before seals (of hints: before \
                 sealed hints) runs (see \
                 HostBuilder::accept_unsealed)"
            );
        }
        false
    }

    /// A notification that did not decode: count it, and read the log.
    pub(crate) fn bad_notice(&self, e: &dyn std::fmt::Display) {
        self.counters.implausible.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%e, "an undecodable notification: reading the log");
        self.owe_read();
    }

    pub(crate) fn apply_notice(&self, notice: Notice) {
        if notice.host == self.id {
            return;
        }
        self.heard_from(&notice.host);
        match notice.op {
            Some(op) => self.apply(
                &Logged {
                    id: notice.id,
                    position: notice.position,
                    host: notice.host,
                    logged_at: notice.committed_at,
                    kind: op.kind,
                    command: op.command,
                    output: op.output,
                },
                notice.committed_at,
                Via::Notification,
            ),
            None => self.owe_read(),
        }
    }

    /// Reads every operation the cursor has not read (page by page), applies those not
    /// applied yet, and moves the cursor (see `db/log.rs`).
    async fn round(&self) -> Result<(), CommandError> {
        let _one_at_a_time = self.round.lock().await;
        // The reads owed before this one began are done when it is.
        let owed = self.reads_owed.load(Ordering::Acquire);
        self.counters.rounds.fetch_add(1, Ordering::Relaxed);
        let from = self.state.lock().cursor.clone();
        let mut reading = Reading::new(from);
        loop {
            let rows = match reading.next_page(&self.db).await {
                Ok(Some(rows)) => rows,
                Ok(None) => break,
                Err(e) => {
                    self.counters.round_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            };
            // A page of SQLite is read without an await: let the runtime breathe.
            tokio::task::yield_now().await;
            for op in &rows {
                if op.host == self.id {
                    // Ours: `run` invalidated here right after the commit (this id is this
                    // process's alone, so no earlier process's operation is skipped),
                    // unless its commit was not seen: then it is applied now.
                    // Kept until the cursor passes it: a page may be read twice.
                    if !self.state.lock().own.contains_key(&op.id) {
                        self.apply_own(op);
                    }
                    continue;
                }
                self.apply(op, op.logged_at, Via::Log);
            }
        }
        let to = reading.finish();
        let mut state = self.state.lock();
        // Remembered only while the cursor has not read them.
        state.applied.retain(|_, (p, _)| !to.has_read(*p));
        state.own.retain(|_, p| !to.has_read(*p));
        state.cursor = to;
        drop(state);
        self.reads_done.fetch_max(owed, Ordering::AcqRel);
        self.ping_back_pending();
        Ok(())
    }

    /// The notifier may have dropped operations: until the log has been read again, no
    /// entry of this host's cache can be trusted, so every one is invalidated (the next
    /// reads recompute from the database), and the log is read at once.
    ///
    /// And until it has rejoined ([`Inner::rejoin`]), it answers nothing from its cache
    /// (its registries are fenced): the other hosts' commands may return without its
    /// acknowledgement meanwhile, so an entry computed now may be stale by the time it
    /// is read.
    pub(crate) fn notifier_lost(&self, why: &str) {
        {
            // With the fence's lock: a rejoin that checks for losses and lifts the fence
            // runs wholly before this (and the fence goes up again) or after (and sees it).
            let _fence = self.fence_lock.lock();
            self.losses.fetch_add(1, Ordering::AcqRel);
            self.notifier_down.store(true, Ordering::Release);
            self.fence_locked();
        }
        self.flush(why);
        self.wake.notify_one();
    }

    /// This host may have missed notices though its notifier is up (its lease ran out, or
    /// the NATS client dropped messages for a slow consumer): fenced and flushed, and the
    /// rejoin lifts the fence.
    pub(crate) fn missed(&self, why: &str) {
        {
            let _fence = self.fence_lock.lock();
            self.losses.fetch_add(1, Ordering::AcqRel);
            self.fence_locked();
        }
        self.flush(why);
        self.rejoin.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    pub(crate) fn notifier_up(&self) {
        self.notifier_down.store(false, Ordering::Release);
        // What was committed while it was down is read, and the fence lifted, by the
        // rejoin that the log reader runs now.
        self.rejoin.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Fences this host's registries (once, however many times it is called; never once
    /// the host stopped).
    fn fence(&self) {
        let _fence = self.fence_lock.lock();
        self.fence_locked();
    }

    fn fence_locked(&self) {
        if *self.stop.borrow() {
            return;
        }
        if !self.fenced.swap(true, Ordering::AcqRel) {
            self.counters.fences.fetch_add(1, Ordering::Relaxed);
            for r in &self.registries {
                r.fence();
            }
        }
    }

    /// Lifts the fence, and the lease, for good (the host stopped).
    fn release(&self) {
        let _fence = self.fence_lock.lock();
        for r in &self.registries {
            r.clear_lease();
        }
        self.unfence_locked();
    }

    fn unfence_locked(&self) {
        if self.fenced.swap(false, Ordering::AcqRel) {
            for r in &self.registries {
                r.unfence();
            }
        }
    }

    /// Takes (or renews) the lease until `until` (on [`lease_clock`]), but for the
    /// registries no later than three fifths of the liveness window after the last
    /// heartbeat that wrote this host's row began: the other hosts stop waiting for a host
    /// whose row is older than the window, so a host whose heartbeats stall (a slow or
    /// unreachable database) must stop answering from its cache before they do, though
    /// its pings still come back.
    fn renew_lease(&self, until: u64) {
        self.lease_until.fetch_max(until, Ordering::AcqRel);
        let until = until.min(self.beat_until());
        for r in &self.registries {
            r.set_lease(until);
        }
    }

    /// Until when (on [`lease_clock`]) the last heartbeat that went through lets this host
    /// answer from its cache: three fifths of the liveness window after it began.
    fn beat_until(&self) -> u64 {
        let alive = PEER_ALIVE.min(self.host_expiry) * 3 / 5;
        self.beat_ok
            .load(Ordering::Acquire)
            .saturating_add(alive.as_nanos() as u64)
    }

    /// Whether the last heartbeat that went through still lets this host answer from its
    /// cache at `now`.
    fn beat_fresh(&self, now: u64) -> bool {
        self.beat_until() > now
    }

    /// Whether a read of the log is owed (see `reads_owed`).
    fn read_owed(&self) -> bool {
        self.reads_done.load(Ordering::Acquire) < self.reads_owed.load(Ordering::Acquire)
    }

    /// A notification told of an operation without carrying it: the log is read, and the
    /// lease is not renewed before (a host that applies notices as they come may answer
    /// from its cache; one that must read the log first may not, until it has).
    fn owe_read(&self) {
        self.reads_owed.fetch_add(1, Ordering::AcqRel);
        self.wake.notify_one();
    }

    /// A ping this host sent itself at `sent` came back: every notice published before it
    /// was applied here. The lease runs from `sent`; a ping that comes back after the
    /// lease it would give ran out means the host was paused or its notifier stalled.
    fn ping_back(&self, sent: u64) {
        let Some(lease) = self.lease else { return };
        // Each ping comes back once, in the order they were sent: one not newer than the
        // last is heard again (anyone may listen on the channel and send a sealed
        // message again; an old ping would lose the lease), one from the future is no
        // ping of this process's clock.
        if sent > lease_clock() || self.ping_latest.fetch_max(sent, Ordering::AcqRel) >= sent {
            return;
        }
        if self.fenced.load(Ordering::Acquire) {
            return;
        }
        if self.read_owed() {
            // Renews once the read is done (`round`), from when it was sent.
            self.ping_pending.fetch_max(sent, Ordering::AcqRel);
            // The read may have ended meanwhile, and missed this ping.
            self.ping_back_pending();
            return;
        }
        let until = sent.saturating_add(lease.as_nanos() as u64);
        if until > lease_clock() {
            self.renew_lease(until);
        } else {
            self.lease_lost("a ping came back after its lease ran out");
        }
    }

    /// The horizon this host's row may say it read to: the cursor's, once every operation
    /// applied below it has reached this host's clients ([`HostBuilder::after_invalidate`]:
    /// the trusted replicas of `serve_replicas`), else the last one that had. A command
    /// whose notice did not go out takes the rows' horizons for acknowledgements (9), and
    /// an acknowledgement is sent only after that wait too. The wait runs on a task of its
    /// own: a slow client never holds up the heartbeat, which the host's lease depends on.
    fn reported_horizon(&self, host: &Weak<Inner>) -> u64 {
        let horizon = self.state.lock().cursor.horizon;
        let Some(wait) = &self.after_invalidate else {
            return horizon;
        };
        let (wait, host) = (wait(), host.clone());
        tokio::spawn(async move {
            wait.await;
            if let Some(inner) = host.upgrade() {
                inner.delivered_horizon.fetch_max(horizon, Ordering::AcqRel);
            }
        });
        self.delivered_horizon.load(Ordering::Acquire)
    }

    /// Writes this host's row (alive, and its horizon), and notes when it began for the
    /// lease ([`Inner::beat_until`]).
    async fn heartbeat(&self, horizon: u64) -> Result<(), CommandError> {
        let began = lease_clock();
        self.db.heartbeat(&self.id, horizon).await?;
        self.beat_ok.fetch_max(began, Ordering::AcqRel);
        Ok(())
    }

    /// Takes the ping held while a read of the log was owed, once none is owed.
    fn ping_back_pending(&self) {
        if !self.read_owed() {
            let sent = self.ping_pending.swap(0, Ordering::AcqRel);
            if sent != 0 {
                self.ping_back(sent);
            }
        }
    }

    /// The lease ran out (its readers are fenced by it already): fenced, flushed, and the
    /// rejoin (its peers may have stopped waiting for it) lifts the fence.
    fn lease_lost(&self, why: &str) {
        self.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
        self.missed(why);
    }

    /// Sends this host a ping through its notifier; or, when its lease ran out with no
    /// ping back, fences it.
    fn ping(&self) {
        if self.lease.is_none()
            || self.fenced.load(Ordering::Acquire)
            || self.notifier_down.load(Ordering::Acquire)
        {
            return;
        }
        let now = lease_clock();
        let until = self.lease_until.load(Ordering::Acquire);
        if until != 0 && until < now {
            self.lease_lost(
                "no ping came back within the lease (or a read of the log owed took longer)",
            );
            return;
        }
        if !self.beat_fresh(now) {
            // The others may stop waiting for this host: it must greet them again (the
            // rejoin waits for a heartbeat to go through first).
            self.lease_lost("no heartbeat went through for three fifths of the liveness window");
            return;
        }
        self.publisher.lock().send_control(
            &self.id,
            &Ack {
                from: self.id.clone(),
                ping: now,
                ..Ack::default()
            },
        );
    }

    /// The rejoin handshake, once the notifier is up (again): greets every live host and
    /// waits for each one's welcome (sent after every notice of its that did not wait for
    /// this host; commands after it wait for this host), reads the log (what committed
    /// before, whose notices this host may have missed), then lifts the fence, unless
    /// the notifier dropped meanwhile. A host that does not answer is greeted again; after
    /// [`REJOIN_GIVE_UP`] the fence is lifted without it (counted, and said).
    async fn rejoin(&self) -> Result<(), CommandError> {
        let losses = self.losses.load(Ordering::Acquire);
        let started = Instant::now();
        let round = rand::random::<u64>() | 1;
        {
            // Under the set's lock, which a welcome is checked under: one of the round
            // before was counted before this (and is cleared with the set) or is not.
            let mut welcomed = self.welcomed.lock();
            self.rejoin_round.store(round, Ordering::Release);
            welcomed.clear();
        }
        let greet = self.acknowledgements.is_some() && self.publisher.lock().acks();
        loop {
            if !greet {
                break;
            }
            if self.notifier_down.load(Ordering::Acquire)
                || self.losses.load(Ordering::Acquire) != losses
            {
                return Ok(());
            }
            let left: HashSet<String> = self.left.lock().keys().cloned().collect();
            let pending: Vec<String> = self
                .db
                .live_hosts(PEER_ALIVE.min(self.host_expiry))
                .await?
                .into_iter()
                .filter(|h| *h != self.id && !left.contains(h))
                .filter(|h| !self.welcomed.lock().contains(h))
                .collect();
            if pending.is_empty() {
                break;
            }
            if started.elapsed() > REJOIN_GIVE_UP {
                self.counters
                    .rejoins_incomplete
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(host = %self.id, missing = ?pending,
                    "hosts did not welcome this one: it serves from its cache without them");
                break;
            }
            {
                let publisher = self.publisher.lock();
                let hello = Ack {
                    from: self.id.clone(),
                    hello: true,
                    round,
                    ..Ack::default()
                };
                for peer in &pending {
                    publisher.send_control(peer, &hello);
                }
            }
            let wait = self.acknowledgements.unwrap_or_default();
            let asked = Instant::now();
            while asked.elapsed() < wait
                && !pending.iter().all(|h| self.welcomed.lock().contains(h))
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        // The lease runs from before the read: every operation committed before then is
        // applied by it; one committed later goes out as a notice after, and its command
        // answers no sooner than a lease after that (or with this host's acknowledgement),
        // by when this lease is over unless a ping sent after that notice came back.
        let read_from = lease_clock();
        self.round().await?;
        if self.lease.is_some() && !self.beat_fresh(lease_clock()) {
            // Its peers may have stopped waiting for it: fenced until a heartbeat goes
            // through, then greeted again.
            tracing::debug!(host = %self.id, "rejoin waits for a heartbeat to go through");
            self.rejoin.store(true, Ordering::Release);
            return Ok(());
        }
        let _fence = self.fence_lock.lock();
        if !self.notifier_down.load(Ordering::Acquire)
            && self.losses.load(Ordering::Acquire) == losses
            && !*self.stop.borrow()
        {
            if let Some(lease) = self.lease {
                let lease = lease.as_nanos() as u64;
                // The first ping has a lease's time to come back (a read longer than the
                // lease is no sign of a lost notifier).
                self.lease_until
                    .fetch_max(lease_clock().saturating_add(lease), Ordering::AcqRel);
                self.renew_lease(read_from.saturating_add(lease));
            }
            self.unfence_locked();
            tracing::debug!(host = %self.id, "rejoined: serving from the cache");
        }
        Ok(())
    }

    fn flush(&self, why: &str) {
        let n: usize = self.registries.iter().map(Registry::invalidate_all).sum();
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(host = %self.id, invalidated = n, why, "cache flushed");
    }

    async fn trim(&self) -> Result<u64, CommandError> {
        let n = self.db.trim(self.retention, self.host_expiry).await?;
        self.counters.trimmed.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.release();
        if let Some(changes) = &self.changes {
            changes.release_all();
        }
    }
}

/// A command waiting for, or in, a batch, its types erased.
trait Job: Execute {
    /// After the batch: on success the local invalidation, the counters and the notice;
    /// then the answer to the caller.
    fn finish(self: Box<Self>, host: &Inner, result: Result<(i64, u64), (CommandError, bool)>);
}

struct TypedJob<C: Command> {
    handler: Arc<dyn DynHandler<C>>,
    host: String,
    command: C,
    command_json: String,
    /// Who sent it (see [`Tx::caller`]).
    caller: Option<coherent_rpc::Identity>,
    /// The output of the last run of the handler, and its JSON.
    output: Option<(C::Output, String)>,
    answer: oneshot::Sender<Answer<C>>,
}

/// A command's output, and what its caller waits for before answering.
type Answer<C> = Result<(<C as Command>::Output, Option<AckWait>), CommandError>;

impl<C: Command> Execute for TypedJob<C> {
    fn execute<'a, 'b>(
        &'a mut self,
        tx: &'a mut Tx<'b>,
    ) -> BoxFuture<'a, Result<Append, CommandError>>
    where
        'b: 'a,
    {
        Box::pin(async move {
            self.output = None;
            tx.caller.clone_from(&self.caller);
            tx.logging = Some(Append {
                host: self.host.clone(),
                kind: C::NAME,
                command: self.command_json.clone(),
                output: String::new(),
            });
            let result = self.handler.execute(&self.command, tx).await;
            let mut row = tx.logging.take().expect("set above, taken here only");
            if let Some(Finished::Unknown) = &tx.finished {
                // Its last write may have committed, and no output says what it changed
                // (whatever the handler answered after): no output, so that the host
                // flushes rather than invalidate by a guess.
                return Err(result.err().unwrap_or_else(|| {
                    CommandError::new(
                        ErrorKind::Database,
                        format!("{}: the connection was lost under its last write", C::NAME),
                    )
                }));
            }
            if let Some(Finished::Committed { output: logged, .. }) = &tx.finished {
                // The handler's last write committed with its operation's row
                // (`Tx::finish_sql`): the log holds the statement's answer, and that is
                // the command's output, whatever the handler answered after.
                let output: C::Output = serde_json::from_str(logged).map_err(|e| {
                    CommandError::new(
                        ErrorKind::BadCommand,
                        format!(
                            "{}: committed, but the logged output does not decode as the \
                             command's: {e}",
                            C::NAME
                        ),
                    )
                })?;
                match &result {
                    // Checked in debug builds only: compared as JSON values (the logged
                    // text is PostgreSQL's), it took a fifth of a command's instructions.
                    Ok(answered)
                        if cfg!(debug_assertions)
                            && serde_json::to_value(answered).ok()
                                != serde_json::from_str::<serde_json::Value>(logged).ok() =>
                    {
                        tracing::error!(
                            command = C::NAME,
                            "the handler answered another output than its Tx::finish_sql \
                             logged: the logged one is answered"
                        )
                    }
                    Ok(_) => {}
                    Err(e) => tracing::error!(
                        command = C::NAME,
                        %e,
                        "the handler failed after its Tx::finish_sql committed: the \
                         command stands, with the logged output"
                    ),
                }
                row.output.clone_from(logged);
                self.output = Some((output, row.output.clone()));
                return Ok(row);
            }
            let output = result?;
            let output_json = serde_json::to_string(&output)?;
            row.output.clone_from(&output_json);
            self.output = Some((output, output_json));
            Ok(row)
        })
    }
}

impl<C: Command> Job for TypedJob<C> {
    fn finish(self: Box<Self>, inner: &Inner, result: Result<(i64, u64), (CommandError, bool)>) {
        let job = *self;
        match (result, job.output) {
            (Ok((id, position)), Some((output, output_json))) => {
                job.handler.invalidate(&job.command, &output);
                // A read of the log that finds it skips it (see `Inner::apply_own`).
                inner.state.lock().own.insert(id, position);
                let committed_at = now_micros() + inner.clock_skew;
                inner.counters.commands.fetch_add(1, Ordering::Relaxed);
                let _ = inner.applied_tx.send(Applied {
                    id,
                    host: inner.id.as_str().into(),
                    kind: C::NAME.into(),
                    committed_at,
                    applied_at: now_micros() + inner.clock_skew,
                    via: Via::Local,
                });
                let publisher = inner.publisher.lock();
                // Registered before the notice goes: an acknowledgement cannot come first.
                let (mut acks, alone) = inner.expect_acks(id, &publisher);
                let seq = if alone {
                    inner
                        .counters
                        .notices_skipped
                        .fetch_add(1, Ordering::Relaxed);
                    0
                } else {
                    publisher.publish(Notice {
                        id,
                        position,
                        host: inner.id.clone(),
                        committed_at,
                        op: Some(NoticeOp {
                            kind: C::NAME.to_owned(),
                            command: job.command_json,
                            output: output_json,
                        }),
                        seq: 0,
                    })
                };
                if let Some(wait) = &mut acks {
                    wait.seq = seq;
                    wait.position = position;
                }
                drop(publisher);
                let _ = job.answer.send(Ok((output, acks)));
            }
            (result, output) => {
                inner
                    .counters
                    .command_errors
                    .fetch_add(1, Ordering::Relaxed);
                let e = match result {
                    Err((e, commit_attempted)) => {
                        if commit_attempted {
                            // The commit failed: it may have happened. Invalidate to be
                            // safe (the other hosts replay it from the log if it did).
                            match &output {
                                Some((output, _)) => job.handler.invalidate(&job.command, output),
                                // Its last write went before its handler answered
                                // (`Tx::finish_sql`), and the output is not known: what it
                                // changed is not known either.
                                None => inner.flush(
                                    "a command that may have committed left no output to invalidate by",
                                ),
                            }
                        }
                        e
                    }
                    Ok(_) => CommandError::new(
                        ErrorKind::Database,
                        "the batch committed without running this command's handler",
                    ),
                };
                let _ = job.answer.send(Err(e));
            }
        }
    }
}

/// The commands of a host waiting for a transaction, and how many of its transactions
/// are free. A command that finds one free takes it and commits in its caller's task;
/// the others wait in the queue, and whoever commits next takes them, as one batch.
struct Batcher {
    queue: Mutex<Queue>,
    max_batch: usize,
}

struct Queue {
    jobs: VecDeque<Box<dyn Job>>,
    /// The host stopped: nothing is taken any more.
    closed: bool,
    /// Transactions not in use. While none is free, jobs wait; while one is, none waits.
    free: usize,
}

impl Batcher {
    /// Queues `job`; when a transaction is free, takes it and answers the batch to commit
    /// in it (the job alone: nothing waits while a transaction is free). The caller then
    /// commits it and calls [`next`](Self::next) until that answers `None`.
    fn push(&self, job: Box<dyn Job>) -> Result<Option<Vec<Box<dyn Job>>>, CommandError> {
        let mut queue = self.queue.lock();
        if queue.closed {
            return Err(CommandError::new(
                ErrorKind::Unavailable,
                "the host is stopped",
            ));
        }
        if queue.free == 0 {
            queue.jobs.push_back(job);
            return Ok(None);
        }
        queue.free -= 1;
        Ok(Some(vec![job]))
    }

    /// After a transaction's batch: the next batch for it (the oldest waiting jobs, at
    /// most `max_batch`), or `None` when nothing waits (the transaction is free again).
    fn next(&self) -> Option<Vec<Box<dyn Job>>> {
        let mut queue = self.queue.lock();
        if queue.jobs.is_empty() {
            queue.free += 1;
            return None;
        }
        let n = queue.jobs.len().min(self.max_batch);
        Some(queue.jobs.drain(..n).collect())
    }

    /// Refuses new commands and drops the waiting ones (their callers hear that the host
    /// stopped).
    fn close(&self) {
        let jobs = {
            let mut queue = self.queue.lock();
            queue.closed = true;
            std::mem::take(&mut queue.jobs)
        };
        drop(jobs);
    }
}

/// A transaction's work from its first batch on: the batch, then the commands that queued
/// meanwhile (committed on a task of their own, so that the caller who began it gets its
/// answer now). Dropped before it ends (its caller went away), it goes on on a task: a
/// command handed to the pipeline runs.
struct Committing {
    work: Option<BoxFuture<'static, ()>>,
    runtime: tokio::runtime::Handle,
}

impl Committing {
    fn new(host: &Arc<Inner>, batch: Vec<Box<dyn Job>>) -> Self {
        let host = host.clone();
        Self {
            runtime: host.runtime.clone(),
            work: Some(Box::pin(async move {
                host.commit_caught(batch).await;
                if let Some(next) = host.batcher.next() {
                    let runtime = host.runtime.clone();
                    runtime.spawn(async move {
                        let mut batch = next;
                        loop {
                            host.commit_caught(batch).await;
                            match host.batcher.next() {
                                Some(next) => batch = next,
                                None => break,
                            }
                        }
                    });
                }
            })),
        }
    }
}

impl std::future::Future for Committing {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let Some(work) = self.work.as_mut() else {
            return std::task::Poll::Ready(());
        };
        let done = work.as_mut().poll(cx);
        if done.is_ready() {
            self.work = None;
        }
        done
    }
}

impl Drop for Committing {
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            self.runtime.spawn(work);
        }
    }
}

/// Reads the log when woken, and at least every poll interval; trims now and then. Ends
/// when the host is dropped or stopped.
async fn read_loop(host: Weak<Inner>, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    let mut last_ok = Instant::now();
    let mut last_trim = Instant::now();
    // The gap (by the last good read before it) after which the owed flushes were read.
    let mut owed_read_after = None;
    loop {
        let every = {
            let Some(inner) = host.upgrade() else { return };
            if inner.notifier_down.load(Ordering::Acquire) {
                inner.poll.min(Duration::from_millis(50))
            } else {
                inner.poll
            }
        };
        // Waits without holding the host, so that dropping its last handle ends this task.
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|&s| s) => return,
        }
        let Some(inner) = host.upgrade() else { return };
        if last_ok.elapsed() > inner.host_expiry {
            inner.flush("this host read no log for longer than the host expiry");
            // The log may have been trimmed past a hold meanwhile (the others stopped
            // counting this host): the flushes owed are read again, once per gap.
            if let Some(apply) = inner
                .changes
                .as_ref()
                .filter(|_| owed_read_after != Some(last_ok))
            {
                match hold_owed(&inner.db, apply, inner.owed_slot.as_deref()).await {
                    Ok(()) => owed_read_after = Some(last_ok),
                    Err(e) => {
                        tracing::debug!(host = %inner.id, %e, "the flushes owed could not be read");
                    }
                }
            }
        }
        if inner.rejoin.swap(false, Ordering::AcqRel) {
            if let Err(e) = inner.rejoin().await {
                tracing::warn!(host = %inner.id, %e, "rejoining failed: trying again");
                inner.rejoin.store(true, Ordering::Release);
                tokio::time::sleep(Duration::from_millis(50)).await;
                inner.wake.notify_one();
            }
            continue;
        }
        // A panic in a read (replays catch their own) must not end this task: the host
        // would read and trim no more, its notifier still saying it is up.
        match std::panic::AssertUnwindSafe(inner.round())
            .catch_unwind()
            .await
        {
            Ok(Ok(())) => last_ok = Instant::now(),
            Ok(Err(e)) => tracing::warn!(host = %inner.id, %e, "reading the operation log failed"),
            Err(_) => {
                inner.counters.round_errors.fetch_add(1, Ordering::Relaxed);
                inner.flush("a read of the operation log panicked");
            }
        }
        if last_trim.elapsed() >= Duration::from_secs(60).min(inner.retention) {
            last_trim = Instant::now();
            if let Err(e) = inner.trim().await {
                tracing::warn!(host = %inner.id, %e, "trimming the log failed");
            }
        }
    }
}

/// Writes this host's row (alive, and its horizon) and reads which other hosts are alive,
/// every second (a quarter of the host expiry when that is shorter), on a timer of its own:
/// not after reads of the log, whose pace follows the poll interval and which may stall
/// (issue 30, hole 3: a host that polled every 5 s or more, or whose read hung, dropped out
/// of the others' acknowledgement waits). Ends when the host is dropped or stopped.
/// Pings the host through its notifier every fifth of its lease ([`HostBuilder::lease`]).
/// Ends when the host is dropped or stopped.
async fn lease_loop(host: Weak<Inner>, mut stop: watch::Receiver<bool>) {
    let every = {
        let Some(inner) = host.upgrade() else { return };
        let Some(lease) = inner.lease else { return };
        (lease / 5).max(Duration::from_millis(1))
    };
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|&s| s) => return,
        }
        let Some(inner) = host.upgrade() else { return };
        inner.ping();
    }
}

async fn heartbeat_loop(host: Weak<Inner>, mut stop: watch::Receiver<bool>) {
    let every = {
        let Some(inner) = host.upgrade() else { return };
        Duration::from_secs(1)
            .min(inner.host_expiry / 4)
            .max(Duration::from_millis(10))
    };
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // `start` wrote the row and read the live hosts: the first tick is a period away.
    ticks.tick().await;
    loop {
        // Waits without holding the host, so that dropping its last handle ends this task.
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|&s| s) => return,
        }
        let Some(inner) = host.upgrade() else { return };
        {
            let _beat = inner.beat.lock().await;
            if *inner.stop.borrow() {
                return;
            }
            let horizon = inner.reported_horizon(&host);
            if let Err(e) = inner.heartbeat(horizon).await {
                tracing::warn!(host = %inner.id, %e, "heartbeat failed");
            }
        }
        if let Err(e) = inner.refresh_peers().await {
            tracing::warn!(host = %inner.id, %e, "reading the live hosts failed");
        }
    }
}
