-- durable_jobs 0.4.0 back to 0.3.0: drops the status API, its audit table (with what it
-- recorded) and the status columns, keeps fingerprints only for keyed jobs, as 0.3.0 does, and
-- writes the table's constraints in SQL again.
-- Every job stays. Run by ALTER EXTENSION durable_jobs UPDATE TO '0.3.0'; tests/upgrade.rs
-- checks that the result equals a fresh 0.3.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.3.0'" to load this file. \quit

-- The three-argument claim comes back, with the grants given on the four-argument one.
CREATE FUNCTION durable_jobs.claim_next_durable_job(
    worker_id pg_catalog.text,
    queue_names pg_catalog.text[] DEFAULT NULL,
    lease_seconds pg_catalog.int4 DEFAULT NULL)
    RETURNS TABLE (
        job_id pg_catalog.int8,
        lease_token pg_catalog.uuid,
        lease_expires_at pg_catalog.timestamptz,
        job_kind pg_catalog.text,
        payload pg_catalog.jsonb,
        attempt_count pg_catalog.int4,
        max_attempts pg_catalog.int4)
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'claim_next_durable_job_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4) FROM PUBLIC;
DO $carry$
DECLARE
    fresh_acl pg_catalog.aclitem[];
    given record;
BEGIN
    SELECT p.proacl INTO fresh_acl FROM pg_catalog.pg_proc p
    WHERE p.oid = 'durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4)'::pg_catalog.regprocedure;
    FOR given IN
        SELECT a.grantee, a.is_grantable
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid = 'durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4, pg_catalog.text[])'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4) TO %s%s',
            CASE WHEN given.grantee = 0 THEN 'PUBLIC' ELSE given.grantee::pg_catalog.regrole::pg_catalog.text END,
            CASE WHEN given.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    -- A GRANT in an extension script counts as the extension's own privilege, which pg_dump
    -- leaves out: record the function's privileges as a fresh install has them, so that the
    -- operators' grants stay theirs and are dumped.
    UPDATE pg_catalog.pg_init_privs SET initprivs = fresh_acl
    WHERE objoid = 'durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4)'::pg_catalog.regprocedure
      AND classoid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND objsubid = 0;
END
$carry$;
DROP FUNCTION durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4, pg_catalog.text[]);

DROP VIEW durable_jobs.durable_job_handlers, durable_jobs.durable_job_queue_controls;
CREATE OR REPLACE VIEW durable_jobs.durable_job_queue_summary AS
SELECT j.queue_name,
       j.job_state,
       pg_catalog.count(*) AS job_count,
       pg_catalog.max(pg_catalog.clock_timestamp() - j.run_after)
           FILTER (WHERE j.job_state = 'available' AND j.run_after <= pg_catalog.clock_timestamp())
           AS oldest_ready_age,
       pg_catalog.count(*)
           FILTER (WHERE j.job_state = 'running' AND j.lease_expires_at <= pg_catalog.clock_timestamp())
           AS expired_leases,
       COALESCE(q.paused, false) AS queue_paused,
       q.concurrency_limit
FROM durable_jobs.durable_job j
LEFT JOIN durable_jobs.durable_job_queue q ON q.queue_name = j.queue_name
GROUP BY j.queue_name, j.job_state, q.paused, q.concurrency_limit;

DROP FUNCTION durable_jobs.get_durable_job(pg_catalog.int8);
DROP FUNCTION durable_jobs.list_durable_jobs(pg_catalog.text, pg_catalog.text[], pg_catalog.text,
                                             pg_catalog.int4, pg_catalog.text);
DROP FUNCTION durable_jobs.wait_for_durable_job(pg_catalog.int8, pg_catalog.int8, pg_catalog.float8);
DROP FUNCTION durable_jobs.replay_durable_job(pg_catalog.int8, pg_catalog.jsonb, pg_catalog.int4);
DROP TYPE durable_jobs.durable_job_listing;
DROP TYPE durable_jobs.durable_job_status;
-- Out of the extension first, so that pg_dump's list of its data tables forgets them too.
ALTER EXTENSION durable_jobs DROP SEQUENCE durable_jobs.durable_job_audit_audit_id_seq;
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_audit;
DROP TABLE durable_jobs.durable_job_audit;

