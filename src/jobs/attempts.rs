//! The attempt history: what the lease statements write about each attempt, and the error text
//! they keep. An attempt that ends otherwise than in success gets a row of
//! `durable_job_attempt`: a failure (`FAIL`) and a cancel while it runs (`CANCEL`) write it in
//! the statement that ends it; a lapsed lease, taken over by a claim or expired on the last
//! attempt, is returned by that statement and written by `record_lapsed_leases` after it, only
//! when there is one, so that a claim neither starts an insert nor locks the history table. A
//! running or succeeded attempt is the job's latest and lives on the job row
//! (`attempt_started_at`, `attempt_worker_id`, set by the claim), so a job that succeeds writes
//! nothing more than before. `api::attempts` reads both.

use crate::pg::plans;
use crate::pg::settings;
use pgrx::prelude::*;

/// The longest error message an attempt keeps, in characters; a longer one is cut there.
pub const ERROR_MESSAGE_LIMIT: usize = 2000;

/// The SQL fragments `jobs::statements` assembles its statements from on a schema with the
/// attempt history (0.6.0 on), by the part of the statement they go in: the failure and the
/// cancel record their attempt in a CTE of their own, the claim and the expiry return theirs.
#[macro_export]
macro_rules! attempt_history {
    // The claim's candidates: what their current attempt was (a lapsed lease is taken over).
    (was) => {
        ", attempt_count AS was_attempt, attempt_worker_id AS was_worker, \
         attempt_started_at AS was_started, lease_expires_at AS was_expiry"
    };
    // The claim's SET: the attempt it starts, at the time its rate limit's token was taken, if
    // it took one (`jobs::rates`; the claims with the history keep limits by place).
    (started) => {
        "attempt_started_at = COALESCE(numbered.token_at, pg_catalog.clock_timestamp()), attempt_worker_id = $2, "
    };
    // What the claim returns of the attempt before (a lapsed lease it took over ended then):
    // whether there was one, its number, worker, start and end, for `record_lapsed_leases`.
    (reclaimed_returning) => {
        ", numbered.was_state = 'running', numbered.was_attempt, numbered.was_worker, numbered.was_started,
                          numbered.was_expiry"
    };
    (expired_returning) => {
        ", x.attempt_count, x.attempt_worker_id, x.attempt_started_at"
    };
    // The same of the last attempts whose leases lapsed, which the expiry ended.
    (expired_selected) => {
        ", true, attempt_count, attempt_worker_id, attempt_started_at, was_expiry"
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
    // CANCEL's SET: a job this transaction leased at its enqueue ($5) loses the attempt no one
    // made.
    (cancelled_set) => {
        "attempt_count = CASE WHEN $5 THEN attempt_count - 1 ELSE attempt_count END,
                attempt_started_at = CASE WHEN $5 THEN NULL ELSE attempt_started_at END,
                attempt_worker_id = CASE WHEN $5 THEN NULL ELSE attempt_worker_id END, "
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

/// An attempt whose lease lapsed, as a claim or the expiry returned it.
pub struct LapsedLease {
    pub job_id: i64,
    pub attempt: i32,
    pub worker_id: Option<String>,
    pub started_at: Option<TimestampWithTimeZone>,
    pub lease_expired_at: TimestampWithTimeZone,
}

impl LapsedLease {
    /// The attempt before, from a claim's or the expiry's row whose columns from `first` on are
    /// `attempt_history!(reclaimed_returning)` or `(expired_selected)`; None when the claim took
    /// an available job.
    pub fn from_row(row: &pgrx::spi::SpiHeapTupleData, job_id: i64, first: usize) -> Option<LapsedLease> {
        if row.get::<bool>(first).ok()?? {
            Some(LapsedLease {
                job_id,
                attempt: row.get(first + 1).ok()??,
                worker_id: row.get(first + 2).ok()?,
                started_at: row.get(first + 3).ok()?,
                lease_expired_at: row.get(first + 4).ok()??,
            })
        } else {
            None
        }
    }
}

const RECORD_LAPSED_LEASES: &str = concat!(
    "
    INSERT INTO durable_jobs.durable_job_attempt (job_id, attempt, worker_id, started_at, ended_at, outcome)
    SELECT a.job_id, a.attempt, a.worker_id, a.started_at, a.ended_at, 'lease_expired'
    FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.int4[]),
                    pg_catalog.unnest($3::pg_catalog.text[]), pg_catalog.unnest($4::pg_catalog.timestamptz[]),
                    pg_catalog.unnest($5::pg_catalog.timestamptz[]))
         AS a(job_id, attempt, worker_id, started_at, ended_at)",
    crate::over_an_older_attempt!()
);

/// Writes the attempts whose lapsed leases a claim took over or the expiry ended, in the
/// current transaction (theirs), as the extension owner. Nothing to do, and no statement, when
/// there are none.
pub fn record_lapsed_leases(client: &mut pgrx::spi::SpiClient, lapsed: Vec<LapsedLease>) {
    if lapsed.is_empty() {
        return;
    }
    let mut columns: (
        Vec<i64>,
        Vec<i32>,
        Vec<Option<String>>,
        Vec<Option<TimestampWithTimeZone>>,
        Vec<TimestampWithTimeZone>,
    ) = Default::default();
    for attempt in lapsed {
        columns.0.push(attempt.job_id);
        columns.1.push(attempt.attempt);
        columns.2.push(attempt.worker_id);
        columns.3.push(attempt.started_at);
        columns.4.push(attempt.lease_expired_at);
    }
    let args = [columns.0.into(), columns.1.into(), columns.2.into(), columns.3.into(), columns.4.into()];
    plans::execute(client, RECORD_LAPSED_LEASES, &args);
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
