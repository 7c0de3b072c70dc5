# Sourced by bench/run.sh (BENCH_ONLY=limits, or a whole run): what queue limits, concurrency
# keys, rate limits and other kinds' backlogs cost, each figure beside the same measure without
# them, in the same run. Uses run.sh's cluster and helpers (psql_q, pgbench_run, set_worker,
# row, ratio, latency_of, $scripts).
LIMIT_DRAIN_JOBS=${LIMIT_DRAIN_JOBS:-20000}
KEYED_JOBS=${KEYED_JOBS:-100000}

limits_target() {  # label figure reference target(">=0.9", "<=1.5")
    python3 - "$@" <<'PY'
import sys
label, figure, reference, target = sys.argv[1:5]
try:
    ratio = float(figure) / float(reference)
    bound = float(target[2:])
    met = ratio >= bound if target.startswith(">=") else ratio <= bound
    print(f"{label:<58} {figure:>10} {reference:>10} {ratio:>7.2f}x {target + 'x':>8}  {'met' if met else 'NOT met'}")
except (ValueError, ZeroDivisionError):
    print(f"{label:<58} {figure:>10} {reference or '-':>10} {'n/a':>8} {target + 'x':>8}")
PY
}

# Jobs of queue flow drained by one worker in batches of 50 -> jobs/s; $1 the SQL that enqueues
# them (worker off). The drained jobs are deleted after, the rest of the table kept.
drain_flow() {
    set_worker off 1
    psql_q -c "$1" >/dev/null
    psql_q -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
    local jobs start end
    jobs=$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE queue_name = 'flow'")
    start=$(date +%s.%N)
    set_worker on 50
    until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE queue_name = 'flow' AND job_state <> 'succeeded'")" = 0 ]; do
        sleep 0.05
    done
    end=$(date +%s.%N)
    set_worker off 1
    psql_q -c "DELETE FROM durable_jobs.durable_job WHERE queue_name = 'flow'" -c "VACUUM durable_jobs.durable_job" >/dev/null
    python3 -c "print(f'{$jobs / ($end - $start):.0f}')"
}
flow_jobs="SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('noop', array_fill('{}'::jsonb, ARRAY[$LIMIT_DRAIN_JOBS]), queue_name => 'flow')"
mean() { python3 -c "import sys; print(f'{(float(sys.argv[1]) + float(sys.argv[2])) / 2:.0f}')" "$1" "$2"; }

echo
row "limits (each against the same without it, this run)" "figure" "ratio"
psql_q -c "TRUNCATE durable_jobs.durable_job" -c "ALTER SYSTEM SET durable_jobs.retention_period = 0" \
    -c "SELECT pg_reload_conf()" >/dev/null

# Ten idle limited queues beside 300,000 finished jobs, two interleaved rounds each.
psql_q -c "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, job_state, max_attempts, attempt_count,
                                                 enqueued_by, finished_at)
           SELECT 'done', 'noop', 'succeeded', 3, 1, 'postgres', now() FROM generate_series(1, 300000)" >/dev/null
unlimit_idle() { psql_q -c "SELECT durable_jobs.set_durable_job_queue_concurrency('idle_' || n, NULL) FROM generate_series(1, 10) n" >/dev/null; }
limit_idle() { psql_q -c "SELECT durable_jobs.set_durable_job_queue_concurrency('idle_' || n, 1) FROM generate_series(1, 10) n" >/dev/null; }
plain_a=$(drain_flow "$flow_jobs"); limit_idle; idle_a=$(drain_flow "$flow_jobs")
unlimit_idle; plain_b=$(drain_flow "$flow_jobs"); limit_idle; idle_b=$(drain_flow "$flow_jobs"); unlimit_idle
plain=$(mean "$plain_a" "$plain_b"); idle=$(mean "$idle_a" "$idle_b")
row "drain, batch 50, 300,000 finished jobs kept" "$plain" ""
row "  the same beside 10 idle limited queues" "$idle" "$(ratio "$idle" "$plain")"

# 10,000 keys limited to 1 each, 100,000 jobs, enqueued key after key (round-robin arrival) and
# key by key (each key's jobs together, its later ones behind its running one).
keyed_jobs() {  # $1 'key' for keys or 'NULL', $2 round | grouped
    local order; order=$([ "$2" = round ] && echo "g % 10000, g" || echo "g")
    echo "SELECT count(durable_jobs.enqueue_durable_job('noop', '{}', queue_name => 'flow',
                  concurrency_key => CASE WHEN '$1' = 'key' THEN 'key-' || (g % 10000) END))
          FROM (SELECT g FROM generate_series(0, $KEYED_JOBS - 1) g ORDER BY $order) o"
}
psql_q -c "SELECT durable_jobs.set_durable_job_queue_key_concurrency('flow', 1)" >/dev/null
unkeyed=$(drain_flow "$(keyed_jobs NULL round)")
keyed=$(drain_flow "$(keyed_jobs key round)")
grouped=$(drain_flow "$(keyed_jobs key grouped)")
psql_q -c "SELECT durable_jobs.set_durable_job_queue_key_concurrency('flow', NULL)" >/dev/null
row "drain, batch 50, $KEYED_JOBS jobs without keys" "$unkeyed" ""
row "  10,000 keys limited to 1, keys interleaved" "$keyed" "$(ratio "$keyed" "$unkeyed")"
row "  10,000 keys limited to 1, each key's jobs together" "$grouped" "$(ratio "$grouped" "$unkeyed")"

