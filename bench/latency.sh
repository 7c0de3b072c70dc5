#!/usr/bin/env bash
# Splits the enqueue-to-start latency of the background worker into its steps: 500 jobs enqueued
# one at a time, 5 ms apart, into an idle queue (as bench/run.sh measures it), with durable
# commits and then with synchronous_commit = off (the difference is the WAL flushes on the
# path). Prints, per setting, pgbench's single-row UPDATE mean latency, the p50 and p99 from the
# enqueue's transaction start to the handler's first statement (jobs leased at enqueue to the
# sleeping worker: direct leases, the default), and the p50 of each step, from runs whose
# handler reads its own job: of a job leased at enqueue, the enqueue's transaction and from its
# commit record to the handler; of a job the worker claims (a run with direct leases off):
#   enqueue -> claim: the enqueue's statement and commit, the worker's wake-up, its poll up to
#                     the claim's write of the row (the row's updated_at, a clock reading), in two:
#     enqueue:          the enqueue's transaction, from its start to its commit record
#                       (track_commit_timestamp of the enqueuing transaction);
#     commit -> claim:  the enqueue's flush, the worker's wake-up and its poll up to the write;
#   claim:            the rest of the claim transaction, to its commit record
#                     (track_commit_timestamp);
#   claim -> handler: the claim's commit (its flush), the run transaction up to the handler.
# Needs the extension installed (a --release build for figures that mean anything).
set -euo pipefail

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
bindir=$("$PG_CONFIG" --bindir)
work=/var/tmp/durable_jobs_latency
source "$(dirname "$0")/cluster.sh"
pgbench_run() { as_postgres "$bindir/pgbench" -h 127.0.0.1 -p "$port" -n "$@" postgres 2>/dev/null; }

# Enqueues 500 jobs of `kind` one at a time and waits until all have run; with `keep_xid`, each
# enqueue also keeps its job id and transaction id (for its commit timestamp) in public.enqueued;
# with `claimed` as well, direct leases are off.
enqueue_one_at_a_time() {
    local enqueue="SELECT durable_jobs.enqueue_durable_job('$1', '{}')"
    [ "${2:-}" != keep_xid ] || enqueue="INSERT INTO public.enqueued $enqueue, txid_current()"
    # With `claimed`: direct leases off, so that the worker claims each job.
    [ "${3:-}" != claimed ] || enqueue="SET durable_jobs.direct_leases = off;
$enqueue"
    printf "%s;\n\\\\sleep 5 ms\n" "$enqueue" >"$work/enqueue.sql"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$work/enqueue.sql"
    pgbench_run -f "$work/enqueue.sql" -c 1 -t 500 >/dev/null
    until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state <> 'succeeded'")" = 0 ]; do
        sleep 0.05
    done
}

for synchronous_commit in on off; do
    stop_cluster
    rm -rf "$work"
    mkdir -p "$work"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$work"
    as_postgres "$bindir/initdb" -D "$work/data" --auth=trust -U postgres >/dev/null
    cat <<CONF | as_postgres tee -a "$work/data/postgresql.conf" >/dev/null
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$work'
shared_buffers = '256MB'
synchronous_commit = $synchronous_commit
track_commit_timestamp = on
shared_preload_libraries = 'durable_jobs'
durable_jobs.worker_count = 1
durable_jobs.worker_enabled = on
CONF
    as_postgres "$bindir/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null
    psql_q <<'SQL' >/dev/null
CREATE EXTENSION durable_jobs;
CREATE TABLE public.started (job_started timestamptz NOT NULL DEFAULT clock_timestamp(), job_id bigint,
                             created timestamptz, claim_started timestamptz, claim_committed timestamptz);
CREATE TABLE public.enqueued (job_id bigint, enqueue_xid bigint);
CREATE FUNCTION public.note_start(payload jsonb) RETURNS void LANGUAGE sql
    AS 'INSERT INTO public.started DEFAULT VALUES';
