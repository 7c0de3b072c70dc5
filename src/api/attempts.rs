//! get_durable_job_attempts: a job's attempts, oldest first, with the error each failed one
//! kept (`jobs::attempts` says what is written where). Visible as `get_durable_job` shows the
//! job: to the roles whose privileges the caller has.

use crate::api::status::sees_all_jobs;
use crate::jobs::arguments;
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner_of, caller};
use pgrx::prelude::*;

// The attempts that ended otherwise than in success, then the job's latest when it runs or
// succeeded (a lapsed lease ended it when it lapsed: no completion can pass the fence since).
const ATTEMPTS: &str = concat!(
    "
    SELECT a.attempt, a.worker_id, a.started_at, a.ended_at, a.outcome, a.failure_code, a.sqlstate,
           a.error_message
    FROM durable_jobs.durable_job j
    JOIN durable_jobs.durable_job_attempt a ON a.job_id = j.job_id
    WHERE j.job_id = $1 AND ",
    crate::visible_to_caller!(),
    "
    UNION ALL
    SELECT j.attempt_count, j.attempt_worker_id, j.attempt_started_at,
           CASE WHEN j.job_state = 'succeeded' THEN j.finished_at
                WHEN j.lease_expires_at <= now.t THEN j.lease_expires_at END,
           CASE WHEN j.job_state = 'succeeded' THEN 'succeeded'
                WHEN j.lease_expires_at <= now.t THEN 'lease_expired'
                ELSE 'running' END,
           NULL, NULL, NULL
    FROM durable_jobs.durable_job j, (SELECT pg_catalog.clock_timestamp() AS t) now
    WHERE j.job_id = $1 AND j.job_state IN ('running', 'succeeded') AND j.attempt_count > 0 AND ",
    crate::visible_to_caller!(),
    "
    ORDER BY 1"
);

type AttemptRow = (
    i32,
    Option<String>,
    Option<TimestampWithTimeZone>,
    Option<TimestampWithTimeZone>,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
);

#[pg_extern(volatile, parallel_unsafe, requires = ["status"])]
#[search_path(pg_catalog, pg_temp)]
fn get_durable_job_attempts(
    job_id: Option<i64>,
) -> TableIterator<
    'static,
    (
        name!(attempt, i32),
        name!(worker_id, Option<String>),
        name!(started_at, Option<TimestampWithTimeZone>),
        name!(ended_at, Option<TimestampWithTimeZone>),
        name!(outcome, String),
        name!(failure_code, Option<String>),
        name!(sqlstate, Option<String>),
        name!(error_message, Option<String>),
    ),
> {
    let job_id = arguments::required(job_id, "job_id");
    let caller = caller();
    let rows: Vec<AttemptRow> = as_extension_owner_of(|installed| {
        let sees_all = sees_all_jobs(&caller, installed.owner);
        Spi::connect_mut(|client| {
            plans::execute(client, ATTEMPTS, &[job_id.into(), sees_all.into(), caller.role_oid.into()])
                .map(|row| {
                    (
                        row.get(1).unwrap().expect("attempt"),
                        row.get(2).unwrap(),
                        row.get(3).unwrap(),
                        row.get(4).unwrap(),
                        row.get(5).unwrap().expect("outcome"),
                        row.get(6).unwrap(),
                        row.get(7).unwrap(),
                        row.get(8).unwrap(),
                    )
                })
                .collect()
        })
    });
    TableIterator::new(rows)
}
