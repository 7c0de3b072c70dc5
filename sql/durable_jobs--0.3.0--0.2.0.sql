-- durable_jobs 0.3.0 back to 0.2.0, for a rollback (docs/runbook.md): the 0.2.0 definitions of
-- the queue functions and idempotency keys unique per queue (this fails, changing nothing, while
-- two roles hold one key in one queue). Run by ALTER EXTENSION durable_jobs UPDATE TO '0.2.0' while the 0.3.0
-- library is installed; tests/upgrade.rs checks that the result equals a fresh 0.2.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.2.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION durable_jobs.durable_job_queue_running(queue pg_catalog.text)
    RETURNS pg_catalog.int8
    LANGUAGE sql STABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
    SELECT pg_catalog.count(*) FROM durable_jobs.durable_job j
    WHERE j.queue_name = queue AND j.job_state = 'running'
      AND j.lease_expires_at > pg_catalog.clock_timestamp()
$body$;

-- Whether a limited queue can take one more running job, asked by claims for each candidate
-- of such a queue. Claimers of one limited queue take turns on a per-queue advisory lock held
-- to the end of the claiming transaction, so the next one counts the claims of the one before;
-- claimers of other queues never wait for it.
CREATE OR REPLACE FUNCTION durable_jobs.durable_job_queue_has_capacity(queue pg_catalog.text)
    RETURNS pg_catalog.bool
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(
        pg_catalog.hashtext('durable_jobs queue'), pg_catalog.hashtext(queue));
    RETURN durable_jobs.durable_job_queue_running(queue) < COALESCE((SELECT q.concurrency_limit FROM durable_jobs.durable_job_queue q
                     WHERE q.queue_name = queue), 2147483647);
END
$body$;

DROP INDEX durable_jobs.durable_job_idempotency_key_idx;
CREATE UNIQUE INDEX durable_job_idempotency_key_idx
    ON durable_jobs.durable_job (queue_name, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

DROP FUNCTION durable_jobs.durable_job_handler_serves(pg_catalog.text, pg_catalog.text);
