//! Arbitrary bytes as everything an accepting side answers a connecting endpoint (its
//! `HelloAck` or `Close` included), while the connecting side has calls in flight, on a
//! paused clock: the connecting side must end every call or close, never panic or hang.
//! The first byte picks zero-RTT (calls in flight before the answer) or not.
#![no_main]

use std::time::Duration;

use coherent_rpc::{CallOptions, Config, Endpoint};
use futures_core::Stream;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, answer)) = data.split_first() else {
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let client = Endpoint::builder()
            .config(
                Config::default()
                    .zero_rtt(mode & 1 == 1)
                    .max_message_size(1 << 16)
                    .stream_window(4)
                    .handshake_timeout(Duration::from_secs(1)),
            )
            .build();
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let connect = tokio::spawn(async move { client.connect(a).await });
        // What the connecting side sends is read and dropped.
        let (mut theirs, mut ours) = tokio::io::split(&mut b);
        let drain = async {
            let mut sink = vec![0u8; 1 << 16];
            while let Ok(n) = theirs.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        };
        let zero_rtt = mode & 1 == 1;
        let work = async {
            // With zero-RTT the calls are in flight before the answer arrives; without, the
            // answer decides whether there is a connection to call on at all.
            if !zero_rtt {
                let _ = ours.write_all(answer).await;
            }
            let Ok(Ok(peer)) = connect.await else {
                return;
            };
            let opts = CallOptions {
                timeout: Some(Duration::from_secs(1)),
                idempotent: false,
            };
            let unary = peer.call::<_, Vec<u8>>(1, (7u8,), opts);
            let stream = async {
                if let Ok(mut s) = peer.call_stream::<_, u8>(2, (3u8,)) {
                    while let Some(Ok(_)) =
                        std::future::poll_fn(|cx| std::pin::Pin::new(&mut s).poll_next(cx)).await
                    {
                    }
                }
            };
            let answering = async {
                if zero_rtt {
                    let _ = ours.write_all(answer).await;
                }
            };
            let _ = tokio::join!(unary, stream, answering);
            peer.close();
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            tokio::select! {
                _ = drain => {}
                _ = work => {}
            }
        })
        .await;
    });
});
