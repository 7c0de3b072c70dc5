-- durable_jobs 0.2.0 back to 0.1.0, for a rollback (docs/runbook.md): undoes what 0.2.0 added.
-- Run by ALTER EXTENSION durable_jobs UPDATE TO '0.1.0' while the 0.2.0 library is installed;
-- tests/upgrade.rs checks that the result equals a fresh 0.1.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.1.0'" to load this file. \quit

DROP FUNCTION durable_jobs.prune_durable_jobs(pg_catalog.interval, pg_catalog.int4);

ALTER TABLE durable_jobs.durable_job_handler ALTER COLUMN handler TYPE pg_catalog.regprocedure
    USING handler::pg_catalog.regprocedure;

-- Leaving and rejoining the extension is the one way to take a table off pg_dump's list.
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job;
ALTER EXTENSION durable_jobs ADD TABLE durable_jobs.durable_job;
ALTER EXTENSION durable_jobs DROP SEQUENCE durable_jobs.durable_job_job_id_seq;
ALTER EXTENSION durable_jobs ADD SEQUENCE durable_jobs.durable_job_job_id_seq;
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_handler;
ALTER EXTENSION durable_jobs ADD TABLE durable_jobs.durable_job_handler;
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_queue;
ALTER EXTENSION durable_jobs ADD TABLE durable_jobs.durable_job_queue;
