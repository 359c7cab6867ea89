//! Unary, one-way and bidirectional calls; typed vs protocol errors; formats; auth.

use coherent_rpc::{Blob, Compression, Config, Endpoint, ErrorCode, Format, Identity};

use crate::support::*;

#[tokio::test]
async fn a_unary_call_returns_the_handlers_result() {
    let (calc, _, _) = calc_pair().await;
    assert_eq!(calc.sum(2, 40).await.unwrap(), 42);
    let user = calc.get_user(7).await.unwrap();
    assert_eq!(user.id, 7);
    assert_eq!(user.name, "user 7");
}

#[tokio::test]
async fn an_application_error_arrives_as_its_typed_value() {
    let (calc, _, _) = calc_pair().await;
    assert_eq!(calc.div(9, 3).await.unwrap(), Ok(3));
    assert_eq!(calc.div(9, 0).await.unwrap(), Err(DivError::ByZero));
}

#[tokio::test]
async fn many_concurrent_calls_share_one_connection() {
    let (calc, _, _) = calc_pair().await;
    let calls = (0..500).map(|i| {
        let calc = calc.clone();
        tokio::spawn(async move { calc.sum(i, i).await.unwrap() })
    });
    for (i, h) in calls.enumerate() {
        assert_eq!(h.await.unwrap(), 2 * i as i32);
    }
    assert_eq!(calc.caller().stats().calls_out, 500);
}

#[tokio::test]
async fn a_panicking_handler_becomes_an_internal_error_and_the_connection_lives_on() {
    let (calc, _, _) = calc_pair().await;
    let err = calc.panics().await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Internal);
    assert_eq!(calc.sum(1, 1).await.unwrap(), 2);
}

#[tokio::test]
async fn a_one_way_call_runs_without_a_reply() {
    let (calc, probe, _) = calc_pair().await;
    calc.record(5).await.unwrap();
    calc.record(6).await.unwrap();
    eventually("both one-way calls ran", || {
        probe.recorded.lock().len() == 2
    })
    .await;
    let mut got = calc.recorded().await.unwrap();
    got.sort();
    assert_eq!(got, vec![5, 6]);
}

#[tokio::test]
async fn the_server_can_call_services_the_client_exposes_on_the_same_connection() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder()
        .service(DoublerServer::new(DoublerImpl))
        .build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    assert_eq!(CalcClient::new(c).ask_back(20).await.unwrap(), 41);
}

#[tokio::test]
async fn a_server_side_peer_can_call_the_client_directly() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder()
        .service(DoublerServer::new(DoublerImpl))
        .build();
    let (_c, s) = pair(&server, &client).await.unwrap();
    assert_eq!(DoublerClient::new(s).double(21).await.unwrap(), 42);
}

#[tokio::test]
async fn messagepack_is_negotiated_when_the_client_asks_for_it() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder()
        .config(Config::default().format(Format::MessagePack))
        .build();
    let (c, s) = pair(&server, &client).await.unwrap();
    assert_eq!(s.format(), Format::MessagePack);
    let calc = CalcClient::new(c);
    assert_eq!(calc.get_user(3).await.unwrap().name, "user 3");
    assert_eq!(calc.div(1, 0).await.unwrap(), Err(DivError::ByZero));
}

#[tokio::test]
async fn blobs_of_every_size_round_trip_in_both_formats() {
    for format in [Format::Postcard, Format::MessagePack] {
        let (server, _) = calc_server(Config::default());
        let client = Endpoint::builder()
            .config(Config::default().format(format))
            .build();
        let (c, _s) = pair(&server, &client).await.unwrap();
        let calc = CalcClient::new(c);
        // Below and above the sizes from which a received blob shares its buffer (512)
        // and a sent one goes out from its own (32 KiB).
        for len in [0usize, 1, 511, 512, 32_767, 32_768, 100_000] {
            let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            let (n, back) = calc.echo_blob(Blob::from(data.clone())).await.unwrap();
            assert_eq!(n, len, "{format:?}");
            assert_eq!(&back[..], &data[..], "{format:?} {len}");
        }
    }
}

