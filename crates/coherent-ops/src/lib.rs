//! Coherent across hosts: commands, an operation log, and invalidation replayed on every
//! host of a cluster that shares one database.
//!
//! A **command** ([`Command`]) is a write as a serde value; its [`Handler`] does the writes
//! in a transaction the pipeline opens ([`Tx`]) and names, in one place, the compute
//! results the command changes ([`Handler::invalidate`]). [`Host::run`] runs a command:
//!
//! 1. the handler's writes and an *operation* (the command, its output, this host's id,
//!    the time) commit in one transaction: an operation exists exactly when its writes do.
//!    Commands that arrive while the host's transactions are busy share the next one (one
//!    `BEGIN`, one `INSERT` of their operations, one `COMMIT`): under load that is most of a
//!    command's cost in the database ([`HostBuilder::max_batch`]);
//! 2. the handler's invalidation runs on this host, before `run` returns (cascading to its
//!    dependants and to the replicas its clients hold);
//! 3. the [`Notifier`] tells the other hosts, which run the same invalidation and
//!    acknowledge it; `run` returns once every live host has (at most
//!    [`HostBuilder::acknowledgements`]), so a read that starts on any host after it
//!    returned sees the write.
//!
//! A handler's write whose answer it does not need can be deferred ([`Tx::defer`]): sent
//! with the transaction, answered at the commit, so that a command is one round trip to
//! PostgreSQL; a command whose only write is deferred with its text ([`Tx::defer_sql`]) is
//! one statement, with its operation's row.
//!
//! The log is the truth; notifications only wake hosts up. A host reads the log after its
//! notifier reconnects and every poll interval, so a lost notification costs latency, never
//! correctness; and when it may have missed operations (its notifier dropped), it
//! invalidates its whole cache before it reads the log, so that until it has caught up it
//! answers from the database, not from entries that may be stale. Nothing is applied twice
//! (each host keeps the ids it applied beyond its horizon), nothing is skipped (see the
//! ordering argument in `db.rs` and ARCHITECTURE.md). Old operations are trimmed once every
//! live host has passed them.
//!
//! # A host alone
//!
//! A host that keeps its peers (acknowledgements on, a notifier that carries them) and
//! knows no other live host sends no notice for its commands: nobody would read it, and
//! on PostgreSQL each is a `NOTIFY` that wakes the listening connections
//! ([`HostStats::notices_skipped`]). A host that joins is fenced until every live host has
//! welcomed it; a host answers a hello, and decides to skip a notice, under the same lock,
//! so every operation whose notice it skipped committed before its welcome went out, and
//! the joiner, reading the log once welcomed, has it. From the welcome on, the joiner is a
//! peer: notified and waited for.
//!
//! # Who can talk to a host
//!
//! The notifier is not the cluster's own: on PostgreSQL any role that can connect may
//! `NOTIFY` on any channel, and listen on it; on NATS any client the server admits may
//! publish on the hosts' subjects. A stranger's acknowledgement in a host's name would end
//! a command's wait before that host invalidated (a read there after the answer would be
//! stale); its farewell would make the others forget a live host, its welcome end a
//! rejoin early, its ping stretch a host's lease. So every message the hosts send each
//! other (notices, acknowledgements, hellos, welcomes, farewells, pings) is **sealed**: a
//! MAC (HMAC-SHA-256, 128 bits) under a key that the first host made and keeps in the
//! cluster's `coherent_secrets` table, made without `PUBLIC` access: whoever can read it
//! (its owner, a superuser, a role granted `SELECT` on it or `pg_read_all_data`) can seal.
//! A message whose seal does not check out, or that has none, is dropped unread and
//! counted ([`HostStats::messages_refused`]); a refused notice still wakes the log reader
//! (the operation it may stand for is read from the log), and a refused acknowledgement
//! is waited out as a silent host's. A sealed message may be heard and sent again: a
//! ping heard again is ignored, a welcome counts only in the rejoin whose hello it
//! answers (a random round), a notice or acknowledgement is taken once; a departed host's
//! message sent again makes the others wait for it once more (one acknowledgement
//! deadline: a delay, not a stale read). The change feed's hints (the changes it read,
//! sent ahead of their operation) are sealed too: a stranger's would invalidate at will,
//! or, naming an owed flush paid, lift the hosts' holds while a new slot waits; a hint
//! never carries a hold or a payment, sealed or not. A host of a release before seals
//! sends none (one before sealed hints, no sealed hints: its hints are refused, and its
//! operations read from the log): during a rolling upgrade from one,
//! [`HostBuilder::accept_unsealed`] lets its messages (and a stranger's) in.
//!
//! Remote clients send commands over Coherent RPC ([`CommandServer`], [`CommandClient`]);
//! the answer returns after the invalidation ran on the host that ran the command, and
//! the other live hosts acknowledged it.
//!
//! Databases: SQLite (a file shared by the processes of one machine, the embedded default)
//! and PostgreSQL. Notifiers: PostgreSQL `LISTEN`/`NOTIFY`, NATS (feature `nats`), or
//! polling.

pub mod changes;
mod command;
mod db;
mod error;
mod host;
mod notify;
mod rpc;
mod seal;

pub use changes::{watch_table, Change, ChangeFeed, ChangeKind, FeedStats, Row, TableWatch};
pub use command::{Command, Handler};
pub use db::{Database, DeferredParam, PostgresOptions, Tx};
pub use error::{connection_lost, CommandError, ErrorKind};
pub use host::{Applied, Host, HostBuilder, HostStats, Via};
pub use notify::Notifier;
pub use rpc::{
    authenticated_or_trusted, CommandClient, CommandServer, Commands, CommandsServer, Guarded,
};

/// The rusqlite this crate links (SQLite allows one per program): the version of the
/// `rusqlite::Connection` that [`Tx::require_sqlite`] hands out.
pub use rusqlite;
/// The tokio-postgres this crate uses: the version of the client and the error types that
/// [`Tx`] hands out on PostgreSQL.
pub use tokio_postgres;
/// The rustls this crate speaks TLS to PostgreSQL with (feature `tls`): the version of the
/// `ClientConfig` that [`PostgresOptions::tls`] takes.
#[cfg(feature = "tls")]
pub use tokio_rustls::rustls;
