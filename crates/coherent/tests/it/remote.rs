//! One trait, two implementations: a compute service defined by a trait, served to remote
//! clients through `<Trait>Server`, and read through `<Trait>Client`, which implements the
//! same trait with replicas.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::prelude::*;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// What the service hands out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Account {
    id: u64,
    owner: String,
    cents: i64,
}

/// An application's own error: its cases, and the lost connection a stub may report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum BankError {
    NoSuchAccount(u64),
    Unavailable(String),
}

impl From<RpcError> for BankError {
    fn from(e: RpcError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

#[compute_service]
pub(crate) trait Bank {
    /// One account.
    async fn account(&self, id: u64) -> Result<Account, BankError>;
    /// The sum of the accounts' balances: built on `account`.
    async fn total(&self, first: u64, last: u64) -> Result<i64, BankError>;
    /// How many accounts there are; no arguments.
    async fn count(&self) -> Result<usize, RpcError>;
}

#[derive(Clone, ComputeService)]
struct Ledger {
    handle: ServiceHandle,
    accounts: Arc<Mutex<HashMap<u64, Account>>>,
    runs: Arc<AtomicUsize>,
}

#[compute_service]
impl Bank for Ledger {
    async fn account(&self, id: u64) -> Result<Account, BankError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.accounts
            .lock()
            .get(&id)
            .cloned()
            .ok_or(BankError::NoSuchAccount(id))
    }

    #[compute(keep_alive = "5s")]
    async fn total(&self, first: u64, last: u64) -> Result<i64, BankError> {
        let mut sum = 0;
        for id in first..=last {
            sum += self.account(id).await?.cents;
        }
        Ok(sum)
    }

    async fn count(&self) -> Result<usize, RpcError> {
        Ok(self.accounts.lock().len())
    }
}

impl Ledger {
    fn new() -> Self {
        let accounts = (1..=3).map(|id| {
            let owner = format!("owner {id}");
            (
                id,
                Account {
                    id,
                    owner,
                    cents: 100 * id as i64,
                },
            )
        });
        Self {
            handle: ServiceHandle::new(),
            accounts: Arc::new(Mutex::new(accounts.collect())),
            runs: Arc::default(),
        }
    }

    /// A write and its invalidation.
    fn deposit(&self, id: u64, cents: i64) {
        self.accounts.lock().get_mut(&id).unwrap().cents += cents;
        self.invalidate_account(id);
    }
}

/// Written once, against the trait.
async fn balance_line(bank: &impl Bank, id: u64) -> String {
    match bank.account(id).await {
        Ok(a) => format!("{}: {}", a.owner, a.cents),
        Err(e) => format!("error: {e:?}"),
    }
}

async fn serve(server: RemoteServer) -> SocketAddr {
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    addr
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within 10 s"))
}

#[tokio::test]
async fn code_written_against_the_trait_runs_in_process_and_remote_alike() {
    let ledger = Ledger::new();
    let addr = serve(RemoteServer::new().expose_service(BankServer::new(ledger.clone()))).await;
    let remote = BankClient::new(RemoteClient::connect_tcp(addr).await.unwrap());

    assert_eq!(balance_line(&ledger, 2).await, "owner 2: 200");
    assert_eq!(balance_line(&remote, 2).await, "owner 2: 200");
    assert_eq!(
        balance_line(&remote, 9).await,
        "error: NoSuchAccount(9)",
        "the server's typed error reaches the client as itself"
    );
    assert_eq!(remote.total(1, 3).await, Ok(600));
    assert_eq!(remote.count().await, Ok(3));

    // A hit on the client: the server's method does not run again.
    let runs = ledger.runs.load(Ordering::SeqCst);
    assert_eq!(balance_line(&remote, 2).await, "owner 2: 200");
    assert_eq!(ledger.runs.load(Ordering::SeqCst), runs);

    // A write on the server reaches the stub's replica, and what was built on it.
    let account = remote.account_computed(2).await;
    let total = remote.total_computed(1, 3).await;
    ledger.deposit(2, 5);
    within("the pushed invalidation", account.when_invalidated()).await;
    within("the remote total's invalidation", total.when_invalidated()).await;
    assert_eq!(balance_line(&remote, 2).await, "owner 2: 205");
    assert_eq!(remote.total(1, 3).await, Ok(605));
}

/// A client-side compute service built on a stub, as an application would write it.
#[derive(Clone, ComputeService)]
struct Statement<B: Bank + Clone + Send + Sync + 'static> {
    handle: ServiceHandle,
    bank: B,
}

#[compute_service]
impl<B: Bank + Clone + Send + Sync + 'static> Statement<B> {
    #[compute]
    async fn line(&self, id: u64) -> String {
        balance_line(&self.bank, id).await
    }
}

