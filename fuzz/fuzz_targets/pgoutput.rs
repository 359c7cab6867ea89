//! Arbitrary bytes as pgoutput messages (one row of `pg_logical_slot_peek_binary_changes`):
//! the change feed's decoder must refuse what is malformed with an error, never panic,
//! never allocate what a count claims beyond the bytes there.
#![no_main]

use coherent_ops::changes::pgoutput::{decode, Message, Value, MAX_COLUMNS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(message) = decode(data) else {
        return;
    };
    // What decoded is bounded by the bytes it came from.
    let values = |t: &coherent_ops::changes::pgoutput::Tuple<'_>| {
        assert!(t.0.len() <= MAX_COLUMNS && t.0.len() <= data.len());
        for v in &t.0 {
            if let Value::Text(b) | Value::Binary(b) = v {
                assert!(b.len() <= data.len());
            }
        }
    };
    match &message {
        Message::Relation { columns, .. } => assert!(columns.len() <= MAX_COLUMNS),
        Message::Insert { new, .. } => values(new),
        Message::Update { old, new, .. } => {
            if let Some(old) = old {
                values(old);
            }
            values(new);
        }
        Message::Delete { old, .. } => values(old),
        Message::Truncate { relations, .. } => assert!(relations.len() * 4 <= data.len()),
        _ => {}
    }
});
