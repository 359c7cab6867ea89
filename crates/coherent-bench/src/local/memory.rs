//! The `local` suite's `memory` and `scale` rows: what a cached result costs in memory, and how
//! hits and invalidation behave as the cache grows.
//!
//! Each figure comes from a fresh process (`coherent-bench memory-probe SHAPE --keys N`), so
//! that no earlier case's heap (freed but kept by the allocator) hides a later one's growth:
//! the probe reads its resident set (`VmRSS`) before building anything and again
//! after `N` results are cached, and prints the difference divided by `N`. Shapes:
//! - `coherent.leaf`: a compute method `u64 -> u64` with no dependency, called for `N` keys;
//! - `coherent.node_leaf`: a method calling that leaf for its key (one edge): `N` pairs, so the
//!   figure is per pair, a node and a leaf;
//! - `coherent.dag4`: `N` results of one method, each depending on the four before it (fan-in
//!   and fan-out 4), called in key order so that each call's dependencies are hits;
//! - `map`, `moka`, `quickcache`: the peers holding the same `u64 -> u64` pairs (dashmap with
//!   foldhash; moka and quick_cache sized for `N`).
//!
//! The probe can then read for a while (`--hit-seconds`): one reader, keys drawn uniformly from
//! the `N`, every read a hit; and `coherent.cascade` builds `N` dependants of one result and
//! times the call that invalidates it (the cascade completes before that call returns).

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use serde_json::{json, Value};

use crate::report::{Report, Row};
use crate::Timing;

/// The probe's shapes for the `memory` rows, in the order they are printed.
const MEMORY_SHAPES: [&str; 6] = [
    "coherent.leaf",
    "coherent.node_leaf",
    "coherent.dag4",
    "map",
    "moka",
    "quickcache",
];

/// The peers whose hits the `scale.hits` rows carry beside ours.
const SCALE_PEERS: [&str; 2] = ["map", "quickcache"];

/// Bytes of resident memory of this process.
fn rss_bytes() -> f64 {
    crate::hostile::server::Proc(std::process::id()).rss_mb() * 1024.0 * 1024.0
}

/// The results under test: a leaf, a node over it, a DAG of fan-in 4, and a root with its
/// dependants. Values are `u64`, the same as the peers'.
#[derive(Clone, ComputeService)]
pub(crate) struct Shapes {
    handle: ServiceHandle,
}

