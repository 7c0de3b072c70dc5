-- durable_jobs 0.3.0 to 0.4.0: the status API, and a claim that filters by kind. Every job
-- gets state_version 1, replay_count 0 and no SQLSTATE; from now on every enqueued payload keeps
-- its fingerprint (replay compares against it). The table's constraints call C functions of the
-- library. Three listing indexes are built over the job table while the update holds its lock,
-- and the lease index keeps only last attempts.
-- Run by ALTER EXTENSION durable_jobs UPDATE; tests/upgrade.rs checks that the result equals a
-- fresh 0.4.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE" to load this file. \quit

-- A constant default: no table rewrite.
ALTER TABLE durable_jobs.durable_job
    ADD COLUMN state_version pg_catalog.int8 NOT NULL DEFAULT 1,
    ADD COLUMN last_failure_sqlstate pg_catalog.text,
    ADD COLUMN replay_count pg_catalog.int4 NOT NULL DEFAULT 0;

-- The CHECK constraints call C functions of the library instead of SQL expressions (read back
-- from their text for every statement that writes the table). Every job enqueued from now on
-- has a fingerprint; a keyed job always had one. One ALTER: one scan of the table to validate.
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
REVOKE ALL ON FUNCTION
    durable_jobs.durable_job_state_known(pg_catalog.text),
    durable_jobs.durable_job_names_not_empty(pg_catalog.text, pg_catalog.text),
    durable_jobs.durable_job_priority_range(pg_catalog.int4),
    durable_jobs.durable_job_attempts_within_max(pg_catalog.int4, pg_catalog.int4),
    durable_jobs.durable_job_payload_only_while_pending(pg_catalog.text, pg_catalog.jsonb),
    durable_jobs.durable_job_lease_only_while_running(pg_catalog.text, pg_catalog.text, pg_catalog.uuid, pg_catalog.timestamptz),
    durable_jobs.durable_job_finished_only_when_terminal(pg_catalog.text, pg_catalog.timestamptz),
    durable_jobs.durable_job_failure_code_known(pg_catalog.text),
    durable_jobs.durable_job_status_fields_valid(pg_catalog.int8, pg_catalog.int4, pg_catalog.text),
    durable_jobs.durable_job_terminal_row_uncleared(pg_catalog.text, pg_catalog.jsonb, pg_catalog.timestamptz)
    FROM PUBLIC;
ALTER TABLE durable_jobs.durable_job
    DROP CONSTRAINT durable_job_state_known,
    DROP CONSTRAINT durable_job_names_not_empty,
    DROP CONSTRAINT durable_job_priority_range,
    DROP CONSTRAINT durable_job_attempts_within_max,
    DROP CONSTRAINT durable_job_payload_only_while_pending,
    DROP CONSTRAINT durable_job_lease_only_while_running,
    DROP CONSTRAINT durable_job_finished_only_when_terminal,
    DROP CONSTRAINT durable_job_failure_code_known,
    DROP CONSTRAINT durable_job_key_has_fingerprint,
    ADD CONSTRAINT durable_job_state_known CHECK (durable_jobs.durable_job_state_known(job_state)),
    ADD CONSTRAINT durable_job_names_not_empty CHECK (durable_jobs.durable_job_names_not_empty(queue_name, job_kind)),
    ADD CONSTRAINT durable_job_priority_range CHECK (durable_jobs.durable_job_priority_range(priority)),
    ADD CONSTRAINT durable_job_attempts_within_max CHECK (
        durable_jobs.durable_job_attempts_within_max(max_attempts, attempt_count)),
    ADD CONSTRAINT durable_job_payload_only_while_pending CHECK (
        durable_jobs.durable_job_payload_only_while_pending(job_state, payload)),
    ADD CONSTRAINT durable_job_lease_only_while_running CHECK (
        durable_jobs.durable_job_lease_only_while_running(job_state, lease_owner, lease_token, lease_expires_at)),
    ADD CONSTRAINT durable_job_finished_only_when_terminal CHECK (
        durable_jobs.durable_job_finished_only_when_terminal(job_state, finished_at)),
    ADD CONSTRAINT durable_job_failure_code_known CHECK (
        durable_jobs.durable_job_failure_code_known(last_failure_code)),
    ADD CONSTRAINT durable_job_key_has_fingerprint CHECK (
        idempotency_key IS NULL OR payload_sha256 IS NOT NULL),
    ADD CONSTRAINT durable_job_status_fields_valid CHECK (
        durable_jobs.durable_job_status_fields_valid(state_version, replay_count, last_failure_sqlstate));

