#!/usr/bin/env bash
# Runs schemathesis (PyPI) against the Tasks API's OpenAPI document, /api/openapi.json:
# every operation, every check (no 5xx, responses and status codes as documented, valid
# requests accepted, invalid ones refused), on each backend it is given a database for.
#
#   apps/tasks/scripts/schemathesis.sh            # SQLite; and PostgreSQL if DATABASE_URL
#   ST_SEED=random apps/tasks/scripts/schemathesis.sh   # explore beyond the fixed seed
#
# Installs schemathesis into a virtual environment under ~/.cache on first use.
set -euo pipefail

root=$(cd "$(dirname "$0")/../../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
venv=${COHERENT_ST_VENV:-$HOME/.cache/coherent/schemathesis-4.32.5}
seed=${ST_SEED:-20261125}
examples=${ST_MAX_EXAMPLES:-40}

if ! "$venv/bin/schemathesis" --version >/dev/null 2>&1; then
    echo "schemathesis: installing into $venv"
    if ! python3 -m venv "$venv"; then
        # Debian splits venv (and ensurepip) out of python3.
        if command -v apt-get >/dev/null; then
            apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
        fi
        rm -rf "$venv"
        python3 -m venv "$venv"
    fi
    "$venv/bin/pip" install --quiet "schemathesis==4.32.5"
fi

(cd "$root" && cargo build --quiet -p coherent-tasks)
bin=$target/debug/tasks
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# run NAME BACKEND [tasks options...]: seeds a database, serves it, runs schemathesis.
run() {
    local name=$1 backend=$2
    shift 2
    local port
    port=$(free_port)
    "$bin" "$@" seed --tasks 200 --projects 3 >/dev/null 2>&1
    "$bin" "$@" serve --listen "127.0.0.1:$port" --backend "$backend" \
        --user "st:a password for schemathesis" 2>"$work/$name.log" &
    pids+=($!)
    local seed_args=(--seed "$seed")
    [[ $seed == random ]] && seed_args=()
    echo "schemathesis: $name ($backend backend) on port $port"
    # Writes need a login: the requests that the document says need one carry its cookie
    # (the `session` security scheme), and the checks that leave it out see them refused.
    local cookie=""
    for _ in $(seq 1 120); do
        cookie=$(curl -s -o /dev/null -D - -H 'content-type: application/json' \
            -d '{"name":"st","password":"a password for schemathesis"}' \
            "http://127.0.0.1:$port/api/session" | sed -n 's/^set-cookie: \([^;]*\).*/\1/ip' || true)
        [[ -n $cookie ]] && break
        sleep 0.5
    done
    if [[ -z $cookie ]]; then
        tail -50 "$work/$name.log"
        echo "schemathesis: $name: could not log in"
        return 1
    fi
    printf '[auth.openapi.session]\napi_key = "%s"\n' "${cookie#*=}" >"$work/$name.toml"
    if ! "$venv/bin/schemathesis" --config-file "$work/$name.toml" \
        run "http://127.0.0.1:$port/api/openapi.json" \
        --checks all --max-examples "$examples" "${seed_args[@]}" \
        --wait-for-schema 60 --no-color >"$work/$name.out" 2>&1; then
        cat "$work/$name.out"
        echo "--- server log"
        tail -50 "$work/$name.log"
        echo "schemathesis: $name FAILED"
        return 1
    fi
    grep -E "^Test cases:|generated" "$work/$name.out" | tail -2
}

run sqlite-coherent coherent --sqlite "$work/coherent.db" --database-url ""
run sqlite-direct direct --sqlite "$work/direct.db" --database-url ""
run sqlite-grpc grpc --sqlite "$work/grpc.db" --database-url ""
if [[ -n ${DATABASE_URL:-} ]]; then
    schema=st_$$
    run postgres-coherent coherent --database-url "$DATABASE_URL" --schema "$schema"
    psql "$DATABASE_URL" -qc "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
fi
echo "schemathesis: passed"
