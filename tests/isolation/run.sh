#!/usr/bin/env bash
# Runs the isolation specs (specs/*.spec, expected/*.out) with PostgreSQL's isolation tester on a
# temporary instance that has durable_jobs installed. As root, it runs as the postgres OS user.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
bindir=$("$PG_CONFIG" --bindir)
regress=$("$PG_CONFIG" --pkglibdir)/pgxs/src/test/isolation/pg_isolation_regress
work=/var/tmp/durable_jobs_isolation

rm -rf "$work"
mkdir -p "$work"
cp -r "$here/specs" "$here/expected" "$work/"
run=()
if [ "$(id -u)" -eq 0 ]; then
    chown -R postgres: "$work"
    run=(runuser -u postgres --)
fi

specs=()
for spec in "$here"/specs/*.spec; do
    specs+=("$(basename "$spec" .spec)")
done

cd "$work"
if ! "${run[@]}" "$regress" --temp-instance="$work/instance" --bindir="$bindir" \
        --inputdir="$work" --outputdir="$work" --load-extension=durable_jobs "${specs[@]}"; then
    cat "$work/regression.diffs" >&2 || true
    exit 1
fi
