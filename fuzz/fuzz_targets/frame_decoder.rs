//! Feeds arbitrary bytes to the frame decoder the way a connection's reader does: decode
//! an envelope, take its payload, decompress it under a limit, split a stream batch into
//! its items, repeat. Nothing may panic, every envelope that decodes must re-encode to the
//! same bytes, and a batch that checks out must split into exactly that many items.
#![no_main]

use bytes::Bytes;
use coherent_rpc::frame::{batch_len, BatchItems, Compression, Header, Kind, MAX_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

const MAX: u32 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((h, n))) = Header::decode(rest, MAX) {
        let mut head = [0u8; MAX_HEADER_LEN];
        let m = h.encode(&mut head);
        assert_eq!(&head[..m], &rest[..n], "decoded envelope does not re-encode");
        let end = n + h.len as usize;
        if rest.len() < end {
            break;
        }
        let payload = Bytes::copy_from_slice(&rest[n..end]);
        if h.kind == Kind::StreamBatch {
            let items: Vec<_> = BatchItems::new(&payload).collect();
            match batch_len(&payload) {
                Ok(count) => {
                    assert_eq!(items.len(), count as usize);
                    assert!(items.iter().all(Result::is_ok));
                    let total: usize = items.iter().map(|i| i.as_ref().map_or(0, |i| i.len())).sum();
                    assert!(total <= payload.len());
                }
                Err(_) => assert!(items.is_empty() || items.last().is_some_and(Result::is_err)),
            }
        }
        if h.compression != Compression::None {
            if let Ok(out) = coherent_rpc::decompress(h.compression, payload, MAX) {
                assert!(out.len() <= MAX as usize);
            }
        }
        rest = &rest[end..];
    }
});
