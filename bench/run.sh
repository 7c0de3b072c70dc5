#!/usr/bin/env bash
# durable_jobs benchmark: prints figures, each beside its ratio to the matching reference
# measured in the same run. Never passes or fails on speed.
#
# Runs on a throwaway local cluster (loopback only) with default durable settings
# (fsync = on, synchronous_commit = on) and durable_jobs preloaded. Needs the extension
# installed (scripts/run-tests.sh or `bash scripts/install-extension.sh --release`) and pgbench.
#   JOBS (default 10000): jobs per throughput run; DRAIN_JOBS (20000): jobs per worker drain;
#   WAITER_DRAIN_JOBS (60000): jobs per drain beside waiters (shorter drains weigh the fixed
#   cost of the last wake-ups more than the drain's own speed);
#   BENCH_ONLY=status: the status API figures only; BENCH_ONLY=throughput: all but those;
#   BENCH_ONLY=limits: the limits' figures only (bench/limits.sh; LIMIT_DRAIN_JOBS, KEYED_JOBS,
#   RATE_BURST).
#   The peer, graphile-worker (pinned in bench/graphile), is installed there with npm on first
#   use; its rows are skipped where node is missing.
set -euo pipefail

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
bindir=$("$PG_CONFIG" --bindir)
JOBS=${JOBS:-10000}
DRAIN_JOBS=${DRAIN_JOBS:-20000}
WAITER_DRAIN_JOBS=${WAITER_DRAIN_JOBS:-60000}
work=/var/tmp/durable_jobs_bench
source "$(dirname "$0")/cluster.sh"
pgbench_run() { as_postgres "$bindir/pgbench" -h 127.0.0.1 -p "$port" -n "$@" postgres 2>&1; }

start_cluster() {  # $1: worker_count
    cat <<CONF | as_postgres tee "$work/data/bench.conf" >/dev/null
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$work'
# The status API figures hold 200 waiting sessions.
max_connections = 250
shared_buffers = '256MB'
shared_preload_libraries = 'durable_jobs'
durable_jobs.worker_count = $1
durable_jobs.poll_interval = '1s'
# A busy queue table wants frequent vacuum (see docs/runbook.md, "Tuning").
autovacuum_naptime = '5s'
CONF
    as_postgres "$bindir/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null
}

rm -rf "$work"
mkdir -p "$work"
[ "$(id -u)" -ne 0 ] || chown postgres: "$work"
as_postgres "$bindir/initdb" -D "$work/data" --auth=trust -U postgres >/dev/null
echo "include 'bench.conf'" | as_postgres tee -a "$work/data/postgresql.conf" >/dev/null
start_cluster 1

# pgbench scripts
scripts=$work/scripts
mkdir -p "$scripts"
cat >"$scripts/update.sql" <<'SQL'
\set aid random(1, 100000)
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;
SQL
cat >"$scripts/raw_one.sql" <<'SQL'
BEGIN;
SELECT id FROM raw_job WHERE state = 'ready' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED \gset
UPDATE raw_job SET state = 'running' WHERE id = :id;
COMMIT;
UPDATE raw_job SET state = 'done' WHERE id = :id;
SQL
cat >"$scripts/raw_batch.sql" <<'SQL'
BEGIN;
WITH c AS (SELECT id FROM raw_job WHERE state = 'ready' ORDER BY id LIMIT 50 FOR UPDATE SKIP LOCKED),
     u AS (UPDATE raw_job r SET state = 'running' FROM c WHERE r.id = c.id RETURNING r.id)
