-- durable_jobs: the job table, its constraints and the payload-clearing trigger.
-- Everything is schema-qualified: CREATE EXTENSION runs this with search_path = durable_jobs.

-- CREATE EXTENSION reuses an existing schema of that name; refuse one somebody else prepared,
-- since its owner could later replace what we put in it.
DO $guard$
BEGIN
    IF (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'durable_jobs')
       IS DISTINCT FROM (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = CURRENT_USER) THEN
        RAISE EXCEPTION 'schema durable_jobs exists and is owned by another role'
            USING ERRCODE = '42501',
                  HINT = 'Drop or rename that schema, then run CREATE EXTENSION durable_jobs again.';
    END IF;
END
$guard$;

REVOKE ALL ON SCHEMA durable_jobs FROM PUBLIC;

-- The table's CHECK constraints and the payload trigger's condition are C functions of the
-- library (src/constraints.rs, where each quotes the SQL it stands for): PostgreSQL reads CHECK
-- and WHEN expressions back from their stored text for every statement, and ours, written in
-- SQL, took half the time of a one-row enqueue. Each returns false exactly where that SQL is
-- false, and true where it is true or NULL.
CREATE FUNCTION durable_jobs.durable_job_state_known(job_state pg_catalog.text)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_state_known';
CREATE FUNCTION durable_jobs.durable_job_names_not_empty(queue_name pg_catalog.text, job_kind pg_catalog.text)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_names_not_empty';
CREATE FUNCTION durable_jobs.durable_job_priority_range(priority pg_catalog.int4)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_priority_range';
CREATE FUNCTION durable_jobs.durable_job_attempts_within_max(max_attempts pg_catalog.int4, attempt_count pg_catalog.int4)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_attempts_within_max';
CREATE FUNCTION durable_jobs.durable_job_payload_only_while_pending(job_state pg_catalog.text, payload pg_catalog.jsonb)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_payload_only_while_pending';
CREATE FUNCTION durable_jobs.durable_job_lease_only_while_running(
        job_state pg_catalog.text, lease_owner pg_catalog.text, lease_token pg_catalog.uuid,
        lease_expires_at pg_catalog.timestamptz)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_lease_only_while_running';
CREATE FUNCTION durable_jobs.durable_job_finished_only_when_terminal(
        job_state pg_catalog.text, finished_at pg_catalog.timestamptz)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_finished_only_when_terminal';
CREATE FUNCTION durable_jobs.durable_job_failure_code_known(last_failure_code pg_catalog.text)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_failure_code_known';
CREATE FUNCTION durable_jobs.durable_job_status_fields_valid(
        state_version pg_catalog.int8, replay_count pg_catalog.int4, last_failure_sqlstate pg_catalog.text)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_status_fields_valid';
CREATE FUNCTION durable_jobs.durable_job_terminal_row_uncleared(
        job_state pg_catalog.text, payload pg_catalog.jsonb, finished_at pg_catalog.timestamptz)
    RETURNS pg_catalog.bool LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_terminal_row_uncleared';

CREATE TABLE durable_jobs.durable_job (
    job_id            pg_catalog.int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_name        pg_catalog.text NOT NULL,
    job_kind          pg_catalog.text NOT NULL,
    payload           pg_catalog.jsonb,
    idempotency_key   pg_catalog.text,
    -- sha256 of the payload's canonical text, kept after the payload is cleared.
    payload_sha256    pg_catalog.bytea,
    job_state         pg_catalog.text NOT NULL DEFAULT 'available',
    priority          pg_catalog.int4 NOT NULL DEFAULT 0,
    run_after         pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    attempt_count     pg_catalog.int4 NOT NULL DEFAULT 0,
    max_attempts      pg_catalog.int4 NOT NULL,
    lease_owner       pg_catalog.text,
    lease_token       pg_catalog.uuid,
    lease_expires_at  pg_catalog.timestamptz,
    last_failure_code pg_catalog.text,
    enqueued_by       pg_catalog.name NOT NULL,
    created_at        pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    updated_at        pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    finished_at       pg_catalog.timestamptz,
    -- Moves up by one on every change of state or lease (not on a lease extension): an ETag.
    state_version     pg_catalog.int8 NOT NULL DEFAULT 1,
    -- The SQLSTATE of the handler error behind the last failure the background worker recorded.
    last_failure_sqlstate pg_catalog.text,
    replay_count      pg_catalog.int4 NOT NULL DEFAULT 0,
    -- The latest attempt's start and worker, kept after it ends: get_durable_job_attempts shows
    -- a running or succeeded attempt from them (durable_job_attempt keeps the others).
    attempt_started_at pg_catalog.timestamptz,
    attempt_worker_id pg_catalog.text,
    -- The place the job's latest run took in its queue's concurrency limit (durable_job_queue_slot);
    -- NULL when the queue had no limit when the job started.
    queue_slot        pg_catalog.int4,
    -- Jobs of one key run at most the queue's key_concurrency_limit at once; key_slot: the place
    -- of its key the job's latest run took (durable_job_key_slot).
    concurrency_key   pg_catalog.text,
    key_slot          pg_catalog.int4,

    CONSTRAINT durable_job_state_known CHECK (durable_jobs.durable_job_state_known(job_state)),
    CONSTRAINT durable_job_names_not_empty CHECK (durable_jobs.durable_job_names_not_empty(queue_name, job_kind)),
    CONSTRAINT durable_job_priority_range CHECK (durable_jobs.durable_job_priority_range(priority)),
    CONSTRAINT durable_job_attempts_within_max CHECK (
        durable_jobs.durable_job_attempts_within_max(max_attempts, attempt_count)),
    -- Pending jobs carry their payload; terminal jobs never do.
    CONSTRAINT durable_job_payload_only_while_pending CHECK (
        durable_jobs.durable_job_payload_only_while_pending(job_state, payload)),
    -- A running job holds a complete lease; no other state holds any part of one.
    CONSTRAINT durable_job_lease_only_while_running CHECK (
        durable_jobs.durable_job_lease_only_while_running(job_state, lease_owner, lease_token, lease_expires_at)),
    CONSTRAINT durable_job_finished_only_when_terminal CHECK (
        durable_jobs.durable_job_finished_only_when_terminal(job_state, finished_at)),
    CONSTRAINT durable_job_failure_code_known CHECK (
        durable_jobs.durable_job_failure_code_known(last_failure_code)),
    -- Every job enqueued since 0.4.0 has a fingerprint (replay compares against it); a keyed
    -- job always had one.
    CONSTRAINT durable_job_key_has_fingerprint CHECK (
        idempotency_key IS NULL OR payload_sha256 IS NOT NULL),
    CONSTRAINT durable_job_status_fields_valid CHECK (
        durable_jobs.durable_job_status_fields_valid(state_version, replay_count, last_failure_sqlstate))
);

