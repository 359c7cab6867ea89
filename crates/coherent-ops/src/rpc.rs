//! Commands sent by remote clients over Coherent RPC.

use coherent_rpc::{service, CallContext, Caller, Trust};

use crate::command::Command;
use crate::error::CommandError;
use crate::host::Host;

/// The RPC service through which remote clients run commands on a host. Serve it with
/// `CommandServer::new(host)` on the host's `Endpoint`, beside its `RemoteServer`; call it
/// with a [`CommandClient`].
///
/// Who may run commands: served over a `Host` as it is, a command from a trusted connection
/// (`coherent_rpc::Trust::Trusted`: the application's own tiers) runs, and one from an
/// untrusted connection (a browser over WebSocket) runs only if the endpoint's
/// authentication hook gave that connection an identity; others get
/// [`ErrorKind::Unauthorized`](crate::ErrorKind::Unauthorized). A policy of your own
/// (per command, per identity): `CommandServer::new(Guarded::new(host, policy))`.
#[service]
pub trait Commands {
    /// Runs the command named `kind`, given as JSON, through the host's pipeline; answers
    /// its output as JSON, after its invalidation has run on this host. Not idempotent: a
    /// call cut off by a disconnect is not resent (the command may have run; its operation
    /// is then in the log).
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError>;
}

/// The server side of [`CommandClient`]: `CommandServer::new(host)` (or a [`Guarded`] host)
/// serves a host's commands on an `Endpoint`. The name that pairs with the client; the
/// generated `CommandsServer` is the same type.
pub type CommandServer<T> = CommandsServer<T>;

impl Commands for Host {
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError> {
        if let Some(ctx) = CallContext::current() {
            authenticated_or_trusted(&ctx, &kind)?;
        }
        self.run_json(&kind, command).await
    }
}

/// The policy of a [`Host`] served as it is: trusted connections, and untrusted ones that
/// authenticated. Use it inside a policy of your own to keep it.
pub fn authenticated_or_trusted(ctx: &CallContext, kind: &str) -> Result<(), CommandError> {
    if ctx.peer().trust() == Trust::Trusted || ctx.identity().is_some() {
        Ok(())
    } else {
        Err(CommandError::unauthorized(format!(
            "{kind}: an unauthenticated client may not run commands"
        )))
    }
}

/// A host behind a policy of your own: `policy(ctx, kind)` runs before each command that
/// arrives over RPC, with the call's context (its connection's trust and identity) and the
/// command's name, and an `Err` answers the caller without running anything.
///
/// ```
/// # fn wire(host: coherent_ops::Host) {
/// use coherent_ops::{authenticated_or_trusted, CommandError, CommandServer, Guarded};
/// let commands = CommandServer::new(Guarded::new(host, |ctx, kind| {
///     authenticated_or_trusted(ctx, kind)?;
///     let admin = ctx.identity().is_some_and(|i| i.name() == "admin");
///     let tier = ctx.peer().trust() == coherent_rpc::Trust::Trusted;
///     if kind == "users.delete" && !admin && !tier {
///         return Err(CommandError::unauthorized("admins only"));
///     }
///     Ok(())
/// }));
/// # let _ = commands;
/// # }
/// ```
#[derive(Clone)]
pub struct Guarded<F> {
    host: Host,
    policy: F,
}

impl<F> Guarded<F>
where
    F: Fn(&CallContext, &str) -> Result<(), CommandError> + Send + Sync + 'static,
{
    /// `host`'s commands, each checked by `policy` first.
    pub fn new(host: Host, policy: F) -> Self {
        Self { host, policy }
    }
}

impl<F> Commands for Guarded<F>
where
    F: Fn(&CallContext, &str) -> Result<(), CommandError> + Send + Sync + 'static,
{
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError> {
        let ctx = CallContext::current().ok_or_else(|| {
            CommandError::unauthorized("a guarded host runs commands only for RPC calls")
        })?;
        (self.policy)(&ctx, &kind)?;
        self.host.run_json(&kind, command).await
    }
}

/// Runs commands on a remote host, typed: `client.run(&RenameUser { .. }).await`.
///
/// Over any caller: a `coherent_rpc::Peer`, a `Reconnecting` connection, or the connection
/// of a `RemoteClient` (`RemoteClient::caller`), so that the replicas and the commands
/// share one connection and fail over together.
#[derive(Clone)]
pub struct CommandClient<C> {
    inner: CommandsClient<C>,
}

impl<C: Caller> CommandClient<C> {
    /// A client over `caller`.
    pub fn new(caller: C) -> Self {
        Self {
            inner: CommandsClient::new(caller),
        }
    }

    /// Runs `command` on the host at the other end; returns after its invalidation ran
    /// there (the host's own dependants and the replicas its clients hold, this one's
    /// included, are invalidated by then or being pushed).
    pub async fn run<K: Command>(&self, command: &K) -> Result<K::Output, CommandError> {
        let json = serde_json::to_string(command)?;
        let output = self.inner.run(K::NAME.to_owned(), json).await??;
        Ok(serde_json::from_str(&output)?)
    }
}
