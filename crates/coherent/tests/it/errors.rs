//! `#[derive(FromRpcError)]`: each shape of the marked variant.

use coherent::rpc::{ErrorCode, RpcError};
use coherent::FromRpcError;

#[derive(Debug, PartialEq, FromRpcError)]
enum Message {
    #[allow(dead_code)]
    Other,
    #[rpc_error]
    Unavailable(String),
}

#[derive(Debug, PartialEq, FromRpcError)]
enum Kept {
    #[rpc_error]
    Rpc(RpcError),
}

#[derive(Debug, PartialEq, FromRpcError)]
enum Named {
    #[rpc_error]
    Unreachable { reason: std::sync::Arc<str> },
}

#[derive(Debug, PartialEq, FromRpcError)]
enum Bare {
    #[rpc_error]
    Down,
}

fn lost() -> RpcError {
    RpcError::new(ErrorCode::Disconnected, "the connection dropped")
}

#[test]
fn the_marked_variant_holds_the_error_its_message_or_nothing() {
    let Message::Unavailable(message) = Message::from(lost()) else {
        panic!("not the marked variant");
    };
    assert!(message.contains("the connection dropped"), "{message}");
    assert_eq!(Kept::from(lost()), Kept::Rpc(lost()));
    let Named::Unreachable { reason } = Named::from(lost());
    assert!(reason.contains("the connection dropped"), "{reason}");
    assert_eq!(Bare::from(lost()), Bare::Down);
}
