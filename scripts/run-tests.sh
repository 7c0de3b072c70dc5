#!/usr/bin/env bash
# Runs every test of durable_jobs:
#   1. the in-database #[pg_test] suites (pgrx-tests/), on a cluster cargo-pgrx manages;
#   2. golden files with PostgreSQL's own testers: the SQL surface (tests/regress, pg_regress)
#      and the isolation specs (tests/isolation, the isolation tester);
#   3. the end-to-end suites (tests/), each on a fresh cluster of its own with the extension
#      installed as a user would install it.
# Needs what scripts/install-prerequisites.sh installs.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
export PG_BIN
PG_BIN=$("$PG_CONFIG" --bindir)

if ! cargo pgrx --version >/dev/null 2>&1; then
    echo "cargo-pgrx is missing: run scripts/install-prerequisites.sh first" >&2
    exit 1
fi

# Postgres refuses to run as root; as root, the test clusters run as the postgres OS user.
pgrx_test_args=()
test_root=/var/tmp/durable_jobs_pgrx
mkdir -p "$test_root"
if [ "$(id -u)" -eq 0 ]; then
    chown postgres: "$test_root"
    pgrx_test_args=(--runas postgres --pgdata "$test_root/data")
fi

echo "== in-database suites (cargo pgrx test)"
# cargo pgrx test installs its build by rewriting the installed library in place, which kills a
# running server that has it loaded (the one scripts/install-and-start.sh started, say). A copy
# renamed over it first puts a file no server has mapped at that path (running servers keep the
# one they mapped), and the path is never empty, so new sessions and restarts still load it.
library=$("$PG_CONFIG" --pkglibdir)/durable_jobs.so
if [ -e "$library" ]; then
    as_owner=()
    [ -w "$(dirname "$library")" ] || as_owner=(sudo)
    "${as_owner[@]}" cp -p "$library" "$library.replacing"
    "${as_owner[@]}" mv -f "$library.replacing" "$library"
fi
cargo pgrx test pg15 "${pgrx_test_args[@]}"

echo "== installing the extension into $("$PG_CONFIG" --pkglibdir)"
PG_CONFIG="$PG_CONFIG" bash scripts/install-extension.sh

echo "== golden SQL results (tests/regress) and isolation specs (tests/isolation)"
bash tests/pg_regress.sh regress
bash tests/pg_regress.sh isolation

echo "== end-to-end suites (tests/)"
# --nocapture shows the reliability scenarios' summary lines.
cargo test --manifest-path tests/Cargo.toml -- --test-threads=2 --nocapture
