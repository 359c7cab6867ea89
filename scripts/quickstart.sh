#!/usr/bin/env bash
# Builds and runs the README's quick start as a new user would: a crate outside the
# workspace, its Cargo.toml and src/main.rs copied from the README, the dependency's path
# pointed at this checkout. The workspace's Cargo.lock seeds the new crate's, so that it
# builds against the versions CI tests.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# Outside the repository (inside it, cargo would take the crate for a stray member of the
# workspace); its build shares the workspace's target directory.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/src"
# The fenced block right after each marker.
block() {
  awk -v marker="<!-- quickstart:$1 -->" '
    $0 == marker { found = 1; next }
    found && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }
  ' "$root/README.md"
}
block toml | sed "s#path = \"../coherent/crates/coherent\"#path = \"$root/crates/coherent\"#" \
  > "$dir/Cargo.toml"
block rust > "$dir/src/main.rs"
grep -q "$root/crates/coherent" "$dir/Cargo.toml" || { echo "quickstart: no coherent dependency in the README's Cargo.toml"; exit 1; }
[ -s "$dir/src/main.rs" ] || { echo "quickstart: no main.rs in the README"; exit 1; }
cp "$root/Cargo.lock" "$dir/Cargo.lock"
out="$(cd "$dir" && cargo run -q)"
echo "$out"
[ "$out" = "doubled: 42" ] || { echo "quickstart: expected 'doubled: 42'"; exit 1; }
