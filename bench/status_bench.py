#!/usr/bin/env python3
"""Status API figures for bench/run.sh, each beside a reference measured in the same run.

- Wake latency: from the last statement before COMMIT to the moment wait_for_durable_job returned
  (both clock_timestamp() on the server, so client threads do not skew it), with 1 and 200 waiters
  woken by one commit. Reference: sessions blocked on the row locks of the same kind of commit,
  the fastest wake-at-commit PostgreSQL itself has.
- Worker throughput while 200 waiters sleep on jobs the worker runs, against the same drain with
  no waiter; and with the 200 woken for one job in ten, each moving on to a job further ahead.

Usage: status_bench.py PORT DRAIN_JOBS
"""
import statistics
import sys
import threading
import time

import psycopg

PORT, DRAIN_JOBS = sys.argv[1], int(sys.argv[2])
DSN = f"host=127.0.0.1 port={PORT} dbname=postgres user=postgres"


def connect():
    return psycopg.connect(DSN, autocommit=True)


def row(label, figure, ratio=""):
    print(f"{label:<58} {figure:>12} {ratio:>10}", flush=True)


def ratio(a, b):
    return f"{a / b:.2f}x" if b else "n/a"


def percentile(samples, p):
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]


admin = connect()


def sql(query, *args):
    with admin.cursor() as cur:
        cur.execute(query, args)
        return cur.fetchall() if cur.description else None


sql("""
CREATE TABLE IF NOT EXISTS public.bench_lock_row (id int PRIMARY KEY, touched int NOT NULL DEFAULT 0);
CREATE OR REPLACE FUNCTION public.bench_wait(job bigint) RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN PERFORM durable_jobs.wait_for_durable_job(job, 1, 30); RETURN clock_timestamp(); END $$;
CREATE OR REPLACE FUNCTION public.bench_lock_wait(row_id int) RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN PERFORM 1 FROM public.bench_lock_row WHERE id = row_id FOR UPDATE; RETURN clock_timestamp(); END $$;
""")
sql("INSERT INTO public.bench_lock_row (id) SELECT g FROM generate_series(1, 200) g ON CONFLICT DO NOTHING")


def set_worker(enabled, batch):
    sql(f"ALTER SYSTEM SET durable_jobs.worker_enabled = {'on' if enabled else 'off'}")
    sql(f"ALTER SYSTEM SET durable_jobs.claim_batch_size = {batch}")
    sql("SELECT pg_reload_conf()")


def wait_until_asleep(pids, wait_event_type):
    """Until every waiter's backend sleeps in the given kind of wait."""
    while True:
        (asleep,), = sql("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND wait_event_type = %s",
                         pids, wait_event_type)
        if asleep == len(pids):
            return
        time.sleep(0.002)


def wake_round(waiters, use_status_api):
    """One commit wakes len(waiters) sessions; returns each one's latency in ms."""
    n = len(waiters)
    committer = connect()
    woke = [None] * n
    with committer.cursor() as cur:
        cur.execute("BEGIN")
        if use_status_api:
            cur.execute("TRUNCATE durable_jobs.durable_job")
            cur.execute("COMMIT")
            cur.execute("SELECT durable_jobs.enqueue_durable_jobs('external', array_fill('{}'::jsonb, ARRAY[%s]))", (n,))
            targets = [r[0] for r in cur.fetchall()]
            cur.execute("BEGIN")
            call, wait_type = "SELECT public.bench_wait(%s)", "Extension"
        else:
            targets = list(range(1, n + 1))
            cur.execute("UPDATE public.bench_lock_row SET touched = touched + 1 WHERE id <= %s", (n,))
            call, wait_type = "SELECT public.bench_lock_wait(%s)", "Lock"

        def wait(i):
            with waiters[i].cursor() as wcur:
                wcur.execute(call, (targets[i],))
                woke[i] = wcur.fetchone()[0]

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_until_asleep([w.info.backend_pid for w in waiters], wait_type)
        if use_status_api:
            cur.execute("SELECT durable_jobs.cancel_durable_job(j) FROM unnest(%s::bigint[]) j", (targets,))
        cur.execute("SELECT clock_timestamp()")
        before_commit = cur.fetchone()[0]
        cur.execute("COMMIT")
        for t in threads:
            t.join()
    committer.close()
    return [(w - before_commit).total_seconds() * 1000 for w in woke]


