-- durable_jobs 0.6.0 back to 0.5.0: durable_job_handlers loses the columns that say whom each
-- registration serves. The rule itself lives in the library: while the 0.6.0 library is loaded
-- it holds for a 0.5.0 schema too. Run by ALTER EXTENSION durable_jobs UPDATE TO '0.5.0';
-- tests/upgrade.rs checks that the result equals a fresh 0.5.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.5.0'" to load this file. \quit

-- A view cannot drop columns in place: it is made again, and given back its owner, the grants
-- made on it, and the initial privileges pg_dump compares them with (so that a dump still
-- carries those grants, as before the downgrade).
DO $remake$
DECLARE
    view_oid pg_catalog.oid := 'durable_jobs.durable_job_handlers'::pg_catalog.regclass;
    owner pg_catalog.oid;
    acl pg_catalog.aclitem[];
    initial pg_catalog.aclitem[];
    privilege record;
BEGIN
    SELECT c.relowner, c.relacl INTO owner, acl FROM pg_catalog.pg_class c WHERE c.oid = view_oid;
    SELECT i.initprivs INTO initial FROM pg_catalog.pg_init_privs i
    WHERE i.objoid = view_oid AND i.classoid = 'pg_catalog.pg_class'::pg_catalog.regclass AND i.objsubid = 0;
    DROP VIEW durable_jobs.durable_job_handlers;
    CREATE VIEW durable_jobs.durable_job_handlers AS
    WITH h AS (SELECT * FROM durable_jobs.durable_job_handler)
    SELECT h.job_kind, h.handler, h.registered_by, h.registered_at FROM h;
    view_oid := 'durable_jobs.durable_job_handlers'::pg_catalog.regclass;
    EXECUTE pg_catalog.format('ALTER VIEW durable_jobs.durable_job_handlers OWNER TO %s',
                              owner::pg_catalog.regrole);
    REVOKE ALL ON durable_jobs.durable_job_handlers FROM PUBLIC;
    FOR privilege IN
        SELECT a.grantee, a.privilege_type, a.is_grantable FROM pg_catalog.aclexplode(acl) a
        WHERE a.grantee <> owner
    LOOP
        EXECUTE pg_catalog.format('GRANT %s ON durable_jobs.durable_job_handlers TO %s%s',
            privilege.privilege_type,
            CASE WHEN privilege.grantee = 0 THEN 'PUBLIC'
                 ELSE privilege.grantee::pg_catalog.regrole::pg_catalog.text END,
            CASE WHEN privilege.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF initial IS NULL THEN
        DELETE FROM pg_catalog.pg_init_privs
        WHERE objoid = view_oid AND classoid = 'pg_catalog.pg_class'::pg_catalog.regclass AND objsubid = 0;
    ELSE
        UPDATE pg_catalog.pg_init_privs SET initprivs = initial
        WHERE objoid = view_oid AND classoid = 'pg_catalog.pg_class'::pg_catalog.regclass AND objsubid = 0;
    END IF;
END
$remake$;