#[compute_service]
impl Shapes {
    #[compute]
    pub(crate) async fn leaf(&self, key: u64) -> u64 {
        key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    #[compute]
    pub(crate) async fn node(&self, key: u64) -> u64 {
        self.leaf(key).await ^ 1
    }

    /// Depends on the four results before it (none for the first four).
    #[compute]
    pub(crate) async fn dag(&self, key: u64) -> u64 {
        let mut sum = key;
        for back in 1..=4u64.min(key) {
            sum = sum.wrapping_add(self.dag(key - back).await);
        }
        sum
    }

    #[compute]
    pub(crate) async fn root(&self) -> u64 {
        7
    }

    #[compute]
    pub(crate) async fn dependant(&self, key: u64) -> u64 {
        self.root().await ^ key
    }
}

/// Reads `n` keys at random from `get` for `seconds`: hits per second.
async fn hits<F, Fut>(n: u64, seconds: f64, mut get: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    if seconds <= 0.0 {
        return 0.0;
    }
    let mut keys = super::Ids(0x9E37_79B9_7F4A_7C15);
    let deadline = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut calls = 0u64;
    let mut sum = 0u64;
    while started.elapsed() < deadline {
        for _ in 0..1024 {
            sum = sum.wrapping_add(std::hint::black_box(get(keys.below(n)).await));
        }
        calls += 1024;
    }
    std::hint::black_box(sum);
    calls as f64 / started.elapsed().as_secs_f64()
}

/// The hidden `memory-probe` subcommand: builds `keys` results of `shape` in this (fresh)
/// process and prints one JSON line: `bytes_per_entry`, and `hits_per_s` or `cascade_ms`.
pub(crate) fn probe(shape: &str, keys: u64, hit_seconds: f64) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let keys = keys.max(1);
    let out = runtime.block_on(async {
        let before = rss_bytes();
        let mut out = json!({ "shape": shape, "keys": keys });
        match shape {
            "coherent.leaf" | "coherent.node_leaf" | "coherent.dag4" | "coherent.cascade" => {
                // Room for every result: the default capacity (100,000) would evict.
                let registry = Registry::builder()
                    .capacity(usize::try_from(keys)?.saturating_mul(4))
                    .build();
                let shapes = Shapes {
                    handle: ServiceHandle::with_registry(&registry),
                };
                for key in 0..keys {
                    std::hint::black_box(match shape {
                        "coherent.leaf" => shapes.leaf(key).await,
                        "coherent.node_leaf" => shapes.node(key).await,
                        "coherent.dag4" => shapes.dag(key).await,
                        _ => shapes.dependant(key).await,
                    });
                }
                out["bytes_per_entry"] = json!((rss_bytes() - before) / keys as f64);
                match shape {
                    "coherent.leaf" => {
                        out["hits_per_s"] =
                            json!(hits(keys, hit_seconds, |k| shapes.leaf(k)).await);
                    }
                    "coherent.cascade" => {
                        // The best of three: build, invalidate, build again.
                        let mut best = f64::INFINITY;
                        for round in 0..3 {
                            if round > 0 {
                                for key in 0..keys {
                                    std::hint::black_box(shapes.dependant(key).await);
                                }
                            }
                            let started = Instant::now();
                            anyhow::ensure!(shapes.invalidate_root(), "the root was cached");
                            best = best.min(started.elapsed().as_secs_f64() * 1e3);
                            // Every dependant was invalidated before the call returned.
                            anyhow::ensure!(
                                !shapes.invalidate_dependant(keys - 1),
                                "a dependant survived the cascade"
                            );
                        }
                        out["cascade_ms"] = json!(best);
                    }
                    _ => {}
                }
            }
            "map" => {
                let map = dashmap::DashMap::with_hasher(foldhash::fast::RandomState::default());
                for key in 0..keys {
                    map.insert(key, key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                }
                out["bytes_per_entry"] = json!((rss_bytes() - before) / keys as f64);
                let map = Arc::new(map);
                out["hits_per_s"] = json!(
                    hits(keys, hit_seconds, |k| std::future::ready(
                        *map.get(&k).expect("in")
                    ))
                    .await
                );
            }
            "moka" => {
                let cache = moka::sync::Cache::new(keys);
                for key in 0..keys {
                    cache.insert(key, key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                }
                cache.run_pending_tasks();
                out["bytes_per_entry"] = json!((rss_bytes() - before) / keys as f64);
                out["hits_per_s"] = json!(
                    hits(keys, hit_seconds, |k| std::future::ready(
                        cache.get(&k).unwrap_or(0)
                    ))
                    .await
                );
            }
            "quickcache" => {
                let cache = quick_cache::sync::Cache::new(keys as usize);
                for key in 0..keys {
                    cache.insert(key, key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                }
                out["bytes_per_entry"] = json!((rss_bytes() - before) / keys as f64);
                out["hits_per_s"] = json!(
                    hits(keys, hit_seconds, |k| std::future::ready(
                        cache.get(&k).unwrap_or(0)
                    ))
                    .await
                );
            }
            other => anyhow::bail!(
                "unknown shape {other:?}: coherent.leaf, coherent.node_leaf, coherent.dag4, \
                 coherent.cascade, map, moka or quickcache"
            ),
        }
        anyhow::Ok(out)
    })?;
    println!("{out}");
    Ok(())
}

/// Runs one probe in a fresh process of this binary.
fn run_probe(shape: &str, keys: u64, hit_seconds: f64) -> anyhow::Result<Value> {
    let output = Command::new(std::env::current_exe()?)
        .args(["memory-probe", shape, "--keys"])
        .arg(keys.to_string())
        .arg("--hit-seconds")
        .arg(hit_seconds.to_string())
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "memory-probe {shape} --keys {keys} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = String::from_utf8(output.stdout)?;
    Ok(serde_json::from_str(line.trim())?)
}

fn field(value: &Value, name: &str) -> f64 {
    value[name].as_f64().unwrap_or(f64::NAN)
}

/// The `memory` rows (bytes per entry, ours and the peers') and the `scale` rows (hits and
/// bytes per entry at three sizes; the cascade at two).
pub(crate) fn rows(
    timing: Timing,
    report: &mut Report,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    let quick = timing.runs <= 1;
    // At least a million keys (the line), a tenth of that in a smoke run.
    let keys: u64 = if quick { 100_000 } else { 1_000_000 };
    for shape in MEMORY_SHAPES {
        bar.set_message(format!("memory.{shape}"));
        let probe = run_probe(shape, keys, 0.0)?;
        let mut row = Row::new(
            format!("memory.{shape}"),
            field(&probe, "bytes_per_entry"),
            "B/entry",
        )
        .with("keys", keys)
        .in_group("memory");
        if shape == "coherent.leaf" {
            // The line: at most 0.4 x moka's.
            row = row.compared_to("memory.moka");
        }
        report.push(row);
        bar.inc(1);
    }
    report.note(format!(
        "memory: resident set growth / keys, each shape in a fresh process, {keys} keys, \
         u64 -> u64; node_leaf is per pair (a node and its leaf), dag4 per result (4 edges each)"
    ));

    // Scale: the same leaf at three sizes, one reader hitting random keys.
    let sizes: &[u64] = if quick {
        &[10_000, 100_000]
    } else {
        &[10_000, 1_000_000, 10_000_000]
    };
    let hit_seconds = timing.run.as_secs_f64();
    for &size in sizes {
        bar.set_message(format!("scale.hits.{size}"));
        let probe = run_probe("coherent.leaf", size, hit_seconds)?;
        let mut row = scale_row("hits", size, sizes[0], &probe, "hits_per_s", "calls/s");
        // The peers at the same size: how much of the fall is any map's, once its
        // entries no longer fit in the caches.
        for peer in SCALE_PEERS {
            let probe = run_probe(peer, size, hit_seconds)?;
            row = row.with(
                &format!("{peer}_hits_per_s"),
                field(&probe, "hits_per_s").round(),
            );
        }
        report.push(row);
        bar.inc(1);
    }
    let cascades: &[u64] = if quick {
        &[10_000, 100_000]
    } else {
        &[10_000, 1_000_000]
    };
    for &size in cascades {
        bar.set_message(format!("scale.cascade.{size}"));
        let probe = run_probe("coherent.cascade", size, 0.0)?;
        report.push(scale_row(
            "cascade",
            size,
            cascades[0],
            &probe,
            "cascade_ms",
            "ms",
        ));
        bar.inc(1);
    }
    report.note(
        "scale: one reader over N cached u64 results (random keys, all hits; map_hits_per_s and \
         quickcache_hits_per_s: the peers over the same N), and one invalidation reaching N \
         dependants, each in a fresh process",
    );
    Ok(())
}

/// `scale.KIND.SIZE`: the probe's `value` field, its bytes per entry, compared with the
/// smallest size's row.
fn scale_row(
    kind: &str,
    size: u64,
    smallest: u64,
    probe: &Value,
    value: &str,
    unit: &'static str,
) -> Row {
    let row = Row::new(format!("scale.{kind}.{size}"), field(probe, value), unit)
        .with("bytes_per_entry", field(probe, "bytes_per_entry"))
        .in_group(&format!("scale.{kind}"));
    if size == smallest {
        row
    } else {
        row.compared_to(&format!("scale.{kind}.{smallest}"))
    }
}

/// The number of progress steps [`rows`] takes.
pub(crate) fn steps(timing: Timing) -> u64 {
    let quick = timing.runs <= 1;
    MEMORY_SHAPES.len() as u64 + if quick { 4 } else { 5 }
}
