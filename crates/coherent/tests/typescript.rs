//! `#[compute_service(typescript)]`: a trait's methods described for TypeScript (wire name,
//! id, documentation, argument and result types), and a `Module` rendering them with the
//! declarations of the types they name, as serde writes those types. Needs the `typescript`
//! feature (`cargo test -p coherent --features typescript --test typescript`).

use coherent::prelude::*;
use coherent::typescript::{Config, Module, TS};
use serde::{Deserialize, Serialize};

/// What the service hands out.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[ts(crate = "coherent::typescript")]
pub(crate) struct Account {
    /// Its number.
    id: u64,
    #[serde(rename = "holder")]
    owner: String,
    cents: i64,
    kind: Kind,
    closed_at: Option<i64>,
}

/// Which kind of account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[ts(crate = "coherent::typescript")]
#[serde(rename_all = "snake_case")]
pub(crate) enum Kind {
    Checking,
    SavingsPlan,
}

/// The service's own error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
#[ts(crate = "coherent::typescript")]
pub(crate) enum BankError {
    NoSuchAccount(u64),
    Closed { since: i64 },
    Unavailable(String),
}

impl From<RpcError> for BankError {
    fn from(e: RpcError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

/// Declared by the module though no method names it.
#[derive(Serialize, TS)]
#[ts(crate = "coherent::typescript")]
pub(crate) struct Extra {
    account: Account,
}

#[compute_service(typescript)]
pub(crate) trait Bank {
    /// One account.
    async fn account(&self, id: u64) -> Result<Account, BankError>;
    /// Every account of a holder, of one kind.
    ///
    /// Newest first.
    async fn accounts(&self, holder: String, kind: Option<Kind>)
        -> Result<Vec<Account>, BankError>;
    async fn total(&self) -> Result<i64, BankError>;
}

/// A second service in the same file, its trait private.
#[compute_service(typescript)]
trait Clock {
    async fn now(&self) -> Result<Option<u32>, BankError>;
}

const EXPECTED: &str = r#"// Generated. Do not edit.
//
// Second line.

/**
 * What the service hands out.
 */
export type Account = {
  /**
   * Its number.
   */
  id: number,
  holder: string,
  cents: number,
  kind: Kind,
  closed_at: number | null,
};

/**
 * The service's own error.
 */
export type BankError = { "NoSuchAccount": number } | { "Closed": { since: number, } } | { "Unavailable": string };

/**
 * Declared by the module though no method names it.
 */
export type Extra = {
  account: Account,
};

/**
 * Which kind of account.
 */
export type Kind = "checking" | "savings_plan";

/** The compute methods of Bank (what `client.replica(...)` and `client.compute(...)` accept), by wire name: each one's id, arguments and result. */
export interface Bank {
  /** One account. */
  "Bank.account": { id: 0x11b8baee; args: [id: number]; result: { Ok : Account } | { Err : BankError } };
  /**
   * Every account of a holder, of one kind.
   *
   * Newest first.
   */
  "Bank.accounts": { id: 0x82cdc527; args: [holder: string, kind: Kind | null]; result: { Ok : Array<Account> } | { Err : BankError } };
  "Bank.total": { id: 0x02dd4e6b; args: []; result: { Ok : number } | { Err : BankError } };
}

/** The method ids of Bank, by wire name. */
export const BankIds = {
  "Bank.account": 0x11b8baee,
  "Bank.accounts": 0x82cdc527,
  "Bank.total": 0x02dd4e6b,
} as const;

/** The compute methods of Clock (what `client.replica(...)` and `client.compute(...)` accept), by wire name: each one's id, arguments and result. */
export interface Clock {
  "Clock.now": { id: 0xae160acb; args: []; result: { Ok : number | null } | { Err : BankError } };
}

/** The method ids of Clock, by wire name. */
export const ClockIds = {
  "Clock.now": 0xae160acb,
} as const;
"#;

#[test]
fn a_module_declares_each_type_once_then_each_service() {
    let ts = Module::new()
        .comment("Generated. Do not edit.")
        .comment("")
        .comment("Second line.")
        .service(BankServer::typescript())
        .service(ClockServer::typescript())
        .declare::<Extra>()
        .render();
    assert_eq!(ts, EXPECTED, "rendered:\n{ts}");
}

#[test]
fn methods_are_the_traits_in_order_with_their_wire_ids() {
    let service = BankServer::typescript();
    assert_eq!(service.name(), "Bank");
    let names: Vec<_> = service.methods().iter().map(|m| m.name()).collect();
    assert_eq!(names, ["Bank.account", "Bank.accounts", "Bank.total"]);
    for m in service.methods() {
        assert_eq!(m.id(), coherent::rpc::method_id(m.name()));
    }
    let accounts = &service.methods()[1];
    assert_eq!(
        accounts.docs(),
        [
            "Every account of a holder, of one kind.",
            "",
            "Newest first."
        ]
    );
    let config = Config::new();
    assert_eq!(
        accounts.arg_types(&config),
        [
            ("holder", "string".to_owned()),
            ("kind", "Kind | null".to_owned())
        ]
    );
    assert_eq!(
        accounts.result_type(&config),
        "{ Ok : Array<Account> } | { Err : BankError }"
    );
}

#[test]
fn large_integers_are_numbers_unless_configured() {
    let bigint = Module::new()
        .config(Config::new().with_large_int("bigint"))
        .service(BankServer::typescript())
        .render();
    assert!(bigint.contains("args: [id: bigint]"), "{bigint}");
    assert!(
        bigint.contains("  id: bigint,\n  holder: string,\n  cents: bigint,\n"),
        "{bigint}"
    );
}

/// Commas and brackets in names, types and doc comments.
#[derive(Serialize, TS)]
#[ts(crate = "coherent::typescript")]
pub(crate) struct Tricky {
    /// A doc with a comma, a `{` and a `<`.
    #[serde(rename = "a, b")]
    pair: (u8, Option<Vec<u16>>),
    map: std::collections::HashMap<String, [u8; 2]>,
    /// One line.
    ///
    /// Another, after a blank one.
    inline: BankError,
}

#[test]
fn struct_declarations_have_one_field_a_line() {
    let ts = Module::new().declare::<Tricky>().render();
    let tricky = ts
        .split("\n\n")
        .find(|d| d.contains("export type Tricky"))
        .expect("Tricky is declared");
    assert_eq!(
        tricky.trim_end(),
        r#"/**
 * Commas and brackets in names, types and doc comments.
 */
export type Tricky = {
  /**
   * A doc with a comma, a `{` and a `<`.
   */
  "a, b": [number, Array<number> | null],
  map: { [key in string]: [number, number] },
  /**
   * One line.
   *
   * Another, after a blank one.
   */
  inline: BankError,
};"#
    );
}

#[test]
#[should_panic(expected = "service Account declares `Account`, which is also a type's name")]
fn a_service_named_as_a_type_is_refused() {
    mod service {
        use coherent::prelude::*;

        #[compute_service(typescript)]
        pub(super) trait Account {
            async fn get(&self) -> Result<crate::Account, crate::BankError>;
        }
    }
    let _ = Module::new()
        .service(service::AccountServer::typescript())
        .render();
}

/// A method that takes the caller, filled in by the server: declared as the shape it
/// travels as.
#[compute_service(typescript)]
trait Inbox {
    async fn unread(&self, caller: coherent::remote::Caller) -> Result<u32, BankError>;
}

#[test]
fn a_caller_is_a_string_or_null() {
    let ts = Module::new().service(InboxServer::typescript()).render();
    assert!(ts.contains("export type Caller = string | null;"), "{ts}");
    assert!(ts.contains("args: [caller: Caller]"), "{ts}");
}
