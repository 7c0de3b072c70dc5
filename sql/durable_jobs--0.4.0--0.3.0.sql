-- durable_jobs 0.4.0 back to 0.3.0: drops the status API, its audit table (with what it
-- recorded) and the status columns, and keeps fingerprints only for keyed jobs, as 0.3.0 does.
-- Every job stays. Run by ALTER EXTENSION durable_jobs UPDATE TO '0.3.0'; tests/upgrade.rs
-- checks that the result equals a fresh 0.3.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.3.0'" to load this file. \quit

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

ALTER TABLE durable_jobs.durable_job
    DROP CONSTRAINT durable_job_status_fields_valid,
    DROP CONSTRAINT durable_job_key_has_fingerprint;
UPDATE durable_jobs.durable_job SET payload_sha256 = NULL
WHERE idempotency_key IS NULL AND payload_sha256 IS NOT NULL;
ALTER TABLE durable_jobs.durable_job
    ADD CONSTRAINT durable_job_key_has_fingerprint CHECK (
        (idempotency_key IS NULL) = (payload_sha256 IS NULL)),
    DROP COLUMN state_version,
    DROP COLUMN last_failure_sqlstate,
    DROP COLUMN replay_count;
