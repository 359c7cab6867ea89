//! Notifiers: how a host hears of the operations other hosts commit. A notification only
//! wakes a host up (and, when it carries the operation, saves it a read); the log is the
//! truth, read after every reconnect of the notifier and every poll interval.

use std::sync::Weak;
use std::time::Duration;

#[cfg(feature = "nats")]
use futures::FutureExt;
use futures::StreamExt;
use tokio::sync::watch;

use crate::db::{Database, Engine, PG_PAYLOAD_LIMIT};
use crate::error::{CommandError, ErrorKind};
use crate::host::{Ack, Host, Inner, Notice};
use crate::seal::{Seal, SEAL_LEN};

/// How a host hears of other hosts' operations.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Notifier {
    /// No notifications: the log is read every poll interval (10 ms by default), which
    /// costs a query per interval per host. The default for SQLite, where that query reads
    /// a local file.
    Poll,
    /// PostgreSQL `LISTEN`/`NOTIFY` on the database the commands write to: one more
    /// connection per host, nothing else to run. The default for PostgreSQL.
    Postgres,
    /// NATS at this URL (e.g. `nats://127.0.0.1:4222`): notifications fan out without
    /// loading the database. Feature `nats`.
    #[cfg(feature = "nats")]
    Nats(String),
}

/// Where a host publishes the operations it commits.
pub(crate) enum Publisher {
    None,
    Postgres {
        queue: Outbox,
        channel: String,
        /// The longest notice that fits in a payload of this host's (see [`Packer`]):
        /// a longer one goes without its operation.
        notice_max: usize,
    },
    /// The client (for farewells), the notices' subject, and the queue of the one task
    /// that publishes, in order: a welcome must reach its host after every notice
    /// published before it (issue 30).
    #[cfg(feature = "nats")]
    Nats(async_nats::Client, String, NatsOutbox),
}

/// The queue of a host's NATS publishing task: (subject, payload), published in order.
#[cfg(feature = "nats")]
#[derive(Clone)]
pub(crate) struct NatsOutbox {
    /// (subject, payload, the notice's sequence number or 0).
    queue: tokio::sync::mpsc::Sender<(String, bytes::Bytes, u64)>,
    counts: std::sync::Arc<OutboxCounts>,
    sends: std::sync::Arc<Sends>,
    /// The longest notice the server takes (its `max_payload`, less room for the rest of
    /// the message and its seal): a longer one goes without its operation.
    notice_max: usize,
    /// Every payload is sealed as it is queued.
    seal: Seal,
}

#[cfg(feature = "nats")]
impl NatsOutbox {
    fn push(&self, ack: bool, subject: String, mut payload: Vec<u8>) {
        use tokio::sync::mpsc::error::TrySendError;
        self.seal.seal(&mut payload);
        if let Err(TrySendError::Full(_)) = self.queue.try_send((subject, payload.into(), 0)) {
            self.counts
                .dropped(ack, 1, "the NATS publishing queue is full");
        }
    }

    /// Queues notice `seq`; when the queue is full, its wake-up (`wake_up`, the notice
    /// without its operation) is owed instead (see [`Sends`]).
    fn push_notice(
        &self,
        subject: String,
        mut payload: Vec<u8>,
        seq: u64,
        wake_up: impl FnOnce() -> Vec<u8>,
    ) {
        use tokio::sync::mpsc::error::TrySendError;
        self.seal.seal(&mut payload);
        if let Err(TrySendError::Full(_)) = self.queue.try_send((subject, payload.into(), seq)) {
            self.counts.dropped(
                false,
                1,
                "the NATS publishing queue is full: a wake-up goes instead",
            );
            let mut wake_up = wake_up();
            self.seal.seal(&mut wake_up);
            self.sends.owe(seq, wake_up);
        }
    }
}

/// Publishes what the host queues, in order, in batches: each batch is published and
/// flushed, and its notices are out ([`Sends`]) when this host hears the last of them back
/// from the server (`nats_listen`): the server has then queued it for every subscriber,
/// before anything it receives later. A batch that fails, or whose last notice does not
/// come back within [`ECHO_WAIT`], is published again (the hosts take a notice twice as
/// one). Ends when the host's publisher is dropped.
#[cfg(feature = "nats")]
async fn nats_publish(
    client: async_nats::Client,
    subject: String,
    mut queue: tokio::sync::mpsc::Receiver<(String, bytes::Bytes, u64)>,
    sends: std::sync::Arc<Sends>,
) {
    const BATCH: usize = 256;
    let _all_out = AllOut(sends.clone());
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        tokio::select! {
            n = queue.recv_many(&mut batch, BATCH) => if n == 0 { return },
            () = sends.kick.notified() => {}
        }
        let mut last = batch.iter().map(|(_, _, seq)| *seq).max().unwrap_or(0);
        if let Some((seq, wake_up)) = sends.take_owed() {
            batch.push((subject.clone(), wake_up.into(), seq));
            last = last.max(seq);
        }
        let started = std::time::Instant::now();
        let mut failures = 0u32;
        loop {
            let mut result = Ok(());
            for (subject, payload, _) in &batch {
                if let Err(e) = client.publish(subject.clone(), payload.clone()).await {
                    result = Err(e.to_string());
                    break;
                }
            }
            if result.is_ok() {
                result = match tokio::time::timeout(SEND_RETRY_MAX, client.flush()).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("the flush timed out".to_owned()),
                };
            }
            // A flush only empties the client's buffer. The batch is out when the server
            // has handed its last notice to every subscriber: when this host hears it back.
            if result.is_ok()
                && last != 0
                && tokio::time::timeout(ECHO_WAIT, sends.wait_out(last))
                    .await
                    .is_err()
            {
                result = Err("its last notice did not come back".to_owned());
            }
            match result {
                Ok(()) => break,
                Err(e) if started.elapsed() < sends.give_up && !queue.is_closed() => {
                    failures = failures.saturating_add(1);
                    tracing::debug!(%e, n = batch.len(), "NATS publish failed: publishing again");
                    tokio::time::sleep(retry_wait(failures)).await;
                }
                Err(e) => {
                    tracing::warn!(%e, n = batch.len(),
                        "NATS publish failed for too long: the other hosts read the log at their next poll");
                    sends.gave_up(last);
                    break;
                }
            }
        }
        batch.clear();
        sends.out(last);
    }
}

