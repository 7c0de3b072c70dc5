-- Queue controls and the operators' views.

-- One row per queue that has a control set; queues without a row are open.
CREATE TABLE durable_jobs.durable_job_queue (
    queue_name        pg_catalog.text PRIMARY KEY,
    paused            pg_catalog.bool NOT NULL DEFAULT false,
    -- At most this many jobs of the queue run at once (hold a live lease, or a lapsed one whose
    -- row another transaction holds); NULL: no limit.
    concurrency_limit pg_catalog.int4 CHECK (concurrency_limit BETWEEN 1 AND 100000),
    changed_by        pg_catalog.name NOT NULL,
    changed_at        pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- At most this many jobs of one concurrency_key run at once; NULL: no limit.
    key_concurrency_limit pg_catalog.int4 CHECK (key_concurrency_limit BETWEEN 1 AND 1000),
    -- At most rate_burst + rate_per_second * T claims start the queue's jobs in T seconds; NULL
    -- (both): no rate limit.
    rate_per_second   pg_catalog.float8 CHECK (rate_per_second > 0 AND rate_per_second <= 1000000),
    rate_burst        pg_catalog.int4 CHECK (rate_burst BETWEEN 1 AND 10000),
    CONSTRAINT durable_job_queue_rate_complete CHECK ((rate_per_second IS NULL) = (rate_burst IS NULL))
);

-- Queue controls are the operator's data: pg_dump dumps them.
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_queue', '');

COMMENT ON TABLE durable_jobs.durable_job_queue IS
    'Queue controls. Write through pause_durable_job_queue, resume_durable_job_queue and '
    'set_durable_job_queue_concurrency.';

-- Whether a row version of the job table is held by another transaction in progress (an update
-- or a row lock not yet committed): a C function of the library (src/jobs/held_rows.rs).
CREATE FUNCTION durable_jobs.durable_job_row_held(row_version pg_catalog.tid)
    RETURNS pg_catalog.bool LANGUAGE c VOLATILE STRICT PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'durable_job_row_held';

-- Jobs of a queue that run: hold a live lease, or a lapsed one while another transaction holds
-- their row (a worker's batch renews its later jobs' leases in its own transaction, and runs
-- them past the leases its claim committed). VOLATILE: it reads clock_timestamp().
CREATE FUNCTION durable_jobs.durable_job_queue_running(queue pg_catalog.text)
    RETURNS pg_catalog.int8
    LANGUAGE sql VOLATILE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
    SELECT pg_catalog.count(*) FROM ONLY durable_jobs.durable_job j
    WHERE j.queue_name = queue AND j.job_state = 'running'
      AND (j.lease_expires_at > pg_catalog.clock_timestamp() OR durable_jobs.durable_job_row_held(j.ctid))
$body$;

-- The places of each limited queue: one row per place, 1 to its concurrency limit, made by
-- set_durable_job_queue_concurrency. The rows hold nothing: a claim locks a place's row (SKIP
-- LOCKED) while it checks that no running job holds the place, and records the place on the job
-- it claims (queue_slot), so an open claim transaction holds only the places it took.
CREATE TABLE durable_jobs.durable_job_queue_slot (
    queue_name pg_catalog.text NOT NULL,
    slot       pg_catalog.int4 NOT NULL,
    PRIMARY KEY (queue_name, slot)
);
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_queue_slot', '');

-- The places of each key of a queue with a per-key limit, 1 to the limit, as for queues. Made
-- with a key's jobs: by their enqueue, by set_durable_job_queue_key_concurrency, or by the claim
-- that finds them missing.
CREATE TABLE durable_jobs.durable_job_key_slot (
    queue_name      pg_catalog.text NOT NULL,
    concurrency_key pg_catalog.text NOT NULL,
    slot            pg_catalog.int4 NOT NULL,
    PRIMARY KEY (queue_name, concurrency_key, slot)
);
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_key_slot', '');

-- The tokens of each queue with a rate limit, 1 to its burst: each starts one job, then is
-- usable again a period (burst / rate seconds) later (src/jobs/rates.rs).
CREATE TABLE durable_jobs.durable_job_rate_token (
    queue_name pg_catalog.text NOT NULL,
    token      pg_catalog.int4 NOT NULL,
    next_at    pg_catalog.timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (queue_name, token)
);
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_rate_token', '');

-- A free place of a limited queue for a job a claim is about to take, locked to the end of the
-- claiming transaction; NULL when every place is taken or locked by another claim, or when jobs
-- run outside the places (started before the limit was set, or above a lowered limit). C
-- functions of the library (src/jobs/slots.rs): the second returns the place the first gave the
-- job in the same claim statement.
CREATE FUNCTION durable_jobs.durable_job_take_queue_slot(
    queue pg_catalog.text, job_id pg_catalog.int8, row_version pg_catalog.tid)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 10000
    AS 'MODULE_PATHNAME', 'durable_job_take_queue_slot';
CREATE FUNCTION durable_jobs.durable_job_taken_queue_slot(job_id pg_catalog.int8)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'durable_job_taken_queue_slot';
-- Whether a claim took a token of a queue with a rate limit for the job.
CREATE FUNCTION durable_jobs.durable_job_take_rate_token(
    queue pg_catalog.text, job_id pg_catalog.int8, row_version pg_catalog.tid)
    RETURNS pg_catalog.bool LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 10000
    AS 'MODULE_PATHNAME', 'durable_job_take_rate_token';
-- When the same claim statement took the job's token: the start the job records.
CREATE FUNCTION durable_jobs.durable_job_rate_token_taken_at(job_id pg_catalog.int8)
    RETURNS pg_catalog.timestamptz LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'durable_job_rate_token_taken_at';
