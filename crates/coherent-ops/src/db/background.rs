//! The threads a PostgreSQL [`Database`](super::Database) does its work on: one drives every
//! connection of its pool (`coherent-pg-io`), the other runs its hosts' own work
//! (`coherent-ops`: the listener and the notifications it applies, the notifier, reads of
//! the log, leases, heartbeats, the log of database changes).
//!
//! Why threads of their own: an application's runtime is often busy (readers hitting the
//! cache, requests being served), and a task woken there waits behind every task queued
//! before it. A change's way to another host is a dozen such wake-ups (the operation's
//! commit, its `NOTIFY`, the other host's listener, its read of the log, each response
//! parsed by a connection's driver task), each a scheduler round on a loaded runtime: on
//! two cores with the `dbchanges` readers, 4-5 ms at the median and 13-15 ms at p99
//! before these threads, for 0.3 ms on the host that applied the change itself. On
//! runtimes of their own, that work waits only for the operating system's scheduler. Two
//! threads, not one: the hosts' work runs the application's invalidations (a flush of a
//! large cache, a long backlog of the log), which must not hold up every query of the
//! process meanwhile.
//!
//! The runtimes live as long as the `Database` (the pool's connections are driven by one of
//! them, so it must not end before them): the threads end when the last clone of the
//! `Database` is dropped, and with them the connections' drivers (a connection taken from
//! the pool and kept after that fails with "connection closed").

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// A current-thread runtime on a thread of its own, ended when this is dropped.
pub(crate) struct Thread {
    handle: Handle,
    /// Dropped with `self`: the thread's `block_on` returns and it drops the runtime.
    _stop: oneshot::Sender<()>,
}

impl Thread {
    /// Starts the thread, named `name`, and its runtime, built there. May be called in an
    /// async context: the runtime is made, run and dropped on its own thread only.
    fn start(name: &str) -> std::io::Result<Self> {
        let (stop, stopped) = oneshot::channel::<()>();
        let (made, handle) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = made.send(Err(e));
                        return;
                    }
                };
                let _ = made.send(Ok(runtime.handle().clone()));
                // Ends when the sender is dropped (the `Database` went away); the tasks
                // still there (connections' drivers, a stopped host's loops) are dropped
                // with the runtime, on this thread.
                let _ = runtime.block_on(stopped);
            })?;
        // The thread answers at once (building a current-thread runtime does no I/O).
        let handle = handle
            .recv()
            .map_err(|_| std::io::Error::other("the thread ended before its runtime was made"))??;
        Ok(Self {
            handle,
            _stop: stop,
        })
    }
}

/// A `Database`'s two threads.
pub(crate) struct Background {
    io: Thread,
    work: Thread,
}

impl Background {
    pub(crate) fn start() -> std::io::Result<Self> {
        Ok(Self {
            io: Thread::start("coherent-pg-io")?,
            work: Thread::start("coherent-ops")?,
        })
    }

    /// The runtime that drives the pool's connections.
    pub(crate) fn io(&self) -> &Handle {
        &self.io.handle
    }

    /// The runtime of the hosts' own work.
    pub(crate) fn work(&self) -> &Handle {
        &self.work.handle
    }
}

/// The pool's way to connect: on the I/O thread, so that the socket is registered with that
/// thread's reactor and the connection's driver task runs there, whatever runtime asked the
/// pool for a connection.
pub(crate) struct ConnectOnBackground {
    pub(crate) handle: Handle,
    pub(crate) tls: super::tls::Tls,
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
        let (handle, tls) = (self.handle.clone(), self.tls.clone());
        Box::pin(async move {
            match handle.spawn(connect(config.clone(), tls.clone())).await {
                Ok(made) => made,
                // The thread's runtime is gone (the `Database` is being dropped while a
                // caller still asks for a connection): connect here, as a plain pool would.
                Err(_) => connect(config, tls).await,
            }
        })
    }
}

/// Connects, and drives the connection on a task of the current runtime.
async fn connect(
    config: tokio_postgres::Config,
    tls: super::tls::Tls,
) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error> {
    let (client, connection) = config.connect(tls).await?;
    let driver = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(%e, "a pool connection ended");
        }
    });
    Ok((client, driver))
}