/// What a host's notifying task (PostgreSQL) dropped, from its start (see
/// [`HostStats`](crate::HostStats)).
#[derive(Default)]
pub(crate) struct OutboxCounts {
    pub(crate) notices_dropped: std::sync::atomic::AtomicU64,
    pub(crate) acks_dropped: std::sync::atomic::AtomicU64,
}

impl OutboxCounts {
    /// Counts `n` notices (or acknowledgements) dropped, and says so now and then (at the
    /// first, the second, the fourth...: an outage does not flood the log).
    fn dropped(&self, ack: bool, n: u64, why: &str) {
        let counter = if ack {
            &self.acks_dropped
        } else {
            &self.notices_dropped
        };
        let before = counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        if (before + n).ilog2() != before.checked_ilog2().unwrap_or(u32::MAX) {
            let what = if ack { "acknowledgements" } else { "notices" };
            tracing::warn!(dropped = before + n, what, why, "notifications dropped");
        }
    }
}

/// How far a host's notices have gone out (issue 30). Each notice gets a sequence number
/// when queued; `out` is the highest whose fate is settled: its `NOTIFY` committed (or its
/// NATS publish was flushed), or its wake-up went out in its place, or sending it failed
/// for [`SEND_GIVE_UP`]. A command's acknowledgement deadline counts from then: counted
/// from the commit, a notice held in the queue (a busy or failed `NOTIFY`, the notify
/// interval) ate the deadline, the command answered before the other hosts could know,
/// and they served their old values under leases their own pings kept valid.
///
/// A notice the full queue cannot take is not dropped without a trace: a wake-up (the
/// notice without its operation: "read the log") is owed, and the sending task sends the
/// latest one owed with its next batch.
pub(crate) struct Sends {
    /// The last sequence number given.
    queued: std::sync::atomic::AtomicU64,
    out: watch::Sender<u64>,
    owed: parking_lot::Mutex<Option<(u64, Vec<u8>)>>,
    /// Wakes the sending task for an owed wake-up.
    kick: tokio::sync::Notify,
    /// How long a batch is tried before it is given up on
    /// ([`HostBuilder::notice_give_up`](crate::HostBuilder::notice_give_up)).
    pub(crate) give_up: Duration,
    /// The sequence numbers (first, last) of the latest batches given up on: counted out,
    /// but the other hosts may not have heard them (at most [`NOT_OUT_KEPT`] batches).
    not_out: parking_lot::Mutex<std::collections::VecDeque<(u64, u64)>>,
}

/// How many given-up batches [`Sends`] remembers: a command asks about its own notice as
/// soon as it is counted out, so only a command that waited on a stalled runtime for as
/// many more give-ups would miss its own.
const NOT_OUT_KEPT: usize = 4096;

impl Sends {
    pub(crate) fn new(give_up: Duration) -> Self {
        Self {
            queued: std::sync::atomic::AtomicU64::new(0),
            out: watch::Sender::new(0),
            owed: parking_lot::Mutex::new(None),
            kick: tokio::sync::Notify::new(),
            give_up,
            not_out: parking_lot::Mutex::default(),
        }
    }

    /// The notices up to `last` not counted out yet are given up on (or could not be sent
    /// at all): they are counted out, and [`went_out`](Self::went_out) says they did not.
    /// All of them, not only the batch's: a batch may carry an owed wake-up numbered past
    /// notices still queued behind it (the queue was full), which counting it out counts
    /// out too (a review finding).
    fn gave_up(&self, last: u64) {
        let first = self.out.borrow().saturating_add(1);
        if first > last {
            return;
        }
        let mut not_out = self.not_out.lock();
        if not_out.len() == NOT_OUT_KEPT {
            not_out.pop_front();
        }
        not_out.push_back((first, last));
    }

    /// Whether notice `seq`, counted out, was sent (not given up on).
    pub(crate) fn went_out(&self, seq: u64) -> bool {
        !self
            .not_out
            .lock()
            .iter()
            .any(|&(first, last)| (first..=last).contains(&seq))
    }