SELECT array_agg(id)::text AS ids FROM u \gset
COMMIT;
UPDATE raw_job SET state = 'done' WHERE id = ANY (':ids'::bigint[]);
SQL
# The raw batch loop's shape over durable_jobs' own job table (its columns, indexes, constraints
# and trigger), writing what a claim and a completion write, with no handler, no fence and no
# per-job code: what the table alone lets a batch of 50 reach.
cat >"$scripts/table_batch.sql" <<'SQL'
BEGIN;
WITH c AS (SELECT job_id FROM durable_jobs.durable_job
           WHERE job_state = 'available' AND run_after <= clock_timestamp()
           ORDER BY priority DESC, run_after, job_id LIMIT 50 FOR UPDATE SKIP LOCKED),
     u AS (UPDATE durable_jobs.durable_job j
           SET job_state = 'running', state_version = j.state_version + 1, lease_owner = 'bench',
               lease_token = gen_random_uuid(), lease_expires_at = clock_timestamp() + interval '60 s',
               attempt_count = j.attempt_count + 1, updated_at = clock_timestamp()
           FROM c WHERE j.job_id = c.job_id RETURNING j.job_id)
SELECT array_agg(job_id)::text AS ids FROM u \gset
COMMIT;
UPDATE durable_jobs.durable_job
SET job_state = 'succeeded', payload = NULL, finished_at = clock_timestamp(), state_version = state_version + 1,
    lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = clock_timestamp()
WHERE job_id = ANY (':ids'::bigint[]);
SQL
cat >"$scripts/api_one.sql" <<'SQL'
SELECT job_id, lease_token FROM durable_jobs.claim_next_durable_job('bench-' || :client_id) \gset
SELECT durable_jobs.complete_durable_job(:job_id, 'bench-' || :client_id, ':lease_token');
SQL
cat >"$scripts/enqueue_one.sql" <<'SQL'
SELECT durable_jobs.enqueue_durable_job('noop', '{"n": 1}');
SQL
cat >"$scripts/enqueue_batch.sql" <<'SQL'
SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('noop', array_fill('{"n": 1}'::jsonb, ARRAY[100]));
SQL
# Status API pages against the same keyset read done by hand on the table.
cat >"$scripts/list_top.sql" <<'SQL'
SELECT count(*) FROM durable_jobs.list_durable_jobs(page_size => 100);
SQL
cat >"$scripts/raw_top.sql" <<'SQL'
SELECT count(*) FROM (SELECT * FROM durable_jobs.durable_job ORDER BY job_id DESC LIMIT 100) page;
SQL
cat >"$scripts/list_deep.sql" <<'SQL'
SELECT count(*) FROM durable_jobs.list_durable_jobs(page_size => 100, page_cursor => ':cursor');
SQL
cat >"$scripts/raw_deep.sql" <<'SQL'
SELECT count(*) FROM (SELECT * FROM durable_jobs.durable_job WHERE job_id < :deep_id ORDER BY job_id DESC LIMIT 100) page;
SQL
cat >"$scripts/list_sparse.sql" <<'SQL'
SELECT count(*) FROM durable_jobs.list_durable_jobs(job_states => '{failed}', page_size => 100);
SQL
cat >"$scripts/raw_sparse.sql" <<'SQL'
SELECT count(*) FROM (SELECT * FROM durable_jobs.durable_job WHERE job_state = 'failed' ORDER BY job_id DESC LIMIT 100) page;
SQL
cat >"$scripts/get_one.sql" <<'SQL'
\set id random(:low_id, :deep_id)
SELECT count(*) FROM durable_jobs.get_durable_job(:id);
SQL
cat >"$scripts/raw_get_one.sql" <<'SQL'
\set id random(:low_id, :deep_id)
SELECT count(*) FROM durable_jobs.durable_job WHERE job_id = :id;
SQL
# Every other job with direct leases off (kind latency_claimed): the worker claims it, as
# before 0.5.0; the two interleaved share every minute of the machine.
cat >"$scripts/enqueue_latency.sql" <<'SQL'
SELECT durable_jobs.enqueue_durable_job('latency', '{}');
\sleep 5 ms
SET durable_jobs.direct_leases = off;
SELECT durable_jobs.enqueue_durable_job('latency_claimed', '{}');
RESET durable_jobs.direct_leases;
\sleep 5 ms
SQL
[ "$(id -u)" -ne 0 ] || chown -R postgres: "$scripts"