#[tokio::test]
async fn a_computed_built_on_the_stub_follows_the_server() {
    let ledger = Ledger::new();
    let addr = serve(RemoteServer::new().expose_service(BankServer::new(ledger.clone()))).await;
    let bank = BankClient::new(RemoteClient::connect_tcp(addr).await.unwrap());
    let statement = Statement {
        handle: ServiceHandle::new(),
        bank,
    };
    assert_eq!(statement.line(1).await, "owner 1: 100");
    let line = statement.line_computed(1).await;
    ledger.deposit(1, 1);
    within("the statement's invalidation", line.when_invalidated()).await;
    assert_eq!(statement.line(1).await, "owner 1: 101");
}

#[compute_service]
pub(crate) trait Clock {
    async fn now(&self) -> Result<u64, RpcError>;
}

#[compute_service]
impl Clock for Ledger {
    async fn now(&self) -> Result<u64, RpcError> {
        Ok(42)
    }
}

#[tokio::test]
async fn one_server_exposes_several_traits_and_a_lost_server_is_an_error_of_the_trait() {
    let ledger = Ledger::new();
    let server = RemoteServer::new()
        .expose_service(BankServer::new(ledger.clone()))
        .expose_service(ClockServer::new(ledger.clone()));
    let addr = serve(server).await;
    let remote = RemoteClient::connect_tcp(addr).await.unwrap();
    let (bank, clock) = (
        BankClient::new(remote.clone()),
        ClockClient::new(remote.clone()),
    );
    assert_eq!(clock.now().await, Ok(42));
    assert_eq!(bank.count().await, Ok(3));

    // Closed: the stub's error is the application's own `Unavailable`.
    remote.close();
    match bank.account(3).await {
        Err(BankError::Unavailable(m)) => assert!(m.contains("closed"), "{m}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn the_stub_asks_by_the_method_id_that_the_name_hashes_to() {
    // A client that knows only the name reads the same method.
    let ledger = Ledger::new();
    let addr = serve(RemoteServer::new().expose_service(BankServer::new(ledger.clone()))).await;
    let remote = RemoteClient::connect_tcp(addr).await.unwrap();
    let by_name: Result<Result<Account, BankError>, RpcError> =
        remote.call("Bank.account", (1u64,)).await;
    assert_eq!(by_name.unwrap().unwrap().owner, "owner 1");
}

/// Argument names the generated code also uses, a type named `S`, and two traits (and an
/// inherent compute method) with one method name on one type.
pub(crate) struct S(u64);

#[compute_service]
pub(crate) trait Names {
    async fn get(&self, table: String, service: u64, key: u64) -> Result<String, RpcError>;
    async fn wrap(&self, s: u64) -> Result<u64, RpcError>;
}

#[compute_service]
pub(crate) trait Others {
    async fn get(&self, key: u64) -> Result<u64, RpcError>;
}

// Only its definition is under test.
#[allow(dead_code)]
#[compute_service(local)]
pub(crate) trait LocalOnly {
    /// Neither a `Result` nor serde types: no stub is made.
    async fn get(&self, s: u64) -> std::time::Instant;
}

#[derive(Clone, ComputeService)]
struct Crowded {
    handle: ServiceHandle,
}

#[compute_service]
impl Names for Crowded {
    async fn get(&self, table: String, service: u64, key: u64) -> Result<String, RpcError> {
        Ok(format!("{table}/{service}/{key}"))
    }

    async fn wrap(&self, s: u64) -> Result<u64, RpcError> {
        Ok(S(s).0 + 1)
    }
}

#[compute_service]
impl Others for Crowded {
    async fn get(&self, key: u64) -> Result<u64, RpcError> {
        Ok(key * 2)
    }
}

#[compute_service]
impl Crowded {
    #[compute]
    async fn get(&self, key: u64) -> u64 {
        key * 3
    }
}

#[tokio::test]
async fn generated_names_do_not_collide_with_the_users() {
    let crowded = Crowded {
        handle: ServiceHandle::new(),
    };
    assert_eq!(crowded.get(1).await, 3);
    assert_eq!(Others::get(&crowded, 1).await, Ok(2));
    assert_eq!(
        Names::get(&crowded, "t".into(), 4, 5).await.as_deref(),
        Ok("t/4/5")
    );
    let server = RemoteServer::new()
        .expose_service(NamesServer::new(crowded.clone()))
        .expose_service(OthersServer::new(crowded.clone()));
    let remote = RemoteClient::connect_tcp(serve(server).await)
        .await
        .unwrap();
    let names = NamesClient::new(remote.clone());
    assert_eq!(names.get("u".into(), 6, 7).await.as_deref(), Ok("u/6/7"));
    assert_eq!(names.wrap(9).await, Ok(10));
    assert_eq!(OthersClient::new(remote).get(5).await, Ok(10));
    // Invalidating one trait's `get` leaves the other's and the inherent one alone.
    let others = Others::get_computed(&crowded, 1).await;
    let inherent = crowded.get_computed(1).await;
    assert!(Names::invalidate_get(&crowded, "t".into(), 4, 5));
    assert!(others.is_consistent() && inherent.is_consistent());
}