    /// The next sequence number (called under the publisher's lock: numbers are queued in
    /// order).
    fn next(&self) -> u64 {
        self.queued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    fn owe(&self, seq: u64, wake_up: Vec<u8>) {
        let mut owed = self.owed.lock();
        if owed.as_ref().is_none_or(|(s, _)| *s < seq) {
            *owed = Some((seq, wake_up));
        }
        drop(owed);
        self.kick.notify_one();
    }

    fn take_owed(&self) -> Option<(u64, Vec<u8>)> {
        self.owed.lock().take()
    }

    /// Every notice up to `seq` is out.
    fn out(&self, seq: u64) {
        self.out.send_if_modified(|out| {
            let moved = seq > *out;
            *out = (*out).max(seq);
            moved
        });
    }

    /// Waits until notice `seq` is out.
    pub(crate) async fn wait_out(&self, seq: u64) {
        let mut out = self.out.subscribe();
        let _ = out.wait_for(|&o| o >= seq).await;
    }
}

/// Counts every notice out when a sending task ends (the host stopped, or the task
/// panicked): no command waits for notices that will never go.
struct AllOut(std::sync::Arc<Sends>);

impl Drop for AllOut {
    fn drop(&mut self) {
        // A task that panicked sent none of what was left: its commands wait for the
        // other hosts to read the log. One that ended with its host (the queue closed)
        // leaves commands that are not answered any more.
        if std::thread::panicking() {
            self.0.gave_up(u64::MAX);
        }
        self.0.out(u64::MAX);
    }
}

/// How long a NATS publisher waits to hear a batch's last notice back before it publishes
/// the batch again.
#[cfg(feature = "nats")]
const ECHO_WAIT: Duration = Duration::from_secs(2);

/// The default of [`HostBuilder::notice_give_up`](crate::HostBuilder::notice_give_up):
/// how long a host tries to send a batch of notifications before it gives up on them (the
/// other hosts read the log at their next poll).
pub(crate) const SEND_GIVE_UP: Duration = Duration::from_secs(30);

/// The longest wait between two tries to send a batch.
const SEND_RETRY_MAX: Duration = Duration::from_secs(1);

/// The wait before the next try to send, after `failures` failed tries: 25 ms doubling,
/// to [`SEND_RETRY_MAX`].
fn retry_wait(failures: u32) -> Duration {
    (Duration::from_millis(25) * 2u32.saturating_pow(failures.saturating_sub(1).min(6)))
        .min(SEND_RETRY_MAX)
}

/// The queue of a host's notifying task (PostgreSQL): it holds at most
/// [`HostBuilder::notify_queue`](crate::HostBuilder::notify_queue) entries (issue 30,
/// hole 5: it was unbounded, and grew for as long as the `NOTIFY`s did not go out); what
/// comes while it is full is dropped and counted.
#[derive(Clone)]
pub(crate) struct Outbox {
    queue: tokio::sync::mpsc::Sender<Outgoing>,
    counts: std::sync::Arc<OutboxCounts>,
    sends: std::sync::Arc<Sends>,
}

impl Outbox {
    fn push(&self, item: Outgoing) {
        use tokio::sync::mpsc::error::TrySendError;
        match self.queue.try_send(item) {
            Ok(()) => {}
            Err(TrySendError::Full(item)) => self.counts.dropped(
                matches!(item, Outgoing::Ack { .. } | Outgoing::Control { .. }),
                1,
                "the notifying queue is full",
            ),
            // The host stopped.
            Err(TrySendError::Closed(_)) => {}
        }
    }

    /// Queues notice `seq`; when the queue is full, its wake-up (`wake_up`, the notice
    /// without its operation) is owed instead (see [`Sends`]).
    fn push_notice(&self, payload: String, seq: u64, wake_up: impl FnOnce() -> String) {
        use tokio::sync::mpsc::error::TrySendError;
        if let Err(TrySendError::Full(_)) = self.queue.try_send(Outgoing::Notice { payload, seq }) {
            self.counts.dropped(
                false,
                1,
                "the notifying queue is full: a wake-up goes instead",
            );
            self.sends.owe(seq, wake_up().into_bytes());
        }
    }

    /// Entries in the queue now.
    pub(crate) fn queued(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }
}

/// What a host's notifying task sends (PostgreSQL).
pub(crate) enum Outgoing {
    /// A notice, on the log's channel, and its sequence number ([`Sends`]).
    Notice { payload: String, seq: u64 },
    /// An acknowledgement of the operation `id`, on the channel `to` (its host's).
    Ack { to: String, id: i64 },
    /// A message of the rejoin handshake (a hello or a welcome, an [`Ack`] as JSON) on the
    /// channel `to`: sent after everything queued before it.
    Control { to: String, payload: String },
}

/// Where this host's acknowledgements go, cloned out of its publisher.
#[derive(Clone)]
pub(crate) enum AckSender {
    Postgres {
        queue: Outbox,
        channel: String,
    },
    #[cfg(feature = "nats")]
    Nats {
        queue: NatsOutbox,
        subject: String,
        from: String,
    },
}

impl AckSender {
    /// Tells `to` that this host applied its operation `id`.
    pub(crate) fn send(&self, to: &str, id: i64) {
        match self {
            AckSender::Postgres { queue, channel } => {
                queue.push(Outgoing::Ack {
                    to: ack_channel(channel, to),
                    id,
                });
            }
            #[cfg(feature = "nats")]
            AckSender::Nats {
                queue,
                subject,
                from,
            } => {
                let payload = serde_json::to_vec(&Ack {
                    from: from.clone(),
                    ids: vec![id],
                    ..Ack::default()
                })
                .unwrap_or_default();
                queue.push(true, ack_channel(subject, to), payload);
            }
        }
    }
}

/// Tells `peers` that this host stopped (on their acknowledgement channels), and returns
/// once the message is with PostgreSQL or NATS.
pub(crate) async fn farewell(inner: &Inner, peers: &[String]) -> Result<(), CommandError> {
    if peers.is_empty() {
        return Ok(());
    }
    let mut payload = serde_json::to_string(&Ack {
        from: inner.id.clone(),
        bye: true,
        ..Ack::default()
    })?;
    inner.seal.seal_string(&mut payload);
    enum Route {
        Postgres(String),
        #[cfg(feature = "nats")]
        Nats(async_nats::Client, String),
    }
    let route = match &*inner.publisher.lock() {
        Publisher::None => return Ok(()),
        Publisher::Postgres { channel, .. } => Route::Postgres(channel.clone()),
        #[cfg(feature = "nats")]
        Publisher::Nats(client, subject, _) => Route::Nats(client.clone(), subject.clone()),
    };
    match route {
        Route::Postgres(channel) => {
            let Some(pool) = inner.db.postgres_pool() else {
                return Ok(());
            };
            let channels: Vec<String> = peers.iter().map(|p| ack_channel(&channel, p)).collect();
            let pairs: Vec<(&str, &str)> = channels
                .iter()
                .map(|c| (c.as_str(), payload.as_str()))
                .collect();
            crate::db::pg_notify(pool, &pairs).await?;
        }
        #[cfg(feature = "nats")]
        Route::Nats(client, subject) => {
            let nats = |e: &dyn std::fmt::Display| {
                CommandError::new(ErrorKind::Unavailable, format!("NATS: {e}"))
            };
            for peer in peers {
                client
                    .publish(ack_channel(&subject, peer), payload.clone().into())
                    .await
                    .map_err(|e| nats(&e))?;
            }
            client.flush().await.map_err(|e| nats(&e))?;
        }
    }
    Ok(())
}

/// The channel (PostgreSQL) or subject (NATS) where `host` hears acknowledgements: the
/// log's, shortened, and a hash of the host's id (PostgreSQL's names are at most 63 bytes,
/// and NATS subjects are tokens between dots).
pub(crate) fn ack_channel(base: &str, host: &str) -> String {
    format!("{}.ack.{:016x}", prefix(base, 40), fnv1a(host.as_bytes()))
}

/// The channel of the change feed's hints ([`crate::changes::HintOut`]): every host with
/// watches of database changes listens on it. The log's channel, shortened, and a hash of
/// all of it: clusters of other schemas, or of databases with long names, whose channels
/// share a prefix, do not hear each other's hints.
pub(crate) fn hint_channel(base: &str) -> String {
    format!(
        "{}.changes.{:016x}",
        prefix(base, 38),
        fnv1a(base.as_bytes())
    )
}

/// The longest prefix of `base` of at most `max` bytes that ends on a character boundary.
fn prefix(base: &str, max: usize) -> &str {
    let mut end = 0;
    for (i, c) in base.char_indices() {
        if i + c.len_utf8() > max {
            break;
        }
        end = i + c.len_utf8();
    }
    &base[..end]
}

/// FNV-1a: the same in every process, unlike std's seeded hashers.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Publisher {
    pub(crate) fn channel(&self, db: &Database) -> Option<String> {
        match (self, &*db.inner) {
            (Publisher::Postgres { .. }, Engine::Postgres(pg)) => Some(pg.channel.clone()),
            #[cfg(feature = "nats")]
            (Publisher::Nats(_, subject, _), _) => Some(subject.clone()),
            _ => None,
        }
    }

