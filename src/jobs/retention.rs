//! Retention: deleting finished jobs (their attempts go with them, by trigger), and audit rows of
//! the same age. The background workers do it on their own every second
//! (`durable_jobs.retention_period`); `api::retention`'s `prune_durable_jobs` does the same for a
//! caller.

use crate::pg::plans;
use crate::pg::privilege::Installed;
use pgrx::prelude::*;

// Oldest first, skipping rows somebody holds, so that pruning never waits on the queue. The
// cutoff uses now(), not clock_timestamp(): a stable bound can be an index condition, where a
// volatile one would filter the whole finished-jobs index on every round.
pub const DELETE_FINISHED: &str = "
    WITH expired AS (
        SELECT job_id FROM durable_jobs.durable_job
        WHERE finished_at < pg_catalog.now() - $1
        ORDER BY finished_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
    DELETE FROM durable_jobs.durable_job j USING expired WHERE j.job_id = expired.job_id
    RETURNING j.job_id";

// Audit rows age like the jobs they are about (schemas from 0.4.0 on).
pub const DELETE_OLD_AUDIT: &str = "
    WITH expired AS (
        SELECT audit_id FROM durable_jobs.durable_job_audit
        WHERE acted_at < pg_catalog.now() - $1
        ORDER BY acted_at
        LIMIT $2)
    DELETE FROM durable_jobs.durable_job_audit a USING expired WHERE a.audit_id = expired.audit_id";

// The places of keys that have no pending job (schemas from 0.6.0 on): made again by the key's
// next enqueue, or by the claim that finds them missing (`jobs::slots`). Skipping places a claim
// holds.
pub const DELETE_IDLE_KEY_PLACES: &str = "
    WITH idle AS (
        SELECT s.ctid AS place FROM durable_jobs.durable_job_key_slot s
        WHERE NOT EXISTS (SELECT FROM durable_jobs.durable_job j
                          WHERE j.queue_name = s.queue_name AND j.concurrency_key = s.concurrency_key
                            AND j.job_state IN ('available', 'running'))
        LIMIT $1
        FOR UPDATE OF s SKIP LOCKED)
    DELETE FROM durable_jobs.durable_job_key_slot s USING idle WHERE s.ctid = idle.place";

/// Deletes up to `limit` jobs finished more than `older_than` ago, up to `limit` audit rows as
/// old, and up to `limit` places of keys without pending jobs; returns how many jobs it deleted. The caller has pinned search_path and has the
/// privileges of the extension owner.
pub fn delete_finished_jobs(installed: Installed, older_than: Interval, limit: i64) -> i64 {
    Spi::connect_mut(|client| {
        let args = [older_than.into(), limit.into()];
        if installed.has_status_api {
            plans::execute(client, DELETE_OLD_AUDIT, &args);
        }
        if installed.has_attempt_history {
            plans::execute(client, DELETE_IDLE_KEY_PLACES, &[limit.into()]);
        }
        let deleted: Vec<i64> = plans::execute(client, DELETE_FINISHED, &args)
            .map(|row| row.get::<i64>(1).unwrap().expect("job_id"))
            .collect();
        // Their waiters learn at the commit that they are gone.
        crate::jobs::waiters::wake_waiters_at_commit(
            deleted.iter().copied(),
            crate::jobs::waiters::Change::Terminal,
        );
        deleted.len() as i64
    })
}
