#!/usr/bin/env bash
# Profiles one background worker draining no-op jobs, CPU-bound (synchronous_commit = off, so
# that the code and not the disk is measured), and prints the inclusive share of each function
# in the worker's samples: where its time goes, step by step.
#   BATCH (default 50): durable_jobs.claim_batch_size; JOBS (default 200000): jobs enqueued;
#   SECONDS_PROFILED (default 4): how long perf records, once the drain is under way;
#   PERCENT_LIMIT (default 0.5): the smallest share printed.
# Needs the extension installed (a --release build for figures that mean anything) and perf.
set -euo pipefail

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
bindir=$("$PG_CONFIG" --bindir)
BATCH=${BATCH:-50}
JOBS=${JOBS:-200000}
SECONDS_PROFILED=${SECONDS_PROFILED:-4}
PERCENT_LIMIT=${PERCENT_LIMIT:-0.5}
work=/var/tmp/durable_jobs_profile
source "$(dirname "$0")/cluster.sh"

rm -rf "$work"
mkdir -p "$work"
[ "$(id -u)" -ne 0 ] || chown postgres: "$work"
as_postgres "$bindir/initdb" -D "$work/data" --auth=trust -U postgres >/dev/null
cat <<CONF | as_postgres tee -a "$work/data/postgresql.conf" >/dev/null
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$work'
shared_buffers = '256MB'
synchronous_commit = off
shared_preload_libraries = 'durable_jobs'
durable_jobs.worker_count = 1
durable_jobs.worker_enabled = off
durable_jobs.claim_batch_size = $BATCH
autovacuum_naptime = '5s'
CONF
as_postgres "$bindir/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null

psql_q <<SQL >/dev/null
CREATE EXTENSION durable_jobs;
CREATE FUNCTION public.noop(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
SELECT durable_jobs.register_durable_job_handler('noop', 'public.noop(jsonb)');
SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('noop', array_fill('{"n": 1}'::jsonb, ARRAY[$JOBS]));
VACUUM ANALYZE durable_jobs.durable_job;
SQL
worker_pid=$(psql_q -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'durable_jobs worker'")
remaining() { psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state <> 'succeeded'"; }

psql_q -c "ALTER SYSTEM SET durable_jobs.worker_enabled = on" -c "SELECT pg_reload_conf()" >/dev/null
sleep 1
before=$(remaining)
start=$(date +%s.%N)
perf record -q -F 400 --call-graph dwarf -p "$worker_pid" -o "$work/perf.data" -- sleep "$SECONDS_PROFILED" 2>/dev/null
end=$(date +%s.%N)
after=$(remaining)
echo "drain while profiled (perf slows it): $(python3 -c "print(f'{($before - $after) / ($end - $start):.0f}')") jobs/s, batch $BATCH"
perf report -i "$work/perf.data" --children --stdio --sort symbol -g none --percent-limit "$PERCENT_LIMIT" 2>/dev/null |
    grep -v '^$' | grep -v '^#' | head -n "${ROWS:-120}"