    /// Whether acknowledgements can travel (not when the host polls).
    pub(crate) fn acks(&self) -> bool {
        !matches!(self, Publisher::None)
    }

    /// Where this host (`from`) sends acknowledgements; `None` when it polls.
    pub(crate) fn ack_sender(&self, from: &str) -> Option<AckSender> {
        let _ = from;
        match self {
            Publisher::None => None,
            Publisher::Postgres { queue, channel, .. } => Some(AckSender::Postgres {
                queue: queue.clone(),
                channel: channel.clone(),
            }),
            #[cfg(feature = "nats")]
            Publisher::Nats(_, subject, queue) => Some(AckSender::Nats {
                queue: queue.clone(),
                subject: subject.clone(),
                from: from.to_owned(),
            }),
        }
    }

    /// Queues a notice; answers its sequence number ([`Sends`]), 0 when none goes out
    /// (the host polls).
    pub(crate) fn publish(&self, mut notice: Notice) -> u64 {
        match self {
            Publisher::None => 0,
            Publisher::Postgres {
                queue, notice_max, ..
            } => {
                let seq = queue.sends.next();
                let mut payload = serde_json::to_string(&notice).unwrap_or_default();
                if payload.len() > *notice_max {
                    notice.op = None;
                    payload = serde_json::to_string(&notice).unwrap_or_default();
                }
                queue.push_notice(payload, seq, || {
                    notice.op = None;
                    serde_json::to_string(&notice).unwrap_or_default()
                });
                seq
            }
            #[cfg(feature = "nats")]
            Publisher::Nats(_, subject, queue) => {
                let seq = queue.sends.next();
                notice.seq = seq;
                let mut payload = serde_json::to_vec(&notice).unwrap_or_default();
                if payload.len() > queue.notice_max {
                    notice.op = None;
                    payload = serde_json::to_vec(&notice).unwrap_or_default();
                }
                queue.push_notice(subject.clone(), payload, seq, || {
                    notice.op = None;
                    serde_json::to_vec(&notice).unwrap_or_default()
                });
                seq
            }
        }
    }

    /// How far this host's notices have gone out; `None` when it polls.
    pub(crate) fn sends(&self) -> Option<&std::sync::Arc<Sends>> {
        match self {
            Publisher::None => None,
            Publisher::Postgres { queue, .. } => Some(&queue.sends),
            #[cfg(feature = "nats")]
            Publisher::Nats(_, _, queue) => Some(&queue.sends),
        }
    }

    /// Sends a message of the rejoin handshake to `to`'s acknowledgement channel, after
    /// every notice and acknowledgement this host queued before it.
    pub(crate) fn send_control(&self, to: &str, message: &Ack) {
        let Ok(payload) = serde_json::to_string(message) else {
            return;
        };
        match self {
            Publisher::None => {}
            Publisher::Postgres { queue, channel, .. } => queue.push(Outgoing::Control {
                to: ack_channel(channel, to),
                payload,
            }),
            #[cfg(feature = "nats")]
            Publisher::Nats(_, subject, queue) => {
                queue.push(true, ack_channel(subject, to), payload.into_bytes());
            }
        }
    }
}

