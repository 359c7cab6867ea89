//! A network namespace of the run's own, joined to this one by a veth pair: the run's NATS
//! server listens inside it, so every byte between the hosts and NATS crosses a link the
//! run can degrade. `degrade` drops a share of the packets at random both ways and slows
//! the link: `tc netem` (loss, delay with jitter) where the kernel has it, else nftables
//! (`numgen random` drops, in the namespace's input and output hooks) and a token bucket
//! (`tc tbf`: a narrow link that queues). Needs root, `ip`, `tc`, and `nft` where there is
//! no netem; [`Netns::create`] says what is missing.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context as _};

/// How a degraded link loses and slows packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degrade {
    /// `tc netem`: 15% loss and 40 ms ± 20 ms of delay, each way.
    Netem,
    /// nftables drops 15% of the packets each way; `tc tbf` limits the link to 1 Mbit/s.
    NftAndTbf,
}

/// A namespace and its veth pair, removed when dropped.
pub struct Netns {
    name: String,
    /// The veth end in this namespace.
    outer: String,
    /// The veth end inside.
    inner: String,
    /// This namespace's address on the link.
    pub outer_ip: Ipv4Addr,
    /// The namespace's address on the link: where its servers listen.
    pub inner_ip: Ipv4Addr,
    degrade: Degrade,
}

fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Netns {
    /// Creates a namespace with a link to this one (a /30 of 10.200.0.0/13 of its own).
    pub fn create() -> anyhow::Result<Netns> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Names fit IFNAMSIZ (15) and differ by process and namespace; addresses are a /30
        // of 10.200.0.0/13 (131,072 of them) picked by both.
        let tag = format!("{}x{}", pid % 1_000_000, n % 100);
        let slot = (pid.wrapping_mul(131) ^ n.wrapping_mul(65_537)) % 131_072;
        let base = u32::from(Ipv4Addr::new(10, 200, 0, 0)) + slot * 4;
        let ns = Netns {
            name: format!("chk{tag}"),
            outer: format!("c{tag}o"),
            inner: format!("c{tag}i"),
            outer_ip: Ipv4Addr::from(base + 1),
            inner_ip: Ipv4Addr::from(base + 2),
            degrade: Degrade::Netem,
        };
        let mut ns = ns;
        ns.set_up()?;
        ns.degrade = ns.probe_degrade()?;
        Ok(ns)
    }

    fn set_up(&self) -> anyhow::Result<()> {
        let (outer_ip, inner_ip) = (
            format!("{}/30", self.outer_ip),
            format!("{}/30", self.inner_ip),
        );
        run(&["ip", "netns", "add", &self.name])?;
        run(&[
            "ip",
            "link",
            "add",
            &self.outer,
            "type",
            "veth",
            "peer",
            "name",
            &self.inner,
        ])?;
        run(&["ip", "link", "set", &self.inner, "netns", &self.name])?;
        run(&["ip", "addr", "add", &outer_ip, "dev", &self.outer])?;
        run(&["ip", "link", "set", &self.outer, "up"])?;
        self.exec(&["ip", "addr", "add", &inner_ip, "dev", &self.inner])?;
        self.exec(&["ip", "link", "set", &self.inner, "up"])?;
        self.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(())
    }

    /// netem where the kernel has it, else nftables and tbf (`nft` must be installed).
    fn probe_degrade(&self) -> anyhow::Result<Degrade> {
        let netem = [
            "tc",
            "qdisc",
            "add",
            "dev",
            &self.outer,
            "root",
            "netem",
            "loss",
            "0%",
        ];
        if run(&netem).is_ok() {
            run(&["tc", "qdisc", "del", "dev", &self.outer, "root"])?;
            return Ok(Degrade::Netem);
        }
        self.exec(&["nft", "add", "table", "inet", "chk"])
            .context("no netem qdisc in this kernel, and nftables failed (install nftables)")?;
        for (chain, hook) in [("in", "input"), ("out", "output")] {
            let spec = format!("{{ type filter hook {hook} priority 0; }}");
            self.exec(&["nft", "add", "chain", "inet", "chk", chain, &spec])?;
        }
        run(&[
            "tc",
            "qdisc",
            "add",
            "dev",
            &self.outer,
            "root",
            "tbf",
            "rate",
            "1gbit",
            "burst",
            "1mb",
            "latency",
            "50ms",
        ])
        .context("no tbf qdisc either")?;
        run(&["tc", "qdisc", "del", "dev", &self.outer, "root"])?;
        Ok(Degrade::NftAndTbf)
    }

    /// Runs `args` inside the namespace, waiting for it.
    fn exec(&self, args: &[&str]) -> anyhow::Result<()> {
        let mut all = vec!["ip", "netns", "exec", &self.name];
        all.extend_from_slice(args);
        run(&all)
    }

    /// A command that runs `program` inside the namespace (`ip netns exec` execs it: the
    /// child's pid is the program's).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// How the link is degraded here.
    pub fn how(&self) -> Degrade {
        self.degrade
    }

    /// Makes the link lossy and slow, both ways, until [`restore`](Self::restore).
    pub fn degrade(&self) -> anyhow::Result<()> {
        match self.degrade {
            Degrade::Netem => self.qdisc_both(&["netem", "loss", "15%", "delay", "40ms", "20ms"]),
            Degrade::NftAndTbf => {
                for chain in ["in", "out"] {
                    self.exec(&[
                        "nft", "add", "rule", "inet", "chk", chain, "numgen", "random", "mod",
                        "100", "<", "15", "drop",
                    ])?;
                }
                self.qdisc_both(&[
                    "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "100ms",
                ])
            }
        }
    }

    /// Adds the root qdisc `spec` on both ends of the link (ours here, the other inside).
    fn qdisc_both(&self, spec: &[&str]) -> anyhow::Result<()> {
        for (dev, inside) in [(&self.outer, false), (&self.inner, true)] {
            let mut args = vec!["tc", "qdisc", "add", "dev", dev.as_str(), "root"];
            args.extend_from_slice(spec);
            if inside {
                self.exec(&args)?;
            } else {
                run(&args)?;
            }
        }
        Ok(())
    }

    /// The link as it was.
    pub fn restore(&self) -> anyhow::Result<()> {
        let _ = run(&["tc", "qdisc", "del", "dev", &self.outer, "root"]);
        let _ = self.exec(&["tc", "qdisc", "del", "dev", &self.inner, "root"]);
        if self.degrade == Degrade::NftAndTbf {
            for chain in ["in", "out"] {
                self.exec(&["nft", "flush", "chain", "inet", "chk", chain])?;
            }
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it ours.
        let _ = run(&["ip", "link", "del", &self.outer]);
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the machine allows it (root, `ip`; CHECKER_NETNS=1 makes it required): the
    /// link is degraded and restored, and the namespace is gone once dropped.
    #[test]
    fn a_namespace_is_degraded_restored_and_removed() {
        let ns = match Netns::create() {
            Ok(ns) => ns,
            Err(e) if std::env::var_os("CHECKER_NETNS").is_none() => {
                eprintln!("skipped: no network namespace here ({e:#})");
                return;
            }
            Err(e) => panic!("CHECKER_NETNS is set: {e:#}"),
        };
        let name = ns.name.clone();
        ns.degrade().unwrap();
        ns.restore().unwrap();
        drop(ns);
        let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&list.stdout).contains(&name));
    }
}
