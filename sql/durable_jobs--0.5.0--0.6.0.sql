-- durable_jobs 0.5.0 to 0.6.0: a handler runs as its job's enqueuer only when the role that
-- registered it and the role that owns it already hold the enqueuer's rights (the library
-- applies that rule from the moment it is loaded, whatever the schema's version); the view
-- durable_job_handlers shows whom each registration serves. Run by ALTER EXTENSION durable_jobs
-- UPDATE; tests/upgrade.rs checks that the result equals a fresh 0.6.0 install.
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

-- Each registration whose jobs the new rule runs for other roles than 0.5.0's did, as a WARNING
-- (PostgreSQL raises client_min_messages to WARNING while it runs an extension script):
-- - lost: a member of the registering role (or of the handler's owner) that role holds no
--   rights of, whose jobs now wait for an external worker (or fail target_rejected);
-- - gained: a role whose rights the registering role holds, not its member, whose jobs external
--   workers took before and the background worker now runs.
-- Names are shown with control characters replaced, so that none can forge a log line.
-- Registrations whose routine no longer exists run nothing either way and are left out.
DO $report$
DECLARE
    change record;
BEGIN
    FOR change IN
        WITH registration AS (
            SELECT h.job_kind, h.registered_by, h.handler, a.oid AS registrant,
                   a.rolsuper AS registrant_is_superuser, o.oid AS owner, o.rolsuper AS owner_is_superuser
            FROM durable_jobs.durable_job_handler h
            JOIN pg_catalog.pg_roles a ON a.rolname = h.registered_by
            JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(h.handler)
            JOIN pg_catalog.pg_roles o ON o.oid = p.proowner),
        pair AS (
            SELECT r.*, e.oid AS enqueuer, e.rolname AS enqueuer_name,
                   -- The rule of 0.5.0: the author's code ran for the roles that had its privileges.
                   r.registrant_is_superuser OR pg_catalog.pg_has_role(e.oid, r.registrant, 'USAGE') AS old_registrant,
                   pg_catalog.pg_has_role(e.oid, r.owner, 'USAGE') AS old_owner,
                   -- This one: for the roles whose rights the author holds (and may become, 16 on).
                   r.registrant_is_superuser
                   OR (pg_catalog.pg_has_role(r.registrant, e.oid, 'USAGE')
                       AND CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 160000
                                THEN pg_catalog.pg_has_role(r.registrant, e.oid, 'SET') ELSE true END) AS new_registrant,
                   pg_catalog.pg_has_role(r.owner, e.oid, 'USAGE')
                   AND CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 160000
                            THEN pg_catalog.pg_has_role(r.owner, e.oid, 'SET') ELSE true END AS new_owner
            FROM registration r
            JOIN pg_catalog.pg_roles e ON NOT e.rolsuper AND e.oid <> r.registrant),
        judged AS (
            SELECT p.job_kind, p.registered_by, p.handler, p.enqueuer_name,
                   p.old_registrant AND NOT p.new_registrant AS unserved,
                   p.new_registrant AND NOT p.owner_is_superuser AND p.enqueuer <> p.owner
                   AND p.old_owner AND NOT p.new_owner AS rejected,
                   p.new_registrant AND NOT p.old_registrant
                   AND (p.owner_is_superuser OR p.enqueuer = p.owner OR p.new_owner) AS gained
            FROM pair p),
        shown AS (
            SELECT j.*,
                   pg_catalog.regexp_replace(pg_catalog.quote_ident(j.enqueuer_name), '[[:cntrl:]]', '?', 'g') AS who,
                   (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job d
                    WHERE d.job_kind = j.job_kind AND d.enqueued_by = j.enqueuer_name
                      AND d.job_state IN ('available', 'running')) AS pending
            FROM judged j
            WHERE j.unserved OR j.rejected OR j.gained)
        SELECT pg_catalog.regexp_replace(s.handler, '[[:cntrl:]]', '?', 'g') AS handler,
               pg_catalog.regexp_replace(pg_catalog.quote_literal(s.job_kind), '[[:cntrl:]]', '?', 'g') AS job_kind,
               pg_catalog.regexp_replace(pg_catalog.quote_ident(s.registered_by), '[[:cntrl:]]', '?', 'g') AS registered_by,
               pg_catalog.string_agg(s.who, ', ' ORDER BY s.who) FILTER (WHERE s.unserved) AS unserved,
               pg_catalog.string_agg(s.who, ', ' ORDER BY s.who) FILTER (WHERE s.rejected) AS rejected,
               pg_catalog.string_agg(s.who, ', ' ORDER BY s.who) FILTER (WHERE s.gained) AS gained,
               pg_catalog.sum(s.pending) FILTER (WHERE s.unserved OR s.rejected) AS lost_pending,
               pg_catalog.sum(s.pending) FILTER (WHERE s.gained) AS gained_pending
        FROM shown s
        GROUP BY s.job_kind, s.registered_by, s.handler
        ORDER BY s.job_kind
    LOOP
        IF change.unserved IS NOT NULL OR change.rejected IS NOT NULL THEN
            RAISE WARNING USING
                MESSAGE = pg_catalog.format(
                    'durable_jobs: the handler %s registered for job kind %s by %s no longer runs the jobs of%s%s (%s of them pending)',
                    change.handler, change.job_kind, change.registered_by,
                    CASE WHEN change.unserved IS NOT NULL
                         THEN ' ' || change.unserved || ' (the registering role does not hold their rights: their jobs wait for an external worker)' ELSE '' END,
                    CASE WHEN change.rejected IS NOT NULL
                         THEN ' ' || change.rejected || ' (the handler''s owner does not hold their rights: their jobs fail target_rejected)' ELSE '' END,
                    change.lost_pending),
                HINT = 'A role''s code runs as another role only when it holds that role''s rights, so a group''s '
                       'handler never runs as its members. Register the handler as a role that holds the rights of '
                       'each role whose jobs it is to run (a role granted each of them: GRANT app_alice, app_bob TO '
                       'app_admin), with a routine that role or a superuser owns; or have the members enqueue as '
                       'the group (SET ROLE). durable_jobs.durable_job_handlers shows whom each registration serves.';
        END IF;
        IF change.gained IS NOT NULL THEN
            RAISE WARNING USING
                MESSAGE = pg_catalog.format(
                    'durable_jobs: the handler %s registered for job kind %s by %s now runs the jobs of %s, whose rights the registering role holds (%s of them pending, left to external workers until now)',
                    change.handler, change.job_kind, change.registered_by, change.gained, change.gained_pending),
                HINT = 'Unregister the kind, or register it as another role, if external workers are to keep serving those roles.';
        END IF;
    END LOOP;
END
$report$;
