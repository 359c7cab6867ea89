//! Coherent's counters through the [`metrics`] facade, so that whatever exporter the
//! application installs (Prometheus, StatsD, OpenTelemetry...) shows them.
//!
//! The counters themselves stay where they are cheap to keep (a registry counts hits on the
//! table stripes a hit touches anyway; a connection counts in its own atomics): nothing on
//! a call's path goes through the facade. An [`Observer`] reads them when asked —
//! [`Observer::record`] right before an exporter renders (a scrape), or every so often with
//! [`Observer::spawn`] — and sets the facade's counters and gauges to what it read.
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | `coherent_cache_hits_total` | counter | `registry` | calls answered from a consistent cached result (summed over the live services' tables: a dropped service's hits leave the sum) |
//! | `coherent_cache_misses_total` | counter | `registry` | calls that ran the method body |
//! | `coherent_cache_invalidations_total` | counter | `registry` | computeds invalidated, cascades included |
//! | `coherent_cache_evictions_total` | counter | `registry` | entries removed by pruning |
//! | `coherent_cache_entries` | gauge | `registry` | entries held now |
//! | `coherent_rpc_connections_open` | gauge | `endpoint` | connections open now |
//! | `coherent_rpc_connections_total` | counter | `endpoint` | connections made or accepted |
//! | `coherent_rpc_calls_out_total` | counter | `endpoint` | calls this side made |
//! | `coherent_rpc_calls_in_total` | counter | `endpoint` | calls the other sides made |
//! | `coherent_rpc_errors_in_total` | counter | `endpoint` | `Error` frames received |
//! | `coherent_rpc_bytes_out_total` | counter | `endpoint` | payload bytes written |
//! | `coherent_rpc_bytes_in_total` | counter | `endpoint` | bytes read |
//! | `coherent_rpc_calls_in_flight` | gauge | `endpoint` | calls from the other sides running now |
//! | `coherent_rpc_connections_refused_total` | counter | `endpoint` | connections refused at the endpoint's `max_connections` |
//! | `coherent_rpc_calls_refused_total` | counter | `endpoint` | calls answered `Overloaded` at once (`max_inbound_calls`, or the queue budget) |
//! | `coherent_rpc_connections_shed_total` | counter | `endpoint` | connections closed because the send queues went over the `queue_budget` |
//! | `coherent_rpc_accept_errors_total` | counter | `endpoint` | failed accepts on the endpoint's listeners |
//! | `coherent_rpc_origins_refused_total` | counter | `endpoint` | WebSocket upgrades refused for their `Origin` |
//! | `coherent_rpc_calls_paced_total` | counter | `endpoint` | calls of untrusted connections that waited for their rate (`untrusted_call_rate`, or their address's) |
//! | `coherent_rpc_queued_bytes` | gauge | `endpoint` | bytes queued for sending over all connections now |
//! | `coherent_rpc_queued_bytes_peak` | gauge | `endpoint` | the most bytes queued for sending at once |
//! | `coherent_remote_connections` | gauge | `server` | client connections holding replicas |
//! | `coherent_remote_replicas_held` | gauge | `server` | replicas the server watches for its clients |
//! | `coherent_remote_untrusted_replicas_held` | gauge | `server` | replicas the server watches for its untrusted clients together (what `max_untrusted_replicas` bounds) |
//! | `coherent_remote_replicas_refused_per_connection_total` | counter | `server` | replicas refused because their connection held as many as it may (`max_replicas_per_connection`, or `max_replicas_per_untrusted_connection`) |
//! | `coherent_remote_replicas_refused_untrusted_total` | counter | `server` | replicas refused to untrusted connections because they held `max_untrusted_replicas` together |
//! | `coherent_remote_pushes_total` | counter | `server` | invalidation messages pushed to clients |
//! | `coherent_remote_clients_closed_unresponsive_total` | counter | `server` | client connections closed for leaving pushes unanswered (past the delivery timeout, or too many at once) |
//! | `coherent_remote_waits_skipped_untrusted_total` | counter | `server` | untrusted connections behind on a write's invalidations that `invalidations_delivered` did not wait for |
//! | `coherent_remote_sse_feeds_open` | gauge | `server` | HTTP gateway event feeds open now |
//! | `coherent_remote_sse_feeds_refused_total` | counter | `server` | event feeds refused because the server's limit of open feeds was reached |
//! | `coherent_remote_sse_feeds_expired_total` | counter | `server` | event feeds the server ended because they were open for `max_sse_lifetime` |
//! | `coherent_remote_client_replicas` | gauge | `client` | replicas this client holds |
//! | `coherent_remote_client_connections_total` | counter | `client` | connections made (1 plus the reconnections) |
//! | `coherent_remote_client_leases_lost_total` | counter | `client` | renewals of the client's lease that came after it ran out (its registry answered nothing from its cache meanwhile) |
//! | `coherent_ops_commands_total` | counter | `host` | commands run on this host that committed |
//! | `coherent_ops_command_errors_total` | counter | `host` | commands run on this host that failed (rolled back, or their outcome unknown) |
//! | `coherent_ops_operations_applied_notified_total` | counter | `host` | operations of other hosts applied from a notification |
//! | `coherent_ops_operations_applied_from_log_total` | counter | `host` | operations of other hosts applied from a read of the log |
//! | `coherent_ops_operations_duplicate_total` | counter | `host` | operations that arrived again and were skipped |
//! | `coherent_ops_operations_unknown_total` | counter | `host` | operations whose command no handler on this host knows |
//! | `coherent_ops_operations_undecodable_total` | counter | `host` | operations whose logged command or output did not decode |
//! | `coherent_ops_replay_panics_total` | counter | `host` | replays of another host's invalidation that panicked (each flushed the cache) |
//! | `coherent_ops_notifications_implausible_total` | counter | `host` | notifications that did not decode or claimed an implausible position (each only woke the log reader) |
//! | `coherent_ops_messages_refused_total` | counter | `host` | messages of the notifier refused unread: not sealed under the cluster's key (a stranger writes on its channel, or a host of a release before seals runs) |
//! | `coherent_ops_log_reads_total` | counter | `host` | reads of the log |
//! | `coherent_ops_log_read_errors_total` | counter | `host` | reads of the log that failed |
//! | `coherent_ops_flushes_total` | counter | `host` | times the host invalidated its whole cache (it may have missed operations or changes) |
//! | `coherent_ops_change_hints_total` | counter | `host` | hints of database changes heard from the host that reads the change feed |
//! | `coherent_ops_change_hints_paired_total` | counter | `host` | hints, and operations of database changes, skipped because the other of the pair was applied |
//! | `coherent_ops_change_holds_total` | counter | `host` | times the host held its cache (every call read the database) for a flush the change feed owed, while a new slot waited |
//! | `coherent_ops_trimmed_total` | counter | `host` | operations this host deleted from the log |
//! | `coherent_ops_batches_total` | counter | `host` | transactions that committed this host's commands |
//! | `coherent_ops_batches_split_total` | counter | `host` | batches that failed and whose commands ran again one at a time |
//! | `coherent_ops_fused_total` | counter | `host` | commands sent as one statement with their operation's row |
//! | `coherent_ops_acks_received_total` | counter | `host` | acknowledgements of this host's operations from other hosts |
//! | `coherent_ops_ack_timeouts_total` | counter | `host` | commands that answered without every live host's acknowledgement (the wait ran out) |
//! | `coherent_ops_peers_left_total` | counter | `host` | hosts that said they stopped and were no longer waited for |
//! | `coherent_ops_fences_total` | counter | `host` | times the host fenced its registries (at start, and when its notifier dropped) |
//! | `coherent_ops_rejoins_incomplete_total` | counter | `host` | rejoins that lifted the fence without every live host's welcome |
//! | `coherent_ops_leases_lost_total` | counter | `host` | times the host's lease ran out (it was paused, or its pings stalled) |
//! | `coherent_ops_commits_retried_total` | counter | `host` | transactions that lost their connection before anything ran and ran again |
//! | `coherent_ops_lease_waits_total` | counter | `host` | commands that waited out a lease for a host they did not wait for |
//! | `coherent_ops_log_waits_total` | counter | `host` | commands whose notice did not go out, that waited for the other hosts to read the log past them |
//! | `coherent_ops_log_wait_timeouts_total` | counter | `host` | of those, the ones that answered before every live host had read that far |
//! | `coherent_ops_notices_dropped_total` | counter | `host` | notices not sent with their operation (the notifying queue full, or too large) |
//! | `coherent_ops_notices_skipped_total` | counter | `host` | notices not sent because the host knew no other live host |
//! | `coherent_ops_acks_dropped_total` | counter | `host` | acknowledgements not sent (the notifying queue full) |
//! | `coherent_ops_peers` | gauge | `host` | other live hosts that commands wait for now |
//! | `coherent_ops_acks_waiting` | gauge | `host` | this host's commands waiting for acknowledgements now |
//! | `coherent_ops_horizon` | gauge | `host` | the log position before which everything is applied on this host |
//! | `coherent_ops_notify_queued` | gauge | `host` | notices and acknowledgements waiting for the notifying task now |
//! | `coherent_ops_fenced` | gauge | `host` | 1 while the host answers nothing from its cache (fenced: rejoining, or past its lease), else 0 |
//! | `coherent_ops_notifier_connected` | gauge | `host` | 1 while the host's notifier is connected, else 0 |
//! | `coherent_ops_feed_leading` | gauge | `host` | 1 while this host runs the change feed (reads the slot), else 0 |
//! | `coherent_ops_feed_streaming` | gauge | `host` | 1 while the slot is streamed over a replication connection, else 0 |
//! | `coherent_ops_feed_reads_total` | counter | `host` | reads of the change feed's slot (streamed: starts and batches) |
//! | `coherent_ops_feed_transactions_total` | counter | `host` | database transactions whose changes the feed logged |
//! | `coherent_ops_feed_transactions_skipped_total` | counter | `host` | transactions skipped because they also wrote a command's operation |
//! | `coherent_ops_feed_rows_total` | counter | `host` | rows logged as changed |
//! | `coherent_ops_feed_tables_total` | counter | `host` | tables logged as changed as a whole (TRUNCATE, or past the row cap) |
//! | `coherent_ops_feed_operations_total` | counter | `host` | coherent.db_changes operations the feed logged |
//! | `coherent_ops_feed_slots_created_total` | counter | `host` | times the slot was created or triggers were missing (each flushed every host) |
//! | `coherent_ops_feed_errors_total` | counter | `host` | reads or logs of the feed that failed (read again) |
//! | `coherent_ops_feed_undecodable_total` | counter | `host` | messages of the stream that did not decode |
//!
//! ```
//! use coherent::metrics::Observer;
//! use coherent::Registry;
//!
//! let observer = Observer::new().registry("default", Registry::global());
//! // Before an exporter renders (e.g. in the handler of `GET /metrics`):
//! observer.record();
//! ```

