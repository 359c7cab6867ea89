//! The data every peer moves: the same users, hello messages, stream items and payloads,
//! so that the peers are compared on equal work.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// `GetUser`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct User {
    pub(crate) id: i64,
    pub(crate) version: i64,
    pub(crate) created_at: i64,
    pub(crate) modified_at: i64,
    pub(crate) name: String,
}

pub(crate) fn user(id: i64) -> User {
    User {
        id,
        version: 1,
        created_at: 1_700_000_000_000,
        modified_at: 1_700_000_360_000,
        name: format!("User {id}"),
    }
}

/// grpc_bench's complex_proto `Pet`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Pet {
    pub(crate) name: String,
    pub(crate) color: i32,
}

/// The oneof of complex_proto.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Choice {
    Text(String),
    Flag(bool),
}

/// grpc_bench's complex_proto request, echoed back by `SayHello`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) name: String,
    pub(crate) d: f64,
    pub(crate) f: f32,
    pub(crate) b: bool,
    pub(crate) n32: i32,
    pub(crate) n64: i64,
    pub(crate) choice: Option<Choice>,
    pub(crate) pets: Vec<Pet>,
}

pub(crate) fn hello() -> Hello {
    Hello {
        name: "Hello, complex world".to_owned(),
        d: 1.234_567_89,
        f: 9.876_5,
        b: true,
        n32: 123_456,
        n64: 9_876_543_210,
        choice: Some(Choice::Text("a oneof string".to_owned())),
        pets: vec![
            Pet {
                name: "Rex".to_owned(),
                color: 2,
            },
            Pet {
                name: "Tom".to_owned(),
                color: 0,
            },
        ],
    }
}

/// One streamed item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Item {
    pub(crate) index: i64,
    /// Decoded as a slice of the received batch, as tonic's `bytes` fields are.
    pub(crate) data: ::coherent::rpc::Blob,
}

/// The 10 MB payload kinds of the payload cases.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PayloadKind {
    Zero,
    Text,
    Rand,
}

impl PayloadKind {
    pub(crate) const ALL: [PayloadKind; 3] = [Self::Zero, Self::Text, Self::Rand];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Zero => "zero",
            Self::Text => "text",
            Self::Rand => "rand",
        }
    }

    pub(crate) fn make(self, len: usize) -> Bytes {
        match self {
            Self::Zero => Bytes::from(vec![0u8; len]),
            Self::Text => {
                let text = b"Coherent computes once, caches everywhere and invalidates exactly when inputs change. ";
                Bytes::from(text.iter().copied().cycle().take(len).collect::<Vec<u8>>())
            }
            Self::Rand => {
                use rand::Rng;
                let mut v = vec![0u8; len];
                rand::rng().fill_bytes(&mut v);
                Bytes::from(v)
            }
        }
    }
}

pub(crate) const PAYLOAD_LEN: usize = 10 * 1024 * 1024;
pub(crate) const STREAM_ITEMS: u32 = 1800;