DROP INDEX durable_jobs.durable_job_state_listing_idx;
DROP INDEX durable_jobs.durable_job_queue_listing_idx;
DROP INDEX durable_jobs.durable_job_running_listing_idx;
DROP INDEX durable_jobs.durable_job_exhausted_lease_idx;
CREATE INDEX durable_job_lease_expiry_idx
    ON durable_jobs.durable_job (lease_expires_at)
    WHERE job_state = 'running';

ALTER TABLE durable_jobs.durable_job
    DROP CONSTRAINT durable_job_status_fields_valid,
    DROP CONSTRAINT durable_job_key_has_fingerprint;
UPDATE durable_jobs.durable_job SET payload_sha256 = NULL
WHERE idempotency_key IS NULL AND payload_sha256 IS NOT NULL;
-- The constraints in SQL again, as 0.3.0 writes them (one scan of the table to validate).
ALTER TABLE durable_jobs.durable_job
    ADD CONSTRAINT durable_job_key_has_fingerprint CHECK (
        (idempotency_key IS NULL) = (payload_sha256 IS NULL)),
    DROP COLUMN state_version,
    DROP COLUMN last_failure_sqlstate,
    DROP COLUMN replay_count,
    DROP CONSTRAINT durable_job_state_known,
    DROP CONSTRAINT durable_job_names_not_empty,
    DROP CONSTRAINT durable_job_priority_range,
    DROP CONSTRAINT durable_job_attempts_within_max,
    DROP CONSTRAINT durable_job_payload_only_while_pending,
    DROP CONSTRAINT durable_job_lease_only_while_running,
    DROP CONSTRAINT durable_job_finished_only_when_terminal,
    DROP CONSTRAINT durable_job_failure_code_known,
    ADD CONSTRAINT durable_job_state_known CHECK (
        job_state IN ('available', 'running', 'succeeded', 'failed', 'cancelled')),
    ADD CONSTRAINT durable_job_names_not_empty CHECK (queue_name <> '' AND job_kind <> ''),
    ADD CONSTRAINT durable_job_priority_range CHECK (priority BETWEEN -1000 AND 1000),
    ADD CONSTRAINT durable_job_attempts_within_max CHECK (
        max_attempts BETWEEN 1 AND 1000 AND attempt_count BETWEEN 0 AND max_attempts),
    ADD CONSTRAINT durable_job_payload_only_while_pending CHECK (
        (job_state IN ('available', 'running')) = (payload IS NOT NULL)),
    ADD CONSTRAINT durable_job_lease_only_while_running CHECK (
        CASE WHEN job_state = 'running'
             THEN lease_owner IS NOT NULL AND lease_token IS NOT NULL AND lease_expires_at IS NOT NULL
             ELSE lease_owner IS NULL AND lease_token IS NULL AND lease_expires_at IS NULL END),
    ADD CONSTRAINT durable_job_finished_only_when_terminal CHECK (
        (job_state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)),
    ADD CONSTRAINT durable_job_failure_code_known CHECK (
        last_failure_code IS NULL OR last_failure_code IN (
            'invalid_request', 'integrity_violation', 'target_rejected',
            'target_unavailable', 'unexpected_failure', 'lease_expired'));

DROP TRIGGER durable_job_clear_terminal_payload ON durable_jobs.durable_job;
CREATE TRIGGER durable_job_clear_terminal_payload
    BEFORE INSERT OR UPDATE ON durable_jobs.durable_job
    FOR EACH ROW
    WHEN (NEW.job_state IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION durable_jobs.clear_terminal_payload();

DROP FUNCTION
    durable_jobs.durable_job_state_known(pg_catalog.text),
    durable_jobs.durable_job_names_not_empty(pg_catalog.text, pg_catalog.text),
    durable_jobs.durable_job_priority_range(pg_catalog.int4),
    durable_jobs.durable_job_attempts_within_max(pg_catalog.int4, pg_catalog.int4),
    durable_jobs.durable_job_payload_only_while_pending(pg_catalog.text, pg_catalog.jsonb),
    durable_jobs.durable_job_lease_only_while_running(pg_catalog.text, pg_catalog.text, pg_catalog.uuid, pg_catalog.timestamptz),
    durable_jobs.durable_job_finished_only_when_terminal(pg_catalog.text, pg_catalog.timestamptz),
    durable_jobs.durable_job_failure_code_known(pg_catalog.text),
    durable_jobs.durable_job_status_fields_valid(pg_catalog.int8, pg_catalog.int4, pg_catalog.text),
    durable_jobs.durable_job_terminal_row_uncleared(pg_catalog.text, pg_catalog.jsonb, pg_catalog.timestamptz);