set_worker(False, 1)
for n, rounds in ((1, 100), (200, 5)):
    waiters = [connect() for _ in range(n)]
    figures = {}
    for use_status_api in (False, True):
        samples = []
        for _ in range(rounds):
            samples += wake_round(waiters, use_status_api)
        figures[use_status_api] = (statistics.median(samples), percentile(samples, 0.99))
    for waiter in waiters:
        waiter.close()
    for i, p in enumerate(("p50", "p99")):
        ref, fig = figures[False][i], figures[True][i]
        row(f"row-lock waiters woken by commit, {n} waiter(s): {p} ms", f"{ref:.2f}")
        row(f"wait_for_durable_job woken by commit, {n}: {p} ms (vs lock)", f"{fig:.2f}", ratio(fig, ref))


def drain(waiter_count, cycling=False):
    """Jobs/s of one worker (batch 50) draining DRAIN_JOBS no-op jobs, with waiter_count sessions
    asleep on the last jobs of the drain (each waits for one, so all sleep while the worker runs);
    cycling: each waits on every 10th job in turn instead, moving 10 * waiter_count jobs ahead
    after each (a wake-up and a new wait for one job in ten)."""
    set_worker(False, 1)
    sql("TRUNCATE durable_jobs.durable_job")
    sql("SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('noop', array_fill('{\"n\": 1}'::jsonb, ARRAY[%s]))",
        DRAIN_JOBS)
    sql("VACUUM ANALYZE durable_jobs.durable_job")
    (first,), = sql("SELECT min(job_id) FROM durable_jobs.durable_job")
    conns = [connect() for _ in range(waiter_count)]
    errors = []

    def follow(i):
        try:
            with conns[i].cursor() as cur:
                jobs = (range(first + 10 * i, first + DRAIN_JOBS, 10 * waiter_count) if cycling
                        else [first + DRAIN_JOBS - 1 - i])
                for job in jobs:
                    cur.execute("SELECT job_state FROM durable_jobs.wait_for_durable_job(%s, NULL, 120)", (job,))
                    if cur.fetchone()[0] != "succeeded":
                        errors.append(f"job {job} not finished when its wait returned")
        except Exception as e:  # noqa: BLE001 - reported below, fails the benchmark
            errors.append(repr(e))

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(waiter_count)]
    for t in threads:
        t.start()
    if conns:
        wait_until_asleep([c.info.backend_pid for c in conns], "Extension")
    start = time.monotonic()
    set_worker(True, 50)
    while sql("SELECT count(*) FROM durable_jobs.durable_job WHERE job_state <> 'succeeded'")[0][0]:
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    set_worker(False, 1)
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    if errors:
        sys.exit(f"waiters failed: {errors[:3]}")
    return DRAIN_JOBS / elapsed


# Alternate them so that drift of the machine hits all alike; medians of five (a drain swings
# by 15 % or more between runs here).
runs = {"none": [], "asleep": [], "cycling": []}
for _ in range(5):
    runs["none"].append(drain(0))
    runs["asleep"].append(drain(200))
    runs["cycling"].append(drain(200, cycling=True))
none, asleep, cycling = (statistics.median(runs[k]) for k in ("none", "asleep", "cycling"))
row("worker drain, batch 50, no waiter (median of 5)", f"{none:.0f}")
row("same, 200 waiters asleep on its jobs (vs no waiter)", f"{asleep:.0f}", ratio(asleep, none))
row("same, 200 waiters woken for 1 job in 10 (vs no waiter)", f"{cycling:.0f}", ratio(cycling, none))
