-- durable_jobs 0.5.0 back to 0.4.0: a queue's concurrency limit counts live leases only again.
-- Run by ALTER EXTENSION durable_jobs UPDATE TO '0.4.0'; tests/upgrade.rs checks that the result
-- equals a fresh 0.4.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.4.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION durable_jobs.durable_job_queue_running(queue pg_catalog.text)
    RETURNS pg_catalog.int8
    LANGUAGE sql VOLATILE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
    SELECT pg_catalog.count(*) FROM durable_jobs.durable_job j
    WHERE j.queue_name = queue AND j.job_state = 'running'
      AND j.lease_expires_at > pg_catalog.clock_timestamp()
$body$;

DROP FUNCTION durable_jobs.durable_job_row_held(pg_catalog.tid);
