-- durable_jobs 0.6.0 back to 0.5.0: enqueue_or_get_durable_job, diagnose_durable_job and the
-- attempt history go (its table, with the error texts it kept, and the job columns of the
-- latest attempt), fail_durable_job takes no error text, and durable_job_handlers loses the
-- columns that say whom each registration serves; queue concurrency limits go back to an
-- advisory lock, and concurrency keys, limits per key and rate limits go. The trust rule itself lives in the library:
-- while the 0.6.0 library is loaded it holds for a 0.5.0 schema too. Run by ALTER EXTENSION
-- durable_jobs UPDATE TO '0.5.0'; tests/upgrade.rs checks that the result equals a fresh 0.5.0
-- install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.5.0'" to load this file. \quit

-- A view cannot drop columns in place: each (durable_job_handlers, durable_job_queue_summary,
-- durable_job_queue_controls) is made again, and given back its owner, the grants
-- made on it and on its columns (all recorded as granted by its owner, also those another role
-- with the grant option made), and the initial privileges pg_dump compares them with, so that a
-- dump still carries those grants, as before the downgrade. A view of yours over it stops the
-- downgrade.
DO $remake$
DECLARE
    target record;
    view_oid pg_catalog.oid;
    owner pg_catalog.oid;
    acl pg_catalog.aclitem[];
    column_grants record;
    saved_columns pg_catalog.text[] := '{}';
    saved_column_acls pg_catalog.text[] := '{}';
    initial record;
    saved_initial_subids pg_catalog.int4[] := '{}';
    saved_initial_types pg_catalog.char[] := '{}';
    -- Kept as aclitems, never as text: an item may name a role dropped since (PostgreSQL 15
    -- keeps its oid there), which text could not be read back as. Each row's items in turn.
    saved_initial_items pg_catalog.aclitem[] := '{}';
    saved_initial_counts pg_catalog.int4[] := '{}';
    first_item pg_catalog.int4 := 1;
    privilege record;
    i pg_catalog.int4;
