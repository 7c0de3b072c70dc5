//! prune_durable_jobs: deleting finished jobs from a scheduler, for a deployment that runs only
//! external workers (the background workers prune on their own: `jobs::retention`).

use crate::jobs::arguments;
use crate::jobs::retention::delete_finished_jobs;
use crate::pg::privilege::as_extension_owner_of;
use pgrx::prelude::*;

/// Most jobs one call of `prune_durable_jobs` may delete, so that one call stays one short
/// transaction; a caller with more to delete calls again.
pub const PRUNE_MAX_JOBS_LIMIT: i32 = 100_000;

/// Deletes up to `max_jobs` jobs (succeeded, failed or cancelled) that finished more than
/// `older_than` ago, oldest first; returns how many it deleted.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn prune_durable_jobs(older_than: Option<Interval>, max_jobs: default!(Option<i32>, 10000)) -> i64 {
    let older_than = arguments::required(older_than, "older_than");
    // As PostgreSQL compares intervals (a month as 30 days): '1 day -1 hour' is positive.
    if older_than.as_micros() < 0 {
        arguments::invalid("older_than must not be negative");
    }
    let max_jobs = arguments::required(max_jobs, "max_jobs");
    if !(1..=PRUNE_MAX_JOBS_LIMIT).contains(&max_jobs) {
        arguments::invalid(&format!("max_jobs must be between 1 and {PRUNE_MAX_JOBS_LIMIT}"));
    }
    as_extension_owner_of(|installed| delete_finished_jobs(installed, older_than, i64::from(max_jobs)))
}
