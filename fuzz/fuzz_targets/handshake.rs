//! Arbitrary bytes as a handshake payload: decoding never panics, and whatever decodes
//! re-encodes to the same bytes (the layout has one form).
#![no_main]

use coherent_rpc::handshake::Hello;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hello) = Hello::decode(data) {
        assert_eq!(hello.encode(), data);
    }
});
