-- durable_jobs status API: the row types the status functions return, and the audit of
-- cancellations and replays.

-- Who cancelled or replayed which job, when, and from what state. Read by the extension owner.
CREATE TABLE durable_jobs.durable_job_audit (
    audit_id               pg_catalog.int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id                 pg_catalog.int8 NOT NULL,
    action                 pg_catalog.text NOT NULL,
    acted_by               pg_catalog.name NOT NULL,
    acted_at               pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    previous_state         pg_catalog.text NOT NULL,
    previous_failure_code  pg_catalog.text,
    CONSTRAINT durable_job_audit_action_known CHECK (action IN ('cancel', 'replay'))
);

COMMENT ON TABLE durable_jobs.durable_job_audit IS
    'Cancellations and replays of durable_jobs jobs: who, when, and the state before.';

CREATE INDEX durable_job_audit_job_idx ON durable_jobs.durable_job_audit (job_id);
CREATE INDEX durable_job_audit_acted_at_idx ON durable_jobs.durable_job_audit (acted_at);

SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_audit', '');
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_audit_audit_id_seq', '');

-- A job as the status functions show it: never its payload or lease token.
CREATE TYPE durable_jobs.durable_job_status AS (
    job_id                pg_catalog.int8,
    queue_name            pg_catalog.text,
    job_kind              pg_catalog.text,
    job_state             pg_catalog.text,
    state_version         pg_catalog.int8,
    attempt_count         pg_catalog.int4,
    max_attempts          pg_catalog.int4,
    last_failure_code     pg_catalog.text,
    last_failure_sqlstate pg_catalog.text,
    priority              pg_catalog.int4,
    run_after             pg_catalog.timestamptz,
    lease_owner           pg_catalog.text,
    lease_expires_at      pg_catalog.timestamptz,
    idempotency_key       pg_catalog.text,
    enqueued_by           pg_catalog.name,
    created_at            pg_catalog.timestamptz,
    updated_at            pg_catalog.timestamptz,
    finished_at           pg_catalog.timestamptz,
    replay_count          pg_catalog.int4
);

-- The same, with the cursor that continues a listing after this row.
CREATE TYPE durable_jobs.durable_job_listing AS (
    job_id                pg_catalog.int8,
    queue_name            pg_catalog.text,
    job_kind              pg_catalog.text,
    job_state             pg_catalog.text,
    state_version         pg_catalog.int8,
    attempt_count         pg_catalog.int4,
    max_attempts          pg_catalog.int4,
    last_failure_code     pg_catalog.text,
    last_failure_sqlstate pg_catalog.text,
    priority              pg_catalog.int4,
    run_after             pg_catalog.timestamptz,
    lease_owner           pg_catalog.text,
    lease_expires_at      pg_catalog.timestamptz,
    idempotency_key       pg_catalog.text,
    enqueued_by           pg_catalog.name,
    created_at            pg_catalog.timestamptz,
    updated_at            pg_catalog.timestamptz,
    finished_at           pg_catalog.timestamptz,
    replay_count          pg_catalog.int4,
    page_cursor           pg_catalog.text
);

-- Each attempt of a job that ended otherwise than in success: failed (with the error, when the
-- worker passed it), its lease expired, or cancelled while it ran. A running or succeeded
-- attempt is the job's latest and is read from the job row (attempt_started_at,
-- attempt_worker_id), so the path of a job that succeeds writes no row here.
-- get_durable_job_attempts reads both; pruning deletes a job's rows with the job.
CREATE TABLE durable_jobs.durable_job_attempt (
    job_id        pg_catalog.int8 NOT NULL,
    attempt       pg_catalog.int4 NOT NULL,
    worker_id     pg_catalog.text,
    started_at    pg_catalog.timestamptz,
    ended_at      pg_catalog.timestamptz NOT NULL,
    outcome       pg_catalog.text NOT NULL,
    failure_code  pg_catalog.text,
    sqlstate      pg_catalog.text,
    error_message pg_catalog.text,
    PRIMARY KEY (job_id, attempt),
    CONSTRAINT durable_job_attempt_outcome_known CHECK (outcome IN ('failed', 'lease_expired', 'cancelled'))
);

COMMENT ON TABLE durable_jobs.durable_job_attempt IS
    'Attempts of durable_jobs jobs that failed, lost their lease or were cancelled. Read through get_durable_job_attempts.';

SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_attempt', '');

-- Jobs deleted (by pruning, or by hand) or truncated take their attempts with them: a job id
-- given out again (a TRUNCATE with RESTART IDENTITY, a sequence set back) must find none of the
-- old job's attempts, or their error texts. Statement triggers: nothing on the paths that only
-- insert and update jobs. As the extension's owner, which owns the attempts: a role that may
-- delete jobs need not be granted anything on them.
CREATE FUNCTION durable_jobs.forget_durable_job_attempts() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE durable_jobs.durable_job_attempt;
    ELSE
        DELETE FROM durable_jobs.durable_job_attempt a USING deleted_jobs d WHERE a.job_id = d.job_id;
    END IF;
    RETURN NULL;
END
$body$;

CREATE TRIGGER durable_job_truncate_attempts
    AFTER TRUNCATE ON durable_jobs.durable_job
    FOR EACH STATEMENT
    EXECUTE FUNCTION durable_jobs.forget_durable_job_attempts();

CREATE TRIGGER durable_job_delete_attempts
    AFTER DELETE ON durable_jobs.durable_job
    REFERENCING OLD TABLE AS deleted_jobs
    FOR EACH STATEMENT
    EXECUTE FUNCTION durable_jobs.forget_durable_job_attempts();
