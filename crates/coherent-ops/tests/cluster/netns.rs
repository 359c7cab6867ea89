//! 8. A client across a lossy, slow link: a network namespace joined to the host's by a
//!    veth pair with `netem delay 20ms loss 5%` on both ends.
//!
//! Only the link between a remote client and its host crosses the namespace: the hosts
//! stay in the test's namespace, where PostgreSQL listens (on 127.0.0.1 only, which a
//! namespace cannot reach without forwarding). The client's socket is made inside the
//! namespace by a thread that enters it (`setns`); the socket stays there. Where the
//! kernel has no `netem` qdisc the link is not impaired, and the test prints that.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use coherent::prelude::*;
use coherent_ops::CommandClient;
use coherent_remote::RemoteClient;

use crate::harness::{within, Mirror, Store};
use crate::support::SetValue;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A namespace and its veth pair, removed on drop (on panic too).
struct Netns {
    name: String,
    root_side: String,
    /// The address of the root side, which the namespace reaches over the link.
    root_ip: String,
}

impl Netns {
    /// `Err` when the machine does not permit it (no `ip`, no privilege).
    fn create() -> Result<Netns, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = std::process::id() % 10_000 * 10 + NEXT.fetch_add(1, Ordering::Relaxed) % 10;
        let name = format!("coh{n}");
        ip(&["netns", "add", &name])?;
        let subnet = n % 250 + 1;
        let ns = Netns {
            root_side: format!("cohr{n}"),
            root_ip: format!("10.201.{subnet}.1"),
            name,
        };
        let inner = format!("cohn{n}");
        let ns_ip = format!("10.201.{subnet}.2/30");
        let root_cidr = format!("{}/30", ns.root_ip);
        let netem = ["root", "netem", "delay", "20ms", "loss", "5%"];
        let (name, root) = (ns.name.as_str(), ns.root_side.as_str());
        ip(&["link", "add", root, "type", "veth", "peer", "name", &inner])?;
        ip(&["link", "set", &inner, "netns", name])?;
        ip(&["addr", "add", &root_cidr, "dev", root])?;
        ip(&["link", "set", root, "up"])?;
        ip(&["-n", name, "addr", "add", &ns_ip, "dev", &inner])?;
        ip(&["-n", name, "link", "set", &inner, "up"])?;
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        let tc = |args: Vec<&str>| -> Result<(), String> {
            let out = Command::new(args[0])
                .args(&args[1..])
                .output()
                .map_err(|e| format!("{args:?}: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{args:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        let mut on_root = vec!["tc", "qdisc", "add", "dev", root];
        on_root.extend(netem);
        let mut in_ns = vec![
            "ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", &inner,
        ];
        in_ns.extend(netem);
        // A kernel without `sch_netem` still gives a link of its own, not impaired: the
        // test runs over it and says so.
        match tc(on_root).and_then(|()| tc(in_ns)) {
            Ok(()) => println!("netns link: netem delay 20ms loss 5% on both ends"),
            Err(e) => println!("netns link NOT impaired (netem unavailable): {e}"),
        }
        Ok(ns)
    }

    /// A TCP connection to `addr`, made from inside the namespace.
    fn connect(&self, addr: SocketAddr) -> std::net::TcpStream {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            // This thread only: the socket made next belongs to the namespace.
            // SAFETY: `file` is an open namespace file for the duration of the call, and
            // a thread that changes its network namespace affects nothing else here (it
            // makes one socket and ends).
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            let stream =
                std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(60)).unwrap();
            stream.set_nonblocking(true).unwrap();
            stream
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting one end deletes the pair (and the end in the namespace).
        let _ = ip(&["link", "del", &self.root_side]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// A client in the namespace holds a replica of B's `Items.value(3)` over the lossy link;
/// every write on A reaches it (invalidated, then read anew), and its own commands, sent
/// over the same link to B, reach B's cache and its replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_client_in_another_network_namespace() {
    let Some(store) = Store::postgres("c_netns").await else {
        return;
    };
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(e) => {
            eprintln!("skipped: network namespaces are not permitted here: {e}");
            return;
        }
    };
    let mut a = store.host().spawn().await;
    let mut b = store
        .host()
        .bind(&format!("{}:0", ns.root_ip))
        .spawn()
        .await;
    let stream = tokio::net::TcpStream::from_std(ns.connect(b.addr)).unwrap();
    let client = RemoteClient::builder().connect(stream).await.unwrap();
    let mirror = Mirror {
        handle: ServiceHandle::with_registry(&Registry::new()),
        remote: client.clone(),
    };
    let commands = CommandClient::new(client.caller());
    let (mut applied_on_a, mut applied_on_b) = (0, 0);
    for k in 1..=10 {
        let replica = mirror.value_computed(3).await;
        assert_eq!(replica.value(), &Ok(Ok(k - 1)));
        if k % 2 == 0 {
            // Through the link to B.
            assert_eq!(commands.run(&SetValue { id: 3, value: k }).await, Ok(k - 1));
            applied_on_a += 1;
            a.wait_applied(applied_on_a).await;
        } else {
            a.set(3, k).await;
            applied_on_b += 1;
            b.wait_applied(applied_on_b).await;
        }
        within(
            "the replica's invalidation across the link",
            replica.when_invalidated(),
        )
        .await;
        assert_eq!(mirror.value(3).await, Ok(Ok(k)));
        assert_eq!(a.read(3).await, k);
    }
    client.close();
}
