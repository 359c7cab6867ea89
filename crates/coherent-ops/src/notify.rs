//! Notifiers: how a host hears of the operations other hosts commit. A notification only
//! wakes a host up (and, when it carries the operation, saves it a read); the log is the
//! truth, read after every reconnect of the notifier and every poll interval.

use std::sync::Weak;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use crate::db::{Database, Engine, PG_PAYLOAD_MAX};
use crate::error::{CommandError, ErrorKind};
use crate::host::{Host, Inner, Notice};

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
    /// The queue of the task that sends `NOTIFY`s (see `pg_notify_batches`).
    Postgres(tokio::sync::mpsc::UnboundedSender<String>),
    #[cfg(feature = "nats")]
    Nats(async_nats::Client, String),
}

impl Publisher {
    pub(crate) fn channel(&self, db: &Database) -> Option<String> {
        match (self, &*db.inner) {
            (Publisher::Postgres(_), Engine::Postgres(pg)) => Some(pg.channel.clone()),
            #[cfg(feature = "nats")]
            (Publisher::Nats(_, subject), _) => Some(subject.clone()),
            _ => None,
        }
    }

    /// Announces `notice` (in the background: the command's caller does not wait).
    pub(crate) fn publish(&self, mut notice: Notice) {
        match self {
            Publisher::None => {}
            Publisher::Postgres(queue) => {
                let mut payload = serde_json::to_string(&notice).unwrap_or_default();
                if payload.len() > PG_PAYLOAD_MAX {
                    notice.op = None;
                    payload = serde_json::to_string(&notice).unwrap_or_default();
                }
                let _ = queue.send(payload);
            }
            #[cfg(feature = "nats")]
            Publisher::Nats(client, subject) => {
                let payload = serde_json::to_vec(&notice).unwrap_or_default();
                let (client, subject) = (client.clone(), subject.clone());
                tokio::spawn(async move {
                    if let Err(e) = client.publish(subject, payload.into()).await {
                        tracing::warn!(%e, "NATS publish failed");
                    }
                });
            }
        }
    }
}

/// Starts `notifier` for `host`: its listening task and its publisher.
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
            let (queue, payloads) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(pg_notify_batches(
                pg.pool.clone(),
                channel.clone(),
                payloads,
            ));
            *inner.publisher.lock() = Publisher::Postgres(queue);
            tokio::spawn(pg_listen(
                std::sync::Arc::downgrade(inner),
                inner.stop.subscribe(),
                config,
                channel,
            ));
        }
        #[cfg(feature = "nats")]
        Notifier::Nats(url) => {
            let subject = format!("coherent.ops.{}", inner.db.log_name());
            let weak = std::sync::Arc::downgrade(inner);
            let events = weak.clone();
            let client = async_nats::ConnectOptions::new()
                .retry_on_initial_connect()
                .max_reconnects(None)
                .event_callback(move |event| {
                    let events = events.clone();
                    async move {
                        let Some(inner) = events.upgrade() else {
                            return;
                        };
                        match event {
                            async_nats::Event::Connected => inner.notifier_up(),
                            async_nats::Event::Disconnected => {
                                inner.notifier_lost("the NATS connection dropped");
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
            *inner.publisher.lock() = Publisher::Nats(client, subject);
            tokio::spawn(nats_listen(weak, inner.stop.subscribe(), subscription));
        }
    }
    Ok(())
}

#[cfg(feature = "nats")]
async fn nats_listen(
    host: Weak<Inner>,
    mut stop: watch::Receiver<bool>,
    mut subscription: async_nats::Subscriber,
) {
    loop {
        let message = tokio::select! {
            m = subscription.next() => m,
            _ = stop.wait_for(|&s| s) => return,
        };
        let Some(message) = message else { return };
        let Some(inner) = host.upgrade() else { return };
        match serde_json::from_slice::<Notice>(&message.payload) {
            Ok(notice) => inner.apply_notice(notice),
            Err(e) => inner.bad_notice(&e),
        }
    }
}

/// Sends the host's notifications, in batches: one `SELECT pg_notify(..), pg_notify(..)`
/// for whatever queued while the previous one ran. A notifying transaction takes
/// PostgreSQL's notification lock through its commit (and its flush: the queue records
/// its transaction id), so notifying transactions commit one at a time; one per command
/// would cap commands at one flush each, one per batch costs a flush per batch. The
/// commands do not wait for it (the log is the truth: a lost `NOTIFY` costs a poll).
/// Ends when the host is dropped.
async fn pg_notify_batches(
    pool: deadpool_postgres::Pool,
    channel: String,
    mut payloads: tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    const BATCH: usize = 64;
    let mut batch = Vec::with_capacity(BATCH);
    while payloads.recv_many(&mut batch, BATCH).await > 0 {
        let result = async {
            let sql = crate::db::notify_sql(&channel, &batch)?;
            pool.get().await?.batch_execute(&sql).await?;
            Ok::<_, CommandError>(())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(%e, n = batch.len(), "NOTIFY failed: the other hosts read the log at their next poll");
        }
        batch.clear();
    }
}

/// Listens on a connection of its own; reconnects (with backoff) when it drops, and reads
/// the log after every `LISTEN`.
async fn pg_listen(
    host: Weak<Inner>,
    mut stop: watch::Receiver<bool>,
    config: tokio_postgres::Config,
    channel: String,
) {
    let mut failures: u32 = 0;
    loop {
        if *stop.borrow() {
            return;
        }
        match pg_listen_once(&host, &mut stop, &config, &channel).await {
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
    config: &tokio_postgres::Config,
    channel: &str,
) -> Result<(), CommandError> {
    let (client, mut connection) = config.connect(tokio_postgres::NoTls).await?;
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
                    match serde_json::from_str::<Notice>(n.payload()) {
                        Ok(notice) => inner.apply_notice(notice),
                        Err(e) => inner.bad_notice(&e),
                    }
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
    client
        .batch_execute(&format!("LISTEN \"{quoted}\""))
        .await?;
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
