-- durable_jobs 0.1.0 to 0.2.0: adds prune_durable_jobs; pg_dump dumps the jobs; pg_upgrade works.
-- Run by ALTER EXTENSION durable_jobs UPDATE; tests/upgrade.rs checks that the result equals a
-- fresh 0.2.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE" to load this file. \quit

CREATE FUNCTION durable_jobs.prune_durable_jobs(older_than pg_catalog.interval,
                                                max_jobs pg_catalog.int4 DEFAULT 10000)
    RETURNS pg_catalog.int8
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'prune_durable_jobs_wrapper';

-- As everything else in durable_jobs: no one but the owner until granted.
REVOKE ALL ON FUNCTION durable_jobs.prune_durable_jobs(pg_catalog.interval, pg_catalog.int4) FROM PUBLIC;

-- A regprocedure column made pg_upgrade refuse the cluster. Printed with only pg_catalog on the
-- path, every handler's name comes out schema-qualified (the SET ends with this script).
SET search_path = pg_catalog;
ALTER TABLE durable_jobs.durable_job_handler ALTER COLUMN handler TYPE pg_catalog.text
    USING handler::pg_catalog.text;

-- 0.1.0 left its tables out of pg_dump, so a restore lost every job.
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job', '');
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_job_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_handler', '');
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_queue', '');