#[tokio::test]
async fn compressed_payloads_round_trip_with_lz4_and_zstd() {
    for c in [Compression::Lz4, Compression::Zstd] {
        let cfg = Config::default().compression(c, 64);
        let (server, _) = calc_server(cfg.clone());
        let client = Endpoint::builder().config(cfg).build();
        let (c, _s) = pair(&server, &client).await.unwrap();
        let calc = CalcClient::new(c);
        let text: Vec<u8> = b"coherent ".iter().copied().cycle().take(100_000).collect();
        assert_eq!(calc.echo(text.clone()).await.unwrap(), text);
        // A large blob is a part of its own in the message, compressed with the rest.
        let (n, back) = calc.echo_blob(Blob::from(text.clone())).await.unwrap();
        assert_eq!((n, &back[..]), (text.len(), &text[..]));
        // Compression shows in the bytes actually written.
        assert!(calc.caller().stats().bytes_out < 50_000);
    }
}

#[tokio::test]
async fn compression_falls_back_to_none_when_the_other_side_cannot_decode_it() {
    let (server, _) = calc_server(Config::default().decodes(coherent_rpc::CompressionSet::NONE));
    let client = Endpoint::builder()
        .config(Config::default().compression(Compression::Zstd, 16))
        .build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    let data = vec![0u8; 10_000];
    assert_eq!(CalcClient::new(c).echo(data.clone()).await.unwrap(), data);
}

#[tokio::test]
async fn the_authenticated_identity_is_visible_to_handlers() {
    let server = Endpoint::builder()
        .service(CalcServer::new(CalcImpl::default()))
        .authenticate(|token| async move {
            match token.strip_prefix("secret-") {
                Some(name) => Ok(Identity::new(name)),
                None => Err("bad token".to_owned()),
            }
        })
        .build();
    let client = Endpoint::builder().token("secret-alice").build();
    let (c, s) = pair(&server, &client).await.unwrap();
    assert_eq!(s.identity().map(|i| i.name()), Some("alice"));
    assert_eq!(
        CalcClient::new(c).whoami().await.unwrap().as_deref(),
        Some("alice")
    );
}

#[tokio::test]
async fn a_refused_token_fails_the_connect_with_unauthenticated() {
    let server = calc_server_accepting("good");
    let client = Endpoint::builder().token("bad").build();
    let err = pair(&server, &client).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Unauthenticated);
    assert!(err.message().contains("not known"), "{err}");
}

#[tokio::test]
async fn calls_after_close_fail_with_disconnected() {
    let (calc, _, server_side) = calc_pair().await;
    calc.caller().close();
    let err = calc.sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected);
    assert_eq!(server_side.closed().await.code(), ErrorCode::Disconnected);
}

#[tokio::test]
async fn calls_in_flight_fail_with_disconnected_when_the_server_goes_away() {
    let (calc, probe, server_side) = calc_pair().await;
    let call = tokio::spawn({
        let calc = calc.clone();
        async move { calc.wait_for_release().await }
    });
    eventually("the handler started", || {
        probe.started.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    server_side.close();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected);
}

/// A hand-written service whose handler future records, when dropped, whether it still
/// sees its call's context.
struct DropWatcher(std::sync::Arc<parking_lot::Mutex<Vec<Option<u64>>>>);

const WATCHED: &[coherent_rpc::MethodInfo] = &[
    coherent_rpc::MethodInfo {
        id: coherent_rpc::method_id("DropWatcher.answer"),
        name: "answer",
        kind: coherent_rpc::MethodKind::Unary,
    },
    coherent_rpc::MethodInfo {
        id: coherent_rpc::method_id("DropWatcher.panic"),
        name: "panic",
        kind: coherent_rpc::MethodKind::Unary,
    },
];

struct Watched {
    seen: std::sync::Arc<parking_lot::Mutex<Vec<Option<u64>>>>,
    format: Format,
    panics: bool,
}

impl std::future::Future for Watched {
    type Output = Result<coherent_rpc::Message, coherent_rpc::RpcError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        assert!(!self.panics, "this handler panics on purpose");
        std::task::Poll::Ready(self.format.encode_message(&42u32))
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let id = coherent_rpc::CallContext::current().map(|c| c.call_id());
        self.seen.lock().push(id);
    }
}

impl coherent_rpc::Service for DropWatcher {
    fn name(&self) -> &'static str {
        "DropWatcher"
    }
    fn methods(&self) -> &'static [coherent_rpc::MethodInfo] {
        WATCHED
    }
    fn call(&self, index: usize, _: bytes::Bytes, format: Format) -> coherent_rpc::Response {
        coherent_rpc::Response::Unary(Box::pin(Watched {
            seen: self.0.clone(),
            format,
            panics: index == 1,
        }))
    }
}

