//! A command answers after every other live host has applied it (their
//! acknowledgements): a read that starts on any host after the answer sees the write,
//! without waiting or catching up. A host that does not acknowledge is waited for once.

use std::time::Duration;

use coherent_ops::{Database, HostBuilder, Notifier};

use crate::inproc::{nats_url, postgres_db, wait_until};
use crate::support::{host, BlackHole, SetValue};

/// Long enough never to run out in a test, however loaded the machine: the test checks
/// what the answer promises, not how fast it comes.
const PATIENT: Duration = Duration::from_secs(60);

async fn every_host_has_applied_a_command_when_it_answers(
    db: Database,
    notifier: impl Fn(HostBuilder) -> HostBuilder,
) {
    let configure = |b: HostBuilder| notifier(b).acknowledgements(Some(PATIENT));
    let (a, _) = host(&db, &configure).await;
    let (b, items_b) = host(&db, &configure).await;
    let (c, items_c) = host(&db, &configure).await;
    // Each learns of the others by their rows, read when it started and every second, or
    // by hearing from them: until A knows both, it does not wait for both. And a host
    // hears notices and acknowledgements once its listener is connected (`start` does not
    // wait for it): one sent before is read from the log, an acknowledgement is lost.
    wait_until(|| a.stats().peers >= 2 && [&a, &b, &c].iter().all(|h| h.notifier_connected()))
        .await;
    for id in 1..=3 {
        assert_eq!(items_b.value(id).await, Ok(0));
        assert_eq!(items_c.value(id).await, Ok(0));
    }
    for round in 1..=30 {
        let id = 1 + round % 3;
        a.run(SetValue { id, value: round }).await.unwrap();
        // No catch-up, no wait: B and C applied it before A answered.
        assert_eq!(items_b.value(id).await, Ok(round), "B, round {round}");
        assert_eq!(items_c.value(id).await, Ok(round), "C, round {round}");
    }
    let stats = a.stats();
    assert_eq!(stats.ack_timeouts, 0);
    assert!(stats.acks_received >= 60, "{stats:?}");
    a.stop().await;
    b.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_every_host_has_applied_a_command_when_it_answers() {
    let Some(db) = postgres_db("acks").await else {
        return;
    };
    every_host_has_applied_a_command_when_it_answers(db, |b| b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_every_host_has_applied_a_command_when_it_answers_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("acks_nats").await else {
        return;
    };
    every_host_has_applied_a_command_when_it_answers(db, move |b| {
        b.notifier(Notifier::Nats(url.clone()))
    })
    .await;
}

/// A host whose row says it is alive but that never answers (it died without leaving):
/// the first command waits out the timeout and answers; the next ones do not wait for it.
/// A host that answers is waited for again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_silent_host_is_waited_for_once() {
    let Some(db) = postgres_db("acks_silent").await else {
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    db.postgres_pool()
        .unwrap()
        .get()
        .await
        .unwrap()
        .execute(
            "INSERT INTO coherent_hosts (host, horizon, seen_at) VALUES ('ghost', 0, $1)",
            &[&now],
        )
        .await
        .unwrap();
    let short = |b: HostBuilder| b.acknowledgements(Some(Duration::from_millis(200)));
    let (a, items_a) = host(&db, short).await;
    wait_until(|| a.notifier_connected()).await;
    assert_eq!(a.stats().peers, 1, "the ghost's row is fresh");
    a.run(SetValue { id: 1, value: 1 }).await.unwrap();
    assert_eq!(items_a.value(1).await, Ok(1));
    assert_eq!(a.stats().ack_timeouts, 1);
    assert_eq!(a.stats().peers, 0, "the ghost is no longer waited for");
    for value in 2..=5 {
        a.run(SetValue { id: 1, value }).await.unwrap();
    }
    assert_eq!(a.stats().ack_timeouts, 1, "waited for once");
    // But not forgotten while its row is fresh: each command answered a lease after its
    // notice went out (were the ghost alive and slow, its cache has lapsed by then).
    assert_eq!(a.stats().lease_waits, 4);

    // A live host is waited for once heard from (its acknowledgement of one of A's
    // commands, or its row). (Whether it then answers within A's short wait depends on
    // the machine's load: the first test checks what an answer in time promises.)
    let (b, _) = host(&db, |b| b.acknowledgements(Some(PATIENT))).await;
    while a.stats().peers < 1 {
        a.run(SetValue { id: 2, value: 0 }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.stop().await;
    b.stop().await;
}

/// Notices that queue while a host waits out its `notify_interval` go out together in one
/// `NOTIFY` transaction, and each still reaches the other host by notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_notices_sent_together_all_arrive() {
    let Some(db) = postgres_db("notify_interval").await else {
        return;
    };
    let (a, _) = host(&db, |b| {
        b.notify_interval(Duration::from_millis(300))
            .acknowledgements(None)
    })
    .await;
    // B reads the log only when woken: a poll must not apply them first. Its listener
    // must be up before A notifies (a notice sent before is read from the log).
    let (b, items_b) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    wait_until(|| b.notifier_connected()).await;
    for id in 1..=10 {
        assert_eq!(items_b.value(id).await, Ok(0));
    }
    let runs: Vec<_> = (1..=10)
        .map(|id| {
            let a = a.clone();
            tokio::spawn(async move { a.run(SetValue { id, value: 40 + id }).await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    // No catch-up and no poll: the notices must come. (B reads the log once after its
    // listener connects, to catch what it missed meanwhile; on a loaded machine that read
    // may run late and find some of these first. Lost notices would never arrive.)
    wait_until(|| b.stats().applied_notified + b.stats().applied_from_log >= 10).await;
    assert!(b.stats().applied_notified >= 1);
    for id in 1..=10 {
        assert_eq!(items_b.value(id).await, Ok(40 + id), "B, item {id}");
    }
    a.stop().await;
    b.stop().await;
}

/// A host that stops says so: the others stop waiting for it at once (not after a
/// timeout, nor at their next read of the hosts table).
async fn a_stopped_host_is_not_waited_for(
    db: Database,
    notifier: impl Fn(HostBuilder) -> HostBuilder,
) {
    let configure = |b: HostBuilder| notifier(b).acknowledgements(Some(PATIENT));
    let (a, items_a) = host(&db, &configure).await;
    let (b, _) = host(&db, &configure).await;
    wait_until(|| a.stats().peers >= 1).await;
    a.run(SetValue { id: 1, value: 1 }).await.unwrap();
    b.stop().await;
    wait_until(|| a.stats().peers_left >= 1).await;
    assert_eq!(a.stats().peers, 0);
    // Would wait out PATIENT if B were still waited for.
    a.run(SetValue { id: 1, value: 2 }).await.unwrap();
    assert_eq!(items_a.value(1).await, Ok(2));
    assert_eq!(a.stats().ack_timeouts, 0);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stopped_host_is_not_waited_for() {
    let Some(db) = postgres_db("acks_bye").await else {
        return;
    };
    a_stopped_host_is_not_waited_for(db, |b| b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stopped_host_is_not_waited_for_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("acks_bye_nats").await else {
        return;
    };
    a_stopped_host_is_not_waited_for(db, move |b| b.notifier(Notifier::Nats(url.clone()))).await;
}

/// A notice that waits in its host's queue longer than the acknowledgement deadline
/// (here its `notify_interval`; under load, a `NOTIFY` behind others, or one that failed
/// and is sent again): the deadline counts from when the notice went out, not from the
/// commit. Counted from the commit, the command answered while B still had the notice to
/// come, and B served its old value under a lease its own pings kept valid (the checker
/// found it under load: issue 30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_notice_held_in_its_queue_is_waited_for() {
    let Some(db) = postgres_db("acks_late_notice").await else {
        return;
    };
    // A's notices go out at most every 1.5 s; it waits 500 ms for acknowledgements.
    let (a, _) = host(&db, |b| {
        b.notify_interval(Duration::from_millis(1500))
            .acknowledgements(Some(Duration::from_millis(500)))
    })
    .await;
    // B reads the log only when woken: only A's notice tells it.
    let (b, items_b) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    wait_until(|| {
        a.stats().peers >= 1
            && a.notifier_connected()
            && b.notifier_connected()
            && !a.is_fenced()
            && !b.is_fenced()
    })
    .await;
    for value in 1..=3 {
        assert_eq!(items_b.value(1).await, Ok(value - 1));
        a.run(SetValue { id: 1, value }).await.unwrap();
        assert_eq!(items_b.value(1).await, Ok(value), "B, write {value}");
    }
    assert_eq!(a.stats().ack_timeouts, 0);
    a.stop().await;
    b.stop().await;
}

/// A host whose heartbeats stall (its row locked here: a slow database, a lost
/// connection) while its notifier works: the other hosts stop waiting for it once its row
/// is older than the liveness window (5 s), so it must stop answering from its cache
/// before that, though its pings still come back and renew its lease; and answer from it
/// again once its heartbeats go through and it has greeted the others again (a review
/// found it served again while A did not yet wait for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_whose_heartbeats_stall_stops_answering_from_its_cache() {
    let Some(db) = postgres_db("acks_beat_stall").await else {
        return;
    };
    let (a, _) = host(&db, |b| b).await;
    let (b, items_b) = host(&db, |b| b).await;
    let registry = items_b.handle.registry().clone();
    wait_until(|| {
        a.stats().peers >= 1 && b.notifier_connected() && !b.is_fenced() && !registry.is_fenced()
    })
    .await;
    let pool = db.postgres_pool().unwrap().clone();
    let mut locker = pool.get().await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM coherent_hosts WHERE host = $1 FOR UPDATE",
        &[&b.id()],
    )
    .await
    .unwrap();
    // A drops B once B's row is 5 s old (by the database's clock); B must be fenced by
    // then (its lease stops at 3 s after its last heartbeat began).
    wait_until(|| {
        let dropped = a.stats().peers == 0;
        assert!(
            !dropped || registry.is_fenced(),
            "A stopped waiting for B while B answers from its cache"
        );
        dropped
    })
    .await;
    assert!(b.notifier_connected());
    tx.rollback().await.unwrap();
    // B answers from its cache again only after it greeted A again: A waits for it by
    // then (it heard B's hello), not only from its next read of the hosts table.
    wait_until(|| {
        let serving = !registry.is_fenced();
        assert!(
            !serving || a.stats().peers >= 1,
            "B answers from its cache while A does not wait for it"
        );
        serving
    })
    .await;
    a.stop().await;
    b.stop().await;
}

/// A notice that does not go out (the writer's NATS connection black-holed, the other
/// host's fine): no host hears of the operation but from the log, and the other host's
/// lease (its own pings come back) says nothing about it. The command answers once the
/// other host has read the log past it (its heartbeat says so), not once the writer gave
/// up sending (it answered then, and the other host served its old value until its next
/// read of the log: issue 30, `SEND_GIVE_UP`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_notice_that_does_not_go_out_is_waited_for_through_the_log_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("acks_not_out").await else {
        return;
    };
    let nats: std::net::SocketAddr = url.trim_start_matches("nats://").parse().unwrap();
    let link = BlackHole::start(nats).await;
    // A gives up on a notice after 500 ms (its echo wait, 2 s, comes first).
    let (a, _) = host(&db, |b| {
        b.notifier(Notifier::Nats(format!("nats://{}", link.addr)))
            .notice_give_up(Duration::from_millis(500))
            .acknowledgements(Some(Duration::from_millis(500)))
    })
    .await;
    // B reads the log every 10 s; a notice would tell it sooner.
    let (b, items_b) = host(&db, |b| {
        b.notifier(Notifier::Nats(url.clone()))
            .poll_interval(Duration::from_secs(10))
    })
    .await;
    wait_until(|| {
        a.stats().peers >= 1 && a.notifier_connected() && b.notifier_connected() && !b.is_fenced()
    })
    .await;
    assert_eq!(items_b.value(1).await, Ok(0));
    link.black_hole();
    for value in 1..=2 {
        a.run(SetValue { id: 1, value }).await.unwrap();
        assert_eq!(items_b.value(1).await, Ok(value), "B, write {value}");
    }
    let stats = a.stats();
    assert!(stats.log_waits >= 2, "{stats:?}");
    assert_eq!(stats.log_wait_timeouts, 0, "{stats:?}");
    b.stop().await;
    drop(a);
}

/// A host that knows no other live host sends no notices (no `NOTIFY`, no NATS message:
/// nobody would read them). A host that joins while it writes misses none of its
/// operations: it is fenced (it answers from the database) until the lone host has
/// welcomed it, and the welcome comes after every notice that host skipped, each of whose
/// operations committed before it, so that the joiner's read of the log has them; from
/// then on the first host notifies it and waits for it, as for any peer.
async fn a_host_alone_skips_its_notices_and_a_joining_host_misses_nothing(
    db: Database,
    notifier: impl Fn(HostBuilder) -> HostBuilder,
) {
    let configure = |b: HostBuilder| notifier(b).acknowledgements(Some(PATIENT));
    let (a, items_a) = host(&db, &configure).await;
    wait_until(|| a.notifier_connected()).await;
    for value in 1..=10 {
        a.run(SetValue { id: 1, value }).await.unwrap();
    }
    assert_eq!(items_a.value(1).await, Ok(10));
    let alone = a.stats();
    assert_eq!(alone.peers, 0);
    assert_eq!(alone.notices_skipped, 10, "{alone:?}");

    // A writes on while B joins.
    let a = std::sync::Arc::new(a);
    let writing = tokio::spawn({
        let a = a.clone();
        async move {
            for value in 1..=300 {
                a.run(SetValue { id: 2, value }).await.unwrap();
            }
        }
    });
    let (b, items_b) = host(&db, &configure).await;
    // Fenced or not, B never answers a value older than the last one A answered.
    wait_until(|| !b.is_fenced()).await;
    wait_until(|| a.stats().peers == 1).await;
    for round in 1..=30 {
        a.run(SetValue {
            id: 3,
            value: round,
        })
        .await
        .unwrap();
        assert_eq!(items_b.value(3).await, Ok(round), "B, round {round}");
        assert_eq!(items_b.value(1).await, Ok(10), "a skipped notice's write");
    }
    writing.await.unwrap();
    assert_eq!(
        items_b.value(2).await,
        Ok(300),
        "the writes made while B joined"
    );
    let joined = a.stats();
    assert!(
        joined.notices_skipped < alone.notices_skipped + 300,
        "A notified B once it knew it: {joined:?}"
    );
    assert_eq!(joined.ack_timeouts, 0);
    b.stop().await;
    // Alone again once B said goodbye.
    wait_until(|| a.stats().peers == 0).await;
    let before = a.stats().notices_skipped;
    a.run(SetValue { id: 1, value: 11 }).await.unwrap();
    assert_eq!(a.stats().notices_skipped, before + 1);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_alone_skips_its_notices_and_a_joining_host_misses_nothing() {
    let Some(db) = postgres_db("alone").await else {
        return;
    };
    a_host_alone_skips_its_notices_and_a_joining_host_misses_nothing(db, |b| b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_alone_skips_its_notices_and_a_joining_host_misses_nothing_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("alone_nats").await else {
        return;
    };
    a_host_alone_skips_its_notices_and_a_joining_host_misses_nothing(db, move |b| {
        b.notifier(Notifier::Nats(url.clone()))
    })
    .await;
}

/// Anyone who can connect to the database may `NOTIFY` on a host's acknowledgement channel
/// (on NATS, publish on its subject). A stranger's acknowledgement in another host's name,
/// or its farewell, carries no seal under the cluster's key: it is refused, and the
/// command still waits for that host to apply its operation (here, for B's
/// `after_invalidate`, held closed until the forgeries were refused).
async fn a_forged_acknowledgement_does_not_end_a_commands_wait<F, Fut>(
    db: Database,
    notifier: impl Fn(HostBuilder) -> HostBuilder,
    forge: F,
) where
    F: Fn(String, String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (open, opened) = tokio::sync::watch::channel(false);
    let (a, _) = host(&db, |b| notifier(b).acknowledgements(Some(PATIENT))).await;
    let (b, items_b) = host(&db, |b| {
        notifier(b)
            .acknowledgements(Some(PATIENT))
            .after_invalidate(move || {
                let mut opened = opened.clone();
                async move {
                    let _ = opened.wait_for(|&o| o).await;
                }
            })
    })
    .await;
    wait_until(|| a.stats().peers >= 1 && a.notifier_connected() && b.notifier_connected()).await;
    assert_eq!(items_b.value(1).await, Ok(0));

    let command = tokio::spawn({
        let a = a.clone();
        async move { a.run(SetValue { id: 1, value: 7 }).await }
    });
    // B applied it, and holds its acknowledgement.
    wait_until(|| {
        let s = b.stats();
        s.applied_notified + s.applied_from_log >= 1
    })
    .await;
    let id: i64 = db
        .postgres_pool()
        .unwrap()
        .get()
        .await
        .unwrap()
        .query_one("SELECT max(id) FROM coherent_operations", &[])
        .await
        .unwrap()
        .get(0);
    let to = a.acknowledgement_channel().unwrap();
    let from = serde_json::to_string(b.id()).unwrap();
    forge(to.clone(), format!(r#"{{"from":{from},"ids":[{id}]}}"#)).await;
    forge(to.clone(), format!(r#"{{"from":{from},"bye":true}}"#)).await;
    // And one whose seal does not check out.
    forge(
        to.clone(),
        format!(r#"{{"from":{from},"ids":[{id}],"mac":"00000000000000000000000000000000"}}"#),
    )
    .await;
    wait_until(|| a.stats().messages_refused >= 3).await;
    assert!(
        !command.is_finished(),
        "the command returned on a forged acknowledgement, before B applied its operation"
    );
    assert_eq!(a.stats().peers, 1, "a forged farewell made A forget B");

    open.send_replace(true);
    command.await.unwrap().unwrap();
    let s = a.stats();
    assert!(s.acks_received >= 1, "{s:?}");
    assert_eq!(s.ack_timeouts, 0, "{s:?}");
    assert_eq!(b.stats().messages_refused, 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_forged_acknowledgement_does_not_end_a_commands_wait() {
    let Some(db) = postgres_db("acks_forged").await else {
        return;
    };
    let stranger =
        crate::support::connect_in_schema(&crate::support::database_url().unwrap(), "public").await;
    let stranger = &stranger;
    a_forged_acknowledgement_does_not_end_a_commands_wait(
        db,
        |b| b,
        |channel, payload| async move {
            stranger
                .execute("SELECT pg_notify($1, $2)", &[&channel, &payload])
                .await
                .unwrap();
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_forged_acknowledgement_does_not_end_a_commands_wait_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("acks_forged_nats").await else {
        return;
    };
    let stranger = async_nats::connect(url.as_str()).await.unwrap();
    let stranger = &stranger;
    a_forged_acknowledgement_does_not_end_a_commands_wait(
        db,
        move |b| b.notifier(Notifier::Nats(url.clone())),
        |subject, payload| async move {
            stranger.publish(subject, payload.into()).await.unwrap();
            stranger.flush().await.unwrap();
        },
    )
    .await;
}

/// A message sealed as the cluster's hosts seal theirs: the key from `coherent_secrets`
/// (whoever can read it is the cluster), HMAC-SHA-256 of a context string and the JSON,
/// its first 16 bytes in hex as a last field.
fn sealed(key: &str, json: &str) -> String {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).unwrap();
    mac.update(b"coherent-ops seal v1\0");
    mac.update(json.as_bytes());
    let tag = mac.finalize().into_bytes();
    let hex: String = tag[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{},\"mac\":\"{hex}\"}}", &json[..json.len() - 1])
}

/// A welcome counts only in the rejoin whose hello it answers: one sent before (anyone
/// may listen on the channels and keep what it heard) cannot end a later rejoin. Here B
/// waits for a host that never answers ('ghost', whose row stays fresh); a welcome in the
/// ghost's name, sealed under the cluster's key but of another round, does not lift B's
/// fence: B gives up on the ghost after the rejoin's time, as on any host that does not
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_welcome_of_another_rejoin_does_not_count() {
    let Some(db) = postgres_db("acks_welcome_round").await else {
        return;
    };
    let client = db.postgres_pool().unwrap().get().await.unwrap();
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
        + 600_000_000;
    client
        .execute(
            "INSERT INTO coherent_hosts (host, horizon, seen_at) VALUES ('ghost', 0, $1)",
            &[&later],
        )
        .await
        .unwrap();
    let key: String = client
        .query_one(
            "SELECT value FROM coherent_secrets WHERE name = 'seal'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (b, _) = host(&db, |b| b).await;
    wait_until(|| b.notifier_connected()).await;
    assert!(b.is_fenced(), "waits for the ghost's welcome");
    // Sent again and again until B's fence is lifted (a welcome that came before B's
    // rejoin began is cleared by it: the ones after must not count either).
    let channel = b.acknowledgement_channel().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while b.is_fenced() {
        assert!(std::time::Instant::now() < deadline, "B is still fenced");
        for round in [0u64, 1, 12_345, u64::MAX] {
            let welcome = format!(r#"{{"from":"ghost","welcome":true,"round":{round}}}"#);
            client
                .execute(
                    "SELECT pg_notify($1, $2)",
                    &[&channel, &sealed(&key, &welcome)],
                )
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = b.stats();
    assert_eq!(
        s.rejoins_incomplete, 1,
        "the ghost's welcomes counted: {s:?}"
    );
    assert_eq!(
        s.messages_refused, 0,
        "sealed under the cluster's key: {s:?}"
    );
    b.stop().await;
}

/// A host's pings to itself renew its lease. Anyone may listen on its acknowledgement
/// channel, keep a (sealed) ping, and send it again once its lease has run out: heard
/// again, it is ignored. (Taken as new, it came back after its lease ran out: the host
/// lost its lease, fenced itself and flushed its cache.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_ping_heard_again_does_not_cost_the_lease() {
    let Some(db) = postgres_db("acks_ping_again").await else {
        return;
    };
    // A lease long enough that no ping of B's own comes back after it on a loaded machine.
    let lease = Duration::from_secs(2);
    let (b, items_b) = host(&db, |b| {
        b.acknowledgements(Some(PATIENT)).lease(Some(lease))
    })
    .await;
    wait_until(|| b.notifier_connected() && !b.is_fenced()).await;
    assert_eq!(items_b.value(1).await, Ok(0));
    let channel = b.acknowledgement_channel().unwrap();

    // A listener of B's channel, as any role may be.
    let url = crate::support::database_url().unwrap();
    let (listener, mut connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (heard_tx, mut heard) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = futures::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message {
                let _ = heard_tx.send(n.payload().to_owned());
            }
        }
    });
    listener
        .batch_execute(&format!("LISTEN \"{}\"", channel.replace('"', "\"\"")))
        .await
        .unwrap();
    let ping = loop {
        let payload = heard.recv().await.unwrap();
        if payload.contains("\"ping\":") {
            break payload;
        }
    };
    // Its lease runs out; B's own later pings renew B's meanwhile.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    let before = b.stats();
    listener
        .execute("SELECT pg_notify($1, $2)", &[&channel, &ping])
        .await
        .unwrap();
    // After it, from the same session (delivered in order): a message B refuses, so that
    // B has heard the ping once this is counted.
    listener
        .execute("SELECT pg_notify($1, '{\"from\":\"x\"}')", &[&channel])
        .await
        .unwrap();
    wait_until(|| b.stats().messages_refused > before.messages_refused).await;
    let after = b.stats();
    assert_eq!(after.leases_lost, before.leases_lost, "{after:?}");
    assert_eq!(after.fences, before.fences, "{after:?}");
    b.stop().await;
}

/// A notice that is refused (no seal under this host's key: a host of a release before
/// seals sends such) still wakes the log reader, unread, as a notice without its
/// operation does: the operation it may stand for is read from the log now, not at the
/// next poll (here an hour away), and the host's lease waits for that read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refused_notice_still_wakes_the_log_reader() {
    let Some(db) = postgres_db("acks_refused_wakes").await else {
        return;
    };
    let (b, _) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    wait_until(|| b.notifier_connected() && !b.is_fenced()).await;
    let before = b.stats();
    let stranger =
        crate::support::connect_in_schema(&crate::support::database_url().unwrap(), "public").await;
    stranger
        .execute(
            "SELECT pg_notify($1, '{\"id\":1,\"position\":1,\"host\":\"old\",\"committed_at\":0}')",
            &[&b.notification_channel().unwrap()],
        )
        .await
        .unwrap();
    wait_until(|| {
        let s = b.stats();
        s.messages_refused > before.messages_refused && s.rounds > before.rounds
    })
    .await;
    b.stop().await;
}
