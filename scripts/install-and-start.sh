#!/usr/bin/env bash
# Installs everything durable_jobs needs, builds and installs the extension, and starts a local
# cluster with durable_jobs preloaded, its background worker on, and the extension created in
# database `postgres`.
#   PGPORT (default 5433) and DURABLE_JOBS_PGDATA (default /var/lib/postgresql/durable_jobs)
#   choose where it runs. Running it again rebuilds, reinstalls and restarts.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGPORT=${PGPORT:-5433}
PGDATA=${DURABLE_JOBS_PGDATA:-/var/lib/postgresql/durable_jobs}

bash scripts/install-prerequisites.sh

PG_CONFIG="$PG_CONFIG" bash scripts/install-extension.sh --release

bindir=$("$PG_CONFIG" --bindir)
as_postgres() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    mkdir -p "$PGDATA"
    chown postgres: "$PGDATA" 2>/dev/null || sudo chown postgres: "$PGDATA"
    as_postgres "$bindir/initdb" --auth-local=peer --auth-host=scram-sha-256 -U postgres -D "$PGDATA" >/dev/null
fi
# Our settings live in their own file, rewritten on every run.
cat <<CONF | as_postgres tee "$PGDATA/durable_jobs.conf" >/dev/null
port = $PGPORT
listen_addresses = 'localhost'
unix_socket_directories = '/var/run/postgresql'
shared_preload_libraries = 'durable_jobs'
durable_jobs.database = 'postgres'
durable_jobs.worker_enabled = on
# Room for each worker's role runner beside parallel query and logical replication (runbook).
max_worker_processes = 16
CONF
grep -qs "^include_if_exists = 'durable_jobs.conf'" "$PGDATA/postgresql.conf" ||
    echo "include_if_exists = 'durable_jobs.conf'" | as_postgres tee -a "$PGDATA/postgresql.conf" >/dev/null

mkdir -p /var/run/postgresql 2>/dev/null || true
chown postgres: /var/run/postgresql 2>/dev/null || true
if as_postgres "$bindir/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
    as_postgres "$bindir/pg_ctl" -D "$PGDATA" -w restart -l "$PGDATA/server.log" >/dev/null
else
    as_postgres "$bindir/pg_ctl" -D "$PGDATA" -w start -l "$PGDATA/server.log" >/dev/null
fi

as_postgres "$bindir/psql" -h /var/run/postgresql -p "$PGPORT" -d postgres -qX \
    -c "CREATE EXTENSION IF NOT EXISTS durable_jobs" \
    -c "ALTER EXTENSION durable_jobs UPDATE"

echo "durable_jobs is running on port $PGPORT (data in $PGDATA)."
echo "Connect with: runuser -u postgres -- psql -h /var/run/postgresql -p $PGPORT postgres"
