#!/usr/bin/env bash
# graphile-worker peer figures for bench/run.sh:
#   bash bench/graphile/run.sh <connection-string> drain|latency <jobs>
# Exits 3 when node is missing so the caller can skip the peer rows.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "graphile-worker skipped: node is not installed" >&2
    exit 3
fi
if [ ! -d "$here/node_modules/graphile-worker" ]; then
    # npm's progress and notices go to stderr: stdout carries only the figures.
    if [ -f "$here/package-lock.json" ]; then
        (cd "$here" && npm ci --no-audit --no-fund >&2)
    else
        (cd "$here" && npm install --no-audit --no-fund >&2)
    fi
fi
exec node "$here/bench.js" "$@"