#[tokio::test]
async fn a_handler_that_answers_or_panics_at_once_is_dropped_inside_its_calls_context() {
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let server = Endpoint::builder()
        .service(DropWatcher(seen.clone()))
        .build();
    let (c, _s) = pair(&server, &Endpoint::builder().build()).await.unwrap();
    let id = coherent_rpc::method_id("DropWatcher.answer");
    let r: u32 = c.call(id, (), Default::default()).await.unwrap();
    assert_eq!(r, 42);
    let id = coherent_rpc::method_id("DropWatcher.panic");
    let e = c
        .call::<_, u32>(id, (), Default::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Internal, "{e}");
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter().all(Option::is_some),
        "a handler was dropped outside its call's context: {seen:?}"
    );
}

#[tokio::test]
async fn an_endpoint_counts_over_its_connections_closed_ones_included() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder().build();
    for round in 1..=3u64 {
        let (c, _s) = pair(&server, &client).await.unwrap();
        let calc = CalcClient::new(c.clone());
        assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
        assert_eq!(calc.sum(3, 4).await.unwrap(), 7);
        let live = client.stats();
        assert_eq!(live.connections_total, round);
        assert_eq!(live.totals.calls_out, 2 * round);
        c.close();
        drop((calc, c, _s));
    }
    // Every connection is closed and dropped: their counts stay in the totals.
    eventually("the connections to close", || {
        server.stats().connections_open == 0 && client.stats().connections_open == 0
    })
    .await;
    let (s, c) = (server.stats(), client.stats());
    assert_eq!((s.connections_total, c.connections_total), (3, 3));
    assert_eq!((s.totals.calls_in, c.totals.calls_out), (6, 6));
    assert!(c.totals.bytes_out > 0 && s.totals.bytes_in > c.totals.bytes_out);
}

/// A subscriber, set on this thread only, that records the names of the spans made and
/// takes events and spans up to `max`.
#[derive(Clone)]
struct SpanNames {
    max: tracing::Level,
    names: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl SpanNames {
    fn new(max: tracing::Level) -> Self {
        Self {
            max,
            names: std::sync::Arc::default(),
        }
    }

    fn names(&self) -> Vec<String> {
        self.names.lock().unwrap().clone()
    }

    /// Sets this subscriber as this thread's default while the guards live. Another
    /// dispatcher (taking up to info) is kept registered beside it: with one only,
    /// tracing-core takes a callsite's interest from the default of the first thread
    /// that uses it, which may be another test's thread with no subscriber (then
    /// `rpc.serve` would be "never" for the whole binary).
    fn listen(&self) -> (tracing::subscriber::DefaultGuard, tracing::Dispatch) {
        let other = tracing::Dispatch::new(SpanNames::new(tracing::Level::INFO));
        (tracing::subscriber::set_default(self.clone()), other)
    }
}

impl tracing::Subscriber for SpanNames {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        *meta.level() <= self.max
    }

    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut names = self.names.lock().unwrap();
        names.push(span.metadata().name().to_owned());
        tracing::span::Id::from_u64(names.len() as u64)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::from_level(self.max))
    }
}

/// The names of the spans made while a Calc server answers `calls` sums, under a
/// subscriber taking up to `max` on this thread. On a current-thread runtime (the tests'
/// own), the server's handlers run on this thread, under that subscriber.
async fn spans_of_served_calls(max: tracing::Level, calls: i32) -> Vec<String> {
    let spans = SpanNames::new(max);
    let _listening = spans.listen();
    let (calc, _, _) = calc_pair().await;
    for i in 0..calls {
        assert_eq!(calc.sum(i, 1).await.unwrap(), i + 1);
    }
    spans.names()
}

#[tokio::test]
async fn a_served_call_runs_in_an_rpc_serve_span_when_debug_is_taken() {
    let names = spans_of_served_calls(tracing::Level::DEBUG, 2).await;
    let served = names.iter().filter(|n| *n == "rpc.serve").count();
    assert_eq!(served, 2, "spans made: {names:?}");
}

// Run alone, this takes the branch that makes no span at all (every live subscriber stops
// at info); beside the test above, the span's own callsite is asked and says no: either
// way none is made.
#[tokio::test]
async fn no_span_is_made_for_a_served_call_when_debug_is_not_taken() {
    let names = spans_of_served_calls(tracing::Level::INFO, 1).await;
    assert!(
        !names.iter().any(|n| n == "rpc.serve"),
        "spans made: {names:?}"
    );
}
