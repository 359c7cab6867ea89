//! Issue 34 across processes: a change committed by a connection outside the application
//! (a `psql` session) reaches every host process's cache and the replicas its clients
//! hold, through the change feed; the host reading the feed killed with SIGKILL, another
//! takes it over and the next change reaches the hosts left.

use coherent::prelude::*;
use coherent_remote::RemoteClient;

use crate::harness::{within, HostProc, Mirror, Store};

async fn leading(host: &mut HostProc) -> bool {
    host.cmd("feed").await.contains("leading=1")
}

/// Waits until `host` reads `value` for `id` from its cache (a host whose entry was not
/// invalidated reads the old value for ever).
async fn reads(host: &mut HostProc, id: i64, value: i64) {
    within("the host's read of the new value", async {
        while host.read(id).await != value {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_change_from_outside_reaches_every_host_process_and_outlives_the_readers_kill() {
    let Some(store) = Store::postgres("c_feed").await else {
        return;
    };
    let sql = store.sql().await;
    let pid = std::process::id();
    // Slots of earlier runs of this binary (a slot holds the log back for ever).
    sql.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name LIKE 't\\_feed\\_%' AND slot_name NOT LIKE $1 AND NOT active",
        &[&format!("t\\_feed\\_{pid}\\_%")],
    )
    .await
    .unwrap();
    let slot = format!("t_feed_{pid}_cluster");
    let config = store.host().feed(&slot);
    let mut hosts = vec![
        config.spawn().await,
        config.spawn().await,
        config.spawn().await,
    ];
    within("a host reads the feed", async {
        loop {
            for h in hosts.iter_mut() {
                if leading(h).await {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    for h in hosts.iter_mut() {
        assert_eq!(h.read(3).await, 0);
    }
    let mirror = Mirror {
        handle: ServiceHandle::with_registry(&Registry::new()),
        remote: RemoteClient::connect_tcp(hosts[2].addr).await.unwrap(),
    };
    let replica = mirror.value_computed(3).await;
    assert_eq!(replica.value(), &Ok(Ok(0)));

    sql.execute("UPDATE items SET value = 5 WHERE id = 3", &[])
        .await
        .unwrap();
    for h in hosts.iter_mut() {
        reads(h, 3, 5).await;
    }
    within("the replica's invalidation", replica.when_invalidated()).await;
    assert_eq!(mirror.value(3).await, Ok(Ok(5)));

    // The reader of the feed killed: another takes it over.
    let mut leader = None;
    for (i, h) in hosts.iter_mut().enumerate() {
        if leading(h).await {
            leader = Some(i);
        }
    }
    let mut dead = hosts.remove(leader.expect("one host leads"));
    for h in hosts.iter_mut() {
        assert_eq!(h.read(4).await, 0);
    }
    dead.kill().await;
    sql.execute("UPDATE items SET value = 6 WHERE id = 4", &[])
        .await
        .unwrap();
    for h in hosts.iter_mut() {
        reads(h, 4, 6).await;
    }
    let mut leaders = 0;
    for h in hosts.iter_mut() {
        leaders += usize::from(leading(h).await);
    }
    assert_eq!(leaders, 1, "one of the hosts left reads the feed");
    for h in hosts.iter_mut() {
        h.kill().await;
    }
    within("the slot's drop", async {
        loop {
            let gone = sql
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND NOT active",
                    &[&slot],
                )
                .await
                .is_ok()
                && sql
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                    .unwrap()
                    .is_none();
            if gone {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
}
