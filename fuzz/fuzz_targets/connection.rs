//! Arbitrary bytes as everything a client sends to an accepting endpoint, handshake
//! included, on a paused clock: the endpoint must answer or close, never panic.
#![no_main]

use std::time::Duration;

use coherent_rpc::{Config, Endpoint, Service};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A service with one method of each kind, written by hand so the target needs no macro.
struct Echo;

const METHODS: &[coherent_rpc::MethodInfo] = &[
    coherent_rpc::MethodInfo {
        id: coherent_rpc::method_id("Echo.echo"),
        name: "echo",
        kind: coherent_rpc::MethodKind::Unary,
    },
    coherent_rpc::MethodInfo {
        id: coherent_rpc::method_id("Echo.items"),
        name: "items",
        kind: coherent_rpc::MethodKind::Stream,
    },
];

impl Service for Echo {
    fn name(&self) -> &'static str {
        "Echo"
    }
    fn methods(&self) -> &'static [coherent_rpc::MethodInfo] {
        METHODS
    }
    fn call(
        &self,
        index: usize,
        args: bytes::Bytes,
        format: coherent_rpc::Format,
    ) -> coherent_rpc::Response {
        if index == 0 {
            coherent_rpc::Response::Unary(Box::pin(async move {
                let v: Vec<u8> = format.decode(&args)?;
                format.encode_message(&v)
            }))
        } else {
            coherent_rpc::Response::Stream(Box::pin(async move {
                let n: u8 = format.decode(&args)?;
                Ok(coherent_rpc::item_stream(Box::pin(countdown(n))))
            }))
        }
    }
}

/// `n - 1` down to 0: a stream whose items are ready at once, so they are batched.
fn countdown(n: u8) -> impl futures_core::Stream<Item = u8> + Send {
    struct It(u8);
    impl futures_core::Stream for It {
        type Item = u8;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<u8>> {
            if self.0 == 0 {
                return std::task::Poll::Ready(None);
            }
            self.0 -= 1;
            std::task::Poll::Ready(Some(self.0))
        }
    }
    It(n)
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let server = Endpoint::builder()
            .service(Echo)
            .config(
                Config::default()
                    .max_message_size(1 << 16)
                    .handshake_timeout(Duration::from_secs(1)),
            )
            .build();
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let accept = tokio::spawn(async move { server.accept(a).await });
        let _ = b.write_all(data).await;
        let mut sink = vec![0u8; 1 << 16];
        // Drain answers for a while of (paused) time, then hang up.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Ok(n) = b.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        drop(b);
        let _ = accept.await;
    });
});