pub(crate) async fn start(host: &Host, notifier: Notifier) -> Result<(), CommandError> {
    let inner = &host.inner;
    match notifier {
        Notifier::Poll => {}
        Notifier::Postgres => {
            let Engine::Postgres(pg) = &*inner.db.inner else {
                return Err(CommandError::new(
                    ErrorKind::WrongDatabase,
                    "the PostgreSQL notifier needs a PostgreSQL database",
                ));
            };
            let mut config = pg.config.clone();
            config.application_name(format!("coherent-listener:{}", host.id()));
            let channel = pg.channel.clone();
            let (queue, payloads) = tokio::sync::mpsc::channel(inner.notify_queue);
            let sends = std::sync::Arc::new(Sends::new(inner.notice_give_up));
            tokio::spawn(pg_notify_batches(
                pg.pool.clone(),
                channel.clone(),
                host.id().to_owned(),
                inner.notify_interval,
                payloads,
                inner.outbox.clone(),
                sends.clone(),
                inner.seal.clone(),
            ));
            *inner.publisher.lock() = Publisher::Postgres {
                queue: Outbox {
                    queue,
                    counts: inner.outbox.clone(),
                    sends,
                },
                channel: channel.clone(),
                notice_max: Packer::notices(host.id()).item_max(),
            };
            tokio::spawn(pg_listen(
                std::sync::Arc::downgrade(inner),
                inner.stop.subscribe(),
                (config, pg.tls.clone()),
                channel,
            ));
        }
        #[cfg(feature = "nats")]
        Notifier::Nats(url) => {
            let subject = format!("coherent.ops.{}", inner.db.log_name());
            let weak = std::sync::Arc::downgrade(inner);
            let events = weak.clone();
            // The client, once made: a (re)connection counts as up only after a flush.
            let made: std::sync::Arc<std::sync::OnceLock<async_nats::Client>> =
                std::sync::Arc::default();
            let made_for_events = made.clone();
            let client = async_nats::ConnectOptions::new()
                .retry_on_initial_connect()
                .max_reconnects(None)
                .event_callback(move |event| {
                    let events = events.clone();
                    let made = made_for_events.clone();
                    async move {
                        match event {
                            async_nats::Event::Connected => {
                                // Before the client exists, `start` sees to it.
                                if let Some(client) = made.get() {
                                    tokio::spawn(up_after_flush(events, client.clone()));
                                }
                            }
                            async_nats::Event::Disconnected => {
                                if let Some(inner) = events.upgrade() {
                                    inner.notifier_lost("the NATS connection dropped");
                                }
                            }
                            // The client dropped messages of a subscription that fell
                            // behind: notices may be among them.
                            async_nats::Event::SlowConsumer(_) => {
                                if let Some(inner) = events.upgrade() {
                                    inner.missed(
                                        "the NATS client dropped messages (a slow consumer)",
                                    );
                                }
                            }
                            _ => {}
                        }
                    }
                })
                .connect(url.as_str())
                .await
                .map_err(|e| CommandError::new(ErrorKind::Unavailable, format!("NATS: {e}")))?;
            let subscription = client
                .subscribe(subject.clone())
                .await
                .map_err(|e| CommandError::new(ErrorKind::Unavailable, format!("NATS: {e}")))?;
            let acks = client
                .subscribe(ack_channel(&subject, host.id()))
                .await
                .map_err(|e| CommandError::new(ErrorKind::Unavailable, format!("NATS: {e}")))?;
            // The subscriptions are queued, not yet known to the server: a message published
            // before it has them is not delivered. The notifier is up (and the host reads
            // the log for what it may have missed) once a flush has come back: the server
            // answered a ping sent after them. After a reconnection too: the client sends
            // the subscriptions again before the flush's ping. `start` waits for it, a while.
            let _ = made.set(client.clone());
            tokio::spawn(up_after_flush(weak.clone(), client.clone()));
            let (queue, outgoing) = tokio::sync::mpsc::channel(inner.notify_queue);
            let sends = std::sync::Arc::new(Sends::new(inner.notice_give_up));
            tokio::spawn(nats_publish(
                client.clone(),
                subject.clone(),
                outgoing,
                sends.clone(),
            ));
            let max_payload = match client.server_info().max_payload {
                0 => 1 << 20,
                n => n,
            };
            let outbox = NatsOutbox {
                queue,
                counts: inner.outbox.clone(),
                sends: sends.clone(),
                // The room left holds the seal's SEAL_LEN bytes too.
                notice_max: max_payload.saturating_sub(4096).max(1024),
                seal: inner.seal.clone(),
            };
            *inner.publisher.lock() = Publisher::Nats(client, subject, outbox);
            tokio::spawn(nats_listen(
                weak,
                inner.stop.subscribe(),
                subscription,
                acks,
                sends,
            ));
        }
    }
    Ok(())
}