COMMENT ON TABLE durable_jobs.durable_job IS
    'Jobs of the durable_jobs queue. Write through the durable_jobs functions only.';

-- One job per idempotency key, queue and enqueuing role, for as long as the job row exists.
CREATE UNIQUE INDEX durable_job_idempotency_key_idx
    ON durable_jobs.durable_job (queue_name, enqueued_by, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Claim order over the jobs a claim can take.
CREATE INDEX durable_job_claim_order_idx
    ON durable_jobs.durable_job (priority DESC, run_after, job_id)
    WHERE job_state IN ('available', 'running');

-- The claim order per kind: claims of some kinds (the background worker's registered kinds, a
-- claim's job_kinds) read only their kinds' ranges, merged (src/jobs/statements.rs).
CREATE INDEX durable_job_kind_claim_order_idx
    ON durable_jobs.durable_job (job_kind, priority DESC, run_after, job_id)
    WHERE job_state IN ('available', 'running');

-- Leases on a job's last attempt, for expiring them as lease_expired once they lapse (claims
-- reclaim the other lapsed leases through the claim order). Only a last attempt has an entry.
CREATE INDEX durable_job_exhausted_lease_idx
    ON durable_jobs.durable_job (lease_expires_at)
    WHERE job_state = 'running' AND attempt_count >= max_attempts;

-- Keyset pages of list_durable_jobs, newest first: one index range per enqueuing role and
-- state, with and without a queue, so that a page reads about one page of entries however deep
-- it is and however rare the state, and a caller reads only entries of roles it may see. The
-- role as text: a name would take 64 bytes in every entry. Running jobs have an index of their
-- own, so that a claim writes one listing entry, not two; job_id before queue_name keeps each
-- role's running jobs in page order, with or without a queue (checked inside the index).
CREATE INDEX durable_job_state_listing_idx
    ON durable_jobs.durable_job ((enqueued_by::pg_catalog.text), job_state, job_id)
    WHERE job_state <> 'running';
CREATE INDEX durable_job_queue_listing_idx
    ON durable_jobs.durable_job ((enqueued_by::pg_catalog.text), queue_name, job_state, job_id)
    WHERE job_state <> 'running';
CREATE INDEX durable_job_running_listing_idx
    ON durable_jobs.durable_job ((enqueued_by::pg_catalog.text), job_id, queue_name)
    WHERE job_state = 'running';

-- Running jobs by queue and place: what a claim reads to find which places of a limited queue
-- are taken (durable_job_take_queue_slot), and to count a queue's running jobs.
CREATE INDEX durable_job_running_queue_idx
    ON durable_jobs.durable_job (queue_name, queue_slot)
    WHERE job_state = 'running';

-- Running jobs of a key: which places of the key are taken (durable_job_take_key_slot).
CREATE INDEX durable_job_running_key_idx
    ON durable_jobs.durable_job (queue_name, concurrency_key, key_slot)
    WHERE job_state = 'running' AND concurrency_key IS NOT NULL;

-- Pending jobs of a key: whether a key's places are still needed (pruning).
CREATE INDEX durable_job_pending_key_idx
    ON durable_jobs.durable_job (queue_name, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND job_state IN ('available', 'running');

-- Finished jobs by age, for the retention pruning of the background workers.
CREATE INDEX durable_job_finished_idx
    ON durable_jobs.durable_job (finished_at)
    WHERE finished_at IS NOT NULL;

-- The jobs are data, not part of the extension's definition: pg_dump must dump them (and the
-- position of job_id's sequence with them), or a restore would come back with an empty queue.
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job', '');
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_job_id_seq', '');

-- Every claim and transition updates a row: vacuum often, so dead tuples do not pile up.
ALTER TABLE durable_jobs.durable_job SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02);

CREATE FUNCTION durable_jobs.clear_terminal_payload() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    NEW.payload := NULL;
    IF NEW.finished_at IS NULL THEN
        NEW.finished_at := pg_catalog.clock_timestamp();
    END IF;
    RETURN NEW;
END
$body$;

COMMENT ON FUNCTION durable_jobs.clear_terminal_payload() IS
    'Trigger: a job entering a terminal state loses its payload, whoever writes the row.';

-- Only when there is something to do: the completions clear both themselves, which spares a
-- PL/pgSQL call per completed job.
CREATE TRIGGER durable_job_clear_terminal_payload
    BEFORE INSERT OR UPDATE ON durable_jobs.durable_job
    FOR EACH ROW
    WHEN (durable_jobs.durable_job_terminal_row_uncleared(NEW.job_state, NEW.payload, NEW.finished_at))
    EXECUTE FUNCTION durable_jobs.clear_terminal_payload();

