-- Queue controls and the operators' views.

-- One row per queue that has a control set; queues without a row are open.
CREATE TABLE durable_jobs.durable_job_queue (
    queue_name pg_catalog.text PRIMARY KEY,
    paused     pg_catalog.bool NOT NULL DEFAULT false,
    changed_by pg_catalog.name NOT NULL,
    changed_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now()
);

COMMENT ON TABLE durable_jobs.durable_job_queue IS
    'Queue controls. Write through pause_durable_job_queue / resume_durable_job_queue.';

-- Per queue and state: how many jobs, how long the oldest ready job has waited, and how many
-- running jobs hold an expired lease (their worker died or stalled).
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
       COALESCE((SELECT q.paused FROM durable_jobs.durable_job_queue q
                 WHERE q.queue_name = j.queue_name), false) AS queue_paused
FROM durable_jobs.durable_job j
GROUP BY j.queue_name, j.job_state;

-- Jobs that failed in the last hour, per queue and failure code.
CREATE VIEW durable_jobs.durable_job_recent_failures AS
SELECT j.queue_name, j.last_failure_code AS failure_code, pg_catalog.count(*) AS failed_last_hour
FROM durable_jobs.durable_job j
WHERE j.job_state = 'failed' AND j.finished_at > pg_catalog.clock_timestamp() - interval '1 hour'
GROUP BY j.queue_name, j.last_failure_code;
