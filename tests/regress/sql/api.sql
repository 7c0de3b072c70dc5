-- The common paths of the SQL API, as a client sees them.

-- Enqueue, with an idempotency key: the same key, kind and payload give the same job.
SELECT durable_jobs.enqueue_durable_job('send_email', '{"to": "a@example.com"}', 'welcome-1') AS job_id;
SELECT durable_jobs.enqueue_durable_job('send_email', '{"to":"a@example.com"}', 'welcome-1') AS same_job;
SELECT job_id, queue_name, job_kind, payload, job_state, priority, attempt_count, max_attempts
FROM durable_jobs.durable_job;

-- Claim, complete: the payload is cleared.
SELECT job_id, job_kind, payload, attempt_count, max_attempts
FROM durable_jobs.claim_next_durable_job('worker-1') \gset
SELECT :job_id AS claimed, :'job_kind' AS kind, :'payload' AS payload;
SELECT lease_token FROM durable_jobs.durable_job WHERE job_id = :job_id \gset
SELECT durable_jobs.complete_durable_job(:job_id, 'someone-else', :'lease_token') AS other_worker;
SELECT durable_jobs.complete_durable_job(:job_id, 'worker-1', :'lease_token') AS holder;
SELECT durable_jobs.complete_durable_job(:job_id, 'worker-1', :'lease_token') AS again;
SELECT job_state, payload, lease_token IS NULL AS lease_cleared, finished_at IS NOT NULL AS finished
FROM durable_jobs.durable_job WHERE job_id = :job_id;

-- Still recognised after it finished.
SELECT durable_jobs.enqueue_durable_job('send_email', '{"to": "a@example.com"}', 'welcome-1') AS finished_job;

-- A transient failure is retried later; a terminal one ends the job.
SELECT durable_jobs.enqueue_durable_job('flaky', '{"n": 1}', NULL, 'default', now(), 2) AS job_id \gset
SELECT job_id, lease_token FROM durable_jobs.claim_next_durable_job('worker-1') \gset
SELECT durable_jobs.extend_durable_job_lease(:job_id, 'worker-1', :'lease_token', 120) > now() AS extended;
SELECT durable_jobs.fail_durable_job(:job_id, 'worker-1', :'lease_token', 'target_unavailable') AS outcome;
SELECT job_state, last_failure_code, attempt_count, run_after > now() AS backed_off, payload
FROM durable_jobs.durable_job WHERE job_id = :job_id;
SELECT count(*) AS claimable_now FROM durable_jobs.claim_next_durable_job('worker-1');

SELECT durable_jobs.enqueue_durable_job('bad', '{}') AS job_id \gset
SELECT job_id, lease_token FROM durable_jobs.claim_next_durable_job('worker-1') \gset
SELECT durable_jobs.fail_durable_job(:job_id, 'worker-1', :'lease_token', 'invalid_request') AS outcome;
SELECT job_state, last_failure_code, payload FROM durable_jobs.durable_job WHERE job_id = :job_id;

-- Cancel: an available job, then nothing left to cancel.
SELECT durable_jobs.enqueue_durable_job('later', '{}', NULL, 'default', now() + interval '1 day') AS job_id \gset
SELECT durable_jobs.cancel_durable_job(:job_id) AS cancelled;
SELECT durable_jobs.cancel_durable_job(:job_id) AS cancelled_again;

-- Batch enqueue returns the ids in the order of the payloads.
SELECT * FROM durable_jobs.enqueue_durable_jobs('etl.step', ARRAY['{"step": 1}', '{"step": 2}']::jsonb[]);
SELECT job_id, payload FROM durable_jobs.durable_job WHERE job_kind = 'etl.step' ORDER BY job_id;

-- Queue controls and what operators see.
SELECT durable_jobs.pause_durable_job_queue('default') AS paused;
SELECT count(*) AS claimed_from_paused FROM durable_jobs.claim_next_durable_job('worker-1');
SELECT durable_jobs.resume_durable_job_queue('default') AS resumed;
SELECT durable_jobs.set_durable_job_queue_concurrency('default', 4);
SELECT queue_name, job_state, job_count, expired_leases, queue_paused, concurrency_limit
FROM durable_jobs.durable_job_queue_summary ORDER BY 1, 2;
SELECT * FROM durable_jobs.durable_job_recent_failures ORDER BY 1, 2;
SELECT metric_name, metric_value FROM durable_jobs.durable_job_metrics()
WHERE metric_name LIKE 'jobs_%';

-- Pruning deletes finished jobs only, and says how many.
SELECT durable_jobs.prune_durable_jobs(interval '0') AS pruned;
SELECT job_state, count(*) FROM durable_jobs.durable_job GROUP BY 1 ORDER BY 1;
