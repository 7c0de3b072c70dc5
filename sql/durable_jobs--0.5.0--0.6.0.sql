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
           ARRAY(SELECT e.rolname FROM pg_catalog.pg_roles e
                 WHERE NOT e.rolsuper AND pg_catalog.pg_has_role(a.oid, e.oid, 'USAGE')
                 ORDER BY e.rolname)
       END AS serves_roles
FROM h LEFT JOIN pg_catalog.pg_roles a ON a.rolname = h.registered_by;

-- Each registration whose jobs the rule of 0.5.0 ran for a role and the new rule does not: a
-- member of the registering role (or of the handler's owner) that the registering role (or the
-- owner) holds no rights of. Their jobs now wait for an external worker (a registration that no
-- longer serves them) or fail target_rejected (a handler owner that may no longer run as them).
-- A WARNING: PostgreSQL raises client_min_messages to WARNING while it runs an extension script.
DO $report$
DECLARE
    lost record;
BEGIN
    FOR lost IN
        WITH registration AS (
            SELECT h.job_kind, h.registered_by, h.handler, a.oid AS registrant, a.rolsuper AS registrant_is_superuser,
                   o.oid AS owner, o.rolsuper AS owner_is_superuser
            FROM durable_jobs.durable_job_handler h
            JOIN pg_catalog.pg_roles a ON a.rolname = h.registered_by
            LEFT JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(h.handler)
            LEFT JOIN pg_catalog.pg_roles o ON o.oid = p.proowner),
        no_longer AS (
            SELECT r.job_kind, r.registered_by, r.handler, e.rolname AS enqueuer,
                   -- Served before and not now: the registrant's member, not its holder.
                   NOT r.registrant_is_superuser AND e.oid <> r.registrant
                   AND pg_catalog.pg_has_role(e.oid, r.registrant, 'USAGE')
                   AND NOT pg_catalog.pg_has_role(r.registrant, e.oid, 'USAGE') AS unserved,
                   -- Still served, but the handler's owner may no longer run as it.
                   (r.registrant_is_superuser OR e.oid = r.registrant
                    OR pg_catalog.pg_has_role(r.registrant, e.oid, 'USAGE'))
                   AND NOT r.owner_is_superuser AND e.oid <> r.owner
                   AND pg_catalog.pg_has_role(e.oid, r.owner, 'USAGE')
                   AND NOT pg_catalog.pg_has_role(r.owner, e.oid, 'USAGE') AS rejected
            FROM registration r
            JOIN pg_catalog.pg_roles e ON NOT e.rolsuper)
        SELECT n.job_kind, n.registered_by, n.handler,
               pg_catalog.string_agg(pg_catalog.quote_ident(n.enqueuer), ', ' ORDER BY n.enqueuer)
                   FILTER (WHERE n.unserved) AS unserved,
               pg_catalog.string_agg(pg_catalog.quote_ident(n.enqueuer), ', ' ORDER BY n.enqueuer)
                   FILTER (WHERE n.rejected) AS rejected,
               (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job j
                WHERE j.job_kind = n.job_kind AND j.job_state IN ('available', 'running')
                  AND j.enqueued_by IN (SELECT m.enqueuer FROM no_longer m
                                        WHERE m.job_kind = n.job_kind AND (m.unserved OR m.rejected)))
                   AS pending
        FROM no_longer n
        WHERE n.unserved OR n.rejected
        GROUP BY n.job_kind, n.registered_by, n.handler
        ORDER BY n.job_kind
    LOOP
        RAISE WARNING USING
            MESSAGE = pg_catalog.format(
                'durable_jobs: the handler %s registered for job kind %L by %I no longer runs the jobs of%s%s (%s of them pending)',
                lost.handler, lost.job_kind, lost.registered_by,
                CASE WHEN lost.unserved IS NOT NULL
                     THEN ' ' || lost.unserved || ' (the registering role does not hold their rights: their jobs wait for an external worker)' ELSE '' END,
                CASE WHEN lost.rejected IS NOT NULL
                     THEN ' ' || lost.rejected || ' (the handler''s owner does not hold their rights: their jobs fail target_rejected)' ELSE '' END,
                lost.pending),
            HINT = 'A role''s code runs as another role only when it holds that role''s rights. '
                   'Grant the enqueuing role to the registering role and to the handler''s owner '
                   '(GRANT app_producer TO app_admin), or register the handler as a role that has them; '
                   'durable_jobs.durable_job_handlers shows whom each registration serves.';
    END LOOP;
END
$report$;