-- The same for a place of the job's key, in a queue with a per-key limit.
CREATE FUNCTION durable_jobs.durable_job_take_key_slot(
    queue pg_catalog.text, concurrency_key pg_catalog.text, job_id pg_catalog.int8, row_version pg_catalog.tid)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 10000
    AS 'MODULE_PATHNAME', 'durable_job_take_key_slot';
CREATE FUNCTION durable_jobs.durable_job_taken_key_slot(job_id pg_catalog.int8)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'durable_job_taken_key_slot';

-- Per queue and state: how many jobs, how long the oldest ready job has waited, and how many
-- running jobs hold an expired lease (their worker died or stalled); the queue's controls, with
-- (since 0.6.0) its keys at their limit and its usable rate tokens.
CREATE VIEW durable_jobs.durable_job_queue_summary AS
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
       q.concurrency_limit,
       q.key_concurrency_limit,
       CASE WHEN q.key_concurrency_limit IS NOT NULL THEN
       (SELECT pg_catalog.count(*) FROM (
            SELECT FROM durable_jobs.durable_job r
            WHERE r.queue_name = j.queue_name AND r.job_state = 'running' AND r.concurrency_key IS NOT NULL
              AND r.lease_expires_at > pg_catalog.clock_timestamp()
            GROUP BY r.concurrency_key
            HAVING pg_catalog.count(*) >= q.key_concurrency_limit) k) END AS keys_at_limit,
       q.rate_per_second,
       q.rate_burst,
       CASE WHEN q.rate_burst IS NOT NULL THEN
       (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job_rate_token t
        WHERE t.queue_name = j.queue_name AND t.token <= q.rate_burst AND t.next_at <= pg_catalog.clock_timestamp()) END AS rate_tokens
FROM durable_jobs.durable_job j
LEFT JOIN durable_jobs.durable_job_queue q ON q.queue_name = j.queue_name
GROUP BY j.queue_name, j.job_state, q.paused, q.concurrency_limit, q.key_concurrency_limit, q.rate_per_second,
         q.rate_burst
UNION ALL
-- A queue with a control but no job still shows, with no state, so that a paused queue is seen.
SELECT q.queue_name, NULL, 0, NULL, 0, q.paused, q.concurrency_limit, q.key_concurrency_limit,
       CASE WHEN q.key_concurrency_limit IS NOT NULL THEN
       (SELECT pg_catalog.count(*) FROM (
            SELECT FROM durable_jobs.durable_job r
            WHERE r.queue_name = q.queue_name AND r.job_state = 'running' AND r.concurrency_key IS NOT NULL
              AND r.lease_expires_at > pg_catalog.clock_timestamp()
            GROUP BY r.concurrency_key
            HAVING pg_catalog.count(*) >= q.key_concurrency_limit) k) END,
       q.rate_per_second, q.rate_burst,
       CASE WHEN q.rate_burst IS NOT NULL THEN
       (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job_rate_token t
        WHERE t.queue_name = q.queue_name AND t.token <= q.rate_burst AND t.next_at <= pg_catalog.clock_timestamp()) END
FROM durable_jobs.durable_job_queue q
WHERE NOT EXISTS (SELECT 1 FROM durable_jobs.durable_job j WHERE j.queue_name = q.queue_name);

-- Jobs that failed in the last hour, per queue and failure code.
CREATE VIEW durable_jobs.durable_job_recent_failures AS
SELECT j.queue_name, j.last_failure_code AS failure_code, pg_catalog.count(*) AS failed_last_hour
FROM durable_jobs.durable_job j
WHERE j.job_state = 'failed' AND j.finished_at > pg_catalog.clock_timestamp() - interval '1 hour'
GROUP BY j.queue_name, j.last_failure_code;

-- What an operator who registers handlers or controls queues may read of them. The WITH makes
-- them read-only whatever is granted on them (PostgreSQL does not update through a WITH query).
-- Since 0.6.0, whose jobs each registration serves, as durable_job_handler_serves decides: a
-- superuser's every role's; another role's its own (by name) and those of the roles, not
-- superusers, whose privileges it has (pg_has_role USAGE) and, from PostgreSQL 16 on, which it
-- may become (SET; the CASE keeps PostgreSQL 15, which has no such privilege, from evaluating it).
CREATE VIEW durable_jobs.durable_job_handlers AS
WITH h AS (SELECT * FROM durable_jobs.durable_job_handler)
SELECT h.job_kind, h.handler, h.registered_by, h.registered_at,
       COALESCE(a.rolsuper, false) AS serves_every_role,
       CASE WHEN a.rolsuper IS NOT TRUE THEN
           ARRAY(SELECT h.registered_by
                 UNION
                 SELECT e.rolname FROM pg_catalog.pg_roles e
                 WHERE NOT e.rolsuper AND pg_catalog.pg_has_role(a.oid, e.oid, 'USAGE')
                   AND CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 160000
                            THEN pg_catalog.pg_has_role(a.oid, e.oid, 'SET') ELSE true END
                 ORDER BY 1)
       END AS serves_roles
FROM h LEFT JOIN pg_catalog.pg_roles a ON a.rolname = h.registered_by;

CREATE VIEW durable_jobs.durable_job_queue_controls AS
WITH q AS (SELECT * FROM durable_jobs.durable_job_queue)
SELECT q.queue_name, q.paused, q.concurrency_limit, q.changed_by, q.changed_at, q.key_concurrency_limit,
       q.rate_per_second, q.rate_burst
FROM q;
