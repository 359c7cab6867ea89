//! The real wrk, when it is installed (Debian package `wrk`), as a reference row beside our
//! generator: the same threads, connections and duration, driven by a Lua script generated
//! from a [`WrkScript`], whose `done` hook prints the counts and percentiles as
//! machine-readable lines that [`run_wrk`] parses.

use std::io::{ErrorKind, Write as _};
use std::net::SocketAddr;
use std::process::Command;

use anyhow::Context as _;

use super::LoadConfig;

/// The note a report carries when wrk is not installed and its rows are missing.
pub(crate) const WRK_MISSING: &str =
    "wrk is not installed (Debian package `wrk`): its reference rows are missing";

/// The prefix of the lines the generated `done` hook prints.
const LINE_PREFIX: &str = "coherent-wrk ";

/// What wrk sends: one of four generated Lua scripts.
#[derive(Clone, Debug)]
pub(crate) enum WrkScript {
    /// A `GET` of one path, again and again.
    #[cfg_attr(not(test), allow(dead_code))]
    Get {
        /// The request target.
        path: String,
    },
    /// `GET`s of `paths` in turn, each wrk thread starting at a different place.
    GetRotating {
        /// The request targets (at least one).
        paths: Vec<String>,
    },
    /// A `POST` of one JSON body to one path.
    Post {
        /// The request target.
        path: String,
        /// The JSON body.
        body: String,
    },
    /// `GET`s of paths chosen at random from `paths`, and with probability
    /// `patch_percent`/100 a `PATCH` of a random one of them with the JSON body `patch_body`.
    Mixed {
        /// The request targets (at least one).
        paths: Vec<String>,
        /// The body of each `PATCH`.
        patch_body: String,
        /// The share of `PATCH`es, in percent (5 for 95% reads).
        patch_percent: u32,
    },
}

/// What wrk measured over its run.
#[derive(Clone, Debug)]
pub(crate) struct WrkResult {
    /// Responses received.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) requests: u64,
    /// Responses per second over wrk's own measured duration.
    pub(crate) rps: f64,
    /// Median latency, in milliseconds.
    pub(crate) p50_ms: f64,
    /// 99th percentile latency, in milliseconds.
    pub(crate) p99_ms: f64,
    /// Socket errors: connect, read, write and timeouts.
    pub(crate) errors: u64,
    /// Responses with a status of 400 or more (wrk's "Non-2xx or 3xx responses").
    pub(crate) bad_status: u64,
}