psql_q <<'SQL' >/dev/null
CREATE EXTENSION durable_jobs;
CREATE FUNCTION public.noop(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
CREATE TABLE public.started (job_started timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION public.note_start(payload jsonb) RETURNS void LANGUAGE sql
    AS 'INSERT INTO public.started DEFAULT VALUES';
SELECT durable_jobs.register_durable_job_handler('noop', 'public.noop(jsonb)');
SELECT durable_jobs.register_durable_job_handler('latency', 'public.note_start(jsonb)');
SELECT durable_jobs.register_durable_job_handler('latency_claimed', 'public.note_start(jsonb)');
CREATE TABLE public.raw_job (id bigserial PRIMARY KEY, state text NOT NULL, payload jsonb);
CREATE INDEX raw_job_ready ON public.raw_job (id) WHERE state = 'ready';
SQL
pgbench_run -i -s 1 -q >/dev/null

# field of a pgbench report: tps or mean latency
tps_of() { awk '/^tps = / {print $3}' <<<"$1"; }
latency_of() { awk '/^latency average = / {print $4}' <<<"$1"; }
ratio() { python3 -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); print(f'{a / b:.2f}x' if b else 'n/a')" "$1" "$2"; }
row() { printf '%-58s %12s %10s\n' "$1" "$2" "$3"; }
reset_raw() { psql_q -c "TRUNCATE public.raw_job RESTART IDENTITY" -c "INSERT INTO public.raw_job (state, payload) SELECT 'ready', '{\"n\": 1}' FROM generate_series(1, $1)" -c "VACUUM ANALYZE public.raw_job" >/dev/null; }
reset_jobs() {  # $1 jobs of kind $2, all available
    psql_q -c "TRUNCATE durable_jobs.durable_job" \
        -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('$2', array_fill('{\"n\": 1}'::jsonb, ARRAY[$1]))" \
        -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
}
set_worker() {  # $1 on|off, $2 batch size
    psql_q -c "ALTER SYSTEM SET durable_jobs.worker_enabled = $1" -c "ALTER SYSTEM SET durable_jobs.claim_batch_size = $2" -c "SELECT pg_reload_conf()" >/dev/null
}
per_client() { echo $(( JOBS / $1 )); }

drain() {  # $1 workers, $2 batch size -> jobs/s
    set_worker off 1
    reset_jobs "$DRAIN_JOBS" noop
    local start end
    start=$(date +%s.%N)
    set_worker on "$2"
    until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state <> 'succeeded'")" = 0 ]; do sleep 0.05; done
    end=$(date +%s.%N)
    set_worker off 1
    python3 -c "print(f'{$DRAIN_JOBS / ($end - $start):.0f}')"
}

if [ "${BENCH_ONLY:-}" = limits ]; then
    echo "durable_jobs benchmark, limits only: $(nproc) cores, PostgreSQL $("$bindir/postgres" --version | awk '{print $3}')"
    source "$(dirname "$0")/limits.sh"
    exit 0
fi

echo "durable_jobs benchmark: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, PostgreSQL $("$bindir/postgres" --version | awk '{print $3}'), fsync on, synchronous_commit on"
echo "figures: jobs/s unless stated; ratio = figure / matching reference"

# BENCH_ONLY=status: only the status API figures (and what they need).
if [ "${BENCH_ONLY:-}" != status ]; then
echo
row "reference" "figure" "ratio"

declare -A ref fig
for clients in 1 2; do
    out=$(pgbench_run -f "$scripts/update.sql" -c "$clients" -j "$clients" -T 10)
    ref[update_$clients]=$(tps_of "$out"); ref[update_latency_$clients]=$(latency_of "$out")
    row "pgbench single-row UPDATE, $clients client(s): tps" "${ref[update_$clients]}" ""
    row "pgbench single-row UPDATE, $clients client(s): mean latency ms" "${ref[update_latency_$clients]}" ""
done
for clients in 1 2 4 8; do
    reset_raw "$JOBS"
    ref[raw_$clients]=$(tps_of "$(pgbench_run -f "$scripts/raw_one.sql" -c "$clients" -j "$clients" -t "$(per_client "$clients")")")
    row "raw SKIP LOCKED, claim then complete, $clients client(s)" "${ref[raw_$clients]}" ""
done
for clients in 1 2; do
    reset_raw $(( JOBS * 5 ))
    tps=$(tps_of "$(pgbench_run -f "$scripts/raw_batch.sql" -c "$clients" -j "$clients" -t $(( JOBS / 10 / clients )))")
    ref[raw_batch_$clients]=$(python3 -c "print(f'{$tps * 50:.0f}')")
    row "raw SKIP LOCKED, 50 per transaction, $clients client(s)" "${ref[raw_batch_$clients]}" ""
done
reset_jobs $(( JOBS * 5 )) noop
tps=$(tps_of "$(pgbench_run -f "$scripts/table_batch.sql" -c 1 -j 1 -t $(( JOBS / 10 )))")
ref[table_batch_1]=$(python3 -c "print(f'{$tps * 50:.0f}')")
row "same, 50 per transaction over durable_jobs' job table, 1 client" "${ref[table_batch_1]}" ""
# The queue users would pick instead, in its best configuration (bench/graphile), on this
# cluster while our worker is off; skipped where node is missing.
graphile() { bash "$(dirname "$0")/graphile/run.sh" "postgres://postgres@127.0.0.1:$port/postgres" "$@"; }
if out=$(graphile drain "$DRAIN_JOBS") && out+=$'\n'$(graphile latency 500); then
    ref[graphile_drain]=$(awk '/^graphile_drain_jobs_per_s / {print $2}' <<<"$out")
    ref[graphile_p50]=$(awk '/^graphile_latency_p50_ms / {print $2}' <<<"$out")
    row "graphile-worker 0.17.3 drain (concurrency 24, local queue 500)" "${ref[graphile_drain]}" ""
    row "graphile-worker enqueue-to-start latency p50 ms" "${ref[graphile_p50]}" ""
else
    echo "graphile-worker figures skipped (see above)"
fi
psql_q -c "DROP SCHEMA IF EXISTS graphile_worker, graphile_migrate CASCADE" >/dev/null 2>&1 || true

echo
row "durable_jobs" "figure" "ratio"
for workers in 1 2; do
    if [ "$workers" = 2 ]; then stop_cluster; start_cluster 2; fi
    figure=$(drain "$workers" 1)
    fig[batch1_$workers]=$figure
    row "worker drain, $workers worker(s), batch 1 (vs raw, $workers client(s))" "$figure" "$(ratio "$figure" "${ref[raw_$workers]}")"
    figure=$(drain "$workers" 50)
    fig[batch50_$workers]=$figure
    row "worker drain, $workers worker(s), batch 50 (vs raw 50/txn, $workers)" "$figure" "$(ratio "$figure" "${ref[raw_batch_$workers]}")"
done
stop_cluster; start_cluster 1

for clients in 1 2 4 8; do
    reset_jobs "$JOBS" external
    figure=$(tps_of "$(pgbench_run -f "$scripts/api_one.sql" -c "$clients" -j "$clients" -t "$(per_client "$clients")")")
    fig[api_$clients]=$figure
    row "SQL API claim + complete, $clients connection(s) (vs raw)" "$figure" "$(ratio "$figure" "${ref[raw_$clients]}")"
done

psql_q -c "TRUNCATE durable_jobs.durable_job" -c "TRUNCATE public.started" >/dev/null
set_worker on 1
sleep 1
# The machine drifts by a fifth either way within minutes (docs/benchmarks.md):
# the latency's reference is pgbench's UPDATE right before and right after it, averaged.
update_latency_now() { latency_of "$(pgbench_run -f "$scripts/update.sql" -c 1 -j 1 -T 5)"; }
latency_before=$(update_latency_now)
pgbench_run -f "$scripts/enqueue_latency.sql" -c 1 -t 500 >/dev/null
until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state <> 'succeeded'")" = 0 ]; do sleep 0.05; done
# Each job's start against its enqueue: the n-th start belongs to the n-th job.
latency_of_kind() {
    psql_q -F ' ' -c "
    WITH j AS (SELECT created_at, job_kind, row_number() OVER (ORDER BY job_id) n FROM durable_jobs.durable_job),
         s AS (SELECT job_started, row_number() OVER (ORDER BY job_started) n FROM public.started),
         l AS (SELECT extract(epoch FROM s.job_started - j.created_at) * 1000 ms
               FROM j JOIN s USING (n) WHERE j.job_kind = '$1')
    SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 2),
           round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 2) FROM l"
}
read -r p50 p99 < <(latency_of_kind latency)
read -r claimed_p50 claimed_p99 < <(latency_of_kind latency_claimed)
latency_after=$(update_latency_now)
ref[update_latency_around]=$(python3 -c "print(f'{($latency_before + $latency_after) / 2:.3f}')")
row "pgbench UPDATE mean latency ms right before / after it" "$latency_before / $latency_after" ""
row "enqueue-to-start latency p50 ms (vs that pgbench, averaged)" "$p50" "$(ratio "$p50" "${ref[update_latency_around]}")"
row "enqueue-to-start latency p99 ms (vs that pgbench, averaged)" "$p99" "$(ratio "$p99" "${ref[update_latency_around]}")"
row "  the same, interleaved, direct leases off: p50 / p99 ms" "$claimed_p50 / $claimed_p99" "$(ratio "$claimed_p50" "${ref[update_latency_around]}")"
set_worker off 1