BEGIN
  -- Each view, the columns it keeps, and what must change between its drop and its remaking.
  FOR target IN
    SELECT * FROM (VALUES
        ('durable_jobs.durable_job_handlers', 4, NULL,
         'WITH h AS (SELECT * FROM durable_jobs.durable_job_handler)
          SELECT h.job_kind, h.handler, h.registered_by, h.registered_at FROM h'),
        ('durable_jobs.durable_job_queue_summary', 7, NULL,
         'SELECT j.queue_name,
       j.job_state,
       pg_catalog.count(*) AS job_count,
       pg_catalog.max(pg_catalog.clock_timestamp() - j.run_after)
           FILTER (WHERE j.job_state = ''available'' AND j.run_after <= pg_catalog.clock_timestamp())
           AS oldest_ready_age,
       pg_catalog.count(*)
           FILTER (WHERE j.job_state = ''running'' AND j.lease_expires_at <= pg_catalog.clock_timestamp())
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
WHERE NOT EXISTS (SELECT 1 FROM durable_jobs.durable_job j WHERE j.queue_name = q.queue_name)'),
        ('durable_jobs.durable_job_queue_controls', 5,
         'ALTER TABLE durable_jobs.durable_job_queue DROP COLUMN key_concurrency_limit,
              DROP COLUMN rate_per_second, DROP COLUMN rate_burst',
         'WITH q AS (SELECT * FROM durable_jobs.durable_job_queue)
          SELECT q.queue_name, q.paused, q.concurrency_limit, q.changed_by, q.changed_at FROM q')
    ) AS v(view_name, kept_columns, meanwhile, definition)
  LOOP
    view_oid := target.view_name::pg_catalog.regclass;
    saved_columns := '{}';
    saved_column_acls := '{}';
    saved_initial_subids := '{}';
    saved_initial_types := '{}';
    saved_initial_items := '{}';
    saved_initial_counts := '{}';
    first_item := 1;
    SELECT c.relowner, c.relacl INTO owner, acl FROM pg_catalog.pg_class c WHERE c.oid = view_oid;
    FOR column_grants IN
        SELECT a.attname, a.attacl FROM pg_catalog.pg_attribute a
        WHERE a.attrelid = view_oid AND a.attnum BETWEEN 1 AND target.kept_columns AND a.attacl IS NOT NULL
    LOOP
        saved_columns := saved_columns || column_grants.attname::pg_catalog.text;
        saved_column_acls := saved_column_acls || column_grants.attacl::pg_catalog.text;
    END LOOP;
    FOR initial IN
        SELECT i.objsubid, i.privtype, i.initprivs FROM pg_catalog.pg_init_privs i
        WHERE i.objoid = view_oid AND i.classoid = 'pg_catalog.pg_class'::pg_catalog.regclass
          AND i.objsubid BETWEEN 0 AND target.kept_columns
    LOOP
        saved_initial_subids := saved_initial_subids || initial.objsubid;
        saved_initial_types := saved_initial_types || initial.privtype;
        saved_initial_items := saved_initial_items || initial.initprivs;
        saved_initial_counts := saved_initial_counts || pg_catalog.cardinality(initial.initprivs);
    END LOOP;

    EXECUTE pg_catalog.format('DROP VIEW %s', target.view_name);
    IF target.meanwhile IS NOT NULL THEN
        EXECUTE target.meanwhile;
    END IF;
    EXECUTE pg_catalog.format('CREATE VIEW %s AS %s', target.view_name, target.definition);
    view_oid := target.view_name::pg_catalog.regclass;
    EXECUTE pg_catalog.format('ALTER VIEW %s OWNER TO %s', target.view_name, owner::pg_catalog.regrole);
    EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM PUBLIC', target.view_name);
    FOR privilege IN
        SELECT a.grantee, a.privilege_type, a.is_grantable FROM pg_catalog.aclexplode(acl) a
        WHERE a.grantee <> owner
    LOOP
        EXECUTE pg_catalog.format('GRANT %s ON %s TO %s%s',
            privilege.privilege_type, target.view_name,
            CASE WHEN privilege.grantee = 0 THEN 'PUBLIC'
                 ELSE privilege.grantee::pg_catalog.regrole::pg_catalog.text END,
            CASE WHEN privilege.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    FOR i IN 1 .. pg_catalog.cardinality(saved_columns) LOOP
        FOR privilege IN
            SELECT a.grantee, a.privilege_type, a.is_grantable
            FROM pg_catalog.aclexplode(saved_column_acls[i]::pg_catalog.aclitem[]) a
        LOOP
            EXECUTE pg_catalog.format('GRANT %s (%I) ON %s TO %s%s',
                privilege.privilege_type, saved_columns[i], target.view_name,
                CASE WHEN privilege.grantee = 0 THEN 'PUBLIC'
                     ELSE privilege.grantee::pg_catalog.regrole::pg_catalog.text END,
                CASE WHEN privilege.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
    -- The grants above were recorded as initial privileges, as anything an extension script
    -- grants is: the view's are put back as they were.
    DELETE FROM pg_catalog.pg_init_privs
    WHERE objoid = view_oid AND classoid = 'pg_catalog.pg_class'::pg_catalog.regclass;
    FOR i IN 1 .. pg_catalog.cardinality(saved_initial_subids) LOOP
        INSERT INTO pg_catalog.pg_init_privs (objoid, classoid, objsubid, privtype, initprivs)
        VALUES (view_oid, 'pg_catalog.pg_class'::pg_catalog.regclass, saved_initial_subids[i],
                saved_initial_types[i],
                saved_initial_items[first_item : first_item + saved_initial_counts[i] - 1]);
        first_item := first_item + saved_initial_counts[i];
    END LOOP;
  END LOOP;
END
$remake$;

DROP FUNCTION durable_jobs.diagnose_durable_job(pg_catalog.int8);
DROP FUNCTION durable_jobs.enqueue_or_get_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text,
    pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text);
DROP FUNCTION durable_jobs.get_durable_job_attempts(pg_catalog.int8);
DROP TRIGGER durable_job_truncate_attempts ON durable_jobs.durable_job;
DROP TRIGGER durable_job_delete_attempts ON durable_jobs.durable_job;
DROP FUNCTION durable_jobs.forget_durable_job_attempts();
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_attempt;
DROP TABLE durable_jobs.durable_job_attempt;
ALTER TABLE durable_jobs.durable_job DROP COLUMN attempt_started_at, DROP COLUMN attempt_worker_id;

-- Queue concurrency limits go back to counting under a per-queue advisory lock.
DROP FUNCTION durable_jobs.durable_job_take_queue_slot(pg_catalog.text, pg_catalog.int8, pg_catalog.tid);
DROP FUNCTION durable_jobs.durable_job_taken_queue_slot(pg_catalog.int8);
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_queue_slot;
DROP TABLE durable_jobs.durable_job_queue_slot;
ALTER TABLE durable_jobs.durable_job DROP COLUMN queue_slot;
-- Per-key concurrency goes: jobs lose their concurrency keys (durable_job_queue's column went
-- with its view, above).
DROP FUNCTION durable_jobs.set_durable_job_queue_key_concurrency(pg_catalog.text, pg_catalog.int4);
DROP FUNCTION durable_jobs.durable_job_take_key_slot(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.tid);
DROP FUNCTION durable_jobs.durable_job_taken_key_slot(pg_catalog.int8);
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_key_slot;
DROP TABLE durable_jobs.durable_job_key_slot;
ALTER TABLE durable_jobs.durable_job DROP COLUMN concurrency_key, DROP COLUMN key_slot;
DROP INDEX durable_jobs.durable_job_kind_claim_order_idx;
-- Rate limits go (their columns went with durable_job_queue_controls, above).
DROP FUNCTION durable_jobs.set_durable_job_queue_rate(pg_catalog.text, pg_catalog.float8, pg_catalog.int4);
DROP FUNCTION durable_jobs.get_durable_job_queue_next_start(pg_catalog.text);
DROP FUNCTION durable_jobs.durable_job_take_rate_token(pg_catalog.text, pg_catalog.int8, pg_catalog.tid);
DROP FUNCTION durable_jobs.durable_job_rate_token_taken_at(pg_catalog.int8);
ALTER EXTENSION durable_jobs DROP TABLE durable_jobs.durable_job_rate_token;
DROP TABLE durable_jobs.durable_job_rate_token;
CREATE FUNCTION durable_jobs.durable_job_queue_has_capacity(queue pg_catalog.text)
    RETURNS pg_catalog.bool
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
    SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock(
            pg_catalog.hashtext('durable_jobs queue'), pg_catalog.hashtext(queue)) THEN
        RETURN false;
    END IF;
    RETURN durable_jobs.durable_job_queue_running(queue) < COALESCE((SELECT q.concurrency_limit FROM durable_jobs.durable_job_queue q
                     WHERE q.queue_name = queue), 2147483647);
END
$body$;
REVOKE ALL ON FUNCTION durable_jobs.durable_job_queue_has_capacity(pg_catalog.text) FROM PUBLIC;
DO $hand_over$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION durable_jobs.durable_job_queue_has_capacity(pg_catalog.text) OWNER TO %s',
                              (SELECT x.extowner::pg_catalog.regrole::pg_catalog.text
                               FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs'));
    UPDATE pg_catalog.pg_init_privs i SET initprivs = p.proacl
    FROM pg_catalog.pg_proc p
    WHERE p.oid = 'durable_jobs.durable_job_queue_has_capacity(pg_catalog.text)'::pg_catalog.regprocedure
      AND i.objoid = p.oid AND i.classoid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND i.objsubid = 0;
END
$hand_over$;


-- fail_durable_job takes no error text, and enqueue_durable_job and enqueue_durable_jobs no
-- concurrency key: each function is replaced by its 0.5.0 form, with the grants it had.
CREATE FUNCTION durable_jobs.fail_durable_job(
    job_id pg_catalog.int8,
    worker_id pg_catalog.text,
    lease_token pg_catalog.uuid,
    failure_code pg_catalog.text)
    RETURNS pg_catalog.text
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'fail_durable_job_wrapper';
CREATE FUNCTION durable_jobs.enqueue_durable_job(
    job_kind pg_catalog.text,
    payload pg_catalog.jsonb,
    idempotency_key pg_catalog.text DEFAULT NULL,
    queue_name pg_catalog.text DEFAULT 'default',
    run_after pg_catalog.timestamptz DEFAULT pg_catalog.now(),
    max_attempts pg_catalog.int4 DEFAULT NULL,
    priority pg_catalog.int4 DEFAULT 0)
    RETURNS pg_catalog.int8
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'enqueue_durable_job_wrapper';
CREATE FUNCTION durable_jobs.enqueue_durable_jobs(
    job_kind pg_catalog.text,
    payloads pg_catalog.jsonb[],
    idempotency_keys pg_catalog.text[] DEFAULT NULL,
    queue_name pg_catalog.text DEFAULT 'default',
    run_after pg_catalog.timestamptz DEFAULT pg_catalog.now(),
    max_attempts pg_catalog.int4 DEFAULT NULL,
    priority pg_catalog.int4 DEFAULT 0)
    RETURNS SETOF pg_catalog.int8
    VOLATILE PARALLEL UNSAFE
    SET search_path TO pg_catalog, pg_temp
    LANGUAGE c
    AS 'MODULE_PATHNAME', 'enqueue_durable_jobs_wrapper';
REVOKE ALL ON FUNCTION durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4) FROM PUBLIC;
DO $carry$
DECLARE
    owner pg_catalog.oid := (SELECT x.extowner FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs');
    pair record;
    old_owner pg_catalog.oid;
    fresh_acl pg_catalog.aclitem[];
BEGIN
    FOR pair IN
        SELECT p.old_name::pg_catalog.regprocedure::pg_catalog.oid AS old_routine,
               p.new_name::pg_catalog.regprocedure::pg_catalog.oid AS new_routine,
               p.new_name
        FROM (VALUES
            ('durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text, pg_catalog.text)',
             'durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text)'),
            ('durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, '
             'pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text)',
             'durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, '
             'pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4)'),
            ('durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, '
             'pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text)',
             'durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, '
             'pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4)')
        ) AS p(old_name, new_name)
    LOOP
        SELECT p.proowner INTO old_owner FROM pg_catalog.pg_proc p WHERE p.oid = pair.old_routine;
        EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %s', pair.new_name, owner::pg_catalog.regrole);
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
DROP FUNCTION durable_jobs.fail_durable_job(pg_catalog.int8, pg_catalog.text, pg_catalog.uuid, pg_catalog.text, pg_catalog.text);
DROP FUNCTION durable_jobs.enqueue_durable_job(pg_catalog.text, pg_catalog.jsonb, pg_catalog.text, pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text);
DROP FUNCTION durable_jobs.enqueue_durable_jobs(pg_catalog.text, pg_catalog.jsonb[], pg_catalog.text[], pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, pg_catalog.int4, pg_catalog.text);
