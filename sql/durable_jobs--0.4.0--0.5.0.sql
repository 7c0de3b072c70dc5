-- durable_jobs 0.4.0 to 0.5.0: a queue's concurrency limit also counts a running job whose
-- lapsed lease's row a transaction in progress holds (a worker's batch running it on a lease
-- renewed in its own transaction). Run by ALTER EXTENSION durable_jobs UPDATE; tests/upgrade.rs
-- checks that the result equals a fresh 0.5.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE" to load this file. \quit

CREATE FUNCTION durable_jobs.durable_job_row_held(row_version pg_catalog.tid)
    RETURNS pg_catalog.bool LANGUAGE c VOLATILE STRICT PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_row_held';
-- What an update creates belongs to the role that runs it, a superuser: the extension's owner
-- (another role after REASSIGN OWNED) takes it before the REVOKE, whose privileges are then
-- recorded as the owner's, as a fresh install by that role records them.
DO $hand_over$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_row_held(pg_catalog.tid) OWNER TO %s',
        (SELECT x.extowner::pg_catalog.regrole::pg_catalog.text FROM pg_catalog.pg_extension x
         WHERE x.extname = 'durable_jobs'));
END
$hand_over$;
REVOKE ALL ON FUNCTION durable_jobs.durable_job_row_held(pg_catalog.tid) FROM PUBLIC;

CREATE OR REPLACE FUNCTION durable_jobs.durable_job_queue_running(queue pg_catalog.text)
    RETURNS pg_catalog.int8
    LANGUAGE sql VOLATILE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
    SELECT pg_catalog.count(*) FROM ONLY durable_jobs.durable_job j
    WHERE j.queue_name = queue AND j.job_state = 'running'
      AND (j.lease_expires_at > pg_catalog.clock_timestamp() OR durable_jobs.durable_job_row_held(j.ctid))
$body$;