-- A claim writes fewer index entries: running jobs leave the lease index for one of their own.
DROP INDEX durable_jobs.durable_job_lease_expiry_idx;
CREATE INDEX durable_job_exhausted_lease_idx
    ON durable_jobs.durable_job (lease_expires_at)
    WHERE job_state = 'running' AND attempt_count >= max_attempts;
CREATE INDEX durable_job_state_listing_idx
    ON durable_jobs.durable_job ((enqueued_by::pg_catalog.text), job_state, job_id)
    WHERE job_state <> 'running';
CREATE INDEX durable_job_queue_listing_idx
    ON durable_jobs.durable_job ((enqueued_by::pg_catalog.text), queue_name, job_state, job_id)
    WHERE job_state <> 'running';
CREATE INDEX durable_job_running_listing_idx
    ON durable_jobs.durable_job ((enqueued_by::pg_catalog.text), job_id, queue_name)
    WHERE job_state = 'running';

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

CREATE FUNCTION durable_jobs.get_durable_job(job_id pg_catalog.int8)
    RETURNS SETOF durable_jobs.durable_job_status
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'get_durable_job_wrapper';

CREATE FUNCTION durable_jobs.list_durable_jobs(
    queue_name pg_catalog.text DEFAULT NULL,
    job_states pg_catalog.text[] DEFAULT NULL,
    job_kind pg_catalog.text DEFAULT NULL,
    page_size pg_catalog.int4 DEFAULT 100,
    page_cursor pg_catalog.text DEFAULT NULL)
    RETURNS SETOF durable_jobs.durable_job_listing
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'list_durable_jobs_wrapper';

CREATE FUNCTION durable_jobs.wait_for_durable_job(
    job_id pg_catalog.int8,
    known_version pg_catalog.int8 DEFAULT NULL,
    timeout_seconds pg_catalog.float8 DEFAULT 30)
    RETURNS SETOF durable_jobs.durable_job_status
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'wait_for_durable_job_wrapper';

CREATE FUNCTION durable_jobs.replay_durable_job(
    job_id pg_catalog.int8,
    payload pg_catalog.jsonb,
    extra_attempts pg_catalog.int4 DEFAULT 1)
    RETURNS SETOF durable_jobs.durable_job_status
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'replay_durable_job_wrapper';

-- As everything else in durable_jobs: no one but the owner until granted.
REVOKE ALL ON TABLE durable_jobs.durable_job_audit FROM PUBLIC;
REVOKE ALL ON SEQUENCE durable_jobs.durable_job_audit_audit_id_seq FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.get_durable_job(pg_catalog.int8) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.list_durable_jobs(pg_catalog.text, pg_catalog.text[], pg_catalog.text,
                                                     pg_catalog.int4, pg_catalog.text) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.wait_for_durable_job(pg_catalog.int8, pg_catalog.int8, pg_catalog.float8)
    FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.replay_durable_job(pg_catalog.int8, pg_catalog.jsonb, pg_catalog.int4)
    FROM PUBLIC;

-- The claim takes the kinds a worker handles as a fourth, optional argument. The three-argument
-- function goes, and the EXECUTE grants operators gave on it move to the new one first.
CREATE FUNCTION durable_jobs.claim_next_durable_job(
    worker_id pg_catalog.text,
    queue_names pg_catalog.text[] DEFAULT NULL,
    lease_seconds pg_catalog.int4 DEFAULT NULL,
    job_kinds pg_catalog.text[] DEFAULT NULL)
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
    AS 'MODULE_PATHNAME', 'claim_next_durable_job_of_kinds_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4, pg_catalog.text[]) FROM PUBLIC;
DO $carry$
DECLARE
    fresh_acl pg_catalog.aclitem[];
    given record;
