-- durable_jobs 0.5.0 to 0.6.0: a handler runs as its job's enqueuer only when the role that
-- registered it and the role that owns it already hold the enqueuer's rights (the library
-- applies that rule from the moment it is loaded, whatever the schema's version); the view
-- durable_job_handlers shows whom each registration serves; each job keeps the history of its
-- attempts, with the error text of failed ones (get_durable_job_attempts, fail_durable_job's
-- error_message); diagnose_durable_job says why a job is where it is; enqueue_or_get_durable_job
-- tells whether an enqueue created its job; queue concurrency limits are kept by place, not by
-- an advisory lock; jobs get concurrency keys, and queues limits per key and rate limits. Run by ALTER EXTENSION durable_jobs UPDATE; tests/upgrade.rs checks that the
-- result equals a fresh 0.6.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE" to load this file. \quit

-- Columns added at the end: the view keeps its owner and its grants.
CREATE OR REPLACE VIEW durable_jobs.durable_job_handlers AS
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

-- Each registration whose jobs the background worker treats otherwise under the new rule than
-- under 0.5.0's, as a WARNING (PostgreSQL raises client_min_messages to WARNING while it runs
-- an extension script), one per registration and change:
-- - left to external workers: a member of the registering role, which holds none of its rights;
-- - claimed and now failed: the handler's owner holds none of the role's rights (the registering
--   role's own jobs too, when a group it is a member of owns the routine), or the role may not
--   execute the handler; its jobs fail target_rejected;
-- - now run: jobs the worker now claims and runs, which it left to external workers, or failed.
-- Registrations whose routine no longer exists are left out (they run nothing either way), as
-- are PostgreSQL's predefined roles (pg_monitor and the like, which enqueue nothing), and every
-- database but the one the background workers work in, when that is known. Names are shown with
-- control characters replaced, so that none can forge a log line.
DO $report$
DECLARE
    change record;
BEGIN
    IF pg_catalog.current_setting('durable_jobs.database', true) IS DISTINCT FROM NULL
       AND pg_catalog.current_setting('durable_jobs.database', true) <> pg_catalog.current_database() THEN
        RETURN;
    END IF;
    FOR change IN
        WITH registration AS (
            SELECT h.job_kind, h.registered_by, h.handler, p.oid AS routine, p.pronamespace AS routine_schema,
                   a.oid AS registrant, a.rolsuper AS registrant_is_superuser,
                   o.oid AS owner, o.rolsuper AS owner_is_superuser
            FROM durable_jobs.durable_job_handler h
            JOIN pg_catalog.pg_roles a ON a.rolname = h.registered_by
            JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(h.handler)
            JOIN pg_catalog.pg_roles o ON o.oid = p.proowner),
        rights AS (
            -- For each registration and role, the registering one included: whose code ran for it
            -- under 0.5.0 (the roles that had the author's privileges) and does now (the roles
            -- whose rights the author holds, and from PostgreSQL 16 may become).
            SELECT r.*, e.rolname AS enqueuer_name,
                   pg_catalog.has_function_privilege(e.oid, r.routine, 'EXECUTE')
                   AND pg_catalog.has_schema_privilege(e.oid, r.routine_schema, 'USAGE') AS may_execute,
                   r.registrant_is_superuser OR pg_catalog.pg_has_role(e.oid, r.registrant, 'USAGE') AS claimed_before,
                   r.registrant_is_superuser
                   OR (pg_catalog.pg_has_role(r.registrant, e.oid, 'USAGE')
                       AND CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 160000
                                THEN pg_catalog.pg_has_role(r.registrant, e.oid, 'SET') ELSE true END) AS claimed_now,
                   r.owner_is_superuser OR e.oid = r.owner
                   OR pg_catalog.pg_has_role(e.oid, r.owner, 'USAGE') AS owner_before,
                   r.owner_is_superuser OR e.oid = r.owner
                   OR (pg_catalog.pg_has_role(r.owner, e.oid, 'USAGE')
                       AND CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 160000
                                THEN pg_catalog.pg_has_role(r.owner, e.oid, 'SET') ELSE true END) AS owner_now
            FROM registration r
            JOIN pg_catalog.pg_roles e ON NOT e.rolsuper AND e.oid >= 16384),
        outcome AS (
            SELECT x.job_kind, x.registered_by, x.handler, x.enqueuer_name,
                   CASE WHEN NOT x.claimed_before THEN 'left'
                        WHEN x.owner_before AND x.may_execute THEN 'ran' ELSE 'failed' END AS before,
                   CASE WHEN NOT x.claimed_now THEN 'left'
                        WHEN x.owner_now AND x.may_execute THEN 'ran' ELSE 'failed' END AS now
            FROM rights x),
        shown AS (
            SELECT o.job_kind, o.registered_by, o.handler, o.now,
                   pg_catalog.regexp_replace(pg_catalog.quote_ident(o.enqueuer_name), '[[:cntrl:]]', '?', 'g') AS who,
                   (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job d
                    WHERE d.job_kind = o.job_kind AND d.enqueued_by = o.enqueuer_name
                      AND d.job_state IN ('available', 'running')) AS pending
            FROM outcome o
            WHERE o.before <> o.now)
        SELECT s.now,
               pg_catalog.regexp_replace(s.handler, '[[:cntrl:]]', '?', 'g') AS handler,
               pg_catalog.regexp_replace(pg_catalog.quote_literal(s.job_kind), '[[:cntrl:]]', '?', 'g') AS job_kind,
               pg_catalog.regexp_replace(pg_catalog.quote_ident(s.registered_by), '[[:cntrl:]]', '?', 'g') AS registered_by,
               pg_catalog.string_agg(s.who, ', ' ORDER BY s.who) AS roles,
               pg_catalog.sum(s.pending) AS pending
        FROM shown s
        GROUP BY s.job_kind, s.registered_by, s.handler, s.now
        ORDER BY s.job_kind, s.now
    LOOP
        RAISE WARNING USING
            MESSAGE = pg_catalog.format(
                'durable_jobs: the handler %s registered for job kind %s by %s %s the jobs of %s (%s of them pending)',
                change.handler, change.job_kind, change.registered_by,
                CASE change.now
                    WHEN 'left' THEN 'now leaves to external workers'
                    WHEN 'failed' THEN 'now fails with target_rejected'
                    ELSE 'now runs' END,
                change.roles || CASE change.now
                    WHEN 'left' THEN ' (the registering role holds none of their rights)'
                    WHEN 'failed' THEN ' (the handler''s owner holds none of their rights, or they may not execute it)'
                    ELSE ' (the registering role and the handler''s owner hold their rights)' END,
                change.pending),
            HINT = CASE change.now
                WHEN 'ran' THEN 'Unregister the kind, or register it as another role, if external workers are to keep '
                                'serving those roles.'
                ELSE 'A role''s code runs as another role only when it holds that role''s rights, so a group''s '
                     'handler never runs as its members. Register the handler as a role that holds the rights of '
                     'each role whose jobs it is to run (a role granted each of them: GRANT app_alice, app_bob TO '
                     'app_admin), with a routine that role or a superuser owns (ALTER FUNCTION ... OWNER TO); or '
                     'have the members enqueue as the group (SET ROLE). durable_jobs.durable_job_handlers shows '
                     'whom each registration serves.'
                END;
    END LOOP;
END
$report$;

-- The attempt history. Jobs enqueued before keep no history of the attempts they made before.
ALTER TABLE durable_jobs.durable_job
    ADD COLUMN attempt_started_at pg_catalog.timestamptz,
    ADD COLUMN attempt_worker_id pg_catalog.text;

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
REVOKE ALL ON durable_jobs.durable_job_attempt FROM PUBLIC;

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
REVOKE ALL ON FUNCTION durable_jobs.forget_durable_job_attempts() FROM PUBLIC;

CREATE FUNCTION durable_jobs.get_durable_job_attempts(job_id pg_catalog.int8)
    RETURNS TABLE (
        attempt pg_catalog.int4,
        worker_id pg_catalog.text,
        started_at pg_catalog.timestamptz,
        ended_at pg_catalog.timestamptz,
        outcome pg_catalog.text,
        failure_code pg_catalog.text,
        sqlstate pg_catalog.text,
        error_message pg_catalog.text)
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'get_durable_job_attempts_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.get_durable_job_attempts(pg_catalog.int8) FROM PUBLIC;

CREATE FUNCTION durable_jobs.enqueue_or_get_durable_job(
    job_kind pg_catalog.text,
    payload pg_catalog.jsonb,
    idempotency_key pg_catalog.text DEFAULT NULL,
    queue_name pg_catalog.text DEFAULT 'default',
    run_after pg_catalog.timestamptz DEFAULT pg_catalog.now(),
    max_attempts pg_catalog.int4 DEFAULT NULL,
    priority pg_catalog.int4 DEFAULT 0,
    concurrency_key pg_catalog.text DEFAULT NULL)
    RETURNS TABLE (job_id pg_catalog.int8, created pg_catalog.bool)
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'enqueue_or_get_durable_job_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.enqueue_or_get_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text) FROM PUBLIC;

CREATE FUNCTION durable_jobs.diagnose_durable_job(job_id pg_catalog.int8)
    RETURNS TABLE (reason pg_catalog.text, detail pg_catalog.text)
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'diagnose_durable_job_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.diagnose_durable_job(pg_catalog.int8) FROM PUBLIC;

-- Queue concurrency limits by place: each limited queue gets its places, a claim takes one for
-- each job it starts and records it on the job, and no advisory lock stands for the queue any
-- more. Jobs that run as the library is updated hold no place: their queue counts as full
-- until they end.
ALTER TABLE durable_jobs.durable_job ADD COLUMN queue_slot pg_catalog.int4;
CREATE INDEX durable_job_running_queue_idx
    ON durable_jobs.durable_job (queue_name, queue_slot)
    WHERE job_state = 'running';
CREATE TABLE durable_jobs.durable_job_queue_slot (
    queue_name pg_catalog.text NOT NULL,
    slot       pg_catalog.int4 NOT NULL,
    PRIMARY KEY (queue_name, slot)
);
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_queue_slot', '');
REVOKE ALL ON durable_jobs.durable_job_queue_slot FROM PUBLIC;
INSERT INTO durable_jobs.durable_job_queue_slot (queue_name, slot)
SELECT q.queue_name, place FROM durable_jobs.durable_job_queue q,
       pg_catalog.generate_series(1, q.concurrency_limit) AS place;
CREATE FUNCTION durable_jobs.durable_job_take_queue_slot(
    queue pg_catalog.text, job_id pg_catalog.int8, row_version pg_catalog.tid)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 10000
    AS 'MODULE_PATHNAME', 'durable_job_take_queue_slot';
CREATE FUNCTION durable_jobs.durable_job_taken_queue_slot(job_id pg_catalog.int8)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'durable_job_taken_queue_slot';
REVOKE ALL ON FUNCTION durable_jobs.durable_job_take_queue_slot(pg_catalog.text, pg_catalog.int8, pg_catalog.tid) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.durable_job_taken_queue_slot(pg_catalog.int8) FROM PUBLIC;
DROP FUNCTION durable_jobs.durable_job_queue_has_capacity(pg_catalog.text);

-- Per-key concurrency: jobs carry a concurrency key, a queue may limit how many jobs of one key
-- run at once, and each key has its places, as a limited queue has.
ALTER TABLE durable_jobs.durable_job
    ADD COLUMN concurrency_key pg_catalog.text,
    ADD COLUMN key_slot pg_catalog.int4;
CREATE INDEX durable_job_running_key_idx
    ON durable_jobs.durable_job (queue_name, concurrency_key, key_slot)
    WHERE job_state = 'running' AND concurrency_key IS NOT NULL;
CREATE INDEX durable_job_pending_key_idx
    ON durable_jobs.durable_job (queue_name, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND job_state IN ('available', 'running');
-- Claims of some kinds read only their kinds' ranges of the claim order.
CREATE INDEX durable_job_kind_claim_order_idx
    ON durable_jobs.durable_job (job_kind, priority DESC, run_after, job_id)
    WHERE job_state IN ('available', 'running');
-- Rate limits: a queue may limit how many claims start its jobs, with a bucket of tokens.
ALTER TABLE durable_jobs.durable_job_queue
    ADD COLUMN key_concurrency_limit pg_catalog.int4 CHECK (key_concurrency_limit BETWEEN 1 AND 1000),
    ADD COLUMN rate_per_second pg_catalog.float8 CHECK (rate_per_second > 0 AND rate_per_second <= 1000000),
    ADD COLUMN rate_burst pg_catalog.int4 CHECK (rate_burst BETWEEN 1 AND 10000),
    ADD CONSTRAINT durable_job_queue_rate_complete CHECK ((rate_per_second IS NULL) = (rate_burst IS NULL));
-- Columns added at the end: the view keeps its owner and its grants.
CREATE OR REPLACE VIEW durable_jobs.durable_job_queue_controls AS
WITH q AS (SELECT * FROM durable_jobs.durable_job_queue)
SELECT q.queue_name, q.paused, q.concurrency_limit, q.changed_by, q.changed_at, q.key_concurrency_limit,
       q.rate_per_second, q.rate_burst
FROM q;
CREATE TABLE durable_jobs.durable_job_rate_token (
    queue_name pg_catalog.text NOT NULL,
    token      pg_catalog.int4 NOT NULL,
    next_at    pg_catalog.timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (queue_name, token)
);
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_rate_token', '');
REVOKE ALL ON durable_jobs.durable_job_rate_token FROM PUBLIC;
-- Columns added at the end: the view keeps its owner and its grants.
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

CREATE FUNCTION durable_jobs.durable_job_take_rate_token(
    queue pg_catalog.text, job_id pg_catalog.int8, row_version pg_catalog.tid)
    RETURNS pg_catalog.bool LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 10000
    AS 'MODULE_PATHNAME', 'durable_job_take_rate_token';
CREATE FUNCTION durable_jobs.durable_job_rate_token_taken_at(job_id pg_catalog.int8)
    RETURNS pg_catalog.timestamptz LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'durable_job_rate_token_taken_at';
REVOKE ALL ON FUNCTION durable_jobs.durable_job_take_rate_token(pg_catalog.text, pg_catalog.int8, pg_catalog.tid) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.durable_job_rate_token_taken_at(pg_catalog.int8) FROM PUBLIC;
CREATE FUNCTION durable_jobs.set_durable_job_queue_rate(
    queue_name pg_catalog.text,
    starts_per_second pg_catalog.float8,
    burst pg_catalog.int4 DEFAULT 1)
    RETURNS void
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'set_durable_job_queue_rate_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.set_durable_job_queue_rate(pg_catalog.text, pg_catalog.float8, pg_catalog.int4) FROM PUBLIC;
CREATE FUNCTION durable_jobs.get_durable_job_queue_next_start(queue_name pg_catalog.text)
    RETURNS pg_catalog.timestamptz
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'get_durable_job_queue_next_start_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.get_durable_job_queue_next_start(pg_catalog.text) FROM PUBLIC;
CREATE TABLE durable_jobs.durable_job_key_slot (
    queue_name      pg_catalog.text NOT NULL,
    concurrency_key pg_catalog.text NOT NULL,
    slot            pg_catalog.int4 NOT NULL,
    PRIMARY KEY (queue_name, concurrency_key, slot)
);
SELECT pg_catalog.pg_extension_config_dump('durable_jobs.durable_job_key_slot', '');
REVOKE ALL ON durable_jobs.durable_job_key_slot FROM PUBLIC;
CREATE FUNCTION durable_jobs.durable_job_take_key_slot(
    queue pg_catalog.text, concurrency_key pg_catalog.text, job_id pg_catalog.int8, row_version pg_catalog.tid)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 10000
    AS 'MODULE_PATHNAME', 'durable_job_take_key_slot';
CREATE FUNCTION durable_jobs.durable_job_taken_key_slot(job_id pg_catalog.int8)
    RETURNS pg_catalog.int4 LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'durable_job_taken_key_slot';
REVOKE ALL ON FUNCTION durable_jobs.durable_job_take_key_slot(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.tid) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.durable_job_taken_key_slot(pg_catalog.int8) FROM PUBLIC;
CREATE FUNCTION durable_jobs.set_durable_job_queue_key_concurrency(
    queue_name pg_catalog.text,
    max_running_per_key pg_catalog.int4)
    RETURNS void
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'set_durable_job_queue_key_concurrency_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.set_durable_job_queue_key_concurrency(pg_catalog.text, pg_catalog.int4) FROM PUBLIC;

-- What an update creates belongs to the role that runs it, a superuser. After REASSIGN OWNED the
-- extension may belong to another role, which the library's functions act as: the new members
-- are handed to it, with the privileges they have then recorded as the extension's own, as a
-- fresh install by that role would.
DO $hand_over$
DECLARE
    extension_owner pg_catalog.text := (SELECT x.extowner::pg_catalog.regrole::pg_catalog.text
                                        FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs');
BEGIN
    EXECUTE pg_catalog.format('ALTER TABLE durable_jobs.durable_job_attempt OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.get_durable_job_attempts(pg_catalog.int8) OWNER TO %s',
                              extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.diagnose_durable_job(pg_catalog.int8) OWNER TO %s',
                              extension_owner);
    EXECUTE pg_catalog.format(
        'ALTER FUNCTION durable_jobs.enqueue_or_get_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, '
        'pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text) OWNER TO %s',
        extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.forget_durable_job_attempts() OWNER TO %s',
                              extension_owner);
    EXECUTE pg_catalog.format('ALTER TABLE durable_jobs.durable_job_queue_slot OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER TABLE durable_jobs.durable_job_key_slot OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER TABLE durable_jobs.durable_job_rate_token OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_take_rate_token(pg_catalog.text, pg_catalog.int8, '
                              'pg_catalog.tid) OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_rate_token_taken_at(pg_catalog.int8) OWNER TO %s',
                              extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.set_durable_job_queue_rate(pg_catalog.text, pg_catalog.float8, '
                              'pg_catalog.int4) OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.get_durable_job_queue_next_start(pg_catalog.text) OWNER TO %s',
                              extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_take_key_slot(pg_catalog.text, pg_catalog.text, '
                              'pg_catalog.int8, pg_catalog.tid) OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_taken_key_slot(pg_catalog.int8) OWNER TO %s',
                              extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.set_durable_job_queue_key_concurrency(pg_catalog.text, '
                              'pg_catalog.int4) OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_take_queue_slot(pg_catalog.text, pg_catalog.int8, pg_catalog.tid) '
                              'OWNER TO %s', extension_owner);
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_taken_queue_slot(pg_catalog.int8) OWNER TO %s',
                              extension_owner);
    UPDATE pg_catalog.pg_init_privs i SET initprivs = c.relacl
    FROM pg_catalog.pg_class c
    WHERE c.oid IN ('durable_jobs.durable_job_attempt'::pg_catalog.regclass,
                    'durable_jobs.durable_job_queue_slot'::pg_catalog.regclass,
                    'durable_jobs.durable_job_key_slot'::pg_catalog.regclass,
                    'durable_jobs.durable_job_rate_token'::pg_catalog.regclass)
      AND i.objoid = c.oid AND i.classoid = 'pg_catalog.pg_class'::pg_catalog.regclass AND i.objsubid = 0;
    UPDATE pg_catalog.pg_init_privs i SET initprivs = p.proacl
    FROM pg_catalog.pg_proc p
    WHERE p.oid IN ('durable_jobs.get_durable_job_attempts(pg_catalog.int8)'::pg_catalog.regprocedure,
                    'durable_jobs.diagnose_durable_job(pg_catalog.int8)'::pg_catalog.regprocedure,
                    'durable_jobs.enqueue_or_get_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, '
                    'pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text)'::pg_catalog.regprocedure,
                    'durable_jobs.forget_durable_job_attempts()'::pg_catalog.regprocedure,
                    'durable_jobs.durable_job_take_queue_slot(pg_catalog.text, pg_catalog.int8, pg_catalog.tid)'::pg_catalog.regprocedure,
                    'durable_jobs.durable_job_taken_queue_slot(pg_catalog.int8)'::pg_catalog.regprocedure,
                    'durable_jobs.durable_job_take_key_slot(pg_catalog.text, pg_catalog.text, pg_catalog.int8, '
                    'pg_catalog.tid)'::pg_catalog.regprocedure,
                    'durable_jobs.durable_job_taken_key_slot(pg_catalog.int8)'::pg_catalog.regprocedure,
                    'durable_jobs.set_durable_job_queue_key_concurrency(pg_catalog.text, pg_catalog.int4)'::pg_catalog.regprocedure,
                    'durable_jobs.durable_job_take_rate_token(pg_catalog.text, pg_catalog.int8, pg_catalog.tid)'::pg_catalog.regprocedure,
                    'durable_jobs.durable_job_rate_token_taken_at(pg_catalog.int8)'::pg_catalog.regprocedure,
                    'durable_jobs.set_durable_job_queue_rate(pg_catalog.text, pg_catalog.float8, pg_catalog.int4)'::pg_catalog.regprocedure,
                    'durable_jobs.get_durable_job_queue_next_start(pg_catalog.text)'::pg_catalog.regprocedure)
      AND i.objoid = p.oid AND i.classoid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND i.objsubid = 0;
END
$hand_over$;

-- fail_durable_job takes the worker's error text, and enqueue_durable_job and
-- enqueue_durable_jobs a concurrency key: each old function is replaced (and handed to the
-- extension's owner, as above), and whoever could execute it may execute the new one.
CREATE FUNCTION durable_jobs.fail_durable_job(
    job_id pg_catalog.int8,
    worker_id pg_catalog.text,
    lease_token pg_catalog.uuid,
    failure_code pg_catalog.text,
    error_message pg_catalog.text DEFAULT NULL)
    RETURNS pg_catalog.text
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'fail_durable_job_with_message_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text, pg_catalog.text) FROM PUBLIC;
CREATE FUNCTION durable_jobs.enqueue_durable_job(
    job_kind pg_catalog.text,
    payload pg_catalog.jsonb,
    idempotency_key pg_catalog.text DEFAULT NULL,
    queue_name pg_catalog.text DEFAULT 'default',
    run_after pg_catalog.timestamptz DEFAULT pg_catalog.now(),
    max_attempts pg_catalog.int4 DEFAULT NULL,
    priority pg_catalog.int4 DEFAULT 0,
    concurrency_key pg_catalog.text DEFAULT NULL)
    RETURNS pg_catalog.int8
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'enqueue_durable_job_with_concurrency_key_wrapper';
CREATE FUNCTION durable_jobs.enqueue_durable_jobs(
    job_kind pg_catalog.text,
    payloads pg_catalog.jsonb[],
    idempotency_keys pg_catalog.text[] DEFAULT NULL,
    queue_name pg_catalog.text DEFAULT 'default',
    run_after pg_catalog.timestamptz DEFAULT pg_catalog.now(),
    max_attempts pg_catalog.int4 DEFAULT NULL,
    priority pg_catalog.int4 DEFAULT 0,
    concurrency_key pg_catalog.text DEFAULT NULL)
    RETURNS SETOF pg_catalog.int8
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'enqueue_durable_jobs_with_concurrency_key_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text) FROM PUBLIC;
DO $carry$
DECLARE
    owner pg_catalog.oid := (SELECT x.extowner FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs');
    pair record;
    old_owner pg_catalog.oid;
    fresh_acl pg_catalog.aclitem[];
BEGIN
    FOR pair IN
        SELECT o.routine::pg_catalog.regprocedure AS old_routine, n.routine::pg_catalog.regprocedure AS new_routine
        FROM (VALUES
            ('durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text)',
             'durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text, pg_catalog.text)'),
            ('durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, '
             'pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4)',
             'durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, '
             'pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text)'),
            ('durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, '
             'pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4)',
             'durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], '
             'pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text)')
        ) AS p(old_name, new_name),
        LATERAL (SELECT p.old_name::pg_catalog.regprocedure::pg_catalog.oid) AS o(routine),
        LATERAL (SELECT p.new_name::pg_catalog.regprocedure::pg_catalog.oid) AS n(routine)
    LOOP
        SELECT p.proowner INTO old_owner FROM pg_catalog.pg_proc p WHERE p.oid = pair.old_routine;
        EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %s', pair.new_routine, owner::pg_catalog.regrole);
        SELECT p.proacl INTO fresh_acl FROM pg_catalog.pg_proc p WHERE p.oid = pair.new_routine;
        -- The old function's grants are copied as they are, each still made by the role that made
        -- it (the owner's by the owner), so that who may revoke what stays as it was; no GRANT is
        -- run as those roles. The roles they name depend on the new function as they did on the
        -- old one.
        UPDATE pg_catalog.pg_proc p
        SET proacl = (SELECT pg_catalog.array_agg(pg_catalog.makeaclitem(
                                 CASE a.grantee WHEN old_owner THEN owner ELSE a.grantee END,
                                 CASE a.grantor WHEN old_owner THEN owner ELSE a.grantor END,
                                 a.privilege_type, a.is_grantable))
                      FROM pg_catalog.pg_proc o, pg_catalog.aclexplode(o.proacl) a
                      WHERE o.oid = pair.old_routine)
        WHERE p.oid = pair.new_routine
          AND (SELECT o.proacl FROM pg_catalog.pg_proc o WHERE o.oid = pair.old_routine) IS NOT NULL;
        INSERT INTO pg_catalog.pg_shdepend (dbid, classid, objid, objsubid, refclassid, refobjid, deptype)
        SELECT d.dbid, d.classid, pair.new_routine, d.objsubid, d.refclassid, d.refobjid, d.deptype
        FROM pg_catalog.pg_shdepend d
        WHERE d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND d.objid = pair.old_routine AND d.deptype = 'a'
          AND d.dbid = (SELECT b.oid FROM pg_catalog.pg_database b WHERE b.datname = pg_catalog.current_database())
          AND d.refobjid <> owner AND d.refobjid <> old_owner;
        -- A GRANT in an extension script counts as the extension's own privilege, which pg_dump
        -- leaves out: record the function's privileges as a fresh install has them, so that the
        -- operators' grants stay theirs and are dumped.
        UPDATE pg_catalog.pg_init_privs SET initprivs = fresh_acl
        WHERE objoid = pair.new_routine AND classoid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND objsubid = 0;
    END LOOP;
END
$carry$;
DROP FUNCTION durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text);
DROP FUNCTION durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4);
DROP FUNCTION durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4);