/// Runs wrk against `http://addr` with `config`'s threads and connections and `script`:
/// first for the warm-up (unrecorded), then for the duration. wrk counts time in whole
/// seconds, so each phase lasts its duration rounded up to a second (at least one; a zero
/// warm-up is skipped). Returns `None` when wrk is not installed: the report should then say
/// [`WRK_MISSING`].
pub(crate) fn run_wrk(
    addr: SocketAddr,
    config: &LoadConfig,
    script: &WrkScript,
) -> anyhow::Result<Option<WrkResult>> {
    let mut file = tempfile::Builder::new()
        .prefix("coherent-wrk-")
        .suffix(".lua")
        .tempfile()
        .context("creating wrk's script file")?;
    file.write_all(lua_script(script).as_bytes())
        .and_then(|()| file.flush())
        .context("writing wrk's script file")?;
    let connections = config.connections.max(1);
    let threads = config.threads.clamp(1, connections);
    let wrk = |seconds: u64| -> anyhow::Result<Option<String>> {
        let output = Command::new("wrk")
            .arg(format!("--threads={threads}"))
            .arg(format!("--connections={connections}"))
            .arg(format!("--duration={seconds}s"))
            .arg("--script")
            .arg(file.path())
            .arg(format!("http://{addr}"))
            .output();
        let output = match output {
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            other => other.context("running wrk")?,
        };
        anyhow::ensure!(
            output.status.success(),
            "wrk failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Ok(Some(String::from_utf8_lossy(&output.stdout).into_owned()))
    };
    if !config.warmup.is_zero() && wrk(whole_seconds(config.warmup))?.is_none() {
        return Ok(None);
    }
    match wrk(whole_seconds(config.duration))? {
        Some(stdout) => parse_output(&stdout).map(Some),
        None => Ok(None),
    }
}

/// `duration` in whole seconds, rounded up, at least 1.
fn whole_seconds(duration: std::time::Duration) -> u64 {
    duration.as_secs_f64().ceil().max(1.0) as u64
}

/// The Lua script for `script`, with the `done` hook that prints [`LINE_PREFIX`] lines.
fn lua_script(script: &WrkScript) -> String {
    // Each thread gets an id (a global in its Lua state) that seeds its random numbers and
    // offsets its rotation.
    let mut lua = String::from(
        "local next_id = 0\n\
         function setup(thread)\n  thread:set(\"id\", next_id)\n  next_id = next_id + 1\nend\n\
         local at = 0\n\
         function init(args)\n  math.randomseed(os.time() * 1000 + id)\n  at = id\nend\n",
    );
    match script {
        WrkScript::Get { path } => {
            lua += &format!("wrk.method = \"GET\"\nwrk.path = {}\n", lua_string(path));
        }
        WrkScript::GetRotating { paths } => {
            lua += &format!(
                "local paths = {}\n\
                 function request()\n  at = at % #paths + 1\n  \
                 return wrk.format(\"GET\", paths[at])\nend\n",
                lua_array(paths)
            );
        }
        WrkScript::Post { path, body } => {
            lua += &format!(
                "wrk.method = \"POST\"\nwrk.path = {}\nwrk.body = {}\n\
                 wrk.headers[\"Content-Type\"] = \"application/json\"\n",
                lua_string(path),
                lua_string(body)
            );
        }
        WrkScript::Mixed {
            paths,
            patch_body,
            patch_percent,
        } => {
            lua += &format!(
                "local paths = {}\nlocal patch_body = {}\n\
                 local json = {{[\"Content-Type\"] = \"application/json\"}}\n\
                 function request()\n  local path = paths[math.random(#paths)]\n  \
                 if math.random(100) <= {patch_percent} then\n    \
                 return wrk.format(\"PATCH\", path, json, patch_body)\n  end\n  \
                 return wrk.format(\"GET\", path)\nend\n",
                lua_array(paths),
                lua_string(patch_body),
            );
        }
    }
    lua += &format!(
        "function done(summary, latency, requests)\n  \
         local e = summary.errors\n  \
         io.write(string.format(\"{p}requests %d\\n\", summary.requests))\n  \
         io.write(string.format(\"{p}duration_us %d\\n\", summary.duration))\n  \
         io.write(string.format(\"{p}errors %d\\n\", e.connect + e.read + e.write + e.timeout))\n  \
         io.write(string.format(\"{p}bad_status %d\\n\", e.status))\n  \
         io.write(string.format(\"{p}p50_us %d\\n\", latency:percentile(50)))\n  \
         io.write(string.format(\"{p}p99_us %d\\n\", latency:percentile(99)))\n\
         end\n",
        p = LINE_PREFIX
    );
    lua
}

/// `value` as a Lua string literal.
fn lua_string(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for byte in value.bytes() {
        match byte {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b' '..=b'~' => out.push(char::from(byte)),
            // Lua's decimal escape, three digits so that a following digit is not taken in.
            _ => out.push_str(&format!("\\{byte:03}")),
        }
    }
    out.push('"');
    out
}

/// `values` as a Lua array of string literals.
fn lua_array(values: &[String]) -> String {
    let items: Vec<String> = values.iter().map(|value| lua_string(value)).collect();
    format!("{{{}}}", items.join(", "))
}

/// Reads the [`LINE_PREFIX`] lines of wrk's output.
fn parse_output(stdout: &str) -> anyhow::Result<WrkResult> {
    let field = |name: &str| -> anyhow::Result<u64> {
        stdout
            .lines()
            .filter_map(|line| line.strip_prefix(LINE_PREFIX))
            .find_map(|line| {
                let (key, value) = line.split_once(' ')?;
                (key == name).then(|| value.trim().parse::<u64>().ok())?
            })
            .with_context(|| format!("wrk's output has no `{name}` line: {stdout}"))
    };
    let requests = field("requests")?;
    let duration_us = field("duration_us")?;
    Ok(WrkResult {
        requests,
        rps: requests as f64 / (duration_us.max(1) as f64 / 1e6),
        p50_ms: field("p50_us")? as f64 / 1000.0,
        p99_ms: field("p99_us")? as f64 / 1000.0,
        errors: field("errors")?,
        bad_status: field("bad_status")?,
    })
}

/// Whether the `wrk` binary can be run.
pub(crate) fn wrk_installed() -> bool {
    Command::new("wrk")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}