for clients in 1 2; do
    psql_q -c "TRUNCATE durable_jobs.durable_job" >/dev/null
    figure=$(tps_of "$(pgbench_run -f "$scripts/enqueue_one.sql" -c "$clients" -j "$clients" -t "$(per_client "$clients")")")
    row "enqueue, one job per call, $clients client(s) (vs pgbench UPDATE)" "$figure" "$(ratio "$figure" "${ref[update_$clients]}")"
done
psql_q -c "TRUNCATE durable_jobs.durable_job" >/dev/null
tps=$(tps_of "$(pgbench_run -f "$scripts/enqueue_batch.sql" -c 1 -t $(( JOBS / 100 )))")
figure=$(python3 -c "print(f'{$tps * 100:.0f}')")
row "enqueue_durable_jobs, 100 per call, 1 client (vs pgbench UPDATE)" "$figure" "$(ratio "$figure" "${ref[update_1]}")"

# Table size with jobs flowing through under retention (kept 2 s, pruned by the worker).
psql_q -c "TRUNCATE durable_jobs.durable_job" -c "VACUUM durable_jobs.durable_job" \
    -c "ALTER SYSTEM SET durable_jobs.retention_period = 2" -c "SELECT pg_reload_conf()" >/dev/null
set_worker on 50
passed=0
size_started=$SECONDS
size_at() { psql_q -c "SELECT pg_total_relation_size('durable_jobs.durable_job')"; }
declare -A size
# Paced at 2,000 jobs/s (1,000 every half second) so that autovacuum (naptime 5 s) can keep
# pace; each size is taken once an autovacuum of the table has run after the flow stopped.
autovacuums() { psql_q -c "SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = 'durable_jobs.durable_job'::regclass"; }
for target in 20000 100000; do
    while [ "$passed" -lt "$target" ]; do
        round_started=$(date +%s.%N)
        psql_q -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('noop', array_fill('{\"n\": 1}'::jsonb, ARRAY[1000]))" >/dev/null
        passed=$(( passed + 1000 ))
        until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE finished_at IS NULL")" = 0 ]; do sleep 0.05; done
        sleep "$(python3 -c "import time; print(max(0.0, 0.5 - (time.time() - $round_started)))")"
    done
    before=$(autovacuums)
    for _ in $(seq 1 60); do [ "$(autovacuums)" -gt "$before" ] && break; sleep 0.5; done
    size[$target]=$(size_at)
    row "job table + indexes after $target jobs passed through, kB" "$(( size[$target] / 1024 ))" ""