BEGIN
    SELECT p.proacl INTO fresh_acl FROM pg_catalog.pg_proc p
    WHERE p.oid = 'durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4, pg_catalog.text[])'::pg_catalog.regprocedure;
    FOR given IN
        SELECT a.grantee, a.is_grantable
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid = 'durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4)'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4, pg_catalog.text[]) TO %s%s',
            CASE WHEN given.grantee = 0 THEN 'PUBLIC' ELSE given.grantee::pg_catalog.regrole::pg_catalog.text END,
            CASE WHEN given.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    -- A GRANT in an extension script counts as the extension's own privilege, which pg_dump
    -- leaves out: record the function's privileges as a fresh install has them, so that the
    -- operators' grants stay theirs and are dumped.
    UPDATE pg_catalog.pg_init_privs SET initprivs = fresh_acl
    WHERE objoid = 'durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4, pg_catalog.text[])'::pg_catalog.regprocedure
      AND classoid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND objsubid = 0;
END
$carry$;
DROP FUNCTION durable_jobs.claim_next_durable_job(pg_catalog.text, pg_catalog.text[], pg_catalog.int4);

-- A paused (or limited) queue with no job shows in the summary.
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
GROUP BY j.queue_name, j.job_state, q.paused, q.concurrency_limit
UNION ALL
-- A queue with a control but no job still shows, with no state, so that a paused queue is seen.
SELECT q.queue_name, NULL, 0, NULL, 0, q.paused, q.concurrency_limit
FROM durable_jobs.durable_job_queue q
WHERE NOT EXISTS (SELECT 1 FROM durable_jobs.durable_job j WHERE j.queue_name = q.queue_name);

-- What an operator who registers handlers or controls queues may read of them. The WITH makes
-- them read-only whatever is granted on them (PostgreSQL does not update through a WITH query).
CREATE VIEW durable_jobs.durable_job_handlers AS
WITH h AS (SELECT * FROM durable_jobs.durable_job_handler)
SELECT h.job_kind, h.handler, h.registered_by, h.registered_at FROM h;

CREATE VIEW durable_jobs.durable_job_queue_controls AS
WITH q AS (SELECT * FROM durable_jobs.durable_job_queue)
SELECT q.queue_name, q.paused, q.concurrency_limit, q.changed_by, q.changed_at FROM q;
REVOKE ALL ON durable_jobs.durable_job_handlers, durable_jobs.durable_job_queue_controls FROM PUBLIC;

-- The payload-clearing trigger fires only when there is something to clear.
DROP TRIGGER durable_job_clear_terminal_payload ON durable_jobs.durable_job;
CREATE TRIGGER durable_job_clear_terminal_payload
    BEFORE INSERT OR UPDATE ON durable_jobs.durable_job
    FOR EACH ROW
    WHEN (durable_jobs.durable_job_terminal_row_uncleared(NEW.job_state, NEW.payload, NEW.finished_at))
    EXECUTE FUNCTION durable_jobs.clear_terminal_payload();

-- What an update creates belongs to the role that runs it, a superuser. After REASSIGN OWNED the
-- extension may belong to another role, which the library's functions act as: hand it every
-- member it does not own (or it could not write its own table: the CHECK functions above, the
-- audit table), and record the privileges they now have as the extension's own, as a fresh
-- install by that role would. When the extension's owner runs the update, nothing moves.
DO $hand_over$
DECLARE
    extension_owner pg_catalog.oid;
    member record;
