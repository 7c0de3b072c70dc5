#!/usr/bin/env bash
# Runs PostgreSQL's own golden-file testers on a temporary instance with durable_jobs installed:
#   bash tests/pg_regress.sh isolation   tests/isolation/specs/*.spec against expected/*.out
#   bash tests/pg_regress.sh regress     tests/regress/sql/*.sql against expected/*.out
# As root, it runs as the postgres OS user.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
bindir=$("$PG_CONFIG" --bindir)
case "${1:-}" in
    isolation) tool=isolation/pg_isolation_regress inputs=specs suffix=spec ;;
    regress) tool=regress/pg_regress inputs=sql suffix=sql ;;
    *) echo "usage: $0 isolation|regress" >&2; exit 2 ;;
esac
regress=$("$PG_CONFIG" --pkglibdir)/pgxs/src/test/$tool
work=/var/tmp/durable_jobs_$1

rm -rf "$work"
mkdir -p "$work"
cp -r "$here/$1/$inputs" "$here/$1/expected" "$work/"
run=()
if [ "$(id -u)" -eq 0 ]; then
    chown -R postgres: "$work"
    run=(runuser -u postgres --)
fi

tests=()
for input in "$here/$1/$inputs"/*."$suffix"; do
    tests+=("$(basename "$input" ."$suffix")")
done

# Preloaded as in production, so that waiters are woken by commits (the worker stays off).
echo "shared_preload_libraries = 'durable_jobs'" > "$work/preload.conf"
cd "$work"
if ! "${run[@]}" "$regress" --temp-instance="$work/instance" --bindir="$bindir" \
        --temp-config="$work/preload.conf" \
        --inputdir="$work" --outputdir="$work" --load-extension=durable_jobs "${tests[@]}"; then
    cat "$work/regression.diffs" >&2 || true
    exit 1
fi