/// Marks the NATS notifier up once a flush of `client` comes back (retrying while the
/// connection is down; ends with the host).
#[cfg(feature = "nats")]
async fn up_after_flush(host: Weak<Inner>, client: async_nats::Client) {
    loop {
        let flushed = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
        let Some(inner) = host.upgrade() else { return };
        if matches!(flushed, Ok(Ok(()))) {
            inner.notifier_up();
            return;
        }
        if *inner.stop.borrow() {
            return;
        }
        drop(inner);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(feature = "nats")]
async fn nats_listen(
    host: Weak<Inner>,
    mut stop: watch::Receiver<bool>,
    mut subscription: async_nats::Subscriber,
    mut acks: async_nats::Subscriber,
    sends: std::sync::Arc<Sends>,
) {
    // A notice: another host's is applied; this host's own, come back, is out ([`Sends`]).
    let take = |inner: &Inner, payload: &[u8]| match inner
        .admit_notice(payload)
        .then(|| serde_json::from_slice::<Notice>(payload))
    {
        None => {}
        Some(Ok(notice)) => {
            if notice.host == inner.id {
                if notice.seq != 0 {
                    sends.out(notice.seq);
                }
            } else {
                inner.apply_notice(notice);
            }
        }
        Some(Err(e)) => inner.bad_notice(&e),
    };
    loop {
        let message = tokio::select! {
            m = subscription.next() => m,
            a = acks.next() => {
                let Some(a) = a else { return };
                let Some(inner) = host.upgrade() else { return };
                if !inner.admit(&a.payload, "an acknowledgement") {
                    continue;
                }
                match serde_json::from_slice::<Ack>(&a.payload) {
                    Ok(ack) => {
                        // The client hands each subscription its messages in the order
                        // they came, but two subscriptions race here: the notices that
                        // came before a welcome, or before a ping of this host's lease,
                        // are applied first (the lease and the rejoin rely on it). Without
                        // the runtime's budget: a ready notice must not read as pending.
                        // (A slow consumer loses messages: it is fenced for it.)
                        if ack.welcome || ack.ping != 0 {
                            while let Some(Some(m)) =
                                tokio::task::unconstrained(subscription.next()).now_or_never()
                            {
                                take(&inner, &m.payload);
                            }
                        }
                        inner.ack_received(ack)
                    }
                    Err(e) => tracing::debug!(%e, "an undecodable acknowledgement"),
                }
                continue;
            }
            _ = stop.wait_for(|&s| s) => return,
        };
        let Some(message) = message else { return };
        let Some(inner) = host.upgrade() else { return };
        take(&inner, &message.payload);
    }
}

/// Sends the host's notifications, in batches: one `SELECT pg_notify(..), pg_notify(..)`
/// for whatever queued while the previous one ran, at most one per `interval`
/// ([`HostBuilder::notify_interval`](crate::HostBuilder::notify_interval)). A notifying transaction takes
/// PostgreSQL's notification lock through its commit (and its flush: the queue records
/// its transaction id), so notifying transactions commit one at a time; one per command
/// would cap commands at one flush each, one per batch costs a flush per batch. A
/// command's acknowledgement deadline starts once its notice is out ([`Sends`]); a
/// `NOTIFY` that fails is sent again. Ends when the host is dropped.
#[allow(clippy::too_many_arguments)]
async fn pg_notify_batches(
    pool: deadpool_postgres::Pool,
    channel: String,
    from: String,
    interval: Duration,
    mut outgoing: tokio::sync::mpsc::Receiver<Outgoing>,
    counts: std::sync::Arc<OutboxCounts>,
    sends: std::sync::Arc<Sends>,
    seal: Seal,
) {
    const BATCH: usize = 256;
    let _all_out = AllOut(sends.clone());
    let mut batch = Vec::with_capacity(BATCH);
    let mut last: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            n = outgoing.recv_many(&mut batch, BATCH) => if n == 0 { return },
            () = sends.kick.notified() => {}
        }
        // At most one NOTIFY per interval: what queues meanwhile goes in the next one
        // (unless a full batch waits already).
        if let Some(next) = last.map(|l| l + interval) {
            if batch.len() < BATCH && next > std::time::Instant::now() {
                tokio::time::sleep_until(next.into()).await;
                while batch.len() < BATCH {
                    match outgoing.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
            }
        }
        last = Some(std::time::Instant::now());
        let mut payloads: Vec<(String, String)> = Vec::with_capacity(batch.len());
        // Acknowledgements to one host in this batch go in as few payloads as fit.
        let mut acks: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
        // Notices go several to a payload (`Packed`): PostgreSQL queues, and every
        // listening connection reads and sends, one notification instead of each.
        let mut notices = Packer::notices(&from);
        // Handshake messages: after the notices and acknowledgements queued before them.
        let mut controls: Vec<(String, String)> = Vec::new();
        // Items longer than a payload even alone (a host id of thousands of bytes).
        let (mut unsent_notices, mut unsent_acks) = (0, 0);
        // The last notice of the batch: out once the batch is.
        let mut out = 0;
        for item in batch.drain(..) {
            match item {
                Outgoing::Notice { payload, seq } => {
                    out = out.max(seq);
                    if !notices.push(&payload) {
                        unsent_notices += 1;
                    }
                }
                Outgoing::Ack { to, id } => acks.entry(to).or_default().push(id),
                Outgoing::Control { to, payload } => controls.push((to, payload)),
            }
        }
        // Checked after the queue was read: a notice queued after one that did not fit
        // found the wake-up owed already, and is not out before it.
        if let Some((seq, wake_up)) = sends.take_owed() {
            out = out.max(seq);
            if !notices.push(&String::from_utf8_lossy(&wake_up)) {
                unsent_notices += 1;
            }
        }
        payloads.extend(notices.finish().into_iter().map(|p| (channel.clone(), p)));
        for (to, ids) in acks {
            let mut packer = Packer::acks(&from);
            for id in ids {
                if !packer.push(&id.to_string()) {
                    unsent_acks += 1;
                }
            }
            payloads.extend(packer.finish().into_iter().map(|p| (to.clone(), p)));
        }
        // A handshake message (a hello, a welcome, a ping) holds the host's id: one longer
        // than a payload with its seal would have PostgreSQL refuse the whole `NOTIFY`.
        for (to, payload) in controls {
            if payload.len() <= PAYLOAD_ROOM {
                payloads.push((to, payload));
            } else {
                unsent_acks += 1;
            }
        }
        // Each sealed as it goes out (the packers and the check above left room for it).
        for (_, payload) in &mut payloads {
            seal.seal_string(payload);
        }
        if unsent_notices > 0 {
            // Which of the batch's commands lost its notice is not kept: each of them
            // waits for the other hosts to read the log instead.
            sends.gave_up(out);
        }
        for (ack, n) in [(false, unsent_notices), (true, unsent_acks)] {
            if n > 0 {
                counts.dropped(
                    ack,
                    n,
                    "longer than a NOTIFY payload (the host's id is too long)",
                );
            }
        }
        if !payloads.is_empty() {
            let pairs: Vec<(&str, &str)> = payloads
                .iter()
                .map(|(c, p)| (c.as_str(), p.as_str()))
                .collect();
            // A failed NOTIFY (a terminated connection, a failover) is sent again, on
            // another connection: the commands of its notices wait for it (a host may
            // receive a notice twice, and takes it once).
            let started = std::time::Instant::now();
            let mut failures = 0u32;
            loop {
                match crate::db::pg_notify(&pool, &pairs).await {
                    Ok(()) => break,
                    Err(e) if started.elapsed() < sends.give_up && !outgoing.is_closed() => {
                        failures = failures.saturating_add(1);
                        tracing::debug!(%e, n = payloads.len(), "NOTIFY failed: sending it again");
                        tokio::time::sleep(retry_wait(failures)).await;
                    }
                    Err(e) => {
                        tracing::warn!(%e, n = payloads.len(),
                            "NOTIFY failed for too long: the other hosts read the log at their next poll");
                        sends.gave_up(out);
                        break;
                    }
                }
            }
        }
        sends.out(out);
    }
}