use std::sync::Arc;
use std::time::Duration;

use coherent_core::Registry;

type Source = Arc<dyn Fn() + Send + Sync>;

/// Reads the counters of the registries, endpoints, remote servers and clients, and ops
/// hosts it was given, and reports them through the [`metrics`] facade (see the [module](self) docs).
///
/// It holds a clone of each: a `RemoteClient` given to it stays open (and a server's
/// exposed services stay alive) as long as the observer does.
#[derive(Clone, Default)]
pub struct Observer {
    sources: Vec<Source>,
}

impl Observer {
    /// An observer of nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn with(mut self, source: Source) -> Self {
        self.sources.push(source);
        self
    }

    /// Reports `registry`'s cache counters labelled `registry = name`.
    pub fn registry(self, name: &str, registry: &Registry) -> Self {
        let (registry, name) = (registry.clone(), name.to_owned());
        self.with(Arc::new(move || {
            let m = registry.metrics();
            let label = [("registry", name.clone())];
            metrics::counter!("coherent_cache_hits_total", &label).absolute(m.hits);
            metrics::counter!("coherent_cache_misses_total", &label).absolute(m.misses);
            metrics::counter!("coherent_cache_invalidations_total", &label)
                .absolute(m.invalidations);
            metrics::counter!("coherent_cache_evictions_total", &label).absolute(m.evictions);
            metrics::gauge!("coherent_cache_entries", &label).set(m.entries as f64);
        }))
    }

    /// Reports `endpoint`'s connection and call counters labelled `endpoint = name`.
    #[cfg(feature = "rpc")]
    pub fn endpoint(self, name: &str, endpoint: &coherent_rpc::Endpoint) -> Self {
        let (endpoint, name) = (endpoint.clone(), name.to_owned());
        self.with(Arc::new(move || {
            let s = endpoint.stats();
            let t = s.totals;
            let label = [("endpoint", name.clone())];
            metrics::gauge!("coherent_rpc_connections_open", &label).set(s.connections_open as f64);
            metrics::counter!("coherent_rpc_connections_total", &label)
                .absolute(s.connections_total);
            metrics::counter!("coherent_rpc_calls_out_total", &label).absolute(t.calls_out);
            metrics::counter!("coherent_rpc_calls_in_total", &label).absolute(t.calls_in);
            metrics::counter!("coherent_rpc_errors_in_total", &label).absolute(t.errors_in);
            metrics::counter!("coherent_rpc_bytes_out_total", &label).absolute(t.bytes_out);
            metrics::counter!("coherent_rpc_bytes_in_total", &label).absolute(t.bytes_in);
            metrics::gauge!("coherent_rpc_calls_in_flight", &label).set(t.in_flight_in as f64);
            metrics::counter!("coherent_rpc_connections_refused_total", &label)
                .absolute(s.connections_refused);
            metrics::counter!("coherent_rpc_calls_refused_total", &label).absolute(s.calls_refused);
            metrics::counter!("coherent_rpc_connections_shed_total", &label)
                .absolute(s.connections_shed);
            metrics::counter!("coherent_rpc_accept_errors_total", &label).absolute(s.accept_errors);
            metrics::counter!("coherent_rpc_origins_refused_total", &label)
                .absolute(s.origins_refused);
            metrics::counter!("coherent_rpc_calls_paced_total", &label).absolute(s.calls_paced);
            metrics::gauge!("coherent_rpc_queued_bytes", &label).set(s.queued_bytes as f64);
            metrics::gauge!("coherent_rpc_queued_bytes_peak", &label)
                .set(s.queued_bytes_peak as f64);
        }))
    }

    /// Reports the replicas that `server` holds for its clients (and for the untrusted ones,
    /// and those it refused), its pushes and the clients it closed or did not wait for, and
    /// its gateway's event feeds, labelled `server = name`.
    #[cfg(feature = "remote")]
    pub fn remote_server(self, name: &str, server: &coherent_remote::RemoteServer) -> Self {
        let (server, name) = (server.clone(), name.to_owned());
        self.with(Arc::new(move || {
            let s = server.stats();
            let label = [("server", name.clone())];
            metrics::gauge!("coherent_remote_connections", &label).set(s.connections as f64);
            metrics::gauge!("coherent_remote_replicas_held", &label).set(s.replicas_held as f64);
            metrics::gauge!("coherent_remote_untrusted_replicas_held", &label)
                .set(s.untrusted_replicas_held as f64);
            metrics::counter!(
                "coherent_remote_replicas_refused_per_connection_total",
                &label
            )
            .absolute(s.replicas_refused_per_connection);
            metrics::counter!("coherent_remote_replicas_refused_untrusted_total", &label)
                .absolute(s.replicas_refused_untrusted_total);
            metrics::counter!("coherent_remote_pushes_total", &label).absolute(s.pushes);
            metrics::counter!("coherent_remote_clients_closed_unresponsive_total", &label)
                .absolute(s.clients_closed_unresponsive);
            metrics::counter!("coherent_remote_waits_skipped_untrusted_total", &label)
                .absolute(s.waits_skipped_untrusted);
            metrics::gauge!("coherent_remote_sse_feeds_open", &label).set(s.sse_feeds_open as f64);
            metrics::counter!("coherent_remote_sse_feeds_refused_total", &label)
                .absolute(s.sse_feeds_refused);
            metrics::counter!("coherent_remote_sse_feeds_expired_total", &label)
                .absolute(s.sse_feeds_expired);
        }))
    }

    /// Reports the replicas `client` holds and its connections, labelled `client = name`.
    #[cfg(feature = "remote")]
    pub fn remote_client(self, name: &str, client: &coherent_remote::RemoteClient) -> Self {
        let (client, name) = (client.clone(), name.to_owned());
        self.with(Arc::new(move || {
            let label = [("client", name.clone())];
            metrics::gauge!("coherent_remote_client_replicas", &label)
                .set(client.replica_count() as f64);
            metrics::counter!("coherent_remote_client_connections_total", &label)
                .absolute(client.connections());
            metrics::counter!("coherent_remote_client_leases_lost_total", &label)
                .absolute(client.leases_lost());
        }))
    }

    /// Reports `host`'s counters (commands, operations applied, log reads, flushes,
    /// acknowledgements, fences, leases...), its gauges (peers waited for, commands waiting
    /// for acknowledgements, the horizon, whether it is fenced and its notifier connected)
    /// and, when it runs a change feed, the feed's, labelled `host = name`. Its registries
    /// are reported with [`registry`](Self::registry).
    #[cfg(feature = "ops")]
    pub fn host(self, name: &str, host: &coherent_ops::Host) -> Self {
        let (host, name) = (host.clone(), name.to_owned());
        self.with(Arc::new(move || {
            let s = host.stats();
            let label = [("host", name.clone())];
            let counters = [
                ("coherent_ops_commands_total", s.commands),
                ("coherent_ops_command_errors_total", s.command_errors),
                (
                    "coherent_ops_operations_applied_notified_total",
                    s.applied_notified,
                ),
                (
                    "coherent_ops_operations_applied_from_log_total",
                    s.applied_from_log,
                ),
                ("coherent_ops_operations_duplicate_total", s.duplicates),
                ("coherent_ops_operations_unknown_total", s.unknown),
                ("coherent_ops_operations_undecodable_total", s.undecodable),
                ("coherent_ops_replay_panics_total", s.replay_panics),
                (
                    "coherent_ops_notifications_implausible_total",
                    s.implausible,
                ),
                ("coherent_ops_messages_refused_total", s.messages_refused),
                ("coherent_ops_log_reads_total", s.rounds),
                ("coherent_ops_log_read_errors_total", s.round_errors),
                ("coherent_ops_flushes_total", s.flushes),
                ("coherent_ops_change_hints_total", s.change_hints),
                (
                    "coherent_ops_change_hints_paired_total",
                    s.change_hints_paired,
                ),
                ("coherent_ops_change_holds_total", s.change_holds),
                ("coherent_ops_trimmed_total", s.trimmed),
                ("coherent_ops_batches_total", s.batches),
                ("coherent_ops_batches_split_total", s.batches_split),
                ("coherent_ops_fused_total", s.fused),
                ("coherent_ops_acks_received_total", s.acks_received),
                ("coherent_ops_ack_timeouts_total", s.ack_timeouts),
                ("coherent_ops_peers_left_total", s.peers_left),
                ("coherent_ops_fences_total", s.fences),
                (
                    "coherent_ops_rejoins_incomplete_total",
                    s.rejoins_incomplete,
                ),
                ("coherent_ops_leases_lost_total", s.leases_lost),
                ("coherent_ops_commits_retried_total", s.commits_retried),
                ("coherent_ops_lease_waits_total", s.lease_waits),
                ("coherent_ops_log_waits_total", s.log_waits),
                ("coherent_ops_log_wait_timeouts_total", s.log_wait_timeouts),
                ("coherent_ops_notices_dropped_total", s.notices_dropped),
                ("coherent_ops_notices_skipped_total", s.notices_skipped),
                ("coherent_ops_acks_dropped_total", s.acks_dropped),
            ];
            for (metric, value) in counters {
                metrics::counter!(metric, &label).absolute(value);
            }
            let flag = |on: bool| f64::from(u8::from(on));
            let gauges = [
                ("coherent_ops_peers", s.peers as f64),
                ("coherent_ops_acks_waiting", s.acks_waiting as f64),
                ("coherent_ops_horizon", s.horizon as f64),
                ("coherent_ops_notify_queued", s.notify_queued as f64),
                ("coherent_ops_fenced", flag(host.is_fenced())),
                (
                    "coherent_ops_notifier_connected",
                    flag(host.notifier_connected()),
                ),
            ];
            for (metric, value) in gauges {
                metrics::gauge!(metric, &label).set(value);
            }
            if let Some(f) = host.feed_stats() {
                metrics::gauge!("coherent_ops_feed_leading", &label).set(flag(f.leading));
                metrics::gauge!("coherent_ops_feed_streaming", &label).set(flag(f.streaming));
                let counters = [
                    ("coherent_ops_feed_reads_total", f.reads),
                    ("coherent_ops_feed_transactions_total", f.transactions),
                    (
                        "coherent_ops_feed_transactions_skipped_total",
                        f.skipped_commands,
                    ),
                    ("coherent_ops_feed_rows_total", f.rows),
                    ("coherent_ops_feed_tables_total", f.tables),
                    ("coherent_ops_feed_operations_total", f.operations),
                    ("coherent_ops_feed_slots_created_total", f.slots_created),
                    ("coherent_ops_feed_errors_total", f.errors),
                    ("coherent_ops_feed_undecodable_total", f.undecodable),
                ];
                for (metric, value) in counters {
                    metrics::counter!(metric, &label).absolute(value);
                }
            }
        }))
    }

    /// Also runs `read` at each [`record`](Self::record): the application's own counts (an
    /// HTTP server's refusals, a queue's depth), reported through the facade with Coherent's
    /// and at the same moment.
    pub fn source(self, read: impl Fn() + Send + Sync + 'static) -> Self {
        self.with(Arc::new(read))
    }

    /// Reads every source now and sets the facade's metrics to what it read.
    pub fn record(&self) {
        for source in self.sources.iter() {
            source();
        }
    }

    /// Records every `period` on a task of the current tokio runtime (for exporters that
    /// push rather than render on request), until the handle is aborted.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn spawn(self, period: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                self.record();
            }
        })
    }
}