-- Reads its own job (the only one running): when it was enqueued, claimed and the claim committed.
CREATE FUNCTION public.note_steps(payload jsonb) RETURNS void LANGUAGE sql
    AS $$INSERT INTO public.started (job_id, created, claim_started, claim_committed)
         SELECT job_id, created_at, updated_at, pg_catalog.pg_xact_commit_timestamp(xmin)
         FROM durable_jobs.durable_job WHERE job_state = 'running'$$;
SELECT durable_jobs.register_durable_job_handler('latency', 'public.note_start(jsonb)');
SELECT durable_jobs.register_durable_job_handler('steps', 'public.note_steps(jsonb)');
SQL
    pgbench_run -i -s 1 -q >/dev/null
    printf '\\set aid random(1, 100000)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n' >"$work/update.sql"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$work/update.sql"
    update_ms=$(pgbench_run -f "$work/update.sql" -c 1 -T 5 | awk '/^latency average = / {print $4}')

    enqueue_one_at_a_time latency
    read -r p50 p99 < <(psql_q -F ' ' -c "
        WITH j AS (SELECT created_at, row_number() OVER (ORDER BY job_id) n FROM durable_jobs.durable_job),
             s AS (SELECT job_started, row_number() OVER (ORDER BY job_started) n FROM public.started),
             l AS (SELECT extract(epoch FROM s.job_started - j.created_at) * 1000 ms FROM j JOIN s USING (n))
        SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 3),
               round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 3) FROM l")
    # Steps of a job the enqueue leased to the sleeping worker (direct leases, the default):
    # the enqueue's transaction, and from its commit record to the handler (the flush, the
    # worker's wake-up, its run transaction up to the handler).
    psql_q -c "TRUNCATE durable_jobs.durable_job, public.started, public.enqueued" >/dev/null
    enqueue_one_at_a_time steps keep_xid
    read -r leased_enqueue leased_to_handler < <(psql_q -F ' ' -c "
        WITH t AS (SELECT s.*, pg_catalog.pg_xact_commit_timestamp(e.enqueue_xid::text::xid) AS enqueue_committed
                   FROM public.started s JOIN public.enqueued e USING (job_id))
        SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM enqueue_committed - created) * 1000)::numeric, 3),
               round(percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM job_started - enqueue_committed) * 1000)::numeric, 3)
        FROM t")
    # Steps of a job the worker claims (direct leases off).
    psql_q -c "TRUNCATE durable_jobs.durable_job, public.started, public.enqueued" >/dev/null
    enqueue_one_at_a_time steps keep_xid claimed
    read -r to_claim enqueue to_write claim to_handler < <(psql_q -F ' ' -c "
        WITH t AS (SELECT s.*, pg_catalog.pg_xact_commit_timestamp(e.enqueue_xid::text::xid) AS enqueue_committed
                   FROM public.started s JOIN public.enqueued e USING (job_id)),
             l AS (SELECT extract(epoch FROM claim_started - created) * 1000 to_claim,
                          extract(epoch FROM enqueue_committed - created) * 1000 enqueue,
                          extract(epoch FROM claim_started - enqueue_committed) * 1000 to_write,
                          extract(epoch FROM claim_committed - claim_started) * 1000 claim,
                          extract(epoch FROM job_started - claim_committed) * 1000 to_handler
                   FROM t)
        SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY to_claim)::numeric, 3),
               round(percentile_cont(0.5) WITHIN GROUP (ORDER BY enqueue)::numeric, 3),
               round(percentile_cont(0.5) WITHIN GROUP (ORDER BY to_write)::numeric, 3),
               round(percentile_cont(0.5) WITHIN GROUP (ORDER BY claim)::numeric, 3),
               round(percentile_cont(0.5) WITHIN GROUP (ORDER BY to_handler)::numeric, 3) FROM l")
    echo "synchronous_commit = $synchronous_commit: pgbench UPDATE ${update_ms} ms; enqueue-to-start p50 $p50 ms, p99 $p99 ms;" \
         "steps (p50), leased at enqueue: enqueue $leased_enqueue, commit -> handler $leased_to_handler ms;" \
         "claimed: enqueue -> claim $to_claim (enqueue $enqueue, commit -> claim $to_write), claim $claim," \
         "claim -> handler $to_handler ms"
done
