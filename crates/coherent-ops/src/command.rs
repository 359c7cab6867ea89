//! Commands and their handlers: the writes in one transaction, the invalidation in one place.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{de::DeserializeOwned, Serialize};

use crate::db::Tx;
use crate::error::{CommandError, ErrorKind};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A write, as a value: what to do, not how. Commands are stored in the operation log (as
/// JSON), so that every host can replay their invalidation, and sent by remote clients.
///
/// ```
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct RenameUser { id: i64, name: String }
///
/// impl coherent_ops::Command for RenameUser {
///     const NAME: &'static str = "users.rename";
///     type Output = ();
/// }
/// ```
pub trait Command: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The name the log stores it under: unique within the cluster, and stable across
    /// releases (hosts of two releases may share one log).
    const NAME: &'static str;
    /// What the handler answers; stored with the command, so that the invalidation can
    /// use what only the write knew (the id of a new row, the project a task moved from).
    type Output: Serialize + DeserializeOwned + Send + Sync + 'static;
}

/// Runs a command: [`execute`](Self::execute) does the writes, in the transaction the
/// pipeline opened (and commits, with the operation, after it returns `Ok`);
/// [`invalidate`](Self::invalidate) names the compute results the command changes, and runs
/// after the commit on this host and on every other host that replays the operation.
///
/// The invalidation must depend only on the command and its output, never on the database
/// or on local state: every host runs it, at another time.
///
/// `execute` may run more than once for one command: commands that wait together share a
/// transaction, and when one of them fails the others run again, each in a transaction of
/// its own (see [`HostBuilder::max_batch`](crate::HostBuilder::max_batch)). So it must act
/// only through its transaction: no mail sent, no counter bumped outside it.
pub trait Handler<C: Command>: Send + Sync + 'static {
    /// The writes. An error rolls the transaction back: nothing is written, nothing logged.
    fn execute(
        &self,
        command: &C,
        tx: &mut Tx<'_>,
    ) -> impl Future<Output = Result<C::Output, CommandError>> + Send;

    /// The invalidation: e.g. `self.invalidate_user(command.id)`.
    fn invalidate(&self, command: &C, output: &C::Output);
}

/// A handler with its command type erased, as the host stores it.
pub(crate) trait DynHandler<C: Command>: Send + Sync {
    fn execute<'a>(
        &'a self,
        command: &'a C,
        tx: &'a mut Tx<'_>,
    ) -> BoxFuture<'a, Result<C::Output, CommandError>>;
    fn invalidate(&self, command: &C, output: &C::Output);
}

impl<C: Command, H: Handler<C>> DynHandler<C> for H {
    fn execute<'a>(
        &'a self,
        command: &'a C,
        tx: &'a mut Tx<'_>,
    ) -> BoxFuture<'a, Result<C::Output, CommandError>> {
        Box::pin(Handler::execute(self, command, tx))
    }

    fn invalidate(&self, command: &C, output: &C::Output) {
        Handler::invalidate(self, command, output);
    }
}

/// Replays an operation's invalidation from its JSON.
pub(crate) type Replay = dyn Fn(&str, &str) -> Result<(), CommandError> + Send + Sync;

/// Runs a command given as JSON, answering JSON (for remote callers).
pub(crate) type RunJson =
    dyn Fn(crate::Host, String) -> BoxFuture<'static, Result<String, CommandError>> + Send + Sync;

pub(crate) struct Registered {
    /// `Arc<dyn DynHandler<C>>` for the command type registered under the name.
    pub(crate) typed: Box<dyn Any + Send + Sync>,
    pub(crate) replay: Box<Replay>,
    pub(crate) run_json: Box<RunJson>,
}

/// The handlers of a host, by command name.
#[derive(Default)]
pub(crate) struct Handlers {
    by_name: HashMap<&'static str, Registered>,
}

impl Handlers {
    pub(crate) fn insert<C: Command, H: Handler<C>>(&mut self, handler: H) {
        let handler: Arc<dyn DynHandler<C>> = Arc::new(handler);
        let replay_handler = handler.clone();
        let registered = Registered {
            typed: Box::new(handler),
            replay: Box::new(move |command, output| {
                let command: C = serde_json::from_str(command).map_err(|e| {
                    CommandError::new(
                        ErrorKind::BadCommand,
                        format!("{}: the logged command does not decode: {e}", C::NAME),
                    )
                })?;
                let output: C::Output = serde_json::from_str(output).map_err(|e| {
                    CommandError::new(
                        ErrorKind::BadCommand,
                        format!("{}: the logged output does not decode: {e}", C::NAME),
                    )
                })?;
                replay_handler.invalidate(&command, &output);
                Ok(())
            }),
            run_json: Box::new(|host, json| {
                Box::pin(async move {
                    let command: C = serde_json::from_str(&json).map_err(|e| {
                        CommandError::new(
                            ErrorKind::BadCommand,
                            format!("{}: the command does not decode: {e}", C::NAME),
                        )
                    })?;
                    let output = host.run(command).await?;
                    Ok(serde_json::to_string(&output)?)
                })
            }),
        };
        if self.by_name.insert(C::NAME, registered).is_some() {
            panic!("two handlers for the command {:?}", C::NAME);
        }
    }

    pub(crate) fn typed<C: Command>(&self) -> Result<Arc<dyn DynHandler<C>>, CommandError> {
        self.by_name
            .get(C::NAME)
            .and_then(|r| r.typed.downcast_ref::<Arc<dyn DynHandler<C>>>())
            .cloned()
            .ok_or_else(|| unknown(C::NAME))
    }

    pub(crate) fn get(&self, name: &str) -> Result<&Registered, CommandError> {
        self.by_name.get(name).ok_or_else(|| unknown(name))
    }
}

fn unknown(name: &str) -> CommandError {
    CommandError::new(
        ErrorKind::UnknownCommand,
        format!("no handler for the command {name:?} on this host"),
    )
}
