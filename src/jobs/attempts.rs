//! The attempt history: what the lease statements write about each attempt, and the error text
//! they keep. An attempt that ends otherwise than in success gets a row of
//! `durable_job_attempt` in the statement that ends it: a failure (`FAIL`), a lapsed lease
//! taken over by a claim or expired on the last attempt, a cancel while it runs. A running or
//! succeeded attempt is the job's latest and lives on the job row (`attempt_started_at`,
//! `attempt_worker_id`, set by the claim), so a job that succeeds writes nothing more than
//! before. `api::attempts` reads both.

use crate::pg::settings;

/// The longest error message an attempt keeps, in characters; a longer one is cut there.
pub const ERROR_MESSAGE_LIMIT: usize = 2000;

/// The SQL fragments `jobs::statements` assembles its statements from on a schema with the
/// attempt history (0.6.0 on), by the part of the statement they go in. Each statement that
/// can end an attempt records it in a CTE of its own.
#[macro_export]
macro_rules! attempt_history {
    // The claim's candidates: what their current attempt was (a lapsed lease is taken over).
    (was) => {
        ", attempt_count AS was_attempt, attempt_worker_id AS was_worker, \
         attempt_started_at AS was_started, lease_expires_at AS was_expiry"
    };
    // The claim's SET: the attempt it starts.
    (started) => {
        "attempt_started_at = pg_catalog.clock_timestamp(), attempt_worker_id = $2, "
    };
    // After the claim: the attempts whose lapsed leases it took over ended then.
    (reclaimed) => {
        concat!(
            ",
                reclaimed AS (
                    INSERT INTO durable_jobs.durable_job_attempt
                        (job_id, attempt, worker_id, started_at, ended_at, outcome)
                    SELECT c.job_id, c.was_attempt, c.was_worker, c.was_started, c.was_expiry, 'lease_expired'
                    FROM candidate c WHERE c.was_state = 'running'",
            crate::over_an_older_attempt!(),
            ")"
        )
    };
    (expired_returning) => {
        ", x.attempt_count, x.attempt_worker_id, x.attempt_started_at"
    };
    // The last attempts whose leases lapsed: they ended when their leases did.
    (expired) => {
        concat!(
            ",
                expired_attempts AS (
                    INSERT INTO durable_jobs.durable_job_attempt
                        (job_id, attempt, worker_id, started_at, ended_at, outcome)
                    SELECT e.job_id, e.attempt_count, e.attempt_worker_id, e.attempt_started_at, e.was_expiry,
                           'lease_expired'
                    FROM expired e",
            crate::over_an_older_attempt!(),
            ")"
        )
    };
    (failed_returning) => {
        ", job_id, attempt_count, attempt_started_at, queue_name"
    };
    // What a completion returns for the histograms: the attempt's queue, its wait from run_after
    // to its claim and its run from the claim to now, in microseconds (NULL for an attempt
    // claimed before the update to 0.6.0).
    (observed) => {
        ", queue_name,
               (pg_catalog.date_part('epoch', attempt_started_at - run_after) * 1000000)::pg_catalog.int8,
               (pg_catalog.date_part('epoch', pg_catalog.clock_timestamp() - attempt_started_at) * 1000000)::pg_catalog.int8"
    };
    (failed_observed) => {
        ", f.queue_name,
           (pg_catalog.date_part('epoch', f.attempt_started_at - previous.run_after) * 1000000)::pg_catalog.int8,
           (pg_catalog.date_part('epoch', pg_catalog.clock_timestamp() - f.attempt_started_at) * 1000000)::pg_catalog.int8"
    };
    // FAIL's attempt: $2 the worker, $7 the failure code, $8 the SQLSTATE, $9 the message.
    (failed) => {
        concat!(
            ",
    failed_attempt AS (
        INSERT INTO durable_jobs.durable_job_attempt
            (job_id, attempt, worker_id, started_at, ended_at, outcome, failure_code, sqlstate, error_message)
        SELECT f.job_id, f.attempt_count, $2, f.attempt_started_at, pg_catalog.clock_timestamp(), 'failed',
               $7, $8, $9
        FROM failed f",
            crate::over_an_older_attempt!(),
            ")"
        )
    };
    (cancelled_returning) => {
        ", attempt_count, attempt_worker_id, attempt_started_at"
    };
    // CANCEL's: the attempt of a job that was running ($3 the state before).
    (cancelled) => {
        concat!(
            ",
    cancelled_attempt AS (
        INSERT INTO durable_jobs.durable_job_attempt
            (job_id, attempt, worker_id, started_at, ended_at, outcome)
        SELECT c.job_id, c.attempt_count, c.attempt_worker_id, c.attempt_started_at,
               pg_catalog.clock_timestamp(), 'cancelled'
        FROM cancelled c WHERE $3 = 'running'",
            crate::over_an_older_attempt!(),
            ")"
        )
    };
}

/// An attempt row written over one of the same number: left by a job whose id came again (the
/// job table truncated with RESTART IDENTITY by hand, the attempts kept), it must never fail
/// the statement that ends an attempt, a claim above all.
#[macro_export]
macro_rules! over_an_older_attempt {
    () => {
        "
            ON CONFLICT (job_id, attempt) DO UPDATE SET
                worker_id = EXCLUDED.worker_id, started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at,
                outcome = EXCLUDED.outcome, failure_code = EXCLUDED.failure_code, sqlstate = EXCLUDED.sqlstate,
                error_message = EXCLUDED.error_message"
    };
}

/// The same places on a schema before 0.6.0, which has no attempt history: nothing.
#[macro_export]
macro_rules! no_attempt_history {
    ($part:ident) => {
        ""
    };
}

/// The error message a failed attempt keeps: none while `durable_jobs.keep_error_messages` is
/// off, otherwise `message` cut to `ERROR_MESSAGE_LIMIT` characters.
pub fn kept_message(message: Option<&str>) -> Option<String> {
    if !settings::KEEP_ERROR_MESSAGES.get() {
        return None;
    }
    message.map(|message| match message.char_indices().nth(ERROR_MESSAGE_LIMIT) {
        Some((end, _)) => message[..end].to_string(),
        None => message.to_string(),
    })
}
