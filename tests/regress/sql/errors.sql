-- Bad input: the error each caller sees (messages and SQLSTATEs are part of the contract).
TRUNCATE durable_jobs.durable_job, durable_jobs.durable_job_queue RESTART IDENTITY;
\set VERBOSITY sqlstate
\set ON_ERROR_STOP 0
SELECT durable_jobs.enqueue_durable_job(NULL, '{}');
\set VERBOSITY terse
SELECT durable_jobs.enqueue_durable_job(NULL, '{}');
SELECT durable_jobs.enqueue_durable_job('', '{}');
SELECT durable_jobs.enqueue_durable_job('k', NULL);
SELECT durable_jobs.enqueue_durable_job('k', '{}', '');
SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', 'infinity');
SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', now(), 0);
SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', now(), 3, 5000);
SELECT durable_jobs.enqueue_durable_job('k', '{"a": 1}', 'key');
SELECT durable_jobs.enqueue_durable_job('k', '{"a": 2}', 'key');
SELECT * FROM durable_jobs.claim_next_durable_job('w', ARRAY[]::text[]);
SELECT * FROM durable_jobs.claim_next_durable_job('w', NULL, 0);
SELECT durable_jobs.fail_durable_job(1, 'w', gen_random_uuid(), 'no_such_code');
SELECT durable_jobs.fail_durable_job(1, 'w', gen_random_uuid(), 'lease_expired');
SELECT durable_jobs.complete_durable_job(1, 'w', NULL);
SELECT durable_jobs.register_durable_job_handler('k', 'pg_catalog.now()');
SELECT durable_jobs.set_durable_job_queue_concurrency('default', 0);
SELECT durable_jobs.prune_durable_jobs(NULL);
SELECT durable_jobs.prune_durable_jobs(interval '-1 day');
SELECT durable_jobs.prune_durable_jobs(interval '1 day', 0);
SET durable_jobs.lease_duration = 0;
-- Nothing above changed the one job that was enqueued.
SELECT job_id, job_state, payload FROM durable_jobs.durable_job;
