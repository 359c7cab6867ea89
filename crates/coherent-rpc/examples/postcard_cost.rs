//! What the hand-written postcard format (`src/compact.rs`) saves over the `postcard` crate
//! on the messages the benchmarks send: nanoseconds to encode and to decode each, best of
//! seven runs, the same bytes either way (checked). The figures are in ARCHITECTURE.md.
//!
//! `cargo run --release -p coherent-rpc --example postcard_cost`

use std::hint::black_box;
use std::time::Instant;

use coherent_rpc::Format;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// `GetUser`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct User {
    id: i64,
    version: i64,
    created_at: i64,
    modified_at: i64,
    name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Color {
    Black,
    White,
    Brown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Pet {
    name: String,
    color: Color,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Choice {
    Text(String),
    Flag(bool),
}

/// `SayHello`'s request: grpc_bench's "complex_proto" message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Hello {
    name: String,
    d: f64,
    f: f32,
    b: bool,
    n32: i32,
    n64: i64,
    choice: Choice,
    pets: Vec<Pet>,
}

/// A stream item of 100 bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Item {
    index: i64,
    data: String,
}

const ROUNDS: usize = 7;

/// Best nanoseconds per call of `f` over `ROUNDS` runs of `n` calls.
fn best(n: usize, mut f: impl FnMut()) -> f64 {
    (0..ROUNDS)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..n {
                f();
            }
            start.elapsed().as_nanos() as f64 / n as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn compare<T>(name: &str, value: T, n: usize)
where
    T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let ours_bytes = Format::Postcard.encode(&value).unwrap();
    let theirs_bytes = postcard::to_allocvec(&value).unwrap();
    assert_eq!(&ours_bytes[..], &theirs_bytes[..], "{name}: the same bytes");
    assert_eq!(Format::Postcard.decode::<T>(&theirs_bytes).unwrap(), value);

    let mut out = Vec::with_capacity(4096);
    let ours_enc = best(n, || {
        out.clear();
        Format::Postcard
            .encode_into(black_box(&value), &mut out)
            .unwrap();
        black_box(&out);
    });
    let mut slice = vec![0u8; 4096];
    let theirs_enc = best(n, || {
        let used = postcard::to_slice(black_box(&value), &mut slice).unwrap();
        black_box(used);
    });
    let ours_dec = best(n, || {
        black_box(
            Format::Postcard
                .decode::<T>(black_box(&ours_bytes))
                .unwrap(),
        );
    });
    let theirs_dec = best(n, || {
        black_box(postcard::from_bytes::<T>(black_box(&theirs_bytes)).unwrap());
    });
    println!(
        "{name:<10} {:>4} B  encode {ours_enc:>6.1} ns vs postcard {theirs_enc:>6.1} ns ({:.2}x)  decode {ours_dec:>6.1} ns vs postcard {theirs_dec:>6.1} ns ({:.2}x)",
        ours_bytes.len(),
        theirs_enc / ours_enc,
        theirs_dec / ours_dec,
    );
}

fn main() {
    let n = 2_000_000;
    compare("sum args", (1i32, 2i32), n);
    compare(
        "user",
        User {
            id: 7,
            version: 3,
            created_at: 1_700_000_000_000_000,
            modified_at: 1_700_000_100_000_000,
            name: "user 7".to_owned(),
        },
        n,
    );
    compare(
        "hello",
        Hello {
            name: "Jane Doe".to_owned(),
            d: 1.5,
            f: 2.5,
            b: true,
            n32: -7,
            n64: 1 << 40,
            choice: Choice::Text("a choice".to_owned()),
            pets: vec![
                Pet {
                    name: "Rex".to_owned(),
                    color: Color::Brown,
                },
                Pet {
                    name: "Tom".to_owned(),
                    color: Color::Black,
                },
                Pet {
                    name: "Kitty".to_owned(),
                    color: Color::White,
                },
            ],
        },
        n / 2,
    );
    compare(
        "item 100",
        Item {
            index: 1234,
            data: "x".repeat(100),
        },
        n,
    );
}
