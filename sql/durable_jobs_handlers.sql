-- Handlers: the SQL function or procedure the background worker runs for each job kind.
CREATE TABLE durable_jobs.durable_job_handler (
    job_kind      pg_catalog.text PRIMARY KEY,
    -- The routine's signature, schema-qualified, as regprocedure prints it with search_path =
    -- pg_catalog. Text, not regprocedure: pg_upgrade refuses tables with regprocedure columns
    -- (their OIDs would not survive), and pg_dump restores a name, not an OID, anyway.
    handler       pg_catalog.text NOT NULL,
    registered_by pg_catalog.name NOT NULL,
    registered_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    CONSTRAINT durable_job_handler_kind_not_empty CHECK (job_kind <> '')
);

-- Registrations are the operator's data: pg_dump dumps them.
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_handler', '');

COMMENT ON TABLE durable_jobs.durable_job_handler IS
    'Job kinds the durable_jobs background worker runs, with their handlers. '
    'Write through register_durable_job_handler / unregister_durable_job_handler.';
