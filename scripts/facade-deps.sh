#!/usr/bin/env bash
# What a user of `coherent` builds, checked as a user builds it: a crate outside the workspace
# that depends on the facade alone (with every feature but `ops`/`nats`, whose
# tokio-postgres and async-nats hold two versions of a few crates of their own), without
# dev-dependencies, must hold one version of each crate. Inside the workspace, cargo would
# unify the features that other members turn on (apps/tasks turns on `ops`) into the facade's
# graph. Usage: scripts/facade-deps.sh [extra cargo-deny flags, e.g. --offline]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
features='"rpc", "remote", "http", "persistent", "tls", "websocket", "metrics", "typescript"'
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/src"
cat > "$dir/Cargo.toml" <<TOML
[package]
name = "coherent-facade-deps"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
coherent = { path = "$root/crates/coherent", features = [$features] }
TOML
echo 'fn main() {}' > "$dir/src/main.rs"
# The versions CI tests: the workspace's lock seeds this crate's.
cp "$root/Cargo.lock" "$dir/Cargo.lock"
cargo deny "$@" --manifest-path "$dir/Cargo.toml" --config "$root/deny.toml" --exclude-dev \
  check bans -D duplicate
