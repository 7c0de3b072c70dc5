-- Nothing in durable_jobs is usable by PUBLIC. Roles get EXECUTE on the functions they need;
-- docs/runbook.md shows the GRANTs for a producer role and a worker role.
REVOKE ALL ON ALL TABLES IN SCHEMA durable_jobs FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA durable_jobs FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA durable_jobs FROM PUBLIC;
