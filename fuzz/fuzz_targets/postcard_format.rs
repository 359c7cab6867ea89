//! The postcard format is encoded and decoded by coherent-rpc's own serde implementation;
//! this target holds it to the `postcard` crate on arbitrary bytes, for a type that uses
//! every serde form. Both must accept and refuse the same inputs and decode the same value,
//! and whatever decodes must encode back to what postcard writes for it. Nothing may panic.
#![no_main]

use std::collections::BTreeMap;

use coherent_rpc::{Blob, Format};
use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Unit;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Shape {
    Empty,
    Circle(f64),
    Rect(u16, i16),
    Named { name: String, sides: Option<u8> },
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Everything {
    flag: bool,
    small: i8,
    byte: u8,
    short: i16,
    ushort: u16,
    int: i32,
    uint: u32,
    long: i64,
    ulong: u64,
    huge: i128,
    uhuge: u128,
    single: f32,
    letter: char,
    text: String,
    blob: Blob,
    maybe: Option<Box<Shape>>,
    list: Vec<Shape>,
    map: BTreeMap<u8, Vec<i64>>,
    unit: (),
    unit_struct: Unit,
    tuple: (u8, Option<bool>),
    array: [u32; 2],
}

fuzz_target!(|data: &[u8]| {
    let ours = Format::Postcard.decode::<Everything>(data);
    let theirs = postcard::from_bytes::<Everything>(data);
    match (ours, theirs) {
        (Ok(a), Ok(b)) => {
            // Debug, not ==: a NaN float decodes the same but is not equal to itself.
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
            let mut encoded = Vec::new();
            Format::Postcard.encode_into(&a, &mut encoded).expect("encodes");
            assert_eq!(encoded, postcard::to_allocvec(&b).expect("postcard encodes"));
        }
        (Err(_), Err(_)) => {}
        (a, b) => panic!("ours: {a:?}, postcard's: {b:?}"),
    }
    // A sequence decoded from the start, as a stream of items would be.
    let ours = Format::Postcard.decode::<Vec<(u32, Blob)>>(data).is_ok();
    let theirs = postcard::from_bytes::<Vec<(u32, Blob)>>(data).is_ok();
    assert_eq!(ours, theirs);
});
