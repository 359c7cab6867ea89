#!/usr/bin/env bash
# The guide (docs/guide): runs the program of each of its five chapters, each of which checks
# what its chapter says and exits 0; checks that every `{{#include}}` of the chapters names a
# file (and anchor) that exists; and builds the book with mdBook when mdBook is installed or
# can be installed from crates.io (`cargo install mdbook --locked`; else the chapters are
# plain Markdown, read as they are).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
programs="sqlite_users guide_replicas cluster guide_browser guide_operating"
cargo build -q -p coherent-examples --examples
for program in $programs; do
  grep -rq -- "--example $program\`" docs/guide/src || { echo "guide: no chapter runs $program"; exit 1; }
  echo "--- $program"
  timeout 120 cargo run -q -p coherent-examples --example "$program" > "$(mktemp)" 2>&1 \
    || { echo "guide: $program failed"; timeout 120 cargo run -q -p coherent-examples --example "$program"; exit 1; }
  echo "ok"
done
# Every include resolves (mdBook would fail the same way; this runs without it).
status=0
while IFS= read -r line; do
  chapter="${line%%:*}"
  target="$(sed -E 's/.*\{\{#include ([^}]*)\}\}.*/\1/' <<<"${line#*:}")"
  file="${target%%:*}"
  path="$(dirname "$chapter")/$file"
  if [ ! -f "$path" ]; then
    echo "guide: $chapter includes $file, which does not exist"; status=1; continue
  fi
  if [ "$file" != "$target" ]; then
    anchor="${target#*:}"
    grep -q "ANCHOR: $anchor\$" "$path" && grep -q "ANCHOR_END: $anchor\$" "$path" \
      || { echo "guide: $chapter includes $target: no such anchor"; status=1; }
  fi
done < <(grep -rn '{{#include' docs/guide/src | sed -E 's/^([^:]*):[0-9]+:/\1:/')
[ "$status" = 0 ] || exit 1
echo "every include of the chapters resolves"
if ! command -v mdbook >/dev/null; then
  cargo install -q mdbook --locked --version '^0.4' >/dev/null 2>&1 \
    || echo "mdbook could not be installed: the chapters stay plain Markdown"
fi
if command -v mdbook >/dev/null; then
  mdbook build docs/guide -d "${CARGO_TARGET_DIR:-$root/target}/guide"
  echo "the book: ${CARGO_TARGET_DIR:-$root/target}/guide/index.html"
fi