done
row "size after 100,000 vs after 20,000" "" "$(ratio "${size[100000]}" "${size[20000]}")"
row "seconds for the 100,000 jobs to pass through" "$(( SECONDS - size_started ))" ""

# The targets: each beside the figure and reference of this run.
target_row() {  # label figure reference target(">=1.5", "<=3", or "" for none)
    python3 - "$@" <<'PY'
import sys
label, figure, reference, target = sys.argv[1:5]
try:
    ratio = float(figure) / float(reference)
    if not target:
        print(f"{label:<58} {figure:>10} {reference:>10} {ratio:>7.2f}x {'-':>9}")
        sys.exit(0)
    bound = float(target[2:])
    met = ratio >= bound if target.startswith(">=") else ratio <= bound
    print(f"{label:<58} {figure:>10} {reference:>10} {ratio:>7.2f}x {target + 'x':>8}  {'met' if met else 'NOT met'}")
except (ValueError, ZeroDivisionError):
    print(f"{label:<58} {figure:>10} {reference or '-':>10} {'n/a':>8} {target + 'x':>8}")
PY
}
echo
printf '%-58s %10s %10s %8s %8s\n' "targets" "figure" "reference" "ratio" "target"
target_row "worker batch 50 vs graphile-worker" "${fig[batch50_1]}" "${ref[graphile_drain]:-}" ">=1.5"
target_row "worker batch 50 vs raw 50/txn, 1 client" "${fig[batch50_1]}" "${ref[raw_batch_1]}" ">=0.8"
# Not targets: where the job table alone puts the batch (see docs/benchmarks.md).
target_row "  raw 50/txn over durable_jobs' table vs raw 50/txn" "${ref[table_batch_1]}" "${ref[raw_batch_1]}" ""
target_row "  worker batch 50 vs raw 50/txn over durable_jobs' table" "${fig[batch50_1]}" "${ref[table_batch_1]}" ""
target_row "worker batch 1 vs raw one-job loop, 1 client" "${fig[batch1_1]}" "${ref[raw_1]}" ">=1.0"
target_row "SQL API claim + complete, 1 connection vs raw" "${fig[api_1]}" "${ref[raw_1]}" ">=0.8"
target_row "SQL API claim + complete, 2 connections vs raw" "${fig[api_2]}" "${ref[raw_2]}" ">=0.8"
target_row "enqueue-to-start p50 ms vs pgbench 1-client latency" "$p50" "${ref[update_latency_around]}" "<=3"
target_row "  the same vs pgbench at the start of the run" "$p50" "${ref[update_latency_1]}" ""
target_row "  the same with direct leases off, interleaved" "$claimed_p50" "${ref[update_latency_around]}" ""
target_row "enqueue-to-start p50 ms vs graphile-worker p50" "$p50" "${ref[graphile_p50]:-}" "<=1"
target_row "size after 100,000 jobs vs after 20,000" "${size[100000]}" "${size[20000]}" "<=2"
source "$(dirname "$0")/limits.sh"
fi