BEGIN
    SELECT x.extowner INTO extension_owner FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs';
    FOR member IN
        SELECT 'ROUTINE ' || p.oid::pg_catalog.regprocedure::pg_catalog.text AS object
        FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_proc p ON p.oid = d.objid
        WHERE d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND p.proowner <> extension_owner
          AND d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.deptype = 'e'
          AND d.refobjid = (SELECT x.oid FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs')
        UNION ALL
        -- A table's sequences and indexes go with it.
        SELECT CASE c.relkind WHEN 'v' THEN 'VIEW ' WHEN 'S' THEN 'SEQUENCE ' ELSE 'TABLE ' END
               || c.oid::pg_catalog.regclass::pg_catalog.text
        FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_class c ON c.oid = d.objid
        WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND c.relowner <> extension_owner
          AND c.relkind IN ('r', 'v', 'S')
          AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend o
                          WHERE o.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND o.objid = c.oid
                            AND o.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND o.deptype IN ('a', 'i'))
          AND d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.deptype = 'e'
          AND d.refobjid = (SELECT x.oid FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs')
        UNION ALL
        SELECT 'TYPE ' || t.oid::pg_catalog.regtype::pg_catalog.text
        FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_type t ON t.oid = d.objid
        WHERE d.classid = 'pg_catalog.pg_type'::pg_catalog.regclass AND t.typowner <> extension_owner
          AND d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.deptype = 'e'
          AND d.refobjid = (SELECT x.oid FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs')
    LOOP
        EXECUTE pg_catalog.format('ALTER %s OWNER TO %s', member.object,
                                  extension_owner::pg_catalog.regrole::pg_catalog.text);
    END LOOP;
    -- The initial privileges of the members (and of the sequences that went with a table) as
    -- the scripts gave them, with the extension's owner, which now owns every member, for each
    -- former owner: a role other than it holding the owner's item (granted by itself), or a role
    -- dropped since, as ALTER OWNER does in the ACL (PostgreSQL 15 leaves pg_init_privs as it
    -- was, and keeps no dropped role out of it: an earlier update's superuser, its objects
    -- reassigned since, to this owner or another). Not the current ACL, which holds the
    -- operators' grants (the claim's, carried above): pg_dump dumps what differs from these.
    -- One item per grantee and grantor, as in an ACL; PostgreSQL 15's makeaclitem takes one
    -- privilege, so each item is written as text from the letters it gives.
    WITH owned_by AS (SELECT o.objid, o.refobjid FROM pg_catalog.pg_depend o
                      WHERE o.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                        AND o.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND o.deptype IN ('a', 'i')),
    former_owner_items AS (
        SELECT p.objoid, p.classoid, p.objsubid
        FROM pg_catalog.pg_init_privs p
        WHERE p.privtype = 'e' AND pg_catalog.cardinality(p.initprivs) > 0
          AND EXISTS (SELECT FROM pg_catalog.aclexplode(p.initprivs) a
                      WHERE (a.grantee = a.grantor AND a.grantor <> extension_owner)
                         OR NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.oid = a.grantor)
                         OR (a.grantee <> 0 AND NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.oid = a.grantee)))
          AND EXISTS (SELECT FROM pg_catalog.pg_depend d
                      WHERE d.classid = p.classoid AND d.deptype = 'e'
                        AND d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
                        AND d.refobjid = (SELECT x.oid FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs')
                        AND (d.objid = p.objoid
                             OR (p.classoid = 'pg_catalog.pg_class'::pg_catalog.regclass
                                 AND d.objid IN (SELECT o.refobjid FROM owned_by o WHERE o.objid = p.objoid)))))
    UPDATE pg_catalog.pg_init_privs i
    SET initprivs = (
        SELECT pg_catalog.array_agg((CASE g.grantee WHEN 0 THEN '' ELSE g.grantee::pg_catalog.regrole::pg_catalog.text END
                                     || '=' || g.letters || '/' || g.grantor::pg_catalog.regrole::pg_catalog.text)::pg_catalog.aclitem
                                    ORDER BY g.grantee, g.grantor)
        FROM (SELECT CASE WHEN (a.grantee = a.grantor AND a.grantor <> extension_owner)
                               OR (a.grantee <> 0 AND NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.oid = a.grantee))
                          THEN extension_owner ELSE a.grantee END AS grantee,
                     CASE WHEN a.grantor IN (SELECT o.grantor FROM pg_catalog.aclexplode(i.initprivs) o
                                             WHERE o.grantee = o.grantor)
                               OR NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.oid = a.grantor)
                          THEN extension_owner ELSE a.grantor END AS grantor,
                     pg_catalog.string_agg(pg_catalog.substring(
                         pg_catalog.makeaclitem(0, extension_owner, a.privilege_type, a.is_grantable)::pg_catalog.text,
                         '^=([^/]*)/'), '') AS letters
              FROM pg_catalog.aclexplode(i.initprivs) a
              GROUP BY 1, 2) g)
    FROM former_owner_items m
    WHERE i.objoid = m.objoid AND i.classoid = m.classoid AND i.objsubid = m.objsubid;
END
$hand_over$;