/// Several notices of one host in one payload, as [`pg_notify_batches`] sends them:
/// `{"from":"<host>","notices":[...]}`, always in that order, so that a host can tell
/// its own from the first bytes and skip them.
#[derive(serde::Deserialize)]
struct Packed {
    notices: Vec<Notice>,
}

/// How a [`Packed`] payload from `host` begins.
fn packed_head(host: &str) -> String {
    let host = serde_json::to_string(host).unwrap_or_default();
    format!("{{\"from\":{host},\"notices\":[")
}

/// What a payload may hold before its seal: [`PG_PAYLOAD_LIMIT`] less [`SEAL_LEN`].
const PAYLOAD_ROOM: usize = PG_PAYLOAD_LIMIT - SEAL_LEN;

/// Packs JSON items into as few payloads as hold them, each `head`, the items separated by
/// commas, then `tail`, and each at most [`PAYLOAD_ROOM`] bytes (its seal then brings it
/// to [`PG_PAYLOAD_LIMIT`] at most), every byte counted:
/// the head (the host's id, escaped, is most of it), the commas, the tail (issue 30,
/// hole 5: a long host id took a payload past the limit, and PostgreSQL refused the whole
/// `NOTIFY`). An item that does not fit even alone is left out (see
/// [`item_max`](Self::item_max)).
struct Packer {
    head: String,
    tail: &'static str,
    current: String,
    done: Vec<String>,
}

impl Packer {
    /// Notices of `host`: a [`Packed`] payload.
    fn notices(host: &str) -> Self {
        Self::new(packed_head(host), "]}")
    }

    /// Acknowledgements from `host`, as an [`Ack`] without `bye` serializes:
    /// `{"from":"<host>","ids":[...]}` (the items are the ids).
    fn acks(host: &str) -> Self {
        let host = serde_json::to_string(host).unwrap_or_default();
        Self::new(format!("{{\"from\":{host},\"ids\":["), "]}")
    }

    fn new(head: String, tail: &'static str) -> Self {
        Self {
            head,
            tail,
            current: String::new(),
            done: Vec::new(),
        }
    }

    /// The longest item that fits in a payload (alone).
    fn item_max(&self) -> usize {
        PAYLOAD_ROOM.saturating_sub(self.head.len() + self.tail.len())
    }

    /// Adds `item`; `false` when it is longer than [`item_max`](Self::item_max) (it is
    /// left out).
    fn push(&mut self, item: &str) -> bool {
        if item.len() > self.item_max() {
            return false;
        }
        if !self.current.is_empty()
            && self.current.len() + 1 + item.len() + self.tail.len() > PAYLOAD_ROOM
        {
            self.close();
        }
        if self.current.is_empty() {
            self.current.push_str(&self.head);
        } else {
            self.current.push(',');
        }
        self.current.push_str(item);
        true
    }

    fn close(&mut self) {
        if !self.current.is_empty() {
            self.current.push_str(self.tail);
            self.done.push(std::mem::take(&mut self.current));
        }
    }

    /// The payloads.
    fn finish(mut self) -> Vec<String> {
        self.close();
        self.done
    }
}

/// Applies a notification's payload: one notice (a JSON object), or several ([`Packed`]).
/// `own` is how this host's own packed payloads begin: those are skipped unread.
fn apply_payload(inner: &Inner, own: &str, payload: &str) {
    if payload.starts_with(own) || !inner.admit_notice(payload.as_bytes()) {
        return;
    }
    if payload.starts_with("{\"from\":") {
        match serde_json::from_str::<Packed>(payload) {
            Ok(packed) => packed
                .notices
                .into_iter()
                .for_each(|n| inner.apply_notice(n)),
            Err(e) => inner.bad_notice(&e),
        }
    } else {
        match serde_json::from_str::<Notice>(payload) {
            Ok(notice) => inner.apply_notice(notice),
            Err(e) => inner.bad_notice(&e),
        }
    }
}

async fn pg_listen(
    host: Weak<Inner>,
    mut stop: watch::Receiver<bool>,
    connect: (tokio_postgres::Config, crate::db::tls::Tls),
    channel: String,
) {
    let mut failures: u32 = 0;
    loop {
        if *stop.borrow() {
            return;
        }
        match pg_listen_once(&host, &mut stop, &connect, &channel).await {
            Ok(()) => failures = 0,
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(%e, "the PostgreSQL listener failed");
            }
        }
        if *stop.borrow() {
            return;
        }
        let Some(inner) = host.upgrade() else { return };
        inner.notifier_lost("the PostgreSQL listener connection dropped");
        drop(inner);
        let wait = Duration::from_millis(50 * u64::from(failures.min(20)));
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|&s| s) => return,
        }
    }
}

