//! The thread a PostgreSQL [`Database`](super::Database) does its I/O on: the driver of
//! every connection of its pool, and the hosts' own work (the listener, the notifier, the
//! reads of the log, leases, heartbeats, the log of database changes).
//!
//! Why a thread of its own: an application's runtime is often busy (readers hitting the
//! cache, requests being served), and a task woken there waits behind every task queued
//! before it. A change's way to another host is a dozen such wake-ups (the operation's
//! commit, its `NOTIFY`, the other host's listener, its read of the log, each response
//! parsed by a connection's driver task), each a scheduler round on a loaded runtime: on
//! two cores with the `dbchanges` readers, 4-5 ms at the median and 13-15 ms at p99
//! before this thread, for 0.3 ms on the host that applied the change itself. On a
//! runtime of its own, that work waits only for the operating system's scheduler.
//!
//! The runtime lives as long as the `Database` (the pool's connections are driven by it,
//! so it must not end before them): its thread ends when the last clone of the
//! `Database` is dropped, and with it the connections' drivers.

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// A current-thread runtime on a thread of its own, ended when this is dropped.
pub(crate) struct Background {
    handle: Handle,
    /// Dropped with `self`: the thread's `block_on` returns and it drops the runtime.
    _stop: oneshot::Sender<()>,
}

impl Background {
    /// Starts the thread, named `name`. May be called in an async context (the runtime is
    /// built here and moved to its thread, which alone blocks on it and drops it).
    pub(crate) fn start(name: &str) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                // Ends when the sender is dropped (the `Database` went away); the tasks
                // still there (connections' drivers, a stopped host's loops) are dropped
                // with the runtime, on this thread.
                let _ = runtime.block_on(stopped);
            })?;
        Ok(Self {
            handle,
            _stop: stop,
        })
    }

    /// The runtime's handle.
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }
}

/// The pool's way to connect: on the background thread, so that the socket is registered
/// with that thread's reactor and the connection's driver task runs there, whatever
/// runtime asked the pool for a connection.
pub(crate) struct ConnectOnBackground {
    pub(crate) handle: Handle,
}

impl deadpool_postgres::Connect for ConnectOnBackground {
    fn connect(
        &self,
        config: &tokio_postgres::Config,
    ) -> futures::future::BoxFuture<
        '_,
        Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        let config = config.clone();
        let handle = self.handle.clone();
        Box::pin(async move {
            let connect = {
                let config = config.clone();
                async move {
                    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                    let driver = tokio::spawn(async move {
                        if let Err(e) = connection.await {
                            tracing::debug!(%e, "a pool connection ended");
                        }
                    });
                    Ok((client, driver))
                }
            };
            match handle.spawn(connect).await {
                Ok(made) => made,
                // The thread's runtime is gone (the `Database` is being dropped while a
                // caller still asks for a connection): connect here, as a plain pool would.
                Err(_) => {
                    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                    let driver = tokio::spawn(async move {
                        let _ = connection.await;
                    });
                    Ok((client, driver))
                }
            }
        })
    }
}
