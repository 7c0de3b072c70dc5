-- durable_jobs 0.2.0 to 0.3.0: idempotency keys are unique per enqueuing role; claims never
-- wait on a queue's lock; durable_job_queue_running is VOLATILE; the worker's claim asks
-- durable_job_handler_serves whose jobs a registration serves. Run by ALTER EXTENSION durable_jobs UPDATE; tests/upgrade.rs checks that the
-- result equals a fresh 0.3.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE" to load this file. \quit

CREATE OR REPLACE FUNCTION durable_jobs.durable_job_queue_running(queue pg_catalog.text)
    RETURNS pg_catalog.int8
    LANGUAGE sql VOLATILE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
    SELECT pg_catalog.count(*) FROM durable_jobs.durable_job j
    WHERE j.queue_name = queue AND j.job_state = 'running'
      AND j.lease_expires_at > pg_catalog.clock_timestamp()
$body$;

-- Whether a limited queue can take one more running job, asked by claims for each candidate
-- of such a queue. Claimers of one limited queue take turns on a per-queue advisory lock held
-- to the end of the claiming transaction, so the next one counts the claims of the one before.
-- A claim never waits for it: while another transaction holds the lock, the queue counts as
-- full for this claim, so no session holding it (anyone can take an advisory lock) can stall a
-- claimer, and claimers of two limited queues cannot deadlock.
CREATE OR REPLACE FUNCTION durable_jobs.durable_job_queue_has_capacity(queue pg_catalog.text)
    RETURNS pg_catalog.bool
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock(
            pg_catalog.hashtext('durable_jobs queue'), pg_catalog.hashtext(queue)) THEN
        RETURN false;
    END IF;
    RETURN durable_jobs.durable_job_queue_running(queue) < COALESCE((SELECT q.concurrency_limit FROM durable_jobs.durable_job_queue q
                     WHERE q.queue_name = queue), 2147483647);
END
$body$;

-- Keys per queue and enqueuing role: every existing key stays unique under the new index.
DROP INDEX durable_jobs.durable_job_idempotency_key_idx;
CREATE UNIQUE INDEX durable_job_idempotency_key_idx
    ON durable_jobs.durable_job (queue_name, enqueued_by, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE FUNCTION durable_jobs.durable_job_handler_serves(registered_by pg_catalog.text,
                                                        enqueued_by pg_catalog.text)
    RETURNS pg_catalog.bool
    STRICT STABLE PARALLEL SAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'durable_job_handler_serves_wrapper';

-- As everything else in durable_jobs: no one but the owner until granted.
REVOKE ALL ON FUNCTION durable_jobs.durable_job_handler_serves(pg_catalog.text, pg_catalog.text) FROM PUBLIC;