# Enqueue-to-start latency behind 50,000 ready jobs of a kind no handler serves, ahead in claim
# order; and a job_kinds claim of the SQL API beside the same backlog.
latency_p50() {
    psql_q -c "TRUNCATE public.started" >/dev/null
    set_worker on 1
    sleep 1
    pgbench_run -f "$scripts/enqueue_latency.sql" -c 1 -t 300 >/dev/null
    until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE job_kind LIKE 'latency%' AND job_state <> 'succeeded'")" = 0 ]; do sleep 0.05; done
    set_worker off 1
    psql_q -c "
    WITH j AS (SELECT created_at, row_number() OVER (ORDER BY job_id) n FROM durable_jobs.durable_job
               WHERE job_kind LIKE 'latency%'),
         s AS (SELECT job_started, row_number() OVER (ORDER BY job_started) n FROM public.started),
         l AS (SELECT extract(epoch FROM s.job_started - j.created_at) * 1000 ms FROM j JOIN s USING (n))
    SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 3) FROM l"
    psql_q -c "DELETE FROM durable_jobs.durable_job WHERE job_kind LIKE 'latency%'" >/dev/null
}
cat >"$scripts/kinds_claim.sql" <<'SQL'
SELECT job_id, lease_token FROM durable_jobs.claim_next_durable_job('bench-' || :client_id, job_kinds => ARRAY['wanted']) \gset
SELECT durable_jobs.complete_durable_job(:job_id, 'bench-' || :client_id, ':lease_token');
SQL
kinds_claim_ms() {
    psql_q -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('wanted', array_fill('{}'::jsonb, ARRAY[3000]))" \
        -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
    latency_of "$(pgbench_run -f "$scripts/kinds_claim.sql" -c 1 -t 2000)"
    psql_q -c "DELETE FROM durable_jobs.durable_job WHERE job_kind = 'wanted'" >/dev/null
}
[ "$(id -u)" -ne 0 ] || chown -R postgres: "$scripts"
psql_q -c "DELETE FROM durable_jobs.durable_job" -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
clear_p50=$(latency_p50); clear_claim=$(kinds_claim_ms)
psql_q -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('external', array_fill('{}'::jsonb, ARRAY[50000]),
                                                                 run_after => now() - interval '1 hour')" \
    -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
backlog_p50=$(latency_p50); backlog_claim=$(kinds_claim_ms)
psql_q -c "DELETE FROM durable_jobs.durable_job" -c "VACUUM durable_jobs.durable_job" >/dev/null
row "enqueue-to-start p50 ms" "$clear_p50" ""
row "  behind 50,000 ready jobs of an unhandled kind" "$backlog_p50" "$(ratio "$backlog_p50" "$clear_p50")"
row "job_kinds claim + complete, mean ms" "$clear_claim" ""
row "  behind 50,000 ready jobs of another kind" "$backlog_claim" "$(ratio "$backlog_claim" "$clear_claim")"

# A queue limited to 500 starts a second, 4 SQL-API claimers for 10 s, each claiming and
# completing a job in one transaction and, after a claim that took nothing, sleeping until the
# queue's next start (bench/rate_claimers.py): the rate reached, and the most starts in any window
# of T seconds against burst + rate * T (from each job's start, its token's time).
RATE=500; BURST=${RATE_BURST:-1}
psql_q -c "SELECT durable_jobs.set_durable_job_queue_rate('paced', $RATE, $BURST)" \
    -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('external', array_fill('{}'::jsonb, ARRAY[20000]), queue_name => 'paced')" >/dev/null
python3 "$(dirname "${BASH_SOURCE[0]}")/rate_claimers.py" "host=127.0.0.1 port=$port dbname=postgres user=postgres" 4 10
read -r achieved excess < <(psql_q -F ' ' -c "
    WITH s AS (SELECT attempt_started_at AS t FROM durable_jobs.durable_job
               WHERE queue_name = 'paced' AND attempt_started_at IS NOT NULL),
         w AS (SELECT window_s FROM unnest(ARRAY[0.01, 0.1, 1, 5]::float8[]) window_s),
         counts AS (SELECT w.window_s, a.t, (SELECT count(*) FROM s b WHERE b.t >= a.t
                                               AND b.t < a.t + make_interval(secs => w.window_s)) AS n
                    FROM s a, w)
    SELECT round((SELECT (count(*) - 1) / extract(epoch FROM max(t) - min(t)) FROM s)::numeric, 1),
           round(max(n - $RATE * window_s)::numeric, 2)
    FROM counts")
psql_q -c "SELECT durable_jobs.set_durable_job_queue_rate('paced', NULL)" -c "DELETE FROM durable_jobs.durable_job" >/dev/null
row "rate limit $RATE/s, burst $BURST, 4 claimers: starts/s" "$achieved" "$(ratio "$achieved" "$RATE")"
row "  most starts in any window over rate * window (<= burst)" "$excess" ""

echo
printf '%-58s %10s %10s %8s %8s\n' "limit targets" "figure" "reference" "ratio" "target"
limits_target "drain beside 10 idle limited queues, 300,000 finished" "$idle" "$plain" ">=0.9"
limits_target "enqueue-to-start p50 behind 50,000 unhandled" "$backlog_p50" "$clear_p50" "<=1.5"
limits_target "job_kinds claim behind 50,000 of another kind" "$backlog_claim" "$clear_claim" "<=1.5"
limits_target "drain of 10,000 keys limited to 1 vs no keys" "$keyed" "$unkeyed" ">=0.8"
limits_target "rate reached vs the limit" "$achieved" "$RATE" ">=0.95"
limits_target "  and no more" "$achieved" "$RATE" "<=1.0"
limits_target "most starts in a window, over rate * window, vs burst" "$excess" "$BURST" "<=1.0"