[ "${BENCH_ONLY:-}" != throughput ] || exit 0
echo
row "status API" "figure" "ratio"
psql_q -c "ALTER SYSTEM RESET durable_jobs.retention_period" -c "SELECT pg_reload_conf()" >/dev/null
set_worker off 1
python3 "$(dirname "$0")/status_bench.py" "$port" "$WAITER_DRAIN_JOBS"

# The claim path with and without the two listing indexes (written on every transition),
# alternated twice; the figures are the better of the two runs of each.
declare -A claim
listing_indexes=$(psql_q -c "SELECT string_agg(pg_get_indexdef(indexrelid), '; ') FROM pg_index
                             WHERE indexrelid IN ('durable_jobs.durable_job_state_listing_idx'::regclass,
                                                  'durable_jobs.durable_job_queue_listing_idx'::regclass)")
for round in 1 2; do
    for indexes in with without; do
        if [ "$indexes" = without ]; then
            psql_q -c "DROP INDEX durable_jobs.durable_job_state_listing_idx, durable_jobs.durable_job_queue_listing_idx" >/dev/null
        fi
        reset_jobs "$JOBS" external
        api=$(tps_of "$(pgbench_run -f "$scripts/api_one.sql" -c 1 -t "$JOBS")")
        batch=$(drain 1 50)
        if [ "$indexes" = without ]; then
            psql_q -c "$listing_indexes" >/dev/null
        fi
        claim[api_$indexes]=$(python3 -c "print(max(float('$api'), float('${claim[api_$indexes]:-0}')))")
        claim[batch_$indexes]=$(python3 -c "print(max(float('$batch'), float('${claim[batch_$indexes]:-0}')))")
    done
done
row "SQL API claim + complete, 1 connection, no listing index" "${claim[api_without]%.*}" ""
row "same, with the two listing indexes (vs without)" "${claim[api_with]%.*}" "$(ratio "${claim[api_with]}" "${claim[api_without]}")"
row "worker drain, batch 50, no listing index" "${claim[batch_without]%.*}" ""
row "same, with the two listing indexes (vs without)" "${claim[batch_with]%.*}" "$(ratio "${claim[batch_with]}" "${claim[batch_without]}")"

# Pages of 200,000 finished jobs (finished by hand: setup, not measured), 20 of them failed.
psql_q -c "TRUNCATE durable_jobs.durable_job" \
    -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('noop', array_fill('{\"n\": 1}'::jsonb, ARRAY[200000]))" \
    -c "UPDATE durable_jobs.durable_job SET attempt_count = 1, finished_at = now(), state_version = 3,
            job_state = CASE WHEN job_id % 10000 = 0 THEN 'failed' ELSE 'succeeded' END,
            last_failure_code = CASE WHEN job_id % 10000 = 0 THEN 'target_rejected' END" \
    -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
read -r low_id deep_id < <(psql_q -F ' ' -c "SELECT min(job_id), min(job_id) + 100000 FROM durable_jobs.durable_job")
# The cursor of the row at depth ~100,000, reached by walking 100 pages of 1000.
cursor=$(psql_q -c "
    WITH RECURSIVE walk(pages, page_cursor) AS (
        SELECT 0, NULL::text
        UNION ALL
        SELECT pages + 1, (SELECT l.page_cursor FROM durable_jobs.list_durable_jobs(page_size => 1000, page_cursor => walk.page_cursor) l
                           ORDER BY l.job_id LIMIT 1)
        FROM walk WHERE pages < 100)
    SELECT page_cursor FROM walk WHERE pages = 100")
deep_id=$(( 16#${cursor%%-*} ))  # the cursor starts with the job id in hex
page_ms() { latency_of "$(pgbench_run -f "$scripts/$1.sql" -c 1 -T 5 -D "cursor=$cursor" -D "deep_id=$deep_id" -D "low_id=$low_id")"; }
for page in top deep sparse; do
    case $page in
        top) label="page of 100 at depth 0" ;;
        deep) label="page of 100 at depth ~100,000" ;;
        sparse) label="page of the 20 failed among 200,000" ;;
    esac
    reference=$(page_ms "raw_$page"); figure=$(page_ms "list_$page")
    row "raw keyset read, $label: ms" "$reference" ""
    row "list_durable_jobs, $label: ms (vs raw)" "$figure" "$(ratio "$figure" "$reference")"
done
reference=$(page_ms raw_get_one); figure=$(page_ms get_one)
row "raw read of one job by id: ms" "$reference" ""
row "get_durable_job: ms (vs raw)" "$figure" "$(ratio "$figure" "$reference")"
