//! Commands sent by remote clients over Coherent RPC.

use coherent_rpc::{service, Caller};

use crate::command::Command;
use crate::error::CommandError;
use crate::host::Host;

/// The RPC service through which remote clients run commands on a host. Serve it with
/// `CommandsServer::new(host)` on the host's `Endpoint`, beside its `RemoteServer`; call it
/// with a [`CommandClient`].
#[service]
pub trait Commands {
    /// Runs the command named `kind`, given as JSON, through the host's pipeline; answers
    /// its output as JSON, after its invalidation has run on this host. Not idempotent: a
    /// call cut off by a disconnect is not resent (the command may have run; its operation
    /// is then in the log).
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError>;
}

impl Commands for Host {
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError> {
        self.run_json(&kind, command).await
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