async fn pg_listen_once(
    host: &Weak<Inner>,
    stop: &mut watch::Receiver<bool>,
    (config, tls): &(tokio_postgres::Config, crate::db::tls::Tls),
    channel: &str,
) -> Result<(), CommandError> {
    let ack_channel = {
        let Some(inner) = host.upgrade() else {
            return Ok(());
        };
        ack_channel(channel, &inner.id)
    };
    let acks_here = ack_channel.clone();
    let (own, hints) = match host.upgrade() {
        Some(inner) => (
            packed_head(&inner.id),
            inner.changes.is_some().then(|| hint_channel(channel)),
        ),
        None => return Ok(()),
    };
    let hints_here = hints.clone();
    let (client, mut connection) = config.connect(tls.clone()).await?;
    // Dropped when the connection ends: `rx` then wakes the loop below.
    let (ended, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let listener = host.clone();
    // Notifications are applied right here, in the task that reads the connection: no
    // hop through another task on the way from the socket to the invalidation.
    let driver = tokio::spawn(async move {
        let _ended = ended;
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(tokio_postgres::AsyncMessage::Notification(n)) => {
                    let Some(inner) = listener.upgrade() else {
                        return;
                    };
                    if n.channel() == acks_here {
                        if !inner.admit(n.payload().as_bytes(), "an acknowledgement") {
                            continue;
                        }
                        match serde_json::from_str::<Ack>(n.payload()) {
                            Ok(ack) => inner.ack_received(ack),
                            Err(e) => tracing::debug!(%e, "an undecodable acknowledgement"),
                        }
                        continue;
                    }
                    if hints_here.as_deref() == Some(n.channel()) {
                        if !inner.admit(n.payload().as_bytes(), "a hint of changes") {
                            continue;
                        }
                        match (serde_json::from_str(n.payload()), &inner.changes) {
                            (Ok(hint), Some(apply)) => apply.apply_hint(&hint),
                            (Ok(_), None) => {}
                            // The operation, logged after, carries the same changes.
                            (Err(e), _) => tracing::debug!(%e, "an undecodable hint of changes"),
                        }
                        continue;
                    }
                    apply_payload(&inner, &own, n.payload());
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(%e, "listener connection ended");
                    return;
                }
            }
        }
    });
    let quoted = channel.replace('"', "\"\"");
    let acks_quoted = ack_channel.replace('"', "\"\"");
    let mut listen = format!("LISTEN \"{quoted}\"; LISTEN \"{acks_quoted}\"");
    if let Some(hints) = &hints {
        listen.push_str(&format!("; LISTEN \"{}\"", hints.replace('"', "\"\"")));
    }
    client.batch_execute(&listen).await?;
    {
        let Some(inner) = host.upgrade() else {
            return Ok(());
        };
        inner.notifier_up();
    }
    tokio::select! {
        _ = rx.recv() => {}
        _ = stop.wait_for(|&s| s) => {}
    }
    drop(client);
    driver.abort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{ack_channel, hint_channel, Packed, Packer, PAYLOAD_ROOM, PG_PAYLOAD_LIMIT};
    use crate::seal::{Opened, Seal};

    /// Channel names fit PostgreSQL's 63 bytes, cut on a character boundary, and two bases
    /// that share their first bytes get two hint channels.
    #[test]
    fn derived_channels_fit_and_stay_apart() {
        for base in [
            "coherent_ops.test.public".to_owned(),
            "é".repeat(31),
            "a".repeat(63),
        ] {
            for name in [hint_channel(&base), ack_channel(&base, "host-1")] {
                assert!(name.len() <= 63, "{name}: {} bytes", name.len());
            }
        }
        let long = "coherent_ops.a_database_with_a_long_name.";
        assert_ne!(
            hint_channel(&format!("{long}orders")),
            hint_channel(&format!("{long}billing"))
        );
    }
    use crate::host::{Ack, Notice, NoticeOp};

    /// Every payload is within PostgreSQL's limit, however long the host's id (escapes
    /// included) and the items, and holds exactly the items given, in order.
    #[test]
    fn packed_payloads_stay_within_the_limit_and_hold_every_item() {
        for host in [
            "h".to_owned(),
            "é\"\\\u{1}".repeat(50),
            "a".repeat(200),
            "b".repeat(3_000),
        ] {
            let mut packer = Packer::notices(&host);
            let mut sent = Vec::new();
            for (i, len) in (0..400).map(|i| (i, (i * 997) % 8_100)).chain([(400, 0)]) {
                let notice = Notice {
                    id: i,
                    position: 1,
                    host: host.clone(),
                    committed_at: 0,
                    op: Some(NoticeOp {
                        kind: "k".to_owned(),
                        command: "x".repeat(len as usize),
                        output: String::new(),
                    }),
                    seq: 0,
                };
                let json = serde_json::to_string(&notice).unwrap();
                let fits = json.len() <= packer.item_max();
                assert_eq!(packer.push(&json), fits);
                if fits {
                    sent.push(i);
                }
            }
            let seal = Seal::new(b"key");
            let mut got = Vec::new();
            for payload in packer.finish() {
                assert!(payload.len() <= PAYLOAD_ROOM, "{}", payload.len());
                let mut payload = payload;
                seal.seal_string(&mut payload);
                assert!(payload.len() <= PG_PAYLOAD_LIMIT, "{}", payload.len());
                assert_eq!(seal.open(payload.as_bytes()), Opened::Sealed);
                let packed: Packed = serde_json::from_str(&payload).unwrap();
                got.extend(packed.notices.iter().map(|n| n.id));
            }
            assert_eq!(got, sent);

            let mut packer = Packer::acks(&host);
            let ids: Vec<i64> = (0..2_000).map(|i| i64::MIN + i).collect();
            for id in &ids {
                assert!(packer.push(&id.to_string()));
            }
            let mut got = Vec::new();
            for payload in packer.finish() {
                let mut payload = payload;
                seal.seal_string(&mut payload);
                assert!(payload.len() <= PG_PAYLOAD_LIMIT, "{}", payload.len());
                let ack: Ack = serde_json::from_str(&payload).unwrap();
                assert_eq!(ack.from, host);
                assert!(!ack.bye);
                got.extend(ack.ids);
            }
            assert_eq!(got, ids);
        }
    }
}
